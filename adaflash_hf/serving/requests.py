"""Requests of the serving engine: sampling parameters (validated before any forward), per-request state and
the per-step output deltas that are streamed back.

A request's committed sequence is ``prompt + output``. Invariants once prefilled: the target KV holds every
committed token but the newest (the anchor, fed with its drafts in the next verify), so ``target_len`` is the
anchor's position; the drafter KV holds ``drafter_len`` positions and ``pending_context`` the target features of
the positions it lacks, in the chunks the steps gave them, so ``drafter_len + Σ len(chunk) == target_len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adaflash_hf.lookup import LookupIndex
from adaflash_hf.policy import DraftState

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
SEED_RANGE = "-2**63..2**64-1"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. ``temperature == 0`` is greedy, and a positive one tends to greedy as it
    shrinks (any finite positive value is exact: ``filter_logits``); ``top_k == 0`` and ``top_p == 1`` disable
    those filters. ``seed`` fixes the request's own random stream (None: drawn from the engine's seed), so its
    samples do not depend on what else is in the batch. ``eos_token_id`` None uses the target's."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def validate(self, vocab_size: int) -> None:
        def bad(name, expected, actual):
            return ValueError(f"sampling params {name}: expected {expected}, got {actual!r}")

        # Booleans are ints to Python, never a count or a token here.
        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not (is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise bad("max_new_tokens", "an int >= 1", self.max_new_tokens)
        if not (is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise bad("top_k", "an int >= 0 (0 disables)", self.top_k)
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", "a number in (0, 1]", self.top_p)
        if self.seed is not None and not (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"None or an int in {SEED_RANGE}", self.seed)
        eos = self.eos_token_id
        if eos is not None and not (
            is_int(eos) or (isinstance(eos, (tuple, list)) and all(map(is_int, eos)))
        ):
            raise bad("eos_token_id", "None, a token id or a tuple of them", eos)
        for token in self.eos_ids():
            if not 0 <= token < vocab_size:
                raise bad("eos_token_id", f"token ids in 0..{vocab_size - 1}", self.eos_token_id)

    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    generator: torch.Generator
    status: str = WAITING
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    slot: int | None = None
    target_len: int = 0
    drafter_len: int = 0
    # one chunk a step, joined when the request drafts (or every PENDING_CHUNKS chunks, adaflash_hf.serving.engine)
    pending_context: list[torch.Tensor] = field(default_factory=list)
    drafted: int = 0  # verified drafts over the request's life, and how many of them were accepted
    accepted: int = 0
    verify_rounds: int = 0
    drafter_fallbacks: int = 0  # steps whose drafter block was non-finite (k̂ = 0)
    lookup_index: LookupIndex | None = None  # hybrid only: the committed tokens, for lookup proposals
    draft: DraftState | None = None  # drafting memory between steps (adaflash_hf.policy)

    @property
    def anchor(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    @property
    def kv_reservation(self) -> int:
        """Target KV positions this request can ever hold: verified drafts never go past its token budget."""
        return len(self.prompt) + self.params.max_new_tokens

    def commit(self, tokens: list[int]) -> list[int]:
        """Append committed tokens up to EOS or the length budget; returns the ones actually kept."""
        kept = []
        for token in tokens:
            kept.append(token)
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            if len(self.output) + len(kept) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        self.output.extend(kept)
        return kept


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the newly committed tokens, and whether it is done; a final output
    carries the request (the engine has forgotten it)."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    request: Request | None = field(default=None, repr=False, compare=False)


def filter_logits(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k and top-p (joint support, on the tempered distribution) as -inf masks.

    Each row's maximum is subtracted before dividing by the temperature (softmax is shift-invariant), so every
    tempered logit is <= 0 and none overflows to inf; a temperature below the rows' smallest normal number (1e-300,
    5e-324: zero once in float32, and 0/0 is NaN) divides as that number, which leaves only the row's maximum finite,
    the limit as the temperature goes to 0: such a request samples its argmax."""
    temperature = max(params.temperature, torch.finfo(rows.dtype).tiny)
    rows = (rows - rows.amax(dim=-1, keepdim=True)) / temperature
    if params.top_k and params.top_k < rows.shape[-1]:
        kth = rows.topk(params.top_k, dim=-1).values[..., -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = rows.sort(dim=-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        # Keep a token while the mass before it is < top_p: the top token always survives.
        drop = (cumulative - ordered.softmax(-1)) >= params.top_p
        rows = rows.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return rows


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return (
        f"{type(value).__name__} {value!r}"
        if isinstance(value, (str, bool, type(None)))
        else type(value).__name__
    )


def prompt_tokens(prompt_ids) -> list[int]:
    """One prompt's token ids as a list of ints: a 1-D integer tensor or array, a [1, L] tensor, or a sequence of
    ints. Anything else (text, None, booleans, floats, a batch of several prompts, nested lists) is refused, naming
    ``prompt_ids`` and what it got."""
    expected = "token ids: a 1-D integer tensor, a [1, L] tensor or a list of ints"
    if isinstance(prompt_ids, (str, bytes)) or prompt_ids is None:
        raise TypeError(f"prompt_ids: expected {expected} (tokenize text first), got {describe(prompt_ids)}")
    if not isinstance(prompt_ids, torch.Tensor):
        items = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else None
        if items is not None and any(isinstance(t, bool) for t in items):
            raise TypeError(f"prompt_ids: expected {expected}, got a list holding booleans {items[:8]}")
        if items is not None and all(isinstance(t, int) for t in items):
            prompt_ids = torch.tensor(items, dtype=torch.long)
        else:
            try:
                prompt_ids = torch.as_tensor(prompt_ids)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"prompt_ids: expected {expected}, got {describe(prompt_ids)}") from None
    if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or prompt_ids.is_complex():
        raise TypeError(f"prompt_ids: expected {expected}, got {describe(prompt_ids)}")
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
        raise ValueError(
            f"prompt_ids: expected one prompt, got a batch of shape {list(prompt_ids.shape)}; add each row as its own "
            "request (or pass them all to generate)"
        )
    if prompt_ids.dim() > 2:
        raise ValueError(f"prompt_ids: expected one prompt, got {describe(prompt_ids)}")
    prompt = prompt_ids.reshape(-1).tolist()
    if not prompt:
        raise ValueError("prompt_ids: expected at least one token, got an empty prompt")
    return prompt
