"""Packing geometry of one target forward on the engine's slot-pool layout: requests with different numbers of new
tokens (a whole prompt for a prefill, ``[anchor, d_1 .. d_k̂]`` for a verify) in one packed row.

Request i owns slot ``slots[i]`` of a K/V pool ``[slots, capacity, kv_heads, head_dim]`` (the key at absolute
position p lives at ``[slot, p]``). It contributes ``lengths[i]`` tokens at positions ``starts[i] ..`` (``starts[i]``
= the tokens already in its slot), packed at rows ``offsets[i] ..`` of the row. Its queries see its own slot's keys
at positions up to their own: the prefix, then causal within its new tokens.

``SlotPacking`` holds the host lists and the per-token write targets (``token_slots``, ``token_positions``); each
attention path builds its own view on first use: ``groups`` (torch: requests with at most ``group_width`` new
tokens, i.e. verifies, share one padded SDPA call, work proportional to each request's own length; each longer one,
a prefill, gets its own call, since a dense mask over the concatenated keys of all requests would cost
O(requests²)) and ``request_table`` (Triton: one int32 row ``(slot, start, offset, length)`` per request).
Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


def _padded_causal_mask(query_positions: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
    """[G, 1, Q, length] bool: a query sees its own slot's keys at positions <= its own. Padding queries see
    key 0 only, so no row is empty (SDPA would return NaN), and their outputs are dropped."""
    positions = torch.where(valid, query_positions, 0)
    keys = torch.arange(length, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


@dataclass
class AttentionGroup:
    """Requests attended in one SDPA call: queries gathered from the packed row by ``query_index [G, Q]``."""

    slots: torch.Tensor  # [G]
    query_index: torch.Tensor  # [G, Q] rows of the packed sequence (padding repeats row 0)
    query_valid: torch.Tensor  # [G, Q] bool
    key_length: int
    mask: torch.Tensor  # [G, 1, Q, key_length] bool

    @classmethod
    def build(cls, slots: list[int], starts: list[int], offsets: list[int], lengths: list[int], device):
        width = max(lengths)
        steps = torch.arange(width, device=device)
        length_t = torch.tensor(lengths, device=device)
        valid = steps[None, :] < length_t[:, None]
        index = torch.where(valid, torch.tensor(offsets, device=device)[:, None] + steps[None, :], 0)
        positions = torch.tensor(starts, device=device)[:, None] + steps[None, :]
        key_length = max(s + n for s, n in zip(starts, lengths))
        return cls(
            slots=torch.tensor(slots, device=device),
            query_index=index,
            query_valid=valid,
            key_length=key_length,
            mask=_padded_causal_mask(positions, valid, key_length),
        )


@dataclass
class SlotPacking:
    """See the module docstring. Build with ``SlotPacking.build(slots, starts, lengths, group_width, device)``."""

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    offsets: list[int]
    group_width: int
    device: torch.device
    token_slots: torch.Tensor = field(repr=False)  # [T] slot of each packed token
    token_positions: torch.Tensor = field(repr=False)  # [T] absolute position of each packed token

    @classmethod
    def build(cls, slots, starts, lengths, group_width: int, device) -> SlotPacking:
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        lengths_t = torch.tensor(lengths, device=device)
        token_slots = torch.repeat_interleave(torch.tensor(slots, device=device), lengths_t)
        within = torch.arange(int(lengths_t.sum()), device=device) - torch.repeat_interleave(
            torch.tensor(offsets, device=device), lengths_t
        )
        token_positions = torch.repeat_interleave(torch.tensor(starts, device=device), lengths_t) + within
        return cls(
            list(slots),
            list(starts),
            list(lengths),
            offsets,
            group_width,
            device,
            token_slots,
            token_positions,
        )

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @cached_property
    def row_requests(self) -> list[int]:
        """(slot, start, offset, length) of each request in turn, flat: what the compiled row attention takes (every
        layer of a forward attends with the same packing)."""
        return [n for entry in zip(self.slots, self.starts, self.offsets, self.lengths) for n in entry]

    @cached_property
    def groups(self) -> list[AttentionGroup]:
        """The torch path's SDPA calls: all short requests together, then one per long request."""
        short = [i for i, n in enumerate(self.lengths) if n <= self.group_width]
        members = [short] if short else []
        members += [[i] for i, n in enumerate(self.lengths) if n > self.group_width]
        return [
            AttentionGroup.build(
                [self.slots[i] for i in m],
                [self.starts[i] for i in m],
                [self.offsets[i] for i in m],
                [self.lengths[i] for i in m],
                self.device,
            )
            for m in members
        ]

    @cached_property
    def request_table(self) -> torch.Tensor:
        """[B, 4] int32 ``(slot, start, offset, length)`` per request, for the Triton kernel."""
        rows = list(zip(self.slots, self.starts, self.offsets, self.lengths))
        return torch.tensor(rows, dtype=torch.int32, device=self.device)
