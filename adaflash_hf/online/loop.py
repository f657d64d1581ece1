"""The asynchronous online loop: a traffic source, the serving engine in its own thread, and a trainer.

    rows = run_online(trainer, engine, TrafficSource(phases), OnlineConfig(max_rounds=10), weights_dir=...,
                      checkpoint_dir=..., metrics=MetricsLogger("metrics.csv"))

Serving thread (``ServingWorker``): keeps ``concurrency`` requests in the engine, steps it, polls the hot reloader
between steps, and records every finished request's trajectory into the replay buffer. It never waits for training.
Trainer (the calling thread): waits for a full buffer, trains on it (``trainer.train_round``), publishes the new
drafter version atomically and writes an atomic checkpoint (``weights``). One such cycle is a round; after each round
a metrics row (τ per domain, acceptance, verify length, tokens/s, the round's mean losses, buffer and reload counters)
goes to the CSV and to the ``report_to`` trackers with the round as the step.

The trainer is given by the caller (``OPDTrainer`` in ``trainers/opd.py``) and is used only through ``OnlineLearner``.

The traffic source streams held-out prompts phase by phase (e.g. chat, then code, then math) and starts over after the
last phase, so the drafter meets domain shifts.
"""

from __future__ import annotations

import csv
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from adaflash_hf.atomic import atomic_write
from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, Trajectory, check_replay_domains
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.weights import (
    HotReloader,
    LearnerState,
    latest_checkpoint,
    load_online_checkpoint,
    newest_published_version,
    publish_weights,
    save_online_checkpoint,
)
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)


class OnlineLearner(Protocol):
    """What the loop uses of its trainer (``OPDTrainer`` is one)."""

    weights_version: int  # the version of the weights it holds: 0 at the start, +1 per successful round

    def train_round(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Train on one buffer; on success take the next version and return the round's metrics, else return
        ``{"diverged": 1}`` (training stopped on non-finite steps; the version is unchanged)."""

    def publishable_state(self) -> dict[str, torch.Tensor]:
        """The tensors that are published and hot-reloaded."""

    def learner_state(self) -> LearnerState:
        """Everything a checkpoint keeps of the trainer."""

    def restore(self, state: LearnerState) -> None:
        """Continue from a checkpoint's ``LearnerState``."""


class TrafficSource:
    """Prompts in a domain schedule: every prompt of phase 1, then of phase 2, ..., then again from phase 1."""

    def __init__(self, phases: list[tuple[str, list[list[int]]]]):
        if not phases or any(not prompts for _, prompts in phases):
            raise ValueError(
                f"phases: expected at least one phase and a prompt in each, got {[(d, len(p)) for d, p in phases]}"
            )
        self.phases = phases
        self.phase = 0
        self.index = 0
        self.served = 0

    @classmethod
    def from_domains(
        cls,
        tokenizer,
        domains: list[str],
        prompts_per_domain: int,
        seed: int = 0,
        max_prompt_tokens: int = 512,
        phase_prompts: list[int] | None = None,
    ) -> TrafficSource:
        """Held-out prompts of ``adaflash_hf.data`` domains, chat-templated, longer ones cut to the last tokens: the
        first ``phase_prompts[i]`` (default ``prompts_per_domain``) of the held-out split shuffled with ``seed``."""
        from adaflash_hf.data import load_domain, prompt_ids

        phases = []
        for i, domain in enumerate(domains):
            count = phase_prompts[i] if phase_prompts is not None else prompts_per_domain
            rows = load_domain(domain, "heldout", n=count, seed=seed)
            phases.append(
                (
                    domain,
                    [
                        prompt_ids(tokenizer, r, max_prompt_tokens, too_long="keep_last")[0].tolist()
                        for r in rows
                    ],
                )
            )
        return cls(phases)

    @property
    def domain(self) -> str:
        return self.phases[self.phase][0]

    def __iter__(self) -> Iterator[tuple[str, list[int]]]:
        return self

    def __next__(self) -> tuple[str, list[int]]:
        domain, prompts = self.phases[self.phase]
        prompt = prompts[self.index]
        self.index += 1
        self.served += 1
        if self.index == len(prompts):
            self.phase, self.index = (self.phase + 1) % len(self.phases), 0
        return domain, prompt


class ServingMetrics:
    """Serving counters since the last ``snapshot``: per-domain rounds from finished trajectories, tokens from steps."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.domains: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.tokens = self.steps = 0
        self.started = time.perf_counter()

    def add_trajectory(self, trajectory: Trajectory) -> None:
        with self._lock:
            counts = self.domains[trajectory.domain]
            counts["trajectories"] += 1
            counts["rounds"] += len(trajectory.accepted)
            counts["accepted"] += sum(trajectory.accepted)
            counts["drafted"] += sum(trajectory.draft_lengths)

    def add_step(self, stats) -> None:
        with self._lock:
            self.steps += 1
            self.tokens += stats.committed + stats.admitted  # a prefill commits the first token

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            seconds = time.perf_counter() - self.started
            total = defaultdict(int)
            row: dict[str, float] = {}
            for domain, counts in sorted(self.domains.items()):
                for key, value in counts.items():
                    total[key] += value
                row[f"tau/{domain}"] = _tau(counts)
            row.update(
                tau=_tau(total),
                acceptance=total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
                verify_len=total["drafted"] / total["rounds"] if total["rounds"] else 0.0,
                tokens_per_s=self.tokens / seconds if seconds > 0 else 0.0,
                trajectories=total["trajectories"],
                serving_steps=self.steps,
            )
            self._reset()
            return row


def _tau(counts) -> float:
    return tau_of(counts["accepted"] + counts["rounds"], counts["rounds"])


class ServingWorker(threading.Thread):
    """The serving loop (see the module docstring). ``stop()`` ends it after the current step; ``error`` holds an
    exception that ended it early, and ``done`` is set however it ends."""

    def __init__(
        self,
        engine: AdaFlashEngine,
        traffic: TrafficSource,
        buffer: ReplayBuffer,
        reloader: HotReloader,
        concurrency: int,
        params: SamplingParams,
        backpressure: bool = False,
    ):
        super().__init__(name="adaflash-serving", daemon=True)
        if concurrency < 1:
            raise ValueError(f"concurrency: expected >= 1, got {concurrency}")
        self.engine, self.traffic, self.reloader = engine, traffic, reloader
        self.concurrency, self.params = concurrency, params
        self.buffer, self.backpressure = buffer, backpressure
        self.recorder = EngineRecorder(buffer)
        engine.round_recorder = self.recorder
        self.metrics = ServingMetrics()
        buffer.listeners.append(self.metrics.add_trajectory)
        self._stop_requested = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        self._stop_requested.set()

    def _admitting(self) -> bool:
        """New traffic is admitted unless ``backpressure`` is on and a full buffer waits for the trainer."""
        return not (self.backpressure and len(self.buffer) >= self.buffer.fresh_per_buffer)

    def run(self) -> None:
        engine = self.engine
        try:
            while not self._stop_requested.is_set():
                self.reloader.poll()  # between steps: no request ever sees weights change inside a step
                while self._admitting() and len(engine.running) + len(engine.waiting) < self.concurrency:
                    domain, prompt = next(self.traffic)
                    request_id = engine.add_request(prompt, self.params)
                    self.recorder.domains[request_id] = domain
                if not engine.running and not engine.waiting:
                    time.sleep(0.02)  # paused by backpressure with nothing in flight
                    continue
                seen = len(engine.stats)
                engine.step()
                for stats in engine.stats[seen:]:
                    self.metrics.add_step(stats)
        except BaseException as error:  # surfaced by run_online in the main thread
            logger.error(f"serving loop failed: {error!r}")
            self.error = error
        finally:
            self.done.set()


class MetricsLogger:
    """One row per round to a CSV (rewritten atomically, so columns may grow) and to accelerate trackers."""

    def __init__(
        self,
        csv_path: str | Path,
        report_to: list[str] | None = None,
        run_name: str = "opd",
        logging_dir=None,
    ):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        self.csv_path = Path(csv_path)
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.trackers = []
        for name in report_to or []:
            if name not in LOGGER_TYPE_TO_CLASS:
                raise ValueError(
                    f"report_to: expected trackers among {sorted(LOGGER_TYPE_TO_CLASS)}, got {name!r}"
                )
            tracker_class = LOGGER_TYPE_TO_CLASS[name]
            if tracker_class.requires_logging_directory:
                tracker = tracker_class(run_name, logging_dir or self.csv_path.parent / "runs")
            else:
                tracker = tracker_class(run_name)
            tracker.start()
            self.trackers.append(tracker)

    def log(self, row: dict, step: int) -> None:
        self.rows.append(row)
        columns = list(dict.fromkeys(key for r in self.rows for key in r))

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=columns)
                writer.writeheader()
                writer.writerows(self.rows)

        atomic_write(self.csv_path, write)
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(numbers, step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def _resume(trainer: OnlineLearner, checkpoint_dir, weights_dir, resume: bool = True) -> int:
    """Restore the newest complete checkpoint (with ``resume``, if any), publish the trainer's weights, and return the
    rounds the checkpoint had done.

    Versions only rise across restarts, whatever is left on disk: when ``weights_dir`` already holds a newer version
    than the trainer's (checkpoints deleted or corrupt, ``resume`` off, or a publish after the last checkpoint), the
    trainer's weights are published as the version after it and numbering goes on from there. Otherwise a reloader
    would keep serving the old version while every new one, numbered lower, is published and never loaded."""
    checkpoint = latest_checkpoint(checkpoint_dir) if resume else None
    rounds = 0
    if checkpoint is not None:
        state, loop_state = load_online_checkpoint(checkpoint)
        trainer.restore(state)
        rounds = int(loop_state.get("round", 0))
    published = newest_published_version(weights_dir)
    if published > trainer.weights_version:
        if checkpoint is not None:
            held, why = f"checkpoint {checkpoint.name}", f"version {trainer.weights_version}"
        else:
            held, why = "the starting drafter", "no complete checkpoint" if resume else "resume: false"
        logger.warning(
            f"{weights_dir} holds version {published}, newer than {held} ({why}): publishing {held} as version "
            f"{published + 1}; the versions it trains follow from there"
        )
        trainer.weights_version = published + 1
    if checkpoint is not None or published > 0:
        publish_weights(weights_dir, trainer.publishable_state(), trainer.weights_version)
    return rounds


def _replay_buffer(config: OnlineConfig, traffic: TrafficSource) -> ReplayBuffer:
    """The loop's buffer; its replay domains are checked against the traffic's first, before anything is served."""
    check_replay_domains(config.replay_fraction, config.replay_domains, [d for d, _ in traffic.phases])
    return ReplayBuffer(
        config.train_threshold,
        config.max_staleness,
        replay_fraction=config.replay_fraction,
        replay_domains=config.replay_domains,
    )


def run_online(
    trainer: OnlineLearner,
    engine: AdaFlashEngine,
    traffic: TrafficSource,
    config: OnlineConfig,
    *,
    weights_dir: str | Path,
    checkpoint_dir: str | Path,
    metrics: MetricsLogger,
    params: SamplingParams | None = None,
    disable_tqdm: bool = False,
) -> list[dict]:
    """Serve, learn and hot-reload for ``config.max_rounds`` training rounds (see the module docstring); returns the
    rows.

    With ``config.resume`` the newest complete checkpoint in ``checkpoint_dir`` restores the trainer (drafter,
    optimizer, version) and the round counter, and its weights are republished so serving starts on them.
    ``online_updates=False`` is the no-update baseline: every round still drains one buffer and logs its serving
    metrics, but nothing is trained or published. ``serving_backpressure=True`` stops admitting new traffic while a
    full buffer waits for the trainer (requests in flight finish), so every served request is trained on and runs are
    comparable prompt for prompt; the default keeps serving at full speed and lets the buffer drop its oldest samples.
    A replay mix (``config.replay_fraction``) draws part of every buffer from recent served samples of
    ``config.replay_domains``, which must be traffic domains, not all of them (checked before anything is served).
    """
    buffer = _replay_buffer(config, traffic)
    reloader = HotReloader(engine.drafter, weights_dir)
    start = _resume(trainer, checkpoint_dir, weights_dir, config.resume)
    worker = ServingWorker(
        engine,
        traffic,
        buffer,
        reloader,
        config.concurrency,
        params or SamplingParams(),
        backpressure=config.serving_backpressure,
    )
    worker.start()
    rows = []
    try:
        for round_index in tqdm(range(start, config.max_rounds), desc="OPD rounds", disable=disable_tqdm):
            batch = buffer.take(trainer.weights_version, stop=worker.done)
            if batch is None:
                break
            done = round_index + 1
            training = trainer.train_round(batch) if config.online_updates else {}
            if training.get("diverged"):
                logger.error(f"round {done}: training diverged; nothing published, stopping")
                metrics.log({"round": done, "diverged": 1, **worker.metrics.snapshot()}, step=done)
                break
            if config.online_updates:
                publish_weights(weights_dir, trainer.publishable_state(), trainer.weights_version)
                if config.checkpoint_every and done % config.checkpoint_every == 0:
                    save_online_checkpoint(checkpoint_dir, trainer.learner_state(), {"round": done})
            row = {
                "round": done,
                "version": trainer.weights_version,
                "served_version": reloader.version,
                **worker.metrics.snapshot(),
                **training,
                **{f"buffer/{k}": v for k, v in buffer.stats().items()},
                "reload_swaps": reloader.swaps,
                "reload_rejected": sum(reloader.rejected.values()),
                "domain": traffic.domain,
            }
            metrics.log(row, step=done)
            rows.append(row)
            logger.info(
                f"round {done}: version {row['version']}, tau {row['tau']:.2f}, "
                f"loss {row.get('loss', float('nan')):.4f}, {row['tokens_per_s']:.1f} tok/s"
            )
    finally:
        worker.stop()
        worker.join()
        metrics.finish()
    if worker.error is not None:
        raise RuntimeError("the serving loop failed") from worker.error
    return rows
