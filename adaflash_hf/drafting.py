"""How much to draft: the drafting settings both paths share, a cost model measured on the machine at hand, an
online-calibrated acceptance estimate, and the goodput choice that puts them together.

``generate`` (``adaflash_hf.generation``) and the engine (``adaflash_hf.serving.engine``) read every drafting knob
from one frozen, self-validating ``DraftingSettings``; adding a knob is a field here.

Length modes:
- ``"adaptive"``: the paper's rule, k̂ = clamp(floor(γ·â·(B-1)), min_len, B-1) (``AdaFlashDrafter.predict_draft_length``);
- ``"fixed"``: always B-1 drafts (DFlash);
- ``"goodput"``: per request and round, the k in 0..B-1 that maximises expected committed tokens per second of the
  whole forward (SmartSpec's goodput, with a per-round acceptance estimate instead of a historical rate):

      goodput(k) = (committed_base + Σ_i E_i[accepted | k_i]) / (t_drafter + t_target(tokens_base + Σ_i k_i))

  ``t_target`` and ``t_drafter`` come from a ``CostModel`` measured on this machine, device and dtype (a one-second
  calibration at first use, then the rounds' own timings); E_i from ``AcceptanceModel`` (the length head's â and the
  drafter's confidence in each of its proposals, calibrated online against realised acceptance) or, for a lookup
  continuation, from ``LookupModel`` (first-token and continuation rates by match length). Under greedy decoding
  every proposal, verified or not, is labelled by the committed text (``ShadowLabels``). k = 0 is plain decoding; a request whose drafting did not pay skips
  the drafter forward for a while (``SkipGate``: its context stays buffered) and probes again, at most every
  ``max_skip`` rounds, so a request whose text becomes predictable gets drafts again.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from adaflash_hf.lookup import DRAFT_SOURCES, LookupProposal, LookupRecord

LENGTH_MODES = ("adaptive", "fixed", "goodput")
# The rows of a block whose confidence the goodput choice reads first (each costs an lm_head row over the draft
# vocabulary); the rest only when the chain of acceptances reaches past them with at least this probability.
CONFIDENCE_ROWS = 4
REACH_FOR_MORE_ROWS = 0.05
PROPOSAL_MODES = ("argmax", "sample")


def _bad(name: str, expected: str, actual) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {actual!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DraftingSettings:
    """Every drafting knob, validated when built. ``generate`` reads them as ``adaflash_<name>`` generation-config
    fields (``from_generation_config``); the engine takes the object (or its fields as keyword arguments).

    ``gamma`` / ``min_len`` None take the drafter config's values (``resolve``). ``proposal`` is ``generate``'s choice
    under sampling (the engine always proposes the argmax). ``lookup_history_tokens`` is the engine's shared lookup
    history of finished outputs (hybrid only). ``calibrate`` runs the cost model's one-second calibration at first use
    (goodput only); ``max_skip`` caps the rounds a request skips the drafter before it probes again (goodput only).
    """

    length_mode: str = "adaptive"
    gamma: float | None = None
    min_len: int | None = None
    proposal: str = "argmax"
    draft_source: str = "diffusion"
    lookup_min_prob: float = 0.0
    lookup_history_tokens: int | None = None
    calibrate: bool = True
    max_skip: int = 16
    # Where the values came from, for error messages ("generation_config.adaflash_" for generate's knobs).
    field_prefix: str = field(default="", repr=False, compare=False, metadata={"knob": False})

    def __post_init__(self):
        prefix = self.field_prefix
        if self.length_mode not in LENGTH_MODES:
            raise _bad(f"{prefix}length_mode", f"one of {LENGTH_MODES}", self.length_mode)
        if self.proposal not in PROPOSAL_MODES:
            raise _bad(f"{prefix}proposal", f"one of {PROPOSAL_MODES}", self.proposal)
        if self.draft_source not in DRAFT_SOURCES:
            raise _bad(f"{prefix}draft_source", f"one of {DRAFT_SOURCES}", self.draft_source)
        if self.gamma is not None and not (_is_number(self.gamma) and self.gamma > 0):
            raise _bad(f"{prefix}gamma", "a number > 0", self.gamma)
        if self.min_len is not None and not (_is_int(self.min_len) and self.min_len >= 0):
            raise _bad(f"{prefix}min_len", "an int >= 0", self.min_len)
        if not (_is_number(self.lookup_min_prob) and 0 <= self.lookup_min_prob < 1):
            raise _bad(f"{prefix}lookup_min_prob", "a number in [0, 1)", self.lookup_min_prob)
        history = self.lookup_history_tokens
        if history is not None and not (_is_int(history) and history >= 1 and self.draft_source == "hybrid"):
            raise _bad(
                f"{prefix}lookup_history_tokens",
                f"None, or an int >= 1 with draft_source='hybrid' (draft_source is {self.draft_source!r})",
                history,
            )
        if not isinstance(self.calibrate, bool):
            raise _bad(f"{prefix}calibrate", "True or False", self.calibrate)
        if not (_is_int(self.max_skip) and self.max_skip >= 1):
            raise _bad(f"{prefix}max_skip", "an int >= 1", self.max_skip)

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The field names of the knobs (``generate`` reads each as ``adaflash_<name>``)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("knob", True))

    @classmethod
    def from_generation_config(cls, generation_config) -> DraftingSettings:
        """The knobs set on ``generation_config`` as ``adaflash_<name>`` (unset or None: the default); errors name
        the generation-config field."""
        values = {}
        for name in cls.knobs():
            value = getattr(generation_config, f"adaflash_{name}", None)
            if value is not None:
                values[name] = value
        return cls(**values, field_prefix="generation_config.adaflash_")

    def resolve(self, drafter_config) -> DraftingSettings:
        """These settings with γ and min_len filled from ``drafter_config`` where None, and min_len checked against
        its block size."""
        block = drafter_config.block_size
        gamma = drafter_config.length_head_gamma if self.gamma is None else self.gamma
        min_len = drafter_config.length_head_min_len if self.min_len is None else self.min_len
        if not 0 <= min_len <= block - 1:
            raise _bad(f"{self.field_prefix}min_len", f"an int in 0..{block - 1}", min_len)
        return replace(self, gamma=gamma, min_len=min_len)


# ------------------------------------------------------------------------------------------------- cost model
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

    def __init__(self, window: int = 9):
        self.window = window
        # running bucket (0: pooled over every load) -> token bucket -> seconds
        self.target: dict[int, dict[int, deque]] = {0: {}}
        self.drafter: dict[int, deque] = {}  # drafting requests' bucket -> seconds
        self.calibrated = False
        self.frozen = False  # a profile given by the user (or a test): observations are ignored
        # Engine steps, most recent last: (verify tokens, prefill tokens, running requests, seconds)
        self.steps: deque = deque(maxlen=256)
        self._fit: tuple[int, list[float] | None] = (-1, None)  # (steps seen when fitted, coefficients)
        self._seen = 0

    @classmethod
    def profile(cls, target_seconds: dict[int, float], drafter_seconds: float = 0.0) -> CostModel:
        """A fixed cost model from known timings (tokens -> seconds of one target forward), for a machine profiled
        beforehand or a test; it learns nothing. Install it with ``use_cost_model``."""
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
        self.steps.append((verify_tokens, prefill_tokens, running, float(seconds)))
        self._seen += 1
        self.observe_target(verify_tokens + prefill_tokens, seconds, running)

    def step_curve(self, running: int, prefill_tokens: int = 0) -> Callable[[int], float] | None:
        """``verify tokens -> seconds`` of an engine step with ``running`` requests and ``prefill_tokens``.

        Once 16 steps with at least three different verify sizes are known: a least-squares fit of seconds on
        [1, verify tokens, prefill tokens, running] over the last 256 steps (refitted without the points more than
        three median deviations off, slopes clamped at 0). A packed step's cost is close to linear in these, and a
        fit over every step is far steadier than per-size medians that few steps reach. Before that: the per-size
        curve at verify + prefill tokens."""
        coefficients = self._step_fit()
        if coefficients is None:
            curve = self.target_curve(running)
            return None if curve is None else (lambda n: curve(n + prefill_tokens))
        a, per_verify, per_prefill, per_request = coefficients
        base = a + per_prefill * prefill_tokens + per_request * running
        return lambda n: max(base + per_verify * n, 1e-6)

    def _step_fit(self) -> list[float] | None:
        if self._fit[0] == self._seen:
            return self._fit[1]
        rows = list(self.steps)
        coefficients = None
        if len(rows) >= 16 and len({r[0] for r in rows}) >= 3:
            data = torch.tensor(rows, dtype=torch.float64)
            x = torch.cat([torch.ones(len(rows), 1, dtype=torch.float64), data[:, :3]], dim=1)
            y = data[:, 3:]
            ridge = 1e-6 * torch.eye(4, dtype=torch.float64)
            for _ in range(2):
                solution = torch.linalg.solve(x.T @ x + ridge, x.T @ y)
                residual = (x @ solution - y).abs().flatten()
                keep = residual <= 3 * residual.median() + 1e-9
                x, y = x[keep], y[keep]
            coefficients = [float(solution[0])] + [max(0.0, float(c)) for c in solution[1:, 0]]
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
        # No monotone fit: on a CPU a larger forward can cost less (oneDNN's fp32 path for 2-3 rows is slower than
        # its GEMM for 4-8 on some machines, measured 1.5-2.4x against 1.2-1.5x), and the choice should use that.
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
    return models.setdefault((kind, str(parameter.device), str(parameter.dtype)), CostModel())


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
    """Time target forwards of each of ``sizes`` new tokens after ``context`` random tokens (a cropped dynamic cache,
    as ``generate`` verifies) and feed them to ``cost``: one warm-up forward per size, then up to ``repeats`` passes
    while ``budget_s`` lasts (the first pass always completes). Sizes go coarse to fine (1, the largest, the middle,
    ...), so a pass cut short still spans the range, and every size is timed right after a 1-token forward, so a
    neighbour's load hits both sides of the ratio that decides the choice."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=generator).to(device)
    cache = DynamicCache()
    target(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)

    def forward(n: int) -> float:
        position_ids = torch.arange(context, context + n, device=device)[None]
        tick = time.perf_counter()
        target(
            input_ids=ids[:, context : context + n],
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=n,
            **forward_kwargs,
        )
        seconds = time.perf_counter() - tick
        cache.crop(-n)
        return seconds

    order = _coarse_to_fine(sorted(set(sizes)))
    for n in order:
        forward(n)  # warm-up: the first forward of a shape pays for allocations
    started = time.perf_counter()
    for repeat in range(repeats):
        if repeat and time.perf_counter() - started > budget_s:
            break
        for n in order:
            cost.observe_target(1, forward(1))
            if n != 1:
                cost.observe_target(n, forward(n))
    cost.calibrated = True


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


# -------------------------------------------------------------------------------------------- acceptance model
def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


@dataclass
class AcceptanceModel:
    """P(draft j accepted | drafts 1..j-1 accepted), an online logistic regression on the drafter's confidence in
    its proposal j, the length head's â and the position: σ(w · [1, logit c_j, logit â, log j]).

    It starts at w = (0, 1, 0, 0), the drafter's confidence taken at its word, and learns from every verified
    position (accepted, or the first rejected one) with a small constant step, so it follows a drafter whose
    weights are reloaded online. ``gains`` turns a round's estimates into the chain P(drafts 1..j all accepted).
    """

    weights: list[float] = field(default_factory=lambda: [0.0, 1.0, 0.0, 0.0])
    learning_rate: float = 0.05
    updates: int = 0

    def _features(self, confidence: float, head: float, position: int) -> list[float]:
        return [1.0, _logit(confidence), _logit(head), math.log(position)]

    def probability(self, confidence: float, head: float, position: int) -> float:
        z = sum(w * x for w, x in zip(self.weights, self._features(confidence, head, position)))
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def gains(self, confidences: Sequence[float], head: float) -> list[float]:
        """P(drafts 1..j all accepted), j = 1..len(confidences): the expected accepted drafts of a k-draft verify is
        the sum of the first k."""
        out, reach = [], 1.0
        for j, confidence in enumerate(confidences, start=1):
            reach *= self.probability(confidence, head, j)
            out.append(reach)
        return out

    def update(self, confidences: Sequence[float], head: float, verified: int, accepted: int) -> None:
        """Learn from one verify: drafts 1..accepted were accepted, draft accepted+1 (if verified) was not."""
        for j in range(1, min(verified, accepted + 1, len(confidences)) + 1):
            label = 1.0 if j <= accepted else 0.0
            x = self._features(confidences[j - 1], head, j)
            error = label - self.probability(confidences[j - 1], head, j)
            self.weights = [w + self.learning_rate * error * xi for w, xi in zip(self.weights, x)]
            self.updates += 1


_ACCEPTANCE_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def acceptance_model_for(drafter) -> AcceptanceModel:
    """The drafter's acceptance model, kept across ``generate`` calls (what it learnt stays)."""
    return _ACCEPTANCE_MODELS.setdefault(drafter, AcceptanceModel())


def _match_bucket(match_length: int) -> int:
    return min(max(1, match_length), 6)


@dataclass
class LookupModel:
    """How far a lookup continuation gets accepted: P(its first token is accepted) and P(the next one is, once the
    previous one was), per length of the n-gram match behind it (1..5, 6+), from labelled proposals.

    Two rates, not one: lookups are bursty (a continuation of repeated text is either wrong at once or right for a
    long way), which a single per-token rate undervalues at length. A request's model starts from its ``parent``'s
    estimate (the engine's, or the target's in ``generate``: shared across requests), worth ``strength``
    observations; the parent starts from the match's own evidence, support · n / (n + 1)."""

    parent: LookupModel | None = None
    strength: float = 4.0
    # bucket -> [first accepted, first trials, next accepted, next trials]
    counts: dict[int, list[float]] = field(default_factory=dict)

    def rates(self, proposal: LookupProposal) -> tuple[float, float]:
        if self.parent is not None:
            prior_first, prior_next = self.parent.rates(proposal)
        else:
            prior_first = prior_next = proposal.support * proposal.match_length / (proposal.match_length + 1)
        first_ok, first_n, next_ok, next_n = self.counts.get(
            _match_bucket(proposal.match_length), (0, 0, 0, 0)
        )
        return (
            (first_ok + self.strength * prior_first) / (first_n + self.strength),
            (next_ok + self.strength * prior_next) / (next_n + self.strength),
        )

    def gains(self, proposal: LookupProposal | None) -> list[float]:
        """P(lookup tokens 1..j all accepted) = first · next^(j-1)."""
        if proposal is None or not proposal.tokens:
            return []
        first, following = self.rates(proposal)
        return [first * following ** (j - 1) for j in range(1, len(proposal.tokens) + 1)]

    def observe(self, match_length: int, length: int, accepted: int) -> None:
        """One labelled continuation of ``length`` tokens, ``accepted`` of them accepted (here and in the parent)."""
        counts = self.counts.setdefault(_match_bucket(match_length), [0.0, 0.0, 0.0, 0.0])
        counts[0] += accepted > 0
        counts[1] += 1
        if accepted > 0:
            counts[2] += accepted - 1
            counts[3] += accepted - 1 + (accepted < length)
        if self.parent is not None:
            self.parent.observe(match_length, length, accepted)


_LOOKUP_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lookup_model_for(target) -> LookupModel:
    """The lookup model shared by ``generate`` calls on ``target`` (each call's own model starts from it)."""
    return _LOOKUP_MODELS.setdefault(target, LookupModel(strength=2.0))


@dataclass
class ShadowLabels:
    """Labels for every proposal a greedy round makes, verified or not: under greedy decoding the committed sequence
    is the target's own greedy text, so draft j is accepted exactly when it equals the committed token there (given
    drafts 1..j-1 were). A block the round chose not to verify, or a lookup continuation it did not take, is
    resolved once the sequence has grown past its first mismatch, and feeds the acceptance model (blocks) or the
    lookup record (continuations). Without this, a request that stops drafting stops learning that it should
    draft again. Sampling rounds are not greedy text: there only verified drafts teach (``AcceptanceModel.update``).
    """

    acceptance: AcceptanceModel
    record: LookupRecord
    lookups: LookupModel
    # (start, tokens, the block's confidences or None for a lookup, the block's â or the lookup's match length)
    pending: list[tuple[int, list[int], list[float] | None, float]] = field(default_factory=list)

    def add_block(self, start: int, tokens: Sequence[int], confidences: Sequence[float], head: float) -> None:
        """Block proposals for positions ``start``, ``start + 1``, ... with the drafter's confidence in each."""
        if tokens:
            self.pending.append((start, list(tokens), list(confidences[: len(tokens)]), head))

    def add_lookup(self, start: int, proposal: LookupProposal | None) -> None:
        if proposal is not None and proposal.tokens:
            self.pending.append((start, list(proposal.tokens), None, proposal.match_length))

    def resolve(self, sequence: Sequence[int]) -> None:
        """Settle every pending proposal whose outcome ``sequence`` (the committed tokens) now decides."""
        still = []
        for start, tokens, confidences, head in self.pending:
            seen = sequence[start : start + len(tokens)]
            accepted = next((j for j, (a, b) in enumerate(zip(tokens, seen)) if a != b), len(seen))
            if accepted == len(seen) < len(tokens):
                still.append((start, tokens, confidences, head))  # all seen so far agree: wait for more
                continue
            if confidences is None:
                self.record.add(len(tokens), accepted)
                self.lookups.observe(int(head), len(tokens), accepted)
            else:
                self.acceptance.update(confidences, head, min(len(tokens), accepted + 1), accepted)
        self.pending = still


# ----------------------------------------------------------------------------------------------------- choice
@dataclass(frozen=True)
class Plan:
    lengths: list[int]  # drafts verified per request
    sources: list[int | None]  # per request: the index of the chosen option (None: no drafts)
    goodput: float  # expected committed tokens per second of the step
    expected_accepted: float


def plan_lengths(
    gains: Sequence[Sequence[float]],
    *,
    base_tokens: int,
    base_committed: float,
    drafter_seconds: float,
    target_seconds: Callable[[int], float],
    budget: int | None = None,
) -> tuple[list[int], float, float]:
    """Draft lengths k_i maximising (base_committed + Σ_i Σ_{j<k_i} gains[i][j]) / (drafter_seconds +
    target_seconds(base_tokens + Σ_i k_i)) under Σ_i k_i <= budget; returns (lengths, goodput, expected accepted).

    ``gains[i][j]`` is P(request i's drafts 1..j+1 all accepted), non-increasing in j (enforced), so adding drafts
    in descending order of gain visits, for every total, the set of drafts with the most expected accepted tokens;
    every total is then scored against the cost curve, jumps included.
    """
    cleaned = []
    for row in gains:
        out, low = [], 1.0
        for g in row:
            low = min(low, max(0.0, float(g)))
            out.append(low)
        cleaned.append(out)
    order = sorted(
        ((g, j, i) for i, row in enumerate(cleaned) for j, g in enumerate(row) if g > 0),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    if budget is not None:
        order = order[: max(0, budget)]
    best_total, best_value, best_expected = (
        0,
        base_committed / (drafter_seconds + target_seconds(base_tokens)),
        0.0,
    )
    expected = 0.0
    for total, (g, _, _) in enumerate(order, start=1):
        expected += g
        value = (base_committed + expected) / (drafter_seconds + target_seconds(base_tokens + total))
        if value > best_value:
            best_total, best_value, best_expected = total, value, expected
    lengths = [0] * len(cleaned)
    for _, _, i in order[:best_total]:
        lengths[i] += 1
    return lengths, best_value, best_expected


def plan_round(
    options: Sequence[Sequence[Sequence[float]]],
    *,
    base_tokens: int,
    base_committed: float,
    drafter_seconds: float,
    target_seconds: Callable[[int], float],
    budget: int | None = None,
) -> Plan:
    """``plan_lengths`` where each request may have several exclusive options (its drafter block, its lookup
    continuation): each starts on the option with the most expected accepted tokens, then one pass of coordinate
    ascent switches a request's option where the step's goodput rises (exact for one request)."""
    choice = [max(range(len(opts)), key=lambda o: sum(opts[o])) if opts else None for opts in options]

    def score(picks):
        gains = [options[i][p] if p is not None else [] for i, p in enumerate(picks)]
        return plan_lengths(
            gains,
            base_tokens=base_tokens,
            base_committed=base_committed,
            drafter_seconds=drafter_seconds,
            target_seconds=target_seconds,
            budget=budget,
        )

    best = score(choice)
    for i, opts in enumerate(options):
        for o in range(len(opts)):
            if o == choice[i]:
                continue
            trial = list(choice)
            trial[i] = o
            result = score(trial)
            if result[1] > best[1]:
                choice, best = trial, result
    lengths, value, expected = best
    sources = [c if n else None for c, n in zip(choice, lengths)]
    return Plan(lengths=lengths, sources=sources, goodput=value, expected_accepted=expected)


def draft_surplus(gains: Sequence[float], verify_seconds: Callable[[int], float], rate: float) -> float:
    """What a block's drafts are worth beyond their verify time, in tokens: max over k of the expected accepted drafts
    of a k-draft verify minus the tokens plain decoding commits in the extra time ``verify_seconds(k)`` (``rate``:
    tokens per second of the plain step); 0 when no k pays."""
    best, expected = 0.0, 0.0
    for k, gain in enumerate(gains, start=1):
        expected += gain
        best = max(best, expected - rate * verify_seconds(k))
    return best


@dataclass
class SkipGate:
    """Per request: whether the next round runs the drafter. The drafter costs ``cost`` tokens (its forward, in the
    tokens plain decoding commits meanwhile) and a drafted round is worth its block's ``draft_surplus``; while the
    recent average surplus (an EMA, starting optimistic) stays below the cost, the request skips the next
    ``backoff`` rounds, doubling up to ``max_skip`` while probes keep losing, and a round that pays resets it. The
    average, not the round, decides: the drafter's confidence varies from round to round, so one poor block says
    little about the next.

    The first drafted round and the one after each run of skips are probes (``probing``). Under sampling, where only
    verified drafts teach the acceptance model, a probe verifies at least one draft."""

    max_skip: int = 16
    backoff: int = 0
    skip_left: int = 0
    probing: bool = True
    average_surplus: float | None = None
    smoothing: float = 0.3

    def should_draft(self) -> bool:
        """Consumes one skipped round when skipping; the round after the last skipped one is a probe."""
        if self.skip_left > 0:
            self.skip_left -= 1
            self.probing = self.skip_left == 0
            return False
        return True

    def record(self, surplus: float, cost: float) -> None:
        """A drafted round: its block's surplus and the drafter's cost, both in tokens."""
        self.probing = False
        if self.average_surplus is None:
            self.average_surplus = max(surplus, cost)  # optimistic: the first rounds do not decide alone
        self.average_surplus += self.smoothing * (surplus - self.average_surplus)
        if self.average_surplus >= cost:
            self.backoff = 0
        else:
            self.backoff = min(self.max_skip, max(1, 2 * self.backoff))
            self.skip_left = self.backoff
