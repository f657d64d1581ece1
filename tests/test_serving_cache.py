"""The engine's KV slot pool: one packed target forward (mixed prefills and verifies) gives the logits of each
request run alone, rollback is just a shorter length, and the batched drafter forward equals each request's
drafter forward alone. fp32, tolerance 1e-5."""

import pytest
import torch

from adaflash_hf.serving.cache import (
    DrafterBatch,
    DrafterSlotCache,
    RaggedBatch,
    SlotKVStore,
    packed_target_forward,
)

ATOL = 1e-5


def packed_logits(target, store, slots, starts, pieces):
    batch = RaggedBatch.build(store, slots, starts, [len(p) for p in pieces], 16, torch.device("cpu"))
    with torch.no_grad():
        return packed_target_forward(target, torch.cat(pieces)[None], batch).logits[0]


def alone_logits(target, tokens, first_row):
    with torch.no_grad():
        return target(tokens[None]).logits[0, first_row:]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_verify_equals_per_request_verification(target_factory, kind):
    target = target_factory(kind)
    g = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(0, 512, (n,), generator=g) for n in (7, 40, 3, 19)]
    blocks = [torch.randint(0, 512, (n,), generator=g) for n in (5, 1, 16, 9)]  # anchor + k̂ drafts each
    store = SlotKVStore(target.config.num_hidden_layers)
    store.reserve(8, 128)
    slots = [5, 0, 2, 7]
    # Step 1: all prefills in one packed forward; each request's rows equal its own forward.
    logits = packed_logits(target, store, slots, [0] * 4, prefixes)
    expected = torch.cat([alone_logits(target, p, 0) for p in prefixes])
    assert (logits - expected).abs().max() < ATOL
    # Step 2: ragged verifies (k̂ = 4, 0, 15, 8) plus a new request's prefill, in one forward.
    arriving = torch.randint(0, 512, (23,), generator=g)
    logits = packed_logits(
        target, store, slots + [1], [p.numel() for p in prefixes] + [0], blocks + [arriving]
    )
    expected = [alone_logits(target, torch.cat([p, b]), p.numel()) for p, b in zip(prefixes, blocks)]
    expected = torch.cat(expected + [alone_logits(target, arriving, 0)])
    assert (logits - expected).abs().max() < ATOL


def test_rollback_is_a_shorter_length(target_factory):
    target = target_factory("llama")
    g = torch.Generator().manual_seed(1)
    prefix, block, retry = (torch.randint(0, 512, (n,), generator=g) for n in (11, 8, 6))
    store = SlotKVStore(target.config.num_hidden_layers)
    packed_logits(target, store, [0], [0], [prefix])
    packed_logits(target, store, [0], [11], [block])
    # Keep the anchor and 2 accepted drafts (positions 11..13); the rest of the block was rejected and is
    # overwritten by the next verify starting at position 14.
    logits = packed_logits(target, store, [0], [14], [retry])
    expected = alone_logits(target, torch.cat([prefix, block[:3], retry]), 14)
    assert (logits - expected).abs().max() < ATOL


def test_pool_grows_without_losing_cached_keys(target_factory):
    target = target_factory("qwen3")
    g = torch.Generator().manual_seed(2)
    prefix, block = torch.randint(0, 512, (30,), generator=g), torch.randint(0, 512, (16,), generator=g)
    store = SlotKVStore(target.config.num_hidden_layers)
    packed_logits(target, store, [0], [0], [prefix])
    store.reserve(4, 300)
    logits = packed_logits(target, store, [3], [0], [prefix])  # grows slots and capacity
    logits = packed_logits(target, store, [0], [30], [block])
    assert store.keys[0].shape[:2] == (4, 512)
    assert (logits - alone_logits(target, torch.cat([prefix, block]), 30)).abs().max() < ATOL


def test_batched_drafter_equals_each_request_alone(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    block, features = drafter.config.block_size, drafter.fc.in_features
    g = torch.Generator().manual_seed(3)
    store = SlotKVStore(drafter.config.num_hidden_layers)
    store.reserve(3, 64)
    slots, anchors = [2, 0, 1], torch.randint(0, 500, (3,), generator=g)
    noise = drafter.block_embeds(target.get_input_embeddings().weight, anchors)
    history = [torch.zeros(0, features) for _ in slots]
    cached = [0, 0, 0]
    for new_lengths in ([4, 17, 1], [3, 1, 9]):  # round 2 overwrites round 1's block rows
        contexts = [torch.randn(n, features, generator=g) for n in new_lengths]
        batch = DrafterBatch.build(slots, cached, new_lengths, block, torch.device("cpu"))
        padded = torch.zeros(3, max(new_lengths), features)
        for row, c in enumerate(contexts):
            padded[row, : c.shape[0]] = c
        with torch.no_grad():
            out = drafter(
                noise_embeds=noise,
                context_hidden_states=padded,
                attention_mask=batch.mask,
                position_ids=batch.position_ids,
                cache=DrafterSlotCache(store, batch),
            )
        for row, c in enumerate(contexts):
            history[row] = torch.cat([history[row], c])
            cached[row] += c.shape[0]
            with torch.no_grad():
                alone = drafter(noise_embeds=noise[row : row + 1], context_hidden_states=history[row][None])
            assert (out.last_hidden_state[row] - alone.last_hidden_state[0]).abs().max() < ATOL
            assert (out.acceptance_prob[row] - alone.acceptance_prob[0]).abs().max() < ATOL
