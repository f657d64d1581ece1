"""The vLLM plugin: its decisions and bookkeeping (no vLLM needed), ``adaflash serve --engine vllm``'s checks before
vLLM starts, and, with vLLM's CPU build in ``.venv-vllm`` (``make vllm-env``), the plugin inside vLLM on the real
offline target in fp32: greedy texts equal vLLM's plain decoding at one request and sixteen in flight, different
draft lengths in one step, a reload mid-traffic, a corrupt version refused, trajectories recorded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adaflash_hf.online.buffer import ReplayBuffer, Trajectory
from adaflash_hf.vllm.launch import RecordReader, find_vllm_python, usage_error, vllm_command
from adaflash_hf.vllm.rounds import (
    DrafterGate,
    Proposal,
    RoundBook,
    Row,
    Settings,
    StepCost,
    StepStats,
    choose_lengths,
)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ decisions
def test_settings_errors_name_the_variable_the_expected_and_the_actual_value():
    with pytest.raises(ValueError, match=r"ADAFLASH_VLLM_POLICY: expected one of .*got 'fast'"):
        Settings.from_env({"ADAFLASH_VLLM_POLICY": "fast"})
    with pytest.raises(ValueError, match=r"ADAFLASH_VLLM_GAMMA: expected float, got 'x'"):
        Settings.from_env({"ADAFLASH_VLLM_GAMMA": "x"})
    with pytest.raises(ValueError, match=r"ADAFLASH_VLLM_GAMMA: expected a finite number > 0, got -1.0"):
        Settings.from_env({"ADAFLASH_VLLM_GAMMA": "-1"})
    settings = Settings(policy="goodput", gamma=0.8, weights_dir="/w", poll_seconds=0.0)
    assert Settings.from_env(settings.environ()) == settings


def test_the_cost_line_fits_the_steps_it_sees_and_waits_for_two_sizes():
    cost = StepCost(forget=1.0)
    for _ in range(10):
        cost.observe(16, 0.04 + 0.003 * 16)
    assert not cost.ready  # one size: no slope yet
    for n in (32, 64, 128):
        cost.observe(n, 0.04 + 0.003 * n)
    intercept, slope = cost.line()
    assert (
        cost.ready and intercept == pytest.approx(0.04, rel=1e-6) and slope == pytest.approx(0.003, rel=1e-6)
    )


def test_the_adaptive_lengths_are_the_papers_rule_and_fixed_drafts_the_whole_block():
    acceptance = torch.tensor([0.0, 0.1, 0.5, 0.99, 1.0, float("nan")])
    lengths = choose_lengths(Settings(), 15, acceptance, gamma=0.9, min_len=1)
    assert lengths == [
        max(1, min(15, math.floor(0.9 * a * 15))) if a == a else 1 for a in acceptance.tolist()
    ]
    assert choose_lengths(Settings(policy="fixed"), 15, acceptance, gamma=0.9, min_len=1) == [15] * 6


def _line(intercept: float, slope: float) -> StepCost:
    cost = StepCost(forget=1.0, min_steps=2)
    for n in (1, 100):
        cost.observe(n, intercept + slope * n)
    return cost


def test_goodput_drafts_nothing_where_verifying_costs_more_than_it_gains_and_more_where_it_pays():
    settings, acceptance = Settings(policy="goodput"), torch.full((4,), 0.5)
    confidences = [[0.9] * 15] * 4
    common = dict(gamma=1.0, min_len=1, confidences=confidences)
    dear = choose_lengths(settings, 15, acceptance, cost=_line(0.001, 0.05), **common)
    cheap = choose_lengths(settings, 15, acceptance, cost=_line(0.05, 0.0001), **common)
    assert dear == [0, 0, 0, 0]
    assert min(cheap) > 1
    # until its line is ready, goodput drafts the rule's lengths
    assert choose_lengths(settings, 15, acceptance, cost=StepCost(), **common) == [7] * 4


class _Steps:
    """Drives a ``DrafterGate`` as the proposer does, on a clock of its own: every step of ``batch`` requests costs
    ``plain`` or ``draft`` seconds per request, and every drafting step's rounds accept ``accepted`` drafts each,
    reported two proposals later (the round book reads a round's outcome one step after it was verified)."""

    def __init__(self, gate: DrafterGate, plain: float, draft: float, accepted: int):
        self.gate, self.plain, self.draft, self.accepted = gate, plain, draft, accepted
        self.now, self.pending = 0.0, [[], []]

    def run(self, batch: int, steps: int) -> list[bool]:
        ids = [f"r{i}" for i in range(batch)]
        decisions = []
        for _ in range(steps):
            self.gate.start(self.now, batch, ids)
            for accepted, size in self.pending.pop(0):
                self.gate.observe_round(accepted, size)
            drafting = self.gate.draft(batch)
            if drafting:
                self.gate.drafted([3] * batch)
            self.pending.append([(self.accepted, batch)] * batch if drafting else [])
            self.now += batch * (self.draft if drafting else self.plain)
            decisions.append(drafting)
        return decisions


def test_the_gate_measures_both_kinds_of_step_and_drafts_only_where_it_pays():
    gate = DrafterGate(explore_every=4, budget=0.5, trial_every=1)
    steps = _Steps(gate, plain=0.010, draft=0.030, accepted=1)  # 2 tokens for 3 steps' time: drafting loses
    decisions = steps.run(batch=16, steps=21)
    # plain steps until two are timed (the first interval follows the batch's arrival), then drafting until two
    # drafting steps are timed and their rounds are in
    assert decisions[:5] == [False, False, False, True, True]
    loss = gate.loss(16)
    assert loss == pytest.approx(3.0 - 2.0)  # a drafting step costs one plain step more than it saves
    # then it explores every max(explore_every, loss / budget) = 4 steps
    assert decisions[5:] == [False, False, False, True] * 4
    report = gate.report()["16"]
    assert report["plain_ms_per_request"] == pytest.approx(10.0)
    assert report["draft_ms_per_request"] == pytest.approx(30.0)
    assert report["accepted_per_request"] == pytest.approx(1.0)

    # a cheaper exploration budget spaces the drafting steps further: loss / budget = 1 / 0.1 = 10 steps
    spaced = _Steps(
        DrafterGate(explore_every=4, budget=0.1, trial_every=1), plain=0.010, draft=0.030, accepted=1
    )
    assert spaced.run(batch=16, steps=25)[5:] == ([False] * 9 + [True]) * 2
    # by default a drafting step tried where drafting loses waits at least trial_every = 64 steps, however cheap
    # its own interval says the trial is (it spreads the batch's finishing steps apart)
    rare = _Steps(DrafterGate(explore_every=4, budget=0.5), plain=0.010, draft=0.030, accepted=1)
    assert rare.run(batch=16, steps=5 + 3 * 64)[5:] == ([False] * 63 + [True]) * 3
    # while a plain step tried where drafting pays waits only max(explore_every, |loss| / budget) = 4 steps
    tried = _Steps(DrafterGate(explore_every=4, budget=0.5), plain=0.010, draft=0.012, accepted=2)
    plain = [i for i, drafting in enumerate(tried.run(batch=16, steps=40)) if not drafting and i >= 8]
    assert len(plain) >= 7 and {b - a for a, b in zip(plain, plain[1:])} == {4}

    # where drafting pays it drafts every step
    paying = _Steps(DrafterGate(explore_every=4), plain=0.010, draft=0.020, accepted=3)
    assert paying.run(batch=4, steps=12)[3:] == [True] * 9


def test_the_gate_measures_plain_steps_again_where_drafting_pays_and_changes_its_mind_when_the_host_does():
    gate = DrafterGate(explore_every=4, budget=0.5, trial_every=1)
    # the host is slow while the class's first plain steps are timed: drafting seems to pay
    steps = _Steps(gate, plain=0.040, draft=0.025, accepted=1)
    steps.run(batch=16, steps=8)
    assert gate.loss(16) == pytest.approx(2.5 / 4 - 2.0)
    # the host recovers: plain steps cost 10 ms a request, and drafting (25 ms for 2 tokens) loses; the gate
    # times a plain step every max(explore_every, |loss| / budget) = 4 steps, and once most of its recent plain
    # steps are fast it stops drafting but every 4th step
    steps.plain = 0.010
    later = steps.run(batch=16, steps=40)
    assert later[:14] == [True, True, False] + [True, True, True, False] * 2 + [True, True, True]
    assert gate.loss(16) == pytest.approx(2.5 - 2.0)
    drafting = [i for i, draft in enumerate(later) if draft and i >= 20]
    assert len(drafting) == 5 and {b - a for a, b in zip(drafting, drafting[1:])} == {4}
    # the accepted count is the mean of the first rounds read, then an exponential average: a first round
    # that accepted nothing does not hold the gain down for the next twenty
    fresh = DrafterGate(gain_smoothing=0.05)
    fresh.observe_round(0, 4)
    for _ in range(7):
        fresh.observe_round(2, 4)
    assert fresh.arm(4).accepted == pytest.approx(14 / 8)
    # a class judged on a few rounds keeps drafting while one standard error of its gain would make it pay
    young = DrafterGate(budget=0.01, gain_smoothing=0.05)
    arm = young.arm(1)
    arm.plain_steps.extend([0.070, 0.070]), arm.draft_steps.extend([0.100, 0.100])
    arm.counts[:2], arm.share = [2, 2], 1.0
    for accepted in [0, 0, 0, 0, 0, 0, 0, 3]:  # a mean of 0.375: drafting loses by 0.054 plain steps
        young.observe_round(accepted, 1)
    assert young.loss(1) == pytest.approx(1 / 0.7 - 1.375) and young.loss(1) > 0
    assert young.draft(1)
    for _ in range(60):  # many more rounds, all 0: the error shrinks and the verdict is plain
        young.observe_round(0, 1)
    assert not young.draft(1)
    # a steady class whose rounds accept 0 most times and 7 now and then (a mean of 0.35, a spread of ~1.5): its
    # loss (0.15 plain steps) lies within the error of the ~40 rounds its average holds, so that error must not
    # stay its doubt: it drafts on the first rounds' doubt and stops once a few hundred rounds agree
    steady = DrafterGate(budget=0.01, gain_smoothing=0.05)
    arm = steady.arm(4)
    arm.plain_steps.extend([0.0354, 0.0354]), arm.draft_steps.extend([0.0534, 0.0534])
    arm.counts[:2], arm.share = [2, 2], 1.0

    def periods(count):
        for _ in range(count):
            for accepted in [0] * 11 + [7] + [0] * 8:
                steady.observe_round(accepted, 4)

    periods(2)
    assert (
        steady.loss(4) == pytest.approx(0.151, abs=0.002)
        and [steady.draft(4) for _ in range(3)] == [True] * 3
    )
    periods(18)
    assert steady.loss(4) == pytest.approx(0.147, abs=0.002)
    assert [steady.draft(4) for _ in range(14)] == [False] * 14  # then one every loss / budget = 15 steps
    # a few slow steps among the recent ones leave the verdict as it was (a median, not a mean)
    arm = gate.arm(16)
    arm.plain_steps.extend([0.5, 0.5])
    assert gate.loss(16) == pytest.approx(2.5 - 2.0)


def test_the_gate_carries_a_loss_to_larger_batches_and_a_gain_to_smaller_ones():
    losing = DrafterGate(explore_every=8, budget=1.0, trial_every=1)
    steps = _Steps(losing, plain=0.010, draft=0.030, accepted=1)
    steps.run(batch=4, steps=7)
    assert losing.loss(4) > 0
    # batch 32: no step of it measured yet; drafting lost at 4 already, so it drafts only every 2 x explore_every
    # steps until two drafting steps of its own are timed, then by its own loss
    decisions = steps.run(batch=32, steps=40)
    skipped = (
        1  # at batch 4: plain 3 times, drafting 3 times (8 rounds reported), then a step without the drafter
    )
    assert [i for i, drafting in enumerate(decisions) if drafting] == [
        15 - skipped,
        31 - skipped,
        39 - skipped,
    ]
    assert losing.loss(32) == pytest.approx(3.0 - 2.0)
    paying = DrafterGate()
    steps = _Steps(paying, plain=0.010, draft=0.012, accepted=2)
    steps.run(batch=16, steps=6)
    assert paying.loss(16) < 0
    assert steps.run(batch=2, steps=4) == [True] * 4  # paid at 16: drafts at 2 from its first step
    # a step that took a new request (a prefill inside the interval) is not measured
    fresh = DrafterGate()
    fresh.start(0.0, 2, ["a", "b"])
    fresh.start(5.0, 3, ["a", "b", "c"])  # c joined: its prefill is inside 0 -> 5
    fresh.start(5.1, 3, ["a", "b", "c"])  # the proposal at 5 wrote c's prompt into the drafter's context
    assert fresh.report() == {}
    fresh.start(5.3, 3, ["a", "b", "c"])
    assert fresh.arm(3).plain == pytest.approx(0.2 / 3) and fresh.arm(3) is fresh.arm(2)
    # the target's step ran more tokens than the proposal scheduled (one each and the drafts): a prompt's later
    # prefill chunk was in it, same requests or not, and neither that interval nor the next is timed
    chunked = DrafterGate()
    chunked.start(0.0, 2, ["a", "b"], tokens=300)
    chunked.drafted([2, 0])
    chunked.start(1.0, 2, ["a", "b"], tokens=4)  # 1 + 2 and 1 + 0: a verifying step
    chunked.start(1.1, 2, ["a", "b"], tokens=130)  # a's prompt went on in chunks
    chunked.start(1.2, 2, ["a", "b"], tokens=2)
    assert chunked.arm(2).counts[:2] == [0, 0]
    chunked.start(1.3, 2, ["a", "b"], tokens=2)
    chunked.drafted([3, 3])
    chunked.start(1.5, 1, ["b"], tokens=4)  # a finished: b's 1 + 3 tokens
    assert chunked.arm(2).counts[:2] == [1, 1] and chunked.arm(2).draft == pytest.approx(0.1)
    with pytest.raises(ValueError, match="budget: expected a fraction in"):
        DrafterGate(budget=0)
    with pytest.raises(ValueError, match="trial_every: expected an int >= 1, got 0"):
        DrafterGate(trial_every=0)


def _row(request_id: str, tokens: list[int], prompt_length: int) -> Row:
    return Row(request_id, len(tokens), prompt_length, lambda start, stop: tokens[start:stop])


def test_the_round_book_reads_acceptance_one_step_late_and_skips_prefill_chunks():
    prompt = [5, 6, 7, 8]
    tokens = list(prompt)
    book, alive = RoundBook(), {"a"}
    # vLLM drafts before it books the step's tokens: each row shows the length as of the previous step.
    schedule = [  # (tokens booked by the step before this reading, the length this step proposes)
        ([], 4),  # prefill chunk 1: proposes, but nothing is sampled
        ([], 4),  # prefill chunk 2 (last): samples token 10 -> proposal anchored at position 4
        ([10], 5),  # verifies the 4 drafts proposed above: 2 accepted + 1 -> 3 new tokens
        ([11, 12, 13], 2),  # verifies 5: all accepted + 1
        ([14, 15, 16, 17, 18, 19], 0),  # plain step (k = 0) after verifying 2: 0 accepted + 1
        ([20], 3),
        ([21], 3),
    ]
    resolved = []
    for booked, length in schedule:
        tokens += booked
        out = book.step([_row("a", tokens, len(prompt))], [Proposal(length, version=7)], alive.__contains__)
        resolved += [(p.length, accepted) for p, accepted in out]
    assert resolved == [(4, 2), (5, 5), (2, 0)]
    alive.clear()
    book.step([], [], alive.__contains__)
    (record,) = book.finished
    trajectory = Trajectory(**record)
    assert trajectory.prompt == prompt and trajectory.committed == tokens[4:]
    assert trajectory.anchors == [4, 7, 13] and trajectory.accepted == [2, 5, 0]
    assert trajectory.draft_lengths == [4, 5, 2] and trajectory.drafter_version == 7
    for anchor, accepted in zip(trajectory.anchors, trajectory.accepted):
        assert anchor < len(tokens) - 1 and accepted >= 0
    assert book.recent[-1]["rounds"] == 3


def test_a_request_out_of_the_batch_but_alive_keeps_its_rounds():
    tokens = [1, 2, 3]
    book = RoundBook()
    book.step([_row("a", tokens, 3)], [Proposal(4, 0)], lambda rid: True)
    book.step([], [], lambda rid: True)  # not scheduled this step (preempted or out of budget)
    assert "a" in book.requests and not book.finished


def test_step_stats_count_steps_whose_requests_got_different_lengths():
    stats = StepStats()
    stats.observe_step([1, 1, 1])
    stats.observe_step([0, 3, 1])
    stats.observe_round(3, 2)
    out = stats.as_dict()
    assert out["steps_with_distinct_lengths"] == 1 and out["example_lengths"] == [0, 3, 1]
    assert out["acceptance"] == pytest.approx(2 / 3) and out["tau"] == 3.0


def test_the_record_reader_feeds_complete_lines_only(tmp_path):
    buffer = ReplayBuffer(train_threshold=4)
    reader = RecordReader(tmp_path, buffer)
    record = {"prompt": [1, 2], "committed": [3, 4, 5], "anchors": [2], "draft_lengths": [3], "accepted": [1]}
    line = json.dumps(record | {"drafter_version": 0})
    path = tmp_path / "trajectories-1.jsonl"
    path.write_text(line + "\n" + line[:10])  # the second line is still being written
    assert reader.poll() == 1
    with open(path, "a") as handle:
        handle.write(line[10:] + "\n")
    assert reader.poll() == 1 and reader.poll() == 0 and reader.read == 2


# ------------------------------------------------------------------------------------------ the launcher
class _Options:
    def __init__(self, **values):
        defaults = dict(
            draft_source=None, max_waiting=None, default_max_tokens=None, learn=False, dtype="auto", host="127.0.0.1",
            max_running=16, token_budget=None, served_model_name=None, target="smollm2-135m-instruct",
            vllm_arg=None, length_mode=None, drafter=None,
        )  # fmt: skip
        self.__dict__.update(defaults | values)


def test_options_that_do_not_apply_to_vllm_are_refused_by_name():
    assert "--draft-source hybrid: expected no --draft-source with --engine vllm" in usage_error(
        _Options(draft_source="hybrid")
    )
    assert "--max-waiting 8" in usage_error(_Options(max_waiting=8))
    assert "--dtype bf16: expected auto or fp32 with --learn" in usage_error(
        _Options(learn=True, dtype="bf16")
    )
    assert "--learn: expected a drafter to train" in usage_error(_Options(learn=True, drafter="none"))
    assert "--dtype int4: expected one of auto, fp32, bf16 with --engine vllm" in usage_error(
        _Options(dtype="int4")
    )
    assert usage_error(_Options()) is None


def test_the_vllm_command_carries_the_drafter_the_dtype_and_the_plugin(tmp_path):
    command = vllm_command(
        _Options(learn=True, token_budget=512, vllm_arg=["--enforce-eager"]),
        Path("/py"),
        tmp_path / "t",
        tmp_path / "d",
        8123,
    )
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {
        "method": "dflash",
        "model": str(tmp_path / "d"),
        "num_speculative_tokens": 15,
        "disable_eagle_block_drop": True,  # a DFlash drafter's cached context is valid to the last block
    }
    assert command[command.index("--dtype") + 1] == "float32"  # auto: fp32, the exact one
    assert command[command.index("--max-num-batched-tokens") + 1] == "512"
    assert "--no-enable-prefix-caching" in command and command[-1] == "--enforce-eager"
    plain = vllm_command(_Options(), Path("/py"), tmp_path / "t", None, 8123)
    assert "--speculative-config" not in plain


def test_the_kv_cache_is_sized_for_the_server_not_a_share_of_all_memory(tmp_path):
    from adaflash_hf.vllm.launch import kv_cache_bytes

    folders = []
    for name, layers in (("target", 30), ("drafter", 1)):
        folder = tmp_path / name
        folder.mkdir()
        config = {"num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "hidden_size": 576, "head_dim": 64, "max_position_embeddings": 8192}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    per_token_fp32 = 2 * 31 * 3 * 64 * 4
    size = kv_cache_bytes(_Options(), folders, environ={}, total_memory=64 << 30)
    assert size == per_token_fp32 * 8192 * 16  # 16 requests at the whole context, target and drafter
    assert kv_cache_bytes(_Options(dtype="bf16"), folders, environ={}, total_memory=64 << 30) == size // 2
    assert kv_cache_bytes(_Options(), folders, environ={}, total_memory=4 << 30) == 2 << 30  # half the memory
    assert kv_cache_bytes(_Options(), folders, environ={"VLLM_CPU_KVCACHE_SPACE": "2"}) is None
    chosen = _Options(vllm_arg=["--gpu-memory-utilization=0.5"])
    assert kv_cache_bytes(chosen, folders, environ={}) is None
    command = vllm_command(_Options(), Path("/py"), folders[0], folders[1], 8123, kv_bytes=size)
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(size)
    assert "--kv-cache-memory-bytes" not in vllm_command(_Options(), Path("/py"), folders[0], None, 8123)


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--vllm-python: expected vLLM's Python \(`make vllm-env`"):
        find_vllm_python(str(tmp_path / "nowhere" / "python"))


def _adaflash(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "adaflash"
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_serve_refuses_bad_vllm_options_before_anything_starts(tmp_path):
    result = _adaflash("serve", "--engine", "vllm", "--draft-source", "hybrid", cwd=tmp_path)
    assert result.returncode == 2 and "expected no --draft-source with --engine vllm" in result.stderr
    result = _adaflash("serve", "--vllm-arg=--enforce-eager", cwd=tmp_path)
    assert result.returncode == 2 and "--vllm-arg: expected together with --engine vllm" in result.stderr
    result = _adaflash("serve", "--engine", "vllm", "--vllm-python", str(tmp_path / "py"), cwd=tmp_path)
    assert result.returncode != 0 and "--vllm-python: expected vLLM's Python" in result.stderr


def test_a_drafter_for_another_target_is_refused_before_vllm_starts(
    tmp_path, target_factory, drafter_factory
):
    from adaflash_hf.vllm.launch import prepare_folders

    target = target_factory("qwen3")
    target.save_pretrained(tmp_path / "other-target")
    drafter_factory(target).save_pretrained(tmp_path / "other-drafter")
    with pytest.raises(ValueError, match="target"):
        prepare_folders("smollm2-135m-instruct", str(tmp_path / "other-drafter"), tmp_path / "out")
    assert not (tmp_path / "out" / "drafter").exists()


# ------------------------------------------------------------------------------------------ inside vLLM
def _vllm_python() -> Path | None:
    """vLLM's Python where vLLM is installed in it (an install that failed half-way leaves a venv without it)."""
    try:
        python = find_vllm_python()
    except FileNotFoundError:
        return None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return python if subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0 else None


VLLM_PYTHON = _vllm_python()
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="vLLM's CPU build is not installed in .venv-vllm (make vllm-env; make test logs why to .venv-vllm.log)",
)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """The exported target and drafter, 16 held-out prompts, and the driver's three runs (plain, the plugin with
    the adaptive rule and reloads, goodput)."""
    from adaflash_hf.assets import load_target
    from adaflash_hf.bench.serve import heldout_prompts
    from adaflash_hf.interop import export_dflash
    from adaflash_hf.serving.server import DEFAULT_DRAFTER

    work = tmp_path_factory.mktemp("vllm")
    target, tokenizer = load_target()
    target.save_pretrained(work / "target")
    tokenizer.save_pretrained(work / "target")
    export_dflash(DEFAULT_DRAFTER, work / "drafter", target_config=target.config)
    prompts = [p.tolist() for p in heldout_prompts(tokenizer, 16, 96)]
    (work / "prompts.json").write_text(json.dumps(prompts))
    del target
    runs = {}
    for phase, policy in (
        ("plain", None),
        ("plugin", "adaptive"),
        ("goodput", "goodput"),
        ("cached", "adaptive"),
        ("context", "adaptive"),
        ("context-eager", "adaptive"),
    ):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "ADAFLASH_VLLM_POLL_SECONDS": "0"}
        if policy:
            env |= {"ADAFLASH_VLLM_POLICY": policy, "ADAFLASH_VLLM_RECORDS": str(work / f"records-{phase}")}
        if policy and phase in ("plugin", "goodput"):  # the others keep the shipped weights (none published)
            env |= {"ADAFLASH_VLLM_WEIGHTS": str(work / "weights")}
        result = subprocess.run(
            [str(VLLM_PYTHON), str(REPO / "tests" / "vllm_driver.py"), phase, str(work)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        runs[phase] = json.loads((work / f"{phase}.json").read_text())
    runs["work"] = work
    return runs


@pytest.mark.integration
@needs_vllm
@pytest.mark.parametrize("policy_run", ["plugin", "goodput"])
def test_greedy_texts_through_the_plugin_equal_vllm_plain_at_one_request_and_sixteen(vllm_runs, policy_run):
    plain, run = vllm_runs["plain"], vllm_runs[policy_run]
    assert run["batch"] == plain["batch"]  # 16 in flight
    assert run["alone"] == plain["alone"]  # one at a time
    assert all(len(tokens) > 0 for tokens in run["batch"])


@pytest.mark.integration
@needs_vllm
def test_a_resent_prompt_hits_the_prefix_cache_to_its_last_full_block_and_drafts_as_well(vllm_runs):
    plain, cached = vllm_runs["plain"], vllm_runs["cached"]
    assert cached["long_first"] == plain["long"] and cached["long_again"] == plain["long"]
    block = cached["block_size"]
    lengths = cached["lengths"]
    assert min(lengths) > 2 * block
    # every full block before the last prompt token: vLLM would drop the last one for a drafter fed the target's
    # states, had the plugin's configuration not kept it (a DFlash drafter's context there is valid)
    assert cached["cached_tokens"] == [(n - 1) // block * block for n in lengths]
    first, again = cached["rounds_first"], cached["rounds_again"]
    assert first["accepted"] > 0 and again["rounds"] > 0
    # the drafter reads the cached context: acceptance as good as when the whole prompt was computed
    assert again["accepted"] / again["rounds"] >= 0.8 * first["accepted"] / first["rounds"], (first, again)


@pytest.mark.integration
@needs_vllm
def test_the_context_of_steps_without_the_drafter_reaches_its_cache_as_if_written_at_once(vllm_runs):
    plain, kept, eager = vllm_runs["plain"], vllm_runs["context"], vllm_runs["context-eager"]
    assert kept["batch"] == plain["batch"] and eager["batch"] == plain["batch"]
    # the stash's cache slots are those vLLM's DFlash input kernel computes, at every drafting step
    assert kept["slot_checks"] > 10 and kept["slot_mismatches"] == 0
    # and, at every step the drafter sat out, the target's own slots for the step's tokens (one block table here)
    assert kept["stash_checks"] == kept["stats"]["steps_without_drafter"] and kept["stash_mismatches"] == 0
    assert kept["stats"]["steps_without_drafter"] > kept["slot_checks"]  # two steps in three sat out
    # deferred: several steps' states written at once; eager: every step's written in its own step
    assert kept["stashed_tokens"] > 0 and kept["stash_writes"] < kept["stats"]["steps_without_drafter"]
    assert eager["stash_writes"] >= eager["stats"]["steps_without_drafter"]
    # the drafter sees the same context either way: the same drafts (the adaptive rule's lengths depend on no
    # timing, so both runs schedule alike; fp32, the context projection's batch shapes differ)
    assert len(kept["drafts"]) == len(eager["drafts"]) > 10
    pairs = [(a, b) for step, other in zip(kept["drafts"], eager["drafts"]) for a, b in zip(step, other)]
    agree = sum(a == b for row, other in pairs for a, b in zip(row, other)) / sum(
        len(row) for row, _ in pairs
    )
    assert agree >= 0.98, agree


@pytest.mark.integration
@needs_vllm
def test_requests_in_one_step_verify_different_draft_lengths(vllm_runs):
    stats = vllm_runs["plugin"]["stats_batch"]
    assert stats["steps_with_distinct_lengths"] > 0, stats
    assert len(set(stats["example_lengths"])) > 1
    assert 0 < stats["mean_draft_length"] < 15 and stats["rounds"] > 0
    goodput = vllm_runs["goodput"]["stats_batch"]
    assert (
        "0" in goodput["draft_length_histogram"] or goodput["steps_without_drafter"] > 0
    )  # k̂ = 0 is allowed
    classes = goodput["gate"].values()  # the gate timed vLLM's steps with the drafter and without
    assert any(c["plain_ms_per_request"] for c in classes) and any(c["draft_ms_per_request"] for c in classes)


@needs_vllm
def test_the_draft_projection_covers_only_the_drafters_vocabulary(tmp_path):
    result = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "tests" / "vllm_driver.py"), "draft-logits", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "draft_logits.json").read_text())
    assert out["full_argmax"][0] == 1  # the whole vocabulary's best row is one the drafter never proposes
    assert out["ids"] == list(range(0, 12, 2)) and all(d in out["ids"] for d in out["drafts"])
    assert out["drafts"] == [out["ids"][max(range(6), key=row.__getitem__)] for row in out["expected"]]
    # the rows of its ids, with vLLM's logit scale
    assert torch.tensor(out["logits"]).allclose(torch.tensor(out["expected"]), rtol=1e-5, atol=1e-5)
    assert (
        out["whole_shape"] == [2, 12] and out["whole_ids"] is None
    )  # no draft vocabulary: vLLM's own logits


@pytest.mark.integration
@needs_vllm
def test_drafts_come_from_the_drafters_own_vocabulary(vllm_runs):
    vocabulary = json.loads((vllm_runs["work"] / "drafter" / "config.json").read_text())["draft_token_ids"]
    assert 0 < len(vocabulary) < 49152  # the shipped drafter's reduced vocabulary, in the export's config
    for stats in (vllm_runs["plugin"]["stats_after_corrupt"], vllm_runs["goodput"]["stats_batch"]):
        # the degraded version's drafts (fusion layer zeroed) included; on these prompts the whole vocabulary's
        # argmax seldom leaves the drafter's (the stand-in model above is what tells the two apart)
        assert stats["drafted"] > 0 and stats["drafts_outside_vocabulary"] == 0, stats


@pytest.mark.integration
@needs_vllm
def test_a_reload_mid_traffic_changes_the_drafter_version_and_loses_no_request(vllm_runs):
    run, plain = vllm_runs["plugin"], vllm_runs["plain"]
    assert run["reload"] == plain["batch"]  # every request finished, each text unchanged
    assert run["version_after_reload"] == 1 and run["stats_reloaded"]["reload_swaps"] == 1
    before, reloaded, degraded = run["stats_batch"], run["stats_reloaded"], run["stats_degraded"]
    # the reloaded drafter has its fusion layer zeroed: what it drafts afterwards is accepted less
    late = (degraded["accepted"] - reloaded["accepted"]) / max(1, degraded["drafted"] - reloaded["drafted"])
    assert late < before["acceptance"] - 0.1, (late, before["acceptance"])
    assert run["degraded"] == plain["batch"]


@pytest.mark.integration
@needs_vllm
def test_a_corrupt_published_version_is_refused_and_serving_goes_on(vllm_runs):
    run = vllm_runs["plugin"]
    stats = run["stats_after_corrupt"]
    assert stats["reload_rejected"] == {"checksum": 1} and stats["drafter_version"] == 1
    assert run["after_corrupt"] == vllm_runs["plain"]["batch"]


@pytest.mark.integration
@needs_vllm
def test_every_finished_request_leaves_a_trajectory_for_the_learner(vllm_runs):
    work, plain = vllm_runs["work"], vllm_runs["plain"]
    prompts = json.loads((work / "prompts.json").read_text())
    lines = [json.loads(line) for path in (work / "records-plugin").glob("trajectories-*.jsonl") for line in
             path.read_text().splitlines()]  # fmt: skip
    trajectories = [Trajectory(**line) for line in lines]
    assert len(trajectories) >= len(prompts)
    first = [t for t in trajectories if t.prompt == prompts[0]][0]
    assert plain["batch"][0][: len(first.committed)] == first.committed
    assert {t.drafter_version for t in trajectories} >= {0, 1}


def _start_server(tmp_path, *options: str, **env: str) -> tuple[subprocess.Popen, int]:
    """``adaflash serve --engine vllm`` (eager, a 1024-token context) on a free port, output piped."""
    from adaflash_hf.vllm.launch import free_port

    port = free_port("127.0.0.1")
    command = [
        str(Path(sys.executable).parent / "adaflash"),
        "serve",
        "--engine",
        "vllm",
        "--port",
        str(port),
    ]
    command += [*options, "--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=1024"]
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    server = subprocess.Popen(
        command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    return server, port


@pytest.mark.integration
@needs_vllm
def test_adaflash_serve_with_the_vllm_engine_answers_openai_clients_and_stops_on_sigterm(tmp_path):
    import signal

    import openai

    from adaflash_hf.vllm.launch import wait_until_ready

    server, port = _start_server(tmp_path, "--vllm-dir", str(tmp_path / "vllm"))
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/health", timeout=600, process=server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=16,
            temperature=0,
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
    finally:
        if server.poll() is None:
            server.kill()
        output = server.stdout.read().decode(errors="replace")
    assert "AdaFlash: goodput draft lengths" in output, output[-3000:]


@pytest.mark.integration
@needs_vllm
def test_serve_with_the_vllm_engine_learns_from_its_traffic_and_serves_the_new_version(tmp_path):
    import signal

    import openai

    from adaflash_hf.online.weights import read_manifest
    from adaflash_hf.vllm.launch import wait_until_ready

    learn = tmp_path / "learn"
    options = ["--learn", "--learn-dir", str(learn), "--train-threshold", "4", "--length-mode", "adaptive"]
    server, port = _start_server(tmp_path, *options, ADAFLASH_VLLM_POLL_SECONDS="0")
    questions = ["Name three colours.", "What is tea?", "Count to five.", "Say hello in French."]

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": question}],
            max_tokens=32,
            temperature=0,
        )
        return reply.choices[0].message.content

    try:
        wait_until_ready(f"http://127.0.0.1:{port}/health", timeout=600, process=server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        before = [ask(q) for q in questions]
        deadline = time.monotonic() + 600
        while (read_manifest(learn / "weights") or {"version": 0})["version"] < 1:
            assert time.monotonic() < deadline and server.poll() is None, "expected a trained version"
            ask(questions[0])
        served = 0
        while served < 1:  # the plugin writes its statistics every few steps
            assert time.monotonic() < deadline and server.poll() is None, "expected the new version served"
            after = [ask(q) for q in questions]
            stats = [json.loads(p.read_text()) for p in (learn / "vllm" / "records").glob("stats-*.json")]
            served = max((s["drafter_version"] for s in stats), default=0)
        assert after == before  # lossless across versions
        server.send_signal(signal.SIGTERM)
        assert server.wait(180) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert list((learn / "checkpoints").glob("checkpoint-*"))


HANDLER_RELEASE = """
import gc, json, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from vllm import _custom_ops as ops
if not ops._supports_onednn:
    print(json.dumps({"skip": "this vLLM build has no oneDNN matmul handler"}))
    sys.exit(0)
if sys.argv[1] == "patched":
    from adaflash_hf.vllm.compat import release_handlers_outside_modes
    assert release_handlers_outside_modes() and release_handlers_outside_modes()  # idempotent
handler = ops.create_onednn_mm(torch.randn(64, 32, dtype=torch.bfloat16).t(), 32)
address, real, released = handler.handler_tensor.item(), handler.dtor, []
handler.dtor = lambda value: (released.append(value if type(value) is int else repr(value)), real(value))
cycle = [handler]
cycle.append(cycle)  # freed by the garbage collector, at whatever allocation it runs
del handler
with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):  # what torch.compile traces under
    del cycle
    gc.collect()
print(json.dumps({"released": released, "address": address}))
"""


@needs_vllm
def test_a_onednn_handler_freed_while_compiling_is_released_outside_the_fake_tensor_mode():
    """vLLM's own destructor, run by the collector under torch.compile's fake-tensor mode, hands the mode a real
    tensor (in the bf16 warm-up it recursed until the worker died); the plugin's releases the handler itself."""
    runs = {}
    for variant in ("stock", "patched"):
        result = subprocess.run(
            [str(VLLM_PYTHON), "-c", HANDLER_RELEASE, variant], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[variant] = json.loads(result.stdout.strip().splitlines()[-1]) | {"stderr": result.stderr}
    if "skip" in runs["patched"]:
        pytest.skip(runs["patched"]["skip"])
    stock, patched = runs["stock"], runs["patched"]
    assert stock["released"] != [stock["address"]] and "Exception ignored" in stock["stderr"]
    assert patched["released"] == [patched["address"]], patched
    assert "Exception ignored" not in patched["stderr"], patched["stderr"][-3000:]
