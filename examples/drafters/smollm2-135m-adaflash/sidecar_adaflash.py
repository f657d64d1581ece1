"""What an exported drafter keeps beside z-lab's weights, and reading it back (remote code, like its siblings).

z-lab's DFlash layout has no slot for the length head or a learned mask embedding. ``adaflash export --format dflash``
(``adaflash_hf.interop``) writes them beside it: the head's tensors in ``adaflash/length_head.safetensors`` with its
settings in ``adaflash_length_head.json`` (the sidecar), and a learned mask embedding also as ``mask_embedding.pt`` (a
bare tensor, which vLLM's DFlash loader reads). The tensors sit in a subfolder because vLLM and SGLang load every
``*.safetensors`` file of the folder's root as draft weights; exports that kept them in the root
(``adaflash_length_head.safetensors``) still load here. ``AdaFlashDrafter.from_pretrained`` reads them back here, from a
folder or a Hub repo, so an exported folder loads exactly as the drafter it came from.

This file imports only ``.configuration_adaflash``: ``modeling_adaflash.py`` imports it with a single dot, so
``save_pretrained`` copies it beside the weights and Hub remote code finds it.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from transformers.utils import cached_file

from .configuration_adaflash import TARGET_FINGERPRINT

SIDECAR_WEIGHTS = "adaflash/length_head.safetensors"
ROOT_SIDECAR_WEIGHTS = "adaflash_length_head.safetensors"  # where older exports kept them
SIDECAR_CONFIG = "adaflash_length_head.json"
SIDECAR_FORMAT_VERSION = 1
MASK_EMBEDDING_FILE = "mask_embedding.pt"
SIDECAR_CONFIG_FIELDS = (
    "length_head_variant",
    "length_head_bottleneck",
    "length_head_gamma",
    "length_head_min_len",
    "learned_mask_embedding",
    *TARGET_FINGERPRINT,
)
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def _optional_file(pretrained, filename: str, kwargs: dict) -> str | None:
    """``filename`` of a local folder or Hub repo (through the Hub cache), or None where it has none."""
    hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    return cached_file(
        str(pretrained),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub,
    )


def _read_safetensors(path, keys: bool = True) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()} if keys else {}
    except SafetensorError as error:
        raise ValueError(
            f"{path}: expected a complete safetensors file, got one that cannot be read ({error})"
        ) from error


def _read_mask_embedding(path) -> torch.Tensor:
    value = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(value, dict):
        value = value.get("mask_embedding", value.get("embedding", next(iter(value.values()), None)))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{path}: expected a tensor of hidden_size values, got {type(value).__name__}")
    return value


def read_sidecar(pretrained, kwargs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config values and tensors an exported folder keeps beside its z-lab weights ({} and {} without any)."""
    overrides: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    meta_file = _optional_file(pretrained, SIDECAR_CONFIG, kwargs)
    if meta_file is not None:
        try:
            with open(meta_file) as handle:
                meta = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{meta_file}: expected valid JSON, got {error.msg} at line {error.lineno}, column {error.colno}"
            ) from None
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_file}: expected a JSON object, got {type(meta).__name__}")
        if meta.get("format_version") != SIDECAR_FORMAT_VERSION:
            raise ValueError(
                f"{SIDECAR_CONFIG}: format_version expected {SIDECAR_FORMAT_VERSION}, got {meta.get('format_version')!r}"
            )
        overrides = {field: meta[field] for field in SIDECAR_CONFIG_FIELDS if field in meta}
        weights = _optional_file(pretrained, SIDECAR_WEIGHTS, kwargs) or _optional_file(
            pretrained, ROOT_SIDECAR_WEIGHTS, kwargs
        )
        if weights is not None:
            tensors = _read_safetensors(weights)
    mask_file = _optional_file(pretrained, MASK_EMBEDDING_FILE, kwargs)
    if "mask_embedding" not in tensors and mask_file is not None:
        overrides["learned_mask_embedding"] = True
        tensors["mask_embedding"] = _read_mask_embedding(mask_file)
    return overrides, tensors


def load_sidecar_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    unexpected = sorted(set(tensors) - set(state))
    if unexpected:
        raise ValueError(
            f"{SIDECAR_WEIGHTS}: expected length-head and mask_embedding tensors of this drafter, got unexpected "
            f"keys {unexpected}"
        )
    for key, value in tensors.items():
        if key == "mask_embedding" and value.numel() == state[key].numel():
            value = value.reshape(state[key].shape)  # mask_embedding.pt may hold [1, hidden]
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(f"{key}: expected shape {tuple(state[key].shape)}, got {tuple(value.shape)}")
        with torch.no_grad():
            state[key].copy_(value)


def check_safetensors_readable(folder: str) -> None:
    """Name a truncated ``*.safetensors`` file of a local ``folder`` before transformers' nameless error can."""
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                _read_safetensors(os.path.join(folder, name), keys=False)


def check_loaded_tensors(model: nn.Module, path, problems_on_load: dict, info: dict, sidecar: dict) -> None:
    """Raise unless ``model`` got exactly the tensors of its layout: ``problems_on_load`` are transformers' missing,
    unexpected and mismatched keys, ``sidecar`` the tensors restored beside an export. The one exception, a DFlash or
    Muse-Glimmer checkpoint without a sidecar (no length head), keeps its fresh head with a warning."""
    head_keys = set(model.length_head_parameter_names())
    missing = set(problems_on_load.get("missing_keys") or ()) - set(sidecar)
    fresh_head = (
        model.config.source_layout in ("dflash", "muse_glimmer") and head_keys and head_keys <= missing
    )
    if fresh_head:
        missing -= head_keys
    problems = []
    if missing:
        problems.append(f"missing keys {sorted(missing)}")
    if problems_on_load.get("unexpected_keys"):
        problems.append(f"unexpected keys {sorted(problems_on_load['unexpected_keys'])}")
    if problems_on_load.get("mismatched_keys"):
        problems.append(f"wrong-shaped keys {sorted(map(str, problems_on_load['mismatched_keys']))}")
    if info.get("error_msgs"):
        problems.append(f"errors {info['error_msgs']}")
    if problems:
        raise ValueError(
            f"checkpoint {path}: expected exactly the tensors of the {model.config.source_layout!r} layout "
            f"(plus {SIDECAR_WEIGHTS} / {MASK_EMBEDDING_FILE} beside an export), got " + "; ".join(problems)
        )
    if fresh_head:
        warnings.warn(
            f"{path} is a {model.config.source_layout} checkpoint without a length head: "
            f"the {model.config.length_head_variant!r} length head was freshly initialised and predicts nothing "
            "useful until trained; use length_mode='fixed' or train the head.",
            UserWarning,
            stacklevel=3,
        )
