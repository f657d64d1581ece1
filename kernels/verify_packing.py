"""Packing geometry for a ragged verify batch: requests with different draft lengths k̂_i in one flat batch.

Request i contributes ``k̂_i + 1`` tokens ``[anchor_i, d_i1 .. d_ik̂_i]`` (the last committed token, then its
drafts) at positions ``start_i .. start_i + k̂_i``, where ``start_i`` is the anchor's absolute position
(= the number of tokens already in request i's KV). Lengths follow the flash-attn varlen convention: int32
``cu_seqlens_q = [0, cumsum(k̂_i + 1)]`` over the packed queries and ``cu_seqlens_k = [0, cumsum(start_i +
k̂_i + 1)]`` over keys laid out per request as ``[cached_i; new_i]``. ``k̂_i = 0`` is allowed (the anchor
alone yields one bonus token). Pure torch; host integers (``max_seqlen_*``, ``total``) come from the
lengths, so building the geometry does not sync when the lengths are given as a list.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyBatch:
    """Packed verify inputs. T = Σ(k̂_i + 1) query tokens, D = Σ k̂_i draft tokens, B requests."""

    input_ids: torch.Tensor  # (T,) int64: [anchor_i, drafts_i...] per request
    position_ids: torch.Tensor  # (T,) int64: start_i + 0..k̂_i
    request_index: torch.Tensor  # (T,) int64: which request each query token belongs to
    cu_seqlens_q: torch.Tensor  # (B+1,) int32 over the packed queries
    cu_seqlens_k: torch.Tensor  # (B+1,) int32 over keys laid out [cached_i; new_i] per request
    draft_tokens: torch.Tensor  # (D,) int64, packed
    draft_lengths: torch.Tensor  # (B,) int64, k̂_i
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def total(self) -> int:
        return self.input_ids.shape[0]


def _as_draft_list(draft_tokens, draft_lengths, batch: int) -> list[torch.Tensor]:
    if isinstance(draft_tokens, (list, tuple)):
        if draft_lengths is not None:
            raise ValueError("draft_lengths is only used with a padded (B, K) draft_tokens tensor")
        drafts = [torch.as_tensor(d, dtype=torch.long).reshape(-1) for d in draft_tokens]
    else:
        if draft_tokens.dim() != 2 or draft_tokens.shape[0] != batch or draft_lengths is None:
            raise ValueError(
                f"draft_tokens must be a list of B={batch} 1-D tensors, or a padded ({batch}, K) tensor with "
                f"draft_lengths; got shape {tuple(draft_tokens.shape)}, draft_lengths={draft_lengths is not None}"
            )
        lengths = [int(n) for n in draft_lengths]
        if any(n < 0 or n > draft_tokens.shape[1] for n in lengths):
            raise ValueError(f"draft_lengths must be in [0, {draft_tokens.shape[1]}], got {lengths}")
        drafts = [draft_tokens[i, :n].long() for i, n in enumerate(lengths)]
    if len(drafts) != batch:
        raise ValueError(f"draft_tokens must hold B={batch} requests, got {len(drafts)}")
    return drafts


def pack_verify_batch(
    anchor_tokens: torch.Tensor,
    draft_tokens: list[torch.Tensor] | torch.Tensor,
    start_positions: torch.Tensor | list[int],
    draft_lengths: torch.Tensor | list[int] | None = None,
) -> VerifyBatch:
    """Pack B requests for one verify forward.

    Args:
        anchor_tokens: (B,) the last committed token of each request.
        draft_tokens: a list of B 1-D tensors (lengths k̂_i), or a padded (B, K) tensor with ``draft_lengths``.
        start_positions: (B,) absolute position of each anchor (= tokens already cached for the request).
    """
    anchor_tokens = torch.as_tensor(anchor_tokens, dtype=torch.long).reshape(-1)
    batch = anchor_tokens.shape[0]
    device = anchor_tokens.device
    starts = [int(s) for s in start_positions]
    if len(starts) != batch or any(s < 0 for s in starts):
        raise ValueError(f"start_positions must be B={batch} non-negative integers, got {starts}")
    drafts = [d.to(device) for d in _as_draft_list(draft_tokens, draft_lengths, batch)]
    lengths = [d.numel() for d in drafts]
    q_lens = [n + 1 for n in lengths]
    k_lens = [s + n for s, n in zip(starts, q_lens)]
    pieces = [torch.cat([anchor_tokens[i : i + 1], drafts[i]]) for i in range(batch)]
    input_ids = torch.cat(pieces) if pieces else anchor_tokens.new_empty(0)
    q_len_t = torch.tensor(q_lens, dtype=torch.long, device=device)
    request_index = torch.repeat_interleave(torch.arange(batch, device=device), q_len_t)
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_q[1:] = torch.cumsum(q_len_t, 0)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cu_k[1:] = torch.cumsum(torch.tensor(k_lens, dtype=torch.long, device=device), 0)
    offsets = torch.arange(input_ids.shape[0], device=device) - cu_q[:-1].long()[request_index]
    start_t = torch.tensor(starts, dtype=torch.long, device=device)
    return VerifyBatch(
        input_ids=input_ids,
        position_ids=start_t[request_index] + offsets,
        request_index=request_index,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        draft_tokens=torch.cat(drafts) if drafts else input_ids.new_empty(0),
        draft_lengths=torch.tensor(lengths, dtype=torch.long, device=device),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
    )
