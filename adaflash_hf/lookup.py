"""Lookup proposals for hybrid drafting: the continuation of the longest earlier match of the sequence's suffix.

A request's committed tokens (prompt + output) go into a ``LookupIndex`` as they are committed. Each round
``propose`` finds the longest n (``max_ngram`` down to 1) whose last-n-token suffix occurred earlier and proposes
what followed its most recent occurrence, up to ``max_tokens``. A continuation that runs into the suffix itself
(``a b a b a b``) is a repeat with period ``end - match_end`` and is extended periodically, so a loop yields a
full block. Proposals stop after an EOS token. The engine can also keep one index over recent finished outputs
(bounded, oldest evicted) and match a request's suffix there, since users send similar requests.

How far a continuation will be accepted is the request's ``LookupModel`` (``adaflash_hf.acceptance``: from the
match's own evidence, ``support · n / (n + 1)``, then the request's and the caller's labelled continuations); the
drafting policy (``adaflash_hf.policy``) chooses between it and the drafter's block.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

DRAFT_SOURCES = ("auto", "diffusion", "hybrid")  # "auto": "hybrid" wherever a drafter drafts
MAX_NGRAM = 8
PRIOR_STRENGTH = 2.0  # pseudo-rounds behind a match's own prior, before the request's lookup rounds speak
SUPPORT_WINDOW = 64  # most recent occurrences of the n-gram counted for its support


@dataclass(frozen=True)
class LookupProposal:
    tokens: list[int]
    match_length: int  # n: trailing tokens that matched an earlier occurrence
    support: float  # share of the n-gram's recent earlier occurrences followed by tokens[0]


class LookupIndex:
    """Incremental n-gram index over token sequences. A request's own index holds one growing sequence (``extend``,
    then ``propose`` continues its suffix); the engine's history of finished outputs holds many (``add``, at most
    ``max_tokens`` tokens in all, the oldest evicted first; ``propose(..., suffix=)`` continues another sequence)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, max_tokens: int | None = None):
        if not (isinstance(max_ngram, int) and max_ngram >= 1):
            raise ValueError(f"max_ngram: expected an int >= 1, got {max_ngram!r}")
        if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens: expected an int >= 1 or None, got {max_tokens!r}")
        self.max_ngram = max_ngram
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        # n-gram -> (sequence id, exclusive end) of each occurrence, oldest first (so eviction pops from the left)
        self.ends: dict[tuple[int, ...], deque[tuple[int, int]]] = {}
        self.size = 0
        self.ids = itertools.count()

    def __len__(self) -> int:
        return self.size

    def add(self, tokens: Iterable[int]) -> None:
        """Index ``tokens`` as a new sequence, then evict the oldest sequences beyond ``max_tokens``."""
        self.sequences[next(self.ids)] = []
        self.extend(tokens)
        while self.max_tokens is not None and self.size > self.max_tokens:
            self._evict_oldest()

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the newest sequence (the first one if there is none)."""
        if not self.sequences:
            self.sequences[next(self.ids)] = []
        sequence_id = next(reversed(self.sequences))
        sequence, ends, longest = self.sequences[sequence_id], self.ends, self.max_ngram
        for token in tokens:
            sequence.append(int(token))
            end = len(sequence)
            window, entry = tuple(sequence[-longest:]), (sequence_id, end)
            for n in range(1, len(window) + 1):
                occurrences = ends.get(key := window[-n:])
                if occurrences is None:
                    ends[key] = deque((entry,))
                else:
                    occurrences.append(entry)
            self.size += 1

    def _evict_oldest(self) -> None:
        sequence_id, sequence = self.sequences.popitem(last=False)
        self.size -= len(sequence)
        for end in range(1, len(sequence) + 1):
            for n in range(1, min(self.max_ngram, end) + 1):
                key = tuple(sequence[end - n : end])
                occurrences = self.ends[key]
                occurrences.popleft()
                if not occurrences:
                    del self.ends[key]

    def tail(self, n: int) -> list[int]:
        """The newest sequence's last ``n`` tokens."""
        return self.sequences[next(reversed(self.sequences))][-n:] if self.sequences else []

    def propose(
        self, max_tokens: int, eos_ids: Iterable[int] = (), suffix: list[int] | None = None
    ) -> LookupProposal | None:
        """The continuation of the most recent occurrence of the longest matching n-gram of ``suffix`` (default:
        the newest sequence's own suffix, matched earlier in it), or None (no match, or no room)."""
        own = suffix is None
        if own:
            suffix = self.tail(self.max_ngram + 1)
        if max_tokens <= 0:
            return None
        eos = frozenset(eos_ids)
        newest = next(reversed(self.sequences)) if own else None
        for n in range(min(self.max_ngram, len(suffix) - own), 0, -1):
            # Occurrences with a next token: the own suffix's occurrence at the very end has none.
            recent = [
                (i, end)
                for i, end in itertools.islice(
                    reversed(self.ends.get(tuple(suffix[-n:]), ())), SUPPORT_WINDOW + 1
                )
                if end < len(self.sequences[i])
            ][:SUPPORT_WINDOW]
            if not recent:
                continue
            sequence_id, match_end = recent[0]
            sequence = self.sequences[sequence_id]
            period = len(sequence) - match_end if sequence_id == newest else None
            proposal = []
            for j in range(max_tokens):
                if period is None and match_end + j >= len(sequence):
                    break
                proposal.append(sequence[match_end + (j % period if period else j)])
                if proposal[-1] in eos:
                    break
            support = sum(self.sequences[i][end] == proposal[0] for i, end in recent) / len(recent)
            return LookupProposal(tokens=proposal, match_length=n, support=support)
        return None
