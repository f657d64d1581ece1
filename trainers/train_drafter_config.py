"""DrafterTrainingConfig: every setting of offline drafter training (``trainers/train_drafter.py``)."""

from dataclasses import dataclass, field

from transformers import TrainingArguments

from adaflash_hf.data import DOMAINS
from adaflash_hf.trainers.drafter_setup import DrafterArguments, check_drafter_arguments, check_max_steps


@dataclass
class DrafterTrainingConfig(DrafterArguments, TrainingArguments):
    """TrainingArguments plus the drafter to start from (``DrafterArguments``), the DFlash/SpecForge recipe and
    AdaFlash's length head.

    Defaults differ from TrainingArguments where the recipe says so (lr 6e-4, warmup 4%, grad clip 1.0, cosine) and
    where CPU training needs it (no bf16, no gradient checkpointing, no dataloader workers).
    """

    domains: list[str] = field(
        default_factory=lambda: ["chat", "code", "math"],
        metadata={
            "help": "Training domains of adaflash_hf.data: the corpus files read for training. A domain left out is "
            "in no training sequence (e.g. [chat, math]: a drafter that never saw code)."
        },
    )
    heldout_domains: list[str] | None = field(
        default=None,
        metadata={
            "help": "Domains of the held-out evaluation (the learning curve, eval_prompts_per_domain) and of the "
            "held-out twins dropped from training; None = `domains`. List a domain left out of `domains` here to "
            "measure it (domains: [chat, math], heldout_domains: [chat, code, math])."
        },
    )
    max_length: int = field(default=512, metadata={"help": "Sequences are truncated to this many tokens."})
    num_anchors: int = field(default=24, metadata={"help": "Random anchors (blocks) per sequence and step."})
    attention_layout: str = field(
        default="split",
        metadata={
            "help": "'split': each block row attends to the context and its own block, linear in num_anchors; "
            "'dense': the same through a [Q, S + Q] mask, quadratic in num_anchors (kept as the benchmark baseline)."
        },
    )
    final_norm_init: str = field(
        default="inverse_row_norm",
        metadata={
            "help": "Initial scale of a fresh drafter's final norm: 'inverse_row_norm' (1 / mean lm_head row norm: "
            "first logits near unit scale) or 'target' (the target's own final norm weights, whose lm_head the "
            "drafter's states feed)."
        },
    )
    corpus_dir: str | None = field(
        default=None,
        metadata={
            "help": "The training corpus, written by `adaflash corpus` (<domain>.jsonl.gz of token ids): the script "
            "trains on its sequences of `domains` (required by trainers/train_drafter.py)."
        },
    )
    corpus_features_dir: str | None = field(
        default=None,
        metadata={
            "help": "Target features (and top-k) the corpus builder recorded (`adaflash corpus --features-dir`). "
            "Sequences without a file, or all when None, get theirs from a target forward each step, not cached "
            "(cheap on a GPU)."
        },
    )
    max_train_sequences: int | None = field(
        default=None, metadata={"help": "Use only the first N training sequences (None = all)."}
    )
    drop_heldout_twins: bool = field(
        default=True,
        metadata={
            "help": "Drop every training sequence whose prompt is also a prompt of the held-out split of "
            "heldout_domains (the same first turn under another conversation id), so that held-out figures measure "
            "unseen prompts."
        },
    )
    heldout_corpus_dir: str | None = field(
        default=None,
        metadata={
            "help": "Corpus of held-out prompts for the learning curve: every evaluation measures teacher-forced "
            "greedy acceptance (first position, tau of the full block) per domain on it."
        },
    )
    heldout_features_dir: str | None = field(
        default=None, metadata={"help": "Target features of the held-out corpus."}
    )
    learning_curve_dir: str | None = field(
        default=None,
        metadata={"help": "Where learning_curve.json/.png go (default: output_dir)."},
    )
    curve_points_per_decade: int = field(
        default=0,
        metadata={
            "help": "With a held-out corpus and eval_strategy='no': evaluate at steps spaced evenly on a log scale, "
            "this many per decade of steps, and at the end (0 = only as eval_strategy says)."
        },
    )
    curve_max_anchors: int = field(
        default=64, metadata={"help": "Anchors per held-out sequence in each learning-curve evaluation."}
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Size of the drafter's reduced draft vocabulary (its draft_token_ids). A fresh drafter gets the N "
            "most frequent response tokens of the training sequences; a loaded one must already have N. None: train "
            "over whatever the drafter drafts (its draft_token_ids, else the full vocabulary)."
        },
    )
    loss_decay_gamma: float = field(
        default=7.0, metadata={"help": "Position decay of the CE weight, exp(-(j-1)/gamma) (7 for k=16)."}
    )
    loss_positions: int | None = field(
        default=None,
        metadata={
            "help": "CE only on drafted positions 1..N of each block (None: all block_size - 1). The lm_head "
            "projection is the step's largest cost and later positions weigh exp(-(j-1)/gamma), little under a short "
            "decay; the length head's realised acceptance stays exact."
        },
    )
    soft_target_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight w in [0, 1] of the KL to the target's top-k distribution: token loss (1 - w) CE + w KL, "
            "on the same drafted positions and decay weights (0: hard CE only). The top-k come from the corpus's "
            "feature files (recorded by `adaflash corpus --topk`), or from the target's forward for sequences "
            "without one."
        },
    )
    soft_target_topk: int = field(
        default=32,
        metadata={
            "help": "Top-k of the target's distribution taken by the on-the-fly forward (sequences without a "
            "feature file); recorded files keep the corpus's --topk."
        },
    )
    init_from_target: bool = field(
        default=False,
        metadata={
            "help": "A fresh drafter's decoder layers start as copies of the target's last decoder layers (q_norm / "
            "k_norm at identity where the target has none), hidden_norm as the first copied layer's input norm, and "
            "fc passes the deepest tapped layer through; False: random. Not with drafter_init."
        },
    )
    max_train_seconds: float | None = field(
        default=None,
        metadata={
            "help": "Stop after this many seconds of training, with a log line, a checkpoint and (with held-out "
            "data) a learning-curve point, so --resume_from_checkpoint continues; the LR schedule still spans "
            "max_steps. None: stop at max_steps only."
        },
    )
    weights_only_checkpoint_dir: str | None = field(
        default=None,
        metadata={
            "help": "After every checkpoint save, also write it weights-only here (bf16 weights, config and trainer "
            "state, no optimizer: trainers/weights_only_checkpoint.py), replacing the previous one: a small copy of "
            "the newest checkpoint, to keep where output_dir does not last (scratch space, a preemptible machine). "
            "--resume_from_checkpoint on it carries the run on. None: none written."
        },
    )
    resume_rewarmup_steps: int = field(
        default=50,
        metadata={
            "help": "Resuming from a weights-only checkpoint (model.safetensors and trainer_state.json, no optimizer "
            "or scheduler state: trainers/weights_only_checkpoint.py): the LR schedule is carried on at the "
            "checkpoint's step, ramped linearly from 0 over this many steps while AdamW's fresh moments settle. "
            "0: no ramp."
        },
    )
    length_head_loss_weight: float = field(default=1.0, metadata={"help": "Weight of the length head's MSE."})
    length_head_learning_rate: float = field(
        default=2e-4, metadata={"help": "Learning rate of the length head."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train into an output_dir that already holds files (a previous run's checkpoints and drafter), "
            "which the new run replaces; without it such an output_dir is refused unless --resume_from_checkpoint "
            "continues the run in it."
        },
    )
    eval_prompts_per_domain: int = field(
        default=2, metadata={"help": "Held-out prompts per domain for the periodic tau evaluation."}
    )
    eval_max_new_tokens: int = field(
        default=64, metadata={"help": "Tokens generated per held-out prompt in eval."}
    )

    learning_rate: float = field(
        default=6e-4, metadata={"help": "Drafter learning rate (DFlash recipe: 6e-4)."}
    )
    warmup_ratio: float = field(default=0.04, metadata={"help": "Warm-up fraction of the steps."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clip, applied to drafter and length head separately."}
    )
    per_device_train_batch_size: int = field(default=4, metadata={"help": "Sequences per device and step."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps."})
    save_strategy: str = field(default="steps", metadata={"help": "Checkpoint strategy."})
    save_steps: float = field(default=100, metadata={"help": "Checkpoint every N steps."})
    save_total_limit: int | None = field(default=3, metadata={"help": "Checkpoints kept."})
    eval_strategy: str = field(default="no", metadata={"help": "'steps' to evaluate tau every eval_steps."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the collator's columns."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "Dataloader workers."})
    bf16: bool = field(
        default=False,
        metadata={
            "help": "bf16 autocast of the training step, also on CPU (use_cpu=True); weights stay float32 and the CE "
            "is computed in float32. Faster only where bf16 matmuls are (GPU, CPUs with AMX or AVX512-BF16)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        _check_domains("domains", self.domains)
        if self.heldout_domains is None:
            self.heldout_domains = list(self.domains)
        _check_domains("heldout_domains", self.heldout_domains)
        check_drafter_arguments(self)
        check_max_steps(self.max_steps)
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors: expected >= 1, got {self.num_anchors}")
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma: expected > 0, got {self.loss_decay_gamma}")
        if self.attention_layout not in ("split", "dense"):
            raise ValueError(f"attention_layout: expected 'split' or 'dense', got {self.attention_layout!r}")
        if self.final_norm_init not in ("inverse_row_norm", "target"):
            raise ValueError(
                f"final_norm_init: expected 'inverse_row_norm' or 'target', got {self.final_norm_init!r}"
            )
        if self.curve_points_per_decade < 0:
            raise ValueError(f"curve_points_per_decade: expected >= 0, got {self.curve_points_per_decade}")
        if self.max_train_sequences is not None and self.max_train_sequences < 1:
            raise ValueError(f"max_train_sequences: expected None or >= 1, got {self.max_train_sequences}")
        if self.loss_positions is not None and not 1 <= self.loss_positions <= self.block_size - 1:
            raise ValueError(
                f"loss_positions: expected None or 1..block_size - 1 ({self.block_size - 1}), got {self.loss_positions}"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size: expected None or >= 1, got {self.draft_vocab_size}")
        if not 0.0 <= self.soft_target_weight <= 1.0:
            raise ValueError(f"soft_target_weight: expected a float in [0, 1], got {self.soft_target_weight}")
        if self.soft_target_topk < 1:
            raise ValueError(f"soft_target_topk: expected >= 1, got {self.soft_target_topk}")
        if self.init_from_target and self.drafter_init:
            raise ValueError(
                f"init_from_target: expected False when drafter_init is set (a loaded drafter keeps its weights), "
                f"got True with drafter_init={self.drafter_init!r}"
            )
        if self.resume_rewarmup_steps < 0:
            raise ValueError(f"resume_rewarmup_steps: expected >= 0, got {self.resume_rewarmup_steps}")
        if self.max_train_seconds is not None and self.max_train_seconds <= 0:
            raise ValueError(f"max_train_seconds: expected None or > 0, got {self.max_train_seconds}")
        if self.length_head_variant not in ("two_model", "paper"):
            raise ValueError(
                f"length_head_variant: expected 'two_model' or 'paper', got {self.length_head_variant!r}"
            )


def _check_domains(name: str, domains: list[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``domains`` is a non-empty list of distinct known domains."""
    if not domains or len(set(domains)) != len(domains) or not set(domains) <= set(DOMAINS):
        raise ValueError(
            f"{name}: expected distinct domains among {list(DOMAINS)}, at least one, got {domains}"
        )
