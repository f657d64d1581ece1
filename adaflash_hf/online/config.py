"""OnlineConfig: every setting of the online loop (``adaflash_hf.online.loop.run_online``): rounds, traffic in flight,
the replay buffer and its replay mix, checkpoints and the no-update baseline. ``trainers/opd.py`` parses it beside the
trainer's config."""

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
    replay_fraction: float = field(
        default=0.0,
        metadata={
            "help": "Replay mix: the fraction of each training buffer (round(f * train_threshold) samples) drawn at "
            "random from the most recent served samples of replay_domains (the last train_threshold of each), the "
            "rest fresh traffic; a round starts once its fresh part is in. Only served traffic is replayed, never an "
            "evaluation prompt. 0 = no replay."
        },
    )
    replay_domains: list[str] = field(
        default_factory=list,
        metadata={
            "help": "The traffic domains a replay mix draws from: the other domains than the new one (e.g. [chat, "
            "math] while the traffic shifts to code), served in earlier phases of the traffic schedule."
        },
    )

    def __post_init__(self):
        check_buffer_settings(
            self.train_threshold, self.max_staleness, self.replay_fraction, self.replay_domains
        )
