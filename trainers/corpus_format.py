"""The training corpus on disk: what ``adaflash corpus`` writes (``corpus.py``) and training reads.

- ``<out_dir>/<domain>.jsonl.gz``: one record ``{"id", "domain", "input_ids", "prompt_length"}`` per line (gzip
  members appended batch by batch; small enough to commit);
- ``<features_dir>/<domain>/<sha1(id)>.safetensors``: ``features`` [len(input_ids) - 1, n_layers, hidden] bf16 (the
  outputs of ``layer_ids``, i.e. ``hidden_states[id + 1]``, for every position but the last, which no anchor's context
  reaches), with the layer ids in the file's metadata; with ``topk`` > 0 also the target's distribution over each
  response token, ``topk_ids`` [len(response), topk] int32 and ``topk_logprobs`` fp16 (log-softmax over the whole
  vocabulary, clamped at -60; row r predicts response token r, so under greedy ``topk_ids[r, 0] == response[r]``):
  the soft targets of the drafter's KL arm.
- ``<out_dir>/corpus_settings.json``: the settings that shaped the corpus (target, dtype, max_new_tokens, layer ids,
  topk), checked by ``check_settings`` whenever the builder resumes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.utils import logging

from adaflash_hf.atomic import atomic_write, read_json

logger = logging.get_logger(__name__)


def corpus_file(out_dir: str | Path, domain: str) -> Path:
    return Path(out_dir) / f"{domain}.jsonl.gz"


def feature_file(features_dir: str | Path, record: dict) -> Path:
    digest = hashlib.sha1(record["id"].encode()).hexdigest()[:24]
    return Path(features_dir) / record["domain"] / f"{digest}.safetensors"


def read_corpus(out_dir: str | Path, domains: Iterable[str]) -> list[dict]:
    """Records of ``domains`` from ``out_dir``, in file order; a missing domain file is an error naming it."""
    records = []
    for domain in domains:
        path = corpus_file(out_dir, domain)
        if not path.is_file():
            raise FileNotFoundError(
                f"corpus file: expected {path} (build it with `adaflash corpus --out-dir {out_dir}`), found nothing"
            )
        records.extend(read_jsonl_gz(path))
    return records


def drop_prompt_twins(records: list[dict], prompts: Iterable[Iterable[int]]) -> tuple[list[dict], int]:
    """``records`` without those whose prompt (``input_ids[:prompt_length]``) is one of ``prompts`` (token ids), and
    how many were dropped: a training sequence whose prompt is also a held-out prompt (ShareGPT repeats some first turns
    under different conversation ids) would inflate every held-out figure."""
    excluded = {tuple(ids) for ids in prompts}
    kept = [r for r in records if tuple(r["input_ids"][: r["prompt_length"]]) not in excluded]
    return kept, len(records) - len(kept)


def read_jsonl_gz(path: Path) -> list[dict]:
    records = []
    try:
        with gzip.open(path, "rt") as handle:
            for line in handle:
                if line.strip():
                    records.append(json.loads(line))
    except (EOFError, json.JSONDecodeError):
        # A run killed mid-write leaves a truncated last member: the complete records before it are kept.
        logger.warning(f"{path}: truncated after {len(records)} records (interrupted run); keeping those")
    return records


def is_truncated(path: Path) -> bool:
    try:
        with gzip.open(path, "rb") as handle:
            while handle.read(1 << 20):
                pass
    except EOFError:
        return True
    return False


def load_features(features_dir: str | Path, record: dict, layer_ids: list[int]) -> torch.Tensor | None:
    """Context features ``cat(hidden_states[id + 1] for id in layer_ids)`` [len - 1, n * H] bf16, or None if absent."""
    path = feature_file(features_dir, record)
    if not path.is_file():
        return None
    with safe_open(path, framework="pt") as handle:
        stored = [int(i) for i in handle.metadata()["layer_ids"].split(",")]
    missing = [i for i in layer_ids if i not in stored]
    if missing:
        raise ValueError(
            f"features of {record['id']}: expected layers {layer_ids}, file {path} has only {stored}"
        )
    features = load_file(path)["features"]  # [L - 1, n_stored, H]
    return features[:, [stored.index(i) for i in layer_ids]].flatten(1)


SETTINGS_FILE = "corpus_settings.json"
# Settings that change the token ids (a mismatch is refused) and those that change only the features (rebuilt).
TOKEN_SETTINGS = ("target", "dtype", "max_new_tokens")
FEATURE_SETTINGS = ("layer_ids", "topk")


def check_settings(out_dir: str | Path, settings: dict, rebuild: bool = False) -> list[str]:
    """Compare ``settings`` with those recorded in ``out_dir`` and record them; returns the changed feature settings.

    A corpus written before settings were recorded adopts ``settings`` (with a warning). A different target, dtype or
    ``max_new_tokens`` is an error naming the setting, unless ``rebuild`` (then the caller starts afresh)."""
    path = Path(out_dir) / SETTINGS_FILE
    recorded = read_json(path) if path.is_file() else None
    if recorded is None and any(Path(out_dir).glob("*.jsonl.gz")):
        logger.warning(
            f"{out_dir}: no {SETTINGS_FILE} (a corpus from before settings were kept); recording {settings}"
        )
    changed_features: list[str] = []
    if recorded is not None and not rebuild:
        for name in TOKEN_SETTINGS:
            if recorded.get(name) != settings[name]:
                raise ValueError(
                    f"corpus {out_dir}: expected {name}={recorded.get(name)!r} (the setting its responses were "
                    f"generated with, {path}), got {settings[name]!r}; pass --rebuild to regenerate those domains, or "
                    f"use another --out-dir"
                )
        changed_features = [n for n in FEATURE_SETTINGS if recorded.get(n) != settings[n]]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")
    return changed_features


def save_features(
    features_dir: str | Path,
    record: dict,
    features: torch.Tensor,
    layer_ids: list[int],
    distribution: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write one record's feature file (``features``, and ``topk_ids`` / ``topk_logprobs`` when given), atomically:
    a run killed mid-write leaves no half file that a later run would take as complete."""
    path = feature_file(features_dir, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"features": features}
    if distribution is not None:
        tensors["topk_ids"], tensors["topk_logprobs"] = distribution
    metadata = {"layer_ids": ",".join(map(str, layer_ids))}
    # Not fsynced: a lost file is rebuilt from the committed token ids (rebuild_features), so a power loss costs little.
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), durable=False)


def load_soft_targets(features_dir: str | Path, record: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k distribution over each response token, ``(topk_ids [R, k] long, topk_logprobs [R, k]
    float)``, or None when the record's feature file has none."""
    path = feature_file(features_dir, record)
    if not path.is_file():
        return None
    with safe_open(path, framework="pt") as handle:
        if "topk_ids" not in handle.keys():
            return None
        return handle.get_tensor("topk_ids").long(), handle.get_tensor("topk_logprobs").float()


def features_complete(features_dir: str | Path, record: dict, layer_ids: list[int], topk: int) -> bool:
    path = feature_file(features_dir, record)
    if not path.is_file():
        return False
    try:
        with safe_open(path, framework="pt") as handle:
            stored = [int(i) for i in handle.metadata()["layer_ids"].split(",")]
            has_topk = "topk_ids" in handle.keys() and handle.get_slice("topk_ids").get_shape()[-1] >= topk
    except Exception:  # an unreadable file is rebuilt, not trusted
        return False
    return all(i in stored for i in layer_ids) and (topk == 0 or has_topk)


def stored_distribution(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k ``(ids, log-probs)`` (``target_features.top_k``) as a feature file keeps it: int32 ids and fp16
    log-probs clamped at -60 (fp16 has no room below; nothing that unlikely matters to a KL)."""
    return ids.to(torch.int32).contiguous(), logprobs.clamp(min=-60.0).to(torch.float16).contiguous()
