"""``dtype="auto"`` by measurement: which forward gives the most tokens per second on this machine, eager fp32, the
batch-invariant bf16 forward or, for a target whose linears are 4-bit already (a Q4 GGUF), the same forward on its
4-bit codes (``adaflash_hf.prepared.four_bit``), timed rather than read off the CPU's flags.

A CPU's bf16 flags say that bf16 dot products exist, not that a bf16 forward is faster: on one Intel Xeon with AMX the
prepared bf16 target decoded at 0.89x fp32's speed, while on an AMD EPYC with ``avx512_bf16`` its 16-token verify cost
half of fp32's. So where the CPU reports a bf16 unit, ``prepare_target(dtype="auto")`` times both candidates
(``measure_candidates``) on copies of the target and ``choose`` picks:

- only candidates whose 1-token step (plain decoding) is at most ``PLAIN_TOLERANCE`` times eager fp32's, so "auto" is
  never slower than eager fp32 plain decoding beyond timing noise;
- among those, the one with the most expected committed tokens per second when verifying drafts, at a reference
  acceptance (``REFERENCE_ACCEPTANCE`` per drafted token) and the best verify size measured: ``(1 + a + ... +
  a^(n-1)) / t(n)``, plain decoding (n = 1) included.

A timer is a function ``timer(model) -> {n: seconds}``: the default (``forward_timer``) times a forward of n new tokens
after a prompt, as ``generate`` verifies; ``adaflash serve`` passes one that times the engine's packed forward of
sixteen requests with n rows each, and the prefill of their prompts (``PREFILL``): a served request reads its
prompt first, and a forward whose decode steps are fastest can prefill slowest (on one Intel Xeon with AMX the 4-bit
target's 16-request step took 0.9-1.2x bf16's, its prefill 2.3x, and it served 0.71x bf16's tokens/s at 16
requests).
The timings are kept per machine (CPU model and flags, torch and its threads, the
target's architecture, the timer, transformers' version and a digest of the forward's code) under
``$ADAFLASH_CACHE`` (default ``~/.cache/adaflash_hf``; empty: not kept), so a second process chooses without timing.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache
from transformers.utils import logging

from adaflash_hf.atomic import atomic_write_json
from adaflash_hf.prepared.cpu import bf16_units, cpu_model

logger = logging.get_logger(__name__)

PLAIN_TOLERANCE = 1.05
REFERENCE_ACCEPTANCE = 0.5
# A timer's key for the seconds of prefill per prompt token of each of its sequences (a forward prefilling all of
# them, over the prompt's length), where it gives one (the engine's timer: a served request reads its prompt first).
PREFILL = 0
# Prompt tokens a served request reads per token it generates, for the choice where prefills are timed: held-out
# chat, code and math prompts for 64-token answers read about 2.3.
PROMPT_TOKENS_PER_TOKEN = 2.0
SIZES = (1, 4, 8, 16)
Timer = Callable[[torch.nn.Module], dict[int, float]]


def expected_rate(seconds: dict[int, float], acceptance: float = REFERENCE_ACCEPTANCE) -> float:
    """Expected committed tokens per second at the best measured verify size: a forward of n tokens (n - 1 drafts)
    commits ``1 + a + ... + a^(n-1)`` tokens in expectation. Where the timings hold a prefill (``PREFILL``), each
    committed token also pays the prefill of ``PROMPT_TOKENS_PER_TOKEN`` prompt tokens."""
    decoding = max(sum(acceptance**i for i in range(n)) / t for n, t in seconds.items() if n >= 1)
    if PREFILL not in seconds:
        return decoding
    return 1.0 / (1.0 / decoding + PROMPT_TOKENS_PER_TOKEN * seconds[PREFILL])


def choose(timings: dict[str, dict[int, float]]) -> tuple[str, str]:
    """``(candidate, why)`` from ``{"fp32": {n: s}, "bf16": {n: s}, ...}`` (module docstring)."""
    plain = timings["fp32"][1]
    eligible = [name for name, seconds in timings.items() if seconds[1] <= PLAIN_TOLERANCE * plain]
    best = max(eligible, key=lambda name: expected_rate(timings[name]))
    figures = "; ".join(
        f"{name}: 1-token step {seconds[1] * 1e3:.1f} ms"
        + (f", prefill {seconds[PREFILL] * 1e3:.1f} ms a prompt token" if PREFILL in seconds else "")
        + f", {expected_rate(seconds):.1f} tok/s at acceptance {REFERENCE_ACCEPTANCE}"
        + (f" and {PROMPT_TOKENS_PER_TOKEN:g} prompt tokens a token" if PREFILL in seconds else "")
        for name, seconds in timings.items()
    )
    slower = [name for name in timings if name not in eligible]
    because = f" ({', '.join(slower)} decodes slower than fp32)" if slower else ""
    return best, f"{best}: measured fastest on this machine{because}; {figures}"


@torch.inference_mode()
def forward_timer(model, sizes=SIZES, context: int = 128, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a forward of n new tokens after ``context`` tokens, for each n of ``sizes``."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cache = DynamicCache()
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for repeat in range(repeats + 1):
        for n in sizes:
            start = time.perf_counter()
            model(input_ids=ids[:, context : context + n], cache=cache, use_cache=True)
            if repeat:  # the first round warms up (tiles, packed weights)
                seconds[n].append(time.perf_counter() - start)
            cache.crop(-n)
    return {n: statistics.median(values) for n, values in seconds.items()}


def measure_candidates(target, timer: Timer, prepares: dict[str, Callable]) -> dict[str, dict[int, float]]:
    """``{"fp32": timings, name: timings, ...}``: ``timer`` on an eager fp32 copy of ``target`` and on a copy of it
    that each of ``prepares`` (name -> function of a copy, in place) makes ready (copies: the target itself is left as
    it is)."""
    fp32 = copy.deepcopy(target).to(torch.float32)
    timings = {"fp32": timer(fp32)}
    del fp32
    for name, prepare in prepares.items():
        model = prepare(copy.deepcopy(target))
        timings[name] = timer(model)
        del model
    return timings


@functools.cache
def forward_code_digest() -> str:
    """A digest of the prepared forward's code (this package's ``prepared`` modules and the compiled layer's source):
    timings kept under another version of it are not this forward's."""
    digest = hashlib.sha256()
    folder = Path(__file__).parent
    for path in sorted([*folder.glob("*.py"), *folder.glob("csrc/*.cpp")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def timings_path(target, timer: Timer, candidates: tuple[str, ...] = ("bf16",)) -> Path | None:
    """Where this machine's timings of ``target``'s candidates under ``timer`` are kept (None: not kept)."""
    from adaflash_hf.prepared import native  # the forward's modules: not imported with the package

    root = os.environ.get("ADAFLASH_CACHE", str(Path.home() / ".cache" / "adaflash_hf"))
    if not root:
        return None
    config = target.config.get_text_config()
    names = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads")
    key = {
        "cpu": cpu_model(),
        "bf16_units": list(bf16_units()),
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "forward": forward_code_digest(),
        "compiled_layer": native.load(),
        "threads": torch.get_num_threads(),
        "target": [
            type(target).__name__,
            *(getattr(config, name, None) for name in names),
            config.vocab_size,
        ],
        "timer": getattr(timer, "__qualname__", repr(timer)),
        "candidates": sorted(candidates),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / "dtype" / f"{digest}.json"


def timings_once(
    target, timer: Timer, prepares: dict[str, Callable]
) -> tuple[dict[str, dict[int, float]], str]:
    """The timings of eager fp32 and of ``prepares``' candidates: this machine's kept ones where there are, else
    measured now (and kept); and which."""
    path = timings_path(target, timer, tuple(prepares))
    if path is not None and path.exists():
        try:
            kept = json.loads(path.read_text())
            return {
                name: {int(n): float(s) for n, s in table.items()} for name, table in kept.items()
            }, "kept"
        except (OSError, ValueError, AttributeError, TypeError):
            logger.warning(f"prepare_target: the kept timings {path} are unreadable; timing again")
    timings = measure_candidates(target, timer, prepares)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(
                path, {name: {str(n): s for n, s in table.items()} for name, table in timings.items()}
            )
        except OSError:
            pass  # a read-only home: time again in the next process
    return timings, "measured"
