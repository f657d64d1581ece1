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
Its siblings hold the config (``configuration_adaflash``), the attention functions (``attention_adaflash``), the length
head and its learning signal (``length_head_adaflash``) and the reader of an export's sidecar (``sidecar_adaflash``).
They are imported with a single dot and nothing else from this package, so ``save_pretrained`` copies them all beside
the weights and the folder also works as Hub remote code.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import logging

from .attention_adaflash import BlockwiseMask, blockwise_attention, eager_attention
from .configuration_adaflash import AdaFlashConfig, check_draft_token_ids, check_local_path
from .length_head_adaflash import LENGTH_HEAD_ATTRIBUTE, LENGTH_HEAD_CLASS, draft_lengths
from .sidecar_adaflash import (
    check_loaded_tensors,
    check_safetensors_readable,
    load_sidecar_tensors,
    read_sidecar,
)

logger = logging.get_logger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Muse-Glimmer names the context projection ``encoder.*``; everything else is shared with z-lab DFlash.
MUSE_GLIMMER_KEY_MAPPING = {r"^encoder\.fc\.": "fc.", r"^encoder\.output_norm_enc\.": "hidden_norm."}


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
            out = blockwise_attention(query, key, value, attention_mask, self.scaling, dropout, self.training)
            return self.o_proj(out.reshape(batch, q_len, -1))
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention
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


@dataclass
class AdaFlashDrafterOutput(BaseModelOutputWithPast):
    r"""
    acceptance_prob (`torch.FloatTensor` of shape `[batch]` or `[batch, num_blocks]`):
        The length head's predicted accepted fraction â of each block, from detached final states.
    """

    acceptance_prob: torch.FloatTensor | None = None


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
        setattr(self, self.length_head_name, self._new_length_head())
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
        return self._modules[self.length_head_name]

    @property
    def length_head_name(self) -> str:
        """The length head's attribute, its checkpoint keys' prefix: ``thresh_head_two_model`` or ``length_head``."""
        return LENGTH_HEAD_ATTRIBUTE[self.config.length_head_variant]

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """Sorted target ids the drafter may propose (``config.draft_token_ids``), or None: the whole vocabulary.

        Proposal paths use it through ``adaflash_hf.draft_vocab.draft_logits``. Set it in the config before building
        the drafter: this tensor is made once, at construction.
        """
        return self._draft_token_ids

    def length_head_parameter_names(self) -> list[str]:
        prefix = self.length_head_name + "."
        return [name for name, _ in self.named_parameters() if name.startswith(prefix)]

    def reset_length_head(self, seed: int = 0) -> None:
        """Replace the length head with a fresh one (PyTorch's default init, drawn after ``torch.manual_seed(seed)``),
        on the drafter's device and in its dtype: e.g. to measure what calibration gives an untrained head."""
        torch.manual_seed(seed)
        reference = next(self.parameters())
        setattr(self, self.length_head_name, self._new_length_head().to(reference.device, reference.dtype))

    def _new_length_head(self) -> nn.Module:
        config = self.config
        return LENGTH_HEAD_CLASS[config.length_head_variant](
            config.hidden_size, config.length_head_bottleneck
        )

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
        return torch.cat([hidden_states[i] for i in self.config.target_hidden_state_ids], dim=-1)

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
        return draft_lengths(acceptance_prob, gamma, min_len, self.config.block_size - 1)

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
        self._check_input_dtypes(noise_embeds, context_hidden_states)
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

    def _check_input_dtypes(self, noise_embeds: torch.Tensor, context_hidden_states: torch.Tensor) -> None:
        # Under autocast the matmuls cast for themselves; otherwise a mismatch fails deep inside a layer with torch's
        # "expected m1 and m2 to have the same dtype" (transformers' native DFlash path feeds the target's dtype).
        if torch.is_autocast_enabled(noise_embeds.device.type):
            return
        drafter_dtype = self.fc.weight.dtype
        for name, tensor in {
            "noise_embeds": noise_embeds,
            "context_hidden_states": context_hidden_states,
        }.items():
            if tensor.dtype != drafter_dtype:
                raise TypeError(
                    f"{name}: expected the drafter's dtype {drafter_dtype}, got {tensor.dtype}; load "
                    "the drafter in the target's dtype with from_pretrained(..., dtype=target.dtype), or call "
                    "drafter.to(target.dtype)"
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

    def align_dtype(self, target: nn.Module) -> None:
        """Cast the drafter, in place and once, to the target's floating dtype: a drafter stored in bf16 serves an fp32
        target (the drafter reads the target's states and its lm_head in the target's dtype). Anything else is left to
        ``check_target``'s clear error. Called by ``generate`` and ``AdaFlashEngine`` before ``check_target``."""
        target_dtype = next(target.parameters()).dtype
        drafter_dtype = next(self.parameters()).dtype
        if drafter_dtype != target_dtype and {target_dtype, drafter_dtype} <= set(SUPPORTED_DTYPES):
            logger.warning_once(f"drafter: cast from {drafter_dtype} to the target's {target_dtype}")
            self.to(target_dtype)

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
        check_safetensors_readable(os.path.join(str(path), kwargs.get("subfolder") or ""))
        overrides, sidecar = read_sidecar(path, kwargs)
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
        load_sidecar_tensors(model, sidecar)
        check_loaded_tensors(model, path, model.__dict__.pop("_load_problems", info), info, sidecar)
        return (model, info) if want_info else model
