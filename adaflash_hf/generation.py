"""``target.generate(..., assistant_model=drafter)`` with AdaFlash: the candidate generator.

``adaflash_hf.generate_hook`` hands an ``AdaFlashDrafter`` assistant to ``AdaFlashCandidateGenerator``; the upstream
loop keeps doing verification, speculative sampling, cache cropping, EOS/length handling and streaming. Each round
the drafting policy (``adaflash_hf.policy``, a batch of one) decides what is verified.

Knobs live on the generation config (``GenerationConfig(adaflash_length_mode="fixed", ...)``,
``target.generation_config.adaflash_gamma = 1.3``, or ``generate(..., adaflash_gamma=1.3)`` like any generation-config
field) and are read into one ``adaflash_hf.drafting.DraftingSettings`` (the engine takes the same object); an unknown
``adaflash_*`` name is an error that names the closest knob, and ``adaflash_*`` kwargs of a call without an AdaFlash
assistant are an error too (a forgotten ``assistant_model=``). ``speculation_type="dflash"`` hands the drafter to
transformers' native fixed-length DFlash path (no AdaFlash knobs, no ``last_stats``).

- ``adaflash_length_mode``: ``"auto"`` (default: goodput under greedy, adaptive under sampling, so that a seed's
  output stays reproducible), ``"adaptive"`` (the length head truncates the draft), ``"fixed"`` (always
  ``block_size - 1`` drafts, i.e. DFlash) or ``"goodput"`` (the k, from 0 up, with the most expected committed tokens
  per second on this machine: ``adaflash_hf.drafting``; ``adaflash_calibrate`` / ``adaflash_max_skip`` tune it);
- ``adaflash_gamma`` / ``adaflash_min_len``: override the config's γ and minimum draft length;
- ``adaflash_proposal``: under sampling, ``"argmax"`` (default: one-hot q on the drafter's argmax, lossless) or
  ``"sample"`` (q = the processed drafter distribution the proposals were drawn from);
- ``adaflash_draft_source``: ``"auto"`` (default: ``"hybrid"``), ``"hybrid"`` (each round verifies either the block
  or a lookup continuation from the sequence itself, whichever is expected to keep more tokens: ``adaflash_hf.lookup``;
  lookup proposals have one-hot q, so sampling stays lossless) or ``"diffusion"`` (every round drafts a block);
- ``adaflash_lookup_min_prob``: hybrid only, cut a lookup continuation to the tokens whose estimated chance of being
  reached and accepted is at least this (default 0: the whole continuation; ``policy.truncate_lookup``).

Stopping criteria (stop strings, a user's ``StoppingCriteria``) end the output where plain decoding would: no draft
past the first prefix a criterion meets is verified. EOS lists, ``min_new_tokens`` and ``max_length`` hold token by
token; ``max_time`` stops at a round's end (a prefix of the greedy output). A ``cache`` from an earlier call
continues exactly: the prefill feeds only the uncached tokens and the drafter's context starts after them.

A drafter with ``draft_token_ids`` drafts over that subset only (``adaflash_hf.draft_vocab``), in both proposal modes.
``drafter.last_stats`` describes the last AdaFlash ``generate`` call with that drafter: an ``AdaFlashStats``, or
None before any call, after a call that failed before it drafted, and once ``disable()`` hands generate back to
transformers' native path. ``drafter.round_recorder`` (a callable, default None) receives a ``RoundRecord`` per
drafting round. A non-finite drafter block verifies no drafts that round (counted in
``AdaFlashStats.nonfinite_blocks``, warned once per call).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, replace

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.utils import logging

from adaflash_hf.acceptance import lookup_model_for
from adaflash_hf.draft_vocab import draft_logits
from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.lookup import LookupIndex
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.policy import (
    Block,
    Choice,
    Round,
    Slot,
    Step,
    expected_lookup_accepted,
    policy_for,
    truncate_lookup,
)
from adaflash_hf.stats import AdaFlashStats, RoundRecord

logger = logging.get_logger(__name__)

# Criteria the upstream loop already applies token by token inside an accepted chunk (it cuts the chunk at the first
# EOS and at max_length), or that depend on the clock rather than on the text (max_time stops at a chunk boundary).
_CHUNK_SAFE_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
# Drafters whose last_stats the hook set: disable() clears them, since the calls that follow (transformers' native
# path) are invisible to adaflash_hf and must not be mistaken for the stats' call.
_DRAFTERS_WITH_STATS: weakref.WeakSet = weakref.WeakSet()


def drafting_settings(generation_config, drafter: AdaFlashDrafter) -> DraftingSettings:
    """The call's ``DraftingSettings`` from its ``adaflash_*`` fields, γ and min_len resolved against the drafter."""
    settings = DraftingSettings.from_generation_config(generation_config).resolve(drafter.config)
    settings = replace(settings, length_mode=settings.length_mode_for(bool(generation_config.do_sample)))
    if settings.lookup_history_tokens is not None:
        raise ValueError(
            "generation_config.adaflash_lookup_history_tokens: expected None with generate (a shared history of "
            f"finished outputs is the engine's, adaflash_hf.serving), got {settings.lookup_history_tokens!r}"
        )
    return settings


def _check_call(target, generation_config, input_ids, model_kwargs) -> int:
    """The call's checks that need the prompt (still before any forward); returns how many of its positions a
    passed-in cache already holds."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"input_ids: expected batch size 1 for generate(assistant_model=...) (use adaflash_hf.serving's "
            f"AdaFlashEngine for batches), got {input_ids.shape[0]}"
        )
    if input_ids.shape[1] == 0:
        if model_kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                "inputs_embeds: expected input_ids with an AdaFlash assistant (drafts and lookups are token ids "
                "and the drafter embeds the committed tokens itself), got inputs_embeds without input_ids"
            )
        raise ValueError("input_ids: expected at least one token, got an empty prompt")
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 1 << 62
    if generation_config.max_length > max_positions:
        prompt = input_ids.shape[1]
        raise ValueError(
            f"prompt length + max_new_tokens: expected <= the target's max_position_embeddings={max_positions}, "
            f"got {prompt} + {generation_config.max_length - prompt}"
        )
    cache = model_kwargs.get("cache")
    if cache is not None and not getattr(cache, "is_croppable", True):
        raise ValueError(f"cache: expected a croppable cache, got {type(cache).__name__}")
    cached = 0 if cache is None else int(cache.get_seq_length())
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"cache: expected fewer cached positions than the prompt's {input_ids.shape[1]} tokens (the prompt "
            f"continues the cached text), got a cache holding {cached}"
        )
    return cached


@dataclass(frozen=True)
class PendingRound:
    """One round between ``get_candidates`` and ``update_candidate_strategy``: what it verifies and how it got
    there (``drafted``: the block's float logits over V for its projected rows; None where no block was drafted)."""

    started: float
    drafter_seconds: float
    round: Round
    choice: Choice
    predicted: float  # the length head's â, or a lookup's expected accepted tokens / (block_size - 1)
    context_length: int
    anchor: int
    proposed: torch.Tensor
    drafted: torch.Tensor | None = None


class AdaFlashCandidateGenerator(CandidateGenerator):
    """Each round: the drafting policy (``adaflash_hf.policy``, as a batch of one) decides whether the drafter runs
    and what is verified: the first k rows of the drafter's block, or (hybrid) a lookup continuation, or nothing.

    Drafter-cache invariant: before a drafter forward the cache plus ``context_buffer`` hold every committed
    position except the newest token (the anchor, whose target hidden state does not exist yet) and those a
    passed-in cache already held; the cache may also hold the last drafter forward's block rows, which are evicted
    first. Only committed positions are ever fed as context. The buffer holds the features of the positions
    committed since the last drafter forward (a round that skips the drafter only buffers them).
    """

    requires_model_outputs = True

    def __init__(
        self, target, drafter: AdaFlashDrafter, generation_config, logits_processor, input_ids, model_kwargs
    ):
        from transformers.cache_utils import DFlashCache

        # A cache from an earlier call holds the first ``cached_prefix`` positions: the prefill feeds only the rest,
        # and the drafter's context starts after them (this call never computes their target states).
        self.cached_prefix = _check_call(target, generation_config, input_ids, model_kwargs)
        self.drafter = drafter
        self.config = drafter.config
        self.block_size = drafter.config.block_size
        # Only the tapped layers' states, unless the caller asked for them all (they are returned to it then).
        self.forward_overrides = {
            "output_hidden_states": True
            if generation_config.output_hidden_states
            else drafter.config.target_hidden_state_ids
        }
        self.model_kwargs_overrides = self.forward_overrides
        criteria = getattr(generation_config, "_adaflash_stopping_criteria", None) or ()
        self.stop_criteria = [c for c in criteria if not isinstance(c, _CHUNK_SAFE_CRITERIA)]
        self.cache = DFlashCache(config=drafter.config)
        self.embedding_weight = target.get_input_embeddings().weight
        self.lm_head = target.get_output_embeddings()
        self.logits_processor = logits_processor
        self.do_sample = generation_config.do_sample
        self.max_length = generation_config.max_length
        self.settings = drafting_settings(generation_config, drafter)
        eos = generation_config.eos_token_id
        self.eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        self.lookup_index = LookupIndex()
        self.stats = AdaFlashStats(block_size=self.block_size)
        drafter.last_stats = self.stats
        _DRAFTERS_WITH_STATS.add(drafter)
        self.recorder = getattr(drafter, "round_recorder", None)
        self.version = int(getattr(drafter, "weights_version", 0))
        self.num_cached = self.cached_prefix
        self.context_buffer: torch.Tensor | None = None  # [1, n, features]: not yet in the drafter cache
        self.block_in_cache = False
        self.pending: PendingRound | None = None
        self.policy = policy_for(
            self.settings.length_mode,
            self.settings,
            target,
            drafter,
            "generate",
            output_hidden_states=self.forward_overrides["output_hidden_states"],
        )
        self.state = self.policy.new_state(lookup_model_for(target), greedy=not self.do_sample)

    @torch.no_grad()
    def get_candidates(
        self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs
    ):
        cur_len = input_ids.shape[1]
        self.pending = None
        self.model_kwargs_overrides = self.forward_overrides
        if is_first_iteration:
            # Prefill: the target's first forward yields the context. transformers' assisted loop feeds the whole
            # prompt even where a passed-in cache already holds its first positions: feed only the rest.
            if self.cached_prefix:
                self.model_kwargs_overrides = {
                    **self.forward_overrides,
                    "input_ids": input_ids[:, self.cached_prefix :],
                    "position_ids": model_kwargs["position_ids"][:, self.cached_prefix :],
                }
            return input_ids, None
        if self.max_length - cur_len <= 1:
            return input_ids, None  # only the bonus token still fits
        self._buffer_context(cur_len, model_outputs)
        # Never verify drafts that could not be kept: the bonus token needs one slot of max_length (which
        # _check_call keeps inside the target's positions).
        room = max(0, min(self.block_size - 1, self.max_length - cur_len - 1))
        slot = Slot(self.state, room, self._lookup_proposal(input_ids, room), cur_len)
        # The drafter's seconds start after ``start``: a first round calibrates the cost model there.
        round_ = self.policy.start([slot], Step())
        started = time.perf_counter()
        block, out = None, None
        if round_.drafts[0]:
            out = self._drafter_forward(input_ids, model_kwargs)
            block, drafted = self._block(out, room)
        choice = self.policy.choose(round_, [block])[0]
        if choice.source == "plain":
            return self._plain_round(input_ids, round_, choice, started)
        if choice.source == "lookup":
            return self._lookup_round(input_ids, round_, choice, started)
        return self._diffusion_round(input_ids, round_, choice, out, drafted, started)

    def _buffer_context(self, cur_len: int, model_outputs) -> None:
        """Buffer the committed positions whose target states the last forward produced (all but the anchor)."""
        buffered = 0 if self.context_buffer is None else self.context_buffer.shape[1]
        num_new = cur_len - 1 - self.num_cached - buffered
        hidden = model_outputs.hidden_states
        new_context = torch.cat([hidden[i][:, :num_new] for i in self.config.target_hidden_state_ids], dim=-1)
        self.context_buffer = (
            new_context if self.context_buffer is None else torch.cat([self.context_buffer, new_context], 1)
        )

    def _lookup_proposal(self, input_ids, room: int):
        """The lookup continuation of the committed text (hybrid; None otherwise), cut by ``lookup_min_prob``."""
        if self.settings.draft_source != "hybrid":
            return None
        self.lookup_index.extend(input_ids[0, len(self.lookup_index) :].tolist())
        proposal = self.lookup_index.propose(room, self.eos_ids)
        return truncate_lookup(proposal, self.state.lookups, self.settings.lookup_min_prob)

    def _block(self, out, room: int) -> tuple[Block, torch.Tensor]:
        """What the drafter's block says (â, finiteness and the confidences of the rows the policy reads), and the
        float logits of the rows projected so far."""
        head = float(out.acceptance_prob.float().reshape(-1)[0])
        finite = math.isfinite(head) and bool(torch.isfinite(out.last_hidden_state).all())
        if not finite:
            self._count_nonfinite_block()
            head = 0.0
        self.state.last_acceptance = head
        drafted, confidences, tokens = out.last_hidden_state.new_zeros(1, 0, 0), [], []
        rows = self.policy.confidence_rows(room, (), head) if finite else 0
        if rows:
            drafted, confidences = self._confident_rows(out.last_hidden_state, rows, room, head)
            tokens = drafted[0, : len(confidences)].argmax(-1).tolist()
        return Block(head, finite, tuple(confidences), tuple(tokens)), drafted

    def _confident_rows(self, block_hidden, rows: int, room: int, head: float):
        """Logits of block rows 1..n and the drafter's confidence in each proposal (its softmax maximum): the first
        ``rows``, then the further rows the policy reads given those (the lm_head rows are what costs)."""
        drafted, confidences = self._block_logits(block_hidden[:, 1 : 1 + rows])
        wanted = self.policy.confidence_rows(room, confidences, head)
        if wanted > rows:
            more, more_confidences = self._block_logits(block_hidden[:, 1 + rows : 1 + wanted])
            drafted, confidences = torch.cat([drafted, more], dim=1), confidences + more_confidences
        return drafted, confidences

    def _drafter_forward(self, input_ids, model_kwargs):
        """One drafter forward: the buffered context joins the cache, the block [anchor, MASK...] replaces the
        last forward's block rows there."""
        context, self.context_buffer = self.context_buffer, None
        num_new = context.shape[1]
        if self.block_in_cache:
            self.cache.crop(-self.block_size)
        position_ids = model_kwargs["position_ids"][:, -num_new - 1 : -1]
        block_positions = torch.arange(self.block_size, device=position_ids.device) + position_ids[:, -1:] + 1
        attention_mask = model_kwargs.get("attention_mask")
        if attention_mask is not None:
            attention_mask = torch.cat(
                [attention_mask[:, self.cached_prefix : -1], attention_mask.new_ones(1, self.block_size)],
                dim=-1,
            )
        device = self.drafter.device
        noise = self.drafter.block_embeds(self.embedding_weight, input_ids[:, -1]).to(device)
        out = self.drafter(
            noise_embeds=noise,
            context_hidden_states=context.to(device=device, dtype=noise.dtype),
            position_ids=torch.cat([position_ids, block_positions], dim=-1).to(device),
            attention_mask=None if attention_mask is None else attention_mask.to(device),
            cache=self.cache,
        )
        self.num_cached += num_new
        self.block_in_cache = True
        return out

    def _block_logits(self, block_rows):
        """Float logits of drafter block rows over the whole vocabulary (the draft vocabulary's, scattered), and the
        drafter's confidence in each row's argmax (its softmax maximum, a list)."""
        logits, token_ids = draft_logits(block_rows, self.lm_head, self.drafter.draft_token_ids)
        drafted = logits.float()
        confidences = torch.softmax(drafted[0], dim=-1).amax(dim=-1).nan_to_num(0.0).tolist()
        if token_ids is not None:
            # Processors and the verifier index the whole vocabulary. -inf outside the draft vocabulary: no such token
            # is proposed and q (one-hot, or the processed distribution sampled from) is 0 there, so the verifier's
            # residual max(p - q, 0) keeps all the target's mass outside the subset: still lossless.
            full = drafted.new_full((*drafted.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
            drafted = full.index_copy_(-1, token_ids, drafted)
        return drafted, confidences

    def _count_nonfinite_block(self) -> None:
        if not self.stats.nonfinite_blocks:
            logger.warning(
                "drafter: non-finite block states (NaN/inf weights or inputs?); such rounds verify no drafts, "
                "output unchanged. Counted in drafter.last_stats.nonfinite_blocks; warned once per call."
            )
        self.stats.nonfinite_blocks += 1

    def _pending(self, input_ids, round_, choice, started, predicted, proposed, drafted=None) -> PendingRound:
        return PendingRound(
            started=time.perf_counter(),
            drafter_seconds=time.perf_counter() - started,
            round=round_,
            choice=choice,
            predicted=predicted,
            context_length=input_ids.shape[1] - 1,
            anchor=int(input_ids[0, -1]),
            proposed=proposed,
            drafted=drafted,
        )

    def _plain_round(self, input_ids, round_, choice, started):
        """Verify nothing and skip the drafter: its context waits in the buffer."""
        self.stats.skipped_drafter_forwards += 1
        self.pending = self._pending(input_ids, round_, choice, started, 0.0, input_ids[0, :0])
        return input_ids, None

    def _lookup_round(self, input_ids, round_, choice, started):
        """Verify the lookup continuation's first ``choice.length`` tokens: one-hot q under sampling (accepted with
        probability p(x), resampled from p without x: lossless), no q under greedy."""
        if not choice.drafter_ran:
            self.stats.skipped_drafter_forwards += 1
        cur_len, slot = input_ids.shape[1], round_.slots[0]
        tokens = torch.tensor(
            [slot.proposal.tokens[: choice.length]], dtype=input_ids.dtype, device=input_ids.device
        )
        candidate_ids = torch.cat([input_ids, tokens], dim=-1)
        cut = self._before_stop(candidate_ids, cur_len)
        tokens, candidate_ids = tokens[:, :cut], candidate_ids[:, : cur_len + cut]
        choice = replace(choice, length=cut)
        logits = None
        if self.do_sample and cut:
            vocab = self.lm_head.weight.shape[0]
            logits = torch.full((1, cut, vocab), float("-inf"), device=input_ids.device)
            logits.scatter_(-1, tokens[..., None], 0.0)
        predicted = expected_lookup_accepted(slot.state, slot.proposal, cut) / (self.block_size - 1)
        self.pending = self._pending(
            input_ids, round_, choice, started, predicted, candidate_ids[0, cur_len:]
        )
        return candidate_ids, logits

    def _diffusion_round(self, input_ids, round_, choice, out, drafted, started):
        """Propose the block's first ``choice.length`` rows (the lm_head over V is the expensive part: only the
        verified rows are projected, and every row where a recorder wants the whole block)."""
        cur_len, length = input_ids.shape[1], choice.length
        rows = self.block_size - 1 if self.recorder is not None else length
        if drafted.shape[1] < rows:
            more, _ = self._block_logits(out.last_hidden_state[:, 1 + drafted.shape[1] : 1 + rows])
            drafted = more if not drafted.shape[1] else torch.cat([drafted, more], dim=1)
        candidate_ids, candidate_logits = self._propose(input_ids, drafted, length)
        cut = self._before_stop(candidate_ids, cur_len)
        if cut < length:
            length, candidate_ids = cut, candidate_ids[:, : cur_len + cut]
            candidate_logits = None if candidate_logits is None else candidate_logits[:, :cut]
        choice = replace(choice, length=length)
        predicted = self.state.last_acceptance
        self.pending = self._pending(
            input_ids, round_, choice, started, predicted, candidate_ids[0, cur_len:], drafted
        )
        if length == 0:
            # An empty draft must be (input_ids, None): zero-length logits crash transformers' speculative sampling.
            return input_ids, None
        return candidate_ids, candidate_logits

    def _before_stop(self, candidate_ids, cur_len: int) -> int:
        """How many of the candidates after ``cur_len`` may be verified so that no stopping criterion can fire
        inside the accepted chunk: the drafts before the first one whose prefix meets a criterion. transformers'
        loop checks the criteria once, at the chunk's end (and cuts at EOS and max_length itself); if that draft is
        right, the target's own bonus token completes the stop at the chunk's end, as plain decoding stops there."""
        drafts = candidate_ids.shape[1] - cur_len
        for j in range(1, drafts + 1) if self.stop_criteria else ():
            prefix = candidate_ids[:, : cur_len + j]
            if any(bool(criterion(prefix, None).any()) for criterion in self.stop_criteria):
                return j - 1
        return drafts

    def _propose(self, input_ids, drafted_logits, length):
        """Proposals and the q logits returned to the verifier.

        Processors run position by position over the growing candidate prefix, as the target's logits are processed.
        ``argmax`` proposals return one-hot q (0 at the proposal, -inf elsewhere), so speculative sampling accepts
        with probability p(x) and resamples from p without x: lossless. ``sample`` returns the processed logits the
        proposals were drawn from, so q is exactly the sampling distribution.
        """
        logits = drafted_logits[:, :length].clone()
        candidate_ids = input_ids
        for i in range(length):
            if self.logits_processor:
                logits[:, i] = self.logits_processor(candidate_ids, logits[:, i])
            if self.do_sample and self.settings.proposal == "sample":
                token = torch.multinomial(torch.softmax(logits[:, i], dim=-1), num_samples=1)
            else:
                token = logits[:, i].argmax(dim=-1, keepdim=True)
            candidate_ids = torch.cat([candidate_ids, token.to(candidate_ids.device)], dim=-1)
        if self.do_sample and self.settings.proposal == "argmax" and length:
            proposals = candidate_ids[:, input_ids.shape[1] :]
            logits = torch.full_like(logits, float("-inf")).scatter_(
                -1, proposals[..., None].to(logits.device), 0.0
            )
        return candidate_ids, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.stats.target_forwards += 1
        pending, self.pending = self.pending, None
        if pending is None:
            return
        accepted, choice = int(num_matches), pending.choice
        verify_seconds = time.perf_counter() - pending.started
        self.stats.verify_seconds += verify_seconds
        self.stats.drafter_seconds += pending.drafter_seconds
        self.stats.add_round(choice.length, accepted, pending.predicted, choice.source)
        self.policy.learn(pending.round, [choice], [accepted])
        self.policy.observe_step(choice.length + 1, Step(), verify_seconds)
        if choice.drafter_ran:
            self.policy.observe_drafter(1, pending.drafter_seconds)
        self.state.observe_committed(input_ids[0].tolist())
        if self.recorder is not None and choice.source != "plain":
            self._record(pending, accepted)

    def _record(self, pending: PendingRound, accepted: int) -> None:
        """A diffusion round records every block row's proposal; a lookup round its verified proposals."""
        drafted = pending.proposed
        if pending.choice.source == "diffusion" and pending.drafted.shape[1]:
            drafted = pending.drafted[0].argmax(dim=-1)
            drafted[: pending.choice.length] = pending.proposed.to(drafted.device)
        self.recorder(
            RoundRecord(
                context_length=pending.context_length,
                anchor_token=pending.anchor,
                drafted_tokens=drafted.tolist(),
                draft_length=pending.choice.length,
                predicted_acceptance=pending.predicted,
                accepted=accepted,
                drafter_version=self.version,
                source=pending.choice.source,
            )
        )
