"""DrafterTrainer: offline DFlash/AdaFlash drafter training on a frozen target, as a transformers ``Trainer``.

The model being trained is the ``AdaFlashDrafter``; the frozen target supplies hidden states (on the fly, or from a
feature cache in offline mode), its raw embedding table for the block inputs and its lm_head for the logits. Overridden
hooks: ``compute_loss`` (``recipe_loss``: the recipe in ``dflash_recipe``, under bf16 autocast when ``args.bf16``, CPU
included), ``create_optimizer`` (drafter and length head in two AdamW
groups), ``_clip_grad_norm`` (each group clipped on its own, so the head never shrinks the drafter's update),
``evaluate`` (tau of real speculative generation on held-out prompts) and ``log`` (recipe metrics).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, Trainer, TrainerCallback
from transformers.utils import logging

from adaflash_hf.corpus import load_features, read_corpus
from adaflash_hf.learning_curve import LearningCurve, heldout_acceptance
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.stats import tau_of
from adaflash_hf.trainers.dflash_recipe import block_ce_and_head_loss, build_blocks, sample_anchors
from adaflash_hf.trainers.optim import clip_each_group, split_drafter_and_head, two_group_adamw

logger = logging.get_logger(__name__)


def recipe_loss(
    model,
    config,
    args,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    embedding_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    draft_token_ids: torch.Tensor | None = None,
):
    """One training forward of the recipe and its loss ``ce + length_head_loss_weight * head_mse``.

    ``model`` is the drafter (or its DDP wrapper), ``config`` its ``AdaFlashConfig``; ``args`` supplies
    ``loss_decay_gamma``, ``length_head_loss_weight``, ``attention_layout`` and ``loss_positions``. Shared by ``DrafterTrainer`` and
    ``adaflash bench train`` so the benchmark times the trainer's own step. Returns (loss, drafter output, metrics).
    """
    split = args.attention_layout == "split"
    blocks = build_blocks(
        input_ids,
        loss_mask,
        anchors,
        config.block_size,
        config.mask_token_id,
        args.loss_decay_gamma,
        dense_mask=not split,
    )
    out = model(
        noise_embeds=torch.nn.functional.embedding(blocks.noise_ids, embedding_weight),
        context_hidden_states=features,
        position_ids=blocks.position_ids,
        attention_mask=blocks.attention_mask,
        block_anchors=blocks.anchors if split else None,
    )
    acceptance = out.acceptance_prob
    if acceptance.dim() == 1:
        acceptance = acceptance[:, None]
    ce, head_mse, metrics = block_ce_and_head_loss(
        out.last_hidden_state,
        acceptance,
        lm_head_weight,
        blocks,
        config.block_size,
        draft_token_ids,
        loss_positions=getattr(args, "loss_positions", None),
    )
    return ce + args.length_head_loss_weight * head_mse, out, metrics


def check_draft_vocab(draft_token_ids: torch.Tensor | None, draft_vocab_size: int | None) -> None:
    """A set ``draft_vocab_size`` must be the drafter's draft vocabulary (the drafter's config validates the ids)."""
    size = None if draft_token_ids is None else draft_token_ids.numel()
    if draft_vocab_size is not None and size != draft_vocab_size:
        drafted = "the full vocabulary, no draft_token_ids" if size is None else size
        raise ValueError(
            f"draft_vocab_size: expected the drafter's draft vocabulary ({drafted}), got {draft_vocab_size}"
        )


class SequenceCollator:
    """Right-pads token sequences; ``loss_mask`` marks response tokens (the positions the drafter learns)."""

    def __init__(self, pad_token_id: int, max_length: int):
        self.pad_token_id = pad_token_id
        self.max_length = max_length

    def __call__(self, records: list[dict]) -> dict:
        lengths = [min(len(r["input_ids"]), self.max_length) for r in records]
        width = max(lengths)
        input_ids = torch.full((len(records), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        loss_mask = torch.zeros_like(input_ids)
        for i, (record, length) in enumerate(zip(records, lengths)):
            input_ids[i, :length] = torch.tensor(record["input_ids"][:length])
            attention_mask[i, :length] = 1
            loss_mask[i, record["prompt_length"] : length] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
        batch["sequence_key"] = [
            _sequence_key(r["input_ids"][:length]) for r, length in zip(records, lengths)
        ]
        # Corpus records name their feature file by id and domain (adaflash_hf.corpus.feature_file).
        batch["records"] = [{"id": r.get("id", ""), "domain": r.get("domain", "")} for r in records]
        return batch


def _sequence_key(tokens: list[int]) -> str:
    return hashlib.sha1(str(tokens).encode()).hexdigest()[:20]


class TargetFeatures:
    """Target context features ``cat(hidden_states[id + 1])`` per sequence, on the fly or cached on disk."""

    def __init__(
        self,
        target,
        target_layer_ids: list[int],
        cache_dir: str | Path | None = None,
        corpus_features_dir: str | Path | None = None,
    ):
        self.target = target
        self.layer_ids = list(target_layer_ids)
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.corpus_features_dir = Path(corpus_features_dir) if corpus_features_dir else None
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keys: list[str],
        records: list[dict] | None = None,
    ) -> torch.Tensor:
        """``records`` (id, domain) find the features the corpus builder recorded; the rest come from the disk cache
        or a target forward. Features of the last token of a sequence are zeros: no anchor's context reaches it."""
        cached = [self._load(key) for key in keys] if self.cache_dir else [None] * len(keys)
        if self.corpus_features_dir and records:
            for i, record in enumerate(records):
                if cached[i] is None and record.get("id"):
                    cached[i] = load_features(self.corpus_features_dir, record, self.layer_ids)
        missing = [i for i, feature in enumerate(cached) if feature is None]
        if missing:
            rows = torch.tensor(missing, device=input_ids.device)
            hidden = self.target(
                input_ids=input_ids[rows],
                attention_mask=attention_mask[rows],
                output_hidden_states=[i + 1 for i in self.layer_ids],
            ).hidden_states
            fresh = torch.cat([hidden[i + 1] for i in self.layer_ids], dim=-1)
            for slot, i in enumerate(missing):
                cached[i] = fresh[slot]
                if self.cache_dir:
                    # Cached features are bf16; the first epoch uses the same rounded values as later ones.
                    length = int(attention_mask[i].sum())
                    cached[i] = fresh[slot, :length].to(torch.bfloat16).contiguous()
                    save_file({"features": cached[i]}, self._path(keys[i]))
        width = input_ids.shape[1]
        out = torch.zeros(
            len(keys), width, cached[0].shape[-1], dtype=self.target.dtype, device=input_ids.device
        )
        for i, feature in enumerate(cached):
            out[i, : feature.shape[0]] = feature[:width].to(out.dtype)
        return out

    def _path(self, key: str) -> Path:
        return self.cache_dir / f"{key}.safetensors"

    def _load(self, key: str) -> torch.Tensor | None:
        path = self._path(key)
        return load_file(path)["features"] if path.is_file() else None


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


class DrafterTrainer(Trainer):
    """Trains an ``AdaFlashDrafter`` against a frozen ``target``. See the module docstring for the hooks."""

    def __init__(self, model: AdaFlashDrafter, args, target, tokenizer=None, eval_prompts=None, **kwargs):
        target.eval().requires_grad_(False)
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        kwargs.setdefault("data_collator", SequenceCollator(pad, args.max_length))
        if eval_prompts or args.heldout_corpus_dir:
            # Trainer insists on an eval dataset for eval_strategy="steps"; evaluate() reads the prompts and the
            # held-out corpus directly.
            kwargs.setdefault("eval_dataset", list(eval_prompts or [args.heldout_corpus_dir]))
        super().__init__(model=model, args=args, processing_class=tokenizer, **kwargs)
        self.target = target.to(self.accelerator.device)
        check_draft_vocab(getattr(model, "draft_token_ids", None), args.draft_vocab_size)
        self.features = TargetFeatures(
            self.target, model.config.target_layer_ids, args.feature_cache_dir, args.corpus_features_dir
        )
        self.heldout_records, self.heldout_features, self.curve = [], [], None
        if args.heldout_corpus_dir:
            self._load_heldout(model)
            if args.curve_points_per_decade and args.eval_strategy == "no":
                self.add_callback(LogSpacedEvaluation(args.curve_points_per_decade))
        self.eval_prompts = eval_prompts or []
        self.anchor_generator = torch.Generator().manual_seed(args.seed + self.accelerator.process_index)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ----------------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter: AdaFlashDrafter = self.accelerator.unwrap_model(model)
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        features = self.features(
            input_ids, inputs["attention_mask"], inputs["sequence_key"], inputs.get("records")
        )
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
        layer_ids = drafter.config.target_layer_ids
        self.heldout_records = read_corpus(self.args.heldout_corpus_dir, self.args.domains)
        features_dir = self.args.heldout_features_dir
        features = [
            load_features(features_dir, r, layer_ids) if features_dir else None for r in self.heldout_records
        ]
        for i, record in enumerate(self.heldout_records):
            if features[i] is None:  # no recorded features: one target forward, once
                ids = torch.tensor([record["input_ids"]], device=self.target.device)
                hidden = self.target(input_ids=ids, output_hidden_states=True).hidden_states
                features[i] = drafter.context_features(hidden)[0, :-1].to(torch.bfloat16)
        self.heldout_features = features
        self.curve = LearningCurve(
            self.args.learning_curve_dir or self.args.output_dir,
            meta={
                "title": f"{type(self.target).__name__} drafter, held-out teacher-forced greedy acceptance"
            },
        )

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
