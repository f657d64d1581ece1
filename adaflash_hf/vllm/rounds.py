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
import statistics
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


MIN_STEPS, MIN_ROUNDS = 2, 8  # what ``DrafterGate`` measures of a class before it trusts its comparison
STEP_WINDOW = 9  # the recent steps of a kind whose median is a class's step time


def batch_bucket(batch: int) -> int:
    """The power of two at or below ``batch``: the size class ``DrafterGate`` keeps its measurements for."""
    return 1 << (max(1, int(batch)).bit_length() - 1)


@dataclass
class _Arm:
    """One batch-size class: a step's seconds per request without and with the drafter (the median of the last
    ``STEP_WINDOW`` timed steps of each kind: a step slowed by something else on the host, or a burst of them, moves
    it little, and it follows a lasting change within a few steps), and, of drafting steps, exponential averages of
    the share of requests that drafted and of the drafts accepted per verified round."""

    plain_steps: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    draft_steps: deque = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    share: float | None = None
    accepted: float | None = None
    accepted_squared: float | None = None
    # plain steps timed, drafting steps timed, rounds reported, drafting steps booked
    counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])

    @property
    def plain(self) -> float | None:
        return statistics.median(self.plain_steps) if self.plain_steps else None

    @property
    def draft(self) -> float | None:
        return statistics.median(self.draft_steps) if self.draft_steps else None

    def gain(self) -> float | None:
        """Drafts accepted per request of a drafting step, once ``MIN_ROUNDS`` rounds are in."""
        if self.share is None or self.accepted is None or self.counts[2] < MIN_ROUNDS:
            return None
        return self.share * self.accepted

    def gain_error(self) -> float:
        """The doubt ``gain`` is given: the rounds' spread over the square root of every round the class has
        reported. The average itself holds the last ~``2 / smoothing`` rounds, but each of the windows before
        said the same about a steady class; a doubt fixed at that window's error would let a class whose loss is
        within one round's spread of 0 draft for ever (at 4 requests a round accepts 0 most times and 10 now and
        then: a spread of ~2, an error of ~0.15 plain steps that never shrank)."""
        if self.share is None or self.accepted is None or self.accepted_squared is None or not self.counts[2]:
            return 0.0
        spread = max(self.accepted_squared - self.accepted**2, 0.0) ** 0.5
        return self.share * spread / self.counts[2] ** 0.5

    def timed(self) -> bool:
        return self.counts[0] >= MIN_STEPS and self.counts[1] >= MIN_STEPS

    def loss(self) -> float | None:
        """What one drafting step costs beyond plain steps that commit as many tokens, in plain steps (< 0: drafting
        pays); None until both arms and the gain are measured."""
        gain = self.gain()
        if not self.timed() or gain is None:
            return None
        return self.draft / self.plain - (1.0 + gain)


@dataclass
class _Opened:
    """A proposal as ``DrafterGate`` keeps it until the next one: when it began, its batch and requests, whether no
    request joined at it (no prompt's work inside it), and the tokens per request the target's next step runs if it
    only verifies (1 and the drafts; empty: a step without the drafter, 1 each)."""

    start: float
    batch: int
    steady: bool
    request_ids: list[str]
    scheduled: dict[str, int] = field(default_factory=dict)

    @property
    def drafted(self) -> bool:
        return bool(self.scheduled)


class DrafterGate:
    """Goodput's decision before the drafter runs, from what steps measurably cost here: draft this step, or let
    every request take a plain step.

    A step's cost is measured from one proposal to the next (the drafter's forward, then the target verifying what
    it proposed), where no request joined at either end (a prefill would be inside the interval). Per batch-size class
    (powers of two) the gate keeps the seconds per request of such steps with the drafter and without, and the drafts
    accepted per request of a drafting step (the share of requests that drafted times the drafts accepted per
    verified round, reported one step late). Drafting at batch b pays when ``(1 + gain) / t_draft >= 1 / t_plain``.

    A class that lacks measurements (``MIN_STEPS`` steps of each kind, ``MIN_ROUNDS`` rounds) takes steps of the
    missing kind, plain first, the gain of the nearest class standing in until its own is in; a class drafts while
    its loss less one standard error of its gain is at most 0 (the gain of a few rounds is uncertain; the error
    shrinks with every round reported, ``_Arm.gain_error``); a class above
    one where drafting measurably lost drafts only every ``2 * explore_every`` steps until its own steps are timed,
    and one below a class where it measurably paid drafts without trying plain first. Either way it tries
    the other kind again once the steps taken since it last did reach ``|loss| / budget`` (the exploration then
    costs at most ``budget`` of the time, ``loss`` as ``_Arm.loss``) and at least ``explore_every``, so its
    estimates follow the traffic and the host: a verdict reached while the host was slow is measured again. A
    drafting step tried where drafting loses waits at least ``trial_every`` steps: it costs more than its own
    interval shows. Requests that had accepted different numbers of drafts finish on different steps, so a batch whose
    requests started together no longer finishes together (its next prompts prefill one or a few at a time, its last
    requests drain one at a time), and the drafter first reads the context of every step it sat out. A plain step
    tried where drafting pays costs neither."""

    def __init__(
        self,
        explore_every: int = 4,
        budget: float = 0.01,
        gain_smoothing: float = 0.05,
        trial_every: int = 64,
    ):
        if not 0 < budget <= 1:
            raise ValueError(f"budget: expected a fraction in (0, 1], got {budget}")
        if trial_every < 1:
            raise ValueError(f"trial_every: expected an int >= 1, got {trial_every}")
        self.explore_every, self.budget, self.trial_every = explore_every, budget, trial_every
        self.gain_smoothing = gain_smoothing  # a round's accepted count is noisy
        self.arms: dict[int, _Arm] = {}
        self.skipped = 0  # steps without the drafter since the last drafting step
        self.drafted_in_a_row = 0  # drafting steps since the last step without it
        self._last: _Opened | None = None  # the proposal the next ``start`` closes

    def _average(self, old: float | None, new: float, count: int) -> float:
        """The ``count``-th sample into an exponential average that is the plain mean of its first samples (until
        ``1 / gain_smoothing`` of them): the first round read must not stand for the next twenty."""
        rate = max(self.gain_smoothing, 1.0 / count)
        return new if old is None else old + rate * (new - old)

    def arm(self, batch: int) -> _Arm:
        return self.arms.setdefault(batch_bucket(batch), _Arm())

    def start(self, now: float, batch: int, request_ids: Sequence[str], tokens: int | None = None) -> None:
        """A proposal begins, after a target step of ``tokens`` tokens: the interval since the previous proposal is
        the cost of that step, booked to its class and kind when no request joined at either end and the step ran
        exactly the tokens the previous proposal scheduled (one per request and its drafts). A joining request's
        prefill, a prompt's later prefill chunks (same requests, more tokens) and the drafter context written for
        them would be inside the interval."""
        last = self._last
        steady = last is not None and set(request_ids) <= set(last.request_ids)
        if steady and tokens is not None and tokens != sum(last.scheduled.get(i, 1) for i in request_ids):
            steady = False  # (a request that finished takes its tokens with it)
        if steady and last.steady and now > last.start and last.batch > 0:
            arm = self.arm(last.batch)
            (arm.draft_steps if last.drafted else arm.plain_steps).append((now - last.start) / last.batch)
            arm.counts[int(last.drafted)] += 1
        self._last = _Opened(now, batch, steady, list(request_ids))

    def drafted(self, lengths: Sequence[int]) -> None:
        """The step that just began drafted these lengths (a step that only runs ``start`` is booked as plain)."""
        if self._last is not None and lengths:
            opened = self._last
            opened.scheduled = {request: 1 + k for request, k in zip(opened.request_ids, lengths)}
            arm = self.arm(opened.batch)
            arm.counts[3] += 1
            arm.share = self._average(arm.share, sum(k > 0 for k in lengths) / len(lengths), arm.counts[3])

    def observe_round(self, accepted: int, batch: int) -> None:
        """A verified round of a drafting step of ``batch`` requests."""
        if batch > 0:
            arm = self.arm(batch)
            arm.counts[2] += 1
            arm.accepted = self._average(arm.accepted, float(accepted), arm.counts[2])
            arm.accepted_squared = self._average(arm.accepted_squared, float(accepted) ** 2, arm.counts[2])

    def _nearest(self, bucket: int, value: Callable[[_Arm], float | None]) -> float | None:
        """``value`` of this class, else of the nearest class that has it."""
        ranked = sorted((abs(math.log2(other / bucket)), other) for other in self.arms)
        for _, other in ranked:
            found = value(self.arms[other])
            if found is not None:
                return found
        return None

    def loss(self, batch: int) -> float | None:
        """``_Arm.loss`` of this batch's class, with the nearest class's gain until its own is reported."""
        bucket = batch_bucket(batch)
        arm = self.arms.get(bucket)
        if arm is None or not arm.timed():
            return None
        gain = self._nearest(bucket, _Arm.gain)
        return None if gain is None else arm.draft / arm.plain - (1.0 + gain)

    def _optimistic(self, bucket: int, loss: float) -> float:
        """``loss`` less one standard error of the class's gain: a class judged on a few rounds (at one request,
        a round accepts 0 one time and 15 the next) keeps drafting until its rounds say otherwise."""
        arm = self.arms.get(bucket)
        return loss if arm is None else loss - arm.gain_error()

    def _inferred(self, bucket: int) -> bool | None:
        """Drafting measurably lost in a smaller class (False) or paid in a larger one (True); None if neither."""
        for other in self.arms:
            loss = self.loss(other)
            if loss is not None and other < bucket and loss > 0:
                return False
            if loss is not None and other > bucket and loss <= 0:
                return True
        return None

    def draft(self, batch: int) -> bool:
        bucket = batch_bucket(batch)
        loss = self.loss(bucket)
        if loss is None:
            inferred = self._inferred(bucket)
            if inferred is None:  # measure: plain steps first, then drafting steps
                return self._decide(self.arm(bucket).counts[0] >= MIN_STEPS)
            if inferred:
                margin = -min(self._nearest(bucket, _Arm.loss) or 0.0, 0.0)
                return self._decide(self.drafted_in_a_row + 1 < self._wait(margin))
            # lost in a smaller class: plain, and a drafting step every 2 x explore_every steps until this class's
            # own steps are timed (the smaller class's verdict may not hold here: in bf16 the target's step gets
            # cheaper per request with the batch, and a class seen only at the tails of waves is timed on few steps)
            return self._decide(self.skipped + 1 >= 2 * self.explore_every)
        # drafting pays: a plain step now and then, to see that it still does
        if self._optimistic(bucket, loss) <= 0:
            return self._decide(self.drafted_in_a_row + 1 < self._wait(max(-loss, 0.0)))
        return self._decide(self.skipped + 1 >= max(self.trial_every, self._wait(max(loss, 0.0))))

    def _wait(self, margin: float) -> int:
        """Steps of one kind between two of the other, where the other costs ``margin`` plain steps more."""
        return max(self.explore_every, math.ceil(margin / self.budget))

    def _decide(self, draft: bool) -> bool:
        self.skipped = 0 if draft else self.skipped + 1
        self.drafted_in_a_row = self.drafted_in_a_row + 1 if draft else 0
        return draft

    def report(self) -> dict:
        """Per class: milliseconds per request of a step without and with the drafter, gain and loss."""
        out = {}
        for bucket, arm in sorted(self.arms.items()):
            gain, loss = arm.gain(), self.loss(bucket)
            out[str(bucket)] = {
                "plain_ms_per_request": None if arm.plain is None else round(1000 * arm.plain, 3),
                "draft_ms_per_request": None if arm.draft is None else round(1000 * arm.draft, 3),
                "accepted_per_request": None if gain is None else round(gain, 3),
                "loss_in_plain_steps": None if loss is None else round(loss, 3),
            }
        return out


@dataclass
class Proposal:
    """One round as proposed: its length, the drafter version, â and the drafts' confidences (goodput's inputs)."""

    length: int
    version: int
    head: float = 0.0
    confidences: list[float] | None = None
    batch: int = 0  # the batch of the drafting step that proposed it (0: a step without the drafter)


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
    outside_vocabulary: int = 0  # drafts proposed outside the drafter's own vocabulary

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
            "drafts_outside_vocabulary": self.outside_vocabulary,
            "ms_per_step_without_drafter": 1000 * self.skip_seconds / self.skipped_steps
            if self.skipped_steps
            else 0.0,
        }
