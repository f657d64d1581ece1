"""The verify-cost model of ``length_mode="goodput"``: seconds of one target forward on the machine at hand, by the
tokens in it (and, in the engine, the running requests and prefill tokens), and of one drafter forward, learnt from
the rounds themselves after a short calibration at first use. Kept per target, device and dtype
(``cost_model_for``); a known machine's profile can replace it (``CostModel.profile``, ``use_cost_model``).

The calibration is saved per machine (``calibrate_once``: a small JSON file keyed by the CPU model and flags, torch,
its thread count, the target's architecture and dtype, under ``$ADAFLASH_CACHE``, default
``~/.cache/adaflash_hf/cost``; an empty ``ADAFLASH_CACHE`` turns that off), so a second process starts calibrated
and its first ``generate`` decodes at once; the rounds' own timings then take over as before."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from adaflash_hf.atomic import atomic_write_json
from adaflash_hf.prepared.choice import forward_code_digest
from adaflash_hf.prepared.cpu import bf16_units, cpu_model

# Engine steps between two fits of the step fit once it exists: a fit over the last 256 steps moves little in a few,
# and refitting at every step cost an engine 0.3-0.6 ms a step (two least-squares solves over the window).
REFIT_STEPS = 4


def _token_bucket(tokens: int) -> int:
    """Exact up to 16 tokens, then a grid of ratio sqrt(2): forward cost is smooth there, and few sizes recur."""
    if tokens <= 16:
        return max(1, tokens)
    return int(round(2 ** (round(2 * math.log2(tokens)) / 2)))


def _running_bucket(running: int) -> int:
    """Powers of two: 1, 2, 4, 8, ... (0 is the table pooled over every load)."""
    return 1 << max(0, math.ceil(math.log2(max(1, running))))


class CostModel:
    """Seconds of one target forward by the tokens in it (and the requests running in it), and of one drafter forward
    by the requests in it; learnt from timings: the median of the last ``window`` samples per size bucket, so a
    noisy neighbour moves an estimate only when it persists.

    ``target_seconds(n, running)`` interpolates linearly between measured sizes (not forced monotone: CPUs have
    kernels whose cost drops at some size) and extrapolates past the largest measured size with the last measured
    slope (never decreasing there). The table of the request count's
    bucket answers once it has two sizes; until then the table pooled over every load does.
    """

    def __init__(self, window: int = 9, fit_steps: bool = True):
        self.window = window
        self.fit_steps = (
            fit_steps  # engine steps: a linear fit over them (``step_curve``); generate: per-size medians
        )
        # running bucket (0: pooled over every load) -> token bucket -> seconds
        self.target: dict[int, dict[int, deque]] = {0: {}}
        self.drafter: dict[int, deque] = {}  # drafting requests' bucket -> seconds
        self.calibrated = False
        self.frozen = False  # a profile given by the user (or a test): observations are ignored
        # Engine steps, most recent last: (verify tokens, prefill tokens, running requests, seconds)
        self.steps: deque = deque(maxlen=256)
        self._fit: tuple[int, list[float] | None] = (-1, None)  # (steps seen when fitted, coefficients)
        self._seen = 0
        # Whole plain steps (no drafter, nothing verified, no prefill), measured even under a profile: the step's
        # wall time beyond the forward is what a profile does not price. running requests -> recent seconds.
        self.plain_steps: dict[int, deque] = {}
        self.plain_overhead: deque = deque(maxlen=32)  # seconds of plain steps outside the target forward
        # Rows per call of the target's linears where it runs them in fixed tiles (a prepared target): a step of
        # one row more than a whole number of tiles makes one more call of every linear. None: not known yet; 0: not
        # tiled.
        self.tile_rows: int | None = None

    @classmethod
    def profile(cls, target_seconds: dict[int, float], drafter_seconds: float = 0.0) -> CostModel:
        """A fixed cost model from known timings (tokens -> seconds of one target forward), for a machine profiled
        beforehand or a test; it learns nothing. Install it with ``use_cost_model``."""
        _check_profile(target_seconds, drafter_seconds)
        model = cls(window=1)
        for tokens, seconds in target_seconds.items():
            model.observe_target(tokens, seconds)
        if drafter_seconds:
            model.observe_drafter(1, drafter_seconds)
        model.calibrated = model.frozen = True
        return model

    def observe_target(self, tokens: int, seconds: float, running: int = 1) -> None:
        if self.frozen:
            return
        bucket = _token_bucket(tokens)
        for key in (0, _running_bucket(running)):
            table = self.target.setdefault(key, {})
            table.setdefault(bucket, deque(maxlen=self.window)).append(float(seconds))

    def observe_step(self, verify_tokens: int, prefill_tokens: int, running: int, seconds: float) -> None:
        """One packed engine step: its verify tokens (anchors + drafts), prefill tokens, requests and seconds."""
        if self.frozen:
            return
        if self.fit_steps:
            self.steps.append((verify_tokens, prefill_tokens, running, float(seconds)))
            self._seen += 1
        self.observe_target(verify_tokens + prefill_tokens, seconds, running)

    def observe_plain_step(self, running: int, seconds: float, target_seconds: float, whole: bool) -> None:
        """A step that ran no drafter: its wall time beyond the target forward, and (``whole``: no prefill and
        nothing verified in it) its whole wall time, the plain baseline of ``plain_step_seconds``."""
        self.plain_overhead.append(max(0.0, seconds - target_seconds))
        if whole:
            self.plain_steps.setdefault(running, deque(maxlen=16)).append(float(seconds))

    def plain_step_seconds(self, running: int, prefill_tokens: int = 0, verifies: int | None = None):
        """Wall seconds of a plain decode step (one token per verifying request, ``verifies`` of them, default
        ``running``) with ``running`` requests: measured plain steps (``_measured_plain_step``) where the step has no
        prefill, else the step curve at no drafts plus the median overhead measured outside the forward; None before
        either is known."""
        measured = None if prefill_tokens else self._measured_plain_step(running)
        if measured is not None:
            return measured
        curve = self.step_curve(running, prefill_tokens)
        if curve is None:
            return None
        overhead = statistics.median(self.plain_overhead) if self.plain_overhead else 0.0
        return curve(running if verifies is None else verifies) + overhead

    def _measured_plain_step(self, running: int) -> float | None:
        """The median of the last plain steps at this count, else of the nearest count measured (at least three
        steps), scaled by the step fit's ratio between the two counts (the fit only relates them: requests finishing
        one by one would otherwise send every new count back to the fit's word alone). None before three plain
        steps at any count."""
        counts = [n for n, steps in self.plain_steps.items() if len(steps) >= 3]
        if not counts:
            return None
        nearest = min(counts, key=lambda n: (abs(n - running), n))
        seconds = statistics.median(self.plain_steps[nearest])
        if nearest == running:
            return seconds
        here, there = self.step_curve(running), self.step_curve(nearest)
        if here is None or there is None:
            return None
        return seconds * here(running) / there(nearest)

    def step_curve(self, running: int, prefill_tokens: int = 0) -> Callable[[int], float] | None:
        """``verify tokens -> seconds`` of an engine step with ``running`` requests and ``prefill_tokens``.

        Once 16 steps with at least three different verify sizes are known: a least-squares fit of seconds on
        [1, verify tokens, prefill tokens, running, single, tiles] over the last 256 steps (refitted without the
        points more than three median deviations, or 1% of a median step, off; slopes clamped at 0). A packed step's
        cost is close to linear in these, and a fit over every step is far steadier than per-size medians that few
        steps reach. ``single`` (1 for a forward of one token, its coefficient of either sign) is the jump between
        a one-row forward and any larger one: on a CPU a 1-token step runs matrix-vector kernels and a larger one
        matrix-matrix kernels, a jump that a line through the larger sizes would miss (BENCHMARKS.md, "Verify
        cost"). ``tiles`` (``ceil(rows / tile_rows)`` of a target whose linears run in tiles, else 0) is the step a
        line misses on a prepared target: 16 requests' anchors fill one 16-row tile, and one draft more makes every
        linear run a second. Before that: the per-size curve at verify + prefill tokens."""
        coefficients = self._step_fit()
        if coefficients is None:
            curve = self.target_curve(running)
            return None if curve is None else (lambda n: curve(n + prefill_tokens))
        a, per_verify, per_prefill, per_request, single, per_tile = coefficients
        base = a + per_prefill * prefill_tokens + per_request * running

        def seconds(n: int) -> float:
            rows = n + prefill_tokens
            jumps = (single if rows == 1 else 0.0) + per_tile * self._tiles(rows)
            return max(base + per_verify * n + jumps, 1e-6)

        return seconds

    def has_step_fit(self) -> bool:
        """Whether ``step_curve`` answers from its fit over engine steps (16 steps of three verify sizes seen), not
        from the per-size curve."""
        return self._step_fit() is not None

    def _tiles(self, rows: int) -> int:
        return -(-rows // self.tile_rows) if self.tile_rows else 0

    def _step_fit(self) -> list[float] | None:
        fitted_at, coefficients = self._fit
        if fitted_at == self._seen or (coefficients is not None and self._seen - fitted_at < REFIT_STEPS):
            return coefficients
        rows = list(self.steps)
        coefficients = None
        if len(rows) >= 16 and len({r[0] for r in rows}) >= 3:
            data = torch.tensor(rows, dtype=torch.float64)
            single = (data[:, :1] + data[:, 1:2] == 1).to(torch.float64)
            tiles = (
                torch.ceil((data[:, :1] + data[:, 1:2]) / self.tile_rows)
                if self.tile_rows
                else torch.zeros_like(single)
            )
            x = torch.cat([torch.ones(len(rows), 1, dtype=torch.float64), data[:, :3], single, tiles], dim=1)
            y = data[:, 3:]
            ridge = 1e-6 * torch.eye(6, dtype=torch.float64)
            for _ in range(2):
                solution = torch.linalg.solve(x.T @ x + ridge, x.T @ y)
                residual = (x @ solution - y).abs().flatten()
                keep = residual <= 3 * residual.median() + 0.01 * y.abs().median()  # floor: exact timings
                x, y = x[keep], y[keep]
            slopes = [max(0.0, float(c)) for c in solution[1:4, 0]]
            coefficients = [float(solution[0]), *slopes, float(solution[4]), max(0.0, float(solution[5]))]
        self._fit = (self._seen, coefficients)
        return coefficients

    def observe_drafter(self, requests: int, seconds: float) -> None:
        if self.frozen:
            return
        bucket = _running_bucket(requests)
        self.drafter.setdefault(bucket, deque(maxlen=self.window)).append(float(seconds))

    def knows_target(self, tokens: int, running: int = 1) -> bool:
        """Whether a size of at most ``tokens`` has been measured (at any load): below the smallest measured size the
        curve is flat, which would make a plain step look as dear as a verify."""
        return any(size <= _token_bucket(tokens) for size in self.target[0])

    def target_curve(self, running: int = 1) -> Callable[[int], float] | None:
        """``n -> seconds`` for a forward of n tokens with ``running`` requests, or None before any measurement."""
        table = self.target.get(_running_bucket(running), {})
        if len(table) < 2:
            table = self.target[0]
        if not table:
            return None
        sizes = sorted(table)
        # No monotone fit: on a CPU a larger forward can cost less (a kernel for a few rows slower than the one for
        # more; BENCHMARKS.md, "Verify cost"), and the choice should use that.
        values = [statistics.median(table[s]) for s in sizes]
        return functools.lru_cache(maxsize=None)(lambda n: _interpolate(sizes, values, n))

    def target_seconds(self, tokens: int, running: int = 1) -> float | None:
        curve = self.target_curve(running)
        return None if curve is None else curve(tokens)

    def drafter_seconds(self, requests: int) -> float:
        """Seconds of a drafter forward over ``requests`` requests; 0 before any was measured (the first drafted
        round measures it)."""
        if not self.drafter:
            return 0.0
        sizes = sorted(self.drafter)
        values = [statistics.median(self.drafter[s]) for s in sizes]
        for i in range(1, len(values)):
            values[i] = max(values[i], values[i - 1])
        return _interpolate(sizes, values, _running_bucket(requests))

    def marginal_drafter_seconds(self, requests: int) -> float:
        """What one more request adds to a drafter forward over ``requests`` of them: the slope of the measured
        curve (a batched forward's fixed part is paid once, whoever drafts), the whole forward for one request."""
        if requests <= 1:
            return self.drafter_seconds(1)
        return max(0.0, self.drafter_seconds(requests) - self.drafter_seconds(1)) / (requests - 1)

    def relative_curve(self, running: int = 1) -> dict[int, float]:
        """Measured sizes -> seconds relative to a 1-token forward (the plot of ``adaflash bench``)."""
        curve = self.target_curve(running)
        table = self.target.get(_running_bucket(running), {}) if running > 1 else self.target[0]
        if curve is None or not table:
            return {}
        base = curve(1)
        return {size: curve(size) / base for size in sorted(table)}

    def to_dict(self) -> dict:
        return {
            "target": {
                str(r): {str(n): statistics.median(v) for n, v in sorted(t.items())}
                for r, t in sorted(self.target.items())
            },
            "drafter": {str(r): statistics.median(v) for r, v in sorted(self.drafter.items())},
            "calibrated": self.calibrated,
        }


def _check_profile(target_seconds, drafter_seconds) -> None:
    """A profile prices every forward from its 1-token step: without it (or with seconds that are no forward's
    cost) drafting would be judged against nothing, for good, since a profile learns nothing."""
    if not isinstance(target_seconds, dict) or 1 not in target_seconds:
        got = (
            sorted(target_seconds, key=str)
            if isinstance(target_seconds, dict)
            else type(target_seconds).__name__
        )
        raise ValueError(
            f"target_seconds: expected a dict of tokens -> seconds including 1 (the plain step), got {got!r}"
        )
    for tokens, seconds in target_seconds.items():
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            raise ValueError(f"target_seconds: expected int token counts >= 1 as keys, got {tokens!r}")
        if not (
            isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
        ):
            raise ValueError(f"target_seconds[{tokens}]: expected finite seconds > 0, got {seconds!r}")
        if seconds <= 0:
            raise ValueError(f"target_seconds[{tokens}]: expected finite seconds > 0, got {seconds!r}")
    # Larger forwards may cost a little less than a 1-token one (a GEMM kernel can beat the GEMV one); far less is
    # no measurement of the same forward.
    floor = 0.8 * target_seconds[1]
    for tokens, seconds in sorted(target_seconds.items()):
        if seconds < floor:
            raise ValueError(
                f"target_seconds[{tokens}]: expected >= 0.8 x target_seconds[1] = {floor:.6g} (a forward of more "
                f"tokens costs about as much as one token or more), got {seconds!r}"
            )
    if not (
        isinstance(drafter_seconds, (int, float))
        and not isinstance(drafter_seconds, bool)
        and math.isfinite(drafter_seconds)
        and drafter_seconds >= 0
    ):
        raise ValueError(f"drafter_seconds: expected finite seconds >= 0, got {drafter_seconds!r}")


def _interpolate(sizes: list[int], values: list[float], n: int) -> float:
    if n <= sizes[0]:
        return values[0]
    for (a, va), (b, vb) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        if n <= b:
            return va + (vb - va) * (n - a) / (b - a)
    if len(sizes) == 1:
        return values[0]  # one size known: optimistic, so the first rounds at other sizes measure them
    slope = max(0.0, (values[-1] - values[-2]) / (sizes[-1] - sizes[-2]))
    return values[-1] + slope * (n - sizes[-1])


_COST_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_model_for(target, kind: str) -> CostModel:
    """The cost model of ``target`` on its current device and dtype for one kind of forward (``"generate"``: batch 1
    with a dynamic cache; ``"engine"``: the packed forward), shared by every call that uses it."""
    parameter = next(target.parameters())
    models = _COST_MODELS.setdefault(target, {})
    key = (kind, str(parameter.device), str(parameter.dtype))
    if key not in models:
        models[key] = CostModel(fit_steps=kind == "engine")
    return models[key]


def use_cost_model(target, kind: str, model: CostModel) -> None:
    """Make ``model`` the cost model of ``target`` (current device and dtype) for ``kind`` forwards."""
    if kind not in ("generate", "engine"):
        raise ValueError(f"kind: expected 'generate' or 'engine', got {kind!r}")
    if not isinstance(model, CostModel):
        raise TypeError(f"model: expected a CostModel, got {type(model).__name__}")
    parameter = next(target.parameters())
    _COST_MODELS.setdefault(target, {})[(kind, str(parameter.device), str(parameter.dtype))] = model


@torch.no_grad()
def calibrate_target(
    target,
    cost: CostModel,
    sizes: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 12, 16),
    context: int = 256,
    repeats: int = 3,
    budget_s: float = 1.5,
    **forward_kwargs,
) -> None:
    """Time target forwards of each of ``sizes`` new tokens after ``context`` random tokens (``verify_timer``) and
    feed them to ``cost``: up to ``repeats`` passes while ``budget_s`` lasts (the first pass always completes). Sizes go
    coarse to fine (1, the largest, the middle, ...), so a pass cut short still spans the range, and every size is
    timed right after a 1-token forward, so a neighbour's load hits both sides of the ratio that decides the choice."""
    order = _coarse_to_fine(sorted(set(sizes)))
    forward = verify_timer(target, order, context, **forward_kwargs)
    started = time.perf_counter()
    for repeat in range(repeats):
        if repeat and time.perf_counter() - started > budget_s:
            break
        for n in order:
            cost.observe_target(1, forward(1))
            if n != 1:
                cost.observe_target(n, forward(n))
    cost.calibrated = True


def verify_timer(target, sizes: Sequence[int], context: int, **forward_kwargs) -> Callable[[int], float]:
    """``forward(n)``: the seconds of a target forward of n new tokens after ``context`` random tokens (seed 0) on a
    dynamic cache cropped back after each, as ``generate`` verifies. The context is prefilled and each of ``sizes`` is
    run once, in that order, before it returns: the first forward of a shape pays for allocations (and a prepared
    target's row plans probe)."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=generator).to(device)
    cache = DynamicCache()
    target(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)

    def forward(n: int) -> float:
        position_ids = torch.arange(context, context + n, device=device)[None]
        _synchronize(device)
        tick = time.perf_counter()
        target(
            input_ids=ids[:, context : context + n],
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=n,
            **forward_kwargs,
        )
        _synchronize(device)  # an accelerator runs the forward after the call returns
        seconds = time.perf_counter() - tick
        cache.crop(-n)
        return seconds

    for n in sizes:
        forward(n)  # warm-up
    return forward


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _coarse_to_fine(sizes: list[int]) -> list[int]:
    """1 and the largest first, then midpoints of the widest gaps: [1, 16, 5, 3, 8, ...] from 1..16."""
    order, pending = [sizes[0], sizes[-1]], [(0, len(sizes) - 1)]
    while pending:
        low, high = pending.pop(0)
        if high - low < 2:
            continue
        middle = (low + high) // 2
        order.append(sizes[middle])
        pending += [(low, middle), (middle, high)]
    return list(dict.fromkeys(order))


def calibration_path(target, kind: str) -> Path | None:
    """Where this machine's calibration of ``target`` for ``kind`` forwards is kept (None: saving is off)."""
    from adaflash_hf.prepared import native  # the forward's modules: not imported with the package

    root = os.environ.get("ADAFLASH_CACHE", str(Path.home() / ".cache" / "adaflash_hf"))
    if not root:
        return None
    parameter = next(target.parameters())
    config = target.config.get_text_config()
    names = (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    key = {
        "cpu": cpu_model(),
        "bf16_units": list(bf16_units()),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kind": kind,
        "device": str(parameter.device),
        "dtype": str(parameter.dtype),
        "target": [type(target).__name__, *(getattr(config, name, None) for name in names)],
        "forward": type(target).forward.__qualname__ + str(getattr(target, "_adaflash_preparation", "")),
        "forward_code": forward_code_digest(),
        "compiled_layer": native.loaded(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / "cost" / f"{kind}-{digest}.json"


def calibrate_once(target, cost: CostModel, kind: str, **calibration) -> str:
    """Calibrate ``cost`` unless it is: from this machine's saved calibration where there is one, else by timing
    forwards (``calibrate_target``) and saving them. Returns ``"calibrated"``, ``"loaded"`` or ``"measured"``."""
    if cost.calibrated:
        return "calibrated"
    path = calibration_path(target, kind)
    if path is not None and path.exists():
        try:
            table = json.loads(path.read_text())["target"]
            for tokens, seconds in table.items():
                for value in seconds:
                    cost.observe_target(int(tokens), float(value))
            cost.calibrated = True
            return "loaded"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged file is measured again and rewritten
    calibrate_target(target, cost, **calibration)
    if path is not None:
        table = {str(n): list(v) for n, v in sorted(cost.target[0].items())}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {"target": table})
        except OSError:
            pass  # a read-only home: calibrate in every process, as without saving
    return "measured"
