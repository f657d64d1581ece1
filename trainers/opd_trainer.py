"""OPDTrainer: AdaFlash online on-policy distillation of the drafter, as a ``trl.DistillationTrainer``.

The trained model is the ``AdaFlashDrafter`` (optionally a PEFT LoRA on it); the frozen target is TRL's
``teacher_model``. Training data are served trajectories (``adaflash_hf.online.buffer``), not prompts: TRL's own
on-policy generation is switched off and the trainer only recomputes the target's distributions over each trajectory.
Per trajectory the blocks are the drafter's own serving blocks (the recorded anchors, ``dflash_recipe.build_blocks``:
``[anchor, MASK...]`` seeing context strictly before the anchor); block row j is trained towards the target's
next-token distribution at position ``anchor + j - 1`` with the fused loss of ``kernels/clipped_kl.py``:
``alpha·CE(q, argmax p) + (1-alpha)·Σ_y min(q log(q/p), delta)`` (``clip_mode`` "entry", or "row" as the official
code), optionally position-decayed. The length head learns the realised acceptance ratio (the drafter's argmax
matching the target's top-1, cumulatively) by MSE on detached states.

Hooks overridden (everything else, incl. teacher preparation, the vocabulary check, metric averaging in ``log``,
``prediction_step`` and model cards, is DistillationTrainer's):

- ``get_train_dataloader`` / ``_get_train_sampler`` / ``_prepare_inputs``: back to plain ``Trainer`` behaviour,
  because DistillationTrainer batches prompts per accumulation window and generates completions in
  ``_prepare_inputs``; here the buffer already holds on-policy samples;
- ``_set_signature_columns_if_needed``: the trajectory batch's keys;
- ``compute_loss``: the AdaFlash loss above (``loss_is_scaled_for_ga = False``: it is a per-micro-batch weighted
  mean, so ``Trainer`` divides by the accumulation steps);
- ``create_optimizer``: AdamW with two groups, drafter (``learning_rate``) and length head
  (``length_head_learning_rate``);
- ``_clip_grad_norm``: each group clipped on its own, so the head's gradient never shrinks the drafter's update;
  a non-finite loss (flagged in ``training_step``) or gradient drops every gradient before ``optimizer.step()``,
  which then changes neither parameters nor AdamW state; ``max_nonfinite_steps`` such steps in a row stop training
  and set ``diverged``.

The online learner (``adaflash_hf.online.live``, which publishes and checkpoints) drives it through ``train_round``
(one buffer in, the round's metrics out, the next weights version on success), ``publishable_state``,
``learner_state`` and ``restore``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from transformers import GenerationConfig, Trainer
from transformers.utils import logging
from trl import DistillationTrainer

from adaflash_hf.draft_vocab import draft_tokens
from adaflash_hf.kernels.clipped_kl import fused_clipped_distill_loss
from adaflash_hf.modeling.length_head_adaflash import length_head_loss, realised_acceptance
from adaflash_hf.online.buffer import Trajectory, TrajectoryDataset
from adaflash_hf.online.weights import LearnerState, base_drafter, load_state, publishable_state
from adaflash_hf.trainers.dflash_recipe import IGNORE, accepted_drafts, build_blocks
from adaflash_hf.trainers.optim import clip_each_group, split_drafter_and_head, two_group_adamw
from adaflash_hf.trainers.target_features import target_pass

logger = logging.get_logger(__name__)

BATCH_KEYS = ["input_ids", "attention_mask", "loss_mask", "anchors", "versions"]
# Logged per optimizer step; a round reports their means.
LOSS_KEYS = (
    "loss",
    "ce",
    "rkl_clipped",
    "rkl_raw",
    "clip_ratio",
    "accuracy",
    "head_mse",
    "accept_len",
    "staleness",
)


class TrajectoryCollator:
    """Right-padded ``prompt + committed`` ids, the committed-token mask and each trajectory's anchors (-1 padded).

    Sequences are cut at ``max_length``; an anchor is kept only if a committed token follows it inside the cut, and at
    most ``max_anchors`` anchors per trajectory are kept (a random subset, sorted).
    """

    def __init__(self, pad_token_id: int, max_length: int, max_anchors: int, seed: int = 0):
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.max_anchors = max_anchors
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, samples: list[Trajectory]) -> dict[str, torch.Tensor]:
        sequences = [s.input_ids[: self.max_length] for s in samples]
        anchors = []
        for sample, sequence in zip(samples, sequences):
            usable = torch.tensor([a for a in sample.anchors if a + 1 < len(sequence)], dtype=torch.long)
            if usable.numel() > self.max_anchors:
                chosen = torch.randperm(usable.numel(), generator=self.generator)[: self.max_anchors]
                usable = usable[chosen].sort().values
            anchors.append(usable)
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        loss_mask = torch.zeros_like(input_ids)
        anchor_ids = torch.full((len(samples), max(max(a.numel() for a in anchors), 1)), -1, dtype=torch.long)
        for row, (sample, sequence, chosen) in enumerate(zip(samples, sequences, anchors)):
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention_mask[row, : len(sequence)] = 1
            loss_mask[row, len(sample.prompt) : len(sequence)] = 1
            anchor_ids[row, : chosen.numel()] = chosen
        versions = torch.tensor([s.drafter_version for s in samples], dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "anchors": anchor_ids,
            "versions": versions,
        }


def _freeze_all_but_the_length_head(model) -> None:
    """``requires_grad=False`` on every parameter outside the length head (a PEFT wrapper's adapters included)."""
    head = split_drafter_and_head(model)["length_head"]
    if not head:
        raise ValueError("head_only: expected a drafter with a trainable length head, got none")
    keep = {id(p) for p in head}
    for param in model.parameters():
        if id(param) not in keep:
            param.requires_grad_(False)


class OPDTrainer(DistillationTrainer):
    """Online on-policy distillation of an ``AdaFlashDrafter``. See the module docstring for the hooks."""

    _tag_names = ["trl", "opd", "adaflash", "speculative-decoding"]
    _name = "OPD"
    _paper = {
        "title": "AdaFlash: adaptive-length block-diffusion speculative decoding with online distillation",
        "id": "2607.19223",
        "citation": "@article{adaflash2026, title={AdaFlash}, journal={arXiv preprint arXiv:2607.19223}, year={2026}}",
    }
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model,
        target,
        args,
        train_dataset: Dataset | None = None,
        processing_class=None,
        callbacks=None,
        peft_config=None,
    ):
        target.eval().requires_grad_(False)
        if args.head_only:  # before the optimizer sees them: the frozen drafter has no group, no gradient
            _freeze_all_but_the_length_head(model)
        if getattr(model, "generation_config", None) is None:
            # DistillationTrainer writes pad/eos ids into the student's generation config; a drafter has none.
            model.generation_config = GenerationConfig()
        super().__init__(
            model=model,
            teacher_model=target,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            peft_config=peft_config,
        )
        if args.freeze_length_head:
            # After PEFT's wrap: its modules_to_save copy of the head would otherwise stay trainable.
            for param in split_drafter_and_head(self.model)["length_head"]:
                param.requires_grad_(False)
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        self.data_collator = TrajectoryCollator(pad, args.max_length, args.max_anchors_per_sample, args.seed)
        self.weights_version = 0
        self.skipped_steps = 0
        self.nonfinite_streak = 0
        self.diverged = False
        self._nonfinite_in_step = False

    # ------------------------------------------------------------------------------------------ data (no generation)
    def get_train_dataloader(self):
        return Trainer.get_train_dataloader(self)

    def _get_train_sampler(self, dataset=None):
        return Trainer._get_train_sampler(self, dataset)

    def _prepare_inputs(self, inputs):
        return Trainer._prepare_inputs(self, inputs)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(BATCH_KEYS)

    # --------------------------------------------------------------------------------------------------------- loss
    @property
    def drafter(self):
        """The bare ``AdaFlashDrafter`` (under any accelerate and PEFT wrapper)."""
        return base_drafter(self.accelerator.unwrap_model(self.model))

    def _target_pass(self, input_ids, attention_mask, positions):
        """Context features at every position and the target's logits at ``positions`` (a sorted 1-D index)."""
        passed = target_pass(
            self.teacher_model,
            input_ids,
            self.drafter.config.target_layer_ids,
            attention_mask=attention_mask,
            logits_to_keep=positions,
        )
        return passed.context_features(), passed.logits

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.drafter
        config = drafter.config
        block = config.block_size
        input_ids, loss_mask, anchors = inputs["input_ids"], inputs["loss_mask"], inputs["anchors"]
        batch, seq = input_ids.shape
        gamma = self.args.loss_decay_gamma
        blocks = build_blocks(input_ids, loss_mask, anchors, block, config.mask_token_id, gamma or 1.0)
        rows = blocks.labels != IGNORE  # [B, Q]
        # Row j of the block at anchor a predicts position a + j: the target's distribution for it is its logits at
        # a + j - 1 (the same rows the serving verify scored).
        source = blocks.position_ids[:, seq:] - 1  # [B, Q]
        positions = source[rows].unique()
        features, kept_logits = self._target_pass(input_ids, inputs["attention_mask"], positions)
        batch_index = torch.arange(batch, device=input_ids.device)[:, None].expand_as(source)
        target_logits = kept_logits[batch_index[rows], torch.searchsorted(positions, source[rows])]  # [R, V]

        embedding = self.teacher_model.get_input_embeddings().weight
        out = model(
            noise_embeds=F.embedding(blocks.noise_ids, embedding),
            context_hidden_states=features.to(embedding.dtype),
            position_ids=blocks.position_ids,
            attention_mask=blocks.attention_mask,
        )
        hidden = out.last_hidden_state[rows]  # [R, H]
        weights = blocks.weights[rows] if gamma else torch.ones_like(blocks.weights[rows])
        lm_head = self.teacher_model.get_output_embeddings()
        head_weight, loss_target_logits = lm_head.weight, target_logits
        token_ids = drafter.draft_token_ids
        if token_ids is not None:
            # A reduced draft vocabulary S: q lives on S, and p is taken over S too, i.e. renormalised there. The
            # target's mass outside S drops out: Σ_S q log(q/p) = Σ_S q log(q/p_S) - log p(S), so the unclipped
            # reverse KL only loses the constant -log p(S) per row and keeps the gradient of the full-vocabulary KL
            # with q = 0 outside S (the clip applies to the renormalised entries). The hard CE's label becomes the
            # target's best token inside S, the best proposal the drafter can make.
            token_ids = token_ids.to(head_weight.device)
            head_weight, loss_target_logits = head_weight[token_ids], target_logits[:, token_ids]
        distill = fused_clipped_distill_loss(
            hidden,
            head_weight,
            loss_target_logits,
            alpha=self.args.alpha,
            delta=self.args.delta,
            row_weights=weights,
            clip_mode=self.args.clip_mode,
        )

        realised, valid_blocks = self._realised_acceptance(
            hidden.detach(), lm_head, token_ids, target_logits, rows, blocks
        )
        acceptance = out.acceptance_prob
        if acceptance.dim() == 1:
            acceptance = acceptance[:, None]
        head_mse = length_head_loss(acceptance[valid_blocks], realised[valid_blocks])
        loss = distill.loss + self.args.length_head_loss_weight * head_mse

        metrics = self._metrics["train" if self.model.training else "eval"]
        for name in ("ce", "rkl_clipped", "rkl_raw", "clip_ratio", "accuracy"):
            metrics[name].append(float(getattr(distill, name)))
        metrics["head_mse"].append(float(head_mse.detach()))
        metrics["accept_len"].append(float(realised[valid_blocks].mean()) * (block - 1))
        metrics["blocks"].append(float(valid_blocks.sum()))
        metrics["staleness"].append(float((self.weights_version - inputs["versions"]).float().mean()))
        return (loss, out) if return_outputs else loss

    @torch.no_grad()
    def _realised_acceptance(self, hidden, lm_head, token_ids, target_logits, rows, blocks):
        """Per block: accepted fraction of the k-1 drafts if verified greedily now (cumulative top-1 agreement of the
        drafter's proposals, inside ``token_ids`` when set, with the target's top-1 over the whole vocabulary)."""
        block = self.drafter.config.block_size
        agree = torch.cat(
            [
                draft_tokens(h, lm_head, token_ids) == t.argmax(-1)
                for h, t in zip(hidden.split(1024), target_logits.split(1024))
            ]
        )
        correct = torch.zeros_like(rows)
        correct[rows] = agree
        accepted = accepted_drafts(correct, block)
        return realised_acceptance(accepted, block), blocks.anchors >= 0

    # ------------------------------------------------------------------------------------- optimiser and the guard
    def _groups(self, model=None) -> dict[str, list[torch.nn.Parameter]]:
        return split_drafter_and_head(
            self.accelerator.unwrap_model(model if model is not None else self.model)
        )

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = two_group_adamw(self._groups(model), self.args)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not bool(torch.isfinite(loss)):
            self._nonfinite_in_step = True
        return loss

    def _clip_grad_norm(self, model):
        groups = self._groups(model)
        norms = clip_each_group(groups, self.args.max_grad_norm)
        finite = torch.tensor(
            float(not self._nonfinite_in_step and all(bool(torch.isfinite(n)) for n in norms.values())),
            device=self.accelerator.device,
        )
        # Every process must take the same decision, or ranks that step would wait forever for ranks that skip.
        finite = bool(self.accelerator.reduce(finite, reduction="mean") == 1.0)
        self._nonfinite_in_step = False
        metrics = self._metrics["train"]
        if finite:
            self.nonfinite_streak = 0
            metrics["head_grad_norm"].append(float(norms["length_head"]))
            return norms["drafter"]
        # No gradients: AdamW skips parameters without one, so neither weights nor moments change.
        for params in groups.values():
            for param in params:
                param.grad = None
        self.skipped_steps += 1
        self.nonfinite_streak += 1
        metrics["skipped_steps"].append(float(self.skipped_steps))
        logger.warning(
            f"non-finite loss or gradient: optimizer step skipped ({self.nonfinite_streak} in a row, "
            f"limit {self.args.max_nonfinite_steps})"
        )
        if self.nonfinite_streak >= self.args.max_nonfinite_steps:
            self.diverged = True
            self.control.should_training_stop = True
            logger.error(
                f"training stopped: {self.nonfinite_streak} consecutive non-finite steps "
                f"(max_nonfinite_steps={self.args.max_nonfinite_steps})"
            )
        return norms["drafter"]

    # ------------------------------------------------------------------------------------------- the online seam
    def train_round(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """Train on one buffer (``num_train_epochs`` passes) and take the next weights version. Returns the round's
        mean losses, optimizer steps, seconds and skipped steps, or ``{"diverged": 1}`` (version unchanged) when
        ``max_nonfinite_steps`` non-finite steps in a row stopped training."""
        self.train_dataset = TrajectoryDataset(trajectories)
        started = time.perf_counter()
        self.train()
        train_seconds = time.perf_counter() - started
        if self.diverged:
            return {"diverged": 1}
        self.weights_version += 1
        return {
            **_round_losses(self.state.log_history),
            "train_seconds": train_seconds,
            "skipped_steps": self.skipped_steps,
        }

    def publishable_state(self) -> dict[str, torch.Tensor]:
        return publishable_state(self.accelerator.unwrap_model(self.model))

    def learner_state(self) -> LearnerState:
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        return LearnerState(
            self.publishable_state(), optimizer, self.weights_version, {"skipped_steps": self.skipped_steps}
        )

    def restore(self, state: LearnerState) -> None:
        load_state(self.accelerator.unwrap_model(self.model), state.tensors)
        if state.optimizer is not None:
            self.create_optimizer()
            self.optimizer.load_state_dict(state.optimizer)
        self.weights_version = state.version
        self.skipped_steps = int(state.counters.get("skipped_steps", 0))


def _round_losses(log_history: list[dict]) -> dict[str, float]:
    steps = [entry for entry in log_history if "loss" in entry]
    out = {}
    for key in LOSS_KEYS:
        values = [e[key] for e in steps if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])]
        if values:
            out[key] = sum(values) / len(values)
    out["optimizer_steps"] = len(steps)
    return out
