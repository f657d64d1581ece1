"""The asynchronous online loop: domain schedule, serving that keeps going while the trainer trains, per-round
metrics, resume from a checkpoint, and the launch script end to end under ``accelerate launch`` on CPU."""

import copy
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from adaflash_hf.online import loop
from adaflash_hf.online.buffer import ReplayBuffer
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.loop import MetricsLogger, TrafficSource, run_online
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.trainers.opd_config import OPDConfig
from adaflash_hf.trainers.opd_trainer import OPDTrainer
from tests.conftest import tiny_tokenizer


def synthetic_traffic(n=6):
    g = torch.Generator().manual_seed(0)
    return TrafficSource(
        [
            (domain, [torch.randint(4, 500, (8,), generator=g).tolist() for _ in range(n)])
            for domain in ("chat", "code")
        ]
    )


def test_traffic_follows_the_domain_schedule_and_starts_over():
    traffic = TrafficSource([("chat", [[1], [2]]), ("code", [[3]]), ("math", [[4], [5]])])
    served = [next(traffic) for _ in range(7)]
    assert [d for d, _ in served] == ["chat", "chat", "code", "math", "math", "chat", "chat"]
    assert [p for _, p in served][:5] == [[1], [2], [3], [4], [5]]


def test_held_out_prompts_come_chat_templated_per_domain():
    traffic = TrafficSource.from_domains(tiny_tokenizer(), ["math", "code"], 2, max_prompt_tokens=16)
    assert [d for d, _ in traffic.phases] == ["math", "code"]
    assert all(len(p) == 2 and all(0 < len(x) <= 16 for x in p) for _, p in traffic.phases)


def test_phase_prompts_give_each_phase_its_own_count_of_the_same_shuffle():
    tokenizer = tiny_tokenizer()
    traffic = TrafficSource.from_domains(
        tokenizer, ["math", "translate"], 5, max_prompt_tokens=64, phase_prompts=[2, 3]
    )
    assert [(d, len(p)) for d, p in traffic.phases] == [("math", 2), ("translate", 3)]
    whole = TrafficSource.from_domains(tokenizer, ["translate"], 5, max_prompt_tokens=64)
    assert whole.phases[0][1][:3] == traffic.phases[1][1]  # the first rows of the one held-out shuffle


@pytest.mark.parametrize("counts", [[2], [2, 0], [1, 2, 3]])
def test_phase_prompts_need_one_positive_count_per_domain(counts):
    from adaflash_hf.trainers.opd import OPDScriptArguments

    with pytest.raises(
        ValueError, match=r"phase_prompts: expected one count >= 1 per domain of \['chat', 'translate'\]"
    ):
        OPDScriptArguments(domains=["chat", "translate"], phase_prompts=counts)


def test_a_fresh_drafter_without_layers_is_refused():
    from adaflash_hf.trainers.opd import OPDScriptArguments

    with pytest.raises(ValueError, match=r"drafter_layers: expected >= 1, got 0"):
        OPDScriptArguments(drafter_layers=0)


def test_the_script_refuses_resume_from_checkpoint_before_the_target_loads(tmp_path, monkeypatch):
    from adaflash_hf.trainers import opd

    monkeypatch.setattr(opd, "load_target", lambda name: pytest.fail("the target loaded before the check"))
    config = Path(__file__).resolve().parents[1] / "examples" / "configs" / "opd_tiny.yaml"
    parsed = opd.make_parser().parse_args_and_config(
        ["--config", str(config), "--output_dir", str(tmp_path), "--resume_from_checkpoint", "runs/x"]
    )
    with pytest.raises(
        ValueError, match=r"resume_from_checkpoint: expected none \(an online run resumes .*got 'runs/x'"
    ):
        opd.main(*parsed)


class SlowTraining(TrainerCallback):
    """Slows every optimizer step and counts the engine steps served while a train() call runs."""

    def __init__(self, engine):
        self.engine, self.served_during_training = engine, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = self.engine.step_count

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.1)

    def on_train_end(self, args, state, control, **kwargs):
        self.served_during_training.append(self.engine.step_count - self.begin)


def test_the_buffer_settings_are_the_loops_with_the_papers_threshold():
    assert OnlineConfig().train_threshold == 128
    assert "train_threshold" not in OPDConfig.__dataclass_fields__


@pytest.mark.parametrize("field,value", [("train_threshold", 0), ("max_staleness", -1)])
def test_bad_buffer_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OnlineConfig(**{field: value})


def _online(target, drafter, tmp_path, max_rounds):
    args = OPDConfig(output_dir=str(tmp_path / "opd"), use_cpu=True, disable_tqdm=True)
    trainer = OPDTrainer(
        copy.deepcopy(drafter), copy.deepcopy(target), args, processing_class=tiny_tokenizer()
    )
    engine = AdaFlashEngine(target, copy.deepcopy(drafter))
    slow = SlowTraining(engine)
    trainer.add_callback(slow)
    rows = run_online(
        trainer,
        engine,
        synthetic_traffic(),
        OnlineConfig(max_rounds=max_rounds, concurrency=3, train_threshold=3, max_staleness=8),
        weights_dir=tmp_path / "weights",
        checkpoint_dir=tmp_path / "checkpoints",
        metrics=MetricsLogger(tmp_path / "metrics.csv"),
        params=SamplingParams(max_new_tokens=12),
        disable_tqdm=True,
    )
    return rows, trainer, engine, slow


def test_online_loop_trains_publishes_and_serving_never_waits(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    rows, trainer, engine, slow = _online(target, drafter, tmp_path, max_rounds=2)
    assert [r["round"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
    assert all(n > 0 for n in slow.served_during_training)  # engine steps ran during every train() call
    for key in (
        "tau",
        "tau/chat",
        "acceptance",
        "verify_len",
        "tokens_per_s",
        "loss",
        "ce",
        "rkl_raw",
        "head_mse",
    ):
        assert key in rows[0] or key in rows[1], key
    assert rows[1]["served_version"] >= 1 and rows[1]["buffer/taken"] == 6
    with open(tmp_path / "metrics.csv") as handle:
        assert [row["round"] for row in csv.DictReader(handle)] == ["1", "2"]
    assert json.loads((tmp_path / "weights" / "latest.json").read_text())["version"] == 2

    resumed, trainer, engine, _ = _online(target, drafter, tmp_path, max_rounds=3)
    assert [r["round"] for r in resumed] == [3] and resumed[0]["version"] == 3
    # The optimizer was restored: 4 AdamW steps per round (3 samples, accumulation 2, 2 epochs), 3 rounds.
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert max(steps) == 12


class Untrained:
    """The loop's learner for runs without online updates: it only holds version 0."""

    weights_version = 0


def _serve_without_updates(target, drafter, tmp_path, monkeypatch, traffic, **settings):
    """``run_online`` without updates; returns every batch the buffer handed the trainer."""
    taken = []

    class Recording(ReplayBuffer):
        def take(self, *args, **kwargs):
            batch = super().take(*args, **kwargs)
            taken.append(batch)
            return batch

    engine = AdaFlashEngine(target, copy.deepcopy(drafter), draft_source="diffusion")
    config = OnlineConfig(
        online_updates=False, serving_backpressure=True, resume=False, checkpoint_every=0, **settings
    )
    monkeypatch.setattr(loop, "ReplayBuffer", Recording)
    run_online(
        Untrained(), engine, traffic, config, weights_dir=tmp_path / "weights",
        checkpoint_dir=tmp_path / "checkpoints", metrics=MetricsLogger(tmp_path / "metrics.csv"),
        params=SamplingParams(max_new_tokens=8), disable_tqdm=True,
    )  # fmt: skip
    return taken


def test_the_loop_mixes_served_samples_of_the_replay_domains_into_every_buffer(
    target_factory, drafter_factory, tmp_path, monkeypatch
):
    target = target_factory("llama")
    g = torch.Generator().manual_seed(0)
    phases = [
        (d, [torch.randint(4, 500, (8,), generator=g).tolist() for _ in range(4)])
        for d in ("chat", "math", "code")
    ]
    served = {d: {tuple(p) for p in prompts} for d, prompts in phases}
    taken = _serve_without_updates(
        target, drafter_factory(target), tmp_path, monkeypatch, TrafficSource(phases), max_rounds=4, concurrency=2,
        train_threshold=4, replay_fraction=0.25, replay_domains=["chat", "math"],
    )  # fmt: skip
    assert len(taken) == 4 and all(len(batch) == 4 for batch in taken)
    assert [t.domain for t in taken[-1][:3]] == [
        "code"
    ] * 3  # the traffic shifted: fresh samples of the new domain
    for batch in taken:
        (replayed,) = batch[3:]  # round(0.25 * 4) = 1 of each buffer
        assert replayed.domain in ("chat", "math") and tuple(replayed.prompt) in served[replayed.domain]


@pytest.mark.parametrize(
    ("replay_domains", "message"),
    [
        (["chat"], r"replay_domains: expected domains of the traffic \['code'\] .* got \['chat'\]"),
        (["code"], r"replay_domains: expected the other domains than the new one, .* got \['code'\]"),
    ],
)
def test_replay_domains_the_traffic_cannot_supply_fail_before_anything_is_served(
    target_factory, drafter_factory, tmp_path, monkeypatch, replay_domains, message
):
    target = target_factory("llama")
    traffic = TrafficSource([("code", [[5, 6, 7]])])
    with pytest.raises(ValueError, match=message):
        _serve_without_updates(
            target, drafter_factory(target), tmp_path, monkeypatch, traffic, max_rounds=1, train_threshold=4,
            replay_fraction=0.5, replay_domains=replay_domains,
        )  # fmt: skip
    assert traffic.served == 0


def test_launch_script_runs_two_rounds_end_to_end_under_accelerate(target_factory, tmp_path):
    target = target_factory("llama")
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    root = Path(__file__).resolve().parents[1]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(root / "trainers" / "opd.py"),
        "--config", str(root / "examples" / "configs" / "opd_tiny.yaml"),
        "--target_model", str(tmp_path / "target"), "--output_dir", str(tmp_path / "out"), "--max_rounds", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "out" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["round"] for r in rows] == ["1", "2"] and [r["version"] for r in rows] == ["1", "2"]
    assert {"tau/math", "tau/code", "tokens_per_s", "loss", "ce", "rkl_clipped", "clip_ratio"} <= set(rows[0])
    assert json.loads((tmp_path / "out" / "weights" / "latest.json").read_text())["version"] == 2
    assert (tmp_path / "out" / "checkpoints" / "checkpoint-v000002" / "checkpoint.json").is_file()
    assert (tmp_path / "out" / "drafter" / "model.safetensors").is_file()
