"""Bad requests are refused in ``add_request`` (before any forward) with an error naming the field, the expected
and the actual value, and never disturb the other requests; ``generate`` queues none of a call's prompts when one
prompt or params entry is bad, and takes one params per prompt or one for all; a drafter that produces NaN for one
request makes that request verify no drafts for the step (k̂ = 0) while its output and everyone else's stay exact;
and the KV budget defaults to half the available memory."""

import pytest
import torch

from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from adaflash_hf.serving.admission import default_kv_budget, kv_bytes_per_position
from tests.conftest import SHORT_PROMPT as PROMPT
from tests.conftest import finished_requests


@pytest.fixture(scope="module")
def setup(target_factory, drafter_factory):
    target = target_factory("qwen3", max_position_embeddings=64)
    return target, drafter_factory(target)


def reference(target, prompt, n):
    return target.generate(prompt[None], max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


BAD_REQUESTS = [
    ([], {}, "prompt_ids: expected at least one token"),
    ([1, 2, 600], {}, r"prompt_ids: expected token ids in 0..511, got out-of-range ids \[600\]"),
    ([1] * 60, {"max_new_tokens": 5}, "max_new_tokens: expected <= the target's max_position_embeddings=64"),
    ([1] * 70, {"max_new_tokens": 1}, "max_position_embeddings=64, got 70 \\+ 1"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens: expected an int >= 1, got 0"),
    ([1, 2], {"temperature": -0.5}, "temperature: expected a finite number >= 0, got -0.5"),
    ([1, 2], {"temperature": float("nan")}, "temperature: expected a finite number >= 0, got nan"),
    ([1, 2], {"top_k": -1}, "top_k: expected an int >= 0"),
    ([1, 2], {"top_p": 0.0}, r"top_p: expected a number in \(0, 1\], got 0.0"),
    ([1, 2], {"eos_token_id": 512}, "eos_token_id: expected token ids in 0..511, got 512"),
    ([1, 2], {"seed": "x"}, "seed: expected None or an int in "),
    ([1, 2], {"seed": 2**70}, "seed: expected None or an int in .*, got 1180591620717411303424"),
]


@pytest.mark.parametrize("prompt, params, message", BAD_REQUESTS)
def test_bad_request_is_refused_and_others_are_untouched(setup, prompt, params, message):
    target, drafter = setup
    good = torch.tensor([3, 1, 4, 1, 5])
    engine = AdaFlashEngine(target, drafter)
    first = engine.add_request(good, SamplingParams(max_new_tokens=6))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(torch.tensor(prompt, dtype=torch.long), SamplingParams(**params))
    finished = finished_requests(engine.stream())
    assert finished[first].output == reference(target, good, 6)
    assert list(finished) == [first]


def test_duplicate_request_id_and_wrong_params_type(setup):
    target, drafter = setup
    engine = AdaFlashEngine(target, drafter)
    engine.add_request([1, 2], SamplingParams(max_new_tokens=4), request_id="a")
    with pytest.raises(ValueError, match="request_id: expected a new id, got 'a'"):
        engine.add_request([3], SamplingParams(max_new_tokens=4), request_id="a")
    with pytest.raises(
        ValueError,
        match="request_id: expected one added to this engine whose final output is still to come, got 'b'",
    ):
        engine.abort("b")
    with pytest.raises(TypeError, match="params: expected SamplingParams, got dict"):
        engine.add_request([3], {"max_new_tokens": 3})


def test_prompt_beyond_the_budgets_is_refused(setup):
    target, drafter = setup
    engine = AdaFlashEngine(
        target, drafter, admission=AdmissionConfig(max_running=2, token_budget=8, kv_budget=20)
    )
    with pytest.raises(
        ValueError,
        match=r"prompt length: expected <= admission token_budget=8 \(prefill runs in one forward\), got 9",
    ):
        engine.add_request([1] * 9, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_new_tokens: expected <= admission kv_budget=20, got 21"):
        engine.add_request([1] * 5, SamplingParams(max_new_tokens=16))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"mode": "eagle"}, ValueError, "mode: expected one of"),
        ({"mode": "dflash", "drafter": None}, ValueError, "drafter: expected an AdaFlashDrafter"),
        (
            {"length_mode": "fixed", "drafter": None},
            ValueError,
            r"drafter: expected an AdaFlashDrafter for length_mode='fixed' \(without one the engine decodes plainly",
        ),
        ({"gamma": 0.0}, ValueError, "gamma: expected a number > 0, got 0.0"),
        ({"min_len": 99}, ValueError, "min_len: expected an int in 0..15, got 99"),
        ({"admission": AdmissionConfig(max_running=8, token_budget=4)}, ValueError, "token_budget: expected"),
        ({"admission": AdmissionConfig(ema_beta=0)}, ValueError, "ema_beta: expected a number in"),
    ],
)
def test_engine_settings_are_validated(setup, kwargs, error, message):
    target, drafter = setup
    kwargs = {"drafter": drafter, **kwargs}
    with pytest.raises(error, match=message):
        AdaFlashEngine(target, **kwargs)


def test_sliding_window_target_is_refused(target_factory, drafter_factory):
    target = target_factory("qwen3", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window: expected None"):
        AdaFlashEngine(target, drafter_factory(target))


def test_nan_from_the_drafter_falls_back_to_no_drafts_for_that_request_only(setup, monkeypatch, caplog):
    target, drafter = setup
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (6, 9, 4)]
    engine = AdaFlashEngine(target, drafter, length_mode="fixed", draft_source="diffusion")
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    poisoned = engine.requests[ids[1]]
    forward = type(drafter).forward

    def nan_for_one_request(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        rows = kwargs["cache"].batch.slots.tolist()
        if poisoned.slot in rows:
            out.last_hidden_state[rows.index(poisoned.slot), 3] = float("nan")
        return out

    monkeypatch.setattr(type(drafter), "forward", nan_for_one_request)
    finished = finished_requests(engine.stream())
    assert [finished[i].output for i in ids] == [reference(target, p, 12) for p in prompts]
    assert poisoned.drafted == 0 and finished[ids[0]].drafted > 0
    assert sum(s.drafter_fallbacks for s in engine.stats) == poisoned.verify_rounds > 1
    assert poisoned.drafter_fallbacks == poisoned.verify_rounds
    # One warning for the request, not one per step.
    assert caplog.text.count("non-finite drafter block") == 1
    assert f"{poisoned.request_id}: non-finite drafter block" in caplog.text


def test_engine_loads_a_drafter_given_as_a_path(setup, tmp_path):
    target, drafter = setup
    drafter.save_pretrained(tmp_path)
    engine = AdaFlashEngine(target, str(tmp_path))
    assert isinstance(engine.drafter, type(drafter))
    assert torch.equal(engine.drafter.fc.weight, drafter.fc.weight)


def test_engine_refuses_a_drafter_of_another_type(setup):
    target, _ = setup
    with pytest.raises(
        TypeError,
        match=r"^drafter: expected an AdaFlashDrafter \(or a model wrapping one\) or a checkpoint folder / Hub repo id, got int",
    ):
        AdaFlashEngine(target, 3)


@pytest.mark.parametrize(
    ("mode", "instead", "runs"),
    [
        ("plain", r"AdaFlashEngine\(target\) \(no drafter", "plain"),
        ("dflash", r"AdaFlashEngine\(target, drafter, length_mode='fixed'\)", "dflash"),
        ("adaflash", r"AdaFlashEngine\(target, drafter\)", "adaflash"),
    ],
)
def test_the_old_mode_argument_still_works_and_says_what_to_write_instead(setup, mode, instead, runs):
    target, drafter = setup
    with pytest.warns(
        FutureWarning, match=rf"AdaFlashEngine\(mode='{mode}'\) is deprecated; write {instead}"
    ):
        engine = AdaFlashEngine(target, drafter, mode=mode)
    assert engine.mode == runs
    assert engine.generate([[5, 17, 99]], SamplingParams(max_new_tokens=4))[0] == (
        target.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
    )


# ----------------------------------------------------------------------------------------- prompts and params
@pytest.fixture
def engine(target_factory, drafter_factory):
    target = target_factory("qwen3")
    return AdaFlashEngine(target, drafter_factory(target))


def test_a_batch_of_prompts_is_not_one_request(engine):
    with pytest.raises(ValueError, match=r"^prompt_ids: expected one prompt, got a batch of shape \[2, 6\]"):
        engine.add_request(torch.cat([PROMPT, PROMPT]))
    assert not engine.requests
    assert engine.add_request(PROMPT)  # a [1, L] tensor is one prompt


def test_generate_needs_one_params_per_prompt_or_one_for_all(engine):
    prompts = [[1, 2, 3], [4, 5], [6]]
    with pytest.raises(ValueError, match=r"^params: expected one SamplingParams per prompt \(3\), got 1"):
        engine.generate(prompts, [SamplingParams(max_new_tokens=4)])
    assert not engine.requests
    assert len(engine.generate(prompts, SamplingParams(max_new_tokens=2))) == 3


def test_a_flat_prompt_given_as_prompts_is_refused(engine):
    with pytest.raises(
        TypeError, match=r"^prompts: expected a list of prompts .*one flat list of 5 ints; pass \[prompt\]"
    ):
        engine.generate(PROMPT[0, :5].tolist(), SamplingParams(max_new_tokens=2))
    assert not engine.requests


def test_one_bad_prompt_queues_none_of_the_others(engine):
    with pytest.raises(TypeError, match=r"^prompts\[1\]: prompt_ids: expected token ids"):
        engine.generate([[1, 2], "hello", [3]], SamplingParams(max_new_tokens=2))
    assert not engine.requests and not engine.waiting


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1, 2], [3, 99999]], None, r"^prompts\[1\]: prompt_ids: expected token ids in 0\.\.511"),
        (
            [[1, 2], [3]],
            [SamplingParams(), SamplingParams(max_new_tokens=0)],
            r"^params\[1\]: sampling params max_new_tokens",
        ),
        (
            [[1, 2], [3]],
            [SamplingParams(), "greedy"],
            r"^params\[1\]: params: expected SamplingParams, got str",
        ),
        ([[1, 2], [3] * 600], None, r"^prompts\[1\]: prompt length \+ max_new_tokens: expected <= "),
    ],
)
def test_a_bad_entry_queues_none_and_the_next_call_runs_only_its_own(engine, prompts, params, match):
    with pytest.raises((TypeError, ValueError), match=match):
        engine.generate(prompts, params)
    assert not engine.requests and not engine.waiting
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1
    assert max(s.running for s in engine.stats) == 1


@pytest.mark.parametrize(
    "prompt, got",
    [
        ("Hello there", "got str 'Hello there'"),
        (None, "got NoneType None"),
        ([[1, 2], [3]], "got list"),
        (torch.tensor([True, False, True]), r"got a torch.bool tensor of shape \[3\]"),
        ([1.0, 2.0], r"got a torch.float32 tensor of shape \[2\]"),
        ([True, 2], r"got a list holding booleans \[True, 2\]"),
    ],
)
def test_a_prompt_that_is_not_token_ids_names_prompt_ids_and_what_it_got(engine, prompt, got):
    with pytest.raises(TypeError, match=rf"^prompt_ids: expected token ids: .*{got}"):
        engine.add_request(prompt)


@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed"])
def test_booleans_are_not_counts_in_sampling_params(engine, field):
    with pytest.raises(ValueError, match=rf"^sampling params {field}: expected .*got True"):
        engine.add_request([1, 2, 3], SamplingParams(**{field: True}))


def test_the_kv_budget_defaults_to_half_the_available_memory(engine, target_factory):
    target = engine.target
    per_position = kv_bytes_per_position(target) + kv_bytes_per_position(engine.drafter)
    assert default_kv_budget(target, engine.drafter, available=per_position * 1000) == 500
    budget = engine.admission.config.kv_budget  # derived from this machine's memory when the engine started
    assert isinstance(budget, int) and budget >= 1
    assert budget == pytest.approx(default_kv_budget(target, engine.drafter), rel=0.5)
