"""How many drafts get accepted, for ``length_mode="goodput"``: ``AcceptanceModel`` (a block's drafts, from the
drafter's confidence and the length head's â), ``LookupModel`` (a lookup continuation's, from its match length), and
``ShadowLabels``, which under greedy decoding labels every proposal, verified or not, from the committed text."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from adaflash_hf.lookup import LookupProposal


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


# Positions a lookup model keeps a rate for; later tokens of a continuation share the last one
LOOKUP_POSITIONS = 16


@dataclass
class LookupModel:
    """How far a lookup continuation gets accepted: P(its token j is accepted, once tokens 1..j-1 were), for each
    position j (1..``LOOKUP_POSITIONS``) and length of the n-gram match behind it (1..5, 6+), from labelled proposals.

    A rate per position, not one for the first token and one for the rest: lookups are bursty (a continuation of
    repeated text is either wrong at once or right for a long way), so the chance of the next token rises with the
    tokens already accepted, and one rate pooled over the later positions (where the trials of the long runs outnumber
    those of the runs that stop early) overvalues every continuation: half of them stopping at their second token
    and half right for all twelve deliver 6.5 accepted tokens, which a pooled rate of 11/12 values at 7.8. A request's model
    starts from its ``parent``'s estimate (the engine's, or the target's in ``generate``: shared across requests),
    worth ``strength`` observations; the parent starts from the match's own evidence, support · n / (n + 1), at
    its first two positions, and each later position from its estimate at the position before."""

    parent: LookupModel | None = None
    strength: float = 4.0
    # bucket -> [accepted, trials] per position 1..LOOKUP_POSITIONS
    counts: dict[int, list[list[float]]] = field(default_factory=dict)

    def rates(self, proposal: LookupProposal, length: int | None = None) -> list[float]:
        """P(token j accepted | tokens 1..j-1 accepted) for j = 1..min(length, LOOKUP_POSITIONS) (``length``:
        default, the proposal's tokens, at least one)."""
        positions = min(LOOKUP_POSITIONS, max(1, len(proposal.tokens) if length is None else length))
        if self.parent is not None:
            priors = self.parent.rates(proposal, positions)
        else:
            priors = [proposal.support * proposal.match_length / (proposal.match_length + 1)] * min(
                2, positions
            )
        counts = self.counts.get(_match_bucket(proposal.match_length))
        out = []
        for j in range(positions):
            prior = priors[j] if j < len(priors) else out[-1]
            accepted, trials = counts[j] if counts is not None else (0.0, 0.0)
            out.append((accepted + self.strength * prior) / (trials + self.strength))
        return out

    def gains(self, proposal: LookupProposal | None) -> list[float]:
        """P(lookup tokens 1..j all accepted), j = 1..len(tokens)."""
        if proposal is None or not proposal.tokens:
            return []
        rates = self.rates(proposal)
        out, reach = [], 1.0
        for j in range(len(proposal.tokens)):
            reach *= rates[min(j, len(rates) - 1)]
            out.append(reach)
        return out

    def observe(self, match_length: int, length: int, accepted: int) -> None:
        """One labelled continuation of ``length`` tokens, ``accepted`` of them accepted (here and in the parent):
        a trial at every position up to the first rejected one, a success at each accepted one."""
        bucket = _match_bucket(match_length)
        counts = self.counts.get(bucket)
        if counts is None:
            counts = self.counts[bucket] = [[0.0, 0.0] for _ in range(LOOKUP_POSITIONS)]
        for j in range(1, min(length, accepted + 1) + 1):
            entry = counts[min(j, LOOKUP_POSITIONS) - 1]
            entry[0] += j <= accepted
            entry[1] += 1
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
    lookup model (continuations). Without this, a request that stops drafting stops learning that it should
    draft again. Sampling rounds are not greedy text: there only verified drafts teach (``AcceptanceModel.update``).
    """

    acceptance: AcceptanceModel
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

    def resolve(self, sequence: Sequence[int], offset: int = 0) -> None:
        """Settle every pending proposal whose outcome ``sequence`` (the committed tokens from position ``offset``
        on; every pending proposal starts there or later) now decides."""
        still = []
        for start, tokens, confidences, head in self.pending:
            seen = sequence[start - offset : start - offset + len(tokens)]
            accepted = next((j for j, (a, b) in enumerate(zip(tokens, seen)) if a != b), len(seen))
            if accepted == len(seen) < len(tokens):
                still.append((start, tokens, confidences, head))  # all seen so far agree: wait for more
                continue
            if confidences is None:
                self.lookups.observe(int(head), len(tokens), accepted)
            else:
                self.acceptance.update(confidences, head, min(len(tokens), accepted + 1), accepted)
        self.pending = still
