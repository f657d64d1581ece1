"""What the vLLM plugin decides and remembers per step, written without vLLM so it is tested anywhere: the settings
(from the environment, validated), each request's draft length (the paper's adaptive rule, goodput, or DFlash's
fixed length), the step's cost curve measured from vLLM's own steps, and each request's rounds, turned into the
trajectories the OPD learner trains on (``adaflash_hf.online.buffer.Trajectory`` fields).

vLLM drafts before it books the step's sampled tokens, so a worker sees a request's committed length one step late:
the length read when a request is next scheduled is the anchor (+1) of the round proposed the time before, and the
length read the time after says how many of that round's drafts were accepted. ``RoundBook`` keeps that lag in one
place.
"""

from __future__ import annotations

import math
import os
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from adaflash_hf.acceptance import AcceptanceModel
from adaflash_hf.drafting import plan_lengths
from adaflash_hf.modeling.length_head_adaflash import draft_lengths

POLICIES = ("adaptive", "goodput", "fixed")
ENV = {
    "disable": "ADAFLASH_VLLM_DISABLE",
    "policy": "ADAFLASH_VLLM_POLICY",
    "gamma": "ADAFLASH_VLLM_GAMMA",
    "min_len": "ADAFLASH_VLLM_MIN_LEN",
    "weights_dir": "ADAFLASH_VLLM_WEIGHTS",
    "records_dir": "ADAFLASH_VLLM_RECORDS",
    "poll_seconds": "ADAFLASH_VLLM_POLL_SECONDS",
}


@dataclass(frozen=True)
class Settings:
    """The plugin's settings; ``from_env`` reads them from ``ADAFLASH_VLLM_*`` (vLLM spawns its workers, which
    inherit the environment). ``gamma``/``min_len`` None: the drafter's own (its sidecar's)."""

    policy: str = "adaptive"
    gamma: float | None = None
    min_len: int | None = None
    weights_dir: str | None = None  # poll published weights (``online/weights.py`` format) from here
    records_dir: str | None = None  # write trajectories and statistics here
    poll_seconds: float = 1.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"{ENV['policy']}: expected one of {POLICIES}, got {self.policy!r}")
        if self.gamma is not None and not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ValueError(f"{ENV['gamma']}: expected a finite number > 0, got {self.gamma}")
        if self.min_len is not None and self.min_len < 0:
            raise ValueError(f"{ENV['min_len']}: expected an int >= 0, got {self.min_len}")
        if not (self.poll_seconds >= 0 and math.isfinite(self.poll_seconds)):
            raise ValueError(f"{ENV['poll_seconds']}: expected a number >= 0, got {self.poll_seconds}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        def number(key, kind):
            raw = environ.get(ENV[key])
            if raw in (None, ""):
                return None
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{ENV[key]}: expected {kind.__name__}, got {raw!r}") from None

        poll = number("poll_seconds", float)
        return cls(
            policy=environ.get(ENV["policy"]) or "adaptive",
            gamma=number("gamma", float),
            min_len=number("min_len", int),
            weights_dir=environ.get(ENV["weights_dir"]) or None,
            records_dir=environ.get(ENV["records_dir"]) or None,
            poll_seconds=1.0 if poll is None else poll,
        )

    def environ(self) -> dict[str, str]:
        """The environment that gives these settings to ``from_env`` (what a launcher hands to vLLM)."""
        values = {
            "policy": self.policy,
            "gamma": self.gamma,
            "min_len": self.min_len,
            "weights_dir": self.weights_dir,
            "records_dir": self.records_dir,
            "poll_seconds": self.poll_seconds,
        }
        return {ENV[key]: str(value) for key, value in values.items() if value is not None}


class StepCost:
    """seconds(n) = a + b·n for a step whose target forward runs over n tokens: a least-squares line through the
    steps vLLM ran, with exponential forgetting so that it follows the load. Ready once it has seen ``min_steps``
    steps over at least two sizes."""

    def __init__(self, forget: float = 0.98, min_steps: int = 8):
        self.forget, self.min_steps = forget, min_steps
        self.sums = [0.0] * 5  # Σw, Σw·n, Σw·n², Σw·t, Σw·n·t
        self.steps = 0
        self.sizes: set[int] = set()

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        n = float(tokens)
        terms = (1.0, n, n * n, seconds, n * seconds)
        self.sums = [self.forget * s + t for s, t in zip(self.sums, terms)]
        self.steps += 1
        if len(self.sizes) < 2:
            self.sizes.add(tokens)

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps and len(self.sizes) >= 2

    def line(self) -> tuple[float, float]:
        s0, s1, s2, t0, t1 = self.sums
        det = s0 * s2 - s1 * s1
        slope = (s0 * t1 - s1 * t0) / det if det > 1e-12 else 0.0
        slope = max(slope, 0.0)
        return max((t0 - slope * s1) / s0, 0.0) if s0 else 0.0, slope

    def __call__(self, tokens: int) -> float:
        intercept, slope = self.line()
        return intercept + slope * tokens


def choose_lengths(
    settings: Settings,
    max_len: int,
    acceptance: torch.Tensor,
    *,
    gamma: float,
    min_len: int,
    confidences: Sequence[Sequence[float]] | None = None,
    model: AcceptanceModel | None = None,
    cost: StepCost | None = None,
    drafter_seconds: float = 0.0,
) -> list[int]:
    """Each request's draft length for one step. ``fixed``: ``max_len``; ``adaptive``: the paper's rule on â (γ and
    min_len resolved by the caller); ``goodput``: the lengths with the most expected committed tokens per second
    (``plan_lengths``, 0 allowed) from the acceptance model's chains and the measured cost line, falling back to
    the rule until the line is ready."""
    batch = int(acceptance.shape[0])
    if settings.policy == "fixed":
        return [max_len] * batch
    if settings.policy == "goodput" and cost is not None and cost.ready and confidences is not None:
        model = model or AcceptanceModel()
        heads = acceptance.float().nan_to_num(0.0).tolist()
        gains = [model.gains(list(conf)[:max_len], head) for conf, head in zip(confidences, heads)]
        lengths, _, _ = plan_lengths(
            gains,
            base_tokens=batch,
            base_committed=float(batch),
            drafter_seconds=drafter_seconds,
            target_seconds=cost,
        )
        return lengths
    return draft_lengths(acceptance, gamma, min_len, max_len).tolist()


class DrafterGate:
    """Goodput's coarse decision before the drafter runs: draft this step, or let every request take a plain step.

    Drafting a step of ``batch`` requests is worth ``batch·(1 + s·ā) / (target(batch·(1 + k̄)) + batch·d)`` tokens
    per second against ``batch / target(batch)`` without: ā is the recent accepted drafts per verified round, s the
    share of requests that drafted, k̄ the mean length over all requests of a drafting step and d the drafter's
    seconds per request (exponential averages of what was measured). Until the target's cost line is ready and the
    drafter has run ``min_drafts`` times it drafts; while drafting loses it skips, drafting again every
    ``explore_every`` steps so that its estimates follow the traffic."""

    def __init__(self, explore_every: int = 16, smoothing: float = 0.1, min_drafts: int = 4):
        self.explore_every, self.smoothing, self.min_drafts = explore_every, smoothing, min_drafts
        self.accepted: float | None = None
        self.length = self.share = self.per_request = 0.0
        self.drafts = self.skipped = 0

    def _average(self, old: float, new: float) -> float:
        return old + self.smoothing * (new - old)

    def observe_round(self, accepted: int) -> None:
        self.accepted = float(accepted) if self.accepted is None else self._average(self.accepted, accepted)

    def observe_lengths(self, lengths: Sequence[int], seconds: float) -> None:
        """A drafting step: its lengths and the drafter's seconds."""
        if not lengths:
            return
        per_request = seconds / len(lengths)
        self.per_request = per_request if not self.drafts else self._average(self.per_request, per_request)
        self.drafts += 1
        self.length = self._average(self.length, sum(lengths) / len(lengths))
        self.share = self._average(self.share, sum(k > 0 for k in lengths) / len(lengths))

    def draft(self, batch: int, target: StepCost) -> bool:
        if not (target.ready and self.drafts >= self.min_drafts and self.accepted is not None):
            return True
        gain = batch * (1 + self.share * self.accepted)
        with_drafts = gain / (target(batch * (1 + self.length)) + batch * self.per_request)
        if with_drafts >= batch / target(batch) or self.skipped + 1 >= self.explore_every:
            self.skipped = 0
            return True
        self.skipped += 1
        return False


@dataclass
class Proposal:
    """One round as proposed: its length, the drafter version, â and the drafts' confidences (goodput's inputs)."""

    length: int
    version: int
    head: float = 0.0
    confidences: list[float] | None = None


@dataclass
class _Request:
    prompt: list[int]
    committed: list[int]
    lengths_read: list[int] = field(default_factory=list)  # the last two committed lengths read
    proposals: list[Proposal] = field(default_factory=list)  # the last two proposals
    anchors: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    """A request as a worker sees it at a drafting step: its id, its committed length (prompt included, the step's
    own tokens not yet booked), its prompt length, and a reader of its tokens [start, stop)."""

    request_id: str
    length: int
    prompt_length: int
    tokens: Callable[[int, int], list[int]]


class RoundBook:
    """Per request, the rounds proposed and what became of them (see the module docstring for the one-step lag).

    ``step(rows, proposals, alive)`` is called once per drafting step with the requests in the batch, in batch
    order, and the step's proposals; it returns the rounds resolved by this step as (proposal, accepted) pairs, and
    moves the requests that ``alive`` no longer knows to ``finished`` (trajectory dicts, those with a round)."""

    def __init__(self, keep_finished: int = 256):
        self.requests: dict[str, _Request] = {}
        self.finished: deque[dict] = deque()
        self.recent: deque[dict] = deque(maxlen=keep_finished)  # per-request summaries, newest last

    def step(
        self, rows: Sequence[Row], proposals: Sequence[Proposal], alive: Callable[[str], bool]
    ) -> list[tuple[Proposal, int]]:
        resolved = []
        for row, proposal in zip(rows, proposals):
            request = self.requests.get(row.request_id)
            if request is None:
                request = self.requests[row.request_id] = _Request(
                    prompt=row.tokens(0, row.prompt_length),
                    committed=row.tokens(row.prompt_length, row.length),
                )
            else:
                known = len(request.prompt) + len(request.committed)
                if row.length > known:
                    request.committed += row.tokens(known, row.length)
            outcome = self._resolve(request, row.length)
            if outcome is not None:
                resolved.append(outcome)
            request.lengths_read = [*request.lengths_read[-1:], row.length]
            request.proposals = [*request.proposals[-1:], proposal]
        for request_id in [r for r in self.requests if not alive(r)]:
            self._finish(request_id)
        return resolved

    def _resolve(self, request: _Request, length: int) -> tuple[Proposal, int] | None:
        """The round proposed two readings ago: anchored at the previous reading, accepted = the growth since - 1.
        Only a step that sampled a token proposes for real, and its request grows by the next reading; a proposal
        after which nothing grew (a prefill chunk) was discarded by vLLM's scheduler."""
        if len(request.proposals) < 2 or len(request.lengths_read) < 2:
            return None
        before, previous = request.lengths_read
        if previous <= before:
            return None
        proposal = request.proposals[0]
        accepted = length - previous - 1
        if proposal.length <= 0 or not 0 <= accepted <= proposal.length:
            return None  # a plain step, or a step that did not verify it (a prefill chunk, a preemption)
        request.anchors.append(previous - 1)
        request.draft_lengths.append(proposal.length)
        request.accepted.append(accepted)
        request.versions.append(proposal.version)
        return proposal, accepted

    def _finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        rounds = len(request.anchors)
        self.recent.append(
            {
                "request_id": request_id,
                "rounds": rounds,
                "mean_draft_length": sum(request.draft_lengths) / rounds if rounds else 0.0,
                "accepted": sum(request.accepted),
                "tau": (sum(request.accepted) + rounds) / rounds if rounds else 0.0,
            }
        )
        if rounds:
            self.finished.append(
                {
                    "prompt": request.prompt,
                    "committed": request.committed,
                    "anchors": request.anchors,
                    "draft_lengths": request.draft_lengths,
                    "accepted": request.accepted,
                    "drafter_version": min(request.versions),
                }
            )


@dataclass
class StepStats:
    """What the plugin reports: rounds, k̂ histogram, acceptance, steps whose requests got different lengths."""

    steps: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    lengths: Counter = field(default_factory=Counter)
    steps_with_distinct_lengths: int = 0
    example_lengths: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    skipped_steps: int = 0
    skip_seconds: float = 0.0

    def observe_step(self, lengths: Sequence[int]) -> None:
        self.steps += 1
        self.lengths.update(lengths)
        if len(set(lengths)) > 1:
            self.steps_with_distinct_lengths += 1
            self.example_lengths = list(lengths)

    def observe_round(self, length: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += length
        self.accepted += accepted

    def as_dict(self) -> dict:
        proposed = sum(self.lengths.values())
        return {
            "steps": self.steps,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "tau": (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0,
            "mean_draft_length": sum(k * n for k, n in self.lengths.items()) / proposed if proposed else 0.0,
            "draft_length_histogram": {str(k): n for k, n in sorted(self.lengths.items())},
            "steps_with_distinct_lengths": self.steps_with_distinct_lengths,
            "example_lengths": self.example_lengths,
            "drafter_ms_per_step": 1000 * self.drafter_seconds / self.steps if self.steps else 0.0,
            "steps_without_drafter": self.skipped_steps,
            "ms_per_step_without_drafter": 1000 * self.skip_seconds / self.skipped_steps
            if self.skipped_steps
            else 0.0,
        }
