"""Row plans: run a row-wise op so that every row's result is bitwise the same whatever the number of rows in the
call (batch invariance).

A CPU GEMM picks its kernel, blocking and thread split from the shape. Measured with MKL on an AVX2 EPYC in fp32: a
row of ``F.linear`` gets one result alone (GEMV), another in a 2-3-row call and a third from 4 rows on; with 2 threads
a row in the 1-3-row remainder of a 5-7-row call gets the 2-3-row result. So without care a token's logits depend on
how many tokens share the forward, and a speculative verify can flip a near-tied greedy choice. A plan fixes the row
counts the op is ever called with (its ``sizes``), each verified to give every row the same result, and pads every
call up to one of them (outputs cropped):

- ``unit``: the smallest size. The sizes are its multiples up to 16, verified when the plan is made (they cover
  every decode and verify forward), then 24, 32, 48, 64, 96, 128, 192, 256, each verified on first need; a size that
  fails is never used, its rows go through the verified sizes below it. Calls past 256 rows run in chunks.
- a size m is verified when, in ``PROBE_ROUNDS`` m-row calls of distinct random rows, every checked row (all of
  them, or ``PROBE_ROWS`` of a larger call) equals that row's result at row 0 of a ``unit``-row call. Kernels choose
  their path from shapes and strides, not values (every call gets contiguous inputs at the start of their storage,
  so strides and alignment are the same too), but a path that sums in another order shows in few bf16 outputs: on
  SmolLM2's down projection (K = 1536) a 1-row call sums differently from a multi-row one, and one random row showed
  it in about 1 probe of 15; 64 distinct rows per size show it (its plan pads a 1-token step to 2 rows).
- units tried: 1, 2, 4, 8, 16; the first whose sizes up to 16 all verify wins (fp32 MKL on AVX2: 4; bf16 on AVX2,
  which has no bf16 units: 1). When none does the plan runs one row per call: one shape and one position, invariant
  by construction and slow; it warns.

Plans are kept per op key and thread count (``plan_for``): a thread count has its own kernels and splits, so outputs
are comparable between runs at the same thread count. Pure torch, any device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

UNITS = (1, 2, 4, 8, 16)
EAGER_ROWS = 16
LARGE_SIZES = (24, 32, 48, 64, 96, 128, 192, 256)
# A path that sums in another order differs from the reference in few outputs once they are rounded to bf16 (measured:
# one random row of SmolLM2's down projection showed it in 1 probe of 15), so a size is checked on many distinct rows.
PROBE_ROUNDS = 4
PROBE_ROWS = 16

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


class RowPlan:
    """How one row-wise op is called (see the module docstring). ``op(*inputs)`` takes tensors with rows on dim -2
    and returns rows on dim -2; ``sample(rows, generator)`` draws random inputs of ``rows`` rows for the probes;
    ``pads`` holds the padding value of each input."""

    def __init__(self, name: str, op: Op, sample: Sampler, pads: Sequence):
        self.name, self.sample, self.pads = name, sample, tuple(pads)
        for unit in UNITS:
            sizes = list(range(unit, EAGER_ROWS + 1, unit))
            if all(self.verifies(op, unit, size) for size in sizes):
                self.unit, self.sizes = unit, sizes
                self.untried = [s for s in LARGE_SIZES if s % unit == 0]
                logger.debug(f"row plan {name}: unit {unit}")
                return
        self.unit, self.sizes, self.untried = 1, [1], []
        logger.warning(
            f"row plan {name}: no row count from {UNITS} gives every row the same result on this machine; "
            "running it one row per call (batch-invariant, slow)"
        )

    @torch.no_grad()
    def verifies(self, op: Op, unit: int, size: int) -> bool:
        """Whether every checked row of ``size``-row calls of distinct random rows gets the result its input gets at
        row 0 of a ``unit``-row call (``PROBE_ROUNDS`` calls, up to ``PROBE_ROWS`` rows checked in each)."""
        generator = torch.Generator().manual_seed(size)
        for _ in range(PROBE_ROUNDS):
            batch = self.sample(size, generator)
            out = op(*batch)
            checked = (
                range(size) if size <= PROBE_ROWS else torch.randperm(size, generator=generator)[:PROBE_ROWS]
            )
            for i in map(int, checked):
                row = (padded_rows(t[..., i : i + 1, :], unit, pad) for t, pad in zip(batch, self.pads))
                if not torch.equal(out[..., i : i + 1, :], op(*row)[..., :1, :]):
                    return False
        return True

    def size_for(self, op: Op, rows: int) -> int:
        """The verified size a call of ``rows`` rows is padded to (or, past the largest, the chunk size)."""
        while self.untried and rows > self.sizes[-1]:
            size = self.untried.pop(0)
            if self.verifies(op, self.unit, size):
                self.sizes.append(size)
            else:
                logger.debug(f"row plan {self.name}: {size} rows not invariant, not used")
        return next((s for s in self.sizes if s >= rows), self.sizes[-1])

    def run(self, op: Op, *inputs: torch.Tensor) -> torch.Tensor:
        """``op`` over all rows of ``inputs``, each call padded to a verified size; the rows' results, cropped."""
        rows = inputs[0].shape[-2]
        if rows in self.sizes and all(t.is_contiguous() and t.storage_offset() == 0 for t in inputs):
            return op(*inputs)  # already a verified size, as a fresh tensor would be: as it is
        outputs, start = [], 0
        while start < rows:
            size = self.size_for(op, rows - start)
            take = min(size, rows - start)
            chunk = (padded_rows(t[..., start : start + take, :], size, p) for t, p in zip(inputs, self.pads))
            outputs.append(op(*chunk)[..., :take, :])
            start += take
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


_PLANS: dict[tuple, RowPlan] = {}


def plan_for(key: tuple, op: Op, sample: Sampler, pads: Sequence) -> RowPlan:
    """The plan of the op named by ``key`` (its kind and every shape, dtype and device it depends on) at the current
    thread count, made on first use with ``op`` (any op of that key: a plan depends on shapes, not on values)."""
    full_key = (*key, torch.get_num_threads())
    plan = _PLANS.get(full_key)
    if plan is None:
        plan = _PLANS[full_key] = RowPlan(str(full_key), op, sample, pads)
    return plan
