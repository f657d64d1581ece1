"""Hybrid drafting: the lookup proposer, the per-round choice between it and the diffusion block, and that both
``generate`` and the engine stay lossless with it (greedy exact, sampling marginals, batched == serial)."""

import random

import pytest
import torch
from transformers import GenerationConfig

import adaflash_hf.policy
import adaflash_hf.serving.engine
from adaflash_hf import AdaFlashCandidateGenerator
from adaflash_hf.acceptance import LookupModel
from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.lookup import LookupIndex, LookupProposal
from adaflash_hf.policy import lookup_beats_block, truncate_lookup
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from tests.conftest import (
    FAMILY_ALPHA,
    POSITIONS,
    SCALE,
    SHARPNESS,
    VOCAB,
    assert_outputs_equal_references,
    exact_marginals,
    finished_requests,
    greedy_reference,
    make_batched_oracle,
    min_p_value,
    run_with_churn,
    sample_counts,
)

# A prompt that repeats itself, so lookup has matches from the first round on.
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 8, 41, 5, 17, 99, 3, 250]])
# With the qwen3 test target, this prompt and its 8 greedy tokens repeat no token: lookup never has a match.
NO_REPEAT_PROMPT = [111, 280, 3, 206, 476, 327]


def index_of(tokens, max_ngram=8) -> LookupIndex:
    index = LookupIndex(max_ngram)
    index.extend(tokens)
    return index


# ------------------------------------------------------------------------------------------- the proposer
def test_no_match_proposes_nothing():
    assert index_of([1, 2, 3, 4]).propose(5) is None
    assert index_of([7]).propose(5) is None
    assert index_of([1, 2, 1]).propose(0) is None  # no room


def test_match_right_before_the_end_repeats_the_suffix():
    proposal = index_of([4, 5, 6, 5, 6]).propose(5)
    assert proposal.tokens == [5, 6, 5, 6, 5]
    assert proposal.match_length == 2


def test_overlapping_repeats_take_the_longest_match_and_extend_periodically():
    proposal = index_of([1, 2, 1, 2, 1, 2]).propose(4)
    assert proposal.match_length == 4
    assert proposal.tokens == [1, 2, 1, 2]


def test_a_match_longer_than_the_block_proposes_one_block():
    text = list(range(30))
    proposal = index_of(text + text[:20], max_ngram=32).propose(15)
    assert proposal.match_length == 20
    assert proposal.tokens == text[20:30] + text[:5]


def test_matches_longer_than_max_ngram_count_as_max_ngram():
    text = list(range(30))
    assert index_of(text + text[:20], max_ngram=8).propose(15).match_length == 8


def test_eos_inside_the_continuation_ends_the_proposal():
    proposal = index_of([1, 2, 3, 0, 9, 1, 2]).propose(10, eos_ids=[0])
    assert proposal.tokens == [3, 0]


def test_support_counts_how_often_the_continuation_followed():
    proposal = index_of([1, 2, 1, 2, 1, 5, 1], max_ngram=1).propose(1)
    assert proposal.tokens == [5]
    assert proposal.support == pytest.approx(1 / 3)


def test_extend_is_incremental():
    whole = index_of([3, 1, 4, 1, 5, 3, 1])
    parts = index_of([3, 1, 4])
    parts.extend([1, 5])
    parts.extend([3, 1])
    assert parts.ends == whole.ends
    assert parts.propose(4) == whole.propose(4)


def test_another_sequence_is_continued_up_to_its_end():
    history = LookupIndex()
    history.add([1, 2, 3, 4])
    history.add([9, 2, 3, 7, 8])
    newest = history.propose(5, suffix=[5, 2, 3])  # the most recent occurrence
    assert newest.tokens == [7, 8] and newest.match_length == 2
    assert history.propose(5, suffix=[0, 1, 2]).tokens == [3, 4]  # up to its sequence's end, not periodic
    assert history.propose(5, suffix=[3, 4]) is None  # its only occurrence ends its sequence: nothing follows
    assert history.propose(5, suffix=[6]) is None


def test_history_evicts_the_oldest_sequences_beyond_its_cap():
    history = LookupIndex(max_tokens=6)
    history.add([1, 2, 3])
    history.add([4, 5, 6])
    history.add([7, 8])
    assert len(history) == 5 and list(history.sequences.values()) == [[4, 5, 6], [7, 8]]
    assert history.propose(3, suffix=[1]) is None
    assert all(occurrences for occurrences in history.ends.values())
    assert (1,) not in history.ends and history.propose(3, suffix=[4]).tokens == [5, 6]


# --------------------------------------------------------------------------------------------- the choice
def test_choice_no_proposal_is_diffusion():
    assert not lookup_beats_block(None, LookupModel(), 0.0, 16)


def test_choice_long_confident_match_beats_a_weak_block_and_loses_to_a_strong_one():
    proposal = LookupProposal(tokens=list(range(15)), match_length=8, support=1.0)
    assert lookup_beats_block(proposal, LookupModel(), 0.1, 16)
    assert not lookup_beats_block(proposal, LookupModel(), 0.9, 16)


def _observed(rounds: int, accepted: int, length: int = 15, match_length: int = 4) -> LookupModel:
    model = LookupModel()
    for _ in range(rounds):
        model.observe(match_length, length, accepted)
    return model


def test_choice_lookup_rejections_lower_its_estimate():
    proposal = LookupProposal(tokens=list(range(15)), match_length=4, support=1.0)
    assert lookup_beats_block(proposal, _observed(30, 15), 0.3, 16)
    assert not lookup_beats_block(proposal, _observed(30, 0), 0.3, 16)


def test_choice_non_finite_block_lets_any_proposal_win():
    proposal = LookupProposal(tokens=[1], match_length=1, support=0.5)
    assert lookup_beats_block(proposal, LookupModel(), float("nan"), 16)


def test_a_sampled_requests_lookup_model_neither_reads_nor_teaches_the_shared_one():
    # A seed must reproduce a sample: a sampled request's drafts (and so the random numbers its verification draws)
    # may depend on its own tokens only, not on what earlier calls taught the shared model.
    shared = LookupModel(strength=2.0)
    policy = adaflash_hf.policy.RulePolicy(DraftingSettings(), block_size=16, fixed=False)
    sampled, greedy = policy.new_state(shared, greedy=False), policy.new_state(shared, greedy=True)
    assert sampled.lookups.parent is None and greedy.lookups.parent is shared
    sampled.lookups.observe(3, 4, 0)
    assert shared.counts == {}
    greedy.lookups.observe(3, 4, 0)
    assert shared.counts != {}


def test_truncation_keeps_the_tokens_likely_to_be_reached_and_accepted():
    proposal = LookupProposal(tokens=list(range(15)), match_length=3, support=1.0)
    model = LookupModel(strength=1.0)  # a prior of support * n / (n + 1) = 0.75 at tokens 1 and 2
    model.observe(3, 4, 1)  # first accepted (2 / 2 with the prior), the next one rejected (0.75 / 2)
    rates = model.rates(proposal)
    assert rates[:2] == [pytest.approx(0.875), pytest.approx(0.375)]
    assert rates[2:] == pytest.approx([0.375] * 13)  # untried tokens: the rate of the token before
    cut = truncate_lookup(proposal, model, 0.3)
    assert cut.tokens == [0, 1]  # 0.875 * 0.375 = 0.33 >= 0.3 > 0.875 * 0.375^2 = 0.12
    assert (cut.match_length, cut.support) == (3, 1.0)
    assert truncate_lookup(proposal, model, 0.0) is proposal  # 0: the whole continuation
    assert truncate_lookup(proposal, model, 0.99).tokens == [0]  # at least one token
    confident = _observed(200, 15, match_length=3)
    assert truncate_lookup(proposal, confident, 0.5).tokens == list(range(15))
    assert truncate_lookup(None, model, 0.5) is None


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.3", True])
def test_bad_lookup_min_prob_raises_before_any_forward(value, target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    calls = []
    for model in (target, drafter):
        model.register_forward_pre_hook(lambda *_: calls.append(1))
    config = GenerationConfig(
        max_new_tokens=4, adaflash_draft_source="hybrid", adaflash_lookup_min_prob=value
    )
    with pytest.raises(
        ValueError, match=r"^generation_config\.adaflash_lookup_min_prob: expected a number in \[0, 1\), got"
    ):
        target.generate(PROMPT, assistant_model=drafter, generation_config=config)
    with pytest.raises(ValueError, match=r"^lookup_min_prob: expected a number in \[0, 1\), got"):
        AdaFlashEngine(target, drafter, draft_source="hybrid", lookup_min_prob=value)
    assert calls == []


# -------------------------------------------------------------------------------------------- generate
def coin_chooser(monkeypatch, seed=0):
    """Replace the rule by a seeded coin (independent of the target, so still lossless): mixed rounds, and both
    the skipped-drafter and the drafter-ran-but-lookup-won paths."""
    rng = random.Random(seed)
    monkeypatch.setattr(
        adaflash_hf.policy, "lookup_beats_block", lambda proposal, *_: bool(proposal) and rng.random() < 0.5
    )


def greedy(target, ids, n, drafter=None, **config):
    # Hybrid's own rule (lookup_beats_block against the head's â) is the adaptive path's; goodput has its tests elsewhere.
    config = GenerationConfig(
        max_new_tokens=n, do_sample=False, **{"adaflash_length_mode": "adaptive", **config}
    )
    return target.generate(ids, assistant_model=drafter, generation_config=config)


@pytest.mark.parametrize("k", [0, 1, 8, 15])
def test_hybrid_greedy_matches_plain_over_mixed_rounds_for_every_length(
    k, target_factory, oracle_factory, monkeypatch
):
    target = target_factory("qwen3")
    reference = target.generate(PROMPT, max_new_tokens=60, do_sample=False)
    oracle = oracle_factory(target, reference, seed=k)
    coin_chooser(monkeypatch, seed=k)
    out = greedy(
        target, PROMPT, 60, oracle, adaflash_draft_source="hybrid", adaflash_gamma=1e-9, adaflash_min_len=k
    )
    assert torch.equal(out, reference)
    stats = oracle.last_stats
    assert {"diffusion", "lookup"} <= set(stats.sources)
    assert sum(stats.source_share.values()) == pytest.approx(1.0)


def test_hybrid_with_its_own_rule_matches_plain_greedy(target_factory, drafter_factory):
    target = target_factory("llama")
    reference = target.generate(PROMPT, max_new_tokens=48, do_sample=False)
    drafter = drafter_factory(target)
    out = greedy(target, PROMPT, 48, drafter, adaflash_draft_source="hybrid")
    assert torch.equal(out, reference)
    assert len(drafter.last_stats.sources) == drafter.last_stats.drafting_rounds


def head_saying(monkeypatch, drafter, acceptance: float) -> list:
    """Force the length head's â; returns the list the drafter forwards are counted in."""
    forwards, original = [], type(drafter).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.acceptance_prob = torch.full_like(out.acceptance_prob, acceptance)
        forwards.append(1)
        return out

    monkeypatch.setattr(type(drafter), "forward", forward)
    return forwards


def test_a_pessimistic_length_head_hands_rounds_to_lookup_and_skips_the_drafter(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    reference = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    drafter = drafter_factory(target)
    forwards = head_saying(monkeypatch, drafter, 0.0)
    assert torch.equal(greedy(target, PROMPT, 40, drafter, adaflash_draft_source="hybrid"), reference)
    sources = drafter.last_stats.sources
    assert sources.count("lookup") > 0  # every round that had a match (the others: no proposal, the block)
    # The first round's drafter forward gave â = 0; from then on a lookup round never runs the drafter.
    assert len(forwards) <= sources.count("diffusion") + 1


def test_a_confident_length_head_keeps_the_block(target_factory, drafter_factory, monkeypatch):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    head_saying(monkeypatch, drafter, 1.0)
    greedy(target, PROMPT, 40, drafter, adaflash_draft_source="hybrid")
    assert set(drafter.last_stats.sources) == {"diffusion"}


def test_drafter_is_fed_every_committed_position_once_even_when_lookup_skips_it(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    block = drafter.config.block_size
    fed, forwards = [], []
    original = type(drafter).forward

    def spy(self, *args, **kwargs):
        fed.extend(kwargs["position_ids"][0, :-block].tolist())
        forwards.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "forward", spy)
    coin_chooser(monkeypatch, seed=3)
    out = greedy(target, PROMPT, 40, drafter, adaflash_draft_source="hybrid")
    stats = drafter.last_stats
    assert len(forwards) < stats.drafting_rounds, "some lookup rounds skipped the drafter"
    # Context positions 0.. in order, no gap and no repeat, up to (at most) the last anchor.
    assert fed == list(range(len(fed)))
    assert len(fed) <= out.shape[1] - 1


def test_a_request_without_lookup_matches_behaves_exactly_like_diffusion_only(
    target_factory, drafter_factory
):
    target = target_factory("qwen3")
    prompt = torch.tensor([NO_REPEAT_PROMPT])
    drafter = drafter_factory(target)
    diffusion = greedy(target, prompt, 8, drafter)
    tokens = diffusion[0].tolist()
    assert len(set(tokens)) == len(tokens), "precondition: no token repeats, so lookup never matches"
    diffusion_stats = drafter.last_stats.to_dict()
    hybrid = greedy(target, prompt, 8, drafter, adaflash_draft_source="hybrid")
    assert torch.equal(hybrid, diffusion)
    hybrid_stats = drafter.last_stats.to_dict()
    for key in ("verify_lengths", "accepted_lengths", "predicted_acceptance", "sources"):
        assert hybrid_stats[key] == diffusion_stats[key]
    assert set(hybrid_stats["sources"]) == {"diffusion"}


def test_round_records_carry_the_source(target_factory, drafter_factory, monkeypatch):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    records = []
    drafter.round_recorder = records.append
    coin_chooser(monkeypatch, seed=1)
    greedy(target, PROMPT, 30, drafter, adaflash_draft_source="hybrid")
    assert [r.source for r in records] == drafter.last_stats.sources
    for record in records:
        if record.source == "lookup":
            assert len(record.drafted_tokens) == record.draft_length


# ------------------------------------------------------------------------------------------ sampling law
SAMPLING_PROMPT = torch.tensor([[3, 9, 1, 12, 5, 3, 9]])  # "3 9" recurs: lookup proposes "1 12 5 ..."


@pytest.fixture(scope="module")
def sampling_setup(target_factory, oracle_factory):
    target = target_factory("qwen3", seed=7, vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(SCALE)
    reference = target.generate(SAMPLING_PROMPT, do_sample=False, max_new_tokens=POSITIONS + 16)
    drafter = oracle_factory(target, reference, seed=8, sharpness=SHARPNESS, mask_token_id=VOCAB - 1)
    return target, drafter, exact_marginals(target, SAMPLING_PROMPT)


HYBRID_SAMPLES = 250  # fewer than the diffusion test's 1000, to keep it short; the broken control still fails


def hybrid_counts(target, drafter):
    return sample_counts(
        target,
        drafter,
        "argmax",
        prompt=SAMPLING_PROMPT,
        num_samples=HYBRID_SAMPLES,
        adaflash_draft_source="hybrid",
    )


def test_hybrid_sampled_marginals_equal_the_targets(sampling_setup, monkeypatch):
    target, drafter, marginals = sampling_setup
    coin_chooser(monkeypatch, seed=5)
    original, lookups = AdaFlashCandidateGenerator._lookup_round, []

    def counted(self, *args):
        lookups.append(1)
        return original(self, *args)

    monkeypatch.setattr(AdaFlashCandidateGenerator, "_lookup_round", counted)
    counts = hybrid_counts(target, drafter)
    assert len(lookups) > HYBRID_SAMPLES / 3, "lookup must draft a good share of the rounds"
    assert min_p_value(counts, marginals) > FAMILY_ALPHA / POSITIONS


def test_the_same_test_rejects_lookup_proposals_with_a_broken_q(sampling_setup, monkeypatch):
    target, drafter, marginals = sampling_setup
    coin_chooser(monkeypatch, seed=5)
    original = AdaFlashCandidateGenerator._lookup_round

    def accept_all(self, input_ids, *args):
        candidate_ids, logits = original(self, input_ids, *args)
        proposals = candidate_ids[:, input_ids.shape[1] :]
        # q(x) ~ 0 on every lookup proposal: p/q is huge, so speculative sampling accepts (almost) everything.
        return candidate_ids, torch.zeros_like(logits).scatter_(-1, proposals[..., None], -60.0)

    monkeypatch.setattr(AdaFlashCandidateGenerator, "_lookup_round", accept_all)
    counts = hybrid_counts(target, drafter)
    assert min_p_value(counts, marginals) < FAMILY_ALPHA / POSITIONS


# ------------------------------------------------------------------------------------------------ engine
def engine_prompts(n, seed):
    """Random prompts that repeat a piece of themselves (and the tiny random targets soon loop): lookup matches."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for k in torch.randint(2, 16, (n,), generator=g).tolist():
        piece = torch.randint(0, 500, (k,), generator=g)
        prompts.append(torch.cat([piece, torch.randint(0, 500, (3,), generator=g), piece]))
    return prompts


@pytest.mark.parametrize("seed, history", [(0, None), (1, None), (2, 64)])
def test_engine_hybrid_batched_equals_serial_under_churn(
    seed, history, target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    prompts = engine_prompts(8, seed)
    rng = random.Random(seed)
    params = [SamplingParams(max_new_tokens=rng.randint(1, 40)) for _ in prompts]
    expected = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    oracle, weight = make_batched_oracle(target, drafter_factory(target))
    engine = AdaFlashEngine(
        target,
        oracle,
        admission=AdmissionConfig(max_running=5),
        draft_source="hybrid",
        lookup_history_tokens=history,
        length_mode="adaptive",  # hybrid's own choice (the coin below), not goodput's timing-driven plan
    )
    references = {}
    oracle.arm(engine, references, weight, seed=seed)
    coin_chooser(monkeypatch, seed=seed)
    add = lambda rid, i: references.__setitem__(rid, prompts[i].tolist() + expected[i])  # noqa: E731
    results, aborted = run_with_churn(engine, prompts, params, seed, on_add=add)
    assert_outputs_equal_references(results, aborted, expected)
    assert sum(s.lookup_verifies for s in engine.stats) > 0
    assert sum(s.verifies - s.lookup_verifies for s in engine.stats) > 0
    assert max(s.running for s in engine.stats) > 1


@pytest.mark.parametrize("min_prob", [0.0, 0.3])
def test_engine_hybrid_with_its_own_rule_equals_generate(min_prob, target_factory, drafter_factory):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    prompts = engine_prompts(5, seed=3)
    expected = [greedy_reference(target, p, 16) for p in prompts]
    engine = AdaFlashEngine(target, drafter, draft_source="hybrid", lookup_min_prob=min_prob)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=16)) == expected


def test_truncated_lookup_stays_lossless_and_verifies_fewer_lookup_drafts(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    reference = target.generate(PROMPT, max_new_tokens=40, do_sample=False)
    verified = {}
    for min_prob in (0.0, 0.6):
        drafter = drafter_factory(target)
        head_saying(monkeypatch, drafter, 0.0)  # lookup wins whenever it has a match
        out = greedy(
            target, PROMPT, 40, drafter, adaflash_draft_source="hybrid", adaflash_lookup_min_prob=min_prob
        )
        assert torch.equal(out, reference)
        stats = drafter.last_stats
        verified[min_prob] = [k for k, s in zip(stats.verify_lengths, stats.sources) if s == "lookup"]
    assert verified[0.6] and max(verified[0.6]) < max(verified[0.0])


def test_engine_history_lets_a_repeated_request_copy_an_earlier_output(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    prompt = torch.tensor(NO_REPEAT_PROMPT)
    expected = greedy_reference(target, prompt, 8)
    monkeypatch.setattr(adaflash_hf.policy, "lookup_beats_block", lambda proposal, *_: proposal is not None)
    engine = AdaFlashEngine(
        target,
        drafter_factory(target),
        draft_source="hybrid",
        lookup_history_tokens=100,
        length_mode="adaptive",
    )
    assert engine.generate([prompt], SamplingParams(max_new_tokens=8)) == [expected]
    first_lookups = sum(s.lookup_verifies for s in engine.stats)
    assert first_lookups == 0  # its own sequence never repeats
    again = engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    request = finished_requests(engine.stream())[again]
    # The first output token matches the stored output's first token, whose continuation is the whole answer.
    assert request.output == expected
    assert request.verify_rounds == 1
    assert sum(s.lookup_accepted for s in engine.stats) == len(expected) - 2


def test_engine_request_without_lookup_matches_behaves_exactly_like_diffusion_only(
    target_factory, drafter_factory
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    prompt = torch.tensor(NO_REPEAT_PROMPT)
    runs = {}
    for source in ("diffusion", "hybrid"):
        engine = AdaFlashEngine(target, drafter, draft_source=source, length_mode="adaptive")
        records = []
        engine.round_recorder = lambda request, record: records.append(record)  # noqa: B023
        output = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
        runs[source] = output, [(r.draft_length, r.accepted, r.source) for r in records]
    tokens = prompt.tolist() + runs["diffusion"][0]
    assert len(set(tokens)) == len(tokens), "precondition: no token repeats, so lookup never matches"
    assert runs["hybrid"] == runs["diffusion"]


# ------------------------------------------------------------------------------------------------ errors
def test_bad_adaflash_draft_source_raises_before_any_forward(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    calls = []
    for model in (target, drafter):
        model.register_forward_pre_hook(lambda *_: calls.append(1))
    config = GenerationConfig(max_new_tokens=4, adaflash_draft_source="ngram")
    with pytest.raises(
        ValueError,
        match=r"^generation_config.adaflash_draft_source: expected one of \('auto', 'diffusion', 'hybrid'\), "
        r"got 'ngram'",
    ):
        target.generate(PROMPT, assistant_model=drafter, generation_config=config)
    assert calls == []


@pytest.mark.parametrize(
    ("with_drafter", "source", "match"),
    [
        (True, "ngram", r"^draft_source: expected one of \('auto', 'diffusion', 'hybrid'\), got 'ngram'"),
        (False, "hybrid", r"^draft_source: expected 'auto' or 'diffusion' without a drafter .*got 'hybrid'"),
    ],
)
def test_bad_engine_draft_source_raises_at_construction(
    with_drafter, source, match, target_factory, drafter_factory
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target) if with_drafter else None
    with pytest.raises(ValueError, match=match):
        AdaFlashEngine(target, drafter, draft_source=source)


@pytest.mark.parametrize(("source", "tokens"), [("diffusion", 64), ("hybrid", 0), ("hybrid", 2.5)])
def test_bad_lookup_history_raises_at_construction(source, tokens, target_factory, drafter_factory):
    target = target_factory("qwen3")
    with pytest.raises(ValueError, match=r"^lookup_history_tokens: expected None, or an int >= 1 .*got"):
        AdaFlashEngine(target, drafter_factory(target), draft_source=source, lookup_history_tokens=tokens)
