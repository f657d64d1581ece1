"""Batch-invariant linear layer: ``F.linear`` whose every row's result is the same whatever the number of rows in the
call, by a row plan per weight shape (``adaflash_hf.kernels.row_plan``).

``invariant_linear(x, weight, bias)`` flattens ``x [..., K]`` to rows, runs them through the plan of
``(K, N, bias, dtype, device, weight strides)`` and reshapes back. On an AVX2 EPYC with MKL the fp32 plan pads to
multiples of 4 rows (a 1-token step then costs what a 4-token one costs), the bf16 plan runs unpadded; CPUs with bf16
matrix units (oneDNN kernels) get whatever plan their own probes verify.
"""

import functools

import torch
import torch.nn.functional as F

from adaflash_hf.kernels.row_plan import plan_for


def _sample(features: int, dtype: torch.dtype, device: torch.device, rows: int, generator: torch.Generator):
    return (torch.randn(rows, features, generator=generator).to(device=device, dtype=dtype),)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each row computed as it would be among any number of rows."""
    features, out_features = weight.shape[1], weight.shape[0]
    rows = x.reshape(-1, features)
    if rows.shape[0] == 0:
        return F.linear(x, weight, bias)
    op = functools.partial(F.linear, weight=weight, bias=bias)
    key = ("linear", features, out_features, bias is not None, weight.dtype, weight.device, weight.stride())
    plan = plan_for(key, op, functools.partial(_sample, features, weight.dtype, weight.device), pads=(0.0,))
    return plan.run(op, rows).reshape(*x.shape[:-1], out_features)


class InvariantLinear(torch.nn.Linear):
    """``nn.Linear`` running ``invariant_linear``; a prepared target's linears have this class (same parameters, same
    state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)
