"""The batched engine is lossless: every request's greedy output equals its own ``target.generate``, in every
mode, whatever else is in the batch and whenever it joined or left; seeded sampling requests do not depend on
the batch; EOS, streaming and per-step stats behave."""

import random

import pytest
import torch

import adaflash_hf.serving.engine as engine_module
from adaflash_hf.cost_model import CostModel, use_cost_model
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, DraftingSettings, SamplingParams
from tests.conftest import (
    assert_outputs_equal_references,
    finished_requests,
    greedy_reference,
    make_batched_oracle,
    random_prompts,
    run_with_churn,
)

MODES = ("plain", "dflash", "adaflash")


def engine_args(mode: str, drafter) -> dict:
    """The drafter and drafting of an engine running ``mode``: none (plain), fixed length (DFlash), the default."""
    drafting = DraftingSettings(length_mode="fixed") if mode == "dflash" else None
    return {"drafter": None if mode == "plain" else drafter, "drafting": drafting}


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, target_factory, drafter_factory):
    target = target_factory(request.param)
    return target, drafter_factory(target)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_equals_generate(setup, mode):
    target, drafter = setup
    prompts = random_prompts(5, seed=1)
    expected = [greedy_reference(target, p, 12) for p in prompts]
    engine = AdaFlashEngine(target, **engine_args(mode, drafter))
    assert engine.generate(prompts, SamplingParams(max_new_tokens=12)) == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["dflash", "adaflash"])
def test_batched_equals_serial_under_churn_with_an_oracle_drafter(setup, mode, seed):
    target, drafter = setup
    prompts = random_prompts(8, seed=seed)
    rng = random.Random(seed)
    params = [SamplingParams(max_new_tokens=rng.randint(1, 24)) for _ in prompts]
    expected = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    oracle, weight = make_batched_oracle(target, drafter)
    # The adaptive rule where it applies: goodput (the greedy default) drafts by this machine's timings, and so would
    # the oracle's draws and the accepted count asserted below.
    length_mode = "adaptive" if mode == "adaflash" else "fixed"
    engine = AdaFlashEngine(target, oracle, admission=AdmissionConfig(max_running=5), length_mode=length_mode)
    references = {}
    oracle.arm(engine, references, weight, seed=seed)
    add = lambda rid, i: references.__setitem__(rid, prompts[i].tolist() + expected[i])  # noqa: E731
    results, aborted = run_with_churn(engine, prompts, params, seed, on_add=add)
    assert_outputs_equal_references(results, aborted, expected)
    assert sum(s.accepted for s in engine.stats) > 0, "the oracle must get drafts accepted"
    assert max(s.running for s in engine.stats) > 1


@pytest.mark.parametrize("profile", [{1: 1.0, 64: 1.0}, {1: 1.0, 2: 1.5, 8: 3.0}], ids=["free", "dear"])
def test_batched_equals_serial_under_churn_with_goodput(setup, profile):
    # Verification free (long drafts) or dear (k = 0 and skipped drafter forwards): lossless either way.
    target, drafter = setup
    use_cost_model(target, "engine", CostModel.profile(profile, drafter_seconds=0.05))
    prompts = random_prompts(8, seed=11)
    rng = random.Random(11)
    params = [SamplingParams(max_new_tokens=rng.randint(1, 24)) for _ in prompts]
    expected = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    oracle, weight = make_batched_oracle(target, drafter)
    engine = AdaFlashEngine(target, oracle, length_mode="goodput", admission=AdmissionConfig(max_running=5))
    references = {}
    oracle.arm(engine, references, weight, seed=11)
    add = lambda rid, i: references.__setitem__(rid, prompts[i].tolist() + expected[i])  # noqa: E731
    results, aborted = run_with_churn(engine, prompts, params, 11, on_add=add)
    assert_outputs_equal_references(results, aborted, expected)
    assert max(s.running for s in engine.stats) > 1
    if profile[1] == profile[max(profile)]:
        assert sum(s.accepted for s in engine.stats) > 0, (
            "free verification: the oracle's drafts get verified"
        )
    else:
        assert sum(s.skipped_drafter for s in engine.stats) > 0


@pytest.mark.parametrize("mode", MODES)
def test_batched_equals_serial_under_churn_with_a_random_drafter(setup, mode):
    target, drafter = setup
    prompts = random_prompts(10, seed=7)
    params = [SamplingParams(max_new_tokens=n) for n in (3, 17, 9, 1, 20, 5, 11, 16, 2, 8)]
    expected = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    engine = AdaFlashEngine(target, **engine_args(mode, drafter), admission=AdmissionConfig(max_running=6))
    results, aborted = run_with_churn(engine, prompts, params, seed=7, aborts=3)
    for i, request in results.items():
        if request.finish_reason == "abort":
            assert i in aborted and request.output == expected[i][: len(request.output)]
        else:
            assert request.output == expected[i]


def test_seeded_sampling_request_does_not_depend_on_the_batch(setup):
    target, drafter = setup
    prompt = random_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=123)
    alone = AdaFlashEngine(target, drafter).generate([prompt], params)[0]
    others = random_prompts(6, seed=4)
    engine = AdaFlashEngine(target, drafter)
    mixed = [SamplingParams(max_new_tokens=10, temperature=1.2, seed=s) for s in range(3)]
    mixed += [SamplingParams(max_new_tokens=10)] * 3
    for p, s in zip(others[:3], mixed[:3]):
        engine.add_request(p, s)
    engine.step()
    rid = engine.add_request(prompt, params)
    for p, s in zip(others[3:], mixed[3:]):
        engine.add_request(p, s)
    assert finished_requests(engine.stream())[rid].output == alone
    assert len(set(alone)) > 1


def test_eos_stops_a_request_inside_a_block(setup):
    target, drafter = setup
    prompt = random_prompts(1, seed=5)[0]
    reference = greedy_reference(target, prompt, 24)
    eos = reference[9]
    stop = reference.index(eos) + 1
    oracle, weight = make_batched_oracle(target, drafter)
    engine = AdaFlashEngine(target, oracle, length_mode="fixed")
    oracle.arm(engine, {"r": prompt.tolist() + reference}, weight)
    engine.add_request(prompt, SamplingParams(max_new_tokens=24, eos_token_id=eos), request_id="r")
    outputs = list(engine.stream())
    streamed = [t for out in outputs for t in out.new_tokens]
    request = finished_requests(outputs)["r"]
    assert request.output == streamed == reference[:stop]
    assert request.finish_reason == "stop"


def test_stream_deltas_and_step_stats(setup):
    target, drafter = setup
    prompts = random_prompts(3, seed=6)
    engine = AdaFlashEngine(target, drafter)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=7)) for p in prompts]
    pieces = {i: [] for i in ids}
    finished = {}
    for out in engine.stream():
        assert out.request_id not in finished
        pieces[out.request_id] += out.new_tokens
        if out.finished:
            finished[out.request_id] = out.request
    assert set(finished) == set(ids)
    assert all(pieces[i] == finished[i].output and len(pieces[i]) == 7 for i in ids)
    first, second = engine.stats[0], engine.stats[1]
    assert (first.admitted, first.prefill_tokens, first.verifies) == (3, sum(len(p) for p in prompts), 0)
    assert second.verifies == 3 and second.verify_tokens == second.draft_tokens + 3
    assert second.tau == second.committed / 3 and second.committed >= 3
    assert all(s.drafter_fallbacks == 0 for s in engine.stats)


def test_abort_streams_one_final_output_per_request(setup):
    target, drafter = setup
    prompts = random_prompts(3, seed=5)
    engine = AdaFlashEngine(target, drafter)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.step()
    engine.abort(ids[1])
    engine.abort(ids[2])
    finals = [out for out in engine.stream() if out.finished]
    assert sorted(out.request_id for out in finals) == sorted(ids)
    assert {out.request_id: out.finish_reason for out in finals if out.request_id != ids[0]} == {
        ids[1]: "abort",
        ids[2]: "abort",
    }
    assert all(out.new_tokens == [] for out in finals if out.finish_reason == "abort")


def test_abort_of_the_last_request_still_yields_its_final_output(setup):
    target, drafter = setup
    engine = AdaFlashEngine(target, drafter)
    rid = engine.add_request(random_prompts(1, seed=6)[0], SamplingParams(max_new_tokens=12))
    engine.abort(rid)
    assert [(o.request_id, o.finished, o.finish_reason) for o in engine.stream()] == [(rid, True, "abort")]


def test_a_request_leaves_the_engine_with_its_final_output(setup):
    target, drafter = setup
    engine = AdaFlashEngine(target, drafter)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in random_prompts(3, seed=8)]
    engine.step()
    engine.abort(ids[2])
    assert set(engine.requests) == set(ids)  # an aborted request stays until its final output
    finished = {}
    for out in engine.stream():
        if out.finished:
            assert out.request_id not in engine.requests
            finished[out.request_id] = out.request
    assert not engine.requests and set(finished) == set(ids)
    assert finished[ids[2]].finish_reason == "abort" and len(finished[ids[0]].output) == 5


def test_step_stats_are_kept_for_the_last_steps_and_every_step_is_counted(setup, monkeypatch):
    target, _ = setup
    monkeypatch.setattr(engine_module, "STEP_WINDOW", 3)
    engine = AdaFlashEngine(target)  # plain decoding: a step per token
    engine.generate(random_prompts(1, seed=9), SamplingParams(max_new_tokens=8))
    assert engine.step_count > 3 and [s.step for s in engine.stats] == [
        engine.step_count - n for n in (3, 2, 1)
    ]


def test_round_records_carry_the_length_head_estimate_that_chose_each_draft_length(setup):
    target, drafter = setup
    engine = AdaFlashEngine(
        target, drafter, length_mode="adaptive", gamma=1.0,
        admission=AdmissionConfig(load_aware_gamma=False),
    )  # fmt: skip
    records = []
    engine.round_recorder = lambda request, record: records.append(record)
    prompt = random_prompts(1, seed=6)[0]
    engine.generate([prompt], SamplingParams(max_new_tokens=40))
    assert len(records) > 2
    for record in records:
        assert 0.0 <= record.predicted_acceptance <= 1.0
        k_hat = int(drafter.predict_draft_length(torch.tensor([record.predicted_acceptance]), 1.0))
        remaining = 40 - (record.context_length + 1 - len(prompt))  # the anchor is the last committed token
        assert record.draft_length == min(k_hat, remaining - 1)
    assert len({r.predicted_acceptance for r in records}) > 1  # each round's own â, not one value kept


def test_a_request_that_skips_the_drafter_keeps_its_pending_context_whole_in_few_chunks(setup, monkeypatch):
    # Each chunk is a view of its step's feature tensor; every PENDING_CHUNKS chunks they are joined into one copy,
    # so a request that seldom drafts holds few steps' tensors, and the drafter still gets every position it lacks.
    target, drafter = setup
    monkeypatch.setattr(engine_module, "PENDING_CHUNKS", 2)
    prompts = random_prompts(6, seed=11)
    params = SamplingParams(max_new_tokens=24)
    expected = AdaFlashEngine(target).generate(prompts, params)
    engine = AdaFlashEngine(target, drafter, length_mode="goodput", admission=AdmissionConfig(max_running=6))
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs, joined = {}, 0
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_tokens)
        for request in engine.running:
            pending = request.pending_context
            assert len(pending) < 2
            assert request.drafter_len + sum(chunk.shape[0] for chunk in pending) == request.target_len
            joined += bool(pending) and pending[0]._base is None  # a copy: chunks were joined
    assert joined > 0
    assert [outputs[r] for r in sorted(outputs, key=lambda r: int(r.split("-")[-1]))] == expected
