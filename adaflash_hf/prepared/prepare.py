"""``prepare_target``: a target in the fastest dtype this CPU verifies in, with a batch-invariant forward, so that
greedy speculative decoding and batched serving equal plain greedy decoding of the same prepared target token for
token.

    import adaflash_hf
    target = adaflash_hf.prepare_target(target)            # in place; returns the target
    target.generate(ids, assistant_model=drafter)           # == target.generate(ids), bitwise, in bf16 too

Why. On a CPU with bf16 dot products (``avx512_bf16``, ``amx_bf16``) a bf16 forward of 2..16 new tokens costs about
what a 1-token one costs, so verification is nearly free; but a row's numerics depend on how many rows share the
forward, so a bf16 target's speculative greedy text can differ from its plain greedy text, and a served request's
text from the same request served alone. The invariant forward (``adaflash_hf.prepared.forward``) computes every row
the same way whatever the row count, by construction: each linear and attention block is always called at one row
count (``adaflash_hf.prepared.tiles``), so no kernel library can pick a second kernel for it. Plain decoding of the
prepared target runs it too, so "lossless" compares like with like.

Settings:

- ``dtype``: ``"auto"``, ``"bf16"``/``torch.bfloat16``, ``"fp32"``/``torch.float32`` or ``"int4"``. ``"auto"`` keeps
  fp32 where the CPU reports no bf16 unit or torch has no oneDNN; elsewhere it times eager fp32 against the invariant bf16
  forward on copies of the target and takes the one with the most tokens per second that decodes no slower than
  fp32 (``adaflash_hf.prepared.choice``; the timings are kept per machine); bf16 also needs every linear of the target
  to find a tile. One logged line says why. Rotary frequencies stay fp32.
  For a target whose linears are 4-bit already (fp32 weights dequantized from a Q4 GGUF, as ``load_target`` gives the
  offline SmolLM2), "auto" times ``"int4"`` too.
- ``"int4"``: the invariant bf16 forward with every linear whose weights are 4-bit in groups of 32 (all but the
  output embedding, or it is refused) run on its own 4-bit codes, reading a quarter of bf16's bytes per weight
  (``adaflash_hf.prepared.four_bit``); needs the fp32 weights of a 4-bit model and a CPU.
- ``measure``: ``False`` makes ``"auto"`` decide from the CPU's flags alone (bf16 wherever it has a bf16 unit).
- ``timer``: what ``"auto"`` times (``timer(model) -> {n: seconds}``); default: a forward of n = 1, 4, 8, 16 new
  tokens after a prompt, as ``generate`` verifies. ``adaflash serve`` times the engine's packed forward instead.
- ``invariant``: the invariant forward; default on for bf16 and off for fp32 (an fp32 forward's row-count effects
  are ~1e-7 relative and have not flipped a greedy token in any benchmark; pass ``invariant=True`` to make fp32
  equality a guarantee too).
- ``rows``: the check (``check=True``) runs, after a prefill, forwards of n = 2..rows new tokens and one of
  ``2 * rows + 8`` (several tiles in one call, as the engine's packed forward makes), windows straddling a key block,
  and raises unless every row's logits equal the same token decoded alone, bitwise. The construction makes a check of
  every row count unnecessary (one shape per op, and a one-row shape only where it was checked to agree with it);
  this is the end-to-end proof on this machine, at this thread count.
- ``bf16_units``: the CPU's bf16 flags, read from /proc/cpuinfo when None (``adaflash_hf.prepared.cpu.bf16_units``).

``is_prepared(target)`` returns the settings (``TargetPreparation``) while the target still has them, else None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn import Linear
from transformers import DynamicCache, PreTrainedModel
from transformers.utils import logging

from adaflash_hf.prepared import four_bit
from adaflash_hf.prepared.attention import KEY_BLOCK
from adaflash_hf.prepared.choice import Timer, choose, forward_timer, timings_once
from adaflash_hf.prepared.cpu import BF16_UNITS, cpu_model
from adaflash_hf.prepared.cpu import bf16_units as detect_bf16_units
from adaflash_hf.prepared.forward import install_invariant_forward, rotary_modules, runs_invariant_forward
from adaflash_hf.prepared.linear import linear_tiles, projection_groups

logger = logging.get_logger(__name__)

FOUR_BIT = "int4"
DTYPES = {
    "auto": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int4": FOUR_BIT,
}
_ATTRIBUTE = "_adaflash_preparation"


@dataclass(frozen=True)
class TargetPreparation:
    """What ``prepare_target`` did: the dtype, whether the forward is batch-invariant, why that dtype, the CPU's
    bf16 flags, the largest forward the check verified (0: not checked), and ``"int4"`` where the linears run on
    their 4-bit codes (``dtype="int4"``; ``dtype`` is then bf16, the activations'), else ``""``."""

    dtype: torch.dtype
    invariant: bool
    reason: str
    bf16_units: tuple[str, ...]
    checked_rows: int
    weights: str = ""


def _check_settings(
    target, dtype, invariant, rows, check, bf16_units
) -> tuple[torch.dtype | None, tuple | None]:
    if not isinstance(target, PreTrainedModel) or target.get_output_embeddings() is None:
        raise TypeError(
            f"target: expected a transformers causal LM (a PreTrainedModel with an output embedding), "
            f"got {type(target).__name__}"
        )
    key = dtype if isinstance(dtype, str) else None
    if isinstance(dtype, torch.dtype):
        key = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
    if key not in DTYPES:
        raise ValueError(
            f"dtype: expected one of {list(DTYPES)}, torch.float32 or torch.bfloat16, got {dtype!r}"
        )
    if DTYPES[key] == FOUR_BIT:
        if invariant is False:
            raise ValueError(
                "invariant: expected True or None with dtype='int4' (its forward is the invariant one)"
            )
        if not four_bit.available():
            raise ValueError(
                f"dtype='int4': expected a torch with the CPU kernel for 4-bit weights, got {torch.__version__}"
            )
        device = next(target.parameters()).device
        if device.type != "cpu":
            raise ValueError(
                f"dtype='int4': expected a target on the CPU (its kernel is torch's CPU one), got {device}"
            )
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows: expected an int >= 1 (the largest forward the check verifies), got {rows!r}")
    if invariant is not None and not isinstance(invariant, bool):
        raise TypeError(f"invariant: expected a bool or None, got {invariant!r}")
    if not isinstance(check, bool):
        raise TypeError(f"check: expected a bool, got {check!r}")
    if bf16_units is not None:
        bf16_units = tuple(bf16_units)
        unknown = [u for u in bf16_units if u not in BF16_UNITS]
        if unknown:
            raise ValueError(f"bf16_units: expected flags among {BF16_UNITS}, got {list(bf16_units)}")
    return DTYPES[key], bf16_units


def choose_dtype(device: torch.device, units: tuple[str, ...]) -> tuple[torch.dtype, str]:
    """``dtype="auto"``: bf16 where the CPU has a bf16 unit and torch has oneDNN, else fp32; and why, in one line."""
    if device.type != "cpu":
        return torch.float32, f"fp32: bf16 detection covers CPUs, the target is on {device.type}; pass dtype"
    missing = " nor ".join(u for u in BF16_UNITS if u not in units)
    if not units:
        return (
            torch.float32,
            f"fp32: this CPU has neither {missing}, so the bf16 matrix products of a verify forward (several tokens) "
            "run slower than fp32 ones",
        )
    if not torch.backends.mkldnn.is_available():
        return torch.float32, f"fp32: this CPU has {', '.join(units)} but torch is built without oneDNN"
    return torch.bfloat16, f"bf16: this CPU has {', '.join(units)}"


def prepare_target(
    target: PreTrainedModel,
    dtype: str | torch.dtype = "auto",
    invariant: bool | None = None,
    rows: int = 16,
    check: bool = True,
    bf16_units: Iterable[str] | None = None,
    measure: bool = True,
    timer: Timer | None = None,
) -> PreTrainedModel:
    """Cast ``target`` in place to the chosen dtype, install the batch-invariant forward and check it (module
    docstring); returns ``target``. Settings are checked before anything changes; a target already prepared with
    other settings is refused (its weights may have lost precision: prepare a fresh copy)."""
    requested, units = _check_settings(target, dtype, invariant, rows, check, bf16_units)
    if not isinstance(measure, bool):
        raise TypeError(f"measure: expected a bool, got {measure!r}")
    if timer is not None and not callable(timer):
        raise TypeError(f"timer: expected a callable timer(model) -> {{n: seconds}} or None, got {timer!r}")
    units = detect_bf16_units() if units is None else units
    device = next(target.parameters()).device
    previous = getattr(target, _ATTRIBUTE, None)
    if previous is not None and requested is None and invariant in (None, previous.invariant):
        if is_prepared(target) is not None:
            return target  # "auto" again: the choice made stands (measuring a prepared target would copy it twice)
    if requested is None:
        chosen, reason = choose_dtype(device, units)
        if chosen == torch.bfloat16 and measure:
            chosen, reason = _measured_choice(target, timer or forward_timer)
        slow = _row_by_row_linears(target, chosen) if chosen == torch.bfloat16 else []
        if slow:
            chosen, reason = (
                torch.float32,
                (
                    f"fp32: this CPU has {', '.join(units)}, but no tile of rows runs its bf16 linears "
                    f"{', '.join(slow)} the same at every position, so an invariant bf16 forward would run them one "
                    "row per call"
                ),
            )
        (logger.info if chosen != torch.float32 else logger.warning)(f"prepare_target: {reason}")
    else:
        name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(requested, requested)
        chosen, reason = requested, f"{name}: requested; this CPU's bf16 units: {', '.join(units) or 'none'}"
    weights = FOUR_BIT if chosen == FOUR_BIT else ""
    chosen = torch.bfloat16 if weights else chosen
    invariant = chosen == torch.bfloat16 if invariant is None else invariant
    if previous is not None:
        same = (previous.dtype, previous.invariant, previous.weights) == (chosen, invariant, weights)
        if same and is_prepared(target) is not None:
            return target
        raise ValueError(
            f"target: expected a target not yet prepared, got one prepared with dtype {previous.dtype}, "
            f"invariant={previous.invariant}; prepare a fresh copy for dtype {weights or chosen}, "
            f"invariant={invariant}"
        )
    _prepare(target, chosen, invariant, weights)
    if invariant and check:
        check_batch_invariance(target, rows)
    settings = TargetPreparation(
        chosen, invariant, reason, units, rows if invariant and check else 0, weights
    )
    setattr(target, _ATTRIBUTE, settings)
    return target


def _prepare(target, dtype: torch.dtype, invariant: bool, weights: str = ""):
    """Cast ``target`` (keeping 4-bit codes first where ``weights`` says so) and install the invariant forward."""
    if weights == FOUR_BIT:
        four_bit.attach_codes(target, projection_groups(target))  # raises, changing nothing, unless 4-bit
    _cast(target, dtype)
    if weights == FOUR_BIT:
        four_bit.seal(target)
    if invariant:
        install_invariant_forward(target)
    return target


def _measured_choice(target, timer: Timer) -> tuple[torch.dtype | str, str]:
    """Eager fp32, the invariant bf16 forward or, where the target's linears are 4-bit, the same on their codes:
    whichever ``adaflash_hf.prepared.choice`` finds fastest here."""
    prepares = {"bf16": lambda copied: _prepare(copied, torch.bfloat16, True)}
    if _four_bit_target(target):
        prepares[FOUR_BIT] = lambda copied: _prepare(copied, torch.bfloat16, True, FOUR_BIT)
    timings, source = timings_once(target, timer, prepares)
    best, why = choose(timings)
    kept = " (timings kept from an earlier run on this machine)" if source == "kept" else ""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(best, best), why + kept


def _four_bit_target(target) -> bool:
    """Whether ``target`` can run on 4-bit codes here: fp32 weights that are 4-bit, on a CPU with the kernel."""
    if not four_bit.available() or next(target.parameters()).device.type != "cpu":
        return False
    output = target.get_output_embeddings()
    linears = [m for m in target.modules() if isinstance(m, Linear) and m is not output]
    return bool(linears) and all(
        m.weight.dtype == torch.float32 and four_bit.four_bit_codes(m.weight) is not None for m in linears
    )


def _row_by_row_linears(target, dtype: torch.dtype) -> list[str]:
    """The linear shapes (``K->N``) of ``target`` that would run one row per call in ``dtype`` on this machine."""
    device = next(target.parameters()).device
    shapes = sorted(
        {
            (m.in_features, m.out_features, m.bias is not None)
            for m in target.modules()
            if isinstance(m, Linear)
        }
    )
    return [f"{k}->{n}" for k, n, bias in shapes if linear_tiles(k, n, bias, dtype, device).rows == 1]


def _cast(target, dtype: torch.dtype) -> None:
    """``target.to(dtype)`` with the rotary frequencies kept as they were (fp32): positions stay exact."""
    kept = [
        (m, {n: b for n, b in m.named_buffers(recurse=False) if "inv_freq" in n})
        for m in rotary_modules(target)
    ]
    target.to(dtype)
    for module, buffers in kept:
        for name, buffer in buffers.items():
            setattr(module, name, buffer)


def is_prepared(target) -> TargetPreparation | None:
    """The settings ``prepare_target`` gave ``target``, or None (never prepared, or since cast or re-patched)."""
    settings = getattr(target, _ATTRIBUTE, None)
    if settings is None or next(target.parameters()).dtype != settings.dtype:
        return None
    if settings.invariant and not runs_invariant_forward(target):
        return None
    return settings


def check_sizes(rows: int) -> list[int]:
    """The forwards ``check_batch_invariance`` runs: n = 2..rows new tokens and one of several tiles."""
    return [*range(2, rows + 1), 2 * rows + 8]


@torch.no_grad()
def check_batch_invariance(target, rows: int = 16) -> None:
    """Raise unless, after a prefill, every row of each forward of ``check_sizes(rows)`` new tokens has bitwise the
    logits of the same token decoded alone. The windows straddle a key-block boundary (``KEY_BLOCK``)."""
    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    sizes = check_sizes(rows)
    longest = max(sizes)
    context = max(1, 2 * KEY_BLOCK - longest // 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + longest), generator=generator).to(device)
    cache = DynamicCache()
    target(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    alone = []
    for i in range(context, context + longest):
        alone.append(target(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1])
    cache.crop(-longest)
    for count in sizes:
        logits = target(input_ids=ids[:, context : context + count], cache=cache, use_cache=True).logits[0]
        cache.crop(-count)
        differing = next((row for row in range(count) if not torch.equal(logits[row], alone[row])), None)
        if differing is not None:
            where = (
                f"{cpu_model()}, {torch.get_num_threads()} threads" if device.type == "cpu" else str(device)
            )
            raise RuntimeError(
                f"prepare_target: the forward is not batch-invariant on this machine ({where}): row {differing} of "
                f"a {count}-token forward differs from the same token decoded alone. Prepare a fresh copy with "
                "invariant=False (fp32 is the exact choice there)."
            )
