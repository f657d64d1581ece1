"""OPDConfig: every setting of the AdaFlash online on-policy distillation trainer (``OPDTrainer``); the loop around
it (rounds, replay buffer, checkpoints) is ``adaflash_hf.online.config.OnlineConfig``."""

from dataclasses import dataclass, field

from trl import DistillationConfig

from adaflash_hf.trainers.drafter_setup import check_max_steps

CLIP_MODES = ("entry", "row")


@dataclass
class OPDConfig(DistillationConfig):
    """DistillationConfig plus the AdaFlash OPD loss and the trainer's guards.

    Loss: ``alpha · CE(drafter, target top-1) + (1 - alpha) · Σ_y min(q·log(q/p), delta)`` over the drafter's own
    serving blocks, plus ``length_head_loss_weight ·`` MSE of the length head (detached input) against the realised
    acceptance ratio. ``clip_mode="entry"`` is the paper (clip each vocabulary entry of the reverse KL);
    ``clip_mode="row"`` is the official code's variant (clip each row's KL after dividing it by the total row weight,
    ``ZinYY/AdaFlash`` ``OnlineDFlashModelReverseKL``). TRL defaults that do not fit a small drafter trained on CPU or
    GPU (bf16, gradient checkpointing, lr 1e-6, logging every 10 steps) are overridden here explicitly.
    """

    alpha: float = field(default=0.8, metadata={"help": "Weight of the hard CE against the target's top-1."})
    delta: float = field(default=0.01, metadata={"help": "Clip δ of the reverse-KL term."})
    clip_mode: str = field(
        default="entry",
        metadata={
            "help": "'entry': clip every q·log(q/p) entry at δ (the paper). 'row': clip each row's KL divided by "
            "the total row weight at δ (the official code)."
        },
    )
    loss_decay_gamma: float | None = field(
        default=None,
        metadata={
            "help": "Position decay of the row weights, exp(-(j-1)/gamma) (7 in the official code); None = uniform."
        },
    )
    max_anchors_per_sample: int = field(
        default=512,
        metadata={
            "help": "At most this many serving rounds (blocks) per trajectory are trained on (random subset)."
        },
    )
    max_length: int = field(
        default=2048, metadata={"help": "Trajectories are truncated to this many tokens."}
    )
    length_head_learning_rate: float = field(
        default=2e-4, metadata={"help": "Learning rate of the length head."}
    )
    length_head_loss_weight: float = field(default=1.0, metadata={"help": "Weight of the length head's MSE."})
    head_only: bool = field(
        default=False,
        metadata={
            "help": "Update only the length head from the realised acceptance (drafter frozen): gives a checkpoint "
            "whose head is untrained (a z-lab DFlash drafter) an adaptive length online. Offline: adaflash "
            "calibrate-head."
        },
    )
    freeze_length_head: bool = field(
        default=False,
        metadata={
            "help": "Keep the length head as loaded and update only the drafter (the opposite of head_only): the "
            "frozen-head arm of `adaflash bench opd`, which measures what training the head online is worth."
        },
    )
    max_nonfinite_steps: int = field(
        default=5,
        metadata={
            "help": "Training stops after this many consecutive optimizer steps skipped for a non-finite loss or "
            "gradient (each skipped step leaves parameters and optimizer state unchanged)."
        },
    )

    learning_rate: float = field(default=3e-4, metadata={"help": "Drafter learning rate (AdaFlash: 3e-4)."})
    num_train_epochs: float = field(default=2, metadata={"help": "Passes over each buffer (AdaFlash: 2)."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Trajectories per device and micro-batch (AdaFlash: 1)."}
    )
    gradient_accumulation_steps: int = field(
        default=2, metadata={"help": "Accumulation steps (AdaFlash: 2)."}
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={"help": "Constant: train() runs once per buffer and would restart any schedule."},
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "Gradient clip, applied to the drafter and the length head separately."},
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    save_strategy: str = field(
        default="no",
        metadata={
            "help": "Trainer checkpoints are off: the online loop writes atomic, versioned checkpoints."
        },
    )
    bf16: bool | None = field(default=False, metadata={"help": "bf16 mixed precision (GPU only)."})
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "The drafter is small: no activation checkpointing."}
    )
    dataloader_num_workers: int = field(default=0, metadata={"help": "Dataloader workers."})

    def __post_init__(self):
        super().__post_init__()
        check_max_steps(self.max_steps)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: expected a value in [0, 1], got {self.alpha}")
        if self.delta <= 0:
            raise ValueError(f"delta: expected > 0, got {self.delta}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode: expected one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma: expected > 0 or None, got {self.loss_decay_gamma}")
        if self.max_anchors_per_sample < 1:
            raise ValueError(f"max_anchors_per_sample: expected >= 1, got {self.max_anchors_per_sample}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps: expected >= 1, got {self.max_nonfinite_steps}")
        if self.head_only and self.freeze_length_head:
            raise ValueError(
                "freeze_length_head: expected False with head_only=True (that would train nothing), got True"
            )
