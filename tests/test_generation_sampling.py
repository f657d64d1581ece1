"""Sampling with AdaFlash is lossless: the marginal law of each generated position equals the target's.

The target has a 16-token vocabulary, so the exact marginals of the first three generated tokens are computed by
enumerating every prefix. Generated samples are compared with a chi-square goodness-of-fit test per position
(N = 1000 sequences, bins with expected count < 5 merged, Bonferroni over the three positions, family-wise level
1e-3). The same test must reject two deliberately broken proposal functions: "accept all" (q ~ 0 on every proposal)
and "wrong q" (q from the unprocessed drafter logits instead of the distribution the proposals were drawn from).
Everything runs twice: drafting over the full vocabulary and over a reduced draft vocabulary (``draft_token_ids``)
that lacks the target's most likely first token, so its mass must come from the verifier's residual.
"""

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf import AdaFlashCandidateGenerator
from adaflash_hf.cost_model import CostModel, use_cost_model
from tests.conftest import (
    FAMILY_ALPHA,
    POSITIONS,
    PROMPT,
    SCALE,
    SHARPNESS,
    VOCAB,
    exact_marginals,
    min_p_value,
    sample_counts,
)

# Holds the greedy continuation's 1 and 12 but not its first token 8 (target probability ~0.59 at position 1).
DRAFT_VOCAB = [0, 1, 2, 4, 7, 12, 14]


@pytest.fixture(scope="module", params=[None, DRAFT_VOCAB], ids=["full_vocab", "draft_vocab"])
def setup(request, target_factory, oracle_factory):
    target = target_factory("qwen3", seed=7, vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(SCALE)  # spread the logits so the law is far from uniform
    # Proposals follow the greedy continuation for a random number of rows: often accepted, so q matters.
    reference = target.generate(PROMPT, do_sample=False, max_new_tokens=POSITIONS + 16)
    drafter = oracle_factory(
        target, reference, seed=8, sharpness=SHARPNESS, mask_token_id=VOCAB - 1, draft_token_ids=request.param
    )
    return target, drafter, exact_marginals(target)


def goodput_settings(target) -> dict:
    """``length_mode="goodput"`` with verification free on this (profiled) machine, so drafts do get verified."""
    use_cost_model(target, "generate", CostModel.profile({1: 1.0, 16: 1.0}))
    return {"adaflash_length_mode": "goodput"}


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_sampled_marginals_equal_the_targets(proposal, setup):
    target, drafter, marginals = setup
    counts = sample_counts(target, drafter, proposal)
    assert drafter.last_stats.drafting_rounds >= 1
    assert min_p_value(counts, marginals) > FAMILY_ALPHA / POSITIONS


def test_goodput_sampled_marginals_equal_the_targets(setup):
    target, drafter, marginals = setup
    counts = sample_counts(target, drafter, "argmax", **goodput_settings(target))
    assert sum(drafter.last_stats.verify_lengths) >= 1
    assert min_p_value(counts, marginals) > FAMILY_ALPHA / POSITIONS


def _accept_all(self, input_ids, drafted_logits, length):
    candidate_ids, logits = _ORIGINAL_PROPOSE(self, input_ids, drafted_logits, length)
    proposals = candidate_ids[:, input_ids.shape[1] :]
    # q(x) ~ 0 for every proposal: p/q is huge, so speculative sampling accepts (almost) everything.
    broken = torch.zeros_like(logits).scatter_(-1, proposals[..., None], -60.0)
    return candidate_ids, broken


def _wrong_q(self, input_ids, drafted_logits, length):
    candidate_ids, _ = _ORIGINAL_PROPOSE(self, input_ids, drafted_logits, length)
    # The transformers #47932 class of bug: q from the raw drafter logits, not the processed ones sampled from.
    return candidate_ids, drafted_logits[:, :length]


_ORIGINAL_PROPOSE = AdaFlashCandidateGenerator._propose


@pytest.mark.parametrize("broken, proposal", [(_accept_all, "argmax"), (_wrong_q, "sample")])
def test_the_same_test_rejects_a_broken_verifier_contract(broken, proposal, setup, monkeypatch):
    target, drafter, marginals = setup
    monkeypatch.setattr(AdaFlashCandidateGenerator, "_propose", broken)
    counts = sample_counts(target, drafter, proposal)
    assert min_p_value(counts, marginals) < FAMILY_ALPHA / POSITIONS


def test_the_same_test_rejects_a_broken_verifier_contract_under_goodput(setup, monkeypatch):
    target, drafter, marginals = setup
    monkeypatch.setattr(AdaFlashCandidateGenerator, "_propose", _accept_all)
    counts = sample_counts(target, drafter, "argmax", **goodput_settings(target))
    assert min_p_value(counts, marginals) < FAMILY_ALPHA / POSITIONS


def test_empty_draft_does_not_crash_the_sampling_path(setup):
    target, drafter, _ = setup
    config = GenerationConfig(do_sample=True, max_new_tokens=6, adaflash_gamma=1e-9, adaflash_min_len=0)
    out = target.generate(PROMPT, assistant_model=drafter, generation_config=config)
    assert out.shape[1] == PROMPT.shape[1] + 6
    assert set(drafter.last_stats.verify_lengths) == {0}
