"""Move drafters between our checkpoint layout and the layouts serving engines load.

``export_dflash`` writes the z-lab DFlash layout that SGLang (``--speculative-algorithm DFLASH``) and vLLM
(``method: "dflash"``) load: ``config.json`` in z-lab's Qwen3 schema and ``model.safetensors`` with ``layers.*``,
``fc``, ``hidden_norm`` and ``norm``. What z-lab's layout cannot hold goes beside it:

- the length head (and its gamma/min_len) in ``adaflash/length_head.safetensors`` + ``adaflash_length_head.json``: in
  a subfolder, because vLLM and SGLang load every ``*.safetensors`` file of the root as draft weights (vLLM refuses
  unknown tensors there; SGLang's DFlash loader skips them), so the folder loads in both as written;
- a learned mask embedding also as ``mask_embedding.pt`` (a bare ``[hidden]`` tensor), which vLLM's DFlash loader
  reads in place of the target's mask-token row. Engines that ignore the file draft from the placeholder row.

A reduced draft vocabulary (``draft_token_ids``) is a top-level key of ``config.json``: z-lab's loaders build a
``Qwen3Config``, which keeps unknown keys without reading them, so SGLang and vLLM load the checkpoint unchanged and
draft over the full vocabulary; import (and our loader) reads it back.

``format="adaflash-official"`` instead keeps a ``two_model`` head inside ``model.safetensors`` with the
``dflash_config.thresh_head_*`` flags of the official AdaFlash checkpoint (served by SGLang PR #34171).

``import_checkpoint`` reads any layout ``AdaFlashDrafter.from_pretrained`` understands (ours, z-lab DFlash, official
AdaFlash, Muse-Glimmer, and an export with its sidecar and ``mask_embedding.pt``) and saves ours; export then import
round-trips bitwise. Both accept a target config and refuse a drafter recorded for another target.

CLI: ``adaflash export --format dflash PATH OUT`` and ``adaflash import PATH OUT`` (see ``adaflash_hf.cli``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import snapshot_download
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedConfig
from transformers.utils import logging

from adaflash_hf.assets import looks_like_a_missing_folder
from adaflash_hf.atomic import atomic_folder, blocking_file, read_json
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.modeling.configuration_adaflash import TARGET_FINGERPRINT
from adaflash_hf.modeling.sidecar_adaflash import (
    MASK_EMBEDDING_FILE,
    SIDECAR_CONFIG,
    SIDECAR_CONFIG_FIELDS,
    SIDECAR_FORMAT_VERSION,
    SIDECAR_WEIGHTS,
)
from adaflash_hf.version import __version__

logger = logging.get_logger(__name__)

EXPORT_FORMATS = ("dflash", "adaflash-official")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", MASK_EMBEDDING_FILE]


# ---------------------------------------------------------------------------------------------- targets
def load_target_config(target_config: PreTrainedConfig | str | os.PathLike) -> PreTrainedConfig:
    """A target config object, a ``config.json`` file, a model folder or a Hub repo id -> a config object."""
    if isinstance(target_config, PreTrainedConfig):
        return target_config
    path = Path(target_config)
    if looks_like_a_missing_folder(str(target_config)):
        raise FileNotFoundError(
            f"target_config: expected a config.json file, a model folder or a cached Hub repo id, got "
            f"{str(target_config)!r}, a path where nothing exists"
        )
    if path.is_file():
        values = read_json(path)
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError(
                f"{path}: expected a transformers config with a 'model_type' key, got "
                + (f"keys {sorted(values)}" if isinstance(values, dict) else type(values).__name__)
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


def load_drafter(source: AdaFlashDrafter | str | os.PathLike, revision: str | None = None) -> AdaFlashDrafter:
    """A drafter, or one loaded by ``AdaFlashDrafter.from_pretrained`` (every layout, the export's sidecar and
    ``mask_embedding.pt`` included) from a folder or a Hub repo id."""
    if isinstance(source, AdaFlashDrafter):
        return source
    return AdaFlashDrafter.from_pretrained(resolve_checkpoint(source, revision)).eval()


# ---------------------------------------------------------------------------------------------- writing
def check_out_folder(out: str | os.PathLike, overwrite: bool, hint: str = "overwrite=True") -> None:
    """Raise unless ``out`` is new, an empty folder, or a folder and ``overwrite`` is set (``hint`` names that switch):
    a file is never replaced."""
    out = Path(out)
    blocker = blocking_file(out)
    if blocker == out:
        raise FileExistsError(
            f"out: expected a folder to write (new, empty, or with {hint} a folder), got the file {out}"
        )
    if blocker is not None:
        raise FileExistsError(f"out: expected a folder to write, got {out}, inside the file {blocker}")
    if not overwrite and out.exists() and any(out.iterdir()):
        raise FileExistsError(f"out: expected a new or empty folder (or {hint}), got the non-empty {out}")


def _prepare_out(out: str | os.PathLike, overwrite: bool) -> Path:
    check_out_folder(out, overwrite)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
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

    with atomic_folder(out) as staging:
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config_dict = dflash_config_dict(config, dtype, format)
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        if sidecar_tensors:
            (staging / SIDECAR_WEIGHTS).parent.mkdir()
            save_file(sidecar_tensors, staging / SIDECAR_WEIGHTS, metadata={"format": "pt"})
        meta = {
            "format_version": SIDECAR_FORMAT_VERSION,
            "adaflash_hf_version": __version__,
            "export_format": format,
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "length_head_module": drafter.length_head_name,
            "tensors": sorted(sidecar_tensors),
            **{field: getattr(config, field) for field in SIDECAR_CONFIG_FIELDS},
        }
        (staging / SIDECAR_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if mask_embedding is not None:
            torch.save(mask_embedding.clone(), staging / MASK_EMBEDDING_FILE)
            logger.warning(
                "learned_mask_embedding: z-lab's layout has no slot for a learned mask vector; it is written to "
                f"{MASK_EMBEDDING_FILE} (read by vLLM's DFlash loader) and {SIDECAR_WEIGHTS}. Engines that ignore "
                f"both use the target's row {config.mask_token_id} instead and draft poorly."
            )
    return out


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
    with atomic_folder(out) as staging:
        drafter.save_pretrained(staging)
    return out
