"""What offline drafter training reads per batch: padded token sequences (``SequenceCollator``) and the frozen target's
part of them (``TargetFeatures``): context features ``cat(hidden_states[id + 1])`` and, for the soft-target loss, the
target's top-k distribution over each token.

Both come from the feature files the corpus builder recorded (``adaflash corpus --features-dir``), else from one target
forward over the batch's remaining rows. Nothing is cached here: the corpus builder is the one writer of feature files,
so a feature on disk always carries the corpus's layer ids and settings; on a GPU the forward costs less than the read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaflash_hf.trainers.corpus import feature_file, load_features, load_soft_targets
from adaflash_hf.trainers.dflash_recipe import SoftTargets


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
        # Corpus records name their feature file by id and domain (adaflash_hf.trainers.corpus.feature_file); the prompt length
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
            hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
            features[i] = torch.cat([hidden[j + 1] for j in layer_ids], dim=-1)[0, :-1].to(torch.bfloat16)
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
        """The record's top-k placed at its positions: row r at prompt_length + r, -1 ids before the response."""
        recorded = load_soft_targets(self.features_dir, record)
        if recorded is None:
            raise soft_targets_error(self.features_dir, [record], 1)
        ids, logprobs = recorded
        prompt = record["prompt_length"]
        ids = torch.cat([ids.new_full((prompt, ids.shape[1]), -1), ids])
        return ids, torch.cat([logprobs.new_zeros((prompt, logprobs.shape[1])), logprobs])

    def _forward(self, input_ids, attention_mask, missing: list[int], features: list, soft: list) -> None:
        rows = torch.tensor(missing, device=input_ids.device)
        out = self.target(
            input_ids=input_ids[rows],
            attention_mask=attention_mask[rows],
            output_hidden_states=[i + 1 for i in self.layer_ids],
            # The lm_head over every position is needed only for the soft targets.
            logits_to_keep=0 if self.soft_topk else 1,
        )
        fresh = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        for slot, i in enumerate(missing):
            features[i] = fresh[slot]
        if self.soft_topk:
            # The logits at position p - 1 are the distribution over token p, as the corpus records it.
            logprobs, ids = torch.log_softmax(out.logits[:, :-1].float(), dim=-1).topk(self.soft_topk, dim=-1)
            none_ids, none_logprobs = (
                ids.new_full((1, ids.shape[-1]), -1),
                logprobs.new_zeros((1, ids.shape[-1])),
            )
            for slot, i in enumerate(missing):
                soft[i] = (torch.cat([none_ids, ids[slot]]), torch.cat([none_logprobs, logprobs[slot]]))

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
