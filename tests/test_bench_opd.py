"""``adaflash bench opd`` and the evaluation it runs (``adaflash_hf.online.evaluate``): evaluation prompts never served,
the full-draft acceptance read back from an engine's rounds (rechecked against its verification), its intervals, and
the whole experiment end to end on a tiny target."""

import json
import os

import pytest
import torch
import yaml
from tokenizers import Regex, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split
from transformers import PreTrainedTokenizerFast

from adaflash_hf.bench import opd
from adaflash_hf.online import evaluate
from adaflash_hf.online.buffer import ReplayBuffer, Trajectory
from adaflash_hf.online.loop import TrafficSource
from adaflash_hf.serving import AdaFlashEngine
from tests.conftest import greedy_reference, make_batched_oracle, random_prompts, tiny_tokenizer


def test_leading_matches_counts_proposals_equal_to_the_sequence_in_a_row():
    sequence = [5, 6, 7, 8, 9]
    assert evaluate.leading_matches([7, 8, 0], sequence, anchor=1) == 2
    assert evaluate.leading_matches([0, 8], sequence, anchor=1) == 0
    assert (
        evaluate.leading_matches([8, 9, 10], sequence, anchor=2) == 2
    )  # the sequence ends: nothing beyond it counts


def char_tokenizer():
    """One token per printable character: distinct prompts stay distinct after tokenisation."""
    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def test_eval_prompts_are_never_served_by_the_traffic():
    tokenizer = char_tokenizer()
    config = {"seed": 0, "max_prompt_tokens": 4096, "prompts_per_domain": 300, "domains": ["chat"]}
    prompts = evaluate.eval_prompts(tokenizer, config, per_domain=16)
    assert {d: len(p) for d, p in prompts.items()} == {"chat": 16, "code": 16, "math": 16}
    traffic = TrafficSource.from_domains(tokenizer, ["chat"], 300, seed=0, max_prompt_tokens=4096)
    served = {tuple(p) for p in traffic.phases[0][1]}
    assert len(served) > 290 and not served & {tuple(p) for p in prompts["chat"]}
    assert len({tuple(p) for p in prompts["chat"]}) == 16


def test_eval_prompts_refuse_to_overlap_a_small_traffic_domain():
    config = {"seed": 0, "max_prompt_tokens": 4096, "prompts_per_domain": 161, "domains": ["code"]}
    with pytest.raises(
        ValueError, match=r"--eval-prompts-per-domain: expected at most 3 for traffic domain code"
    ):
        evaluate.eval_prompts(tiny_tokenizer(), config, per_domain=8)


def test_an_evaluation_prompt_with_the_token_ids_of_a_served_one_is_refused():
    # Cut to their last token, distinct texts share their ids: the evaluation would measure served prompts.
    config = {"seed": 0, "max_prompt_tokens": 1, "prompts_per_domain": 300, "domains": ["chat"]}
    with pytest.raises(
        ValueError,
        match=r"evaluation prompts: expected none that the traffic serves, got evaluation prompt chat\[\d+\] with "
        r"the token ids of served prompt chat\[\d+\]",
    ):
        evaluate.eval_prompts(char_tokenizer(), config, per_domain=16)


def test_an_evaluation_prompt_with_the_text_of_a_served_one_is_refused():
    served = {"chat": [("hello", [1]), ("def f(): pass", [2])]}
    with pytest.raises(
        ValueError, match=r"got evaluation prompt code\[1\] with the text of served prompt chat\[1\]: 'def f"
    ):
        evaluate.check_unserved({"code": ["x", "def f(): pass"]}, {"code": [[3], [4]]}, served)
    evaluate.check_unserved({"code": ["x"]}, {"code": [[3]]}, served)  # disjoint: accepted


def test_a_new_traffic_domain_is_evaluated_too_on_prompts_its_phase_never_served():
    tokenizer = char_tokenizer()
    config = {
        "seed": 0, "max_prompt_tokens": 4096, "prompts_per_domain": 300, "domains": ["math", "translate"],
        "phase_prompts": [4, 360],
    }  # fmt: skip
    prompts = evaluate.eval_prompts(tokenizer, config, per_domain=8)
    assert list(prompts) == ["chat", "code", "math", "translate"]
    traffic = TrafficSource.from_domains(
        tokenizer, ["math", "translate"], 300, max_prompt_tokens=4096, phase_prompts=[4, 360]
    )
    served = {tuple(p) for _, ps in traffic.phases for p in ps}
    assert len(served) == 364 and not served & {tuple(p) for ps in prompts.values() for p in ps}
    with pytest.raises(
        ValueError, match=r"expected at most \d+ for traffic domain translate \(\d+ held-out prompts, 380"
    ):
        evaluate.eval_prompts(tokenizer, {**config, "phase_prompts": [4, 380]}, per_domain=8)


def test_each_replay_fraction_is_a_run_and_the_frozen_head_arm_freezes_the_head(tmp_path):
    args = opd.make_parser().parse_args(
        [
            "--variants",
            "adaflash",
            "head_frozen",
            "replay",
            "--replay-fraction",
            "0.25",
            "0.5",
            "--replay-domains",
            "math",
        ]
    )
    runs = opd.run_flags(args)
    assert list(runs) == ["adaflash", "head_frozen", "replay-0.25", "replay-0.5"]
    assert runs["replay-0.5"] == ["--replay_fraction", "0.5", "--replay_domains", "math"]
    config = opd.ROOT / "examples" / "configs" / "opd_tiny.yaml"
    assert opd.run_settings(config, runs["head_frozen"])["freeze_length_head"] is True
    assert opd.run_settings(config, runs["adaflash"])["freeze_length_head"] is False


def test_a_replay_mix_never_replays_an_evaluation_prompt():
    tokenizer = char_tokenizer()
    config = {
        "seed": 0,
        "max_prompt_tokens": 4096,
        "prompts_per_domain": 16,
        "domains": ["chat", "math", "code"],
    }
    evaluation = {
        tuple(p) for ps in evaluate.eval_prompts(tokenizer, config, per_domain=8).values() for p in ps
    }
    traffic = TrafficSource.from_domains(tokenizer, config["domains"], 16, seed=0, max_prompt_tokens=4096)
    buffer = ReplayBuffer(train_threshold=8, replay_fraction=0.5, replay_domains=["chat", "math"])
    replayed = []
    for domain, prompt in (next(traffic) for _ in range(48)):
        buffer.add(Trajectory(prompt, [1, 2], [len(prompt) - 1], [1], [0], drafter_version=0, domain=domain))
        batch = buffer.take(0, timeout=0)
        replayed += batch[4:] if batch else []
    served = {tuple(p) for domain, ps in traffic.phases if domain != "code" for p in ps}
    assert len(replayed) == 4 * 12  # 12 buffers of 4 fresh and 4 replayed samples
    assert {tuple(t.prompt) for t in replayed} <= served and not {
        tuple(t.prompt) for t in replayed
    } & evaluation


def test_the_bench_reads_the_traffic_settings_as_the_script_does_defaults_included(tmp_path):
    config = yaml.safe_load((opd.ROOT / "examples" / "configs" / "opd_tiny.yaml").read_text())
    del config["seed"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    settings = opd.run_settings(tmp_path / "config.yaml", [])
    assert settings["seed"] == 42  # TrainingArguments' default, which the traffic's shuffle then uses
    assert settings["domains"] == ["math", "code"] and settings["max_prompt_tokens"] == 24


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (opd.ROOT / "examples" / "configs").glob("opd_*.yaml"))
)
def test_shipped_opd_configs_parse_with_their_replay_settings(name):
    settings = opd.run_settings(opd.ROOT / "examples" / "configs" / name, [])
    assert settings["replay_fraction"] == 0.0  # a replay variant sets its own
    assert set(settings["replay_domains"]) < set(settings["domains"]) or settings["replay_domains"] == []


def _bench_config(tmp_path, **updates):
    config = yaml.safe_load((opd.ROOT / "examples" / "configs" / "opd_tiny.yaml").read_text())
    config.update(target_model=str(tmp_path / "target"), drafter_init=str(tmp_path / "drafter"), **updates)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return ["--config", str(tmp_path / "config.yaml"), "--output-dir", str(tmp_path / "out")]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--replay-fraction", "1.5", "--replay-domains", "math"],
            r"replay_fraction: expected a value in \[0, 1\)",
        ),
        (["--replay-fraction", "0.5"], r"replay_domains: expected the domains to replay .* got \[\]"),
        (["--replay-domains", "chat"], r"replay_domains: expected domains of the traffic \['math', 'code'\]"),
        (
            ["--replay-domains", "math", "code"],
            r"replay_domains: expected the other domains than the new one",
        ),
    ],
)
def test_bad_replay_settings_of_the_replay_variant_fail_before_any_run(tmp_path, monkeypatch, flags, message):
    launched = []
    monkeypatch.setattr(opd.subprocess, "run", lambda *a, **k: launched.append(a))
    monkeypatch.setattr("adaflash_hf.assets.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match=message):
        opd.main([*_bench_config(tmp_path), "--variants", "adaflash", "replay", *flags])
    assert launched == []


@pytest.mark.parametrize("flag", ["--eval-prompts-per-domain", "--eval-max-new-tokens", "--threads"])
def test_a_count_below_one_is_a_usage_error(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        opd.main([*_bench_config(tmp_path), flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: expected an int >= 1, got 0" in capsys.readouterr().err


def test_more_evaluation_prompts_than_a_held_out_set_holds_are_refused_before_the_target_loads(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("adaflash_hf.assets.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match=r"--eval-prompts-per-domain: expected 1\.\.\d+ for \w+, got 100000"):
        opd.main([*_bench_config(tmp_path), "--eval-prompts-per-domain", "100000"])


def test_the_bench_refuses_an_evaluation_set_that_overlaps_the_traffic_before_any_run(
    target_factory, drafter_factory, tmp_path, monkeypatch
):
    target = target_factory("llama")
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    drafter_factory(target, mask_token_id=3).save_pretrained(tmp_path / "drafter")
    launched = []
    monkeypatch.setattr(opd.subprocess, "run", lambda *a, **k: launched.append(a))
    argv = _bench_config(tmp_path, domains=["chat"], prompts_per_domain=300, max_prompt_tokens=1)
    with pytest.raises(ValueError, match=r"evaluation prompts: expected none that the traffic serves"):
        opd.main([*argv, "--eval-prompts-per-domain", "16", "--variants", "none", "adaflash"])
    assert launched == []


def oracle_engine(target, drafter, mode):
    """An engine whose oracle drafter is right for a random 0..15 proposals per round, and its prompts."""
    prompts = {
        "a": [p.tolist() for p in random_prompts(3, seed=3)],
        "b": [p.tolist() for p in random_prompts(2, 4)],
    }
    expected = {d: [greedy_reference(target, torch.tensor(p), 40) for p in ps] for d, ps in prompts.items()}
    oracle, weight = make_batched_oracle(target, drafter)
    # The adaptive rule explicitly, as the OPD bench serves: the greedy default ("auto") drafts by goodput, whose
    # rounds follow this machine's timings, and so would the oracle's random draws and the statistics below.
    length_mode = "adaptive" if mode == "adaflash" else "fixed"
    engine = AdaFlashEngine(target, oracle, length_mode=length_mode)
    references = {}
    oracle.arm(engine, references, weight, seed=0)
    add_request = engine.add_request

    def add_with_reference(prompt, params):  # the oracle needs each request's greedy continuation
        request_id = add_request(prompt, params)
        domain, index = next((d, ps.index(prompt)) for d, ps in prompts.items() if prompt in ps)
        references[request_id] = list(prompt) + expected[domain][index]
        return request_id

    engine.add_request = add_with_reference
    return engine, prompts, expected


@pytest.fixture(scope="module")
def oracle_eval(target_factory, drafter_factory):
    """A fixed-length (dflash) oracle engine: every proposal is verified."""
    target = target_factory("llama")
    return oracle_engine(target, drafter_factory(target), "dflash")


def test_full_draft_acceptance_of_an_oracle_drafter(oracle_eval):
    engine, prompts, expected = oracle_eval
    summary, outputs = evaluate.evaluate_drafter(engine, prompts, max_new_tokens=40)
    assert outputs == expected  # greedy serving is lossless
    for row in summary.values():
        curve = row["per_position"]
        assert len(curve) == 15 and row["full_rounds"] > 0
        assert all(a >= b for a, b in zip(curve, curve[1:]))  # reaching position j+1 needs position j
        assert row["tau_full"] == pytest.approx(1.0 + sum(curve))  # mean accepted length = Σ_j P(length >= j)
        assert curve[0] > 0.5 and curve[-1] < curve[0]  # right for a uniform 0..15 proposals per round
        assert row["mean_verify_length"] > 10  # fixed-length drafting verifies (nearly) whole blocks


def test_unverified_proposals_count_in_adaptive_mode(target_factory, drafter_factory):
    """With the length head truncating drafts, the full draft is still read: the engine records every block row."""
    target = target_factory("llama")
    engine, prompts, expected = oracle_engine(target, drafter_factory(target), "adaflash")
    engine.gamma = 0.9  # a strict threshold: short verified drafts
    summary, outputs = evaluate.evaluate_drafter(engine, prompts, max_new_tokens=40)
    assert outputs == expected
    assert engine.round_recorder is None and engine.record_full_drafts is False  # restored
    for row in summary.values():
        # Most proposals were never verified, yet the oracle's 8th proposal is right in about half of the rounds.
        assert row["mean_verify_length"] < 8 and row["per_position"][7] > 0.2
        assert row["tau_full"] > row["tau"]
        assert 0.0 <= row["head_error"] <= 1.0  # |â - a*| over the full rounds: the engine records â


def test_a_wrong_reading_of_the_rounds_is_caught(oracle_eval, monkeypatch):
    engine, prompts, _ = oracle_eval
    monkeypatch.setattr(evaluate, "leading_matches", lambda drafted, sequence, anchor: 0)
    with pytest.raises(RuntimeError, match=r"accepted \d+ drafts, but 0 leading proposals"):
        evaluate.evaluate_drafter(engine, prompts, max_new_tokens=40)


def _summary(tau, spread=0, flip=False):
    """A domain's evaluation summary whose pooled τ is ``tau``: 8 prompts of 100 verifies each, their accepted counts
    ``spread`` above and below the mean in turn (``flip``: in the other order)."""
    sign = lambda i: 1 if (i % 2 == 0) != flip else -1  # noqa: E731
    rows = [[round((tau - 1) * 100) + spread * sign(i), 100, 0, 0] for i in range(8)]
    return {"tau": tau, "per_prompt": rows}


def test_tau_intervals_hold_the_pooled_tau_and_need_prompts_of_one_count():
    low, high = evaluate.tau_interval(_summary(1.4, spread=20))
    assert low < 1.4 < high
    with pytest.raises(
        ValueError, match=r"paired: expected non-empty per-prompt lists of one length, got lengths"
    ):
        evaluate.bootstrap(evaluate.pooled_tau, [[1, 2, 0, 0]], [[1, 2, 0, 0]] * 2)


def test_launch_args_may_not_change_the_traffic(capsys):
    with pytest.raises(SystemExit, match=r"--launch-args: expected no traffic settings .* got --domains"):
        opd.main(["--launch-args=--domains=code --learning_rate 1e-4", "--output-dir", "/nonexistent"])


def test_experiment_end_to_end_on_a_tiny_target(target_factory, drafter_factory, tmp_path, monkeypatch):
    target = target_factory("llama")
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(
        tmp_path / "target"
    )  # distinct prompts keep distinct ids (they are checked)
    drafter_factory(target, mask_token_id=3).save_pretrained(tmp_path / "drafter")
    root = opd.ROOT
    config = yaml.safe_load((root / "examples" / "configs" / "opd_tiny.yaml").read_text())
    config.update(
        target_model=str(tmp_path / "target"),
        drafter_init=str(tmp_path / "drafter"),
        domains=["math"],
        max_prompt_tokens=96,  # the math templates share their last few characters
        max_rounds=2,
        serving_backpressure=True,
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    argv = ["--config", str(tmp_path / "config.yaml"), "--variants", "none", "adaflash"]
    argv += ["--eval-prompts-per-domain", "2", "--threads", "1", "--output-dir", str(out)]
    argv += ["--launch-args=--max_anchors_per_sample 8"]
    assert opd.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["evaluation"]) == {"none", "adaflash"}
    assert set(results["evaluation"]["adaflash"]) == {
        "0",
        "1",
        "2",
    }  # round 0 and a checkpoint after each round
    assert [row["round"] for row in results["live"]["adaflash"]] == [1, 2]
    assert [row["version"] for row in results["live"]["none"]] == [0, 0]  # no updates: nothing published
    assert not (out / "none" / "weights" / "latest.json").exists()
    last = results["live"]["adaflash"][
        -1
    ]  # backpressure: nothing dropped, every served request is trained on
    assert last["buffer/added"] == last["buffer/taken"] + last["buffer/size"] and last["buffer/taken"] == 8
    assert results["settings"]["new_domain"] == "math" and "goals" not in results
    assert "--max_anchors_per_sample 8" in (out / "adaflash.log").read_text()  # the launcher's command line
    for name in ("table.md", "tau_vs_rounds.png", "acceptance_per_position.png", "head_error_vs_rounds.png"):
        assert (out / name).stat().st_size > 0
    # A second call reuses the finished runs and the cached evaluations: nothing is launched again.
    launched = []
    monkeypatch.setattr(opd.subprocess, "run", lambda *a, **k: launched.append(a))
    mtime = os.path.getmtime(out / "eval" / "adaflash-r2.json")
    assert opd.main(argv) == 0 and launched == []
    assert os.path.getmtime(out / "eval" / "adaflash-r2.json") == mtime
    # A cached evaluation of other weights (its digest differs from the checkpoint's) is recomputed.
    cached = json.loads((out / "eval" / "adaflash-r2.json").read_text())
    cached["settings"]["weights"] = "0" * 64
    (out / "eval" / "adaflash-r2.json").write_text(json.dumps(cached))
    assert opd.main(argv) == 0
    assert json.loads((out / "eval" / "adaflash-r2.json").read_text())["settings"]["weights"] != "0" * 64
