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

  ``t_target`` and ``t_drafter`` come from a ``CostModel`` measured on this machine, device and dtype
  (``adaflash_hf.cost_model``: a one-second calibration at first use, then the rounds' own timings); E_i from
  ``AcceptanceModel`` (the length head's â and the drafter's confidence in each of its proposals, calibrated online
  against realised acceptance) or, for a lookup continuation, from ``LookupModel`` (a rate per continuation
  position, by match length), both in ``adaflash_hf.acceptance``. Under greedy decoding every proposal, verified or not,
  is labelled by the committed text (``ShadowLabels``). k = 0 is plain decoding; a request whose drafting did not pay skips
  the drafter forward for a while (``SkipGate``: its context stays buffered) and probes again, at most every
  ``max_skip`` rounds, so a request whose text becomes predictable gets drafts again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from adaflash_hf.lookup import DRAFT_SOURCES

LENGTH_MODES = ("auto", "adaptive", "fixed", "goodput")
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

    ``length_mode="auto"`` (the default) is ``"goodput"`` for greedy decoding and ``"adaptive"`` under sampling
    (``length_mode_for``): goodput follows this machine's timings, which changes nothing a greedy request outputs but
    would make a seeded sampling request's text depend on the timings (each round structure consumes the request's
    random numbers differently); the paper's rule keeps a seed's output reproducible.

    ``draft_source="auto"`` (the default) is ``"hybrid"`` (``resolve``): each round verifies the drafter's block or a
    lookup continuation of the sequence itself, whichever the policy values more. Measured with the shipped SmolLM2
    drafter, hybrid was never slower than diffusion-only drafting in any domain and several times faster where text
    repeats (BENCHMARKS.md "Generate"); ``"diffusion"`` drafts blocks only (the drafter's own figures).

    ``gamma`` / ``min_len`` None take the drafter config's values (``resolve``). ``proposal`` is ``generate``'s choice
    under sampling (the engine always proposes the argmax). ``lookup_history_tokens`` is the engine's shared lookup
    history of finished outputs (hybrid only). ``calibrate`` runs the cost model's one-second calibration at first use
    (goodput only); ``max_skip`` caps the rounds a request skips the drafter before it probes again (goodput only).
    ``max_slowdown`` (goodput in an engine) is how much later than plain decoding would have ended it a request may
    end because of the batch's drafts, as a share (0.03: 3%; None: no bound): a request whose own drafts seldom land
    pays for every step the others' drafts make dearer, and a batch then ends on it.
    """

    length_mode: str = "auto"
    gamma: float | None = None
    min_len: int | None = None
    proposal: str = "argmax"
    draft_source: str = "auto"
    lookup_min_prob: float = 0.0
    lookup_history_tokens: int | None = None
    calibrate: bool = True
    max_skip: int = 16
    max_slowdown: float | None = 0.03
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
        lookups = self.draft_source in ("auto", "hybrid")
        if history is not None and not (_is_int(history) and history >= 1 and lookups):
            raise _bad(
                f"{prefix}lookup_history_tokens",
                f"None, or an int >= 1 with draft_source 'hybrid' or 'auto' (draft_source is {self.draft_source!r})",
                history,
            )
        if not isinstance(self.calibrate, bool):
            raise _bad(f"{prefix}calibrate", "True or False", self.calibrate)
        if not (_is_int(self.max_skip) and self.max_skip >= 1):
            raise _bad(f"{prefix}max_skip", "an int >= 1", self.max_skip)
        slowdown = self.max_slowdown
        if slowdown is not None and not (_is_number(slowdown) and 0 <= slowdown <= 1):
            raise _bad(f"{prefix}max_slowdown", "None or a number in [0, 1]", slowdown)

    def length_mode_for(self, sampling: bool) -> str:
        """The length mode a request decodes with: ``"auto"`` resolved by whether it samples."""
        if self.length_mode != "auto":
            return self.length_mode
        return "adaptive" if sampling else "goodput"

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
        """These settings for a drafter: γ and min_len filled from ``drafter_config`` where None (min_len checked
        against its block size), ``draft_source="auto"`` made ``"hybrid"``."""
        block = drafter_config.block_size
        gamma = drafter_config.length_head_gamma if self.gamma is None else self.gamma
        min_len = drafter_config.length_head_min_len if self.min_len is None else self.min_len
        if not 0 <= min_len <= block - 1:
            raise _bad(f"{self.field_prefix}min_len", f"an int in 0..{block - 1}", min_len)
        source = "hybrid" if self.draft_source == "auto" else self.draft_source
        return replace(self, gamma=gamma, min_len=min_len, draft_source=source)


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
    slack: Sequence[float] | None = None,
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
    room = _SlackRoom(slack, target_seconds(base_tokens), len(cleaned)) if slack is not None else None
    for total, (g, _, i) in enumerate(order, start=1):
        expected += g
        seconds = target_seconds(base_tokens + total)
        value = (base_committed + expected) / (drafter_seconds + seconds)
        if room is not None:
            room.add(i, g)
            if drafter_seconds + seconds - room.plain_seconds > room.least:
                continue
        if value > best_value:
            best_total, best_value, best_expected = total, value, expected
    lengths = [0] * len(cleaned)
    for _, _, i in order[:best_total]:
        lengths[i] += 1
    return lengths, best_value, best_expected


class _SlackRoom:
    """The most seconds a step may cost beyond a plain one without any request losing more than its slack: request
    i's slack plus a plain step's seconds for each draft of its own it expects accepted (each saves it a step)."""

    def __init__(self, slack: Sequence[float], plain_seconds: float, count: int):
        self.allowance = [float(s) for s in slack] + [math.inf] * (count - len(slack))
        self.plain_seconds = plain_seconds
        self.least = min(self.allowance, default=math.inf)

    def add(self, request: int, gain: float) -> None:
        was_least = self.allowance[request] == self.least
        self.allowance[request] += self.plain_seconds * gain
        if was_least:
            self.least = min(self.allowance)


def plan_round(
    options: Sequence[Sequence[Sequence[float]]],
    *,
    base_tokens: int,
    base_committed: float,
    drafter_seconds: float,
    target_seconds: Callable[[int], float],
    budget: int | None = None,
    slack: Sequence[float] | None = None,
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
            slack=slack,
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
    verified drafts teach the acceptance model, a probe verifies at least one draft.

    What a round's drafts are worth depends on the load they were judged at: beside many requests each draft costs
    more of the shared forward than beside few. A gate that backed off at some load (``closed_at``: the requests
    running) opens again, its average forgotten, once the load has fallen to half of it (``reopen``): a batch's
    last requests draft again, instead of keeping the skips learnt when it was full."""

    max_skip: int = 16
    backoff: int = 0
    skip_left: int = 0
    probing: bool = True
    average_surplus: float | None = None
    smoothing: float = 0.3
    closed_at: int = 0

    def should_draft(self) -> bool:
        """Consumes one skipped round when skipping; the round after the last skipped one is a probe."""
        if self.skip_left > 0:
            self.skip_left -= 1
            self.probing = self.skip_left == 0
            return False
        return True

    def reopen(self, load: int) -> None:
        """Open a backed-off gate again where the load (``load`` requests running) is at most half of what it was when
        it last backed off (the class docstring)."""
        if self.skip_left > 0 and 2 * load <= self.closed_at:
            self.skip_left = self.backoff = 0
            self.average_surplus = None
            self.probing = True

    def record(self, surplus: float, cost: float, load: int = 1) -> None:
        """A drafted round: its block's surplus and the drafter's cost, both in tokens, judged with ``load`` requests
        running."""
        self.probing = False
        if self.average_surplus is None:
            self.average_surplus = max(surplus, cost)  # optimistic: the first rounds do not decide alone
        self.average_surplus += self.smoothing * (surplus - self.average_surplus)
        if self.average_surplus >= cost:
            self.backoff = 0
        else:
            self.backoff = min(self.max_skip, max(1, 2 * self.backoff))
            self.skip_left = self.backoff
            self.closed_at = load
