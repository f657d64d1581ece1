"""The drafter's context kept through the steps it sits out (``adaflash_hf.vllm.context``): cache slots computed as
vLLM's DFlash input kernel computes them, and deferred writes that leave the cache as eager writes would."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf.vllm.context import ContextStash, context_slots, last_writes


def _slots_by_hand(positions, starts, table, block_size):
    out = []
    for request in range(len(starts) - 1):
        for token in range(starts[request], starts[request + 1]):
            position = positions[token]
            column = min(position // block_size, len(table[request]) - 1)
            out.append(table[request][column] * block_size + position % block_size)
    return out


def test_context_slots_follow_each_requests_block_table():
    block_size = 4
    table = [[7, 2, 9], [5, 1, 3], [0, 8, 6]]
    # request 0: a prefill chunk over a block edge; request 1: one decode token; request 2: a position past the table
    positions = [2, 3, 4, 5, 6, 1, 13]
    starts = [0, 5, 6, 7]
    got = context_slots(torch.tensor(positions), torch.tensor(starts), torch.tensor(table), block_size)
    assert got.tolist() == _slots_by_hand(positions, starts, table, block_size)
    assert got.tolist() == [30, 31, 8, 9, 10, 21, 25]


def test_context_slots_name_a_count_mismatch():
    with pytest.raises(ValueError, match=r"context_slots: expected 3 positions .*got 2"):
        context_slots(torch.tensor([0, 1]), torch.tensor([0, 1, 3]), torch.zeros(2, 2, dtype=torch.long), 4)


def test_last_writes_keep_the_later_token_of_a_repeated_slot_in_order():
    assert last_writes(torch.tensor([4, 9, 2])) is None
    assert last_writes(torch.tensor([4, 9, 4, 2, 9])).tolist() == [2, 3, 4]


def _write_eagerly(cache, steps):
    for states, _, slots in steps:
        cache[slots] = states
    return cache


def test_a_deferred_write_leaves_the_cache_as_writing_every_step_would():
    generator = torch.Generator().manual_seed(0)
    steps = []
    # slot 3: a rejected draft's position brought again next step; slot 11: a finished request's slot reused
    for slots in ([1, 2, 3, 4], [3, 5], [11, 6], [11, 3, 7]):
        slots = torch.tensor(slots)
        steps.append((torch.randn(len(slots), 6, generator=generator), slots * 10, slots))
    stash = ContextStash()
    for step in steps:
        stash.add(*step)
    assert stash.tokens == 11 and not stash.full
    states, positions, slots = stash.take()
    assert stash.tokens == 0 and stash.take() is None
    assert slots.tolist() == [1, 2, 4, 5, 6, 11, 3, 7]  # each slot once, in the order of its last write
    assert torch.equal(positions, slots * 10)
    deferred = torch.zeros(16, 6)
    deferred[slots] = states
    assert torch.equal(deferred, _write_eagerly(torch.zeros(16, 6), steps))


def test_the_stash_says_when_it_is_full_and_checks_its_inputs():
    stash = ContextStash(limit_tokens=3)
    stash.add(torch.zeros(2, 4), torch.arange(2), torch.arange(2))
    assert not stash.full
    stash.add(torch.zeros(1, 4), torch.arange(1), torch.arange(1) + 5)
    assert stash.full
    with pytest.raises(
        ValueError, match=r"expected positions and slots of shape \(2,\).*got \(3,\) and \(2,\)"
    ):
        stash.add(torch.zeros(2, 4), torch.arange(3), torch.arange(2))
    with pytest.raises(ValueError, match=r"expected states of width \(4,\), got \(5,\)"):
        stash.add(torch.zeros(2, 5), torch.arange(2), torch.arange(2))
    assert stash.take() is not None
    assert stash.tokens == 0 and stash.take() is None and not stash.full
    with pytest.raises(ValueError, match=r"limit_tokens: expected >= 0, got -1"):
        ContextStash(limit_tokens=-1)
    eager = ContextStash(limit_tokens=0)
    eager.add(torch.zeros(1, 4), torch.arange(1), torch.arange(1))
    assert eager.full
