"""Acceptance for a packed verify batch: greedy first-mismatch and speculative sampling, in one launch.

Request i owns target rows ``cu_seqlens[i] .. cu_seqlens[i+1]-1`` of the packed logits (``k̂_i + 1`` rows: its
anchor and drafts): row j scores draft ``d_{i,j}`` (j < k̂_i) and the last row the bonus token. Draft tokens are
packed the same way without anchors, so request i's drafts start at ``cu_seqlens[i] - i``.

- Greedy (temperature <= 0): accept while ``argmax(row j) == d_j``; the next token is the argmax of the first
  rejected row, or of the bonus row when all drafts are accepted. Ties go to the lowest index (torch.argmax).
- Sampling (temperature T > 0): ``p = softmax(logits / T)``; accept d_j when ``u_j · q_j(d_j) < p_j(d_j)``
  (i.e. with probability min(1, p/q)); on the first rejection the next token is drawn from the normalised
  residual ``max(p_j - q_j, 0)``, otherwise from the bonus row's ``p``. ``draft_probs`` holds q per draft
  position (None: the drafter proposed its argmax, q is one-hot). The draw is an inverse-CDF lookup with one
  uniform per request, so tests pass both uniform tensors and compare exactly.

Callers apply top-k/top-p (or any logits processing) to the target logits and the draft probabilities
before calling; this op only does the acceptance rule. Triton kernel (one program per request) on CUDA,
vectorised torch fallback elsewhere, one entry point: ``verify_accept``.
"""

from typing import NamedTuple

import torch

from adaflash_hf.kernels._utils import (
    num_warps_for,
    row_argmax,
    select_impl,
    triton_available,
    vocab_block_size,
)


class AcceptResult(NamedTuple):
    accepted: torch.Tensor  # (B,) int64: accepted drafts per request, in [0, k̂_i]
    next_tokens: torch.Tensor  # (B,) int64: the correction (rejection) or bonus token per request


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
        best = -float("inf")
        idx = 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            blk, blk_idx = tl.max(x, axis=0, return_indices=True)
            idx = tl.where(blk > best, start + blk_idx, idx)
            best = tl.maximum(best, blk)
        return idx

    @triton.jit
    def _row_lse(row_ptr, V, inv_t, BLOCK_V: tl.constexpr):
        m = -1e30
        d = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < V, other=-float("inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        return m + tl.log(d)

    @triton.jit
    def _residual_weights(row_ptr, q_row_ptr, offs, V, inv_t, lse, q_mode, q_tok, use_p):
        # q_mode 0: bonus row (q = 0); 1: q row from draft_probs; 2: one-hot q at q_tok.
        inb = offs < V
        p = tl.exp(tl.load(row_ptr + offs, mask=inb, other=-float("inf")).to(tl.float32) * inv_t - lse)
        # tl.where, not "&": the interpreter rejects a block mask combined with a scalar by "&".
        q = tl.load(q_row_ptr + offs, mask=tl.where(q_mode == 1, inb, False), other=0.0).to(tl.float32)
        q = tl.where((q_mode == 2) & (offs == q_tok), 1.0, q)
        return tl.where(use_p, p, tl.maximum(p - q, 0.0))

    @triton.jit
    def _sample_residual(row_ptr, q_row_ptr, V, inv_t, lse, q_mode, q_tok, u, BLOCK_V: tl.constexpr):
        total = 0.0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            total += tl.sum(
                _residual_weights(row_ptr, q_row_ptr, offs, V, inv_t, lse, q_mode, q_tok, False), axis=0
            )
        # An empty residual (p == q up to rounding) falls back to p itself.
        use_p = total <= 0.0
        if use_p:
            total = 1.0
        threshold = u * total
        carry = 0.0
        token = V
        last_positive = -1
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            w = _residual_weights(row_ptr, q_row_ptr, offs, V, inv_t, lse, q_mode, q_tok, use_p)
            cdf = tl.cumsum(w, axis=0) + carry
            token = tl.minimum(token, tl.min(tl.where((cdf > threshold) & (offs < V), offs, V), axis=0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0.0, offs, -1), axis=0))
            carry += tl.sum(w, axis=0)
        # Rounding can leave threshold >= the running total: take the last entry with mass.
        return tl.where(token < V, token, last_positive)

    @triton.jit
    def _verify_accept_kernel(
        logits_ptr,
        stride_l,
        draft_ptr,
        q_ptr,
        stride_q,
        cu_ptr,
        temp_ptr,
        u_accept_ptr,
        u_sample_ptr,
        accepted_ptr,
        next_ptr,
        V,
        HAS_Q: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0)
        row0 = tl.load(cu_ptr + b).to(tl.int64)
        k = tl.load(cu_ptr + b + 1).to(tl.int64) - row0 - 1
        d0 = row0 - b  # first packed draft of this request
        temp = tl.load(temp_ptr + b).to(tl.float32)
        greedy = temp <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(temp, 1e-30))
        accepted = row0 * 0
        going = k > 0
        # Walk the drafts until the first rejection (Triton has no break: the loop condition carries it).
        while going:
            row_ptr = logits_ptr + (row0 + accepted) * stride_l
            token = tl.load(draft_ptr + d0 + accepted)
            if greedy:
                ok = _row_argmax(row_ptr, V, BLOCK_V) == token
            else:
                lse = _row_lse(row_ptr, V, inv_t, BLOCK_V)
                p_tok = tl.exp(tl.load(row_ptr + token).to(tl.float32) * inv_t - lse)
                q_tok = 1.0
                if HAS_Q:
                    q_tok = tl.load(q_ptr + (d0 + accepted) * stride_q + token).to(tl.float32)
                ok = tl.load(u_accept_ptr + d0 + accepted).to(tl.float32) * q_tok < p_tok
            accepted += ok.to(tl.int64)
            going = ok & (accepted < k)
        row_ptr = logits_ptr + (row0 + accepted) * stride_l
        if greedy:
            next_token = _row_argmax(row_ptr, V, BLOCK_V)
        else:
            lse = _row_lse(row_ptr, V, inv_t, BLOCK_V)
            rejected = accepted < k
            q_mode = tl.where(rejected, 2, 0)
            if HAS_Q:
                q_mode = tl.where(rejected, 1, 0)
            q_tok = tl.load(draft_ptr + d0 + accepted, mask=rejected, other=-1)
            q_row_ptr = q_ptr + (d0 + accepted) * stride_q
            u = tl.load(u_sample_ptr + b).to(tl.float32)
            next_token = _sample_residual(row_ptr, q_row_ptr, V, inv_t, lse, q_mode, q_tok, u, BLOCK_V)
        tl.store(accepted_ptr + b, accepted)
        tl.store(next_ptr + b, next_token.to(tl.int64))


def _accept_triton(logits, draft_tokens, cu, temps, draft_probs, u_accept, u_sample, block_v):
    batch, vocab = cu.numel() - 1, logits.shape[1]
    accepted = torch.empty(batch, dtype=torch.int64, device=logits.device)
    next_tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    block = vocab_block_size(vocab, block_v)
    q = draft_probs if draft_probs is not None else logits
    _verify_accept_kernel[(batch,)](
        logits,
        logits.stride(0),
        draft_tokens,
        q,
        q.stride(0),
        cu,
        temps,
        u_accept,
        u_sample,
        accepted,
        next_tokens,
        vocab,
        HAS_Q=draft_probs is not None,
        BLOCK_V=block,
        num_warps=num_warps_for(block),
    )
    return AcceptResult(accepted, next_tokens)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds ``u · Σw`` per row (the last positive entry if rounding misses)."""
    cdf = torch.cumsum(weights, -1)
    index = (cdf <= uniforms[:, None] * cdf[:, -1:]).sum(-1)
    positions = torch.arange(weights.shape[1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, -1).amax(-1)
    return torch.where(index < weights.shape[1], index, last_positive)


def _accept_greedy(logits, draft_tokens, cu):
    """An all-greedy batch: no probabilities, only each row's argmax (one pass over the rows, in their own dtype: a
    widening cast keeps the order), compared with the drafts in Python: at serving batch sizes the dozen small
    tensor ops of the general path cost more than the argmax itself."""
    top, drafts, bounds = row_argmax(logits).tolist(), draft_tokens.tolist(), cu.tolist()
    accepted, next_tokens = [], []
    for request, (start, end) in enumerate(zip(bounds, bounds[1:])):
        first, count = start - request, end - start - 1  # the request's drafts: drafts[first : first + count]
        k = 0
        while k < count and top[start + k] == drafts[first + k]:
            k += 1
        accepted.append(k)
        next_tokens.append(top[start + k])
    device = logits.device
    return AcceptResult(
        torch.tensor(accepted, dtype=torch.long, device=device),
        torch.tensor(next_tokens, dtype=torch.long, device=device),
    )


def _accept_torch(logits, draft_tokens, cu, temps, draft_probs, u_accept, u_sample):
    greedy = temps <= 0
    if bool(greedy.all()):
        return _accept_greedy(logits, draft_tokens, cu)
    device = logits.device
    dtype = torch.promote_types(logits.dtype, torch.float32)
    batch = cu.numel() - 1
    starts = cu[:-1].long()
    draft_lengths = cu.diff().long() - 1
    requests = torch.arange(batch, device=device)
    inv_t = torch.where(greedy, 1.0, 1.0 / temps.clamp_min(1e-30)).to(dtype)

    draft_req = torch.repeat_interleave(requests, draft_lengths)
    draft_pos = torch.arange(draft_tokens.numel(), device=device) - (starts - requests)[draft_req]
    draft_logits = logits[starts[draft_req] + draft_pos].to(dtype)
    greedy_ok = row_argmax(draft_logits) == draft_tokens
    p_draft = torch.softmax(draft_logits * inv_t[draft_req, None], -1)
    p_tok = p_draft.gather(1, draft_tokens[:, None]).squeeze(1)
    q_tok = 1.0 if draft_probs is None else draft_probs.gather(1, draft_tokens[:, None]).squeeze(1).to(dtype)
    ok = torch.where(greedy[draft_req], greedy_ok, u_accept.to(dtype) * q_tok < p_tok)
    accepted = draft_lengths.clone()
    accepted.scatter_reduce_(0, draft_req[~ok], draft_pos[~ok], reduce="amin")

    final_logits = logits[starts + accepted].to(dtype)
    p = torch.softmax(final_logits * inv_t[:, None], -1)
    rejected = accepted < draft_lengths
    q_index = (starts - requests + accepted).clamp(max=max(draft_tokens.numel() - 1, 0))
    if draft_probs is not None:
        q = draft_probs[q_index].to(dtype) if draft_tokens.numel() else torch.zeros_like(p)
    else:
        q = torch.zeros_like(p)
        if draft_tokens.numel():
            q.scatter_(1, draft_tokens[q_index][:, None], 1.0)
    residual = torch.where(rejected[:, None], (p - q).clamp_min(0.0), p)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    sampled = _inverse_cdf(residual, u_sample.to(dtype))
    return AcceptResult(accepted, torch.where(greedy, row_argmax(final_logits), sampled))


def verify_accept(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    accept_uniforms: torch.Tensor | None = None,
    sample_uniforms: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    impl: str | None = None,
    block_v: int | None = None,
) -> AcceptResult:
    """Accept or reject the drafts of every request of a packed verify batch.

    Args:
        target_logits: (T, V) processed target logits, rows packed by ``cu_seqlens``.
        draft_tokens: (D,) packed drafts, D = T - B; request i has ``cu_seqlens[i+1] - cu_seqlens[i] - 1``.
        cu_seqlens: (B+1,) int32 or int64 prefix sums of ``k̂_i + 1``.
        temperatures: (B,) per-request temperature; <= 0 (or None for all) means greedy.
        draft_probs: (D, V) the drafter's proposal distribution q per draft; None means one-hot proposals.
        accept_uniforms: (D,) U[0,1) per draft; sample_uniforms: (B,) U[0,1) per request. Drawn from
            ``generator`` when None; pass them to make sampling reproducible across implementations.
    """
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be (T, V), got shape {tuple(target_logits.shape)}")
    total, vocab = target_logits.shape
    batch = cu_seqlens.numel() - 1
    if draft_tokens.shape != (total - batch,):
        raise ValueError(f"draft_tokens must be ({total - batch},) = T - B, got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (total - batch, vocab):
        raise ValueError(f"draft_probs must be {(total - batch, vocab)}, got {tuple(draft_probs.shape)}")
    device = target_logits.device
    temps = torch.zeros(batch, device=device) if temperatures is None else temperatures.to(device).float()
    if temps.shape != (batch,):
        raise ValueError(f"temperatures must be ({batch},), got {tuple(temps.shape)}")
    if accept_uniforms is None:
        accept_uniforms = torch.rand(total - batch, device=device, generator=generator)
    if sample_uniforms is None:
        sample_uniforms = torch.rand(batch, device=device, generator=generator)
    if accept_uniforms.shape != (total - batch,) or sample_uniforms.shape != (batch,):
        raise ValueError(
            f"accept_uniforms must be ({total - batch},) and sample_uniforms ({batch},); got "
            f"{tuple(accept_uniforms.shape)} and {tuple(sample_uniforms.shape)}"
        )
    draft_tokens = draft_tokens.long()
    if select_impl(device, impl) == "triton":
        return _accept_triton(
            target_logits.contiguous(),
            draft_tokens.contiguous(),
            cu_seqlens.contiguous(),
            temps.contiguous(),
            None if draft_probs is None else draft_probs.contiguous(),
            accept_uniforms.float().contiguous(),
            sample_uniforms.float().contiguous(),
            block_v,
        )
    return _accept_torch(
        target_logits, draft_tokens, cu_seqlens, temps, draft_probs, accept_uniforms, sample_uniforms
    )
