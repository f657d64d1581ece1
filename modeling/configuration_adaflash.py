"""AdaFlashConfig: the drafter's settings (Qwen3-style layers, DFlash block, length head, target fingerprint).

Also reads the config layouts of published drafters (z-lab DFlash, the official AdaFlash checkpoint and
transformers' Muse-Glimmer assistant) so that ``AdaFlashDrafter.from_pretrained`` loads them directly.
"""

from __future__ import annotations

import inspect
import os
import types
from functools import cache
from typing import Any, Union, get_args, get_origin

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

LENGTH_HEAD_VARIANTS = ("two_model", "paper")
SOURCE_LAYOUTS = ("adaflash", "dflash", "adaflash_official", "muse_glimmer")
# Drafter config field -> target text-config attribute it records.
TARGET_FINGERPRINT = {
    "target_model_type": "model_type",
    "target_hidden_size": "hidden_size",
    "target_vocab_size": "vocab_size",
    "target_num_hidden_layers": "num_hidden_layers",
}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's choice of target layers: the middle one for a single layer, else evenly spaced from 1 to L-3."""
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers: expected >= 1, got {num_target_layers}")
    if num_draft_layers <= 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start < num_draft_layers - 1:  # tiny targets: spread over every layer instead
        start, end = 0, num_target_layers - 1
    span = end - start
    return [start + round(i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def hidden_state_ids(layer_ids) -> list[int]:
    """The ``hidden_states`` indices of the outputs of target decoder layers ``layer_ids``: ``id + 1`` each (index 0
    holds the embeddings), as ``output_hidden_states=`` takes them."""
    return [i + 1 for i in layer_ids]


def check_local_path(pretrained_model_name_or_path) -> None:
    """Raise FileNotFoundError for a missing local path: a path object, or a name no Hub repo id can be (``./x``,
    ``/x``, ``~/x``, ``a/b/c``, a backslash), and ValueError for a file (``model.safetensors``), instead of the Hub's
    "Repo id must be in the form ..." later."""
    text = str(pretrained_model_name_or_path)
    path_like = (
        isinstance(pretrained_model_name_or_path, os.PathLike)
        or text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") > 1
    )
    if path_like and not os.path.exists(text):
        raise FileNotFoundError(
            f"pretrained_model_name_or_path: expected an existing drafter folder or an 'org/name' Hub repo id, "
            f"got {text!r}, which does not exist"
        )
    if os.path.isfile(text):
        raise ValueError(
            f"pretrained_model_name_or_path: expected a drafter folder (config.json beside the weights) or an "
            f"'org/name' Hub repo id, got the file {text!r}; pass its folder "
            f"{os.path.dirname(os.path.abspath(text))!r}"
        )


def check_rope_parameters(rope_parameters: dict) -> None:
    """Raise unless ``rope_type`` is one AdaFlashRotaryEmbedding can build (transformers only warns about others)."""
    allowed = ("default", *ROPE_INIT_FUNCTIONS)
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in allowed:
        raise ValueError(f"rope_parameters.rope_type: expected one of {allowed}, got {rope_type!r}")


def check_draft_token_ids(token_ids: list[int], vocab_size: int | None) -> None:
    """Raise unless ``token_ids`` is a non-empty, strictly increasing list of ids inside ``vocab_size``."""
    if not token_ids:
        raise ValueError(
            "draft_token_ids: expected a non-empty sorted list of target token ids (or None for the full "
            "vocabulary), got []"
        )
    for position, (previous, current) in enumerate(zip(token_ids, token_ids[1:]), start=1):
        if current <= previous:
            raise ValueError(
                f"draft_token_ids: expected strictly increasing ids (sorted, no duplicates), got {current} after "
                f"{previous} at index {position}"
            )
    if token_ids[0] < 0:
        raise ValueError(f"draft_token_ids: expected ids >= 0, got {token_ids[0]}")
    if vocab_size is not None and token_ids[-1] >= vocab_size:
        raise ValueError(
            f"draft_token_ids: expected ids in 0..{vocab_size - 1} (vocab_size={vocab_size}), got {token_ids[-1]}"
        )


def _matches(value: Any, expected: Any) -> bool:
    """``isinstance`` for the annotations of AdaFlashConfig, where a bool is not an int and an int is a float."""
    origin = get_origin(expected)
    if origin in (Union, types.UnionType):
        return any(_matches(value, option) for option in get_args(expected))
    if origin is list:
        return isinstance(value, list) and all(_matches(item, get_args(expected)[0]) for item in value)
    if expected is type(None):
        return value is None
    if expected in (int, float) and isinstance(value, bool):
        return False
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin or expected)


def _type_name(expected: Any) -> str:
    return expected.__name__ if isinstance(expected, type) else str(expected)


def check_field_types(config: AdaFlashConfig) -> None:
    """Raise a ValueError naming the first field whose value does not match its annotation (e.g. block_size 16.5)."""
    for name, expected in _field_types().items():
        value = getattr(config, name)
        if not _matches(value, expected):
            raise ValueError(
                f"{name}: expected {_type_name(expected)}, got {value!r} ({type(value).__name__})"
            )


@strict(accept_kwargs=True)
class AdaFlashConfig(PreTrainedConfig):
    r"""
    Configuration of an [`AdaFlashDrafter`].

    The layer hyper-parameters follow Qwen3 (the architecture of published DFlash drafters). ``hidden_size`` must equal
    the target's hidden size, because the drafter reads the target's embeddings and its states go through the target's
    lm_head. ``target_layer_ids`` are 0-indexed target decoder layers whose *outputs* (``hidden_states[id + 1]``) form
    the context. ``mask_token_id`` is a row of the target embedding used for the masked block positions; targets whose
    vocabulary has no spare row set ``learned_mask_embedding=True`` and the drafter owns a learned mask vector instead.

    ``draft_token_ids`` (sorted target ids, e.g. from ``adaflash_hf.draft_vocab.build_draft_vocab``) restricts the
    drafter's logits to those lm_head rows (EAGLE-3 / FR-Spec's reduced draft vocabulary); None drafts over the whole
    vocabulary. It adds no parameter, so the weights stay z-lab DFlash tensors.

    The length head predicts the accepted fraction â of a block; the draft is truncated to
    ``k̂ = clamp(floor(length_head_gamma * â * (block_size - 1)), length_head_min_len, block_size - 1)``.
    """

    model_type = "adaflash"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int | None = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    learned_mask_embedding: bool = False
    draft_token_ids: list[int] | None = None

    target_model_type: str | None = None
    target_hidden_size: int | None = None
    target_vocab_size: int | None = None
    target_num_hidden_layers: int | None = None

    length_head_variant: str = "two_model"
    length_head_bottleneck: int = 256
    length_head_gamma: float = 1.0
    length_head_min_len: int = 1

    source_layout: str = "adaflash"

    def __post_init__(self, **kwargs):
        # The strict dataclass cannot check types here (the annotations are strings), and a float block_size or a
        # string hidden_size would only fail later, far from the config: check them first, by name.
        check_field_types(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None and self.target_num_hidden_layers is not None:
            self.target_layer_ids = build_target_layer_ids(
                self.target_num_hidden_layers, self.num_hidden_layers
            )
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Checks that need nothing but the config; target-dependent checks live in ``AdaFlashDrafter.check_target``."""
        if self.block_size < 2:
            raise ValueError(
                f"block_size: expected >= 2 (one anchor plus at least one draft), got {self.block_size}"
            )
        if self.length_head_variant not in LENGTH_HEAD_VARIANTS:
            raise ValueError(
                f"length_head_variant: expected one of {LENGTH_HEAD_VARIANTS}, got {self.length_head_variant!r}"
            )
        if not 0 <= self.length_head_min_len <= self.block_size - 1:
            raise ValueError(
                f"length_head_min_len: expected 0..{self.block_size - 1} (block_size - 1), got {self.length_head_min_len}"
            )
        if self.length_head_gamma <= 0:
            raise ValueError(f"length_head_gamma: expected > 0, got {self.length_head_gamma}")
        check_rope_parameters(self.rope_parameters)
        if self.source_layout not in SOURCE_LAYOUTS:
            raise ValueError(f"source_layout: expected one of {SOURCE_LAYOUTS}, got {self.source_layout!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads: expected a multiple of num_key_value_heads={self.num_key_value_heads}, "
                f"got {self.num_attention_heads}"
            )
        bad_layer_types = sorted(set(self.layer_types) - {"full_attention"})
        if bad_layer_types:
            raise NotImplementedError(
                f"layer_types: only 'full_attention' drafter layers are supported, got {bad_layer_types}"
            )
        if self.target_layer_ids is not None and len(self.target_layer_ids) == 0:
            raise ValueError("target_layer_ids: expected a non-empty list of target layer indices, got []")
        if self.draft_token_ids is not None:
            check_draft_token_ids(self.draft_token_ids, self.vocab_size)

    def check_target_config(self, target_config: PreTrainedConfig) -> None:
        """Raise a clear error when this drafter cannot serve a target with ``target_config`` (config-level checks).

        A drafter whose config records no ``vocab_size`` (Muse-Glimmer layout) adopts the target's.
        """
        text = target_config.get_text_config()
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2, got {self.block_size}")
        if text.hidden_size != self.hidden_size:
            raise ValueError(f"hidden_size: expected the target's {text.hidden_size}, got {self.hidden_size}")
        if self.vocab_size is None:
            self.vocab_size = text.vocab_size
        if self.vocab_size != text.vocab_size:
            raise ValueError(f"vocab_size: expected the target's {text.vocab_size}, got {self.vocab_size}")
        if self.draft_token_ids is not None:  # a config without vocab_size could not check the range before
            check_draft_token_ids(self.draft_token_ids, self.vocab_size)
        for field_name, attribute in TARGET_FINGERPRINT.items():
            recorded, actual = getattr(self, field_name), getattr(text, attribute, None)
            if recorded is not None and recorded != actual:
                raise ValueError(
                    f"{field_name}: expected the target's {attribute}={actual!r}, got {recorded!r} recorded in the "
                    "drafter (the drafter was built for a different target)"
                )
        num_layers = text.num_hidden_layers
        for layer_id in self.target_layer_ids or ():
            if not 0 <= layer_id < num_layers:
                raise ValueError(
                    f"target_layer_ids: expected every id in 0..{num_layers - 1} (the target has {num_layers} "
                    f"layers), got {layer_id} in {self.target_layer_ids}"
                )
        non_attention = sorted(
            {
                t
                for t in (getattr(text, "layer_types", None) or ())
                if t not in ("full_attention", "sliding_attention")
            }
        )
        if non_attention:
            raise NotImplementedError(
                f"target layer_types: its cache cannot be cropped after a rejected draft; linear-attention and hybrid "
                f"targets are not supported, got {non_attention}"
            )

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids or ())

    @property
    def target_hidden_state_ids(self) -> list[int]:
        """The target's ``hidden_states`` the drafter reads, as ``output_hidden_states=`` takes them."""
        return hidden_state_ids(self.target_layer_ids or ())

    @classmethod
    def for_target(cls, target_config: PreTrainedConfig, **overrides: Any) -> AdaFlashConfig:
        """A drafter config for ``target_config`` with DFlash's defaults.

        Attention shape (heads, head_dim, intermediate size, RoPE, norms) follows the target's text config; five
        layers; layers evenly spaced as DFlash does; a learned mask embedding when ``mask_token_id`` is not given (a
        spare vocabulary row cannot be guessed safely from the config alone).
        """
        text = target_config.get_text_config()
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_layers = overrides.pop("num_hidden_layers", 5)
        values: dict[str, Any] = {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
            "head_dim": head_dim,
            "max_position_embeddings": text.max_position_embeddings,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": dict(
                getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e6}
            ),
            "target_layer_ids": build_target_layer_ids(text.num_hidden_layers, num_layers),
            "target_model_type": text.model_type,
            "target_hidden_size": text.hidden_size,
            "target_vocab_size": text.vocab_size,
            "target_num_hidden_layers": text.num_hidden_layers,
            "eos_token_id": getattr(text, "eos_token_id", None),
        }
        if overrides.get("mask_token_id") is None and not overrides.get("learned_mask_embedding", False):
            values["learned_mask_embedding"] = True
            values["mask_token_id"] = 0
        values.update(overrides)
        return cls(**values)

    # ----------------------------------------------------------------------------------------------------------
    # Foreign layouts. Published drafters keep DFlash-specific fields in ``dflash_config`` (z-lab, official
    # AdaFlash) or use transformers' Muse-Glimmer assistant schema; both are translated into our fields here.
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        check_local_path(pretrained_model_name_or_path)
        folder = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(
                f"{folder}: expected a drafter checkpoint folder with config.json, got no config.json "
                f"(files: {sorted(os.listdir(folder))[:8]})"
            )
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return translate_foreign_config(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        return super().from_dict(translate_foreign_config(dict(config_dict)), **kwargs)


@cache
def _field_types() -> dict[str, Any]:
    # AdaFlashConfig's own fields only: the annotations of PreTrainedConfig name types this module does not import.
    return inspect.get_annotations(AdaFlashConfig, eval_str=True)


def detect_layout(config_dict: dict[str, Any]) -> str:
    model_type = config_dict.get("model_type")
    architectures = config_dict.get("architectures") or []
    if model_type == "adaflash":
        return "adaflash"
    if model_type == "muse_glimmer_assistant" or "MuseGlimmerAssistantModel" in architectures:
        return "muse_glimmer"
    dflash_config = config_dict.get("dflash_config")
    if isinstance(dflash_config, dict) or "DFlashDraftModel" in architectures:
        flags = dflash_config or {}
        if flags.get("use_thresh_head_two_model"):
            return "adaflash_official"
        return "dflash"
    raise ValueError(
        "config.json: expected an AdaFlash (model_type='adaflash'), z-lab DFlash (architectures=['DFlashDraftModel'] "
        "with dflash_config), official AdaFlash or Muse-Glimmer assistant layout, got "
        f"model_type={model_type!r}, architectures={architectures!r}"
    )


_DROPPED_FOREIGN_KEYS = (
    "auto_map",
    "architectures",
    "dflash_config",
    "use_sliding_window",
    "max_window_layers",
)


def translate_foreign_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    layout = detect_layout(config_dict)
    if layout == "adaflash":
        return config_dict
    out = {k: v for k, v in config_dict.items() if k not in _DROPPED_FOREIGN_KEYS}
    out["model_type"] = "adaflash"
    out["source_layout"] = layout
    if "rope_theta" in out and "rope_parameters" not in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(out.pop("rope_theta"))}
    if layout == "muse_glimmer":
        out.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0})
        if out.get("layer_types") is None:
            # Muse-Glimmer's own default is sliding layers, which validate_architecture rejects with a clear error.
            out["layer_types"] = ["sliding_attention"] * out.get("num_hidden_layers", 5)
        out.setdefault("block_size", 16)
        out.setdefault("vocab_size", None)
        out["length_head_variant"] = "two_model"
        return out
    dflash_config = dict(config_dict.get("dflash_config") or {})
    out["block_size"] = config_dict.get("block_size", dflash_config.get("block_size", 16))
    out["mask_token_id"] = dflash_config.get("mask_token_id", config_dict.get("mask_token_id"))
    if out["mask_token_id"] is None:
        raise ValueError("dflash_config.mask_token_id: expected an integer token id, got nothing")
    num_layers = config_dict.get("num_hidden_layers", 5)
    if "target_layer_ids" in dflash_config:
        out["target_layer_ids"] = list(dflash_config["target_layer_ids"])
    elif config_dict.get("num_target_layers"):
        out["target_layer_ids"] = build_target_layer_ids(config_dict["num_target_layers"], num_layers)
    else:
        raise ValueError("dflash_config.target_layer_ids: expected a list of target layer ids, got nothing")
    if config_dict.get("num_target_layers"):
        out["target_num_hidden_layers"] = out.pop("num_target_layers")
    out["sliding_window"] = None
    out["layer_types"] = ["full_attention"] * num_layers
    out["length_head_variant"] = "two_model"
    if layout == "adaflash_official":
        out["length_head_bottleneck"] = dflash_config.get("thresh_head_bottleneck_dim", 256)
        out["length_head_gamma"] = 1.3  # SGLang PR #34171's --thresh-head-threshold-rate default
    return out
