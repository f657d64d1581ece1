"""vLLM's DFlash proposer with each request's drafts truncated to its own length before verification.

vLLM's V1 runner (the one its CPU build always uses, and its GPU build with synchronous scheduling) takes a ragged
``list[list[int]]`` from a proposer and schedules exactly ``1 + len(drafts)`` tokens for that request; an empty list
is a plain step. ``AdaFlashProposer.propose`` runs the stock one-pass DFlash drafter, reads â for every request from
the block's final states (``AdaFlashDFlashForCausalLM.acceptance``), and returns each request's first k drafts, k from
``rounds.choose_lengths`` (the adaptive rule, goodput, or fixed). Around that, ``Session``:

- polls the publish directory (``ADAFLASH_VLLM_WEIGHTS``) between steps and swaps in validated versions of the drafter
  (``online.weights.HotReloader`` with the vLLM model's own layout);
- measures the target's step cost from vLLM's own steps (``rounds.StepCost``, goodput's cost line) and learns the
  acceptance model from every verified round (goodput's chains);
- under goodput, leaves the drafter out of a step where drafting measurably loses at that batch size
  (``rounds.DrafterGate``: whole steps timed with and without the drafter, per batch-size class);
- keeps such a step as cheap as vLLM's plain one: the step's target states go into a ``context.ContextStash``, not
  through the drafter's context projection, and the next drafting step writes them all at once; the runner's draft
  setup is not run for a step the drafter sits out, and a step that verifies no draft anywhere is sampled by vLLM's
  plain sampler, not its rejection sampler (``AdaFlashProposer._hook_runner``);
- books each request's rounds (``rounds.RoundBook``) and, with ``ADAFLASH_VLLM_RECORDS``, appends every finished
  request's trajectory to ``trajectories-<pid>.jsonl`` there and keeps ``stats-<pid>.json`` current.

Without a length head in the drafter folder the proposer is stock DFlash.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from adaflash_hf.acceptance import AcceptanceModel
from adaflash_hf.atomic import atomic_write_json
from adaflash_hf.kernels._utils import row_argmax
from adaflash_hf.modeling.length_head_adaflash import draft_lengths
from adaflash_hf.online.weights import HotReloader
from adaflash_hf.vllm.context import ContextStash, context_slots
from adaflash_hf.vllm.rounds import (
    DrafterGate,
    Proposal,
    RoundBook,
    Row,
    Settings,
    StepCost,
    StepStats,
    choose_lengths,
)

logger = init_logger("vllm.plugins.adaflash")  # under vLLM's logger, so its handlers print it
STATS_EVERY = 16  # steps between writes of stats-<pid>.json


def _tokens(token_ids, index: int, start: int, stop: int) -> list[int]:
    return token_ids[index, start:stop].tolist()


def _published_reference(model) -> dict[str, torch.Tensor]:
    shapes = model.published_shapes()
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


class Session:
    """The plugin's state in one worker: settings, reloader, cost line, acceptance model, round book, statistics."""

    def __init__(self, model, settings: Settings, max_len: int):
        self.model, self.settings, self.max_len = model, settings, max_len
        meta = model.sidecar
        self.gamma = settings.gamma if settings.gamma is not None else float(meta["length_head_gamma"])
        self.min_len = settings.min_len if settings.min_len is not None else int(meta["length_head_min_len"])
        if not 0 <= self.min_len <= max_len:
            raise ValueError(
                f"ADAFLASH_VLLM_MIN_LEN: expected 0..{max_len} (block_size - 1), got {self.min_len}"
            )
        self.cost, self.acceptance_model, self.gate = StepCost(), AcceptanceModel(), DrafterGate()
        self.book, self.stats = RoundBook(), StepStats()
        vocabulary = getattr(model.config, "draft_token_ids", None)
        self.vocabulary = frozenset(vocabulary) if vocabulary is not None else None
        self.pending: tuple | None = None  # this step's â, rule lengths and confidences, from sample_greedy
        self.reloader = None
        if settings.weights_dir:
            shapes = functools.lru_cache(maxsize=1)(lambda: _published_reference(model))
            self.reloader = HotReloader(
                model,
                settings.weights_dir,
                canary=None,
                state=lambda _: shapes(),
                load=lambda m, tensors: m.load_published(tensors),
                same_dtype=False,
            )
        model.weights_version = getattr(model, "weights_version", 0)
        self.polled = float("-inf")
        self.booked = 0  # steps booked, drafting or not
        self.last_end: float | None = None
        self.previous_ids: set[str] = set()
        self.records = Path(settings.records_dir) if settings.records_dir else None
        if self.records is not None:
            self.records.mkdir(parents=True, exist_ok=True)

    @property
    def version(self) -> int:
        return int(self.model.weights_version)

    def before_drafting(self, tokens: int, request_ids: list[str]) -> None:
        """Between steps: a reload when one is due, and the step that just ran as a point of the cost line (only a
        step of requests all seen before: a new request means an idle gap or a prefill may be inside the interval)."""
        now = time.perf_counter()
        if self.reloader is not None and now - self.polled >= self.settings.poll_seconds:
            self.polled = now
            if self.reloader.poll():
                logger.info("AdaFlash: drafter weights version %d loaded", self.version)
        if self.last_end is not None and self.previous_ids and set(request_ids) <= self.previous_ids:
            self.cost.observe(tokens, now - self.last_end)

    def begin_step(self, tokens: int, request_ids: list[str], batch_size: int) -> bool:
        """Once a step, before any drafting: ``before_drafting``, the gate's clock, and whether the drafter sits
        this step out."""
        self.before_drafting(tokens, request_ids)
        self.pending = None
        self.gate.start(time.perf_counter(), batch_size, request_ids[:batch_size], tokens)
        return self.skip_drafter(batch_size)

    def sample_greedy(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts with the vocabulary projection only where they will be verified: â first (from the block's
        states, before any logits), the rule's k̂ from it, then logits for each request's first k̂ rows (fixed: all;
        goodput: up to 2·k̂ + 2, whose confidences it plans with), over the drafter's own vocabulary where it has one
        (``AdaFlashDFlashForCausalLM.draft_logits``). The other rows get token 0 and are cut off."""
        width = self.max_len
        batch_size = hidden.shape[0] // width
        acceptance = model.acceptance(batch_size, width + 1)
        rule = draft_lengths(acceptance, self.gamma, self.min_len, width).tolist()
        if self.settings.policy == "fixed":
            need = [width] * batch_size
        elif self.settings.policy == "goodput":
            need = [min(width, 2 * k + 2) for k in rule]
        else:
            need = rule
        rows = [i * width + j for i in range(batch_size) for j in range(need[i])]
        ids = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        confidences = None
        if rows:
            index = torch.tensor(rows, device=hidden.device)
            logits, vocabulary = model.draft_logits(hidden[index])
            chosen = row_argmax(logits)
            ids[index] = chosen if vocabulary is None else vocabulary[chosen]
            if self.settings.policy == "goodput":
                flat = logits.float().softmax(-1).gather(-1, chosen[:, None]).squeeze(-1).tolist()
                starts = [0]
                for n in need:
                    starts.append(starts[-1] + n)
                confidences = [flat[starts[i] : starts[i + 1]] for i in range(batch_size)]
        self.pending = (acceptance, rule, confidences)
        return ids

    def after_drafting(self, drafts: torch.Tensor, runner, drafter_seconds: float) -> list[list[int]]:
        batch_size, width = drafts.shape
        if self.pending is not None:
            acceptance, _, confidences = self.pending
        else:  # drafts sampled by vLLM (a sampling request in the batch): â now, no confidences
            acceptance, confidences = self.model.acceptance(batch_size, width + 1), None
        self.pending = None
        self.stats.drafter_seconds += drafter_seconds
        lengths = choose_lengths(
            self.settings,
            self.max_len,
            acceptance,
            gamma=self.gamma,
            min_len=self.min_len,
            confidences=confidences,
            model=self.acceptance_model,
            cost=self.cost,
            drafter_seconds=drafter_seconds,
        )
        lengths = [min(k, width) for k in lengths]
        request_ids = list(runner.input_batch.req_ids[:batch_size])
        heads = acceptance.tolist()
        proposals = [
            Proposal(k, self.version, heads[i], confidences[i] if confidences else None, batch=batch_size)
            for i, k in enumerate(lengths)
        ]
        self.gate.drafted(lengths)
        self._book(runner, request_ids, proposals)
        self.stats.observe_step(lengths)
        out = [row[:k] for row, k in zip(drafts.tolist(), lengths)]
        # (drafts sampled by vLLM for a sampling request come from the whole vocabulary and count here too)
        if self.vocabulary is not None:
            self.stats.outside_vocabulary += sum(t not in self.vocabulary for row in out for t in row)
        return out

    def skip_drafter(self, batch_size: int) -> bool:
        """goodput: whether this step leaves the drafter out (``DrafterGate``)."""
        return self.settings.policy == "goodput" and not self.gate.draft(batch_size)

    def plain_step(self, runner, batch_size: int) -> list[list[int]]:
        """A step the drafter sat out: every request verifies no draft; its rounds are still booked."""
        request_ids = list(runner.input_batch.req_ids[:batch_size])
        self._book(runner, request_ids, [Proposal(0, self.version)] * batch_size)
        self.stats.skipped_steps += 1
        return [[] for _ in range(batch_size)]

    def _book(self, runner, request_ids: list[str], proposals: list[Proposal]) -> None:
        batch = runner.input_batch
        rows = [
            Row(rid, int(batch.num_tokens_no_spec[i]), int(batch.num_prompt_tokens[i]),
                functools.partial(_tokens, batch.token_ids_cpu, i))
            for i, rid in enumerate(request_ids)
        ]  # fmt: skip
        for proposal, accepted in self.book.step(rows, proposals, alive=runner.requests.__contains__):
            self.stats.observe_round(proposal.length, accepted)
            self.gate.observe_round(accepted, proposal.batch)
            if proposal.confidences is not None:
                self.acceptance_model.update(proposal.confidences, proposal.head, proposal.length, accepted)
        self._write_records()
        self.previous_ids = set(request_ids)
        self.last_end = time.perf_counter()

    def report(self) -> dict:
        out = self.stats.as_dict() | {
            "policy": self.settings.policy,
            "gamma": self.gamma,
            "min_len": self.min_len,
            "drafter_version": self.version,
            "cost_line_seconds": list(self.cost.line()) if self.cost.ready else None,
            "gate": self.gate.report(),
            "recent_requests": list(self.book.recent)[-32:],
        }
        if self.reloader is not None:
            out |= {"reload_swaps": self.reloader.swaps, "reload_rejected": dict(self.reloader.rejected)}
        return out

    def _write_records(self) -> None:
        if self.records is None:
            return
        pid = os.getpid()
        if self.book.finished:
            with open(self.records / f"trajectories-{pid}.jsonl", "a") as handle:
                while self.book.finished:
                    handle.write(json.dumps(self.book.finished.popleft()) + "\n")
        self.booked += 1
        if self.booked % STATS_EVERY == 1:
            atomic_write_json(self.records / f"stats-{pid}.json", self.report())


def _same_slots(formula: torch.Tensor, step_slots: torch.Tensor) -> bool:
    """Whether the slot mapping vLLM's runner gives the drafter's cache group for a step's tokens is the DFlash
    formula's (``context.context_slots``): true where the drafter's layers share the block table and block size that
    metadata was built for, as in vLLM 0.32, and then the stash takes it as it is (one copy, where the formula is a
    dozen small ops: 0.2 ms a step inside vLLM's CPU worker, whose small ops cost 20-40 µs each). Checked once, on
    the first step the drafter sits out; where they differ, the formula stays."""
    same = step_slots.shape == formula.shape and bool(torch.equal(step_slots.long(), formula.long()))
    if not same:
        logger.info("AdaFlash: the step's slot mapping is not the drafter's; its context slots are computed")
    return same


def _has_recurrent_layers(kv_cache_config) -> bool:
    """Whether any of the target's cache groups holds recurrent (Mamba-like) state."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        if isinstance(spec, MambaSpec):
            return True
    return False


class AdaFlashProposer(DFlashProposer):
    """See the module docstring."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.adaflash_runner = runner
        self.adaflash: Session | None = None
        self.context_stash = ContextStash()
        self._step_begun = False  # the runner's hook began this step (``_hook_runner``)
        # whether the step's own slot mapping is the drafter's (``_same_slots``); None until the first stash
        self._slots_are_the_steps: bool | None = None

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        if getattr(model, "length_head", None) is None:
            logger.info("AdaFlash: the drafter folder has no length head; drafting as stock DFlash")
            return
        block = int(model.sidecar["block_size"])
        if self.num_speculative_tokens != block - 1:
            raise ValueError(
                f"num_speculative_tokens: expected {block - 1} (the AdaFlash drafter's block_size - 1; its length "
                f"head reads the whole block), got {self.num_speculative_tokens}"
            )
        self.adaflash = Session(model, Settings.from_env(), max_len=block - 1)
        self._hook_runner()
        logger.info("AdaFlash: %s draft lengths (gamma %s, min_len %s)", self.adaflash.settings.policy,
                    self.adaflash.gamma, self.adaflash.min_len)  # fmt: skip

    def _hook_runner(self) -> None:
        """Two changes to this worker's runner (this instance only; stock DFlash runners are left alone):

        - ``propose_draft_token_ids``: the session's step begins here, and a step the drafter sits out keeps its
          target states in the stash and returns empty drafts, without the runner's draft setup (the next tokens,
          the padded inputs: 0.4 ms a step at 4 requests on a 2-core CPU);
        - ``_prepare_inputs``: a step where no request verifies a draft is sampled as a plain step (vLLM's sampler,
          not its rejection sampler with nothing to reject: 0.5 ms a step there), as without speculative decoding.
          Left alone for targets with recurrent layers, whose kernels read a zero-draft decode at the speculative
          offset.
        """
        runner = self.adaflash_runner
        if (
            runner is None
            or not hasattr(runner, "propose_draft_token_ids")
            or not hasattr(runner, "_prepare_inputs")
        ):
            return
        proposer, propose_draft_token_ids, prepare_inputs = (
            self,
            runner.propose_draft_token_ids,
            runner._prepare_inputs,
        )
        recurrent: list[bool] = []

        def prepare_inputs_sampling_plain_steps_plainly(*args, **kwargs):
            logits_indices, metadata, most = prepare_inputs(*args, **kwargs)
            if metadata is None or any(metadata.num_draft_tokens):
                return logits_indices, metadata, most
            if not recurrent:
                recurrent.append(_has_recurrent_layers(runner.kv_cache_config))
            return (logits_indices, metadata, most) if recurrent[0] else (logits_indices, None, most)

        def propose_or_keep_context(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            slot_mappings,
        ):
            arguments = (scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                         aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)  # fmt: skip
            session = proposer.adaflash
            if (
                session is None
                or aux_hidden_states is None
                or scheduler_output.num_spec_tokens_to_schedule == 0
            ):
                return propose_draft_token_ids(*arguments)
            batch_size = common_attn_metadata.batch_size()
            tokens = int(scheduler_output.total_num_scheduled_tokens)
            if not session.begin_step(tokens, list(runner.input_batch.req_ids), batch_size):
                proposer._step_begun = True
                try:
                    return propose_draft_token_ids(*arguments)
                finally:
                    proposer._step_begun = False
            # as the runner's own proposal step begins
            runner._draft_probs = runner._draft_prob_req_ids = None
            states = torch.cat([h[:tokens] for h in aux_hidden_states], dim=-1)
            return proposer._sit_out(states, runner._get_positions(tokens), common_attn_metadata)

        runner._prepare_inputs = prepare_inputs_sampling_plain_steps_plainly
        runner.propose_draft_token_ids = propose_or_keep_context

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        session = self.adaflash
        greedy = sampling_metadata.all_greedy or not self._enable_probabilistic_draft_probs
        if session is None or not greedy or self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        return session.sample_greedy(self.model, hidden_states), None

    def propose(self, num_speculative_tokens, **kwargs):
        session = self.adaflash
        if session is None or num_speculative_tokens == 0:
            self._write_stashed_context()
            return super().propose(num_speculative_tokens, **kwargs)
        runner = self.adaflash_runner
        batch_size = kwargs["common_attn_metadata"].batch_size()
        if not self._step_begun:  # called without the runner's hook
            # the target step's tokens, prefill chunks and drafts included
            tokens = int(kwargs["target_token_ids"].shape[0])
            if session.begin_step(tokens, list(runner.input_batch.req_ids), batch_size):
                return self._sit_out(
                    kwargs["target_hidden_states"], kwargs["target_positions"], kwargs["common_attn_metadata"]
                )
        started = time.perf_counter()
        self._write_stashed_context()
        drafts = super().propose(num_speculative_tokens, **kwargs)
        return session.after_drafting(drafts, runner, time.perf_counter() - started)

    def _sit_out(self, states: torch.Tensor, positions: torch.Tensor, cad) -> list[list[int]]:
        """A step without the drafter: its context stashed, its rounds booked, no drafts."""
        started = time.perf_counter()
        self._stash_context(states, positions, cad)
        out = self.adaflash.plain_step(self.adaflash_runner, cad.batch_size())
        self.adaflash.stats.skip_seconds += time.perf_counter() - started
        return out

    def _stash_context(self, states: torch.Tensor, positions: torch.Tensor, cad) -> None:
        """A step the drafter sits out: its target states (unfused), positions and the drafter's cache slots for
        them, kept for the next drafting step (``context.ContextStash``); written now if the stash is full."""
        count = int(cad.query_start_loc_cpu[cad.batch_size()])
        positions = positions[:count].clone()  # the runner's buffers are written again next step
        if self._slots_are_the_steps:
            slots = cad.slot_mapping[:count].clone()
        else:
            slots = self.formula_slots(positions, cad)
            if self._slots_are_the_steps is None:
                self._slots_are_the_steps = _same_slots(slots, cad.slot_mapping[:count])
        self.context_stash.add(states[:count], positions, slots)
        if self.context_stash.full:
            self._write_stashed_context()

    def formula_slots(self, positions: torch.Tensor, cad) -> torch.Tensor:
        """The drafter's cache slots of a step's first ``len(positions)`` tokens by the DFlash formula
        (``context.context_slots``) over the step's metadata ``cad``."""
        starts = cad.query_start_loc_cpu[: cad.batch_size() + 1].to(positions.device)
        return context_slots(positions, starts, cad.block_table_tensor, self.block_size)

    def _write_stashed_context(self) -> None:
        """The stashed steps' states fused and projected into the drafter's context K/V cache, in one call."""
        taken = self.context_stash.take()
        if taken is None:
            return
        states, positions, slots = taken
        self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(states), positions, slots)
