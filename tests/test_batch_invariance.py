"""Batch invariance: on a prepared target, row i of a forward of n new tokens has bitwise the logits of the same token
decoded alone, for n = 1..M, whatever the rows after it hold, as the cache grows across key blocks; the kernels under
it (row plans, the invariant linear and attention) keep a row's result independent of the call's row count; plain
bf16 is the negative control that shows the effect on this CPU."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from adaflash_hf.prepared.attention import sequence_attention
from adaflash_hf.prepared.linear import InvariantLinear, can_pack, invariant_linear
from adaflash_hf.prepared.prepare import prepare_target
from adaflash_hf.prepared.tiles import Tiles, position_invariant

ROWS = 8
REPO = Path(__file__).resolve().parents[1]
# oneDNN's kernel families, from the highest, with the CPU flag each needs; ATen's own vector kernels (softmax, norms,
# elementwise) follow ATEN_CPU_CAPABILITY, lowered with the AVX2 family as an AVX2-only host runs them.
KERNEL_FAMILIES = {
    "AVX512_CORE_AMX": ("amx_bf16", {}),
    "AVX512_CORE_BF16": ("avx512_bf16", {}),
    "AVX512_CORE": ("avx512f", {}),
    "AVX2": ("avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
}
# What runs under each lower family: the forward, the linear and the attention tests of this file.
FAMILY_TESTS = "rows_of_a_prepared_forward or row_count or query_count"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.split(":", 1)[1].split()
    }


@torch.no_grad()
def row_mismatches(target, prompt=60, cache_lengths=(0, 3, 70), rows=ROWS, seed=0):
    """``(cache growth, n, row)`` of every row whose logits in an n-row forward differ from the same token decoded
    alone. After the prompt, the sequence is decoded token by token (the reference); then at each cache length, each
    n-row forward holds the true tokens up to a random row and random tokens after it."""
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    total = prompt + max(cache_lengths) + rows
    ids = torch.randint(0, vocab, (1, total), generator=generator)
    cache = DynamicCache()
    target(input_ids=ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
    alone = [
        target(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1]
        for i in range(prompt, total)
    ]
    found = []
    for grown in cache_lengths:
        cache = DynamicCache()
        target(input_ids=ids[:, : prompt + grown], cache=cache, use_cache=True, logits_to_keep=1)
        for n in range(1, rows + 1):
            window = ids[:, prompt + grown : prompt + grown + n].clone()
            kept = int(torch.randint(0, n, (1,), generator=generator))
            window[0, kept + 1 :] = torch.randint(0, vocab, (n - kept - 1,), generator=generator)
            logits = target(input_ids=window, cache=cache, use_cache=True).logits[0]
            cache.crop(-n)
            found += [(grown, n, r) for r in range(kept + 1) if not torch.equal(logits[r], alone[grown + r])]
    return found


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_of_a_prepared_forward_equal_the_tokens_decoded_alone(
    kind, dtype, target_factory, attention_route
):
    target = prepare_target(target_factory(kind), dtype=dtype, invariant=True)
    assert row_mismatches(target) == []


def test_plain_bf16_rows_depend_on_the_rows_in_the_forward(target_factory):
    # The negative control: the same check on an unprepared bf16 target (transformers' default SDPA attention)
    # must find rows that differ, where this CPU shows the effect at all.
    found = row_mismatches(target_factory("qwen3", dtype=torch.bfloat16))
    if not found:
        pytest.skip("this CPU computes plain bf16 rows the same way at every row count: no effect to detect")
    assert {n for _, n, _ in found} - {1}


@pytest.mark.integration
def test_rows_of_the_prepared_smollm2_equal_the_tokens_decoded_alone():
    import copy

    from adaflash_hf.assets import load_target

    target = copy.deepcopy(load_target()[0])
    prepare_target(target, dtype=torch.bfloat16, rows=ROWS)
    assert row_mismatches(target, prompt=58, cache_lengths=(0, 9), rows=ROWS) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 192), (1536, 576), (64, 512)])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype, shape):
    features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, features, generator=generator).to(dtype)
    x = torch.randn(300, features, generator=generator).to(dtype)
    alone = torch.cat([invariant_linear(x[i : i + 1], weight) for i in range(0, 300, 7)])
    for rows in (1, 2, 3, 5, 8, 13, 16, 17, 40, 300):
        out = invariant_linear(x[:rows], weight)
        assert torch.equal(out[::7], alone[: len(range(0, rows, 7))]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 192), (1536, 576)])
def test_the_prepacked_linear_rows_do_not_depend_on_the_row_count(dtype, shape):
    features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    layer = InvariantLinear(features, out_features, bias=False)
    layer.weight.data = torch.randn(out_features, features, generator=generator).to(dtype)
    x = torch.randn(40, features, generator=generator).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        for rows in (1, 2, 3, 5, 8, 13, 16, 17, 40):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    assert all(torch.isfinite(alone).flatten())


@pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="torch without oneDNN on this CPU"
)
def test_the_prepacked_weight_follows_the_weight_and_stays_out_of_copies_and_the_state_dict():
    layer = InvariantLinear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # in place: a power of two scales every product and sum exactly
        assert torch.equal(layer(x), before * 2)
        layer.load_state_dict({"weight": layer.weight / 4})
        assert torch.equal(layer(x), before / 2)
        assert torch.equal(copy.deepcopy(layer)(x), before / 2)
    assert list(layer.state_dict()) == ["weight"]


def test_a_call_that_wants_gradients_runs_the_differentiable_linear():
    # The prepacked op has no backward; a call that wants gradients gets F.linear's, under the same kind of plan.
    layer = InvariantLinear(16, 8, bias=True)
    reference = torch.nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(5, 16, requires_grad=True)
    layer(x).square().sum().backward()
    gradients = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = None
    reference(x).square().sum().backward()
    assert torch.allclose(gradients[0], x.grad) and torch.allclose(gradients[1], reference.weight.grad)


def test_plain_fp32_linear_rows_depend_on_the_row_count():
    # What the row plan removes: MKL gives a row different bits at 1, 2-3 and 4+ rows (where this CPU does).
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(576, 576, generator=generator), torch.randn(8, 576, generator=generator)
    results = [F.linear(x[:rows], weight)[0] for rows in range(1, 9)]
    if all(torch.equal(r, results[0]) for r in results):
        pytest.skip("this CPU's fp32 GEMM gives a row the same bits at every row count")
    assert not all(torch.equal(r, results[0]) for r in results)


@pytest.fixture(params=["row kernel", "sdpa tiles"])
def attention_route(request, monkeypatch):
    """The invariant attention through the compiled row kernel, or through SDPA in tiles (where no compiler is)."""
    from adaflash_hf.prepared import attention, native

    if request.param == "row kernel" and not native.load():
        pytest.skip("the compiled library could not be built here")
    monkeypatch.setattr(attention, "ROW_KERNEL", request.param == "row kernel")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_query_count_or_the_masked_tail(dtype, attention_route):
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length = 6, 2, 16, 150
    keys = torch.randn(kv_heads, length, dim, generator=generator).to(dtype)
    values = torch.randn(kv_heads, length, dim, generator=generator).to(dtype)
    query = torch.randn(heads, length, dim, generator=generator).to(dtype)
    position = (
        100  # its key block is 64..127: keys 101..127 are masked, real in some calls and absent in others
    )
    alone = sequence_attention(
        query[:, position : position + 1], keys[:, : position + 1], values[:, : position + 1], position
    )
    for first in (100, 97, 90, 64, 40):
        for end in (101, 102, 110, 128, 150):
            tail = keys.clone()
            tail[:, position + 1 :] = torch.randn(
                kv_heads, length - position - 1, dim, generator=generator
            ).to(dtype)
            out = sequence_attention(query[:, first:end], tail[:, :end], values[:, :end], first)
            assert torch.equal(out[:, position - first], alone[:, 0]), (first, end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_requests_attend_as_each_would_alone_whether_stacked_or_not(dtype, attention_route):
    # decode steps and verifies of one key block share an SDPA call; a prefill and a verify across a key block do not;
    # a block's keys are gathered from slots far apart (1, 3, 5), a view of slots side by side (7, 8) or of a range
    # with a free slot among them (9, 11), whose non-finite keys change nothing
    from adaflash_hf.kernels.verify_packing import SlotPacking
    from adaflash_hf.prepared.attention import slot_invariant_attention, stacked_entries, stacking_rows

    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, capacity = 6, 2, 16, 320
    key_pool, value_pool = (
        torch.randn(12, capacity, kv_heads, dim, generator=generator).to(dtype) for _ in range(2)
    )
    key_pool[10], value_pool[10] = float("nan"), float("inf")
    requests = [(0, 10, 1), (3, 70, 1), (5, 75, 4), (1, 100, 5), (2, 60, 8), (6, 0, 70), (7, 130, 1)]
    requests += [(8, 140, 2), (9, 200, 1), (11, 250, 3)]
    assert [stacked_entries(group) for group in ([3, 5, 1], [7, 8], [9, 11])] == [None, (7, 2), (9, 3)]
    slots, starts, lengths = (list(column) for column in zip(*requests))
    packing = SlotPacking.build(slots, starts, lengths, 8, torch.device("cpu"))
    query = torch.randn(sum(lengths), heads, dim, generator=generator).to(dtype)
    out = slot_invariant_attention(query, key_pool, value_pool, packing)
    assert stacking_rows(kv_heads, dim, 128, dtype, torch.device("cpu")) > 0  # stacked on this machine
    for slot, start, offset, length in zip(slots, starts, packing.offsets, lengths):
        alone = sequence_attention(
            query[offset : offset + length].transpose(0, 1),
            key_pool[slot, : start + length].transpose(0, 1),
            value_pool[slot, : start + length].transpose(0, 1),
            start,
        )
        assert torch.equal(out[offset : offset + length], alone.transpose(0, 1)), (slot, start, length)


def test_stacking_tiles_that_change_each_others_results_is_refused(monkeypatch):
    from adaflash_hf.prepared import attention

    real = F.scaled_dot_product_attention

    def leaky(query, *args, **kwargs):  # a kernel whose result for an entry depends on the stack's size
        out = real(query, *args, **kwargs)
        return out + (query.shape[0] - 1) * 1e-3

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", leaky)
    assert not attention.stacking_agrees(2, 16, 64, torch.float32, torch.device("cpu"), 16)


def _sample(rows, generator):
    scale = torch.exp2(torch.randint(-8, 9, (rows, 4), generator=generator).float())
    return (torch.randn(rows, 4, generator=generator) * scale,)


def test_an_op_that_differs_at_every_row_count_runs_at_one_row_count_always():
    calls = []

    def op(x):
        calls.append(x.shape[-2])
        return x + x.shape[-2] * 1e-3

    tiles = Tiles("test", op, _sample, pads=(0.0,))
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    calls.clear()
    assert torch.equal(tiles.run(op, x[:5]), x[:5] + 16e-3)
    assert torch.equal(tiles.run(op, x), x + 16e-3)
    assert tiles.rows == 16 and set(calls) == {16}


def test_a_tile_whose_last_position_differs_for_some_inputs_is_refused():
    # A kernel whose tail row sums in another order shows in few outputs after rounding: here the last row of a
    # 16-row call changes only where its first feature exceeds 1; 32-row calls are even.
    def op(x):
        tail = torch.zeros_like(x)
        if x.shape[-2] == 16:
            tail[-1] = (x[-1, :1] > 1.0) * 1e-3
        return x * 2 + tail

    tiles = Tiles("test", op, _sample, pads=(0.0,))
    assert tiles.rows == 32
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tiles.run(op, x), x * 2)


def test_tiles_run_one_row_per_call_when_a_rows_position_changes_it():
    def op(x):
        return x + torch.arange(x.shape[-2])[:, None] * 1e-3

    tiles = Tiles("test", op, _sample, pads=(0.0,))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    assert tiles.rows == 1
    assert torch.equal(tiles.run(op, x), x)


def test_a_small_shape_that_agrees_with_the_tile_runs_its_calls_as_they_are():
    calls = []

    def op(x):
        calls.append(x.shape[-2])
        return x * 3

    tiles = Tiles("test", op, _sample, pads=(0.0,), small=1)
    assert (tiles.rows, tiles.small) == (16, 1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    calls.clear()
    assert torch.equal(tiles.run(op, x[:1]), x[:1] * 3)
    assert torch.equal(tiles.run(op, x[:2]), x[:2] * 3)
    assert calls == [1, 16]


def test_a_small_shape_whose_rows_differ_from_the_tiles_is_refused():
    # a kernel whose one-row path sums in another order, in a few outputs only
    def op(x):
        out = x * 2
        if x.shape[-2] == 1:
            out = out + (x[:, :1] > 1.5) * 1e-3
        return out

    tiles = Tiles("test", op, _sample, pads=(0.0,), small=1)
    assert (tiles.rows, tiles.small) == (16, 0)
    x = torch.full((1, 4), 2.0)
    assert torch.equal(tiles.run(op, x), x * 2)


def test_large_shapes_that_agree_with_the_tiles_run_long_inputs_in_their_calls():
    calls = []

    def op(x):
        calls.append(x.shape[-2])
        return x * 3

    tiles = Tiles("test", op, _sample, pads=(0.0,), large=(2, 4))
    assert (tiles.rows, tiles.large) == (16, (64, 32))
    x = torch.randn(150, 4, generator=torch.Generator().manual_seed(4))
    calls.clear()
    assert torch.equal(tiles.run(op, x), x * 3)
    # 150 rows padded to 160: the largest admitted call that is left each time, tiles last
    assert calls == [64, 64, 32]
    assert tiles.calls(176) == [(0, 64), (64, 64), (128, 32), (160, 16)]
    assert tiles.large_mask() == (1 << 4) | (1 << 2)


def test_a_large_shape_whose_rows_differ_from_the_tiles_is_refused_and_a_smaller_one_kept():
    # a kernel that sums in another order from 48 rows on, in a few outputs only
    def op(x):
        out = x * 2
        if x.shape[-2] >= 48:
            out = out + (x[:, :1] > 1.5) * 1e-3
        return out

    tiles = Tiles("test", op, _sample, pads=(0.0,), large=(4, 2))
    assert (tiles.rows, tiles.large) == (16, (32,))
    x = torch.full((100, 4), 2.0)
    assert torch.equal(tiles.run(op, x), x * 2)
    assert Tiles("test", op, _sample, pads=(0.0,)).large == ()  # only where asked for


def test_prefill_rows_of_a_prepared_linear_equal_those_rows_alone():
    # the linears' large shape (where this CPU admits one) serves long inputs; every row as in a decode step
    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(100, 64).to(torch.bfloat16)
    together = invariant_linear(x, linear.weight)
    for i in (0, 15, 16, 31, 32, 63, 64, 99):
        assert torch.equal(together[i : i + 1], invariant_linear(x[i : i + 1], linear.weight))


def test_a_rows_result_depending_on_its_neighbours_is_refused():
    def op(x):
        return x + x.roll(1, dims=-2) * 1e-3

    assert not position_invariant(op, _sample, 16, (0.0,))


@pytest.mark.skipif(
    os.environ.get("ONEDNN_MAX_CPU_ISA") is not None, reason="already under a held kernel family"
)
@pytest.mark.parametrize("family", list(KERNEL_FAMILIES))
def test_the_invariance_tests_pass_under_every_kernel_family_this_cpu_has(family):
    flag, extra = KERNEL_FAMILIES[family]
    if flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}: oneDNN's {family} kernels cannot run here")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": family, **extra}
    command = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        FAMILY_TESTS,
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
