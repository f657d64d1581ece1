"""Learning from live traffic (``adaflash serve --learn``): the server's requests feed the replay buffer, a trainer
thread trains on each full buffer and publishes, and the server hot-reloads between engine steps.

    learner = LiveLearner(trainer, engine, weights_dir, checkpoint_dir, OnlineConfig(train_threshold=128))
    worker = EngineWorker(engine, tokenizer, learner=learner)   # calls between_steps() and request_ended()
    learner.start(); ...; learner.close(grace_s=30)

Unlike ``loop.run_online`` there is no traffic source: the requests are whatever clients send. Serving never waits for
training: the engine thread only appends rounds (``EngineRecorder``) and polls the reloader (``HotReloader``), which
swaps in a version only after validating it. Every round publishes the new version atomically (``publish_weights``)
and, every ``checkpoint_every`` rounds, writes an atomic checkpoint; at start the newest complete checkpoint is
restored and republished (``config.resume``), so a restart goes on from there and a kill at any moment leaves the
previous version loadable. A round that diverges publishes nothing and stops training; serving goes on.

The trainer is handed in (``trainers/opd_live.py`` builds the ``OPDTrainer``): nothing here imports training code.
"""

from __future__ import annotations

import threading

from transformers.utils import logging

from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer
from adaflash_hf.online.config import OnlineConfig
from adaflash_hf.online.loop import OnlineLearner, _resume
from adaflash_hf.online.weights import HotReloader, publish_weights, save_online_checkpoint

logger = logging.get_logger(__name__)


class LiveLearner:
    """See the module docstring."""

    def __init__(self, trainer: OnlineLearner, engine, weights_dir, checkpoint_dir, config: OnlineConfig):
        if engine.drafter is None:
            raise ValueError("engine: expected one with a drafter to train, got plain decoding")
        self.trainer, self.config = trainer, config
        self.weights_dir, self.checkpoint_dir = weights_dir, checkpoint_dir
        self.buffer = ReplayBuffer(config.train_threshold, config.max_staleness)
        self.recorder = EngineRecorder(self.buffer)
        engine.round_recorder = self.recorder
        self.rounds = _resume(trainer, checkpoint_dir, weights_dir, config.resume)
        self.reloader = HotReloader(engine.drafter, weights_dir)
        self.checkpointed = trainer.weights_version
        self.last: dict[str, float] = {}
        self.diverged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, name="adaflash-learner", daemon=True)

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

    def _train(self) -> None:
        trainer = self.trainer
        while not self._stop.is_set():
            batch = self.buffer.take(trainer.weights_version, stop=self._stop)
            if batch is None:
                return
            metrics = trainer.train_round(batch)
            if metrics.get("diverged"):
                logger.error("live learning: training diverged; nothing published, serving goes on unchanged")
                self.diverged = True
                return
            self.rounds += 1
            publish_weights(self.weights_dir, trainer.publishable_state(), trainer.weights_version)
            if self.config.checkpoint_every and self.rounds % self.config.checkpoint_every == 0:
                self._checkpoint()
            self.last = metrics
            logger.info(
                f"live learning: round {self.rounds}, version {trainer.weights_version}, "
                f"loss {metrics.get('loss', float('nan')):.4f}"
            )

    def _checkpoint(self) -> None:
        save_online_checkpoint(self.checkpoint_dir, self.trainer.learner_state(), {"round": self.rounds})
        self.checkpointed = self.trainer.weights_version

    def close(self, grace_s: float = 30.0) -> None:
        """Stop training (a round in progress gets ``grace_s`` seconds to finish) and checkpoint the newest
        version if the last round did not."""
        self._stop.set()
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
            "reload_swaps": self.reloader.swaps,
            "reload_rejected": sum(self.reloader.rejected.values()),
            "replay_buffer_size": buffer["size"],
            "replay_buffer_dropped": buffer.get("dropped_overflow", 0) + buffer.get("dropped_stale", 0),
        }
