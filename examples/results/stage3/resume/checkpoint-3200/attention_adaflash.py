"""The drafter's attention functions (remote code, like its siblings).

Queries are the block rows, keys and values ``[context, block]``. ``eager_attention`` takes any additive mask (it runs
under ``attn_implementation="eager"``; sdpa and the others come from transformers' attention interface).
``blockwise_attention`` is the training layout of many blocks per sequence without its dense ``[Q, N + Q]`` mask: each
block sees the context before its anchor and its own rows, at O(Q * (N + block_size)) instead of O(Q * (N + Q)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
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


def blockwise_attention(
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
    # Query head i reads key head i // groups (repeat_interleave in eager_attention): split h into (kv, groups).
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
