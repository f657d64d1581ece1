"""Batch-invariant causal attention over a growing cache: a query's result depends on its own position and the keys
it sees, not on how many queries share the call nor on the masked keys after it.

Where the compiled layer's library is loaded (``adaflash_hf.prepared.native``: built on first use with the system's C++
compiler), CPU tensors in float32 or bfloat16 go through its row attention (``csrc/row_attention.cpp``): each query
row computed alone, in one order of float32 operations written out in its source, so a row's result cannot depend on
the call (``ROW_KERNEL = False`` turns it off). Elsewhere (no compiler, a GPU, another dtype), SDPA in tiles:

SDPA on CPU reduces a query's softmax and its probability-value product over the call's whole key length (with the
masked tail), and picks its blocking from the query count, so a verified token's attention differs from the same
token decoded alone. Here keys come in blocks of ``KEY_BLOCK`` positions, fixed in absolute position: a query at
position p attends over exactly the keys ``0 .. (p // KEY_BLOCK + 1) * KEY_BLOCK - 1`` (keys after p masked, keys
past the sequence zero), whatever the call. The queries of one key block (at most ``KEY_BLOCK`` per sequence) form
one fused call ``softmax(mask(q k^T · scale)) v`` (SDPA, whose blocking follows the shape) whose rows (query x head
of the GQA group) go in tiles of one fixed row count per key-block span (``adaflash_hf.prepared.tiles``), so each
span's attention runs at one shape. A masked key contributes an exact zero (probability 0 times a finite value) to
the value sum, so whether the tail holds later tokens or padding does not change a bit.

- ``sequence_attention(query [Hq, n, D], keys [Hkv, L, D], values, start, scale)``: one sequence whose n new
  queries sit at positions ``start ..`` (``generate``'s dynamic cache: ``start = L - n``), with an optional extra
  boolean mask ``[n, L]`` (padding).
- ``slot_invariant_attention(query [T, Hq, D], key_pool, value_pool, packing, scale)``: the engine's packed row
  (``adaflash_hf.kernels.verify_packing``), each request through ``sequence_attention`` on its own slot, so a
  request's rows are the same served alone, batched, or decoded by ``generate``.

Pure torch; softmax in float32 (as transformers' eager attention).
"""

import functools

import torch
import torch.nn.functional as F

from adaflash_hf.kernels.verify_packing import SlotPacking
from adaflash_hf.prepared.tiles import Tiles, made_tiles, tiles_for

KEY_BLOCK = 64
# The large calls a key block's attention may make over a prompt's rows (multiples of its tile; admitted where they
# agree, adaflash_hf.prepared.tiles): 12 tiles of 16 rows hold a whole key block of a 3-query-head GQA group (the
# offline target), 4 a third of it. On one Intel Xeon with AMX, SDPA gives 192 rows in one call 0.2-0.3x the time of
# twelve tiles, bitwise the same.
ATTENTION_LARGE = (12, 4)
# the name the prepared forward registers this attention under with transformers (adaflash_hf.prepared.forward); no
# "flash" in it: transformers would take it for a flash-attention kernel
ATTENTION_NAME = "ada_invariant"
ROW_KERNEL = True  # the compiled row attention where it is loaded (module docstring)
# the compiled row attention's ops, "row" and "packed", set by adaflash_hf.prepared.native when it loads its library
# (preparing a target loads it)
ROW_OPS: dict = {}


def _row_kernel(query: torch.Tensor, dim: int) -> dict | None:
    """The row attention's ops where they serve these rows, else None."""
    if not ROW_KERNEL or not ROW_OPS or query.device.type != "cpu" or dim % 16 or dim > 512:
        return None
    return ROW_OPS if query.dtype in (torch.float32, torch.bfloat16) else None


def block_attention(query, allowed, *, keys, values, scale: float) -> torch.Tensor:
    """query ``[Hkv, R, D]`` rows over keys/values ``[Hkv, S, D]`` with ``allowed [R, S]`` -> ``[Hkv, R, D]``: one fused
    SDPA call (on a CPU, its flash kernel: softmax in float32, each query row on its own), one shape per tile."""
    return F.scaled_dot_product_attention(
        query[None], keys[None], values[None], attn_mask=allowed, scale=scale
    )[0]


def _sample(heads: int, dim: int, span: int, dtype, device, rows: int, generator: torch.Generator):
    query = torch.randn(heads, rows, dim, generator=generator).to(device=device, dtype=dtype)
    last = torch.randint(max(0, span - KEY_BLOCK), span, (rows, 1), generator=generator)
    return query, (torch.arange(span)[None, :] <= last).to(device)


@functools.lru_cache(maxsize=32)
def _causal_rows(first: int, last: int, span: int, group: int, device: torch.device) -> torch.Tensor:
    """``[group * (last - first), span]`` bool: the queries at positions ``first .. last - 1`` may see keys up to their
    own, repeated for the ``group`` heads of a GQA group. Every layer of a forward asks for the same: kept, never
    written."""
    index = torch.arange(span, device=device)
    return (index[None, :] <= index[first:last, None]).repeat(group, 1)


def _keys_of_block(keys: torch.Tensor, values: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys/values [Hkv, L, D]`` as fresh ``[Hkv, span, D]``: their first ``span`` positions, zeros past ``L``."""
    missing = max(0, span - keys.shape[1])
    return tuple(
        F.pad(t[:, :span], (0, 0, 0, missing))
        if missing
        else t[:, :span].clone(memory_format=torch.contiguous_format)
        for t in (keys, values)
    )


def _block_tiles(kv_heads: int, dim: int, span: int, dtype, device, op) -> Tiles:
    """The tiles of the attention over a key block ending at ``span`` (made with ``op`` on first use): the one shape
    ``sequence_attention`` and ``stacked_block_attention`` both run a request's rows in."""
    # no small shape: SDPA's result for a row differs between a 3-row and a 16-row call in about 1 random draw of 70
    # (one AMD EPYC), too rare for the tiles' check to see in a few rounds
    sample = functools.partial(_sample, kv_heads, dim, span, dtype, device)
    key = ("attention", kv_heads, dim, span, dtype, device)
    return tiles_for(key, op, sample, pads=(0.0, True), large=ATTENTION_LARGE)


def made_block_tiles(kv_heads: int, dim: int, span: int, dtype, device) -> Tiles | None:
    """The tiles of the attention over the key block ending at ``span`` where a forward has made them, else None."""
    return made_tiles(("attention", kv_heads, dim, span, dtype, device), large=ATTENTION_LARGE)


def sequence_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scale: float | None = None,
    allowed: torch.Tensor | None = None,
    key_block: int = KEY_BLOCK,
) -> torch.Tensor:
    """Causal attention of ``query [Hq, n, D]`` (positions ``start .. start + n - 1``) to ``keys/values [Hkv, L, D]``
    (``L >= start + n``; ``allowed [n, L]``: extra mask, True = attend) -> ``[Hq, n, D]``. See the module docstring."""
    heads, count, dim = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    kernel = _row_kernel(query, dim)
    if kernel is not None and keys.dtype == query.dtype:
        mask = query.new_empty(0, dtype=torch.bool) if allowed is None else allowed
        return kernel["row"](
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), start, scale, mask
        ).transpose(0, 1)
    outputs = []
    for block in range(start // key_block, (start + count - 1) // key_block + 1):
        first = max(start, block * key_block) - start
        last = min(start + count, (block + 1) * key_block) - start
        rows, span = last - first, (block + 1) * key_block
        mask = _causal_rows(start + first, start + last, span, group, query.device)
        if allowed is not None:
            extra = allowed.new_zeros(rows, span)
            width = min(span, allowed.shape[1])
            extra[:, :width] = allowed[first:last, :width]
            mask = mask & extra.repeat(group, 1)
        block_keys, block_values = _keys_of_block(keys, values, span)
        op = functools.partial(block_attention, keys=block_keys, values=block_values, scale=scale)
        tiles = _block_tiles(kv_heads, dim, span, query.dtype, query.device, op)
        # rows of the call: (head of the GQA group, query), the group's heads sharing their key/value head
        block_query = query[:, first:last].reshape(kv_heads, group * rows, dim)
        outputs.append(tiles.run(op, block_query, mask).reshape(heads, rows, dim))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def slot_invariant_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    packing: SlotPacking,
    scale: float | None = None,
) -> torch.Tensor:
    """The packed row ``query [T, Hq, D]``, request i's rows to slot ``packing.slots[i]`` of the pools
    ``[slots, capacity, Hkv, D]`` (this forward's keys already written) -> ``[T, Hq, D]``.

    Requests whose new rows sit in one key block and fill at most one tile (decode steps and verifies) go through
    ``stacked_block_attention``, those of one key block in one call; the others (prefills) through
    ``sequence_attention`` each."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_pool.shape[2]
    scale = dim**-0.5 if scale is None else scale
    kernel = _row_kernel(query, dim)
    if kernel is not None and key_pool.dtype == query.dtype:
        return kernel["packed"](query, key_pool, value_pool, packing.row_requests, scale)
    out = torch.empty_like(query)
    by_span: dict[int, list[tuple[int, int, int, int]]] = {}
    for slot, start, offset, length in zip(packing.slots, packing.starts, packing.offsets, packing.lengths):
        if stacked_rows(start, length, heads // kv_heads, kv_heads, dim, query.dtype, query.device):
            by_span.setdefault((start // KEY_BLOCK + 1) * KEY_BLOCK, []).append((slot, start, offset, length))
            continue
        end = start + length
        attended = sequence_attention(
            query[offset : offset + length].transpose(0, 1),
            key_pool[slot, :end].transpose(0, 1),
            value_pool[slot, :end].transpose(0, 1),
            start,
            scale,
        )
        out[offset : offset + length] = attended.transpose(0, 1)
    for span, requests in by_span.items():
        stacked_block_attention(out, query, key_pool, value_pool, requests, span, scale)
    return out


def stacked_rows(start: int, length: int, group: int, kv_heads: int, dim: int, dtype, device) -> int:
    """The rows of the stacked call a request of ``length`` new rows at ``start`` goes in (its key block's, with the
    others of that block: ``stacked_block_attention``), or 0 where it goes through ``sequence_attention``: its rows
    must sit in one key block and fill at most one tile, and stacking must agree on this machine."""
    block = start // KEY_BLOCK
    if (start + length - 1) // KEY_BLOCK != block:
        return 0
    rows = stacking_rows(kv_heads, dim, (block + 1) * KEY_BLOCK, dtype, device)
    return rows if group * length <= rows else 0


def stacked_entries(slots: list[int]) -> tuple[int, int] | None:
    """``(first, entries)`` where a stacked call over requests in ``slots`` reads its keys and values as a view of the
    pools, entries ``first .. first + entries - 1`` (the slots of that range, the ones of no request in this call
    attended too and their rows left unused): where at most half as many other slots sit among the requests' as
    there are requests (a wasted entry costs about what gathering a request's keys does); None where it gathers
    them."""
    first, entries = min(slots), max(slots) - min(slots) + 1
    return (first, entries) if 2 * (entries - len(slots)) <= len(slots) else None


def stacked_block_attention(out, query, key_pool, value_pool, requests, span: int, scale: float) -> None:
    """Requests ``(slot, start, offset, length)`` whose new rows all sit in the key block ending at ``span``: their
    rows in one SDPA call, one request per batch entry, each entry the tile ``sequence_attention`` would give that
    request alone (its rows first, padding rows after). Written into ``out [T, Hq, D]``. The entries are the
    requests' slots in a range of the pools where ``stacked_entries`` says so (a view, nothing copied; an entry
    of no request sees every key and is not read), else the requests in turn, their keys gathered."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_pool.shape[2]
    group = heads // kv_heads
    rows = stacking_rows(kv_heads, dim, span, query.dtype, query.device)
    slots = [r[0] for r in requests]
    view = stacked_entries(slots)
    # [entries, Hkv, span, D], a view of [entries, span, Hkv, D] (stacking_agrees checks the call on such views);
    # past a request's length its slot holds zeros or its own rejected drafts' keys, where sequence_attention has
    # zeros: masked, so a finite key there changes no bit (the module docstring)
    if view is None:
        entry_of = range(len(requests))
        index = torch.tensor(slots, device=query.device)
        keys, values = (pool[index, :span].transpose(1, 2) for pool in (key_pool, value_pool))
    else:
        first, entries = view
        entry_of = [slot - first for slot in slots]
        keys, values = (
            pool[first : first + entries, :span].transpose(1, 2) for pool in (key_pool, value_pool)
        )
    count = keys.shape[0]
    tile = query.new_zeros(count, kv_heads, rows, dim)
    mask = torch.ones(count, 1, rows, span, dtype=torch.bool, device=query.device)
    for entry, (_, start, offset, length) in zip(entry_of, requests):
        tile[entry, :, : group * length] = (
            query[offset : offset + length].transpose(0, 1).reshape(kv_heads, group * length, dim)
        )
        mask[entry, 0, : group * length] = _causal_rows(start, start + length, span, group, query.device)
    attended = F.scaled_dot_product_attention(tile, keys, values, attn_mask=mask, scale=scale)
    for entry, (_, _, offset, length) in zip(entry_of, requests):
        part = attended[entry, :, : group * length].reshape(heads, length, dim)
        out[offset : offset + length] = part.transpose(0, 1)


def stacking_rows(kv_heads: int, dim: int, span: int, dtype, device) -> int:
    """The row count of the attention tile for this key span where stacking requests in one call gives each the
    result of its own call (``stacking_agrees``), else 0 (every request through ``sequence_attention``)."""
    key = (kv_heads, dim, span, dtype, device, torch.get_num_threads())
    rows = _STACKING.get(key)
    if rows is None:
        keys = torch.randn(kv_heads, span, dim, generator=torch.Generator().manual_seed(span)).to(
            device, dtype
        )
        op = functools.partial(block_attention, keys=keys, values=keys.flip(1), scale=dim**-0.5)
        tiles = _block_tiles(kv_heads, dim, span, dtype, device, op)
        rows = (
            tiles.rows
            if tiles.rows > 1 and stacking_agrees(kv_heads, dim, span, dtype, device, tiles.rows)
            else 0
        )
        _STACKING[key] = rows
    return rows


_STACKING: dict[tuple, int] = {}
STACKING_ROUNDS = 8


@torch.no_grad()
def stacking_agrees(kv_heads: int, dim: int, span: int, dtype, device, rows: int) -> bool:
    """Whether SDPA over a stack of tiles (``[count, Hkv, rows, D]``, each entry its own keys, values and mask) gives
    every entry bitwise what that tile's own call gives it, for stacks of 2 to 9 entries of random tiles. The stack's
    keys and values are views ``[count, span, Hkv, D] -> [count, Hkv, span, D]`` as the slot pools give them, every
    other round of longer slots cut to the span (``stacked_entries``' view of the pools), each tile's own contiguous
    as ``sequence_attention`` gives them."""
    generator = torch.Generator().manual_seed(span + rows)
    for count in range(2, 2 + STACKING_ROUNDS):
        entries = []
        for _ in range(count):
            query, allowed = _sample(kv_heads, dim, span, dtype, device, rows, generator)
            keys, values = (
                torch.randn(kv_heads, span, dim, generator=generator).to(device, dtype) for _ in range(2)
            )
            entries.append((query, allowed, keys, values))
        capacity = span + KEY_BLOCK * (count % 2)
        pools = []
        for i in (2, 3):
            pool = torch.zeros(count, capacity, kv_heads, dim, dtype=dtype, device=device)
            pool[:, :span] = torch.stack([e[i].transpose(0, 1) for e in entries])
            pools.append(pool[:, :span].transpose(1, 2))
        stacked = F.scaled_dot_product_attention(
            torch.stack([e[0] for e in entries]),
            *pools,
            attn_mask=torch.stack([e[1] for e in entries])[:, None],
            scale=dim**-0.5,
        )
        for index, (query, allowed, keys, values) in enumerate(entries):
            alone = block_attention(query, allowed, keys=keys, values=values, scale=dim**-0.5)
            if not torch.equal(stacked[index], alone):
                return False
    return True
