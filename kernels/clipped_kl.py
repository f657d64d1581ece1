"""Fused lm_head + clipped reverse-KL + hard-CE distillation loss: the OPD training loss.

For drafter hidden states ``h`` (N x H), the drafter head ``weight`` (V x H, the target's lm_head) and the
target's logits (or hidden states + head), with ``q = softmax(h W^T / T)`` and ``p = softmax(t / T)``::

    loss = α · CE(softmax(h W^T), argmax p) + (1 - α) · RKL_clip
    RKL_clip = Σ_i w_i Σ_y min(q_iy log(q_iy / p_iy), δ) / Σ_i w_i        clip_mode="entry" (the paper)
    RKL_clip = Σ_i w_i min(KL(q_i ‖ p_i) / Σ_j w_j, δ)                    clip_mode="row" (official code)

The hard CE uses the drafter logits at temperature 1 (as Liger's distillation base does); the KL is not
scaled by T². The gradient of ``min(., δ)`` is zero where the clip bites. Rows are processed in chunks:
the drafter logits of one chunk are computed, the loss and its closed-form gradient w.r.t. the logits are
computed in the same pass, and ``dh``/``dW`` are accumulated, so the N x V logits are never materialised
and ``backward`` only rescales. Target logits equal to ``-inf`` (padded vocabulary) remove that column
from both distributions; a row whose target logits are all ``-inf`` yields zeros (give it weight 0).

Layers, Liger-style: ``_clipped_kl_rows_kernel`` (Triton, one program per row, three vocab passes,
gradient written in place into the logits chunk) or ``_rows_torch`` (the CPU fallback) ->
``_FusedClippedDistillFunction`` -> ``fused_clipped_distill_loss`` -> ``ClippedDistillLoss``.
``clipped_distill_loss_reference`` materialises everything with autograd: test oracle and benchmark baseline.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from adaflash_hf.kernels._utils import num_warps_for, select_impl, triton_available, vocab_block_size

CLIP_MODES = ("entry", "row")
_STATS = 6  # per-row stats: ce, kl_clipped (entry mode), kl_raw, n_clipped, n_valid_columns, top-1 correct


class DistillLossOutput(NamedTuple):
    """``loss`` is differentiable w.r.t. ``h`` and ``weight``; the others are detached metrics (weighted means)."""

    loss: torch.Tensor
    ce: torch.Tensor
    rkl_clipped: torch.Tensor
    rkl_raw: torch.Tensor
    clip_ratio: torch.Tensor
    accuracy: torch.Tensor


@dataclass(frozen=True)
class _Settings:
    alpha: float
    delta: float
    temperature: float
    row_clip: bool
    chunk_size: int
    impl: str
    block_v: int | None


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_tile(z_row, t_row, start, V, BLOCK_V: tl.constexpr):
        """One vocabulary tile of a row: offsets, in-bounds mask, valid columns (finite target logit), z and t."""
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < V
        t = tl.load(t_row + offs, mask=inb, other=-float("inf")).to(tl.float32)
        z = tl.load(z_row + offs, mask=inb, other=0.0).to(tl.float32)
        valid = inb & (t != -float("inf"))
        return offs, inb, valid, z, t

    @triton.jit
    def _row_normalisers(z_row, t_row, V, inv_temp, BLOCK_V: tl.constexpr):
        """Pass 1: online (max, sum) for z/T, z and t/T; argmax of t (label) and of z (prediction).
        Returns (lse(z/T), lse(z), lse(t/T), row has a valid column, label, prediction)."""
        # Finite start for the running max so an all-masked block gives exp(-inf) = 0, never nan.
        m_zt = -1e30
        d_zt = 0.0
        m_z = -1e30
        d_z = 0.0
        m_tt = -1e30
        d_tt = 0.0
        best_t = -float("inf")
        label = 0
        best_z = -float("inf")
        pred = 0
        for start in range(0, V, BLOCK_V):
            offs, inb, valid, z, t = _load_tile(z_row, t_row, start, V, BLOCK_V)
            z1 = tl.where(valid, z, -float("inf"))
            zs = z1 * inv_temp
            ts = tl.where(valid, t * inv_temp, -float("inf"))
            new_m = tl.maximum(m_zt, tl.max(zs, axis=0))
            d_zt = d_zt * tl.exp(m_zt - new_m) + tl.sum(tl.exp(zs - new_m), axis=0)
            m_zt = new_m
            new_m = tl.maximum(m_z, tl.max(z1, axis=0))
            d_z = d_z * tl.exp(m_z - new_m) + tl.sum(tl.exp(z1 - new_m), axis=0)
            m_z = new_m
            new_m = tl.maximum(m_tt, tl.max(ts, axis=0))
            d_tt = d_tt * tl.exp(m_tt - new_m) + tl.sum(tl.exp(ts - new_m), axis=0)
            m_tt = new_m
            # Strict ">" keeps the earlier block on ties: first index wins, like torch.argmax.
            blk_t, blk_t_idx = tl.max(tl.where(valid, t, -float("inf")), axis=0, return_indices=True)
            label = tl.where(blk_t > best_t, start + blk_t_idx, label)
            best_t = tl.maximum(best_t, blk_t)
            blk_z, blk_z_idx = tl.max(z1, axis=0, return_indices=True)
            pred = tl.where(blk_z > best_z, start + blk_z_idx, pred)
            best_z = tl.maximum(best_z, blk_z)
        lse_zt = m_zt + tl.log(d_zt)
        lse_z = m_z + tl.log(d_z)
        lse_tt = m_tt + tl.log(d_tt)
        return lse_zt, lse_z, lse_tt, d_tt > 0.0, label, pred

    @triton.jit
    def _reverse_kl_tile(z_row, t_row, start, V, inv_temp, lse_zt, lse_tt, BLOCK_V: tl.constexpr):
        """Passes 2 and 3, one tile: q = softmax(z/T), diff = log q - log p (0 off the valid columns) and
        g = q (1 + diff), the per-entry gradient of q log(q/p) w.r.t. log q."""
        offs, inb, valid, z, t = _load_tile(z_row, t_row, start, V, BLOCK_V)
        a = tl.where(valid, z * inv_temp - lse_zt, -float("inf"))
        q = tl.exp(a)
        diff = tl.where(valid, a - (t * inv_temp - lse_tt), 0.0)
        return offs, inb, valid, z, q, diff, q * (1.0 + diff)

    @triton.jit
    def _clipped_kl_rows_kernel(
        z_ptr,
        t_ptr,
        grad_ptr,
        scale_ptr,
        inv_total_ptr,
        stats_ptr,
        stride_z,
        stride_t,
        stride_g,
        V,
        alpha,
        delta,
        inv_temp,
        ROW_CLIP: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # int64 row offsets: row * stride overflows int32 at N*V > 2^31.
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_z
        t_row = t_ptr + row * stride_t
        lse_zt, lse_z, lse_tt, row_ok, label, pred = _row_normalisers(z_row, t_row, V, inv_temp, BLOCK_V)

        # Pass 2: KL terms and G = Σ_y g_y (the softmax-Jacobian coupling; needs the whole row).
        kl_raw = 0.0
        kl_clip = 0.0
        n_clip = 0.0
        n_cols = 0.0
        g_sum = 0.0
        for start in range(0, V, BLOCK_V):
            _, _, valid, _, q, diff, g = _reverse_kl_tile(
                z_row, t_row, start, V, inv_temp, lse_zt, lse_tt, BLOCK_V
            )
            tau = q * diff
            kl_raw += tl.sum(tau, axis=0)
            n_cols += tl.sum(valid.to(tl.float32), axis=0)
            if ROW_CLIP:
                g_sum += tl.sum(g, axis=0)
            else:
                clipped = valid & (tau >= delta)
                kl_clip += tl.sum(tl.where(clipped, delta, tau), axis=0)
                n_clip += tl.sum(clipped.to(tl.float32), axis=0)
                g_sum += tl.sum(tl.where(clipped, 0.0, g), axis=0)

        z_label = tl.load(z_row + label).to(tl.float32)
        stats_row = stats_ptr + row * 6
        tl.store(stats_row + 0, tl.where(row_ok, lse_z - z_label, 0.0))
        tl.store(stats_row + 1, tl.where(row_ok, kl_clip, 0.0))
        tl.store(stats_row + 2, tl.where(row_ok, kl_raw, 0.0))
        tl.store(stats_row + 3, tl.where(row_ok, n_clip, 0.0))
        tl.store(stats_row + 4, tl.where(row_ok, n_cols, 0.0))
        tl.store(stats_row + 5, tl.where(row_ok & (pred == label), 1.0, 0.0))

        if COMPUTE_GRAD:
            # Pass 3: recompute q, g and softmax(z) per tile and write dL/dz (in place when grad_ptr == z_ptr:
            # each tile is read before it is overwritten).
            scale = tl.where(row_ok, tl.load(scale_ptr + row), 0.0)
            kl_scale = (1.0 - alpha) * inv_temp
            if ROW_CLIP:
                kl_scale = tl.where(kl_raw * tl.load(inv_total_ptr) < delta, kl_scale, 0.0)
            g_row = grad_ptr + row * stride_g
            for start in range(0, V, BLOCK_V):
                offs, inb, valid, z, q, diff, g = _reverse_kl_tile(
                    z_row, t_row, start, V, inv_temp, lse_zt, lse_tt, BLOCK_V
                )
                if not ROW_CLIP:
                    g = tl.where(valid & (q * diff >= delta), 0.0, g)
                softmax_z = tl.exp(tl.where(valid, z - lse_z, -float("inf")))
                ce_grad = softmax_z - tl.where(offs == label, 1.0, 0.0)
                grad = scale * (alpha * ce_grad + kl_scale * (g - q * g_sum))
                grad = tl.where(valid, grad, 0.0)
                tl.store(g_row + offs, grad.to(g_row.dtype.element_ty), mask=inb)


def _rows_triton(z, t, row_scale, inv_total, settings: _Settings, compute_grad: bool):
    """Run the row kernel on one chunk; the gradient overwrites ``z``. Returns (grad or None, stats)."""
    rows, vocab = z.shape
    stats = torch.empty(rows, _STATS, device=z.device, dtype=torch.float32)
    block = vocab_block_size(vocab, settings.block_v)
    _clipped_kl_rows_kernel[(rows,)](
        z,
        t,
        z,
        row_scale,
        inv_total,
        stats,
        z.stride(0),
        t.stride(0),
        z.stride(0),
        vocab,
        settings.alpha,
        settings.delta,
        1.0 / settings.temperature,
        ROW_CLIP=settings.row_clip,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=block,
        num_warps=num_warps_for(block),
    )
    return (z if compute_grad else None), stats


def _rows_torch(z, t, row_scale, inv_total, settings: _Settings, compute_grad: bool):
    """Closed-form chunk math in fp32 torch (the CPU fallback). Returns (grad or None, stats)."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    z = z.to(dtype)
    t = t.to(dtype)
    inv_temp = 1.0 / settings.temperature
    valid = t != float("-inf")
    row_ok = valid.any(dim=-1)
    # A fully masked row would give nan softmaxes: treat its columns as valid, then zero its outputs.
    valid = valid | ~row_ok[:, None]
    t = t.masked_fill(~row_ok[:, None], 0.0)
    z1 = z.masked_fill(~valid, float("-inf"))
    a = torch.log_softmax(z1 * inv_temp, dim=-1)
    q = a.exp()
    diff = torch.where(valid, a - torch.log_softmax(t * inv_temp, dim=-1), 0.0)
    tau = q * diff
    g = q * (1.0 + diff)
    kl_raw = tau.sum(-1)
    if settings.row_clip:
        kl_clip = torch.zeros_like(kl_raw)
        n_clip = torch.zeros_like(kl_raw)
    else:
        clipped = valid & (tau >= settings.delta)
        kl_clip = torch.where(clipped, settings.delta, tau).sum(-1)
        n_clip = clipped.sum(-1).float()
        g = g.masked_fill(clipped, 0.0)
    label = t.masked_fill(~valid, float("-inf")).argmax(-1)
    log_softmax_z = torch.log_softmax(z1, dim=-1)
    ce = -log_softmax_z.gather(1, label[:, None]).squeeze(1)
    correct = (z1.argmax(-1) == label).float()
    stats = torch.stack([ce, kl_clip, kl_raw, n_clip, valid.sum(-1).float(), correct], dim=1)
    stats = stats * row_ok[:, None]
    if not compute_grad:
        return None, stats
    kl_scale = torch.full_like(kl_raw, (1.0 - settings.alpha) * inv_temp)
    if settings.row_clip:
        kl_scale = kl_scale * (kl_raw * inv_total < settings.delta)
    ce_grad = log_softmax_z.exp()
    ce_grad.scatter_add_(1, label[:, None], torch.full_like(ce, -1.0)[:, None])
    grad = settings.alpha * ce_grad + kl_scale[:, None] * (g - q * g.sum(-1, keepdim=True))
    grad = grad * (row_scale * row_ok)[:, None]
    return grad, stats


def default_chunk_size(n_rows: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk from a memory budget for the chunk's N_c x V fp32 working set: ~12 buffers for the
    torch fallback within 128 MiB on CPU, ~3 (logits, target, nothing else) within 1 GiB on CUDA."""
    budget, buffers = (1 << 30, 3) if device.type == "cuda" else (128 << 20, 12)
    return max(1, min(n_rows, budget // (vocab_size * 4 * buffers)))


def _fused_forward(
    h, weight, target_logits, target_hidden, target_weight, row_weights, settings, need_h, need_w
):
    n_rows = h.shape[0]
    dtype = torch.promote_types(h.dtype, torch.float32)
    row_w = torch.ones(n_rows, device=h.device, dtype=dtype) if row_weights is None else row_weights.to(dtype)
    total = row_w.sum()
    inv_total = torch.where(total > 0, 1.0 / total.clamp_min(1e-30), 0.0).reshape(1)
    row_scale = (row_w * inv_total).contiguous()
    compute_grad = need_h or need_w
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.zeros(weight.shape, device=weight.device, dtype=dtype) if need_w else None
    stats = torch.empty(n_rows, _STATS, device=h.device, dtype=torch.promote_types(h.dtype, torch.float32))
    rows_fn = _rows_triton if settings.impl == "triton" else _rows_torch
    for start in range(0, n_rows, settings.chunk_size):
        end = min(start + settings.chunk_size, n_rows)
        h_chunk = h[start:end]
        z = h_chunk @ weight.T
        if target_logits is not None:
            t = target_logits[start:end]
        else:
            t = target_hidden[start:end] @ target_weight.T
        grad, stats[start:end] = rows_fn(z, t, row_scale[start:end], inv_total, settings, compute_grad)
        if need_h:
            grad_h[start:end] = grad.to(weight.dtype) @ weight
        if need_w and grad_w.dtype == h.dtype:
            grad_w.addmm_(grad.T.to(h.dtype), h_chunk)  # in place: no V x H temporary per chunk
        elif need_w:
            grad_w += (grad.T.to(h.dtype) @ h_chunk).to(dtype)
    ce, kl_clip, kl_raw, n_clip, n_cols, correct = stats.unbind(1)
    if settings.row_clip:
        normalised = kl_raw * inv_total
        rkl_clipped = (row_w * normalised.clamp(max=settings.delta)).sum()
        clip_ratio = (row_scale * (normalised >= settings.delta)).sum()
    else:
        rkl_clipped = (row_scale * kl_clip).sum()
        clip_ratio = (row_scale * n_clip / n_cols.clamp_min(1.0)).sum()
    ce_mean = (row_scale * ce).sum()
    loss = settings.alpha * ce_mean + (1.0 - settings.alpha) * rkl_clipped
    metrics = (ce_mean, rkl_clipped, (row_scale * kl_raw).sum(), clip_ratio, (row_scale * correct).sum())
    return (loss, *metrics), grad_h, (grad_w.to(weight.dtype) if need_w else None)


class _FusedClippedDistillFunction(torch.autograd.Function):
    """Gradient computed in the forward pass; ``backward`` multiplies it by the upstream scalar."""

    @staticmethod
    def forward(ctx, h, weight, target_logits, target_hidden, target_weight, row_weights, settings):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.no_grad():
            outputs, grad_h, grad_w = _fused_forward(
                h, weight, target_logits, target_hidden, target_weight, row_weights, settings, need_h, need_w
            )
        # Kept on ctx rather than saved tensors, and dropped in backward: the V x H weight gradient then has
        # a single owner when returned, so autograd adopts it as weight.grad instead of cloning it.
        ctx.grads = (grad_h, grad_w)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_metric_grads):
        if ctx.grads is None:
            raise RuntimeError("the fused distillation loss computes its gradient once: backward ran twice")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # The loss is usually the graph's root (grad 1): skip a V x H copy then (a host sync, as in Liger).
        if not bool(grad_loss == 1.0):
            grad_h = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
            grad_w = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _check_inputs(
    h, weight, target_logits, target_hidden, target_weight, row_weights, alpha, temperature, clip_mode
):
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(
            f"h must be (N, H) and weight (V, H) with the same H; got h {tuple(h.shape)}, weight {tuple(weight.shape)}"
        )
    n_rows, vocab = h.shape[0], weight.shape[0]
    if (target_logits is None) == (target_hidden is None):
        raise ValueError("pass exactly one of target_logits or target_hidden (with target_weight)")
    if target_logits is not None and tuple(target_logits.shape) != (n_rows, vocab):
        raise ValueError(f"target_logits must be {(n_rows, vocab)}, got {tuple(target_logits.shape)}")
    if target_hidden is not None:
        if target_weight is None or target_weight.shape[0] != vocab:
            got = None if target_weight is None else tuple(target_weight.shape)
            raise ValueError(f"target_weight must be ({vocab}, H_t) with target_hidden, got {got}")
        if tuple(target_hidden.shape) != (n_rows, target_weight.shape[1]):
            raise ValueError(
                f"target_hidden must be {(n_rows, target_weight.shape[1])}, got {tuple(target_hidden.shape)}"
            )
    if row_weights is not None and tuple(row_weights.shape) != (n_rows,):
        raise ValueError(f"row_weights must be ({n_rows},), got {tuple(row_weights.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")


def fused_clipped_distill_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor | None = None,
    target_hidden: torch.Tensor | None = None,
    target_weight: torch.Tensor | None = None,
    alpha: float = 0.8,
    delta: float = 0.01,
    temperature: float = 1.0,
    row_weights: torch.Tensor | None = None,
    clip_mode: str = "entry",
    chunk_size: int | None = None,
    impl: str | None = None,
    block_v: int | None = None,
) -> DistillLossOutput:
    """Clipped reverse-KL + hard-CE loss of the drafter logits ``h @ weight.T`` against the target.

    Args:
        h: drafter hidden states (N, H); ``weight``: drafter head (V, H). The loss is differentiable w.r.t. both.
        target_logits: (N, V) target logits, or ``target_hidden`` (N, H_t) with ``target_weight`` (V, H_t),
            in which case target logits are computed chunk by chunk too. Never differentiated.
        alpha: weight of the hard CE (against the target's argmax); ``1 - alpha`` weighs the clipped RKL.
        delta: the clip δ (see ``clip_mode`` and the module docstring).
        temperature: T for both distributions of the KL term (the CE uses T = 1).
        row_weights: optional (N,) non-negative weights (e.g. position decay); all metrics are weighted means.
        chunk_size: rows per chunk (default: ``default_chunk_size``).
        impl: ``"auto" | "torch" | "triton"``; default ``$ADAFLASH_KERNELS`` or ``"auto"``.
        block_v: vocabulary tile of the Triton kernel (tests use small tiles).

    Returns:
        ``DistillLossOutput(loss, ce, rkl_clipped, rkl_raw, clip_ratio, accuracy)``. ``clip_ratio`` is the
        weighted fraction of clipped vocabulary entries ("entry") or clipped rows ("row"); ``accuracy`` is
        the weighted top-1 agreement of drafter and target.
    """
    _check_inputs(
        h, weight, target_logits, target_hidden, target_weight, row_weights, alpha, temperature, clip_mode
    )
    settings = _Settings(
        alpha=float(alpha),
        delta=float(delta),
        temperature=float(temperature),
        row_clip=clip_mode == "row",
        chunk_size=chunk_size or default_chunk_size(h.shape[0], weight.shape[0], h.device),
        impl=select_impl(h.device, impl),
        block_v=block_v,
    )
    if target_logits is not None:
        target_logits = target_logits.contiguous()
    return DistillLossOutput(
        *_FusedClippedDistillFunction.apply(
            h, weight, target_logits, target_hidden, target_weight, row_weights, settings
        )
    )


class ClippedDistillLoss(nn.Module):
    """Module form of ``fused_clipped_distill_loss`` with the loss settings fixed at construction."""

    def __init__(
        self,
        alpha: float = 0.8,
        delta: float = 0.01,
        temperature: float = 1.0,
        clip_mode: str = "entry",
        chunk_size: int | None = None,
        impl: str | None = None,
    ):
        super().__init__()
        self.alpha, self.delta, self.temperature = alpha, delta, temperature
        self.clip_mode, self.chunk_size, self.impl = clip_mode, chunk_size, impl

    def forward(
        self, h, weight, target_logits=None, target_hidden=None, target_weight=None, row_weights=None
    ):
        return fused_clipped_distill_loss(
            h,
            weight,
            target_logits=target_logits,
            target_hidden=target_hidden,
            target_weight=target_weight,
            alpha=self.alpha,
            delta=self.delta,
            temperature=self.temperature,
            row_weights=row_weights,
            clip_mode=self.clip_mode,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, delta={self.delta}, temperature={self.temperature}, clip_mode={self.clip_mode}"


def clipped_distill_loss_reference(
    h, weight, target_logits, alpha=0.8, delta=0.01, temperature=1.0, row_weights=None, clip_mode="entry"
) -> DistillLossOutput:
    """The same loss with materialised N x V logits and autograd, in the inputs' dtype (float64 in tests)."""
    z = h @ weight.T
    valid = target_logits != float("-inf")
    z = z.masked_fill(~valid, float("-inf"))
    a = torch.log_softmax(z / temperature, dim=-1)
    b = torch.log_softmax(target_logits / temperature, dim=-1)
    q = torch.where(valid, a.exp(), 0.0)
    tau = q * torch.where(valid, a - b, 0.0)
    row_w = (
        torch.ones(h.shape[0], dtype=h.dtype, device=h.device)
        if row_weights is None
        else row_weights.to(h.dtype)
    )
    total = row_w.sum()
    kl_raw = tau.sum(-1)
    if clip_mode == "row":
        rkl_clipped = (row_w * (kl_raw / total).clamp(max=delta)).sum()
        clip_ratio = (row_w * (kl_raw / total >= delta)).sum() / total
    else:
        rkl_clipped = (row_w * tau.clamp(max=delta).sum(-1)).sum() / total
        clip_ratio = (row_w * ((tau >= delta) & valid).sum(-1) / valid.sum(-1)).sum() / total
    label = target_logits.argmax(-1)
    ce = -torch.log_softmax(z, dim=-1).gather(1, label[:, None]).squeeze(1)
    ce_mean = (row_w * ce).sum() / total
    accuracy = (row_w * (z.argmax(-1) == label)).sum() / total
    loss = alpha * ce_mean + (1 - alpha) * rkl_clipped
    detach = torch.Tensor.detach
    return DistillLossOutput(
        loss,
        detach(ce_mean),
        detach(rkl_clipped),
        detach((row_w * kl_raw).sum() / total),
        clip_ratio,
        accuracy,
    )
