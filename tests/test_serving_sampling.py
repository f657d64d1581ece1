"""Sampling through the batched engine is lossless per request: 1000 seeded requests in big batches (drafts
proposed and verified every step) give the exact marginal law of generated positions 1..3 of the target with
temperature, top-k and top-p applied as transformers' warpers do. Chi-square per position (bins with expected
count < 5 merged, Bonferroni, family-wise level 1e-3); the same test must reject an "accept every draft" verifier.
"""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import adaflash_hf.serving.engine as engine_module
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from tests.conftest import finished_requests, make_batched_oracle

VOCAB, SCALE, POSITIONS, NUM_REQUESTS = 16, 12.0, 3, 1000
TEMPERATURE, TOP_K, TOP_P = 0.6, 6, 0.95
FAMILY_ALPHA = 1e-3
PROMPT = torch.tensor([3, 9, 1, 12, 5])


@pytest.fixture(scope="module")
def setup(target_factory, drafter_factory):
    target = target_factory("qwen3", seed=7, vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(SCALE)  # spread the logits so the law is far from uniform
    reference = target.generate(PROMPT[None], do_sample=False, max_new_tokens=POSITIONS + 16)[0].tolist()
    return target, drafter_factory(target, mask_token_id=VOCAB - 1), reference, exact_marginals(target)


def exact_marginals(target) -> torch.Tensor:
    warp = LogitsProcessorList(
        [TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(top_k=TOP_K), TopPLogitsWarper(top_p=TOP_P)]
    )
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    ids = torch.cat([PROMPT[None].expand(pairs.shape[0], -1), pairs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, -3:]
    probs = [torch.softmax(warp(ids, logits[:, i]).double(), -1) for i in range(3)]
    p1 = probs[0][0]
    p2 = probs[1].view(VOCAB, VOCAB, VOCAB)[:, 0]
    p3 = probs[2].view(VOCAB, VOCAB, VOCAB)
    return torch.stack([p1, p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    observed_bins, expected_bins, obs, exp = [], [], 0.0, 0.0
    for index in torch.argsort(expected, descending=True).tolist():
        obs, exp = obs + float(counts[index]), exp + float(expected[index])
        if exp >= 5:
            observed_bins.append(obs)
            expected_bins.append(exp)
            obs = exp = 0.0
    observed_bins[-1] += obs
    expected_bins[-1] += exp
    observed, expected = torch.tensor(observed_bins).double(), torch.tensor(expected_bins).double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(observed_bins) - 1
    return (
        1.0 if dof == 0 else float(torch.special.gammaincc(torch.tensor(dof / 2.0).double(), statistic / 2))
    )


def sampled_counts(target, drafter, reference) -> tuple[torch.Tensor, AdaFlashEngine]:
    oracle, weight = make_batched_oracle(target, drafter)
    engine = AdaFlashEngine(target, oracle, length_mode="fixed", admission=AdmissionConfig(max_running=250))
    references = {}
    oracle.arm(engine, references, weight, seed=8)
    for seed in range(NUM_REQUESTS):
        params = SamplingParams(
            max_new_tokens=POSITIONS, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=seed
        )
        references[engine.add_request(PROMPT, params)] = reference
    counts = torch.zeros(POSITIONS, VOCAB)
    for request in finished_requests(engine.stream()).values():
        counts[torch.arange(POSITIONS), torch.tensor(request.output)] += 1
    return counts, engine


def min_p_value(counts, marginals) -> float:
    return min(chi_square_p_value(counts[i], marginals[i]) for i in range(POSITIONS))


def test_sampled_marginals_equal_the_targets(setup):
    target, drafter, reference, marginals = setup
    counts, engine = sampled_counts(target, drafter, reference)
    assert sum(s.accepted for s in engine.stats) > NUM_REQUESTS // 2, "drafts must be accepted often"
    assert min_p_value(counts, marginals) > FAMILY_ALPHA / POSITIONS


def test_the_same_test_rejects_a_verifier_that_accepts_every_draft(setup, monkeypatch):
    target, drafter, reference, marginals = setup
    original = engine_module.verify_accept

    def accept_all(*args, accept_uniforms, **kwargs):
        return original(*args, accept_uniforms=torch.zeros_like(accept_uniforms), **kwargs)

    monkeypatch.setattr(engine_module, "verify_accept", accept_all)
    counts, _ = sampled_counts(target, drafter, reference)
    assert min_p_value(counts, marginals) < 1e-6


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_tiny_positive_temperature_samples_the_greedy_text(setup, temperature):
    target, drafter, reference, _ = setup
    engine = AdaFlashEngine(target, drafter, length_mode="fixed")
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    request_id = engine.add_request(PROMPT, params)
    assert finished_requests(engine.stream())[request_id].output == reference[len(PROMPT) : len(PROMPT) + 12]
