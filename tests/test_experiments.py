"""experiments/: the lab's configs parse, their pinned starts resolve from git history, the run scripts do what their
headers say, the goals grade a bench's results file, and nothing a user starts from (examples/, the library) reads
from experiments/."""

import ast
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from adaflash_hf import AdaFlashDrafter

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
ARMS = ("baseline", "init_from_target", "soft_targets", "higher_lr", "baseline_scratch")
TRAINING = ["continue_first_run", "long_run", "long_run_restart", *(f"sweep_{arm}" for arm in ARMS)]
LIBRARY = ("adaflash_hf", "trainers", "modeling", "kernels")


def _experiment(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOALS = _experiment("goals")


def _restore_module():
    return _experiment("restore_start")


def _training_config(name, monkeypatch):
    from adaflash_hf.trainers.train_drafter import make_parser

    monkeypatch.chdir(ROOT)
    (args,) = make_parser().parse_args_and_config(["--config", str(CONFIGS / f"{name}.yaml")])
    return args


def _history_available() -> bool:
    shallow = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    )
    return shallow.returncode == 0 and shallow.stdout.strip() == "false"


@pytest.mark.parametrize("name", TRAINING)
def test_every_experiment_training_config_parses_and_writes_under_runs(name, monkeypatch):
    args = _training_config(name, monkeypatch)
    assert args.output_dir.startswith("runs/") and args.learning_curve_dir is None
    assert args.drafter_init is None or args.drafter_init.startswith("runs/starts/")


@pytest.mark.parametrize("name", ["opd_mixed_traffic", "opd_new_domain"])
def test_every_experiment_opd_config_parses_with_its_replay_settings(name):
    from adaflash_hf.bench import opd

    settings = opd.run_settings(CONFIGS / f"{name}.yaml", [])
    assert settings["output_dir"].startswith("runs/") and settings["replay_fraction"] == 0.0
    assert set(settings["replay_domains"]) < set(settings["domains"]) or settings["replay_domains"] == []


def test_the_sweep_arms_differ_in_their_arm_only_and_see_equal_blocks(monkeypatch):
    arms = {arm: _training_config(f"sweep_{arm}", monkeypatch) for arm in ARMS}
    base = arms["baseline"]
    assert base.soft_target_weight == 0.0 and not base.init_from_target
    assert base.drafter_init == "runs/starts/sweep_start"  # pinned: shipping a new drafter moves no arm
    assert arms["soft_targets"].soft_target_weight > 0
    assert arms["init_from_target"].init_from_target and arms["init_from_target"].drafter_init is None
    assert arms["higher_lr"].learning_rate > base.learning_rate
    assert arms["baseline_scratch"].drafter_init is None and not arms["baseline_scratch"].init_from_target
    for arm, args in arms.items():
        assert args.max_steps * args.per_device_train_batch_size * 215 / 2 == pytest.approx(150_000, rel=0.01)
        assert args.output_dir == f"runs/sweep/{arm}"
        assert args.heldout_corpus_dir == base.heldout_corpus_dir and args.corpus_dir == base.corpus_dir, arm
        assert args.seed == base.seed and args.draft_vocab_size == base.draft_vocab_size == 8192
        assert args.final_norm_init == base.final_norm_init and args.loss_positions == base.loss_positions


def test_the_sweep_runner_knows_every_arm_and_refuses_an_unknown_one():
    import re

    script = ROOT / "experiments" / "run_sweep.sh"
    default_arms = re.search(r"arms=\((baseline [^)]*)\)", script.read_text()).group(1).split()
    assert set(default_arms) == set(ARMS)
    assert "--resume_from_checkpoint last" in script.read_text()
    done = subprocess.run([str(script), "no_such_arm"], capture_output=True, text=True)
    assert done.returncode == 2 and "experiments/configs/sweep_no_such_arm.yaml" in done.stderr


def _run_long(*args, **env):
    script = ROOT / "experiments" / "run_long.sh"
    env = {**os.environ, "DRY_RUN": "1", **env}
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env)


def test_the_long_run_script_restores_its_start_and_resumes_with_last(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(f'output_dir: "{tmp_path / "run"}"   # quoted, with a comment\nmax_steps: 10\n')
    lines = _run_long(str(config)).stdout.splitlines()
    assert lines[0].split()[-2:] == ["--config", str(config)] and "restore_start.py" in lines[0]
    assert lines[-1].split()[-4:] == ["--config", str(config), "--resume_from_checkpoint", "last"]
    resumed = _run_long(str(config), RESUME_FROM=str(tmp_path / "kept")).stdout.splitlines()
    assert resumed[1].split()[-3:] == ["restore", str(tmp_path / "kept"), str(tmp_path / "run")]


def test_the_long_run_script_skips_a_finished_run_and_refuses_a_bad_config(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"")
    finished = _run_long(str(config))
    assert finished.returncode == 0 and "not rerun" in finished.stdout and "accelerate" not in finished.stdout
    missing = _run_long(str(tmp_path / "nothing.yaml"))
    assert missing.returncode == 2 and "expected a config file" in missing.stderr
    (tmp_path / "bare.yaml").write_text("max_steps: 10\n")
    assert "expected an output_dir line" in _run_long(str(tmp_path / "bare.yaml")).stderr


@pytest.mark.parametrize(
    "name, start, min_blocks",
    [("long_run", "long_run_start", 1_000_000), ("long_run_restart", "long_run_end", 400_000)],
)
def test_the_long_runs_start_from_a_pinned_drafter_with_a_curve_point_per_checkpoint(
    name, start, min_blocks, monkeypatch
):
    args = _training_config(name, monkeypatch)
    assert args.eval_strategy == "steps" and args.eval_steps == args.save_steps
    assert args.max_steps * args.per_device_train_batch_size * 215 / 2 > min_blocks  # ~215 blocks a sequence
    assert args.drafter_init == f"runs/starts/{start}" and args.corpus_features_dir is None


def test_every_config_names_a_known_pinned_start():
    restore = _restore_module()
    pinned = {restore.pinned_start_of(path) for path in CONFIGS.glob("*.yaml")} - {None}
    assert pinned == set(restore.STARTS)


@pytest.mark.skipif(not _history_available(), reason="needs a clone with history (a shallow one lacks it)")
def test_every_pinned_start_resolves_in_git_history():
    restore = _restore_module()
    for name, (path, _) in restore.STARTS.items():
        for file in restore.FILES:
            found = subprocess.run(
                ["git", "-C", str(ROOT), "cat-file", "-e", f"{restore.COMMIT}:{path}/{file}"]
            )
            assert found.returncode == 0, (name, file)


@pytest.mark.skipif(not _history_available(), reason="needs a clone with history (a shallow one lacks it)")
def test_a_restored_start_is_a_drafter_of_the_shipped_shape(tmp_path):
    folder = _restore_module().restore("sweep_start", tmp_path)
    drafter = AdaFlashDrafter.from_pretrained(folder)
    assert drafter.config.block_size == 16 and len(drafter.config.draft_token_ids) == 8192


def test_examples_hold_one_drafter_checkpoint_and_stay_under_15_mb():
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "*.safetensors"], capture_output=True, text=True
    ).stdout
    assert [p for p in tracked.split("\0") if p] == [
        "examples/drafters/smollm2-135m-adaflash/model.safetensors"
    ]
    size = sum(p.stat().st_size for p in (ROOT / "examples").rglob("*") if p.is_file())
    assert size < 15 * 2**20


def _string_constants(path: Path):
    """The string literals of a Python file that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def test_nothing_in_examples_or_the_library_reads_from_experiments():
    readers = [
        f"{path.relative_to(ROOT)}: {value!r}"
        for root in LIBRARY
        for path in sorted((ROOT / root).rglob("*.py"))
        for value in _string_constants(path)
        if value == "experiments" or "experiments/" in value
    ]
    for path in sorted((ROOT / "examples").rglob("*")):
        if path.suffix in (".yaml", ".sh"):
            code = [line.split("#")[0] for line in path.read_text(encoding="utf-8").splitlines()]
            readers += [f"{path.relative_to(ROOT)}: {line}" for line in code if "experiments" in line]
        elif path.suffix == ".py":
            readers += [
                f"{path.relative_to(ROOT)}: {v!r}" for v in _string_constants(path) if "experiments" in v
            ]
    assert not readers, readers


def test_the_overfit_check_computes_the_features_a_fresh_checkout_lacks(target_factory, tmp_path):
    spec = importlib.util.spec_from_file_location("overfit_check", ROOT / "experiments" / "overfit_check.py")
    overfit_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overfit_check)
    target = target_factory("llama")
    g = torch.Generator().manual_seed(0)
    records = [
        {
            "id": f"chat/{i}",
            "domain": "chat",
            "input_ids": torch.randint(4, 200, (40,), generator=g).tolist(),
            "prompt_length": 8,
        }
        for i in range(4)
    ]
    cli = overfit_check.make_parser().parse_args(
        [
            "--features-dir",
            str(tmp_path / "absent"),
            "--max-steps",
            "1",
            "--draft-vocab-size",
            "32",
            "--generate-prompts",
            "1",
            "--max-new-tokens",
            "4",
        ]
    )
    result = overfit_check.overfit(target, None, records, cli)
    assert result["blocks_seen"] > 0 and not (tmp_path / "absent").exists()
    for name in ("before", "after"):
        assert (
            0 <= result[name]["acceptance"]["first_position"] <= 1 and result[name]["generate_tau_fixed"] >= 1
        )


# ----------------------------------------------------------------------------------------------- goals
def _summary(tau, spread=0, flip=False):
    """A domain's evaluation summary whose pooled τ is ``tau``: 8 prompts of 100 verifies each, their accepted counts
    ``spread`` above and below the mean in turn (``flip``: in the other order)."""
    sign = lambda i: 1 if (i % 2 == 0) != flip else -1  # noqa: E731
    rows = [[round((tau - 1) * 100) + spread * sign(i), 100, 0, 0] for i in range(8)]
    return {"tau": tau, "per_prompt": rows}


def _evaluation(start, ada, ce):
    rows = lambda chat, code: {"chat": _summary(chat), "code": _summary(code)}  # noqa: E731
    return {
        "none": {0: rows(*start)},
        "adaflash": {0: rows(*start), **{r + 1: rows(*v) for r, v in enumerate(ada)}},
        "ce": {0: rows(*start), **{r + 1: rows(*v) for r, v in enumerate(ce)}},
    }


def test_the_opd_goals_are_met_by_a_gain_beyond_the_rivals():
    goals = GOALS.opd_goals(
        _evaluation((1.0, 1.2), [(1.1, 1.2), (1.3, 1.15)], [(1.1, 1.2), (1.2, 1.2)]), "chat"
    )
    ada = goals["adaflash"]
    assert goals["new_domain_is_weakest"] and ada["gain_25pct"] and ada["others_within_5pct"]
    assert ada["new_domain_gain"]["value"] == pytest.approx(0.3) and ada["best_round"] == 2
    assert (
        goals["adaflash_minus_ce"]["value"] == pytest.approx(0.1)
        and goals["adaflash_minus_ce"]["beyond_noise"]
    )


def test_the_opd_goals_are_not_met_by_a_small_gain_or_a_lost_domain():
    goals = GOALS.opd_goals(_evaluation((1.0, 1.2), [(1.2, 1.0)], [(1.3, 1.2)]), "chat")
    ada = goals["adaflash"]
    assert not ada["gain_25pct"] and not ada["others_within_5pct"]
    assert not goals["adaflash_minus_ce"]["beyond_noise"] and goals["adaflash_minus_ce"]["value"] < 0
    assert ada["other_domain_change"]["code"]["value"] == pytest.approx(-1 / 6)
    goals = GOALS.opd_goals(_evaluation((1.2, 1.0), [(1.6, 1.0)], [(1.3, 1.0)]), "chat")
    assert not goals["new_domain_is_weakest"]
    ce_only = {"ce": _evaluation((1.0, 1.2), [(1.1, 1.2)], [(1.3, 1.2)])["ce"]}
    assert set(GOALS.opd_goals(ce_only, "chat")) == {"new_domain", "new_domain_is_weakest", "ce"}


def test_a_difference_within_the_prompt_to_prompt_noise_is_not_beyond_it():
    # The same prompts, the two sides' per-prompt values moving in opposite directions: the paired interval is wide.
    noisy = GOALS.difference(_summary(1.32, spread=30), _summary(1.30, spread=30, flip=True))
    assert noisy["value"] == pytest.approx(0.02) and noisy["low"] < 0 < noisy["high"]
    # Moving together, the same mean difference is exact: pairing removes the prompts' own spread.
    paired = GOALS.difference(_summary(1.32, spread=30), _summary(1.30, spread=30))
    assert paired["low"] == pytest.approx(0.02) == paired["high"]


def test_the_replay_plot_draws_each_domains_change_against_the_replay_fraction(tmp_path):
    evaluation = _evaluation((1.0, 1.2), [(1.3, 1.1)], [(1.2, 1.2)])
    evaluation["replay-0.5"] = {
        0: evaluation["adaflash"][0],
        1: {"chat": _summary(1.25), "code": _summary(1.19)},
    }
    goals = GOALS.opd_goals(evaluation, "chat")
    GOALS.plot_replay(evaluation, goals, {"replay-0.5": 0.5}, tmp_path / "replay.png")
    assert (tmp_path / "replay.png").stat().st_size > 0
    del goals["replay-0.5"]  # a single arm (AdaFlash alone) has nothing to compare: no plot
    GOALS.plot_replay(evaluation, goals, {"replay-0.5": 0.5}, tmp_path / "alone.png")
    assert not (tmp_path / "alone.png").exists()


def _serve_row(concurrency, mode, tokens_per_s, plain):
    return {
        "concurrency": concurrency,
        "mode": mode,
        "tokens_per_s": tokens_per_s,
        "speedup_vs_plain": tokens_per_s / plain,
    }


def test_the_serving_goals_are_graded_on_the_levels_and_modes_a_run_has():
    rows = [
        _serve_row(c, m, tps, 10.0)
        for c in (1, 8)
        for m, tps in (("plain", 10.0), ("adaflash", 13.0), ("dflash", 10.0))
    ]
    graded = GOALS.grade("serve", {"summary": rows})
    assert graded["verdicts"] == {
        "adaflash_at_least_plain_everywhere": True,
        "adaflash_1.2x_dflash_at_8_plus": True,
    }


def test_a_serving_run_slower_than_plain_fails_its_goal_and_the_grader_exits_1(tmp_path):
    rows = [_serve_row(1, "plain", 10.0, 10.0), _serve_row(1, "adaflash", 9.0, 10.0)]
    (tmp_path / "results.json").write_text(json.dumps({"summary": rows}))
    assert GOALS.main(["serve", str(tmp_path / "results.json")]) == 1


def test_the_opd_grader_reads_a_results_file_with_rounds_as_strings(tmp_path):
    evaluation = _evaluation((1.0, 1.2), [(1.1, 1.2), (1.3, 1.15)], [(1.1, 1.2), (1.2, 1.2)])
    record = {
        "settings": {"new_domain": "chat"},
        "evaluation": {v: {str(r): s for r, s in rounds.items()} for v, rounds in evaluation.items()},
    }
    (tmp_path / "results.json").write_text(json.dumps(record))
    assert GOALS.main(["opd", str(tmp_path / "results.json")]) == 0


def test_the_kernel_goals_compare_the_fused_loss_with_the_naive_one_at_the_largest_vocabulary():
    loss = [
        {"vocab": 151936, "variant": "naive", "memory_vs_naive": 1.0, "speedup_vs_naive": 1.0},
        {"vocab": 151936, "variant": "fallback", "memory_vs_naive": 0.2, "speedup_vs_naive": 0.9},
        {"vocab": 151936, "variant": "triton", "memory_vs_naive": 0.1, "speedup_vs_naive": 2.5},
    ]
    assert GOALS.kernels_goals({"device": "cuda", "loss": loss}) == {
        "fused_peak_at_most_quarter_of_naive": True,
        "fused_2x_faster_than_naive_on_gpu": True,
    }
    assert GOALS.kernels_goals({"device": "cpu", "loss": loss[:2]}) == {
        "fused_peak_at_most_quarter_of_naive": True
    }
