"""AdaFlashEngine: continuous batching with per-request draft lengths, on one Hugging Face target.

    engine = AdaFlashEngine(target, drafter)             # AdaFlashEngine(target): plain decoding
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
    for out in engine.stream():          # or: while engine.has_unfinished(): engine.step()
        print(out.request_id, out.new_tokens)

One ``step()``: admit waiting requests (``admission``); the drafting policy (``adaflash_hf.policy``) says who runs
the drafter; ONE batched drafter forward over them (each its new committed context + its block); the policy gives
each request its source and length, within the step's token budget; ONE packed target forward
over Σ(k_i + 1) verify tokens plus the prompts of newly admitted requests (``cache``); ONE acceptance launch
(``verify_accept``) for greedy and sampling requests together; per-request commit and rollback. Without a drafter
every k_i is 0; ``length_mode="fixed"`` is DFlash; every mode shares every other line.

Knobs come as one ``DraftingSettings`` (``drafting=``), six of them also as keyword arguments. ``length_mode="auto"``
(the default) is resolved per step by ``length_mode_for``: goodput where every decoding request is greedy, the
adaptive rule while any samples (a seeded sampling request's output then depends on its seed alone). Under
goodput a step's drafts are planned so that no request ends more than ``max_slowdown`` (3%) and one plain step later
than plain steps, as this engine measures them, would have ended it (``GoodputPolicy.settle``: each request's slack).
``draft_source="hybrid"`` (what the default ``"auto"`` is with a drafter): each request also keeps a ``LookupIndex`` of its committed tokens and verifies either its
block or its lookup continuation; a request that skips the drafter keeps its new context in ``pending_context``
until its next block. ``lookup_history_tokens=N`` also indexes the outputs of finished requests (at most N tokens,
the oldest evicted): a request takes the longer of its own match and its match there.

Lossless: greedy requests commit exactly the target's argmax chain; sampling requests use speculative sampling
with one-hot proposals (the drafter's argmax) and uniforms from their own generator, so each request's output
is distributed as the target's and does not depend on the rest of the batch. A non-finite drafter block verifies
no drafts that step (counted in the step stats and the request's ``drafter_fallbacks``, warned once per request).

``abort(request_id)`` ends a request between steps; the next ``step()`` yields its final output, with no new tokens
and ``finish_reason="abort"``, so a client sees one final event per request.

The engine keeps nothing a long run would pile up: ``engine.requests`` holds the unfinished requests (aborted ones
until their final output), and a request leaves it when ``step()`` yields its final output, which carries it
(``output.request``: its tokens, ``finish_reason`` and drafting counts); ``generate`` returns the outputs itself.
``engine.stats`` keeps the ``StepStats`` of the last ``STEP_WINDOW`` steps, ``engine.step_count`` counts them all.

Online learning: ``engine.round_recorder`` (a callable) receives ``(request, RoundRecord)`` after each verify round,
once the request's state is updated (``finish_reason`` is set on its last round): the anchor position, k, the
accepted count, ``drafter.weights_version``, the verified block's â (NaN where no block was verified) and the k
verified drafts, or every block row's proposal with ``engine.record_full_drafts`` (an lm_head row each).
"""

from __future__ import annotations

import itertools
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers.utils import logging

from adaflash_hf.acceptance import LookupModel
from adaflash_hf.draft_vocab import block_confidences, draft_tokens
from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.lookup import LookupIndex
from adaflash_hf.policy import (
    Block,
    Choice,
    DraftingPolicy,
    PlainPolicy,
    Round,
    Slot,
    Step,
    policy_for,
    truncate_lookup_gains,
)
from adaflash_hf.prepared.linear import fast_linears
from adaflash_hf.serving.admission import AdmissionConfig, AdmissionController, with_kv_budget
from adaflash_hf.serving.cache import (
    DrafterBatch,
    DrafterSlotCache,
    RaggedBatch,
    SlotKVStore,
    packed_target_forward,
)
from adaflash_hf.serving.requests import (
    FINISHED,
    RUNNING,
    WAITING,
    Request,
    RequestOutput,
    SamplingParams,
    describe,
    filter_logits,
    prompt_tokens,
)
from adaflash_hf.stats import RoundRecord, StepStats

logger = logging.get_logger(__name__)

MODES = ("plain", "dflash", "adaflash")
# The StepStats kept in ``engine.stats``: about 3.4 MB of them, so a server's memory stays flat however long it runs.
STEP_WINDOW = 4096
# Chunks of a request's pending drafter context joined into one: each chunk is a view that keeps its step's whole
# feature tensor alive, so a request that seldom drafts holds at most this many steps' tensors
PENDING_CHUNKS = 16


def _check_engine_target(target):
    """The target's text config, once it is known to fit the engine's full-attention KV pool."""
    text_config = target.config.get_text_config()
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        raise ValueError(
            f"target sliding_window: expected None (the engine's KV pool is full attention), got "
            f"{text_config.sliding_window}"
        )
    return text_config


def _drafting_settings(drafting: DraftingSettings | None, **knobs) -> DraftingSettings:
    """The engine's ``DraftingSettings``: ``drafting``, or built from the keyword knobs (not both)."""
    given = {name: value for name, value in knobs.items() if value is not None}
    if drafting is not None and given:
        raise ValueError(
            f"drafting: expected a DraftingSettings or its fields as keyword arguments, got both (drafting and "
            f"{sorted(given)})"
        )
    if drafting is not None and not isinstance(drafting, DraftingSettings):
        raise TypeError(f"drafting: expected a DraftingSettings, got {type(drafting).__name__}")
    return drafting or DraftingSettings(**given)


def _legacy_mode(mode: str | None, drafter, settings: DraftingSettings):
    """``mode=`` of earlier releases, mapped onto (drafter, settings) with a warning that says what to write."""
    if mode is None:
        return drafter, settings
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES} (deprecated: leave it out), got {mode!r}")
    if mode == "dflash" and settings.length_mode in ("goodput", "adaptive"):
        raise ValueError(
            f"length_mode: expected 'fixed', 'auto' or unset with mode='dflash', got {settings.length_mode!r}"
        )
    instead = {
        "plain": "AdaFlashEngine(target) (no drafter: plain decoding)",
        "dflash": "AdaFlashEngine(target, drafter, length_mode='fixed')",
        "adaflash": "AdaFlashEngine(target, drafter)",
    }[mode]
    warnings.warn(
        f"AdaFlashEngine(mode={mode!r}) is deprecated; write {instead}", FutureWarning, stacklevel=3
    )
    if mode == "plain":
        return None, settings
    if drafter is None:
        raise ValueError(f"drafter: expected an AdaFlashDrafter for mode={mode!r}, got None")
    return drafter, replace(settings, length_mode="fixed") if mode == "dflash" else settings


def _resolve_drafter(drafter):
    """The drafter itself, or the one at a checkpoint folder / Hub repo id; refuse anything else, before any forward."""
    if isinstance(drafter, (str, os.PathLike)):
        from adaflash_hf.interop import load_drafter

        return load_drafter(drafter)
    if drafter is not None and not callable(getattr(drafter, "check_target", None)):
        # Duck-typed: a PEFT-wrapped drafter (OPD's LoRA) forwards check_target to its AdaFlashDrafter.
        raise TypeError(
            f"drafter: expected an AdaFlashDrafter (or a model wrapping one) or a checkpoint folder / Hub repo id, "
            f"got {type(drafter).__name__}"
        )
    return drafter


@dataclass
class _Drafted:
    """A step's drafting: its round, per decoding request its choice, its row in the block states (None: no block
    verified), its lookup drafts (None: not a lookup round), whether it ran the drafter; the block states."""

    round: Round
    choices: list[Choice]
    rows: list[int | None]
    lookups: list[list[int] | None]
    ran: list[bool]
    states: torch.Tensor | None = None
    fallbacks: int = 0


class AdaFlashEngine:
    """Batched speculative decoding engine. See the module docstring."""

    def __init__(
        self,
        target,
        drafter=None,
        mode: str | None = None,
        admission: AdmissionConfig | None = None,
        gamma: float | None = None,
        min_len: int | None = None,
        seed: int = 0,
        draft_source: str | None = None,
        lookup_history_tokens: int | None = None,
        lookup_min_prob: float | None = None,
        length_mode: str | None = None,
        drafting: DraftingSettings | None = None,
    ):
        settings = _drafting_settings(
            drafting,
            gamma=gamma,
            min_len=min_len,
            draft_source=draft_source,
            lookup_history_tokens=lookup_history_tokens,
            lookup_min_prob=lookup_min_prob,
            length_mode=length_mode,
        )
        drafter, settings = _legacy_mode(mode, drafter, settings)
        if drafter is None and settings.length_mode != "auto":
            raise ValueError(
                f"drafter: expected an AdaFlashDrafter for length_mode={settings.length_mode!r} (without one the "
                "engine decodes plainly), got None"
            )
        if drafter is None and settings.draft_source == "hybrid":
            raise ValueError(
                "draft_source: expected 'auto' or 'diffusion' without a drafter (hybrid compares against a drafter), "
                "got 'hybrid'"
            )
        drafter = _resolve_drafter(drafter)
        text_config = _check_engine_target(target)
        self.drafter = drafter
        if drafter is not None:
            drafter.align_dtype(target)
            drafter.check_target(target)
            fast_linears(drafter)
        self.target = target
        # γ and min_len resolved against the drafter now, before any request or forward.
        self.settings = settings.resolve(drafter.config) if drafter is not None else settings
        self.draft_source = self.settings.draft_source
        self.lookup_history = (
            None
            if self.settings.lookup_history_tokens is None
            else LookupIndex(max_tokens=self.settings.lookup_history_tokens)
        )
        self.block_size = drafter.config.block_size if drafter is not None else 16
        self.admission = AdmissionController(with_kv_budget(admission, target, drafter), self.block_size)
        self.lookups = LookupModel(strength=2.0)  # the parent of every request's own lookup model
        self.policies = self._policies()
        # New requests' drafting state comes from goodput's policy where a step may draft by goodput (its greedy
        # requests then label every proposal), so each step can pick its policy.
        self.state_policy = self.policies.get("goodput") or next(iter(self.policies.values()))
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(text_config, "max_position_embeddings", None) or 1 << 62
        eos = target.generation_config.eos_token_id
        self.default_eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        self.target_store = SlotKVStore(text_config.num_hidden_layers)
        self.drafter_store = SlotKVStore(drafter.config.num_hidden_layers) if drafter is not None else None
        self.seeds = torch.Generator().manual_seed(seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished, until step() yields the final output
        self.aborted: list[RequestOutput] = []  # final outputs of aborted requests, yielded by the next step
        self.stats: deque[StepStats] = deque(maxlen=STEP_WINDOW)
        self.step_count = 0
        self.round_recorder = None
        self.record_full_drafts = False
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.ids = itertools.count()

    def _policies(self) -> dict[str, DraftingPolicy]:
        """The drafting policy of every length mode a step can resolve to (``length_mode_for``: "auto" is goodput
        in the steps where no decoding request samples and the adaptive rule in the others)."""
        if self.drafter is None:
            return {"plain": PlainPolicy(self.settings, self.block_size)}
        modes = dict.fromkeys(self.settings.length_mode_for(sampling) for sampling in (False, True))
        return {m: policy_for(m, self.settings, self.target, self.drafter, "engine") for m in modes}

    def _policy(self, decoding: list[Request]) -> DraftingPolicy:
        if self.drafter is None:
            return self.policies["plain"]
        sampling = any(r.params.temperature > 0 for r in decoding)
        return self.policies[self.settings.length_mode_for(sampling)]

    @property
    def cost(self):
        """The goodput policy's cost model (None where no step drafts by goodput)."""
        return getattr(self.policies.get("goodput"), "cost", None)

    @property
    def mode(self) -> str:
        """``"plain"`` (no drafter), ``"dflash"`` (fixed length) or ``"adaflash"``: what the engine runs."""
        if self.drafter is None:
            return "plain"
        return "dflash" if self.settings.length_mode == "fixed" else "adaflash"

    # ------------------------------------------------------------------------------------------- requests
    def add_request(
        self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; everything about it is validated here, before any forward pass."""
        request = self._new_request(prompt_ids, params, request_id)
        self._queue(request)
        return request.request_id

    def _queue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _new_request(self, prompt_ids, params: SamplingParams | None, request_id: str | None) -> Request:
        """A request built and validated, not yet queued."""
        params = params or SamplingParams()
        self._check_params(params)
        prompt = prompt_tokens(prompt_ids)
        invalid = [t for t in prompt if not 0 <= t < self.vocab_size]
        if invalid:
            raise ValueError(
                f"prompt_ids: expected token ids in 0..{self.vocab_size - 1}, got out-of-range ids {invalid[:8]}"
            )
        if len(prompt) + params.max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt length + max_new_tokens: expected <= the target's max_position_embeddings="
                f"{self.max_positions}, got {len(prompt)} + {params.max_new_tokens}"
            )
        request_id = f"req-{next(self.ids)}" if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id: expected a new id, got {request_id!r} (already used)")
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self.seeds))
        )
        request = Request(
            request_id=request_id,
            prompt=prompt,
            params=params,
            eos_ids=frozenset(params.eos_ids() or self.default_eos),
            generator=torch.Generator().manual_seed(seed),
        )
        request.draft = self.state_policy.new_state(self.lookups, greedy=params.temperature == 0)
        if self.draft_source == "hybrid":
            request.lookup_index = LookupIndex()
            request.lookup_index.extend(prompt)
        self.admission.check_request(request)
        return request

    def _check_params(self, params) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)

    def abort(self, request_id: str) -> bool:
        """Stop a request now (between steps); returns False if it had already ended and its final output is still
        to come. A request whose final output was yielded is no longer the engine's: its id is refused."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(
                f"request_id: expected one added to this engine whose final output is still to come, got {request_id!r}"
            )
        if request.status == FINISHED:
            return False
        if request.status == WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.finish_reason = "abort"
        self._release(request)
        self.aborted.append(RequestOutput(request_id, [], True, "abort", request))
        return True

    def has_unfinished(self) -> bool:
        """Requests still waiting or running, or aborted ones whose final output ``step()`` has not yielded."""
        return bool(self.waiting or self.running or self.aborted)

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request is done, yielding each step's per-request deltas."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Run ``prompts`` (a list of prompts, or a [N, L] tensor of N) to completion; returns each request's
        generated token ids, in order. ``params``: one SamplingParams for all, or one per prompt. Every prompt and
        every params entry is validated before any is queued, so one bad entry queues nothing."""
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
            prompts = list(prompts)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(f"prompts: expected a non-empty list of prompts, got {describe(prompts)}")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise TypeError(
                f"prompts: expected a list of prompts (each a list of token ids), got one flat list of {len(prompts)} "
                "ints; pass [prompt] for a single prompt"
            )
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(
                    f"params: expected one SamplingParams per prompt ({len(prompts)}), got {len(params)}"
                )
            params_list = list(params)
        else:
            params_list = [params] * len(prompts)
        for i, params_i in enumerate(params_list if isinstance(params, (list, tuple)) else []):
            try:
                self._check_params(params_i)
            except (TypeError, ValueError) as error:
                raise type(error)(f"params[{i}]: {error}") from None
        requests = []
        for i, (prompt, params_i) in enumerate(zip(prompts, params_list)):
            try:
                requests.append(self._new_request(prompt, params_i, None))
            except (TypeError, ValueError) as error:
                raise type(error)(f"prompts[{i}]: {error}") from None
        for request in requests:
            self._queue(request)
        finished = {o.request_id: o.request for o in self.stream() if o.finished}
        return [finished[r.request_id].output for r in requests]

    def _release(self, request: Request) -> None:
        if self.lookup_history is not None and request.finish_reason != "abort" and request.output:
            self.lookup_history.add(request.output)
        request.status = FINISHED
        request.pending_context = []
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None

    def _assign_slot(self, request: Request) -> None:
        if self.free_slots:
            request.slot = self.free_slots.pop()
        else:
            request.slot, self.next_slot = self.next_slot, self.next_slot + 1
        for store in (self.target_store, self.drafter_store):
            if store is not None:
                store.reserve(self.next_slot, request.kv_reservation + self.block_size)
                store.clear_slot(request.slot)

    # ----------------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        aborted, self.aborted = self.aborted, []
        admitted = self.admission.admit(self.waiting, self.running)
        for request in admitted:
            self.waiting.popleft()
            request.status = RUNNING
            self._assign_slot(request)
        decoding = list(self.running)
        if not decoding and not admitted:
            return self._forget(aborted)
        self.running.extend(admitted)
        prefill_tokens = sum(len(r.prompt) for r in admitted)
        gamma = (self.settings.gamma or 1.0) * self.admission.gamma_scale()
        budget = self.admission.config.token_budget
        shape = Step(len(decoding) + len(admitted), prefill_tokens, budget, gamma)
        policy = self._policy(decoding)
        drafted = self._draft(policy, decoding, shape)
        drafter_seconds = time.perf_counter() - started
        choices = drafted.choices
        lengths = [c.length for c in choices]
        full = self.record_full_drafts and self.round_recorder is not None
        drafts, full_drafts = self._propose(drafted.states, drafted.rows, drafted.lookups, lengths, full)
        sources = ["diffusion" if lookup is None else "lookup" for lookup in drafted.lookups]
        # â of the blocks this step verifies (for the round recorder); NaN where no block of this step is verified.
        heads = [
            r.draft.last_acceptance if row is not None else math.nan for r, row in zip(decoding, drafted.rows)
        ]

        target_started = time.perf_counter()
        accepted, next_tokens, features = self._verify(admitted, decoding, drafts)
        target_seconds = time.perf_counter() - target_started
        policy.observe_step(len(decoding) + sum(lengths), shape, target_seconds)
        policy.learn(drafted.round, choices, accepted[len(admitted) :])

        outputs, committed = self._commit(
            admitted, decoding, drafts, accepted, next_tokens, features, full_drafts, sources, heads
        )
        if decoding:
            seconds = time.perf_counter() - started
            policy.judge_step(
                any(drafted.ran), committed, len(decoding), shape, seconds, target_seconds, sum(lengths)
            )
            kept = [len(output.new_tokens) for output in outputs[len(admitted) :]]
            policy.settle(drafted.round, kept, shape, seconds)
        self.running = [r for r in self.running if r.status == RUNNING]
        self.admission.update(len(decoding) + len(admitted), sum(lengths) + len(lengths), len(lengths))
        timings = (started, drafter_seconds, target_seconds)
        self._record_step(
            admitted, decoding, drafted, lengths, accepted[len(admitted) :], committed, gamma, timings
        )
        return self._forget(aborted + outputs)

    def _forget(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs``, once every request they finish has left ``requests`` (each final output carries its own)."""
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    def _record_step(self, admitted, decoding, drafted, lengths, verified, committed, gamma, timings) -> None:
        started, drafter_seconds, target_seconds = timings
        sources = ["diffusion" if lookup is None else "lookup" for lookup in drafted.lookups]
        self.stats.append(
            StepStats(
                step=self.step_count,
                running=len(decoding) + len(admitted),
                waiting=len(self.waiting),
                admitted=len(admitted),
                kv_reserved=sum(r.kv_reservation for r in decoding + admitted),
                prefill_tokens=sum(len(r.prompt) for r in admitted),
                draft_tokens=sum(lengths),
                verify_tokens=sum(lengths) + len(lengths),
                accepted=sum(verified),
                committed=committed,
                verifies=len(decoding),
                gamma=gamma,
                ema_running=self.admission.ema_running,
                drafter_fallbacks=drafted.fallbacks,
                drafter_seconds=drafter_seconds,
                target_seconds=target_seconds,
                seconds=time.perf_counter() - started,
                lookup_verifies=sources.count("lookup"),
                lookup_accepted=sum(a for a, s in zip(verified, sources) if s == "lookup"),
                skipped_drafter=drafted.ran.count(False) if self.drafter is not None else 0,
                zero_length_verifies=lengths.count(0),
            )
        )
        self.step_count += 1

    def _draft(self, policy: DraftingPolicy, decoding: list[Request], shape: Step) -> _Drafted:
        """The step's drafting: ``policy.start`` says who runs the drafter; ONE batched drafter forward over them
        (with the confidences the policy reads); ``policy.choose`` gives each request its source and length."""
        count = len(decoding)
        # The bonus token needs one slot of the request's budget, so at most remaining - 1 drafts.
        room = [min(self.block_size - 1, r.remaining - 1) for r in decoding]
        proposals, gains = self._lookup_proposals(decoding, room)
        slots = [
            Slot(r.draft, room[i], proposals[i], len(r.prompt) + len(r.output), gains[i])
            for i, r in enumerate(decoding)
        ]
        round_ = policy.start(slots, shape)
        drafting = [i for i, runs in enumerate(round_.drafts) if runs]
        blocks, states, fallbacks = [None] * count, None, 0
        rows: list[int | None] = [None] * count
        if drafting:
            tick = time.perf_counter()
            states, finite = self._drafter_forward([decoding[i] for i in drafting])
            heads = [decoding[i].draft.last_acceptance for i in drafting]
            confidences, tokens = self._confidences(policy, states, [room[i] for i in drafting], heads)
            policy.observe_drafter(len(drafting), time.perf_counter() - tick)
            for row, i in enumerate(drafting):
                if not finite[row]:
                    self._count_fallback(decoding[i])
                    fallbacks += 1
                blocks[i] = Block(heads[row], finite[row], tuple(confidences[row]), tuple(tokens[row]))
                rows[i] = row
        choices = policy.choose(round_, blocks)
        lookups: list[list[int] | None] = [None] * count
        for i, choice in enumerate(choices):
            if choice.source == "lookup":
                lookups[i], rows[i] = proposals[i].tokens[: choice.length], None
        ran = [b is not None for b in blocks]
        return _Drafted(round_, choices, rows, lookups, ran, states, fallbacks)

    def _confidences(self, policy: DraftingPolicy, states, rooms: list[int], heads: list[float]):
        """Per block, the proposals and confidences of the rows the policy reads: its first rows of every block,
        then the further rows it reads given those (one projection each)."""
        lm_head, token_ids = self.target.get_output_embeddings(), self.drafter.draft_token_ids
        confidences, tokens = [[] for _ in rooms], [[] for _ in rooms]
        for _ in range(2):
            spans = [(len(c), policy.confidence_rows(n, c, h)) for c, n, h in zip(confidences, rooms, heads)]
            more, more_tokens = block_confidences(states, spans, lm_head, token_ids)
            confidences = [c + m for c, m in zip(confidences, more)]
            tokens = [t + m for t, m in zip(tokens, more_tokens)]
        return confidences, tokens

    def _lookup_proposals(self, decoding: list[Request], room: list[int]) -> tuple[list, list]:
        """Each request's lookup continuation (hybrid; None elsewhere): the longer match of its own tokens and the
        shared history, cut by ``lookup_min_prob``; and its gains (its lookup model's, read once a step)."""
        proposals, gains = [None] * len(decoding), [[] for _ in decoding]
        if self.draft_source != "hybrid":
            return proposals, gains
        for i, r in enumerate(decoding):
            proposals[i] = r.lookup_index.propose(room[i], r.eos_ids)
            if self.lookup_history is not None:
                suffix = r.lookup_index.tail(self.lookup_history.max_ngram)
                shared = self.lookup_history.propose(room[i], r.eos_ids, suffix=suffix)
                if shared is not None and (
                    proposals[i] is None or shared.match_length > proposals[i].match_length
                ):
                    proposals[i] = shared
            proposals[i], gains[i] = truncate_lookup_gains(
                proposals[i], r.draft.lookups, self.settings.lookup_min_prob
            )
        return proposals, gains

    def _count_fallback(self, request: Request) -> None:
        request.drafter_fallbacks += 1
        if request.drafter_fallbacks == 1:
            logger.warning(
                f"{request.request_id}: non-finite drafter block, verifying no block drafts in such steps "
                "(output unchanged; counted in StepStats.drafter_fallbacks and the request's "
                "drafter_fallbacks; warned once per request)"
            )

    def _drafter_forward(self, decoding: list[Request]):
        """One batched drafter forward over ``decoding``: the block states and finite flags; sets each request's
        ``last_acceptance`` (â; 0 for a non-finite block)."""
        drafter = self.drafter
        device = next(drafter.parameters()).device
        lengths = [sum(chunk.shape[0] for chunk in r.pending_context) for r in decoding]
        batch = DrafterBatch.build(
            [r.slot for r in decoding], [r.drafter_len for r in decoding], lengths, self.block_size, device
        )
        first = decoding[0].pending_context[0]
        context = first.new_zeros(len(decoding), max(lengths), first.shape[-1])
        for row, request in enumerate(decoding):
            offset = 0
            for chunk in request.pending_context:
                context[row, offset : offset + chunk.shape[0]] = chunk
                offset += chunk.shape[0]
        anchors = torch.tensor([r.anchor for r in decoding], device=device)
        noise = drafter.block_embeds(self.target.get_input_embeddings().weight, anchors).to(device)
        out = drafter(
            noise_embeds=noise,
            context_hidden_states=context.to(device=device, dtype=noise.dtype),
            attention_mask=batch.mask,
            position_ids=batch.position_ids,
            cache=DrafterSlotCache(self.drafter_store, batch),
        )
        states = out.last_hidden_state
        finite = (
            torch.isfinite(states).flatten(1).all(1) & torch.isfinite(out.acceptance_prob.float())
        ).tolist()
        for request, length, acceptance, ok in zip(
            decoding, lengths, out.acceptance_prob.float().tolist(), finite
        ):
            request.drafter_len += length
            request.pending_context = []
            request.draft.last_acceptance = acceptance if ok else 0.0
        return states, finite

    def _propose(
        self, block_states, rows, lookups, lengths: list[int], full: bool = False
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Per request, the first ``lengths[i]`` lookup tokens, or the argmax proposals of its block rows 1..k̂_i
        through the target's lm_head (its ``draft_token_ids`` rows when the drafter has them), on the verified rows
        only; with ``full`` also every block row 1..block_size-1 (returned second, None otherwise; its first k̂_i are
        the drafts; a lookup round's entry is its drafts)."""
        drafts = [[] if t is None else list(t[:n]) for t, n in zip(lookups, lengths)]
        widths = [0 if row is None else (self.block_size - 1 if full else n) for row, n in zip(rows, lengths)]
        if block_states is None or not sum(widths):
            return drafts, ([list(d) for d in drafts] if full else None)
        hidden = torch.cat([block_states[row, 1 : 1 + w] for row, w in zip(rows, widths) if w])
        lm_head = self.target.get_output_embeddings()
        tokens = draft_tokens(hidden, lm_head, self.drafter.draft_token_ids).tolist()
        proposals, offset = [list(d) for d in drafts], 0
        for i, w in enumerate(widths):
            if w:
                proposals[i] = tokens[offset : offset + w]
                drafts[i] = proposals[i][: lengths[i]]
                offset += w
        return drafts, (proposals if full else None)

    def _verify(self, admitted: list[Request], decoding: list[Request], drafts: list[list[int]]):
        """The packed target forward and the acceptance launch. Order: prefills, then verifies."""
        device = self.target.get_input_embeddings().weight.device
        pieces = [r.prompt for r in admitted] + [[r.anchor, *d] for r, d in zip(decoding, drafts)]
        starts = [0] * len(admitted) + [r.target_len for r in decoding]
        lengths = [len(p) for p in pieces]
        requests = admitted + decoding
        batch = RaggedBatch.build(
            self.target_store, [r.slot for r in requests], starts, lengths, self.block_size, device
        )
        # Logits rows: a prefill's last token; every row of a verify (k̂ drafts + the bonus row).
        keep, offset = [], 0
        for i, n in enumerate(lengths):
            keep.extend([offset + n - 1] if i < len(admitted) else range(offset, offset + n))
            offset += n
        kwargs = {}
        if self.drafter is not None:
            kwargs["output_hidden_states"] = self.drafter.config.target_hidden_state_ids
        out = packed_target_forward(
            self.target,
            torch.tensor([list(itertools.chain.from_iterable(pieces))], device=device),
            batch,
            logits_to_keep=torch.tensor(keep, device=device),
            **kwargs,
        )
        features = None
        if self.drafter is not None:
            features = self.drafter.context_features(out.hidden_states)[0]

        logits = out.logits[0].float()
        row_counts = [1] * len(admitted) + [len(d) + 1 for d in drafts]
        cu = torch.tensor([0, *itertools.accumulate(row_counts)], device=device)
        if any(r.params.temperature > 0 for r in requests):
            temperatures, accept_u, sample_u = [], [], []
            for request, rows, start in zip(requests, row_counts, cu.tolist()):
                params = request.params
                if params.temperature > 0:
                    logits[start : start + rows] = filter_logits(logits[start : start + rows], params)
                    accept_u.append(torch.rand(rows - 1, generator=request.generator))
                    sample_u.append(torch.rand(1, generator=request.generator))
                else:
                    accept_u.append(torch.zeros(rows - 1))
                    sample_u.append(torch.zeros(1))
                # Filtered rows are already tempered: the acceptance rule then samples at temperature 1.
                temperatures.append(1.0 if params.temperature > 0 else 0.0)
            temperatures = torch.tensor(temperatures, device=device)
            accept_u, sample_u = torch.cat(accept_u).to(device), torch.cat(sample_u).to(device)
        else:  # every request greedy: no uniforms drawn (none is read)
            temperatures = torch.zeros(len(requests), device=device)
            accept_u = torch.zeros(sum(row_counts) - len(requests), device=device)
            sample_u = torch.zeros(len(requests), device=device)
        result = verify_accept(
            logits,
            torch.tensor(list(itertools.chain.from_iterable(drafts)), dtype=torch.long, device=device),
            cu,
            temperatures,
            accept_uniforms=accept_u,
            sample_uniforms=sample_u,
        )
        return result.accepted.tolist(), result.next_tokens.tolist(), (features, lengths)

    def _commit(
        self, admitted, decoding, drafts, accepted, next_tokens, features, full_drafts, sources, heads
    ):
        """Commit accepted drafts + the next token per request, roll back the rest, queue drafter context."""
        hidden, lengths = features
        outputs, committed, offset = [], 0, 0
        prefills = len(admitted)
        version = int(getattr(self.drafter, "weights_version", 0))
        for i, request in enumerate(admitted + decoding):
            n_accepted = accepted[i]
            proposed = drafts[i - prefills] if i >= prefills else []
            anchor_position, anchor_token = request.target_len, request.output[-1] if request.output else None
            kept = request.commit([*proposed[:n_accepted], next_tokens[i]])
            # Inputs whose K/V stay cached: the whole prompt, or the anchor and the accepted drafts.
            cached = lengths[i] if i < prefills else n_accepted + 1
            request.target_len += cached
            if hidden is not None:
                # Appended: a request that skipped the drafter this step still owes it the older positions.
                pending = request.pending_context
                pending.append(hidden[offset : offset + cached])
                if len(pending) >= PENDING_CHUNKS:
                    request.pending_context = [torch.cat(pending)]
            if request.lookup_index is not None:
                request.lookup_index.extend(kept)
            source = sources[i - prefills] if i >= prefills else None
            if i >= prefills:
                committed += len(kept)
                request.drafted += len(proposed)
                request.accepted += n_accepted
                request.verify_rounds += 1
                request.draft.observe_committed(request.output, len(request.prompt))
            offset += lengths[i]
            if request.finish_reason is not None:
                self._release(request)
            if i >= prefills and self.round_recorder is not None:
                record = RoundRecord(
                    context_length=anchor_position,
                    anchor_token=anchor_token,
                    drafted_tokens=list(full_drafts[i - prefills] if full_drafts else proposed),
                    draft_length=len(proposed),
                    predicted_acceptance=heads[i - prefills],
                    accepted=n_accepted,
                    drafter_version=version,
                    source=source,
                )
                self.round_recorder(request, record)
            finished = request.status == FINISHED
            outputs.append(
                RequestOutput(
                    request.request_id, kept, finished, request.finish_reason, request if finished else None
                )
            )
        return outputs, committed
