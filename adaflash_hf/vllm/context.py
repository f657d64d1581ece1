"""The drafter's context, kept through the steps it sits out.

A DFlash drafter attends to K/V projected from the target's states at every position of the context, so a step the
drafter sits out must still leave its target states behind for the next step that drafts. Projecting and writing
them into the drafter's cache on every such step costs as much as a third of a plain step's overhead at small batch
on a CPU (three small calls of fixed cost); ``ContextStash`` keeps the raw states with their positions and cache
slots instead, and the next drafting step writes them all in one call (``take``).

Deferring the writes gives the cache the contents the eager writes would have given it: nothing reads the drafter's
cache between drafting steps, the stash keeps the steps in order, and where two stashed tokens name one slot (a draft
rejected at a position whose token the next step brings, or a finished request's slot given to a new one) only the
later is written, as writing them one after another would have left it. Torch only (no vLLM), so it is tested
without an engine.
"""

from __future__ import annotations

import torch

# written at once when the stash holds this many tokens (about 28 MB of fp32 states at 3 x 576)
STASH_TOKENS = 4096


def context_slots(
    positions: torch.Tensor, query_start_loc: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The cache slot of every context token, as vLLM's DFlash input kernel computes it: request ``r`` owns tokens
    ``query_start_loc[r]:query_start_loc[r + 1]``, and the token at ``position`` lives in block
    ``block_table[r, position // block_size]`` (the last column where it would run past the table) at offset
    ``position % block_size``."""
    counts = query_start_loc[1:] - query_start_loc[:-1]
    if int(counts.sum()) != positions.shape[0]:
        raise ValueError(
            f"context_slots: expected {int(counts.sum())} positions (query_start_loc's last entry), "
            f"got {positions.shape[0]}"
        )
    requests = torch.repeat_interleave(torch.arange(counts.shape[0], device=positions.device), counts.long())
    positions = positions.long()
    column = torch.clamp(positions // block_size, max=block_table.shape[1] - 1)
    blocks = block_table[requests, column].long()
    return blocks * block_size + positions % block_size


def last_writes(slots: torch.Tensor) -> torch.Tensor | None:
    """Indices (ascending) of the last token naming each slot, or None where every slot is named once."""
    unique, inverse = torch.unique(slots, return_inverse=True)
    if unique.shape[0] == slots.shape[0]:
        return None
    order = torch.arange(slots.shape[0], device=slots.device)
    last = torch.full((unique.shape[0],), -1, dtype=order.dtype, device=slots.device)
    last.scatter_reduce_(0, inverse, order, reduce="amax")
    return last.sort().values


class ContextStash:
    """Target states of the steps the drafter sat out, in order, until the next drafting step takes them."""

    def __init__(self, limit_tokens: int = STASH_TOKENS):
        if limit_tokens < 0:
            raise ValueError(f"limit_tokens: expected >= 0, got {limit_tokens}")
        self.limit_tokens = limit_tokens
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.tokens = 0

    def add(self, states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """One step's context: ``states`` [n, width], ``positions`` [n], ``slots`` [n]. The tensors are kept, not
        copied: pass tensors the caller will not write again."""
        count = states.shape[0]
        if positions.shape != (count,) or slots.shape != (count,):
            raise ValueError(
                f"ContextStash.add: expected positions and slots of shape ({count},) (one per state row), got "
                f"{tuple(positions.shape)} and {tuple(slots.shape)}"
            )
        if self._parts and states.shape[1:] != self._parts[0][0].shape[1:]:
            raise ValueError(
                f"ContextStash.add: expected states of width {tuple(self._parts[0][0].shape[1:])}, "
                f"got {tuple(states.shape[1:])}"
            )
        self._parts.append((states, positions, slots))
        self.tokens += count

    @property
    def full(self) -> bool:
        return self.tokens >= self.limit_tokens and self.tokens > 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Everything stashed, as one write: (states, positions, slots), a slot named twice kept at its last token;
        None when empty. Empties the stash."""
        if not self._parts:
            return None
        parts, self._parts, self.tokens = self._parts, [], 0
        if len(parts) == 1:
            states, positions, slots = parts[0]
        else:
            states, positions, slots = (torch.cat(column) for column in zip(*parts))
        keep = last_writes(slots)
        if keep is not None:
            states, positions, slots = states[keep], positions[keep], slots[keep]
        return states, positions, slots
