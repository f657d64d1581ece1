"""The train cycle of online learning: a learner that records what the engine serves into the replay buffer, trains
on each full buffer, publishes each new version and hot-reloads it between engine steps.

    learner = LiveLearner(trainer, engine, weights_dir, checkpoint_dir, OnlineConfig(train_threshold=128))
    worker = EngineWorker(engine, tokenizer, learner=learner)   # calls between_steps() and request_ended()
    learner.start(); ...; learner.close(grace_s=30)             # adaflash serve --learn: a thread trains
    learner.train()                                             # the online loop (run_online): the caller trains

Serving never waits for training: the engine thread only appends rounds (``EngineRecorder``) and polls the reloader
(``HotReloader``), which swaps in a version only after validating it. A round takes one buffer, trains on it
(``trainer.train_round``), publishes the new version atomically (``publish_weights``) and, every
``checkpoint_every`` rounds, writes an atomic checkpoint; at start the newest complete checkpoint is restored and
republished (``config.resume``), so a restart goes on from there and a kill at any moment leaves the previous
version loadable. A round that diverges publishes nothing and ends training; serving goes on. ``max_rounds`` ends
training after that many rounds in all, ``updates=False`` drains the buffers without training or publishing (the
no-update baseline), and ``on_round(round, metrics)`` hears of every round, a diverged one included.

With ``engine=None`` the serving engine lives in another process (vLLM's, ``adaflash serve --engine vllm``): it
records the trajectories that reach ``buffer`` and reloads the published versions itself, and the learner only
trains, publishes and checkpoints.

The trainer is handed in (``trainers/opd_live.py`` and ``trainers/opd.py`` build the ``OPDTrainer``) and is used only
through ``OnlineLearner``: nothing here imports training code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch
from transformers.utils import logging

from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, Trajectory
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
from adaflash_hf.serving.worker import pin_torch_threads

logger = logging.get_logger(__name__)


class OnlineLearner(Protocol):
    """What the learner uses of its trainer (``OPDTrainer`` is one)."""

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


class LiveLearner:
    """See the module docstring."""

    def __init__(
        self,
        trainer: OnlineLearner,
        engine,
        weights_dir,
        checkpoint_dir,
        config: OnlineConfig,
        *,
        buffer: ReplayBuffer | None = None,
        max_rounds: int | None = None,
        updates: bool = True,
        on_round: Callable[[int, dict[str, float]], None] | None = None,
    ):
        if engine is not None and engine.drafter is None:
            raise ValueError("engine: expected one with a drafter to train, got plain decoding")
        self.trainer, self.config = trainer, config
        self.weights_dir, self.checkpoint_dir = weights_dir, checkpoint_dir
        self.max_rounds, self.updates, self.on_round = max_rounds, updates, on_round
        self.buffer = (
            buffer if buffer is not None else ReplayBuffer(config.train_threshold, config.max_staleness)
        )
        # engine None: an engine of another process serves (vLLM's, adaflash_hf.vllm), records the trajectories
        # that reach ``buffer`` and reloads the published weights itself
        self.recorder = self.reloader = None
        if engine is not None:
            self.recorder = EngineRecorder(self.buffer)
            engine.round_recorder = self.recorder
        self.rounds = _resume(trainer, checkpoint_dir, weights_dir, config.resume)
        if engine is not None:
            self.reloader = HotReloader(engine.drafter, weights_dir)
        self.checkpointed = trainer.weights_version
        self.last: dict[str, float] = {}
        self.diverged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train_beside, name="adaflash-learner", daemon=True)

    # ------------------------------------------------------------------------------------------ engine thread
    def between_steps(self) -> None:
        self.reloader.poll()

    def request_ended(self, request) -> None:
        """An aborted request (a stop string, a client gone) still has the rounds it verified: hand its last round
        back to the recorder, which pushes the trajectory now that ``finish_reason`` is set."""
        rounds = self.recorder.rounds.get(request.request_id)
        if rounds:
            self.recorder(request, rounds.pop())

    # ----------------------------------------------------------------------------------------- trainer thread
    def start(self) -> None:
        self._thread.start()

    def _train_beside(self) -> None:
        """``train`` on the learner's thread. Beside an engine of this process it trains on one torch thread: a
        learner thread with an OpenMP team of its own slowed every op of the engine's thread 1.5-2.4x for as long as
        it lived, idle or not (a 2-core Intel Xeon; why: ``serving.worker.in_own_thread``). A learner beside another
        process's engine (vLLM's) keeps torch's thread count."""
        if self.reloader is not None:
            pin_torch_threads(1)
        self.train()

    def stop(self) -> None:
        """End training at the next buffer wait (a round in progress finishes)."""
        self._stop.set()

    def train(self) -> None:
        """The train cycle, in the calling thread, until ``max_rounds``, a diverged round or ``stop()``."""
        trainer = self.trainer
        while not self._stop.is_set() and (self.max_rounds is None or self.rounds < self.max_rounds):
            batch = self.buffer.take(trainer.weights_version, stop=self._stop)
            if batch is None:
                return
            metrics = trainer.train_round(batch) if self.updates else {}
            if metrics.get("diverged"):
                logger.error(
                    f"online learning: round {self.rounds + 1} diverged; nothing published, training stops"
                )
                self.diverged = True
                if self.on_round is not None:
                    self.on_round(self.rounds + 1, metrics)
                return
            self.rounds += 1
            if self.updates:
                publish_weights(self.weights_dir, trainer.publishable_state(), trainer.weights_version)
                if self.config.checkpoint_every and self.rounds % self.config.checkpoint_every == 0:
                    self._checkpoint()
            self.last = metrics
            logger.info(
                f"online learning: round {self.rounds}, version {trainer.weights_version}, "
                f"loss {metrics.get('loss', float('nan')):.4f}"
            )
            if self.on_round is not None:
                self.on_round(self.rounds, metrics)

    def _checkpoint(self) -> None:
        save_online_checkpoint(self.checkpoint_dir, self.trainer.learner_state(), {"round": self.rounds})
        self.checkpointed = self.trainer.weights_version

    def close(self, grace_s: float = 30.0) -> None:
        """Stop training (a round in progress gets ``grace_s`` seconds to finish) and checkpoint the newest
        version if the last round did not."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(grace_s)
        if self._thread.is_alive():
            logger.warning(
                "live learning: a round was still training at shutdown; the last checkpoint stands"
            )
        elif self.trainer.weights_version != self.checkpointed:
            self._checkpoint()

    def metrics(self) -> dict[str, float]:
        buffer = self.buffer.stats()
        return {
            "trainer_rounds": self.rounds,
            "trainer_version": self.trainer.weights_version,
            "trainer_last_loss": self.last.get("loss", float("nan")),
            "trainer_diverged": int(self.diverged),
            "reload_swaps": self.reloader.swaps if self.reloader else 0,
            "reload_rejected": sum(self.reloader.rejected.values()) if self.reloader else 0,
            "replay_buffer_size": buffer["size"],
            "replay_buffer_dropped": buffer.get("dropped_overflow", 0) + buffer.get("dropped_stale", 0),
        }
