"""AdaFlashEngine: continuous batching with per-request adaptive draft lengths, on one Hugging Face target.

    engine = AdaFlashEngine(target, drafter, mode="adaflash")
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
    for out in engine.stream():          # or: while engine.has_unfinished(): engine.step()
        print(out.request_id, out.new_tokens)

One ``step()``: admit waiting requests (``admission``); ONE batched drafter forward over every running request
(its new committed context + its block); the length head gives each request its own k̂_i (``"adaflash"``), or
k̂ = block_size - 1 (``"dflash"``), or no drafter at all (``"plain"``); the drafts are trimmed to the step's token
budget; ONE packed target forward over Σ(k̂_i + 1) verify tokens plus the prompts of newly admitted requests
(``cache``); ONE acceptance launch (``verify_accept``) for greedy and sampling requests together; per-request
commit and rollback. The three modes share every other line, so they are each other's baselines.

``length_mode="auto"`` (the default) drafts by goodput in the steps where every decoding request is greedy and by
the adaptive rule while any samples (a seeded sampling request's output then depends on its seed alone).
``length_mode="goodput"`` (with ``mode="adaflash"``; ``adaflash_hf.drafting``): the drafter runs only for the
requests whose ``SkipGate`` is open, and one plan over every request's options (its block, its lookup continuation)
picks each k_i from 0 up to maximise the step's expected committed tokens per second, from the engine's cost model
(seconds of the packed forward by its tokens and running requests, calibrated once and learnt from the steps) and
the acceptance model. Knobs come as one ``DraftingSettings`` (``drafting=``) or its fields as keyword arguments.

``draft_source="hybrid"`` (a drafter mode): each request also keeps a ``LookupIndex`` of its committed tokens, and
per step verifies either its block or its lookup continuation, whichever ``choose_lookup`` expects to keep more
tokens. A request whose lookup proposal already beats its last â skips the drafter forward this step; its new
context waits in ``pending_context`` until its next block. Lookup proposals are one-hot, like the drafter's argmax.
With ``lookup_history_tokens=N`` the engine also indexes the outputs of finished requests (at most N tokens, the
oldest evicted) and a request takes the longer of its own match and its match there. ``lookup_min_prob=p`` cuts each
lookup continuation to the tokens whose estimated chance of being reached and accepted is at least p
(``lookup.truncate_lookup``; default 0, the whole continuation).

Lossless: greedy requests commit exactly the target's argmax chain; sampling requests use speculative sampling
with one-hot proposals (the drafter's argmax) and uniforms from their own generator, so each request's output
is distributed as the target's and does not depend on the rest of the batch. A drafter block with a non-finite
state gives that request k̂ = 0 for the step (plain decoding), counted in the step stats and the request's
``drafter_fallbacks`` and warned about once per request.

``abort(request_id)`` ends a request between steps; the next ``step()`` (and so ``stream()``) yields its final
output, with no new tokens and ``finish_reason="abort"``, so a client sees one final event per request.

Online learning: ``engine.round_recorder`` (a callable, default None) receives ``(request, RoundRecord)`` after each
verify round, once the request's state is updated (``request.finish_reason`` is set on its last round). The record
carries the anchor position, k̂, the accepted count and ``drafter.weights_version``; ``drafted_tokens`` holds only
the k̂ verified drafts (the other block rows never go through the lm_head) unless ``engine.record_full_drafts`` is
set, which projects every block row for the recorder (evaluation: how far the whole draft would have been accepted;
it costs an lm_head row per unverified draft). ``predicted_acceptance`` is the length head's â of the verified block
(NaN in a round that verified a lookup continuation or no block).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers.utils import logging

from adaflash_hf.acceptance import LookupModel, ShadowLabels, acceptance_model_for
from adaflash_hf.cost_model import calibrate_target, cost_model_for
from adaflash_hf.draft_vocab import draft_logits, draft_tokens
from adaflash_hf.drafting import (
    CONFIDENCE_ROWS,
    REACH_FOR_MORE_ROWS,
    DraftingSettings,
    SkipGate,
    draft_surplus,
    plan_round,
)
from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.lookup import LookupIndex, choose_lookup, truncate_lookup
from adaflash_hf.serving.admission import AdmissionConfig, AdmissionController, default_kv_budget
from adaflash_hf.serving.cache import (
    DrafterBatch,
    DrafterSlotCache,
    RaggedBatch,
    SlotKVStore,
    packed_target_forward,
)
from adaflash_hf.serving.requests import FINISHED, RUNNING, WAITING, Request, RequestOutput, SamplingParams
from adaflash_hf.stats import RoundRecord, tau_of

logger = logging.get_logger(__name__)

MODES = ("plain", "dflash", "adaflash")


@dataclass
class StepStats:
    step: int
    running: int  # requests in the target forward (prefills + verifies)
    waiting: int  # still queued after admission
    admitted: int
    kv_reserved: int  # target KV positions reserved by the requests in this step
    prefill_tokens: int
    draft_tokens: int  # Σ k̂_i over verifying requests
    verify_tokens: int  # Σ (k̂_i + 1)
    accepted: int  # accepted drafts
    committed: int  # tokens committed by verifies (accepted + 1 each, cut at EOS / length)
    verifies: int
    gamma: float
    ema_running: float
    drafter_fallbacks: int  # requests whose drafter block was non-finite: k̂ = 0
    drafter_seconds: float
    target_seconds: float
    seconds: float
    lookup_verifies: int = 0  # verifying requests whose drafts came from lookup (hybrid)
    lookup_accepted: int = 0  # accepted lookup drafts
    skipped_drafter: int = (
        0  # verifying requests that ran no drafter forward this step (goodput, lookup-only)
    )
    zero_length_verifies: int = 0  # verifying requests with k = 0 (plain decoding for them)

    @property
    def tau(self) -> float:
        """Committed tokens per verifying request in this step (accepted + 1)."""
        return tau_of(self.committed, self.verifies)

    @property
    def mean_verify_length(self) -> float:
        return self.draft_tokens / self.verifies if self.verifies else 0.0


def _filter_logits(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k and top-p (joint support, on the tempered distribution) as -inf masks."""
    rows = rows / params.temperature
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


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return (
        f"{type(value).__name__} {value!r}"
        if isinstance(value, (str, bool, type(None)))
        else type(value).__name__
    )


def _prompt_tokens(prompt_ids) -> list[int]:
    """One prompt's token ids as a list of ints: a 1-D integer tensor or array, a [1, L] tensor, or a sequence of
    ints. Anything else (text, None, booleans, floats, a batch of several prompts, nested lists) is refused, naming
    ``prompt_ids`` and what it got."""
    expected = "token ids: a 1-D integer tensor, a [1, L] tensor or a list of ints"
    if isinstance(prompt_ids, (str, bytes)) or prompt_ids is None:
        raise TypeError(f"prompt_ids: expected {expected} (tokenize text first), got {_describe(prompt_ids)}")
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
                raise TypeError(f"prompt_ids: expected {expected}, got {_describe(prompt_ids)}") from None
    if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or prompt_ids.is_complex():
        raise TypeError(f"prompt_ids: expected {expected}, got {_describe(prompt_ids)}")
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
        raise ValueError(
            f"prompt_ids: expected one prompt, got a batch of shape {list(prompt_ids.shape)}; add each row as its own "
            "request (or pass them all to generate)"
        )
    if prompt_ids.dim() > 2:
        raise ValueError(f"prompt_ids: expected one prompt, got {_describe(prompt_ids)}")
    prompt = prompt_ids.reshape(-1).tolist()
    if not prompt:
        raise ValueError("prompt_ids: expected at least one token, got an empty prompt")
    return prompt


def _check_engine_target(target):
    """The target's text config, once it is known to fit the engine's full-attention KV pool."""
    text_config = target.config.get_text_config()
    if getattr(text_config, "sliding_window", None) and getattr(text_config, "use_sliding_window", True):
        raise ValueError(
            f"target sliding_window: expected None (the engine's KV pool is full attention), got "
            f"{text_config.sliding_window}"
        )
    return text_config


def _with_kv_budget(admission: AdmissionConfig | None, target, drafter) -> AdmissionConfig:
    """``admission`` with ``kv_budget`` derived from the available memory when it is None: a request reserves its
    whole KV up front, so an unbounded pool could ask for more than the machine has."""
    admission = admission or AdmissionConfig()
    if admission.kv_budget is None:
        admission = replace(admission, kv_budget=default_kv_budget(target, drafter))
    return admission


def _drafting_settings(mode: str, drafting: DraftingSettings | None, **knobs) -> DraftingSettings:
    """The engine's ``DraftingSettings``: ``drafting``, or built from the keyword knobs (not both); ``mode="dflash"``
    means fixed length, ``mode="plain"`` drafts nothing."""
    given = {name: value for name, value in knobs.items() if value is not None}
    if drafting is not None and given:
        raise ValueError(
            f"drafting: expected a DraftingSettings or its fields as keyword arguments, got both (drafting and "
            f"{sorted(given)})"
        )
    if drafting is not None and not isinstance(drafting, DraftingSettings):
        raise TypeError(f"drafting: expected a DraftingSettings, got {type(drafting).__name__}")
    settings = drafting or DraftingSettings(**given)
    if mode == "plain" and settings.draft_source != "diffusion":
        raise ValueError(
            f"draft_source: expected 'diffusion' with mode='plain' (hybrid compares against a drafter), "
            f"got {settings.draft_source!r}"
        )
    if mode == "dflash":
        if given.get("length_mode") in ("goodput", "adaptive"):
            raise ValueError(
                f"length_mode: expected 'fixed', 'auto' or unset with mode='dflash', got {given['length_mode']!r}"
            )
        settings = DraftingSettings(**{**_knob_values(settings), "length_mode": "fixed"})
    return settings


def _knob_values(settings: DraftingSettings) -> dict:
    return {name: getattr(settings, name) for name in DraftingSettings.knobs()}


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


class AdaFlashEngine:
    """Batched speculative decoding engine. See the module docstring."""

    def __init__(
        self,
        target,
        drafter=None,
        mode: str = "adaflash",
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
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        settings = _drafting_settings(
            mode,
            drafting,
            gamma=gamma,
            min_len=min_len,
            draft_source=draft_source,
            lookup_history_tokens=lookup_history_tokens,
            lookup_min_prob=lookup_min_prob,
            length_mode=length_mode,
        )
        if mode != "plain" and drafter is None:
            raise ValueError(f"drafter: expected an AdaFlashDrafter for mode={mode!r}, got None")
        drafter = _resolve_drafter(drafter)
        text_config = _check_engine_target(target)
        self.drafter = drafter if mode != "plain" else None
        if self.drafter is not None:
            drafter.align_dtype(target)
            drafter.check_target(target)
        self.target = target
        self.mode = mode
        # γ and min_len resolved against the drafter now, before any request or forward.
        self.settings = settings.resolve(drafter.config) if self.drafter is not None else settings
        self.draft_source = self.settings.draft_source
        self.lookup_history = (
            None
            if self.settings.lookup_history_tokens is None
            else LookupIndex(max_tokens=self.settings.lookup_history_tokens)
        )
        self.block_size = drafter.config.block_size if drafter is not None else 16
        self.admission = AdmissionController(
            _with_kv_budget(admission, target, self.drafter), self.block_size
        )
        # "auto": the goodput machinery, used in the steps where no decoding request samples (``_goodput_step``).
        self.goodput = self.drafter is not None and self.settings.length_mode in ("goodput", "auto")
        if self.goodput:
            self.cost = cost_model_for(target, "engine")
            self.acceptance = acceptance_model_for(drafter)
            self.lookups = LookupModel(strength=2.0)  # shared by the requests' own lookup models
            self.last_drafter_forward: tuple[int, float] | None = None  # (requests, seconds) of this step's
            # The whole batch's drafter, judged on whole steps (below: _judge_drafter_step).
            self.batch_gate = SkipGate(max_skip=self.settings.max_skip)
            self.plain_overhead: deque = deque(maxlen=32)  # seconds of plain steps outside the target forward
            # running requests -> seconds of recent plain decode steps (no drafter, nothing verified, no prefill)
            self.plain_steps: dict[int, deque] = {}
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(text_config, "max_position_embeddings", None) or 1 << 62
        eos = target.generation_config.eos_token_id
        self.default_eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        self.target_store = SlotKVStore(text_config.num_hidden_layers)
        self.drafter_store = (
            SlotKVStore(drafter.config.num_hidden_layers) if self.drafter is not None else None
        )
        self.seeds = torch.Generator().manual_seed(seed)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.aborted: list[RequestOutput] = []  # final outputs of aborted requests, yielded by the next step
        self.stats: list[StepStats] = []
        self.round_recorder = None
        self.record_full_drafts = False
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.ids = itertools.count()

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
        prompt = _prompt_tokens(prompt_ids)
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
        request.gate = SkipGate(max_skip=self.settings.max_skip)
        if self.goodput:
            request.lookups = LookupModel(parent=self.lookups)
            if params.temperature == 0:
                request.shadows = ShadowLabels(self.acceptance, request.lookup, request.lookups)
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
        """Stop a request now (between steps); returns False if it had already finished."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id: expected one added to this engine, got {request_id!r}")
        if request.status == FINISHED:
            return False
        if request.status == WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.finish_reason = "abort"
        self._release(request)
        self.aborted.append(RequestOutput(request_id, [], True, "abort"))
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
            raise TypeError(f"prompts: expected a non-empty list of prompts, got {_describe(prompts)}")
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
        ids = [r.request_id for r in requests]
        for _ in self.stream():
            pass
        return [self.requests[i].output for i in ids]

    def _release(self, request: Request) -> None:
        if self.lookup_history is not None and request.finish_reason != "abort" and request.output:
            self.lookup_history.add(request.output)
        request.status = FINISHED
        request.pending_context = None
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
            return aborted
        self.running.extend(admitted)
        prefill_tokens = sum(len(r.prompt) for r in admitted)

        gamma = (self.settings.gamma or 1.0) * self.admission.gamma_scale()
        goodput = self._goodput_step(decoding)
        if goodput:
            self._calibrate_once()
            drafted = self._draft_goodput(decoding, prefill_tokens, len(admitted))
        else:
            drafted = self._draft(decoding, gamma)
        lengths, block_states, rows, lookups, fallbacks, ran = drafted
        drafter_seconds = time.perf_counter() - started
        lengths = self.admission.fit_lengths(lengths, self.admission.config.token_budget - prefill_tokens)
        full = self.record_full_drafts and self.round_recorder is not None
        drafts, full_drafts = self._propose(block_states, rows, lookups, lengths, full)
        sources = ["diffusion" if lookup is None else "lookup" for lookup in lookups]
        # â of the blocks this step verifies (for the round recorder); NaN where no block of this step is verified.
        heads = [r.last_acceptance if row is not None else float("nan") for r, row in zip(decoding, rows)]

        target_started = time.perf_counter()
        accepted, next_tokens, features = self._verify(admitted, decoding, drafts)
        target_seconds = time.perf_counter() - target_started
        if goodput:
            self._learn(decoding, len(admitted), prefill_tokens, drafts, sources, accepted, target_seconds)

        outputs, committed = self._commit(
            admitted, decoding, drafts, accepted, next_tokens, features, full_drafts, sources, heads
        )
        if goodput and decoding:
            seconds = time.perf_counter() - started
            self._judge_drafter_step(
                any(ran), committed, decoding, admitted, prefill_tokens, seconds, target_seconds, sum(lengths)
            )
        self.running = [r for r in self.running if r.status == RUNNING]
        self.admission.update(len(decoding) + len(admitted), sum(lengths) + len(lengths), len(lengths))
        self.stats.append(
            StepStats(
                step=len(self.stats),
                running=len(decoding) + len(admitted),
                waiting=len(self.waiting),
                admitted=len(admitted),
                kv_reserved=sum(r.kv_reservation for r in decoding + admitted),
                prefill_tokens=prefill_tokens,
                draft_tokens=sum(lengths),
                verify_tokens=sum(lengths) + len(lengths),
                accepted=sum(accepted[len(admitted) :]),
                committed=committed,
                verifies=len(decoding),
                gamma=gamma,
                ema_running=self.admission.ema_running,
                drafter_fallbacks=fallbacks,
                drafter_seconds=drafter_seconds,
                target_seconds=target_seconds,
                seconds=time.perf_counter() - started,
                lookup_verifies=sources.count("lookup"),
                lookup_accepted=sum(a for a, s in zip(accepted[len(admitted) :], sources) if s == "lookup"),
                skipped_drafter=ran.count(False) if self.drafter is not None else 0,
                zero_length_verifies=lengths.count(0),
            )
        )
        return aborted + outputs

    def _goodput_step(self, decoding: list[Request]) -> bool:
        """Whether this step drafts by goodput: always with ``length_mode="goodput"``; with ``"auto"`` only while no
        decoding request samples (the adaptive rule keeps a seeded sampling request's output independent of the
        machine's timings and of the batch; a greedy request's output is the same either way)."""
        if not self.goodput or self.settings.length_mode == "goodput":
            return self.goodput
        return all(r.params.temperature == 0 for r in decoding)

    def _draft(self, decoding: list[Request], gamma: float):
        """Per-request draft lengths; the block states of one batched drafter forward (None without one); each
        request's row in them (None: no block verified); its lookup proposal (None: not a lookup round); the count
        of non-finite blocks; and whether each request ran the drafter."""
        count = len(decoding)
        lengths, rows, lookups, ran = [0] * count, [None] * count, [None] * count, [False] * count
        if self.drafter is None or not decoding:
            return lengths, None, rows, lookups, 0, ran
        # The bonus token needs one slot of the request's budget, so at most remaining - 1 drafts.
        room = [min(self.block_size - 1, r.remaining - 1) for r in decoding]
        proposals = self._lookup_proposals(decoding, room)
        for i, r in enumerate(decoding):
            if r.last_acceptance is not None and choose_lookup(
                proposals[i], r.lookup, r.last_acceptance, self.block_size
            ):
                lookups[i] = proposals[i].tokens
        drafting = [i for i in range(count) if lookups[i] is None]
        if not drafting:
            return [len(t) for t in lookups], None, rows, lookups, 0, ran
        block_lengths, states, finite = self._drafter_forward([decoding[i] for i in drafting], gamma)
        for row, i in enumerate(drafting):
            request = decoding[i]
            ran[i] = True
            if not finite[row]:
                self._count_fallback(request)
            if proposals[i] is not None and choose_lookup(
                proposals[i], request.lookup, request.last_acceptance, self.block_size
            ):
                lookups[i] = proposals[i].tokens
            else:
                rows[i] = row
                lengths[i] = min(block_lengths[row], room[i]) if finite[row] else 0
        lengths = [n if t is None else len(t) for n, t in zip(lengths, lookups)]
        return lengths, states, rows, lookups, finite.count(False), ran

    def _lookup_proposals(self, decoding: list[Request], room: list[int]) -> list:
        """Each request's lookup continuation (hybrid; None elsewhere): the longer match of its own tokens and the
        shared history, cut by ``lookup_min_prob``."""
        proposals = [None] * len(decoding)
        if self.draft_source != "hybrid":
            return proposals
        for i, r in enumerate(decoding):
            proposals[i] = r.lookup_index.propose(room[i], r.eos_ids)
            if self.lookup_history is not None:
                suffix = r.lookup_index.tail(self.lookup_history.max_ngram)
                shared = self.lookup_history.propose(room[i], r.eos_ids, suffix=suffix)
                if shared is not None and (
                    proposals[i] is None or shared.match_length > proposals[i].match_length
                ):
                    proposals[i] = shared
            proposals[i] = truncate_lookup(proposals[i], r.lookup, self.settings.lookup_min_prob)
        return proposals

    def _count_fallback(self, request: Request) -> None:
        request.drafter_fallbacks += 1
        if request.drafter_fallbacks == 1:
            logger.warning(
                f"{request.request_id}: non-finite drafter block, verifying no block drafts in such steps "
                "(output unchanged; counted in StepStats.drafter_fallbacks and the request's "
                "drafter_fallbacks; warned once per request)"
            )

    def _draft_goodput(self, decoding: list[Request], prefill_tokens: int, admitted: int):
        """``_draft`` for ``length_mode="goodput"``: the drafter runs for the requests whose ``SkipGate`` is open
        and whose lookup continuation (hybrid) is not expected to do better alone; then one plan over every
        request's options (its block, its lookup) maximises the step's expected committed tokens per second
        (``drafting.plan_round``) under the token budget."""
        count = len(decoding)
        lengths, rows, lookups, ran = [0] * count, [None] * count, [None] * count, [False] * count
        room = [min(self.block_size - 1, r.remaining - 1) for r in decoding]
        proposals = self._lookup_proposals(decoding, room)
        options = [[g] if (g := r.lookups.gains(p)) else [] for p, r in zip(proposals, decoding)]
        for proposal, request in zip(proposals, decoding):
            if request.shadows is not None:
                request.shadows.add_lookup(len(request.prompt) + len(request.output), proposal)
        kinds = [["lookup"] if o else [] for o in options]
        # The plan counts verify tokens (anchors + drafts); the curve prices them beside this step's prefills.
        running, base_tokens = count + admitted, count
        curve = self.cost.step_curve(running, prefill_tokens)
        if not decoding or curve is None or not self.cost.knows_target(prefill_tokens + count, running):
            return lengths, None, rows, lookups, 0, ran  # a plain step measures the baseline first
        base = {"base_tokens": base_tokens, "base_committed": float(running), "target_seconds": curve}
        share = self.cost.marginal_drafter_seconds(count)
        batch_open = self.batch_gate.should_draft()
        drafting = [i for i, r in enumerate(decoding) if batch_open and room[i] > 0 and r.gate.should_draft()]
        drafting = [
            i for i in drafting if not self._lookup_alone_wins(decoding[i], options[i], room[i], share, base)
        ]
        states, drafter_seconds, fallbacks = None, 0.0, 0
        if drafting:
            tick = time.perf_counter()
            _, states, finite = self._drafter_forward([decoding[i] for i in drafting], 1.0)
            heads = [decoding[i].last_acceptance for i in drafting]
            confidences, tokens = self._confidences(states, [room[i] for i in drafting], heads)
            self.last_drafter_forward = (len(drafting), time.perf_counter() - tick)
            drafter_seconds = self.cost.drafter_seconds(len(drafting))
            for row, i in enumerate(drafting):
                request, ran[i], rows[i] = decoding[i], True, row
                request.last_gains = []
                if not finite[row]:
                    self._count_fallback(request)
                    fallbacks += 1
                    continue
                request.last_gains = self.acceptance.gains(confidences[row], heads[row])
                request.goodput_round = (confidences[row], heads[row])
                if request.shadows is not None:
                    start = len(request.prompt) + len(request.output)
                    request.shadows.add_block(start, tokens[row], confidences[row], heads[row])
                options[i], kinds[i] = [request.last_gains, *options[i]], ["diffusion", *kinds[i]]
        budget = self.admission.config.token_budget - prefill_tokens - base_tokens
        plan = plan_round(options, drafter_seconds=drafter_seconds, budget=budget, **base)
        plain = curve(base_tokens)
        rate = running / plain
        drafter_cost = rate * share
        spare = budget - sum(plan.lengths)
        for i, request in enumerate(decoding):
            source = None if plan.sources[i] is None else kinds[i][plan.sources[i]]
            lengths[i] = plan.lengths[i]
            if source == "lookup":
                lookups[i], rows[i] = proposals[i].tokens[: lengths[i]], None
                request.lookup_match = proposals[i].match_length
            elif ran[i] and not lengths[i] and request.gate.probing and request.shadows is None:
                if request.last_gains and spare > 0:  # sampling: a probe verifies one draft, the only label
                    lengths[i], spare = 1, spare - 1
            if ran[i]:
                gains = request.last_gains or []
                surplus = draft_surplus(gains, lambda k: curve(base_tokens + k) - plain, rate)
                request.gate.record(surplus, drafter_cost)
        return lengths, states, rows, lookups, fallbacks, ran

    def _lookup_alone_wins(
        self, request: Request, options: list, room: int, share: float, base: dict
    ) -> bool:
        """Whether the request's lookup continuation, without the drafter, beats its last block's gains with it."""
        if not options or request.last_gains is None:
            return False
        alone = plan_round([options], drafter_seconds=0.0, **base)
        drafted = plan_round([[request.last_gains[:room], *options]], drafter_seconds=share, **base)
        return alone.goodput >= drafted.goodput

    def _confidences(self, states, rooms: list[int], heads: list[float]):
        """Per drafting request, its argmax proposals for block rows 1..n and the drafter's confidence (softmax
        maximum) in each: the first ``CONFIDENCE_ROWS`` rows, all ``room`` rows where the chain of acceptances could
        reach past them (lm_head rows are what costs)."""
        lm_head = self.target.get_output_embeddings()

        def project(widths, start):
            pieces = [states[row, 1 + start : 1 + w] for row, w in enumerate(widths) if w > start]
            if not pieces:
                return [], []
            logits, token_ids = draft_logits(torch.cat(pieces), lm_head, self.drafter.draft_token_ids)
            confidence, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            best = best if token_ids is None else token_ids[best]
            return confidence.nan_to_num(0.0).tolist(), best.tolist()

        first = [min(room, CONFIDENCE_ROWS) for room in rooms]
        more = [0] * len(rooms)
        confidences, tokens = [[] for _ in rooms], [[] for _ in rooms]
        for start, widths in ((0, first), (CONFIDENCE_ROWS, more)):
            flat_confidence, flat_tokens = project(widths, start)
            for row, w in enumerate(widths):
                n = max(0, w - start)
                confidences[row] += flat_confidence[:n]
                tokens[row] += flat_tokens[:n]
                flat_confidence, flat_tokens = flat_confidence[n:], flat_tokens[n:]
            if start == 0:
                more[:] = [
                    room
                    if room > w
                    and confidences[row]
                    and self.acceptance.gains(confidences[row], heads[row])[-1] > REACH_FOR_MORE_ROWS
                    else 0
                    for row, (room, w) in enumerate(zip(rooms, first))
                ]
        return confidences, tokens

    def _learn(self, decoding, admitted: int, prefill_tokens: int, drafts, sources, accepted, target_seconds):
        """Goodput: feed the step's timings to the cost model and its verified blocks to the acceptance model."""
        running = len(decoding) + admitted
        self.cost.observe_step(len(decoding) + sum(map(len, drafts)), prefill_tokens, running, target_seconds)
        if self.last_drafter_forward is not None:
            self.cost.observe_drafter(*self.last_drafter_forward)
            self.last_drafter_forward = None
        for request, draft, source, n_accepted in zip(decoding, drafts, sources, accepted[admitted:]):
            # Greedy requests learn from ShadowLabels (every proposal, after the commit); sampling ones from here.
            if (
                source == "diffusion"
                and draft
                and request.goodput_round is not None
                and request.shadows is None
            ):
                self.acceptance.update(*request.goodput_round, len(draft), n_accepted)
            request.goodput_round = None

    def _judge_drafter_step(
        self,
        drafted: bool,
        committed: int,
        decoding,
        admitted,
        prefill_tokens: int,
        seconds: float,
        target: float,
        verified: int = 0,
    ) -> None:
        """The safety net under the per-request choice: everything the plan does not price (the drafter's fixed cost
        when few requests draft, the confidences, the bookkeeping) shows in the step's wall time. A step where the
        drafter ran is worth its committed tokens minus what plain decoding would have committed in the same
        seconds (a plain step: measured whole, at this many running requests or the nearest count measured,
        ``_measured_plain_step``; before any, the cost model's step at no drafts plus the measured overhead of plain
        steps);
        while that average stays negative the whole batch skips the drafter (``SkipGate``'s backoff, with probes).
        ``verified``: the step's verified drafts; a step without the drafter that verified lookup continuations is no
        plain step."""
        running = len(decoding) + len(admitted)
        if not drafted:
            self.plain_overhead.append(max(0.0, seconds - target))
            if not admitted and not verified:
                self.plain_steps.setdefault(running, deque(maxlen=16)).append(seconds)
            return
        plain_seconds = None if admitted else self._measured_plain_step(running)
        if plain_seconds is None:
            curve = self.cost.step_curve(running, prefill_tokens)
            if curve is None:
                return
            overhead = statistics.median(self.plain_overhead) if self.plain_overhead else 0.0
            plain_seconds = curve(len(decoding)) + overhead
        self.batch_gate.record(committed - len(decoding) * seconds / plain_seconds, 0.0)

    def _measured_plain_step(self, running: int) -> float | None:
        """Seconds of a plain decode step with ``running`` requests, from measured ones: the median of the last at
        this count, else of the nearest count measured (at least three steps), scaled by the step fit's ratio
        between the two counts (the fit only relates them: requests finishing one by one would otherwise send every
        new count back to the fit's word alone). None before three plain steps at any count."""
        counts = [n for n, steps in self.plain_steps.items() if len(steps) >= 3]
        if not counts:
            return None
        nearest = min(counts, key=lambda n: (abs(n - running), n))
        seconds = statistics.median(self.plain_steps[nearest])
        if nearest == running:
            return seconds
        here, there = self.cost.step_curve(running), self.cost.step_curve(nearest)
        if here is None or there is None:
            return None
        return seconds * here(running) / there(nearest)

    def _calibrate_once(self) -> None:
        if self.settings.calibrate and not self.cost.calibrated:
            budget = self.admission.config.token_budget
            # A few sizes for the first steps: after 16 steps the fit over the steps themselves takes over.
            sizes = [n for n in (1, 4, 16, 64) if n <= budget]
            layers = [i + 1 for i in self.drafter.config.target_layer_ids]
            calibrate_target(
                self.target, self.cost, sizes=sizes, repeats=1, budget_s=1.0, output_hidden_states=layers
            )

    def _drafter_forward(self, decoding: list[Request], gamma: float):
        """One batched drafter forward over ``decoding``: k̂ per request, the block states, finite flags; sets each
        request's ``last_acceptance`` (â)."""
        drafter = self.drafter
        device = next(drafter.parameters()).device
        contexts = [r.pending_context for r in decoding]
        batch = DrafterBatch.build(
            [r.slot for r in decoding],
            [r.drafter_len for r in decoding],
            [c.shape[0] for c in contexts],
            self.block_size,
            device,
        )
        width = max(c.shape[0] for c in contexts)
        context = contexts[0].new_zeros(len(decoding), width, contexts[0].shape[-1])
        for row, features in enumerate(contexts):
            context[row, : features.shape[0]] = features
        anchors = torch.tensor([r.anchor for r in decoding], device=device)
        noise = drafter.block_embeds(self.target.get_input_embeddings().weight, anchors).to(device)
        out = drafter(
            noise_embeds=noise,
            context_hidden_states=context.to(device=device, dtype=noise.dtype),
            attention_mask=batch.mask,
            position_ids=batch.position_ids,
            cache=DrafterSlotCache(self.drafter_store, batch),
        )
        for request, features, acceptance in zip(decoding, contexts, out.acceptance_prob.float().tolist()):
            request.drafter_len += features.shape[0]
            request.pending_context = None
            request.last_acceptance = acceptance
        states = out.last_hidden_state
        finite = torch.isfinite(states).flatten(1).all(1) & torch.isfinite(out.acceptance_prob.float())
        if self.settings.length_mode == "fixed":
            lengths = [self.block_size - 1] * len(decoding)
        else:
            lengths = drafter.predict_draft_length(out.acceptance_prob, gamma, self.settings.min_len).tolist()
        return lengths, states, finite.tolist()

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
            kwargs["output_hidden_states"] = [i + 1 for i in self.drafter.config.target_layer_ids]
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
        temperatures, accept_u, sample_u = [], [], []
        for request, rows, start in zip(requests, row_counts, cu.tolist()):
            params = request.params
            if params.temperature > 0:
                logits[start : start + rows] = _filter_logits(logits[start : start + rows], params)
                accept_u.append(torch.rand(rows - 1, generator=request.generator))
                sample_u.append(torch.rand(1, generator=request.generator))
            else:
                accept_u.append(torch.zeros(rows - 1))
                sample_u.append(torch.zeros(1))
            # Filtered rows are already tempered: the acceptance rule then samples at temperature 1.
            temperatures.append(1.0 if params.temperature > 0 else 0.0)
        result = verify_accept(
            logits,
            torch.tensor(list(itertools.chain.from_iterable(drafts)), dtype=torch.long, device=device),
            cu,
            torch.tensor(temperatures, device=device),
            accept_uniforms=torch.cat(accept_u).to(device),
            sample_uniforms=torch.cat(sample_u).to(device),
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
                new = hidden[offset : offset + cached]
                pending = request.pending_context
                request.pending_context = new if pending is None else torch.cat([pending, new])
            if request.lookup_index is not None:
                request.lookup_index.extend(kept)
            source = sources[i - prefills] if i >= prefills else None
            if i >= prefills:
                committed += len(kept)
                request.drafted += len(proposed)
                request.accepted += n_accepted
                request.verify_rounds += 1
                if source == "lookup" and request.shadows is None:
                    request.lookup.add(len(proposed), n_accepted)
                    if request.lookups is not None and request.lookup_match is not None:
                        request.lookups.observe(request.lookup_match, len(proposed), n_accepted)
                if request.shadows is not None:
                    request.shadows.resolve(request.prompt + request.output)
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
            outputs.append(
                RequestOutput(request.request_id, kept, request.status == FINISHED, request.finish_reason)
            )
        return outputs, committed
