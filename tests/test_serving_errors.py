"""Bad requests are refused in ``add_request`` (before any forward) with an error naming the field, the expected
and the actual value, and never disturb the other requests; a drafter that produces NaN for one request makes
that request verify no drafts for the step (k̂ = 0) while its output and everyone else's stay exact."""

import pytest
import torch

from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams


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
    ([1, 2], {"seed": "x"}, "seed: expected an int or None"),
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
    for _ in engine.stream():
        pass
    assert engine.requests[first].output == reference(target, good, 6)
    assert list(engine.requests) == [first]


def test_duplicate_request_id_and_wrong_params_type(setup):
    target, drafter = setup
    engine = AdaFlashEngine(target, drafter)
    engine.add_request([1, 2], SamplingParams(max_new_tokens=4), request_id="a")
    with pytest.raises(ValueError, match="request_id: expected a new id, got 'a'"):
        engine.add_request([3], SamplingParams(max_new_tokens=4), request_id="a")
    with pytest.raises(ValueError, match="request_id: expected one added to this engine, got 'b'"):
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
    for _ in engine.stream():
        pass
    assert [engine.requests[i].output for i in ids] == [reference(target, p, 12) for p in prompts]
    assert poisoned.drafted == 0 and engine.requests[ids[0]].drafted > 0
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
