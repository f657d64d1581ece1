"""Packed verify attention on the engine's slot-pool layout (``verify_packing``): the attention of one packed target
forward whose requests each attend to their own slot of a K/V pool.

``slot_verify_attention(query, key_pool, value_pool, packing)``: query ``[T, Hq, D]`` (the packed row, every
request's new tokens), pools ``[slots, capacity, Hkv, D]`` already holding this forward's new keys/values (GQA:
``Hq`` a multiple of ``Hkv``) -> ``[T, Hq, D]``. Request i's query at position ``starts[i] + r`` sees the keys of
slot ``slots[i]`` at positions ``0 .. starts[i] + r``; positions past that (rejected drafts of earlier rounds, other
requests' scratch) are never read into the softmax.

- Triton (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per request, head and query tile; it reads the
  request's keys straight from its slot (no gather, no padding) with an online softmax over them.
- torch: ``packing.groups`` padded SDPA calls (verifies together, each prefill alone), each over the gathered slots
  up to the group's longest key length with a boolean causal mask.

The engine registers the attention with ``transformers`` and writes the pools (``adaflash_hf.serving.cache``).
"""

import math

import torch
import torch.nn.functional as F

from adaflash_hf.kernels._utils import next_power_of_2, select_impl, triton_available
from adaflash_hf.kernels.verify_packing import SlotPacking

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_verify_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        table_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kp,
        stride_kh,
        stride_vs,
        stride_vp,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        head = tl.program_id(1)
        m_start = tl.program_id(2) * BLOCK_M
        slot = tl.load(table_ptr + b * 4).to(tl.int64)
        start = tl.load(table_ptr + b * 4 + 1).to(tl.int64)  # query r is at position start + r
        q0 = tl.load(table_ptr + b * 4 + 2).to(tl.int64)
        len_q = tl.load(table_ptr + b * 4 + 3).to(tl.int64)
        if m_start >= len_q:
            return
        len_k = start + len_q
        kv_head = head // GROUP
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        row_ok = offs_m < len_q
        q = tl.load(
            q_ptr + (q0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
        v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
        m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end_k = tl.minimum(len_k, start + m_start + BLOCK_M)  # the tile's last query sees no further
        for n_start in range(0, end_k, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < len_k
            k_tile = tl.load(
                k_base + offs_n[None, :] * stride_kp + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            scores = tl.dot(q, k_tile.to(q.dtype)) * scale
            allowed = n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None] + start)
            scores = tl.where(allowed, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            probs = tl.exp(scores - m_new[:, None])
            rescale = tl.exp(m_i - m_new)
            l_i = l_i * rescale + tl.sum(probs, axis=1)
            v_tile = tl.load(
                v_base + offs_n[:, None] * stride_vp + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v_tile.dtype), v_tile)
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def _attention_triton(query, key_pool, value_pool, packing: SlotPacking, scale: float) -> torch.Tensor:
    heads, head_dim = query.shape[1], query.shape[2]
    out = torch.empty_like(query)
    max_length = packing.max_length
    block_m = min(64, max(16, next_power_of_2(max_length)))
    grid = (len(packing.lengths), heads, triton.cdiv(max_length, block_m))
    _slot_verify_attention_kernel[grid](
        query,
        key_pool,
        value_pool,
        out,
        packing.request_table,
        scale,
        query.stride(0),
        query.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        key_pool.stride(2),
        value_pool.stride(0),
        value_pool.stride(1),
        value_pool.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=heads // key_pool.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
    )
    return out


def _attention_torch(query, key_pool, value_pool, packing: SlotPacking, scale: float | None) -> torch.Tensor:
    out = torch.empty_like(query)
    for group in packing.groups:
        keys = key_pool[group.slots, : group.key_length].transpose(1, 2)  # [G, Hkv, L, D]
        values = value_pool[group.slots, : group.key_length].transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            query[group.query_index].transpose(1, 2),
            keys.to(query.dtype),
            values.to(query.dtype),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1],
        ).transpose(1, 2)
        out[group.query_index[group.query_valid]] = attended[group.query_valid]
    return out


def slot_verify_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    packing: SlotPacking,
    scale: float | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Attention of the packed row ``query [T, Hq, D]`` to each request's own slot of ``key_pool``/``value_pool``
    ``[slots, capacity, Hkv, D]`` -> ``[T, Hq, D]``. See the module docstring; ``scale`` None is 1/sqrt(D)."""
    if (
        query.dim() != 3
        or key_pool.dim() != 4
        or key_pool.shape != value_pool.shape
        or query.shape[2] != key_pool.shape[3]
    ):
        raise ValueError(
            f"query must be (T, Hq, D) and key/value pools (slots, capacity, Hkv, D); got {tuple(query.shape)}, "
            f"{tuple(key_pool.shape)}, {tuple(value_pool.shape)}"
        )
    if query.shape[1] % key_pool.shape[2]:
        raise ValueError(
            f"query heads must be a multiple of key heads, got {query.shape[1]} and {key_pool.shape[2]}"
        )
    if select_impl(query.device, impl) == "triton":
        scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else scale
        return _attention_triton(query.contiguous(), key_pool, value_pool, packing, scale)
    return _attention_torch(query, key_pool, value_pool, packing, scale)
