"""Fixed-shape tiles: run a row-wise op so that every row's result is bitwise the same whatever the number of rows in
the call (batch invariance), by construction rather than by probing row counts.

Why rows differ at all. A CPU GEMM library picks its kernel, blocking and thread split from the call's shape: MKL
gives an fp32 row one result alone (GEMV), another in a 2-3-row call and a third from 4 rows on; oneDNN on an Intel
CPU with AMX runs some row counts on AMX tiles and others (tails, small calls) on AVX-512 kernels that sum in another
order. Which row counts agree is a property of the library version and the ISA, so no list of probed row counts
holds on every CPU.

The construction. Every call of an op is made with exactly ``rows`` rows (the op's tile): a smaller call is padded up
to it (in a tile kept per thread, so a decode step allocates nothing), a larger one split into tiles (the last one
padded), outputs cropped. One shape means one kernel, one blocking
and one thread split for every call the op ever makes in this process, so the only thing a row's result can still
depend on is its position inside the tile (a kernel may treat a tile's rows unevenly: register blocks, a tail of the
tile). That is a property of one kernel at one shape, checked exhaustively when the op's tiles are made
(``position_invariant``): every row of a tile of random rows must give bitwise what it gives alone at the first
position of a padded tile (the call a 1-token decode step makes). Where it holds the op is batch-invariant for every
row count, including counts never seen; no probe of other row counts is needed, nor made. Each tile is contiguous
and 64-byte aligned, as a fresh tensor is, so strides and alignment are the same for every call too.

A second, small shape. A decode step calls each linear with one row, and a padded tile costs more than that call: 2x
for the bf16 output embedding, 1.6x for a 4-bit linear on one AMD EPYC. So an op may name a ``small`` row count that
it runs as is, in calls of exactly ``small`` rows, where that shape gives every row bitwise what the tile gives it
(``small_agrees``: each run of ``small`` rows of random tiles, called alone, equals the same rows of the whole
tile). One more shape is one more kernel path; the check is what admits it, on this machine, as the position check
admits a tile. Where it fails, ``small`` calls go in tiles like any other.

Large shapes. A prompt's prefill calls each linear with hundreds of rows, and each call has its price: a GEMM reads
its weight once per call (on one Intel Xeon with AMX, oneDNN's bf16 linear runs 32 rows in 0.55-0.67x the time of two
16-row tiles), an attention call sets up its blocks (SDPA over a key block runs 192 rows in 0.2-0.3x the time of
twelve tiles). So an op may name multiples of its tile (``large``) that it runs in one call, each admitted where that
shape gives every row bitwise what the tiles give it (``large_agrees``: random rows in one call equal the same rows in
their tiles). A longer input then goes in calls of the largest admitted size that is left, tiles after.

Tile sizes tried: ``TILE_ROWS`` in order (16 covers a decode step and a full 16-token verify in one call; 32 and 64
for kernels whose register blocks do not divide 16). Where none is position-invariant the op runs one row per call
(one shape, one position: invariant whatever the kernel does, and slow); it warns, and ``prepare_target`` reports it.

Where it is not invariant: a kernel whose result for a row depends on the other rows' values (no GEMM does: rows are
independent dot products; the check compares each row among others with the row alone), a thread count other than
the one the tiles were made at (tiles are kept per thread count), and ops that are not called through tiles (the
elementwise and row-wise ops of the forward, ``adaflash_hf.prepared.forward``). Pure torch, any device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

TILE_ROWS = (16, 32, 64)
# Tiles of random rows checked row by row against each row alone when an op's tiles are made. A path that sums in
# another order differs in few outputs once rounded to bf16, so each round draws rows of widely spread magnitudes.
POSITION_ROUNDS = 3
# Tiles of random rows whose small calls are checked against the tile's call. More rounds than the position check: a
# second shape is a second kernel path (on one AMD EPYC oneDNN's bf16 linear with 1536 inputs gives one row in six
# another result at one row than at sixteen; its 576-input linears and the 4-bit kernel gave none in 2,400 draws).
SMALL_ROUNDS = 8

Op = Callable[..., torch.Tensor]
Sampler = Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]


def padded_rows(rows: torch.Tensor, size: int, pad) -> torch.Tensor:
    """``rows`` as a contiguous tensor of ``size`` rows (dim -2), padded with ``pad``: ``rows`` itself when it already
    is one at the start of its storage (a kernel sees it as it sees a fresh tensor: same strides, aligned), else a
    fresh copy."""
    if rows.shape[-2] == size and rows.is_contiguous() and rows.storage_offset() == 0:
        return rows
    out = rows.new_full((*rows.shape[:-2], size, rows.shape[-1]), pad)
    out[..., : rows.shape[-2], :] = rows
    return out


@torch.no_grad()
def position_invariant(
    op: Op, sample: Sampler, rows: int, pads: Sequence = (0.0,), rounds: int = POSITION_ROUNDS
) -> bool:
    """Whether ``op`` called with ``rows`` rows gives each row the same result at every position of the call, whatever
    the other rows hold: in ``rounds`` tiles of random rows, every row's result equals that row's result alone at
    position 0 of a tile padded with ``pads`` (the call a 1-row forward makes)."""
    generator = torch.Generator().manual_seed(rows)
    for _ in range(rounds):
        batch = sample(rows, generator)
        together = op(*batch)
        for i in range(rows):
            alone = op(*(padded_rows(t[..., i : i + 1, :], rows, p) for t, p in zip(batch, pads)))
            if not torch.equal(together[..., i : i + 1, :], alone[..., :1, :]):
                return False
    return True


@torch.no_grad()
def small_agrees(op: Op, sample: Sampler, rows: int, small: int, rounds: int = SMALL_ROUNDS) -> bool:
    """Whether ``op`` called with ``small`` rows gives each of them bitwise what a call of ``rows`` rows gives it: in
    ``rounds`` tiles of random rows, every run of ``small`` consecutive rows called alone equals those rows of the
    tile's call. With ``position_invariant(op, sample, rows)``, a row's result is then the same in either shape."""
    generator = torch.Generator().manual_seed(rows + small)
    for _ in range(rounds):
        batch = sample(rows, generator)
        together = op(*batch)
        for start in range(0, rows - small + 1, small):
            alone = op(
                *(
                    t[..., start : start + small, :].clone(memory_format=torch.contiguous_format)
                    for t in batch
                )
            )
            if not torch.equal(together[..., start : start + small, :], alone):
                return False
    return True


def large_agrees(op: Op, sample: Sampler, rows: int, large: int, rounds: int = SMALL_ROUNDS) -> bool:
    """Whether ``op`` called with ``large`` rows (a multiple of ``rows``) gives each of them bitwise what its tile of
    ``rows`` rows gives it: ``small_agrees`` with the tile as the small shape of a ``large``-row call."""
    return small_agrees(op, sample, large, rows, rounds)


class Tiles:
    """How one row-wise op is called (module docstring): always ``rows`` rows, or exactly ``small`` where that shape
    agrees (``self.small``, 0 where none), or in calls of the ``large`` multiples of ``rows`` that agree
    (``self.large``: their row counts, largest first; checked in ``SMALL_ROUNDS`` rounds as a small shape is).
    ``op(*inputs)`` takes tensors with rows on dim -2 and returns rows on dim -2; ``sample(rows, generator)`` draws
    random inputs for the checks; ``pads`` holds the padding value of each input."""

    def __init__(
        self,
        name: str,
        op: Op,
        sample: Sampler,
        pads: Sequence,
        candidates: Sequence[int] = TILE_ROWS,
        small: int = 0,
        large: Sequence[int] = (),
    ):
        self.name, self.pads, self._kept, self.small = name, tuple(pads), {}, 0
        self.large: tuple[int, ...] = ()
        for rows in candidates:
            if position_invariant(op, sample, rows, self.pads):
                self.rows = rows
                if 0 < small < rows and small_agrees(op, sample, rows, small):
                    self.small = small
                if rows > 1:
                    sizes = sorted({rows * m for m in large if m > 1}, reverse=True)
                    self.large = tuple(n for n in sizes if large_agrees(op, sample, rows, n))
                logger.debug(
                    f"tiles {name}: {rows} rows, small calls of {self.small or 'none'}, large calls of "
                    f"{self.large or 'none'}"
                )
                return
        self.rows = 1
        logger.warning(
            f"tiles {name}: no tile of {tuple(candidates)} rows gives a row the same result at every position on "
            "this machine; running it one row per call (batch-invariant, slow)"
        )

    def run(self, op: Op, *inputs: torch.Tensor) -> torch.Tensor:
        """``op`` over all rows of ``inputs`` in calls of exactly ``self.rows`` rows; the rows' results, cropped. The
        inputs are padded once to a whole number of tiles; each tile is a contiguous slice of that, 64-byte aligned
        as a fresh tensor is (or a fresh copy where a slice would not be)."""
        count, size = inputs[0].shape[-2], self.rows
        if count == size and all(t.is_contiguous() and t.storage_offset() == 0 for t in inputs):
            return op(*inputs)  # already one tile, as a fresh tensor would be: as it is
        if count < size and not any(t.requires_grad for t in inputs):
            # a decode step (its small shape where it has one) or a short verify: in this thread's kept buffers
            if count == self.small:
                return op(*self._kept_tiles(inputs, count))
            return op(*self._kept_tiles(inputs, size))[..., :count, :]
        whole = -(-count // size) * size
        padded = [padded_rows(t, whole, p) for t, p in zip(inputs, self.pads)]
        outputs = [op(*(_tile(t, start, rows) for t in padded)) for start, rows in self.calls(whole)]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)
        return out if whole == count else out[..., :count, :]

    def calls(self, whole: int) -> list[tuple[int, int]]:
        """``(start, rows)`` of the calls over ``whole`` rows (a whole number of tiles): each the largest admitted
        large size that is left, else a tile."""
        calls, start = [], 0
        while start < whole:
            rows = next((n for n in self.large if n <= whole - start), self.rows)
            calls.append((start, rows))
            start += rows
        return calls

    def large_mask(self) -> int:
        """``self.large`` as multiples of the tile, bit m set for each (what the compiled layer takes)."""
        return sum(1 << (n // self.rows) for n in self.large)

    def _kept_tiles(self, inputs: Sequence[torch.Tensor], size: int) -> list[torch.Tensor]:
        """``inputs`` (at most ``size`` rows) written at the start of tiles of ``size`` rows kept for this thread and
        these shapes: allocated once (padded, contiguous, aligned as a fresh tensor), their other rows left as earlier
        calls wrote them, which cannot change a row's result (the position check draws them at random)."""
        key = (threading.get_ident(), size, *(t.shape for t in inputs))
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = [_new_tile(t, pad, size) for t, pad in zip(inputs, self.pads)]
        for (_, rows), t in zip(kept, inputs):
            rows.copy_(t)
        return [tile for tile, _ in kept]


def _new_tile(rows: torch.Tensor, pad, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile of ``size`` rows, padded, for inputs shaped like ``rows`` and the view of it their rows are written to; a
    normal tensor, so that it is written inside and outside inference mode alike."""
    with torch.inference_mode(False):
        tile = torch.full((*rows.shape[:-2], size, rows.shape[-1]), pad, dtype=rows.dtype, device=rows.device)
    return tile, tile.narrow(-2, 0, rows.shape[-2])


def _tile(rows: torch.Tensor, start: int, size: int) -> torch.Tensor:
    tile = rows[..., start : start + size, :]
    return (
        tile
        if tile.is_contiguous() and tile.data_ptr() % 64 == 0
        else tile.clone(memory_format=torch.contiguous_format)
    )


_TILES: dict[tuple, Tiles] = {}


def tiles_for(
    key: tuple,
    op: Op,
    sample: Sampler,
    pads: Sequence,
    candidates: Sequence[int] = TILE_ROWS,
    small: int = 0,
    large: Sequence[int] = (),
) -> Tiles:
    """The tiles of the op named by ``key`` (its kind and every shape, dtype and device it depends on) at the current
    thread count, made on first use with ``op`` (any op of that key: a kernel's path depends on shapes, not
    values), the first position-invariant size of ``candidates``, and ``small`` and ``large`` calls where they
    agree."""
    full_key = (*key, small, tuple(large), torch.get_num_threads())
    tiles = _TILES.get(full_key)
    if tiles is None:
        tiles = _TILES[full_key] = Tiles(str(full_key), op, sample, pads, candidates, small, large)
    return tiles


def made_tiles(key: tuple, small: int = 0, large: Sequence[int] = ()) -> Tiles | None:
    """The tiles ``tiles_for(key, ..., small=small, large=large)`` made for the current thread count, None where none
    were made."""
    return _TILES.get((*key, small, tuple(large), torch.get_num_threads()))


def row_by_row_ops() -> list[str]:
    """The ops of this process that found no position-invariant tile and run one row per call."""
    return [tiles.name for tiles in _TILES.values() if tiles.rows == 1]
