"""What drafter training reads of the frozen target, and the one forward that produces it.

``target_pass`` is that forward: the tapped layers' outputs ``hidden_states[id + 1]`` and the target's top-k over the
next token, both by position. The corpus builder's greedy loop and its feature rebuild (``corpus.py``), the per-batch
``TargetFeatures``, the held-out ``sequence_features`` and OPD's teacher pass all call it.

Per batch, training reads padded token sequences (``SequenceCollator``) and the target's part of them
(``TargetFeatures``): context features ``cat(hidden_states[id + 1])`` and, for the soft-target loss, the target's
top-k distribution over each token. Both come from the feature files the corpus builder recorded (``adaflash corpus
--features-dir``), else from one ``target_pass`` over the batch's remaining rows. Nothing is cached here: the corpus
builder is the one writer of feature files, so a feature on disk always carries the corpus's layer ids and settings;
on a GPU the forward costs less than the read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash_hf.modeling.configuration_adaflash import hidden_state_ids
from adaflash_hf.trainers.corpus_format import feature_file, load_features, load_soft_targets
from adaflash_hf.trainers.dflash_recipe import SoftTargets


@dataclass
class TargetPass:
    """One forward of the target, by position ``p`` of its input: ``states[:, p]`` are the tapped layers' outputs at
    ``p``; ``logits`` and ``topk_*`` hold the rows ``logits_to_keep`` kept, each the target's distribution over the
    token after its position."""

    states: (
        torch.Tensor
    )  # [B, S, len(layer_ids), H], the target's dtype: hidden_states[id + 1] per tapped layer
    logits: torch.Tensor  # [B, R, V]
    topk_ids: torch.Tensor | None = None  # [B, R, k] int64
    topk_logprobs: torch.Tensor | None = None  # [B, R, k] float32: log-softmax over the whole vocabulary

    def context_features(self) -> torch.Tensor:
        """``cat(hidden_states[id + 1])`` over the tapped layers: [B, S, len(layer_ids) * H], the drafter's fc input."""
        return self.states.flatten(2)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64, log-probs float32)`` of the ``k`` likeliest tokens per row of ``logits`` [..., V]."""
    logprobs, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, logprobs


@torch.no_grad()
def target_pass(
    target,
    input_ids: torch.Tensor,
    layer_ids: list[int],
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    logits_to_keep: int | torch.Tensor = 1,
    topk: int = 0,
) -> TargetPass:
    """Run ``target`` once over ``input_ids`` (a continuation of ``cache`` when given), returning the outputs of
    decoder layers ``layer_ids`` and the logits (and with ``topk`` > 0 the top-k) at the positions
    ``logits_to_keep`` selects, as the target's ``forward`` takes it: the last n positions, 0 for all, or an index."""
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=hidden_state_ids(layer_ids),
        logits_to_keep=logits_to_keep,
    )
    states = torch.stack([out.hidden_states[i] for i in hidden_state_ids(layer_ids)], dim=2)
    top = top_k(out.logits, topk) if topk else (None, None)
    return TargetPass(states, out.logits, *top)


def at_tokens(ids: torch.Tensor, logprobs: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k rows (row r: the distribution over token ``first + r``) placed at the tokens they predict:
    ``first`` rows of -1 ids and 0 log-probs (no distribution) before them, so row p is the one over token p."""
    return (
        torch.cat([ids.new_full((first, ids.shape[1]), -1), ids]),
        torch.cat([logprobs.new_zeros((first, logprobs.shape[1])), logprobs]),
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
        # Corpus records name their feature file by id and domain (corpus_format.feature_file); the prompt length
        # places their recorded top-k (row r is the distribution over token prompt_length + r).
        batch["records"] = [
            {"id": r.get("id", ""), "domain": r.get("domain", ""), "prompt_length": r["prompt_length"]}
            for r in records
        ]
        return batch


def missing_soft_targets(features_dir: str | Path, records) -> list[dict]:
    """The records whose feature file exists but holds no top-k distribution (a corpus built with ``--topk 0``).
    Records without a file are not listed: their features and top-k come from the target's forward."""
    from safetensors import safe_open

    missing = []
    for record in records:
        path = feature_file(features_dir, record) if record.get("id") else None
        if path is not None and path.is_file():
            with safe_open(path, framework="pt") as handle:
                if "topk_ids" not in handle.keys():
                    missing.append(record)
    return missing


def soft_targets_error(features_dir, missing: list[dict], total: int) -> ValueError:
    first = missing[0]
    return ValueError(
        f"soft_target_weight > 0: expected the target's top-k in every recorded feature file, got none in "
        f"{len(missing)} of {total} records (first: {first['id']!r}, "
        f"{feature_file(features_dir, first)}); record them with `adaflash corpus --features-dir {features_dir} "
        f"--topk 32`, or set soft_target_weight: 0"
    )


@torch.no_grad()
def sequence_features(
    target, records: list[dict], layer_ids: list[int], features_dir: str | Path | None = None
) -> list[torch.Tensor]:
    """Each record's context features [len - 1, n * H] bf16 (what ``load_features`` returns): read from
    ``features_dir`` where recorded, else from one target forward over the record's token ids (a fresh checkout
    holds no feature files)."""
    features = [load_features(features_dir, r, layer_ids) if features_dir else None for r in records]
    for i, record in enumerate(records):
        if features[i] is None:
            ids = torch.tensor([record["input_ids"]], device=target.device)
            features[i] = target_pass(target, ids, layer_ids).context_features()[0, :-1].to(torch.bfloat16)
    return features


class TargetFeatures:
    """Per batch, the target's context features and (``soft_topk`` > 0) its ``SoftTargets``; see the module docstring.

    The on-the-fly forward takes ``soft_topk`` entries per position; recorded files keep the corpus's ``--topk``."""

    def __init__(
        self, target, target_layer_ids: list[int], features_dir: str | Path | None = None, soft_topk: int = 0
    ):
        self.target = target
        self.layer_ids = list(target_layer_ids)
        self.features_dir = Path(features_dir) if features_dir else None
        self.soft_topk = soft_topk

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, records: list[dict] | None = None
    ) -> tuple[torch.Tensor, SoftTargets | None]:
        """Features [B, S, n * H] in the target's dtype (zeros past each sequence's recorded length: no anchor's
        context reaches its last token) and the soft targets [B, S, k] (None unless ``soft_topk``)."""
        batch, width = input_ids.shape
        features: list[torch.Tensor | None] = [None] * batch
        soft: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * batch
        for i, record in enumerate(records if self.features_dir and records else []):
            if record.get("id"):
                features[i] = load_features(self.features_dir, record, self.layer_ids)
                if features[i] is not None and self.soft_topk:
                    soft[i] = self._recorded(record)
        missing = [i for i, feature in enumerate(features) if feature is None]
        if missing:
            self._forward(input_ids, attention_mask, missing, features, soft)
        out = torch.zeros(
            batch, width, features[0].shape[-1], dtype=self.target.dtype, device=input_ids.device
        )
        for i, feature in enumerate(features):
            out[i, : feature.shape[0]] = feature[:width].to(out.dtype)
        return out, self._stack(soft, width, input_ids.device) if self.soft_topk else None

    def _recorded(self, record: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The record's top-k placed at its tokens: its row r is over response token r, at prompt_length + r."""
        recorded = load_soft_targets(self.features_dir, record)
        if recorded is None:
            raise soft_targets_error(self.features_dir, [record], 1)
        return at_tokens(*recorded, first=record["prompt_length"])

    def _forward(self, input_ids, attention_mask, missing: list[int], features: list, soft: list) -> None:
        rows = torch.tensor(missing, device=input_ids.device)
        fresh = target_pass(
            self.target,
            input_ids[rows],
            self.layer_ids,
            attention_mask=attention_mask[rows],
            # The lm_head over every position is needed only for the soft targets.
            logits_to_keep=0 if self.soft_topk else 1,
            topk=self.soft_topk,
        )
        context = fresh.context_features()
        for slot, i in enumerate(missing):
            features[i] = context[slot]
            if self.soft_topk:
                # Position p's distribution is over token p + 1; the last position predicts nothing in the batch.
                ids, logprobs = fresh.topk_ids[slot, :-1], fresh.topk_logprobs[slot, :-1]
                soft[i] = at_tokens(ids, logprobs, first=1)

    @staticmethod
    def _stack(soft: list[tuple[torch.Tensor, torch.Tensor]], width: int, device) -> SoftTargets:
        k = max(ids.shape[1] for ids, _ in soft)
        ids = torch.full((len(soft), width, k), -1, dtype=torch.long, device=device)
        logprobs = torch.zeros((len(soft), width, k), dtype=torch.float32, device=device)
        for i, (row_ids, row_logprobs) in enumerate(soft):
            n = min(row_ids.shape[0], width)
            ids[i, :n, : row_ids.shape[1]] = row_ids[:n].to(device)
            logprobs[i, :n, : row_ids.shape[1]] = row_logprobs[:n].to(device)
        return SoftTargets(ids=ids, logprobs=logprobs)
