"""The compiled row attention: causal attention within float rounding of a float64 reference, each row's result the
same bits whatever else the call holds (other rows, their count, keys after it, padding before it, the thread count),
and bad inputs refused with errors that say what was expected."""

import shutil

import pytest
import torch

from adaflash_hf.prepared import attention, native

pytestmark = pytest.mark.skipif(
    (shutil.which("c++") or shutil.which("g++")) is None,
    reason="no C++ compiler here: the library cannot be built",
)


@pytest.fixture(autouse=True)
def library():
    assert native.load() or native.ROW_ATTENTION is not None, (
        "a C++ compiler is here, yet the library did not build"
    )


def reference(query, keys, values, start, allowed=None):
    """float64 causal attention: query [Hq, n, D] at positions start.., keys/values [Hkv, L, D]."""
    heads, count, dim = query.shape
    group = heads // keys.shape[0]
    keys, values = (t.double().repeat_interleave(group, 0) for t in (keys, values))
    scores = query.double() @ keys.transpose(1, 2) * dim**-0.5
    positions = torch.arange(start, start + count)[:, None]
    seen = torch.arange(keys.shape[1])[None, :] <= positions
    if allowed is not None:
        seen = seen & allowed[:, : keys.shape[1]]
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values


def sample(heads, kv_heads, length, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, length, dim, generator=generator).to(dtype),
        torch.randn(kv_heads, length, dim, generator=generator).to(dtype),
        torch.randn(kv_heads, length, dim, generator=generator).to(dtype),
    )


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (32, 4, 4), (128, 8, 2)])
def test_the_row_attention_is_causal_attention(dtype, tolerance, dim, heads, kv_heads):
    query, keys, values = sample(heads, kv_heads, 150, dim, dtype, seed=dim)
    start = 70
    out = attention.sequence_attention(query[:, start:], keys, values, start)
    expected = reference(query[:, start:], keys, values, start)
    assert (out.double() - expected).abs().max() < tolerance
    # the SDPA route (no compiler) computes the same attention, not necessarily to the bit
    attention.ROW_KERNEL = False
    try:
        tiles = attention.sequence_attention(query[:, start:], keys, values, start)
    finally:
        attention.ROW_KERNEL = True
    assert (tiles.double() - expected).abs().max() < 2 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_call_or_the_threads(dtype):
    query, keys, values = sample(9, 3, 200, 64, dtype, seed=1)
    threads = torch.get_num_threads()
    calls = [(0, 200), (30, 101), (100, 101), (64, 140), (99, 170)]  # prefills, verifies, a decode step
    results = {}
    try:
        for count in sorted({1, 2, threads}):
            torch.set_num_threads(count)
            for first, end in calls:
                tail = keys.clone()
                tail[:, end:] = float("nan")  # keys after the call's last position are never read
                out = attention.sequence_attention(query[:, first:end], tail, values, first)
                for position in range(first, end):
                    results.setdefault(position, []).append(out[:, position - first])
    finally:
        torch.set_num_threads(threads)
    for position, rows in results.items():
        assert all(torch.equal(row, rows[0]) for row in rows), position
    assert len(results[100]) >= 4 and len(results[0]) >= 1


def test_a_left_padded_row_equals_the_unpadded_row_and_a_row_that_sees_nothing_gives_zeros():
    query, keys, values = sample(4, 2, 60, 64, torch.bfloat16, seed=2)
    unpadded = attention.sequence_attention(query[:, 40:], keys[:, :60], values[:, :60], 40)
    pad = 7
    padded_keys, padded_values = (
        torch.cat([torch.full((2, pad, 64), float("nan"), dtype=t.dtype), t], dim=1) for t in (keys, values)
    )
    padded_query = torch.cat([torch.zeros(4, pad, 64, dtype=query.dtype), query], dim=1)
    allowed = torch.ones(60 + pad, 60 + pad, dtype=torch.bool)
    allowed[:, :pad] = False
    out = attention.sequence_attention(padded_query, padded_keys, padded_values, 0, allowed=allowed)
    assert torch.equal(out[:, pad + 40 :], unpadded)
    assert torch.equal(out[:, :pad], torch.zeros_like(out[:, :pad]))


def test_the_engines_packed_rows_equal_each_request_alone_and_other_slots_change_nothing():
    from adaflash_hf.kernels.verify_packing import SlotPacking

    generator = torch.Generator().manual_seed(3)
    key_pool, value_pool = (
        torch.randn(6, 256, 3, 64, generator=generator).to(torch.bfloat16) for _ in range(2)
    )
    key_pool[4], value_pool[4] = float("nan"), float("inf")  # a free slot
    requests = [(0, 10, 1), (2, 100, 5), (1, 0, 90), (5, 200, 1)]
    slots, starts, lengths = (list(column) for column in zip(*requests))
    for slot, start, length in requests:
        key_pool[slot, start + length :] = float("nan")  # past each request's keys
    packing = SlotPacking.build(slots, starts, lengths, 8, torch.device("cpu"))
    query = torch.randn(sum(lengths), 9, 64, generator=generator).to(torch.bfloat16)
    out = attention.slot_invariant_attention(query, key_pool, value_pool, packing)
    assert torch.isfinite(out).all()
    for slot, start, offset, length in zip(slots, starts, packing.offsets, lengths):
        alone = attention.sequence_attention(
            query[offset : offset + length].transpose(0, 1),
            key_pool[slot, : start + length].transpose(0, 1),
            value_pool[slot, : start + length].transpose(0, 1),
            start,
        )
        assert torch.equal(out[offset : offset + length], alone.transpose(0, 1)), slot


def test_bad_inputs_are_refused_with_what_was_expected():
    query, keys, values = sample(9, 3, 40, 64, torch.float32, seed=4)
    rows = query.transpose(0, 1)
    with pytest.raises(RuntimeError, match="expected at least start \\+ n = 50 keys"):
        native.ROW_ATTENTION(rows, keys.transpose(0, 1), values.transpose(0, 1), 10, 0.125, torch.empty(0))
    with pytest.raises(RuntimeError, match="expected one dtype"):
        native.ROW_ATTENTION(
            rows, keys.transpose(0, 1).bfloat16(), values.transpose(0, 1), 0, 0.125, torch.empty(0)
        )
    with pytest.raises(RuntimeError, match="expected a mask \\[40, >= 40\\]"):
        native.ROW_ATTENTION(
            rows, keys.transpose(0, 1), values.transpose(0, 1), 0, 0.125, torch.ones(3, 40, dtype=torch.bool)
        )
    pool = torch.zeros(2, 64, 3, 64)
    with pytest.raises(RuntimeError, match="request 0 \\(slot, start, offset, length\\) = \\(2, 0, 0, 1\\)"):
        native.PACKED_ROW_ATTENTION(rows[:1], pool, pool, [2, 0, 0, 1], 0.125)
