"""The asynchronous online loop: a traffic source, the serving engine in its own thread, and a trainer.

    rows = run_online(trainer, engine, TrafficSource(phases), OnlineConfig(max_rounds=10), weights_dir=...,
                      checkpoint_dir=..., metrics=MetricsLogger("metrics.csv"))

It is ``adaflash serve --learn`` with a traffic source for clients. Serving is the server's engine thread
(``serving.worker.EngineWorker``): it steps the engine and hot-reloads between steps, and never waits for training; a
feeder thread submits the traffic's prompts to it, ``concurrency`` in flight. Learning is ``online.live.LiveLearner``:
every finished request's trajectory goes to the replay buffer, and its train cycle runs in the calling thread (wait
for a full buffer, train on it with ``trainer.train_round``, publish the new drafter version atomically, write an
atomic checkpoint). One such cycle is a round; after each round a metrics row (τ per domain, acceptance, verify
length, tokens/s, the round's mean losses, buffer and reload counters) goes to the CSV and to the ``report_to``
trackers with the round as the step.

The trainer is given by the caller (``OPDTrainer`` in ``trainers/opd.py``) and is used only through
``online.live.OnlineLearner``.

The traffic source streams held-out prompts phase by phase (e.g. chat, then code, then math) and starts over after the
last phase, so the drafter meets domain shifts.
"""

from __future__ import annotations

import csv
import itertools
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm
from transformers.utils import logging

from adaflash_hf.atomic import atomic_write
from adaflash_hf.online.buffer import ReplayBuffer, check_replay_domains
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.live import LiveLearner, OnlineLearner
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.serving.worker import EngineWorker, Event, QueueFull, ShuttingDown
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)


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
    if config.concurrency < 1:
        raise ValueError(f"concurrency: expected >= 1, got {config.concurrency}")
    buffer = _replay_buffer(config, traffic)
    learner = LiveLearner(
        trainer,
        engine,
        weights_dir,
        checkpoint_dir,
        config,
        buffer=buffer,
        max_rounds=config.max_rounds,
        updates=config.online_updates,
    )
    worker = EngineWorker(engine, None, learner=learner, capacity=config.concurrency)
    buffer.listeners.append(worker.stats.add_trajectory)
    progress = tqdm(total=config.max_rounds, initial=learner.rounds, desc="OPD rounds", disable=disable_tqdm)
    log = _RoundLog(worker, learner, trainer, traffic, metrics, progress)
    learner.on_round = log
    failures: list[BaseException] = []
    stop = threading.Event()
    feeder = threading.Thread(
        target=_feed,
        args=(
            worker,
            traffic,
            learner,
            params or SamplingParams(),
            config.serving_backpressure,
            stop,
            failures,
        ),
        name="adaflash-traffic",
        daemon=True,
    )
    worker.start()
    feeder.start()
    try:
        learner.train()
    finally:
        stop.set()
        feeder.join()
        worker.shutdown(0.0)
        progress.close()
        metrics.finish()
    error = worker.error or (failures[0] if failures else None)
    if error is not None:
        raise RuntimeError("the serving loop failed") from error
    return log.rows


class _RoundLog:
    """``LiveLearner.on_round`` for ``run_online``: one row per round (the serving counters since the last round,
    the training figures, the buffer's and the reloader's), logged to ``metrics`` and kept in ``rows``."""

    def __init__(self, worker: EngineWorker, learner: LiveLearner, trainer, traffic, metrics, progress):
        self.worker, self.learner, self.trainer, self.traffic = worker, learner, trainer, traffic
        self.metrics, self.progress = metrics, progress
        self.rows: list[dict] = []
        self.counted, self.since = worker.stats.totals(), time.perf_counter()

    def __call__(self, done: int, training: dict[str, float]) -> None:
        totals, now = self.worker.stats.totals(), time.perf_counter()
        serving = _serving_columns(totals - self.counted, now - self.since)
        self.counted, self.since = totals, now
        if training.get("diverged"):
            self.metrics.log({"round": done, "diverged": 1, **serving}, step=done)
            return
        reloader = self.learner.reloader
        row = {
            "round": done,
            "version": self.trainer.weights_version,
            "served_version": reloader.version,
            **serving,
            **training,
            **{f"buffer/{k}": v for k, v in self.learner.buffer.stats().items()},
            "reload_swaps": reloader.swaps,
            "reload_rejected": sum(reloader.rejected.values()),
            "domain": self.traffic.domain,
        }
        self.metrics.log(row, step=done)
        self.rows.append(row)
        self.progress.update()
        logger.info(
            f"round {done}: version {row['version']}, tau {row['tau']:.2f}, "
            f"loss {row.get('loss', float('nan')):.4f}, {row['tokens_per_s']:.1f} tok/s"
        )


def _feed(
    worker: EngineWorker, traffic, learner: LiveLearner, params, backpressure: bool, stop, failures
) -> None:
    """Submit the traffic's prompts to ``worker`` until ``stop``: as many in flight as it takes (``QueueFull`` makes
    the next one wait), none while ``backpressure`` holds and a full buffer waits for the trainer. A request the
    engine refuses, or the engine thread failing, goes to ``failures`` and stops the learner."""
    buffer = learner.buffer

    def on_event(event: Event) -> None:
        if event.kind == "failed" and not isinstance(event.error, ShuttingDown):
            failures.append(event.error)
            learner.stop()

    ids = itertools.count()
    pending = None
    try:
        while not stop.is_set() and not failures:
            if not worker.is_alive():
                learner.stop()
                return
            if backpressure and len(buffer) >= buffer.fresh_per_buffer:
                stop.wait(0.02)
                continue
            if pending is None:
                domain, prompt = next(traffic)
                pending = f"opd-{next(ids)}", prompt
                learner.recorder.domains[pending[0]] = domain  # before it is served: its trajectory is tagged
            try:
                worker.submit(pending[1], params, request_id=pending[0], on_event=on_event)
                pending = None
            except QueueFull:
                stop.wait(0.005)
            except ShuttingDown:
                learner.stop()
                return
    except BaseException as error:
        failures.append(error)
        learner.stop()


def _serving_columns(counts, seconds: float) -> dict[str, float]:
    """A round's serving columns from what ``ServingStats`` counted during it: τ per domain and over all (from the
    recorded trajectories), acceptance, verify length, tokens/s and engine steps."""
    domains = sorted(key.split("/", 1)[1] for key in counts if key.startswith("trajectories/"))
    total = {
        key: sum(counts[f"{key}/{d}"] for d in domains)
        for key in ("trajectories", "rounds", "accepted", "drafted")
    }
    columns = {
        f"tau/{d}": tau_of(counts[f"accepted/{d}"] + counts[f"rounds/{d}"], counts[f"rounds/{d}"])
        for d in domains
    }
    return columns | {
        "tau": tau_of(total["accepted"] + total["rounds"], total["rounds"]),
        "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "verify_len": total["drafted"] / total["rounds"] if total["rounds"] else 0.0,
        "tokens_per_s": counts["tokens"] / seconds if seconds > 0 else 0.0,
        "trajectories": total["trajectories"],
        "serving_steps": counts["steps"],
    }
