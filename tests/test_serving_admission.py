"""EMA admission control: budgets are never exceeded, requests beyond them wait (none is lost, all finish,
outputs stay exact), drafts are trimmed longest-first to the token budget, and γ follows the load."""

import pytest
import torch

from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from adaflash_hf.serving.admission import AdmissionController
from adaflash_hf.serving.requests import Request
from tests.conftest import finished_requests

MODE_LENGTH = {
    "dflash": "fixed"
}  # the engine's modes: no drafter (plain), fixed length (DFlash), the default


def fake_request(prompt_len, max_new):
    return Request(
        "r", [1] * prompt_len, SamplingParams(max_new_tokens=max_new), frozenset(), torch.Generator()
    )


@pytest.mark.parametrize("mode", ["plain", "adaflash"])
def test_tight_budget_defers_requests_and_all_finish_exactly(target_factory, drafter_factory, mode):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (12, 5, 20, 9, 14, 3, 17, 8)]
    expected = [
        target.generate(p[None], max_new_tokens=10, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    config = AdmissionConfig(max_running=3, token_budget=24, kv_budget=64)
    engine = AdaFlashEngine(
        target, None if mode == "plain" else drafter, admission=config, length_mode=MODE_LENGTH.get(mode)
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    finished = finished_requests(engine.stream())
    assert [finished[i].output for i in ids] == expected
    assert all(finished[i].finish_reason == "length" for i in ids)
    stats = engine.stats
    assert max(s.waiting for s in stats) > 0, "the budget must have deferred someone"
    assert all(s.running <= 3 and s.prefill_tokens + s.verify_tokens <= 24 for s in stats)
    assert all(s.kv_reserved <= 64 for s in stats) and max(s.kv_reserved for s in stats) > 30


def test_admission_stops_at_the_first_request_that_does_not_fit():
    controller = AdmissionController(AdmissionConfig(max_running=4, token_budget=40, kv_budget=100), 16)
    running = [fake_request(10, 20)]  # reserves 30 KV; its verify is estimated at 16 tokens (no EMA yet)
    waiting = [fake_request(10, 20), fake_request(20, 40), fake_request(2, 20)]
    # 16 + 10 tokens fit, then 16 + 10 + 20 > 40 tokens: the 2nd waits, and so does everyone behind it.
    assert controller.admit(waiting, running) == waiting[:1]
    # Idle: 10 + 20 tokens and 30 + 60 KV fit; the 3rd would need 90 + 22 > 100 KV.
    assert controller.admit(waiting, []) == waiting[:2]


def test_idle_engine_always_admits_the_head_of_the_queue():
    controller = AdmissionController(AdmissionConfig(max_running=2, token_budget=8, kv_budget=10), 16)
    big = fake_request(8, 2)
    assert controller.admit([big], []) == [big]


def test_ema_of_running_requests_and_load_aware_gamma():
    controller = AdmissionController(
        AdmissionConfig(token_budget=64, ema_beta=0.5, load_aware_gamma=True), 16
    )
    controller.update(running=2, verify_tokens=10, verifies=2)
    assert controller.ema_running == 2 and controller.gamma_scale() == 1.0
    controller.update(running=14, verify_tokens=14, verifies=14)
    assert controller.ema_running == 8 and controller.gamma_scale() == 0.5  # 64 / (8 * 16)
    assert controller.ema_verify_tokens == pytest.approx(0.5 * (0.5 * 16 + 0.5 * 5) + 0.5)
    fixed = AdmissionController(AdmissionConfig(token_budget=64, ema_beta=0.5), 16)
    fixed.update(running=14, verify_tokens=14, verifies=14)
    assert fixed.gamma_scale() == 1.0


def test_load_aware_gamma_shortens_drafts_under_load(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target, length_head_gamma=2.0)
    prompts = [torch.tensor([i + 1, 7, 9]) for i in range(8)]
    means = {}
    for aware in (False, True):
        config = AdmissionConfig(max_running=8, token_budget=32, load_aware_gamma=aware)
        engine = AdaFlashEngine(target, drafter, admission=config)
        engine.generate(prompts, SamplingParams(max_new_tokens=8))
        assert all(s.verify_tokens + s.prefill_tokens <= 32 for s in engine.stats)
        means[aware] = [s.gamma for s in engine.stats]
    assert set(means[False]) == {2.0} and min(means[True]) < 2.0
