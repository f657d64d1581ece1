"""Each round's drafting decisions, for a batch of any size: who runs the drafter, how many drafts each request
verifies and from which source, and what the verified round teaches.

``generate`` (``adaflash_hf.generation``) is a batch of one; the engine (``adaflash_hf.serving.engine``) a batch of
its decoding requests. Both run the same three calls per round, around their own forwards:

    round = policy.start(slots, step)        # before the drafter: who drafts (round.drafts: gates, lookup alone)
    choices = policy.choose(round, blocks)   # after it: each request's source and length, inside step.budget
    policy.learn(round, choices, accepted)   # after verification

The policy owns the whole round: it reads what the step hands it (the budget, the adaptive rule's γ after admission)
and what each block says (â, confidences), computes every length itself (the adaptive rule's k̂ included), fits them
to the budget, and calibrates its cost model at its first round. ``start`` returns a frozen ``Round`` that ``choose``
takes, so nothing of a round is left behind on the policy.

``RulePolicy`` is the paper's adaptive rule (k̂ from the length head) or DFlash's fixed length; ``GoodputPolicy``
picks the lengths with the most expected committed tokens per second (``adaflash_hf.drafting``), from its
``CostModel`` (every cost estimate: forwards, drafter, the measured plain step) and ``AcceptanceModel``. A request's
memory between rounds is its ``DraftState``, shared by both policies, so a caller may switch policy from one round to
the next (the engine does under ``length_mode="auto"``). Lookup continuations (hybrid drafting) are valued by one
estimator, the request's ``LookupModel``, both where a policy chooses between them and the block and where
``lookup_min_prob`` truncates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from adaflash_hf.acceptance import AcceptanceModel, LookupModel, ShadowLabels, acceptance_model_for
from adaflash_hf.cost_model import CostModel, calibrate_once, cost_model_for
from adaflash_hf.drafting import (
    CONFIDENCE_ROWS,
    REACH_FOR_MORE_ROWS,
    DraftingSettings,
    SkipGate,
    draft_surplus,
    plan_round,
)
from adaflash_hf.lookup import LookupProposal
from adaflash_hf.prepared.linear import row_tile

# The forward sizes an engine's first step times (those within its token budget), once each: its step fit takes over
# after 16 steps. ``generate`` times 1..16 new tokens (``calibrate_target``'s defaults).
ENGINE_CALIBRATION_SIZES = (1, 4, 16, 64)
# An engine's drafts a step until its step fit exists, where its target does not run in tiles (GoodputPolicy)
COLD_DRAFTS = 16


@dataclass
class DraftState:
    """One request's drafting memory between rounds (a ``generate`` call's, or an engine request's)."""

    gate: SkipGate  # goodput: whether the next rounds run the drafter
    lookups: LookupModel  # how far this request's lookup continuations get accepted
    shadows: ShadowLabels | None = None  # greedy goodput: labels for every proposal from the committed text
    last_acceptance: float | None = None  # the length head's newest â
    last_gains: list[float] | None = None  # the newest block's P(drafts 1..j accepted)
    block: tuple[list[float], float] | None = (
        None  # (confidences, â) of the block this round verifies (goodput)
    )
    # goodput in an engine: seconds this request may still lose to the batch's drafts and stay within the settings'
    # max_slowdown of plain decoding (None: before its first decode step, or no bound)
    slack: float | None = None

    def observe_committed(self, sequence: Sequence[int], offset: int = 0) -> None:
        """The committed text so far from position ``offset`` on (default: prompt + output; an engine passes its
        output and the prompt's length, every proposal being past the prompt): settles the shadow labels it
        decides."""
        if self.shadows is not None and self.shadows.pending:
            self.shadows.resolve(sequence, offset)


@dataclass(frozen=True)
class Slot:
    """A request in this round: its state, the drafts it can still keep, its lookup continuation (hybrid, cut by
    ``lookup_min_prob``), and where its first draft goes (its committed tokens); ``gains``, where the caller already
    has them, are ``state.lookups.gains(proposal)`` (read once a round)."""

    state: DraftState
    room: int
    proposal: LookupProposal | None
    position: int
    gains: Sequence[float] | None = None

    def lookup_gains(self) -> Sequence[float]:
        return self.state.lookups.gains(self.proposal) if self.gains is None else self.gains


@dataclass(frozen=True)
class Block:
    """One request's drafter block: the length head's â, whether every state is finite, and, for the rows a policy
    reads (``confidence_rows``), the drafter's argmax proposals and its confidence (softmax maximum) in each."""

    head: float
    finite: bool
    confidences: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Step:
    """The forward a round shares: the requests in it (verifies + prefills), its prefill tokens, the most tokens the
    forward may take (prefills + one per verifying request + drafts; None: no budget), and the adaptive rule's γ after
    admission (None: the settings' γ)."""

    running: int = 1
    prefill_tokens: int = 0
    budget: int | None = None
    gamma: float | None = None

    def draft_budget(self, verifies: int) -> int | None:
        """The drafts ``verifies`` verifying requests may add to the forward (None: no budget)."""
        return None if self.budget is None else self.budget - self.prefill_tokens - verifies


@dataclass(frozen=True)
class Round:
    """What ``start`` hands ``choose``: the round's requests and step, who runs the drafter (``drafts``), and what
    goodput planned before the drafter ran: per request its options (lookup gains) and their kinds, the step's cost
    curve (None: a plain step), the plan's base and one more drafting request's drafter seconds."""

    slots: tuple[Slot, ...]
    step: Step
    drafts: tuple[bool, ...]
    options: tuple[tuple[Sequence[float], ...], ...] = ()
    kinds: tuple[tuple[str, ...], ...] = ()
    curve: Callable[[int], float] | None = None
    base: Mapping = field(default_factory=dict)
    share: float = 0.0


@dataclass(frozen=True)
class Choice:
    """What a request verifies this round: ``"diffusion"`` (the first ``length`` rows of its block; 0: the drafter
    ran, no draft pays), ``"lookup"`` (the first ``length`` tokens of its continuation) or ``"plain"`` (nothing,
    and the drafter did not run)."""

    source: str
    length: int
    drafter_ran: bool


PLAIN = Choice("plain", 0, False)


def fit_budget(lengths: Sequence[int], budget: int | None) -> list[int]:
    """Draft lengths capped at the highest level L with Σ min(k_i, L) <= ``budget`` (water filling: the longest
    drafts are trimmed first; None: no budget)."""
    lengths = list(lengths)
    if budget is None or not lengths or sum(lengths) <= budget:
        return lengths
    level = max(lengths)
    while level > 0 and sum(min(n, level) for n in lengths) > budget:
        level -= 1
    return [min(n, level) for n in lengths]


def expected_lookup_accepted(state: DraftState, proposal: LookupProposal, length: int | None = None) -> float:
    """Expected accepted tokens of the first ``length`` tokens of a lookup continuation (default: all)."""
    return sum(state.lookups.gains(proposal)[:length])


def truncate_lookup(proposal: LookupProposal | None, lookups: LookupModel, min_prob: float):
    """The continuation cut to the tokens whose chance of being reached and accepted is at least ``min_prob`` (at
    least one token): a weak match does not make the target verify a long continuation it will reject."""
    return truncate_lookup_gains(proposal, lookups, min_prob)[0]


def truncate_lookup_gains(proposal: LookupProposal | None, lookups: LookupModel, min_prob: float):
    """``truncate_lookup``'s continuation and its gains (``lookups.gains`` of it: the first gains of the uncut
    one, a token's chance depending on its position and the match alone)."""
    if proposal is None or not proposal.tokens:
        return proposal, []
    gains = lookups.gains(proposal)
    if min_prob <= 0:
        return proposal, gains
    keep = max(1, sum(g >= min_prob for g in gains))
    if keep == len(proposal.tokens):
        return proposal, gains
    cut = LookupProposal(
        tokens=proposal.tokens[:keep], match_length=proposal.match_length, support=proposal.support
    )
    return cut, gains[:keep]


def lookup_beats_block(proposal: LookupProposal | None, lookups: LookupModel, head, block_size: int) -> bool:
    """The adaptive rule's choice: lookup wins when its expected accepted tokens beat the block's â · (B - 1). No
    proposal never wins (an empty index is diffusion-only); a non-finite â counts as 0 (such a block drafts
    nothing)."""
    if proposal is None or not proposal.tokens:
        return False
    head = head if head is not None and math.isfinite(head) else 0.0
    return sum(lookups.gains(proposal)) > head * (block_size - 1)


class DraftingPolicy:
    """The shape every policy has (see the module docstring); also what every policy learns from a lookup round."""

    def __init__(self, settings: DraftingSettings, block_size: int):
        self.settings = settings
        self.block_size = block_size

    def new_state(self, lookups: LookupModel, greedy: bool) -> DraftState:
        """A request's fresh state. A greedy request's lookup model starts from ``lookups`` (the caller's shared one)
        and teaches it; a sampled request's starts from its own matches alone, so that its drafts, and with them the
        random numbers its verification draws, depend on its own tokens only: a seed reproduces its sample whatever
        ran before or beside it."""
        shared = lookups if greedy else None
        return DraftState(gate=SkipGate(max_skip=self.settings.max_skip), lookups=LookupModel(parent=shared))

    def start(self, slots: Sequence[Slot], step: Step) -> Round:
        raise NotImplementedError

    def choose(self, round_: Round, blocks: Sequence[Block | None]) -> list[Choice]:
        """Each request's source and length; the lengths fit ``round_.step``'s budget."""
        raise NotImplementedError

    def confidence_rows(self, room: int, confidences: Sequence[float], head: float) -> int:
        """How many of a block's first rows ``choose`` reads the confidence of, given those read so far (none at
        first): each costs an lm_head row over the draft vocabulary."""
        return 0

    def learn(self, round_: Round, choices: Sequence[Choice], accepted: Sequence[int]) -> None:
        for slot, choice, n in zip(round_.slots, choices, accepted):
            # Greedy goodput requests learn from ShadowLabels (every proposal, after the commit) instead.
            if choice.source == "lookup" and slot.state.shadows is None:
                slot.state.lookups.observe(slot.proposal.match_length, choice.length, n)

    def observe_step(self, verify_tokens: int, step: Step, seconds: float) -> None:
        """The target forward's seconds (goodput learns its cost curve from them)."""

    def observe_drafter(self, requests: int, seconds: float) -> None:
        """A drafter forward's seconds."""

    def settle(self, round_: Round, committed: Sequence[int], step: Step, seconds: float) -> None:
        """After a step: each verifying request's committed tokens (``GoodputPolicy`` keeps its slack)."""

    def judge_step(
        self,
        drafted: bool,
        committed: int,
        verifies: int,
        step: Step,
        seconds: float,
        target_seconds: float = 0.0,
        verified: int = 0,
    ) -> None:
        """The whole step's wall time (goodput's safety net under the per-request plan)."""


class PlainPolicy(DraftingPolicy):
    """No drafter: every request verifies nothing (plain decoding)."""

    def start(self, slots, step):
        return Round(tuple(slots), step, (False,) * len(slots))

    def choose(self, round_, blocks):
        return [PLAIN] * len(round_.slots)


class RulePolicy(DraftingPolicy):
    """The paper's rule (``fixed=False``: k̂ = clamp(floor(γ·â·(B-1)), min_len, B-1) from the length head, by
    ``length_rule``, the drafter's ``predict_draft_length``; γ is the step's) or DFlash's (``fixed=True``: B - 1
    drafts); in hybrid, lookup wins where its expected accepted tokens beat â · (B - 1), and a lookup that beats the
    last â skips the drafter forward. Lengths over the step's budget are trimmed longest first (``fit_budget``)."""

    def __init__(
        self,
        settings: DraftingSettings,
        block_size: int,
        fixed: bool,
        length_rule: Callable[..., torch.Tensor] | None = None,
    ):
        super().__init__(settings, block_size)
        self.fixed = fixed
        self.length_rule = length_rule

    def start(self, slots, step):
        drafts = tuple(
            not (s.state.last_acceptance is not None and self._lookup_wins(s, s.state.last_acceptance))
            for s in slots
        )
        return Round(tuple(slots), step, drafts)

    def _lookup_wins(self, slot: Slot, head) -> bool:
        return lookup_beats_block(slot.proposal, slot.state.lookups, head, self.block_size)

    def choose(self, round_, blocks):
        rule_lengths = iter(self._rule_lengths(blocks, round_.step))
        sources, lengths, ran = [], [], []
        for slot, block in zip(round_.slots, blocks):
            rule_length = next(rule_lengths) if block is not None else 0
            ran.append(block is not None)
            if block is None or self._lookup_wins(slot, block.head):
                sources.append("lookup")
                lengths.append(len(slot.proposal.tokens))
                continue
            sources.append("diffusion")
            lengths.append(min(rule_length if block.finite else 0, slot.room))
        lengths = fit_budget(lengths, round_.step.draft_budget(len(round_.slots)))
        return [Choice(s, n, r) for s, n, r in zip(sources, lengths, ran)]

    def _rule_lengths(self, blocks: Sequence[Block | None], step: Step) -> list[int]:
        """Each drafted block's rule length: B - 1 (fixed), else k̂ from its â and the step's γ."""
        heads = [b.head for b in blocks if b is not None]
        if self.fixed or not heads:
            return [self.block_size - 1] * len(heads)
        gamma = self.settings.gamma if step.gamma is None else step.gamma
        # The drafter's float32 â, as the length head gave it: the rule floors γ·â·(B-1) in float32.
        return self.length_rule(
            torch.tensor(heads, dtype=torch.float32), gamma, self.settings.min_len
        ).tolist()


class GoodputPolicy(DraftingPolicy):
    """Per request and round the k in 0..B-1 (and in hybrid the source) with the most expected committed tokens per
    second of the shared forward (``drafting.plan_round``), from the cost model and the acceptance model; requests
    whose drafting did not pay skip the drafter for a while (``SkipGate``), and, where whole steps are judged
    (``judge_step``: the engine), so does the whole batch while drafted steps lose to plain ones. Its first round
    calibrates the cost model (``calibrate_once``) by forwards of ``target`` with ``forward_kwargs``."""

    def __init__(
        self,
        settings: DraftingSettings,
        block_size: int,
        cost: CostModel,
        acceptance: AcceptanceModel,
        kind: str = "generate",
        target=None,
        **forward_kwargs,
    ):
        super().__init__(settings, block_size)
        self.cost = cost
        self.kind = kind  # the forwards the cost model prices: "generate" or "engine"
        self.acceptance = acceptance
        self.batch_gate = SkipGate(max_skip=settings.max_skip)
        self.target = target
        self.forward_kwargs = forward_kwargs

    def new_state(self, lookups, greedy):
        """A greedy request also labels every proposal from its committed text (``ShadowLabels``)."""
        state = super().new_state(lookups, greedy)
        state.shadows = ShadowLabels(self.acceptance, state.lookups) if greedy else None
        return state

    def _calibrate(self, step: Step) -> None:
        """Once per cost model, at its first round: this machine's saved calibration, else timed forwards
        (``calibrate_once``; an engine's, of the sizes within its token budget, once each)."""
        if not self.settings.calibrate or self.cost.calibrated:
            return
        sizes = {}
        if self.kind == "engine":
            fits = [n for n in ENGINE_CALIBRATION_SIZES if step.budget is None or n <= step.budget]
            sizes = {"sizes": fits, "repeats": 1, "budget_s": 1.0}
        calibrate_once(self.target, self.cost, self.kind, **sizes, **self.forward_kwargs)

    def start(self, slots, step):
        self._calibrate(step)
        if self.kind == "engine" and self.cost.tile_rows is None:
            self.cost.tile_rows = row_tile(self.target)
        options = tuple((g,) if (g := s.lookup_gains()) else () for s in slots)
        kinds = tuple(("lookup",) if o else () for o in options)
        for slot in slots:
            if slot.state.shadows is not None:
                slot.state.shadows.add_lookup(slot.position, slot.proposal)
        count = len(slots)
        # The plan counts verify tokens (anchors + drafts); the curve prices them beside the step's prefills.
        curve = self.cost.step_curve(step.running, step.prefill_tokens)
        if (
            not slots
            or curve is None
            or not self.cost.knows_target(step.prefill_tokens + count, step.running)
        ):
            # A plain step measures the k = 0 baseline first.
            return Round(tuple(slots), step, (False,) * count, options, kinds)
        curve = self._beside_prefill(curve, step, count)
        base = {"base_tokens": count, "base_committed": float(step.running), "target_seconds": curve}
        share = self.cost.marginal_drafter_seconds(count)
        self.batch_gate.reopen(step.running)
        for slot in slots:
            slot.state.gate.reopen(step.running)
        plain = curve(count)
        batch_open = self.batch_gate.should_draft() and self._drafter_fits_slack(slots, None, plain)
        drafts = tuple(
            batch_open
            and s.room > 0
            and s.state.gate.should_draft()
            and not _lookup_alone_wins(s, o, base, share)
            for s, o in zip(slots, options)
        )
        if any(drafts) and not self._drafter_fits_slack(slots, drafts, plain):
            drafts = (False,) * count
        return Round(tuple(slots), step, drafts, options, kinds, curve, base, share)

    def _drafter_fits_slack(self, slots, drafts, plain: float) -> bool:
        """Whether the drafter's forward leaves every request within its slack: its seconds against each request's
        slack plus what its last block's drafts would save it (``plain``: a plain step's forward). ``drafts``: who
        runs it; None: the least forward, of one request, each request counted as running it (no set of drafters
        fits where that does not)."""
        need = self.cost.drafter_seconds(1 if drafts is None else sum(drafts))
        for slot, runs in zip(slots, drafts or [True] * len(slots)):
            if slot.state.slack is None:
                continue
            saved = plain * sum((slot.state.last_gains or [])[: slot.room]) if runs else 0.0
            if slot.state.slack + saved < need:
                return False
        return True

    def _beside_prefill(self, curve, step, count: int):
        """The curve a step with prompts to prefill is planned on: its drafts' own cost beside the prefill (the
        step's curve above its ``count`` anchors) on top of a decode step of the same requests (the decode curve at
        ``count``). The prefill is paid whatever is drafted; what the drafts' seconds must beat is what they would
        commit in decode steps, not the prefill step's own low tokens a second: on a CPU a prefill's rows make the
        forward compute-bound, where each verified row costs about what a prompt token does (a 16-request step
        with a 136-token prefill: 213 ms with 15 verify rows, 411 ms with 120), while a decode step's extra rows
        are nearly free. ``curve`` unchanged for a step without prefill, or before the decode curve is known."""
        if not step.prefill_tokens:
            return curve
        decode = self.cost.step_curve(step.running)
        if decode is None:
            return curve
        anchors, floor = curve(count), decode(count)
        return lambda n: floor + max(0.0, curve(n) - anchors)

    def confidence_rows(self, room, confidences, head):
        """The first ``CONFIDENCE_ROWS`` rows; then all ``room`` rows where the chain of acceptances reaches past
        them with more than ``REACH_FOR_MORE_ROWS``."""
        if not confidences:
            return min(room, CONFIDENCE_ROWS)
        if self.acceptance.gains(confidences, head)[-1] > REACH_FOR_MORE_ROWS:
            return room
        return len(confidences)

    def choose(self, round_, blocks):
        slots = round_.slots
        if round_.curve is None:
            return [PLAIN] * len(slots)
        options, kinds = [list(o) for o in round_.options], [list(k) for k in round_.kinds]
        drafting = sum(b is not None for b in blocks)
        for i, (slot, block) in enumerate(zip(slots, blocks)):
            if block is None:
                continue
            state = slot.state
            state.last_gains = []
            if not block.finite:
                continue
            state.last_gains = self.acceptance.gains(block.confidences, block.head)
            state.block = (list(block.confidences), block.head)
            if state.shadows is not None:
                state.shadows.add_block(slot.position, block.tokens, block.confidences, block.head)
            options[i], kinds[i] = [state.last_gains, *options[i]], ["diffusion", *kinds[i]]
        drafter_seconds = self.cost.drafter_seconds(drafting) if drafting else 0.0
        budget = self._cold_budget(round_.step.draft_budget(len(slots)))
        slack = [math.inf if s.state.slack is None else s.state.slack for s in slots]
        plan = plan_round(options, drafter_seconds=drafter_seconds, budget=budget, slack=slack, **round_.base)
        return self._choices(round_, blocks, plan, kinds, budget)

    def _cold_budget(self, budget: int | None) -> int | None:
        """An engine's drafts before its step fit exists (``CostModel.has_step_fit``: its first steps in a process):
        at most one tile of rows (16 where the target is not tiled). The per-size curve it plans on until then
        extrapolates from few sizes and can be flat over many rows (a fresh engine at 16 requests planned 75 drafts a
        step on a curve that priced 91 rows as 16, and its steps ran at 0.5x plain's tokens a second); a tile of
        drafts still gives the fit the step sizes it needs. A profile (``CostModel.profile``, which learns nothing) is
        the user's word on the costs: no cap."""
        if self.kind != "engine" or self.cost.frozen or self.cost.has_step_fit():
            return budget
        cap = self.cost.tile_rows or COLD_DRAFTS
        return cap if budget is None else min(budget, cap)

    def _choices(self, round_: Round, blocks, plan, kinds, budget) -> list[Choice]:
        """The plan's choices; a sampled request's probe verifies one draft where the budget has room for it."""
        count = len(round_.slots)
        plain = round_.curve(count)
        rate = round_.base["base_committed"] / plain
        spare = math.inf if budget is None else budget - sum(plan.lengths)
        choices = []
        for i, (slot, block) in enumerate(zip(round_.slots, blocks)):
            state, length = slot.state, plan.lengths[i]
            source = None if plan.sources[i] is None else kinds[i][plan.sources[i]]
            ran = block is not None
            if source is None and ran and state.gate.probing and state.shadows is None:
                if state.last_gains and spare > 0:  # sampling: a probe verifies one draft, the only label
                    source, length, spare = "diffusion", 1, spare - 1
            if ran:
                gains = state.last_gains or []
                surplus = draft_surplus(gains, lambda k: round_.curve(count + k) - plain, rate)
                state.gate.record(surplus, rate * round_.share, round_.step.running)
            choices.append(Choice(source or ("diffusion" if ran else "plain"), length, ran))
        return choices

    def learn(self, round_, choices, accepted):
        super().learn(round_, choices, accepted)
        for slot, choice, n in zip(round_.slots, choices, accepted):
            state = slot.state
            if choice.source == "diffusion" and choice.length and state.block and state.shadows is None:
                self.acceptance.update(*state.block, choice.length, n)
            state.block = None

    def observe_step(self, verify_tokens, step, seconds):
        self.cost.observe_step(verify_tokens, step.prefill_tokens, step.running, seconds)

    def observe_drafter(self, requests, seconds):
        self.cost.observe_drafter(requests, seconds)

    def settle(self, round_, committed, step, seconds):
        """Each request's slack after an engine's decode step: what a plain step would have taken for its committed
        tokens, ``max_slowdown`` of it more, less the step's seconds. A request starts with one plain step of slack
        (room for the drafter's first forwards), and a request whose drafts pay gains slack, while one whose drafts
        seldom land loses what the batch's drafts cost its steps; the plan (``plan_round``'s ``slack``) and the
        drafter's forward (``_drafter_fits_slack``) keep every request's slack from going below 0, so no request
        ends much later than plain decoding would have ended it (a batch of requests that came together ends on its
        last one). Steps with prefill are not counted (their prompt costs what a plain step beside it would)."""
        tolerance = self.settings.max_slowdown
        if tolerance is None or self.kind != "engine" or step.prefill_tokens or round_.curve is None:
            return
        plain = self.cost.plain_step_seconds(step.running)
        if plain is None:
            return
        for slot, tokens in zip(round_.slots, committed):
            state = slot.state
            if state.slack is None:
                state.slack = plain
            state.slack += (1 + tolerance) * tokens * plain - seconds

    def judge_step(self, drafted, committed, verifies, step, seconds, target_seconds=0.0, verified=0):
        """The safety net under the per-request plan: everything it does not price (the drafter's fixed cost when few
        requests draft, the confidences, the bookkeeping) shows in the step's wall time. A drafted step is worth its
        committed tokens minus what plain decoding would have committed in the same seconds
        (``CostModel.plain_step_seconds``; beside a prefill, the seconds beyond the plain step at a decode step's
        tokens a second, as ``_beside_prefill`` plans); while that average stays negative the whole batch skips the
        drafter (``SkipGate``'s backoff, with probes). ``verified``: the step's verified drafts (a step that verified lookup
        continuations without the drafter is no plain step)."""
        if not drafted:
            whole = not step.prefill_tokens and not verified
            self.cost.observe_plain_step(step.running, seconds, target_seconds, whole)
            return
        plain_seconds = self.cost.plain_step_seconds(step.running, step.prefill_tokens, verifies)
        decode_seconds = (
            self.cost.plain_step_seconds(step.running, 0, verifies) if step.prefill_tokens else plain_seconds
        )
        if plain_seconds is not None and decode_seconds is not None:
            # the seconds beyond the plain step, at what decode steps commit in them (_beside_prefill)
            lost = (seconds - plain_seconds) * verifies / decode_seconds
            self.batch_gate.record(committed - verifies - lost, 0.0, step.running)


def _lookup_alone_wins(slot: Slot, options: Sequence, base: Mapping, share: float) -> bool:
    """Whether the lookup continuation, without the drafter, beats the last block's gains with it (``share``: the
    drafter seconds one more drafting request adds)."""
    if not options or slot.state.last_gains is None:
        return False
    alone = plan_round([options], drafter_seconds=0.0, **base)
    drafted = plan_round([[slot.state.last_gains[: slot.room], *options]], drafter_seconds=share, **base)
    return alone.goodput >= drafted.goodput


def policy_for(
    length_mode: str, settings: DraftingSettings, target, drafter, kind: str, output_hidden_states=None
) -> DraftingPolicy:
    """The policy of a resolved length mode (``DraftingSettings.length_mode_for``) for ``drafter`` on ``target``;
    goodput keeps the target's cost model for ``kind`` forwards (``cost_model_for``) and the drafter's acceptance
    model, both shared with every other call that uses them, and calibrates with the target's forwards as they run
    (``output_hidden_states``: default, the layers the drafter reads)."""
    block_size = drafter.config.block_size
    if length_mode == "goodput":
        hidden = (
            drafter.config.target_hidden_state_ids if output_hidden_states is None else output_hidden_states
        )
        cost, acceptance = cost_model_for(target, kind), acceptance_model_for(drafter)
        return GoodputPolicy(
            settings, block_size, cost, acceptance, kind, target, output_hidden_states=hidden
        )
    return RulePolicy(
        settings, block_size, fixed=length_mode == "fixed", length_rule=drafter.predict_draft_length
    )
