"""Attention for a packed verify step, and its registration with ``transformers.AttentionInterface``.

Layout (flash-attn varlen convention, see ``verify_packing``): queries of B requests are concatenated,
``cu_seqlens_q`` delimits them; keys/values are concatenated per request as ``[cached_i; new_i]``,
delimited by ``cu_seqlens_k``. Causality is bottom-right aligned: query row r of request i (of ``Lq_i``)
sees that request's keys ``0 .. r + Lk_i - Lq_i``. With ``cu_seqlens_q == cu_seqlens_k`` this is the
block-diagonal causal mask of packed sequences.

- ``packed_verify_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)``: Triton kernel on CUDA
  (one program per request, head and query tile; online softmax over that request's keys only; GQA), on
  CPU one SDPA call with the boolean mask built from the cumulative lengths (``varlen_causal_mask``).
- ``register_packed_verify_attention()`` registers ``packed_verify_attention_forward`` as
  ``"ada_packed_verify"`` (transformers treats any implementation name containing "flash" as a
  flash-attention kernel, hence not "adaflash_..."). A Hugging Face model run with that implementation and batch size 1 takes:
  * ``cu_seq_lens_q``/``cu_seq_lens_k`` forward kwargs (transformers' own flash-attn kwarg names): the
    layer's keys must be laid out per request as above, e.g. no cache and every request's
    prefix + anchor + drafts packed into one row (``cu_seq_lens_q == cu_seq_lens_k``, positions restart
    per request): a full packed verify;
  * or a prebuilt 4-D boolean ``attention_mask`` (1, 1, Tq, Tk), which transformers passes through
    untouched: the layout for a batch-1 ``DynamicCache`` holding packed requests, whose keys are in
    arrival order ``[prefill of all requests; verify tokens of all requests]``. Build it with
    ``segment_causal_mask`` from per-token request ids and positions (a rejected key gets request id
    -1 and is never attended again, so rollback needs no cache surgery).
"""

import math

import torch
import torch.nn.functional as F

from adaflash_hf.kernels._utils import next_power_of_2, select_impl, triton_available

ATTENTION_NAME = "ada_packed_verify"

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _varlen_verify_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        cu_q_ptr,
        cu_k_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
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
        q0 = tl.load(cu_q_ptr + b).to(tl.int64)
        len_q = tl.load(cu_q_ptr + b + 1).to(tl.int64) - q0
        if m_start >= len_q:
            return
        k0 = tl.load(cu_k_ptr + b).to(tl.int64)
        len_k = tl.load(cu_k_ptr + b + 1).to(tl.int64) - k0
        shift = len_k - len_q  # bottom-right causal: query r sees keys <= r + shift
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
        m_i = tl.full((BLOCK_M,), -1e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end_k = tl.minimum(len_k, m_start + BLOCK_M + shift)
        for n_start in range(0, end_k, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < len_k
            k_tile = tl.load(
                k_ptr + (k0 + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            scores = tl.dot(q, k_tile) * scale
            allowed = n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None] + shift)
            scores = tl.where(allowed, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            probs = tl.exp(scores - m_new[:, None])
            rescale = tl.exp(m_i - m_new)
            l_i = l_i * rescale + tl.sum(probs, axis=1)
            v_tile = tl.load(
                v_ptr + (k0 + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc = acc * rescale[:, None] + tl.dot(probs.to(v_tile.dtype), v_tile)
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + (q0 + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def segment_causal_mask(
    query_segments: torch.Tensor,
    query_positions: torch.Tensor,
    key_segments: torch.Tensor,
    key_positions: torch.Tensor,
) -> torch.Tensor:
    """(Tq, Tk) bool: a query sees keys of its own request (segment id >= 0) at positions <= its own."""
    same = (query_segments[:, None] == key_segments[None, :]) & (key_segments[None, :] >= 0)
    return same & (key_positions[None, :] <= query_positions[:, None])


def _segments_from_cu(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = cu_seqlens.diff().long()
    segments = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total
    )
    offsets = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1].long()[segments]
    return segments, offsets


def varlen_causal_mask(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int
) -> torch.Tensor:
    """(total_q, total_k) bool mask of the varlen layout: per request, bottom-right aligned causal."""
    q_seg, q_off = _segments_from_cu(cu_seqlens_q, total_q)
    k_seg, k_off = _segments_from_cu(cu_seqlens_k, total_k)
    shift = (cu_seqlens_k.diff() - cu_seqlens_q.diff()).long()
    return segment_causal_mask(q_seg, q_off + shift[q_seg], k_seg, k_off)


def masked_sdpa(query, key, value, mask, scale):
    """SDPA over (T, H, D) tensors with a (Tq, Tk) bool mask; GQA by head groups; rows with no key give 0."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )[0].transpose(0, 1)
    return torch.where(mask.any(-1)[:, None, None], out, 0.0)


def _attention_triton(query, key, value, cu_q, cu_k, max_seqlen_q, scale):
    total_q, heads, head_dim = query.shape
    out = torch.empty_like(query)
    block_m = min(64, max(16, next_power_of_2(max_seqlen_q)))
    grid = (cu_q.numel() - 1, heads, triton.cdiv(max(max_seqlen_q, 1), block_m))
    _varlen_verify_attention_kernel[grid](
        query,
        key,
        value,
        out,
        cu_q,
        cu_k,
        scale,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // key.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
    )
    return out


def packed_verify_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Varlen attention: query (Tq, Hq, D), key/value (Tk, Hkv, D), Hq a multiple of Hkv -> (Tq, Hq, D)."""
    if query.dim() != 3 or key.shape != value.shape or key.dim() != 3 or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query must be (Tq, Hq, D) and key/value (Tk, Hkv, D); got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query heads must be a multiple of key heads, got {query.shape[1]} and {key.shape[1]}"
        )
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same (B+1,) shape, got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else scale
    if select_impl(query.device, impl) == "triton":
        if max_seqlen_q is None:
            max_seqlen_q = int(cu_seqlens_q.diff().max())
        return _attention_triton(
            query.contiguous(),
            key,
            value,
            cu_seqlens_q.contiguous(),
            cu_seqlens_k.contiguous(),
            max_seqlen_q,
            scale,
        )
    mask = varlen_causal_mask(cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0])
    return masked_sdpa(query, key, value, mask, scale)


def packed_verify_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: (1, H, T, D) in, (1, Tq, Hq, D) out. See the module docstring."""
    if query.shape[0] != 1:
        raise ValueError(
            f"packed verify attention runs on one packed row: batch size must be 1, got {query.shape[0]}"
        )
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        out = packed_verify_attention(q, k, v, cu_q, cu_k, kwargs.get("max_length_q"), scaling)
    elif attention_mask is not None and attention_mask.dtype == torch.bool:
        scale = 1.0 / math.sqrt(q.shape[2]) if scaling is None else scaling
        out = masked_sdpa(q, k, v, attention_mask[0, 0, :, -k.shape[0] :], scale)
    else:
        raise ValueError(
            f"{ATTENTION_NAME} needs cu_seq_lens_q and cu_seq_lens_k forward kwargs or a 4-D boolean "
            f"attention_mask; got kwargs {sorted(kwargs)} and attention_mask "
            f"{None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape))}"
        )
    return out[None], None


def register_packed_verify_attention(name: str = ATTENTION_NAME) -> str:
    """Register the packed verify attention with transformers (idempotent); returns the implementation name
    to pass as ``attn_implementation=`` or to ``model.set_attn_implementation``. ``name`` must not contain
    "flash"."""
    if "flash" in name:
        raise ValueError(
            f"name must not contain 'flash' (transformers would load it as a flash kernel), got {name!r}"
        )
    from transformers import AttentionInterface

    AttentionInterface.register(name, packed_verify_attention_forward)
    return name
