"""OnlineConfig: every setting of the online loop (``adaflash_hf.online.loop.run_online``): rounds, traffic in flight,
the replay buffer, checkpoints and the no-update baseline. ``trainers/opd.py`` parses it beside the trainer's config."""

from dataclasses import dataclass, field

from adaflash_hf.online.buffer import check_buffer_settings


@dataclass
class OnlineConfig:
    """The serve/learn loop around a trainer. A round is one buffer of ``train_threshold`` finished requests."""

    max_rounds: int = field(default=10, metadata={"help": "Training rounds (buffer fills) before stopping."})
    concurrency: int = field(default=8, metadata={"help": "Requests kept in flight by the traffic source."})
    train_threshold: int = field(
        default=128,
        metadata={"help": "Buffered trajectories that trigger a training round (the paper: 128)."},
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "Trajectories drafted more than this many versions before the trainer's are dropped."
        },
    )
    checkpoint_every: int = field(
        default=1, metadata={"help": "Atomic checkpoint every N rounds (0 = never)."}
    )
    resume: bool = field(
        default=True, metadata={"help": "Resume from the newest complete checkpoint, if any."}
    )
    online_updates: bool = field(
        default=True,
        metadata={
            "help": "False: the no-update baseline (serve and log the same rounds, train and publish nothing)."
        },
    )
    serving_backpressure: bool = field(
        default=False,
        metadata={
            "help": "Stop admitting new traffic while a full buffer waits for the trainer, so every served request "
            "is trained on (comparable experiments); off = serve at full speed, the buffer drops its oldest."
        },
    )

    def __post_init__(self):
        check_buffer_settings(self.train_threshold, self.max_staleness)
