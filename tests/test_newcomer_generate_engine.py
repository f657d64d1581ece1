"""Issue 25, the generate-hook and engine items: what a new user's mistakes now give (a correct result or one clear
error before any forward), each reproduced as the issue states it."""

import pytest
import torch

import adaflash_hf
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.serving.admission import default_kv_budget, kv_bytes_per_position

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])


@pytest.fixture
def watched(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    calls = []
    for model in (target, drafter):
        model.register_forward_pre_hook(lambda *_: calls.append(1))
    return target, drafter, calls


def greedy(target, tokens=8, **kwargs):
    return target.generate(PROMPT, max_new_tokens=tokens, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------------- generate
def test_speculation_type_dflash_runs_the_native_fixed_length_path(
    target_factory, drafter_factory, monkeypatch
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    built = []
    original = adaflash_hf.AdaFlashCandidateGenerator.__init__
    monkeypatch.setattr(
        adaflash_hf.AdaFlashCandidateGenerator,
        "__init__",
        lambda self, *a, **k: (built.append(1), original(self, *a, **k))[1],
    )
    out = greedy(target, 12, assistant_model=drafter, speculation_type="dflash")
    assert torch.equal(out, greedy(target, 12))
    assert (
        not built and drafter.last_stats is None
    )  # transformers' DFlashTokenCandidateGenerator ran, not ours


def test_adaflash_knobs_with_speculation_type_dflash_are_refused(watched):
    target, drafter, calls = watched
    with pytest.raises(
        ValueError, match=r"^adaflash_length_mode: AdaFlash knobs expected .*speculation_type='dflash'"
    ):
        greedy(target, assistant_model=drafter, speculation_type="dflash", adaflash_length_mode="fixed")
    assert not calls


def test_prompt_lookup_with_an_adaflash_assistant_points_to_hybrid(watched):
    target, drafter, calls = watched
    with pytest.raises(
        ValueError, match=r"^prompt_lookup_num_tokens: expected None .*adaflash_draft_source='hybrid'"
    ):
        greedy(target, assistant_model=drafter, prompt_lookup_num_tokens=3)
    assert not calls


def test_an_adaflash_knob_without_an_assistant_is_refused_and_a_typo_named(watched):
    target, _, calls = watched
    with pytest.raises(ValueError, match=r"adaflash_lenght_mode.*did you mean 'adaflash_length_mode'"):
        greedy(target, adaflash_lenght_mode="fixed")
    with pytest.raises(
        ValueError, match=r"^adaflash_length_mode: AdaFlash knobs expected .*got assistant_model=None"
    ):
        greedy(target, adaflash_length_mode="fixed")
    assert not calls


def test_knobs_stored_on_a_reused_config_do_not_break_plain_calls(target_factory):
    target = target_factory("qwen3")
    config = target.generation_config
    config.adaflash_gamma = 1.3
    try:
        assert torch.equal(greedy(target), target.generate(PROMPT, max_new_tokens=8, do_sample=False))
    finally:
        del config.adaflash_gamma


@pytest.mark.parametrize("knob", ["adaflash_gamma", "adaflash_min_len"])
def test_booleans_are_not_numbers_for_knobs(watched, knob):
    target, drafter, calls = watched
    with pytest.raises(ValueError, match=rf"^generation_config\.{knob}: expected .*got True"):
        greedy(target, assistant_model=drafter, **{knob: True})
    assert not calls


def test_hidden_states_are_returned_with_an_adaflash_assistant(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    kwargs = dict(output_hidden_states=True, return_dict_in_generate=True)
    plain = greedy(target, **kwargs)
    out = greedy(target, assistant_model=drafter, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    layers = target.config.num_hidden_layers + 1
    assert all(len(step) == layers and all(h is not None for h in step) for step in out.hidden_states)
    assert sum(step[-1].shape[1] for step in out.hidden_states) == sum(
        step[-1].shape[1] for step in plain.hidden_states
    )


# --------------------------------------------------------------------------------------------------- engine
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
    assert len(engine.requests) == 1


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
