"""AdaFlashDrafter: a DFlash block-diffusion drafter with an adaptive length head.

The drafter has no embedding and no lm_head: it reads the target's raw embedding rows for the block
``[last committed token, MASK x (block_size - 1)]`` and its final states go through the target's lm_head. Context comes
from target hidden states (outputs of ``config.target_layer_ids``), fused by ``hidden_norm(fc(concat(...)))`` and
turned into extra keys/values by every layer's own k/v projections. Queries come only from the block, and attention is
bidirectional inside it. Checkpoint names follow z-lab's DFlash (``layers.{i}``, ``fc``, ``hidden_norm``, ``norm``) and
the official AdaFlash head (``thresh_head_two_model``), so published drafters load as they are; so do folders written
by ``adaflash export --format dflash``, whose length head and learned mask embedding sit beside the z-lab weights.

The forward follows transformers' native DFlash drafter contract (``DFlashTokenCandidateGenerator``), so
``target.generate(ids, assistant_model=drafter, speculation_type="dflash")`` runs it as a fixed-length baseline.
This file imports only ``.configuration_adaflash`` so it also works as Hub remote code.
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import cached_file

from .configuration_adaflash import (
    TARGET_FINGERPRINT,
    AdaFlashConfig,
    check_draft_token_ids,
    check_local_path,
)

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Muse-Glimmer names the context projection ``encoder.*``; everything else is shared with z-lab DFlash.
MUSE_GLIMMER_KEY_MAPPING = {r"^encoder\.fc\.": "fc.", r"^encoder\.output_norm_enc\.": "hidden_norm."}
# What z-lab's layout has no slot for, written beside it by ``adaflash export --format dflash``: the length head and
# its settings (the sidecar), and a learned mask embedding (also as a bare tensor, which vLLM's DFlash loader reads).
SIDECAR_WEIGHTS = "adaflash_length_head.safetensors"
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


class AdaFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float() if input_dtype != torch.float64 else hidden_states
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class AdaFlashRotaryEmbedding(nn.Module):
    def __init__(self, config: AdaFlashConfig):
        super().__init__()
        inv_freq, self.attention_scaling = self.compute_inv_freq(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    @staticmethod
    def compute_inv_freq(config: AdaFlashConfig) -> tuple[torch.Tensor, float]:
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = config.head_dim
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        return ROPE_INIT_FUNCTIONS[rope_type](config)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [B, S] absolute positions -> cos/sin [B, S, head_dim] in x's dtype
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(x.device, torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(
            x.dtype
        )


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    # Upcast half precision for a stable softmax, but never downcast float64 (exactness tests run in float64).
    probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


@dataclass
class BlockwiseMask:
    """The training layout without its dense [Q, N + Q] mask: keys are [N context positions, Q block rows], and each
    block of ``block_size`` rows sees the context columns where ``context_visible`` is True plus its own rows
    (bidirectional), never another block. Passed to the layers in place of a mask tensor (as flex attention's
    ``BlockMask`` is)."""

    context_visible: torch.Tensor  # [B, n_blocks, N] bool
    block_size: int


def _blockwise_attention(
    query, key, value, mask: BlockwiseMask, scaling: float, dropout: float, training: bool
):
    """Exactly the dense-mask attention of the training layout, in O(Q * (N + block_size)) instead of O(Q * (N + Q)).

    query [B, h, Q, d]; key/value [B, kv, N + Q, d]. Each row's scores are its [N] context scores next to the
    [block_size] scores of its own block (computed block-diagonally, never as [Q, Q]), under one softmax. The own block
    is always visible, so a block that sees no context still has finite scores. Returns [B, Q, h, d].
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    n_ctx = key.shape[2] - q_len
    block = mask.block_size
    n_blocks = q_len // block
    # Query head i reads key head i // groups (repeat_interleave in _eager_attention): split h into (kv, groups).
    query = query.reshape(batch, kv_heads, groups, n_blocks, block, dim)
    key_blocks = key[:, :, n_ctx:].reshape(batch, kv_heads, 1, n_blocks, block, dim)
    value_blocks = value[:, :, n_ctx:].reshape(batch, kv_heads, 1, n_blocks, block, dim)

    context_keys = key[:, :, :n_ctx].transpose(-1, -2)
    context_scores = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, dim), context_keys) * scaling
    context_scores = context_scores.view(batch, kv_heads, groups, n_blocks, block, n_ctx).masked_fill(
        ~mask.context_visible[:, None, None, :, None, :], torch.finfo(context_scores.dtype).min
    )
    # [B, kv, groups, n_blocks, block, block]: each row against its own block's keys only
    block_scores = torch.matmul(query, key_blocks.transpose(-1, -2)) * scaling
    scores = torch.cat([context_scores, block_scores], dim=-1)
    probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=training)
    context_probs, block_probs = probs.split([n_ctx, block], dim=-1)
    out = torch.matmul(
        context_probs.reshape(batch, kv_heads, groups * q_len, n_ctx), value[:, :, :n_ctx]
    ).view(batch, kv_heads, groups, n_blocks, block, dim) + torch.matmul(block_probs, value_blocks)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()


class AdaFlashAttention(nn.Module):
    def __init__(self, config: AdaFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = AdaFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = AdaFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        block_hidden: torch.Tensor,
        context_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        **kwargs,
    ) -> torch.Tensor:
        batch, q_len, _ = block_hidden.shape
        # Keys/values see [new context, block]; queries only the block.  kv_hidden: [B, n_ctx + q_len, H]
        kv_hidden = torch.cat([context_hidden, block_hidden], dim=1)
        query = self.q_norm(self.q_proj(block_hidden).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(
            self.k_proj(kv_hidden).view(batch, kv_hidden.shape[1], -1, self.head_dim)
        ).transpose(1, 2)
        value = self.v_proj(kv_hidden).view(batch, kv_hidden.shape[1], -1, self.head_dim).transpose(1, 2)

        # cos/sin cover every new kv position (context then block); the block's queries are the last q_len of them.
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        key = key * cos + _rotate_half(key) * sin
        query = query * cos[:, :, -q_len:] + _rotate_half(query) * sin[:, :, -q_len:]

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        dropout = self.config.attention_dropout if self.training else 0.0
        if isinstance(attention_mask, BlockwiseMask):
            out = _blockwise_attention(
                query, key, value, attention_mask, self.scaling, dropout, self.training
            )
            return self.o_proj(out.reshape(batch, q_len, -1))
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, _eager_attention
        )
        out, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(out.reshape(batch, q_len, -1))


class AdaFlashMLP(nn.Module):
    def __init__(self, config: AdaFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AdaFlashDecoderLayer(nn.Module):
    def __init__(self, config: AdaFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = AdaFlashAttention(config, layer_idx)
        self.mlp = AdaFlashMLP(config)
        self.input_layernorm = AdaFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = AdaFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context_hidden, position_embeddings, attention_mask, cache, **kwargs):
        # The fused context is shared by all layers and deliberately not passed through input_layernorm (DFlash).
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context_hidden, position_embeddings, attention_mask, cache, **kwargs
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class ThreshHeadTwoModel(nn.Module):
    """The official AdaFlash length head: concat(mean over block, last position) -> bottleneck MLP -> sigmoid."""

    def __init__(self, hidden_size: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(2 * hidden_size, bottleneck)
        self.res = nn.Sequential(nn.Linear(bottleneck, bottleneck), nn.SiLU())
        self.out = nn.Linear(bottleneck, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        features = torch.cat([block_hidden.mean(dim=-2), block_hidden[..., -1, :]], dim=-1)
        x = F.silu(self.down(features))
        x = x + self.res(x)
        return torch.sigmoid(self.out(x)).squeeze(-1)


class PaperLengthHead(nn.Module):
    """The paper's Algorithm 3 head: per-position Linear+SiLU, mean pool, Linear+sigmoid."""

    def __init__(self, hidden_size: int, bottleneck: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, bottleneck)
        self.out = nn.Linear(bottleneck, 1)

    def forward(self, block_hidden: torch.Tensor) -> torch.Tensor:
        pooled = F.silu(self.proj(block_hidden)).mean(dim=-2)
        return torch.sigmoid(self.out(pooled)).squeeze(-1)


LENGTH_HEAD_ATTRIBUTE = {"two_model": "thresh_head_two_model", "paper": "length_head"}
LENGTH_HEAD_CLASS = {"two_model": ThreshHeadTwoModel, "paper": PaperLengthHead}


@dataclass
class AdaFlashDrafterOutput(BaseModelOutputWithPast):
    r"""
    acceptance_prob (`torch.FloatTensor` of shape `[batch]` or `[batch, num_blocks]`):
        The length head's predicted accepted fraction â of each block, from detached final states.
    """

    acceptance_prob: torch.FloatTensor | None = None


# ------------------------------------------------------------------------------------------------ loading helpers
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


def _read_sidecar(pretrained, kwargs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config values and tensors an exported folder keeps beside its z-lab weights ({} and {} without any)."""
    overrides: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    meta_file = _optional_file(pretrained, SIDECAR_CONFIG, kwargs)
    if meta_file is not None:
        with open(meta_file) as handle:
            meta = json.load(handle)
        if meta.get("format_version") != SIDECAR_FORMAT_VERSION:
            raise ValueError(
                f"{SIDECAR_CONFIG}: format_version expected {SIDECAR_FORMAT_VERSION}, got {meta.get('format_version')!r}"
            )
        overrides = {field: meta[field] for field in SIDECAR_CONFIG_FIELDS if field in meta}
        weights = _optional_file(pretrained, SIDECAR_WEIGHTS, kwargs)
        if weights is not None:
            tensors = _read_safetensors(weights)
    mask_file = _optional_file(pretrained, MASK_EMBEDDING_FILE, kwargs)
    if "mask_embedding" not in tensors and mask_file is not None:
        overrides["learned_mask_embedding"] = True
        tensors["mask_embedding"] = _read_mask_embedding(mask_file)
    return overrides, tensors


def _load_sidecar_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
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


class AdaFlashPreTrainedModel(PreTrainedModel):
    config: AdaFlashConfig
    config_class = AdaFlashConfig
    base_model_prefix = "model"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AdaFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, AdaFlashRotaryEmbedding):
            # inv_freq is a non-persistent buffer: from_pretrained builds the model on the meta device and never loads
            # it, so it must be recomputed here or RoPE reads uninitialised memory.
            init.copy_(module.inv_freq, module.compute_inv_freq(self.config)[0])
        if isinstance(module, AdaFlashDrafter) and module.mask_embedding is not None:
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, AdaFlashDrafter) and module.draft_token_ids is not None:
            # Non-persistent like inv_freq, so from_pretrained's meta-device build leaves it uninitialised too.
            init.copy_(module.draft_token_ids, torch.tensor(self.config.draft_token_ids))


class AdaFlashDrafter(AdaFlashPreTrainedModel):
    """DFlash-compatible block drafter plus the adaptive length head. See the module docstring."""

    # Runtime state set from outside the model, never saved with it. Annotations only name types this file can
    # resolve (PreTrainedModel.__init_subclass__ evaluates them, and remote code cannot import adaflash_hf).
    # The adaflash_hf.stats.AdaFlashStats of the last AdaFlash generate call with this drafter, set by the generate
    # hook: None before any, after a call that failed before drafting, and after adaflash_hf.disable().
    last_stats: Any = None
    # Called with each drafting round's adaflash_hf.stats.RoundRecord during generate (online learning); None: off.
    round_recorder: Callable[..., None] | None = None
    # Version of the loaded weights, set by adaflash_hf.online.weights.HotReloader; stamped on every RoundRecord.
    weights_version: int = 0

    def __init__(self, config: AdaFlashConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(AdaFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_context_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = AdaFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = AdaFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = AdaFlashRotaryEmbedding(config)
        self.mask_embedding = (
            nn.Parameter(torch.zeros(config.hidden_size)) if config.learned_mask_embedding else None
        )
        head = LENGTH_HEAD_CLASS[config.length_head_variant](
            config.hidden_size, config.length_head_bottleneck
        )
        setattr(self, LENGTH_HEAD_ATTRIBUTE[config.length_head_variant], head)
        token_ids = config.draft_token_ids
        if token_ids is not None:
            # Again here: a value set after the config was built (from_pretrained(path, draft_token_ids=ids)) never
            # went through the config's validators.
            check_draft_token_ids(token_ids, config.vocab_size)
        # A buffer so it follows the model's device; non-persistent because config.json holds it and the checkpoint
        # must keep exactly z-lab's tensors.
        self.register_buffer(
            "_draft_token_ids", None if token_ids is None else torch.tensor(token_ids), persistent=False
        )
        self.post_init()

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def length_head(self) -> nn.Module:
        # Read _modules directly: the paper head's attribute is itself named ``length_head``, which this property shadows.
        return self._modules[LENGTH_HEAD_ATTRIBUTE[self.config.length_head_variant]]

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """Sorted target ids the drafter may propose (``config.draft_token_ids``), or None: the whole vocabulary.

        Proposal paths use it through ``adaflash_hf.draft_vocab.draft_logits``. Set it in the config before building
        the drafter: this tensor is made once, at construction.
        """
        return self._draft_token_ids

    def length_head_parameter_names(self) -> list[str]:
        prefix = LENGTH_HEAD_ATTRIBUTE[self.config.length_head_variant] + "."
        return [name for name, _ in self.named_parameters() if name.startswith(prefix)]

    def can_generate(self) -> bool:
        return False

    def __getattr__(self, name: str):
        if name == "generation_config":
            # transformers' generic assisted decoding reads the assistant's generation_config: reached only when the
            # adaflash_hf hook is not installed. Say how to run the drafter instead of a bare AttributeError.
            raise AttributeError(
                "generation_config: expected the adaflash_hf generate hook for generate(assistant_model=drafter) "
                "(import adaflash_hf, or adaflash_hf.enable() after adaflash_hf.disable()), got no hook; without it "
                "pass speculation_type='dflash' to run the drafter through transformers' native DFlash path "
                "(fixed length)"
            )
        return super().__getattr__(name)

    # --------------------------------------------------------------------------------------------------- helpers
    def context_features(self, hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """Concatenate the target's ``hidden_states[id + 1]`` for ``id`` in ``target_layer_ids``: [B, S, n_ids * H]."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1)

    def block_embeds(self, target_embedding_weight: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Raw target-embedding rows of ``[anchor, MASK x (block_size - 1)]`` per anchor: [B, block_size, H].

        With a learned mask embedding the MASK rows are replaced inside ``forward``; the lookup here still uses
        ``mask_token_id`` so the tensor has the same shape and dtype as the native DFlash generator's.
        """
        block = self.config.block_size
        ids = anchor_ids.new_full((anchor_ids.shape[0], block), self.config.mask_token_id)
        ids[:, 0] = anchor_ids
        return F.embedding(ids, target_embedding_weight)

    def predict_draft_length(
        self, acceptance_prob: torch.Tensor, gamma: float | None = None, min_len: int | None = None
    ) -> torch.Tensor:
        """k̂ = clamp(floor(γ·â·(block_size-1)), min_len, block_size-1); a NaN â gives min_len."""
        gamma = self.config.length_head_gamma if gamma is None else gamma
        min_len = self.config.length_head_min_len if min_len is None else min_len
        max_len = self.config.block_size - 1
        if not 0 <= min_len <= max_len:
            raise ValueError(f"min_len: expected 0..{max_len} (block_size - 1), got {min_len}")
        if not (gamma > 0 and math.isfinite(gamma)):
            raise ValueError(f"gamma: expected a finite value > 0, got {gamma}")
        prob = torch.nan_to_num(acceptance_prob.float(), nan=0.0, posinf=1.0, neginf=0.0)
        length = torch.floor(gamma * prob * max_len)
        return length.clamp(min_len, max_len).to(torch.long)

    def _attention_mask(self, attention_mask, batch, q_len, kv_len, dtype, device):
        """Turn a 2-D padding mask over all keys (or a prepared 4-D one) into what the attention function expects.

        ``None`` means every query sees every key: all context precedes the block and the block is bidirectional.
        """
        if attention_mask is None:
            return None
        if attention_mask.dim() == 2:
            if attention_mask.shape[-1] != kv_len:
                raise ValueError(
                    f"attention_mask: expected {kv_len} columns (cached context + new context + block), "
                    f"got {attention_mask.shape[-1]}"
                )
            allowed = attention_mask.bool()[:, None, None, :].expand(batch, 1, q_len, kv_len)
        elif attention_mask.dim() == 4:
            if attention_mask.dtype != torch.bool:
                return attention_mask.to(dtype)
            allowed = attention_mask
        else:
            raise ValueError(f"attention_mask: expected a 2-D or 4-D tensor, got {attention_mask.dim()}-D")
        if self.config._attn_implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def _blockwise_mask(self, block_anchors, attention_mask, cache, batch, q_len, n_ctx) -> BlockwiseMask:
        block = self.config.block_size
        if attention_mask is not None:
            raise ValueError(
                f"attention_mask: expected None with block_anchors (the layout is the mask), "
                f"got a {attention_mask.dim()}-D tensor"
            )
        if cache is not None:
            raise ValueError(
                f"cache: expected None with block_anchors (training layout), got {type(cache).__name__}"
            )
        if tuple(block_anchors.shape) != (batch, q_len // block):
            raise ValueError(
                f"block_anchors: expected shape {(batch, q_len // block)} (batch, rows / block_size), "
                f"got {tuple(block_anchors.shape)}"
            )
        # Context position p is the sequence position p (no cache), so "strictly before the anchor" is p < anchor;
        # an unused slot (-1) sees no context. Right padding lies after every anchor and is never visible.
        positions = torch.arange(n_ctx, device=block_anchors.device)
        return BlockwiseMask(positions < block_anchors.clamp(min=0)[..., None], block)

    # --------------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        block_anchors: torch.LongTensor | None = None,
        **kwargs,
    ) -> AdaFlashDrafterOutput:
        r"""
        noise_embeds: `[B, Q, H]`, one or more blocks ``[anchor, MASK x (block_size-1)]`` of target embeddings
            (Q a multiple of block_size). Rows that are not block starts are MASK rows.
        context_hidden_states: `[B, N, n_ids * H]`, target features of the N context positions not yet in ``cache``.
        attention_mask: `[B, cached + N + Q]` padding mask over all keys, or a prepared `[B, 1, Q, cached + N + Q]` mask
            (training uses it to hide context at and after each block's anchor). ``None`` lets every query see every key.
        position_ids: `[B, N + Q]` absolute positions of the new context then the block rows.
        cache: a transformers ``Cache`` (e.g. ``DFlashCache``); it receives the new context and block K/V. The caller
            evicts the block rows before the next round (``cache.crop(-block_size)``), as the native generator does.
        block_anchors: `[B, Q // block_size]` training layout instead of a 4-D mask: block b sees the context positions
            strictly before ``block_anchors[:, b]`` (-1: none) and its own rows, never another block. Same result as
            the dense mask of ``dflash_recipe.build_blocks`` at O(Q * (N + block_size)) attention cost instead of
            O(Q * (N + Q)). Needs ``attention_mask=None`` and ``cache=None``.
        """
        batch, q_len, hidden = noise_embeds.shape
        block = self.config.block_size
        if q_len % block:
            raise ValueError(f"noise_embeds: expected a multiple of block_size={block} rows, got {q_len}")
        if hidden != self.config.hidden_size:
            raise ValueError(f"noise_embeds: expected hidden size {self.config.hidden_size}, got {hidden}")
        if context_hidden_states is None:
            context_hidden_states = noise_embeds.new_zeros(batch, 0, self.fc.in_features)
        if context_hidden_states.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"context_hidden_states: expected last dim {self.fc.in_features} "
                f"(len(target_layer_ids)={self.config.num_context_features} x hidden {hidden}), "
                f"got {context_hidden_states.shape[-1]}"
            )
        drafter_dtype = self.fc.weight.dtype
        # Under autocast the matmuls cast for themselves; otherwise a mismatch fails deep inside a layer with torch's
        # "expected m1 and m2 to have the same dtype" (transformers' native DFlash path feeds the target's dtype).
        if not torch.is_autocast_enabled(noise_embeds.device.type):
            inputs = {"noise_embeds": noise_embeds, "context_hidden_states": context_hidden_states}
            for name, tensor in inputs.items():
                if tensor.dtype != drafter_dtype:
                    raise TypeError(
                        f"{name}: expected the drafter's dtype {drafter_dtype}, got {tensor.dtype}; load "
                        "the drafter in the target's dtype with from_pretrained(..., dtype=target.dtype), or call "
                        "drafter.to(target.dtype)"
                    )
        n_ctx = context_hidden_states.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        if block_anchors is None:
            mask = self._attention_mask(
                attention_mask, batch, q_len, past + n_ctx + q_len, noise_embeds.dtype, noise_embeds.device
            )
        else:
            mask = self._blockwise_mask(block_anchors, attention_mask, cache, batch, q_len, n_ctx)
        if hasattr(cache, "set_previous_accepted_tokens"):
            cache.set_previous_accepted_tokens(n_ctx)
        if position_ids is None:
            position_ids = torch.arange(past, past + n_ctx + q_len, device=noise_embeds.device)[None].expand(
                batch, -1
            )
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(batch, -1)

        hidden_states = noise_embeds
        if self.mask_embedding is not None:
            is_mask_row = (torch.arange(q_len, device=noise_embeds.device) % block != 0)[None, :, None]
            hidden_states = torch.where(is_mask_row, self.mask_embedding.to(noise_embeds.dtype), noise_embeds)

        context_hidden = self.hidden_norm(self.fc(context_hidden_states))
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context_hidden, position_embeddings, mask, cache, **kwargs)
        hidden_states = self.norm(hidden_states)

        # The head reads detached states: its loss must never move the drafter (AdaFlash §3).
        per_block = hidden_states.detach().view(batch, q_len // block, block, hidden)
        acceptance_prob = self.length_head(per_block)
        if q_len == block:
            acceptance_prob = acceptance_prob.squeeze(1)
        return AdaFlashDrafterOutput(
            last_hidden_state=hidden_states, cache=cache, acceptance_prob=acceptance_prob
        )

    # ------------------------------------------------------------------------------------------------ validation
    def check_target(self, target: nn.Module) -> None:
        """Raise a clear error, before any forward pass, when this drafter cannot serve ``target``."""
        if not isinstance(target, nn.Module) or not hasattr(target, "get_input_embeddings"):
            raise TypeError(
                "target: expected the target model (a transformers PreTrainedModel, e.g. from "
                f"AutoModelForCausalLM.from_pretrained), got a {type(target).__name__}"
            )
        cfg = self.config
        cfg.check_target_config(target.config)
        embedding_rows = target.get_input_embeddings().weight.shape[0]
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < embedding_rows:
            if cfg.learned_mask_embedding:
                expected = (
                    f"a placeholder row 0..{embedding_rows - 1} (replaced by the learned mask embedding)"
                )
            else:
                expected = (
                    f"a row of the target embedding (0..{embedding_rows - 1}) or learned_mask_embedding=True"
                )
            raise ValueError(f"mask_token_id: expected {expected}, got {cfg.mask_token_id}")
        if getattr(target, "_is_stateful", False):
            raise NotImplementedError(
                f"target: its cache cannot be cropped after a rejected draft (stateful model); linear-attention and "
                f"hybrid targets are not supported, got {type(target).__name__}"
            )
        target_dtype = next(target.parameters()).dtype
        drafter_dtype = next(self.parameters()).dtype
        if target_dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"target dtype: expected one of {SUPPORTED_DTYPES}, got {target_dtype}")
        if drafter_dtype != target_dtype:
            raise TypeError(
                f"drafter dtype: expected the target's {target_dtype}, got {drafter_dtype} (cast it with "
                f"drafter.to({target_dtype}); generate and AdaFlashEngine do that once for you)"
            )

    # --------------------------------------------------------------------------------------------- save and load
    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save safetensors weights, the config and the remote-code files (loadable with ``trust_remote_code``)."""
        if kwargs.get("safe_serialization") is False:
            raise ValueError(
                "safe_serialization: expected True (AdaFlash drafters are saved as safetensors only), got False"
            )
        self.config.__class__.register_for_auto_class()
        self.__class__.register_for_auto_class("AutoModel")
        source_layout = self.config.source_layout
        self.config.source_layout = "adaflash"
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.config.source_layout = source_layout

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        super()._adjust_missing_and_unexpected_keys(loading_info)
        # from_pretrained judges these itself: a key restored from an export's sidecar, a fresh head with its own
        # warning, or its strict error naming them all. Keep them for it, out of transformers' load report, which
        # would print them as newly initialised just before that error.
        self._load_problems = {
            "missing_keys": set(loading_info.missing_keys),
            "unexpected_keys": set(loading_info.unexpected_keys),
            "mismatched_keys": set(loading_info.mismatched_keys),
        }
        for name in self._load_problems:
            setattr(loading_info, name, set())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load our format, z-lab DFlash, the official AdaFlash checkpoint, Muse-Glimmer naming or an exported folder
        (z-lab weights plus the length-head sidecar and ``mask_embedding.pt``), strictly and completely.

        Missing, unexpected or wrong-shaped tensors raise; the only exception is a DFlash or Muse-Glimmer checkpoint
        without a sidecar, which has no length head: the head is freshly initialised and a warning says so.
        """
        path = pretrained_model_name_or_path
        check_local_path(path)
        want_info = kwargs.pop("output_loading_info", False)
        if kwargs.get("ignore_mismatched_sizes"):
            raise ValueError("ignore_mismatched_sizes: expected False (drafter loading is strict), got True")
        kwargs.setdefault("key_mapping", MUSE_GLIMMER_KEY_MAPPING)
        folder = os.path.join(str(path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder):  # name a truncated file before transformers' nameless error can
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    _read_safetensors(os.path.join(folder, name), keys=False)
        overrides, sidecar = _read_sidecar(path, kwargs)
        if isinstance(kwargs.get("config"), AdaFlashConfig):
            kwargs["config"] = copy.deepcopy(kwargs["config"])
            for field, value in overrides.items():
                setattr(kwargs["config"], field, value)
        else:  # config.json's values, then the sidecar's, then the caller's overrides
            kwargs = overrides | kwargs
        # Let transformers list wrong-shaped tensors in the loading info (its own error names none of them); every
        # mismatch is turned into a ValueError below, so nothing is silently re-initialised.
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(path, *model_args, output_loading_info=True, **kwargs)
        _load_sidecar_tensors(model, sidecar)
        head_keys = set(model.length_head_parameter_names())
        problems_on_load = model.__dict__.pop("_load_problems", info)
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
                f"checkpoint {path}: expected exactly the tensors of a {model.config.source_layout} drafter "
                f"(plus {SIDECAR_WEIGHTS} / {MASK_EMBEDDING_FILE} beside an export), got "
                + "; ".join(problems)
            )
        if fresh_head:
            warnings.warn(
                f"{path} is a {model.config.source_layout} checkpoint without a length head: "
                f"the {model.config.length_head_variant!r} length head was freshly initialised and predicts nothing "
                "useful until trained; use length_mode='fixed' or train the head.",
                UserWarning,
                stacklevel=2,
            )
        return (model, info) if want_info else model
