"""DrafterTrainer: offline DFlash/AdaFlash drafter training on a frozen target, as a transformers ``Trainer``.

The model being trained is the ``AdaFlashDrafter``; the frozen target supplies hidden states (from the corpus's feature
files or on the fly, ``target_features.TargetFeatures``), its raw embedding table for the block inputs and its lm_head
for the logits. Overridden hooks: ``compute_loss`` (``dflash_recipe.recipe_loss``, under bf16
autocast when ``args.bf16``, CPU included), ``create_optimizer`` (drafter and length head in two AdamW
groups), ``_clip_grad_norm`` (each group clipped on its own, so the head never shrinks the drafter's update),
``evaluate`` (tau of real speculative generation on held-out prompts), ``log`` (recipe metrics) and ``train`` (the
held-out learning curve is claimed first: ``LearningCurve.claim``). A resumed run carries on through the
``CarryOnAfterResume`` callback (``weights_only_checkpoint.py``), a public hook, not the Trainer's private loader.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from transformers import GenerationConfig, Trainer, TrainerCallback
from transformers.utils import logging

from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.stats import tau_of
from adaflash_hf.trainers.corpus_format import read_corpus
from adaflash_hf.trainers.dflash_recipe import recipe_loss, sample_anchors
from adaflash_hf.trainers.learning_curve import LearningCurve, heldout_acceptance
from adaflash_hf.trainers.optim import clip_each_group, split_drafter_and_head, two_group_adamw
from adaflash_hf.trainers.target_features import (
    SequenceCollator,
    TargetFeatures,
    missing_soft_targets,
    sequence_features,
    soft_targets_error,
)
from adaflash_hf.trainers.weights_only_checkpoint import CarryOnAfterResume, SaveWeightsOnly

logger = logging.get_logger(__name__)


def check_draft_vocab(draft_token_ids: torch.Tensor | None, draft_vocab_size: int | None) -> None:
    """A set ``draft_vocab_size`` must be the drafter's draft vocabulary (the drafter's config validates the ids)."""
    size = None if draft_token_ids is None else draft_token_ids.numel()
    if draft_vocab_size is not None and size != draft_vocab_size:
        drafted = "the full vocabulary, no draft_token_ids" if size is None else size
        raise ValueError(
            f"draft_vocab_size: expected the drafter's draft vocabulary ({drafted}), got {draft_vocab_size}"
        )


class LogSpacedEvaluation(TrainerCallback):
    """Evaluate at steps evenly spaced on a log scale (``per_decade`` a decade) and at the last step: a learning
    curve drawn against log(blocks seen) then has its points where the curve bends, not bunched at the end."""

    def __init__(self, per_decade: int):
        self.per_decade = per_decade

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        marks = {max(1, round(10 ** (k / self.per_decade))) for k in range(8 * self.per_decade)}
        if step in marks or step == state.max_steps:
            control.should_evaluate = True
        return control


class TimeBudget(TrainerCallback):
    """Stop once ``seconds`` of training have passed, logging, saving a checkpoint and (``evaluate``) adding a
    learning-curve point at that step: a run on a machine lent for a fixed time, or a GPU run with a fixed budget,
    ends resumable with its blocks-seen count exact. The learning-rate schedule still spans ``max_steps``."""

    def __init__(self, seconds: float, evaluate: bool = False):
        self.seconds = seconds
        self.evaluate = evaluate
        self.started: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.started >= self.seconds:
            control.should_training_stop = control.should_log = control.should_save = True
            control.should_evaluate = control.should_evaluate or self.evaluate
        return control


class DrafterTrainer(Trainer):
    """Trains an ``AdaFlashDrafter`` against a frozen ``target``. See the module docstring for the hooks."""

    _tag_names = ["trl", "adaflash", "dflash"]  # the model card's tags when the drafter is pushed to the Hub

    def __init__(self, model: AdaFlashDrafter, args, target, tokenizer=None, eval_prompts=None, **kwargs):
        target.eval().requires_grad_(False)
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        kwargs.setdefault("data_collator", SequenceCollator(pad, args.max_length))
        if eval_prompts or args.heldout_corpus_dir:
            # Trainer insists on an eval dataset for eval_strategy="steps"; evaluate() reads the prompts and the
            # held-out corpus directly.
            kwargs.setdefault("eval_dataset", list(eval_prompts or [args.heldout_corpus_dir]))
        super().__init__(model=model, args=args, processing_class=tokenizer, **kwargs)
        self.model.add_model_tags(self._tag_names)
        self.target = target.to(self.accelerator.device)
        check_draft_vocab(getattr(model, "draft_token_ids", None), args.draft_vocab_size)
        soft_topk = args.soft_target_topk if args.soft_target_weight > 0 else 0
        if soft_topk and args.corpus_features_dir:
            # Checked here, before any forward: a corpus recorded without top-k fails now, not hours into a run.
            records = self.train_dataset if self.train_dataset is not None else []
            if {"id", "domain"} <= set(getattr(records, "column_names", ())):
                records = records.select_columns(["id", "domain"])  # not the token ids of 13k sequences
            missing = missing_soft_targets(args.corpus_features_dir, records)
            if missing:
                raise soft_targets_error(args.corpus_features_dir, missing, len(records))
        self.features = TargetFeatures(
            self.target, model.config.target_layer_ids, args.corpus_features_dir, soft_topk
        )
        self.heldout_records, self.heldout_features, self.curve = [], [], None
        if args.heldout_corpus_dir:
            self._load_heldout(model)
            if args.curve_points_per_decade and args.eval_strategy == "no":
                self.add_callback(LogSpacedEvaluation(args.curve_points_per_decade))
        self.add_callback(CarryOnAfterResume(self.callback_handler, args.resume_rewarmup_steps))
        if args.weights_only_checkpoint_dir:
            self.add_callback(SaveWeightsOnly(args.weights_only_checkpoint_dir))
        if args.max_train_seconds is not None:
            self.add_callback(
                TimeBudget(args.max_train_seconds, evaluate=bool(eval_prompts or args.heldout_corpus_dir))
            )
        self.eval_prompts = eval_prompts or []
        self.anchor_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ----------------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter: AdaFlashDrafter = self.accelerator.unwrap_model(model)
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        features, soft_targets = self.features(input_ids, inputs["attention_mask"], inputs.get("records"))
        anchors = sample_anchors(loss_mask, self.args.num_anchors, self.anchor_generator)
        # accelerate autocasts only the drafter's forward; the lm_head logits, the largest matmul, need it too.
        with self.accelerator.autocast():
            loss, out, metrics = recipe_loss(
                model,
                drafter.config,
                self.args,
                input_ids,
                loss_mask,
                features,
                anchors,
                self.target.get_input_embeddings().weight,
                self.target.get_output_embeddings().weight,
                getattr(drafter, "draft_token_ids", None),
                soft_targets,
            )
        for name, value in metrics.items():
            self._metrics[name].append(value)
        if model.training:
            self.blocks_seen = (
                self._resumed_blocks_seen() + metrics["blocks"] * self.accelerator.num_processes
            )
        return (loss, out) if return_outputs else loss

    def _resumed_blocks_seen(self) -> int:
        # A resumed run continues from the count its last log line recorded (at most logging_steps behind).
        if getattr(self, "blocks_seen", None) is None:
            logged = [e["blocks_seen"] for e in self.state.log_history if "blocks_seen" in e]
            self.blocks_seen = int(logged[-1]) if logged else 0
        return self.blocks_seen

    def _load_heldout(self, drafter: AdaFlashDrafter) -> None:
        self.heldout_records = read_corpus(self.args.heldout_corpus_dir, self.args.heldout_domains)
        # Recorded features where there are some, else one target forward per sequence, once.
        self.heldout_features = sequence_features(
            self.target, self.heldout_records, drafter.config.target_layer_ids, self.args.heldout_features_dir
        )
        self.curve = LearningCurve(
            self.args.learning_curve_dir or self.args.output_dir,
            meta={
                "title": f"{type(self.target).__name__} drafter, held-out teacher-forced greedy acceptance"
            },
        )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.curve is not None and self.is_world_process_zero():
            # Before any step: a curve folder holding another run's points is refused here, not cut back later.
            self.curve.claim(self.args.output_dir, resumed=bool(resume_from_checkpoint))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ------------------------------------------------------------------------------------------------ optimiser
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            groups = split_drafter_and_head(self.accelerator.unwrap_model(self.model))
            self.optimizer = two_group_adamw(groups, self.args)
        return self.optimizer

    def _clip_grad_norm(self, model):
        groups = split_drafter_and_head(self.accelerator.unwrap_model(model))
        norms = clip_each_group(groups, self.args.max_grad_norm)
        self._metrics["head_grad_norm"].append(float(norms["length_head"]))
        return norms["drafter"]

    # ------------------------------------------------------------------------------------------------ eval, log
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """tau of real speculative generation on the held-out prompts (adaptive and fixed length)."""
        drafter: AdaFlashDrafter = self.accelerator.unwrap_model(self.model)
        was_training = drafter.training
        drafter.eval()
        metrics: dict[str, float] = {}
        if self.heldout_records:
            acceptance = heldout_acceptance(
                drafter, self.target, self.heldout_records, self.heldout_features, self.args.curve_max_anchors
            )
            for domain, values in acceptance.items():
                metrics[f"{metric_key_prefix}_first_position_{domain}"] = values["first_position"]
                metrics[f"{metric_key_prefix}_tau_fixed_{domain}"] = values["tau_fixed"]
            if self.is_world_process_zero():
                self.curve.add(self._resumed_blocks_seen(), acceptance, step=self.state.global_step)
        for mode in ("adaptive", "fixed") if self.eval_prompts else ():
            committed = rounds = verified = 0
            started = time.perf_counter()
            for prompt_ids in self.eval_prompts:
                config = GenerationConfig(
                    max_new_tokens=self.args.eval_max_new_tokens, do_sample=False, adaflash_length_mode=mode
                )
                self.target.generate(
                    prompt_ids.to(self.target.device), assistant_model=drafter, generation_config=config
                )
                stats = drafter.last_stats
                committed += stats.committed_tokens
                rounds += stats.drafting_rounds
                verified += sum(stats.verify_lengths)
            metrics[f"{metric_key_prefix}_tau_{mode}"] = tau_of(committed, rounds)
            metrics[f"{metric_key_prefix}_verify_len_{mode}"] = verified / max(rounds, 1)
            metrics[f"{metric_key_prefix}_seconds_{mode}"] = time.perf_counter() - started
        drafter.train(was_training)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._metrics and "loss" in logs:
            for name, values in self._metrics.items():
                logs[name] = sum(values) / len(values)
            self._metrics.clear()
            logs["blocks_seen"] = self._resumed_blocks_seen()
        super().log(logs, start_time)
