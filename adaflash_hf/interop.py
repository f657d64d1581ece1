"""Move drafters between our checkpoint layout and the layouts serving engines load.

``export_dflash`` writes the z-lab DFlash layout that SGLang (``--speculative-algorithm DFLASH``) and vLLM
(``method: "dflash"``) load: ``config.json`` in z-lab's Qwen3 schema and ``model.safetensors`` with ``layers.*``,
``fc``, ``hidden_norm`` and ``norm``. What z-lab's layout cannot hold goes beside it:

- the length head (and its gamma/min_len) in ``adaflash_length_head.safetensors`` + ``adaflash_length_head.json``;
- a learned mask embedding also as ``mask_embedding.pt`` (a bare ``[hidden]`` tensor), which vLLM's DFlash loader
  reads in place of the target's mask-token row. Engines that ignore the file draft from the placeholder row.

A reduced draft vocabulary (``draft_token_ids``) is a top-level key of ``config.json``: z-lab's loaders build a
``Qwen3Config``, which keeps unknown keys without reading them, so SGLang and vLLM load the checkpoint unchanged and
draft over the full vocabulary; import (and our loader) reads it back.

``format="adaflash-official"`` instead keeps a ``two_model`` head inside ``model.safetensors`` with the
``dflash_config.thresh_head_*`` flags of the official AdaFlash checkpoint (served by SGLang PR #34171).

``import_checkpoint`` reads any layout ``AdaFlashDrafter.from_pretrained`` understands (ours, z-lab DFlash, official
AdaFlash, Muse-Glimmer), plus the sidecar and ``mask_embedding.pt`` when present, and saves ours; export then import
round-trips bitwise. Both accept a target config and refuse a drafter recorded for another target.

CLI: ``adaflash export --format dflash PATH OUT`` and ``adaflash import PATH OUT`` (see ``adaflash_hf.cli``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedConfig
from transformers.initialization import no_init_weights
from transformers.utils import logging

import adaflash_hf
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.modeling.configuration_adaflash import TARGET_FINGERPRINT
from adaflash_hf.modeling.modeling_adaflash import LENGTH_HEAD_ATTRIBUTE, MUSE_GLIMMER_KEY_MAPPING

logger = logging.get_logger(__name__)

EXPORT_FORMATS = ("dflash", "adaflash-official")
SIDECAR_WEIGHTS = "adaflash_length_head.safetensors"
SIDECAR_CONFIG = "adaflash_length_head.json"
SIDECAR_FORMAT_VERSION = 1
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# drafter config field -> target text-config attribute it must equal
_SIDECAR_CONFIG_FIELDS = (
    "length_head_variant",
    "length_head_bottleneck",
    "length_head_gamma",
    "length_head_min_len",
    "learned_mask_embedding",
    *TARGET_FINGERPRINT,
)
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", MASK_EMBEDDING_FILE]


# ---------------------------------------------------------------------------------------------- targets
def load_target_config(target_config: PreTrainedConfig | str | os.PathLike) -> PreTrainedConfig:
    """A target config object, a ``config.json`` file, a model folder or a Hub repo id -> a config object."""
    if isinstance(target_config, PreTrainedConfig):
        return target_config
    path = Path(target_config)
    if path.is_file():
        values = json.loads(path.read_text())
        if "model_type" not in values:
            raise ValueError(
                f"{path}: expected a transformers config with a 'model_type' key, got keys {sorted(values)}"
            )
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        return AutoConfig.from_pretrained(str(target_config))
    except OSError as error:
        raise FileNotFoundError(
            f"target config: expected a config.json file, a model folder or a cached Hub repo id, got {str(target_config)!r} "
            f"({error})"
        ) from error


def check_target_fingerprint(
    config: AdaFlashConfig, target_config: PreTrainedConfig | str | os.PathLike
) -> None:
    """Raise before any weights move when the drafter cannot serve ``target_config`` (see
    ``AdaFlashConfig.check_target_config``)."""
    config.check_target_config(load_target_config(target_config))


def record_target_fingerprint(
    config: AdaFlashConfig, target_config: PreTrainedConfig | str | os.PathLike
) -> None:
    """Check against ``target_config``, then fill fingerprint fields the checkpoint did not record (z-lab's)."""
    check_target_fingerprint(config, target_config)
    text = load_target_config(target_config).get_text_config()
    for field, attribute in TARGET_FINGERPRINT.items():
        if getattr(config, field, None) is None:
            setattr(config, field, getattr(text, attribute))


# ---------------------------------------------------------------------------------------------- loading
def resolve_checkpoint(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint folder, or a Hub repo id fetched through the Hub cache (honours ``HF_HUB_OFFLINE``)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path}: expected a drafter checkpoint folder with config.json, got no config.json"
            )
        return path
    if path.exists():
        raise ValueError(f"checkpoint: expected a folder or a Hub repo id, got the file {path}")
    text = str(source)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(
            f"checkpoint: expected an existing folder or an 'org/name' Hub repo id, got {text!r}"
        )
    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS))
    except Exception as error:  # offline, unknown repo, unknown revision: all mean "not found" to the caller
        raise FileNotFoundError(
            f"checkpoint: expected a local folder or a reachable/cached Hub repo, got {text!r} at revision "
            f"{revision or 'main'} ({type(error).__name__}: {error})"
        ) from error


def _load_mask_embedding(path: Path, hidden_size: int) -> torch.Tensor:
    value = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(value, dict):
        value = value.get("mask_embedding", value.get("embedding", next(iter(value.values()), None)))
    if not isinstance(value, torch.Tensor) or value.numel() != hidden_size:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{path.name}: expected a tensor of {hidden_size} values (hidden_size), got {shape}")
    return value.reshape(hidden_size)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(p for p in folder.glob("*.safetensors") if p.name != SIDECAR_WEIGHTS)
    if not files:
        raise FileNotFoundError(f"{folder}: expected model.safetensors (or shards), got no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    for pattern, replacement in MUSE_GLIMMER_KEY_MAPPING.items():
        tensors = {re.sub(pattern, replacement, key): value for key, value in tensors.items()}
    return tensors


def load_drafter(source: AdaFlashDrafter | str | os.PathLike, revision: str | None = None) -> AdaFlashDrafter:
    """Load a drafter from any supported layout, restoring the AdaFlash sidecar and ``mask_embedding.pt`` if present."""
    if isinstance(source, AdaFlashDrafter):
        return source
    folder = resolve_checkpoint(source, revision)
    sidecar = folder / SIDECAR_CONFIG
    mask_file = folder / MASK_EMBEDDING_FILE
    if not sidecar.is_file() and not mask_file.is_file():
        return AdaFlashDrafter.from_pretrained(folder).eval()

    config = AdaFlashConfig.from_pretrained(folder)
    extra: dict[str, torch.Tensor] = {}
    if sidecar.is_file():
        meta = json.loads(sidecar.read_text())
        if meta.get("format_version") != SIDECAR_FORMAT_VERSION:
            raise ValueError(
                f"{SIDECAR_CONFIG}: format_version expected {SIDECAR_FORMAT_VERSION}, got {meta.get('format_version')!r}"
            )
        for field in _SIDECAR_CONFIG_FIELDS:
            if field in meta:
                setattr(config, field, meta[field])
        if (folder / SIDECAR_WEIGHTS).is_file():
            with safe_open(folder / SIDECAR_WEIGHTS, framework="pt") as handle:
                extra = {key: handle.get_tensor(key) for key in handle.keys()}
    if "mask_embedding" not in extra and mask_file.is_file():
        config.learned_mask_embedding = True
        extra["mask_embedding"] = _load_mask_embedding(mask_file, config.hidden_size)
    config.validate_architecture()

    tensors = _read_safetensors(folder) | extra
    dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.get_default_dtype()
    if "mask_embedding" in tensors:
        tensors["mask_embedding"] = tensors["mask_embedding"].to(dtype)
    with no_init_weights():
        drafter = AdaFlashDrafter(config).to(dtype)
    expected = set(drafter.state_dict())
    head_keys = set(drafter.length_head_parameter_names())
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    fresh_head = bool(head_keys) and head_keys <= missing and not sidecar.is_file()
    if fresh_head:
        missing -= head_keys
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder}: expected exactly the tensors of a {config.source_layout} drafter "
            f"(plus {SIDECAR_WEIGHTS}/{MASK_EMBEDDING_FILE}), got missing keys {sorted(missing)}, "
            f"unexpected keys {sorted(unexpected)}"
        )
    shapes = {name: tuple(tensor.shape) for name, tensor in drafter.state_dict().items()}
    for key, value in tensors.items():
        if tuple(value.shape) != shapes[key]:
            raise ValueError(f"{key}: expected shape {shapes[key]}, got {tuple(value.shape)}")
    drafter.load_state_dict(tensors, strict=not fresh_head)
    if fresh_head:
        drafter.length_head.apply(drafter._init_weights)
        warnings.warn(
            f"{source} has no length head: the {config.length_head_variant!r} head was freshly initialised and "
            "predicts nothing useful until trained.",
            UserWarning,
            stacklevel=2,
        )
    return drafter.eval()


# ---------------------------------------------------------------------------------------------- writing
def _prepare_out(out: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(
                f"out: expected a new or empty folder (or overwrite=True), got the non-empty {out}"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _finish(staging: Path, out: Path) -> Path:
    """Move a fully written staging folder into place, so a failed write never leaves a half checkpoint at ``out``."""
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(staging, out)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dflash_config_dict(config: AdaFlashConfig, dtype: torch.dtype, format: str = "dflash") -> dict[str, Any]:
    """``config.json`` in z-lab's ``DFlashDraftModel`` schema (``model_type='qwen3'``, ``dflash_config``)."""
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": 1e6})
    default_rope = rope.get("rope_type", "default") == "default"
    dflash_config: dict[str, Any] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
    }
    if format == "adaflash-official":
        dflash_config |= {
            "use_thresh_head_two_model": True,
            "thresh_head_bottleneck_dim": config.length_head_bottleneck,
            "thresh_head_direct_len": True,
        }
    values: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "block_size": config.block_size,
        "bos_token_id": config.bos_token_id,
        "dflash_config": dflash_config,
        "eos_token_id": config.eos_token_id,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "layer_types": list(config.layer_types),
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "pad_token_id": config.pad_token_id,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_scaling": None if default_rope else {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_theta": rope.get("rope_theta"),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": config.vocab_size,
    }
    if (
        not default_rope
    ):  # transformers >= 5 reads rope_parameters; older readers use rope_theta + rope_scaling
        values["rope_parameters"] = rope
    if config.draft_token_ids is not None:  # ignored by z-lab loaders (see the module docstring)
        values["draft_token_ids"] = list(config.draft_token_ids)
    if config.target_num_hidden_layers is not None:
        values["num_target_layers"] = config.target_num_hidden_layers
    else:
        logger.warning(
            "num_target_layers: the drafter does not record its target's depth; config.json omits it"
        )
    return values


def export_dflash(
    source: AdaFlashDrafter | str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str = "dflash",
    target_config: PreTrainedConfig | str | os.PathLike | None = None,
    revision: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``source`` (a drafter, a folder in any supported layout, or a Hub repo id) to ``out`` for serving engines.

    See the module docstring for the files written. Returns ``out``.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format: expected one of {EXPORT_FORMATS}, got {format!r}")
    out = _prepare_out(out, overwrite)
    drafter = load_drafter(source, revision)
    config = drafter.config
    if target_config is not None:
        check_target_fingerprint(config, target_config)
    if format == "adaflash-official" and config.length_head_variant != "two_model":
        raise ValueError(
            "length_head_variant: expected 'two_model' for format='adaflash-official' (the official checkpoint holds "
            f"only ThreshHeadTwoModel), got {config.length_head_variant!r}; use format='dflash'"
        )
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in drafter.state_dict().items()}
    head = {name: state.pop(name) for name in drafter.length_head_parameter_names()}
    mask_embedding = state.pop("mask_embedding", None)
    if format == "adaflash-official":
        state |= head
        head = {}
    sidecar_tensors = head | ({"mask_embedding": mask_embedding} if mask_embedding is not None else {})
    dtype = state["fc.weight"].dtype

    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config_dict = dflash_config_dict(config, dtype, format)
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        if sidecar_tensors:
            save_file(sidecar_tensors, staging / SIDECAR_WEIGHTS, metadata={"format": "pt"})
        meta = {
            "format_version": SIDECAR_FORMAT_VERSION,
            "adaflash_hf_version": adaflash_hf.__version__,
            "export_format": format,
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "length_head_module": LENGTH_HEAD_ATTRIBUTE[config.length_head_variant],
            "tensors": sorted(sidecar_tensors),
            **{field: getattr(config, field) for field in _SIDECAR_CONFIG_FIELDS},
        }
        (staging / SIDECAR_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if mask_embedding is not None:
            torch.save(mask_embedding.clone(), staging / MASK_EMBEDDING_FILE)
            logger.warning(
                "learned_mask_embedding: z-lab's layout has no slot for a learned mask vector; it is written to "
                f"{MASK_EMBEDDING_FILE} (read by vLLM's DFlash loader) and {SIDECAR_WEIGHTS}. Engines that ignore "
                f"both use the target's row {config.mask_token_id} instead and draft poorly."
            )
        return _finish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def import_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    target_config: PreTrainedConfig | str | os.PathLike | None = None,
    revision: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a z-lab DFlash, official AdaFlash, Muse-Glimmer or exported checkpoint (folder or Hub repo id) to ours.

    With ``target_config`` the drafter is checked against the target and fingerprint fields the source did not record
    are filled in. Returns ``out``; a failure leaves ``out`` untouched.
    """
    out = _prepare_out(out, overwrite)
    drafter = load_drafter(source, revision)
    if target_config is not None:
        record_target_fingerprint(drafter.config, target_config)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        drafter.save_pretrained(staging)
        return _finish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
