"""The target a benchmark runs, in the dtype and preparation its options ask for, and the plain decodings a user could
run instead; shared by ``adaflash bench generate`` and ``adaflash bench serve``.

- ``--dtype {fp32,bf16,auto}``: the benchmarked target's dtype (``auto``: bf16 where this CPU reports a bf16 unit,
  ``adaflash_hf.prepared.prepare.choose_dtype``);
- ``--prepared``: ``adaflash_hf.prepare_target(target, dtype=...)`` (bf16: the checked batch-invariant forward);
- ``--plain-baselines {fp32,bf16}``: plain decoding as transformers runs it in each dtype, timed beside the methods;
  the fastest is what a user would otherwise run, and every method's speed-up is also reported against it.

Each is a private copy of the loaded target (``load_target``'s object is shared and must stay as it is).
"""

from __future__ import annotations

import copy

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CHOICES = (*DTYPES, "auto")


def add_target_options(parser) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="fp32",
        help="the target's dtype (default fp32; auto: bf16 where this CPU has avx512_bf16 or amx_bf16)",
    )
    parser.add_argument(
        "--prepared",
        action="store_true",
        help="run the target through adaflash_hf.prepare_target(dtype=--dtype): bf16 gets the batch-invariant "
        "forward, so every method must equal plain decoding of the prepared target",
    )
    parser.add_argument(
        "--plain-baselines",
        nargs="*",
        choices=tuple(DTYPES),
        default=list(DTYPES),
        help="plain decodings (transformers' own forward) timed beside the methods; speed-ups are also reported "
        "against the fastest (default: fp32 bf16; none: against this target's plain only)",
    )


def benchmarked_target(loaded, dtype: str, prepared: bool):
    """A copy of ``loaded`` in ``dtype``, through ``prepare_target`` when ``prepared``; and the preparation's record
    (dtype, invariant, why) or None."""
    from adaflash_hf.prepared.cpu import bf16_units
    from adaflash_hf.prepared.prepare import choose_dtype, is_prepared, prepare_target

    target = copy.deepcopy(loaded)
    if prepared:
        settings = is_prepared(prepare_target(target, dtype=dtype))
        return target, {
            "dtype": str(settings.dtype),
            "invariant": settings.invariant,
            "reason": settings.reason,
        }
    chosen = DTYPES.get(dtype) or choose_dtype(next(target.parameters()).device, bf16_units())[0]
    return target.to(chosen), None


def plain_baselines(loaded, names, target, prepared: dict | None) -> dict:
    """Baseline name -> a copy of ``loaded`` in that dtype, or None where the benchmarked ``target`` is that plain
    decoding itself (not prepared, same dtype)."""
    own = None if prepared is not None else next(target.parameters()).dtype
    return {
        name: None if DTYPES[name] == own else copy.deepcopy(loaded).to(DTYPES[name])
        for name in dict.fromkeys(names)
    }
