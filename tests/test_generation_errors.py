"""``generate(assistant_model=drafter)`` rejects what it cannot do losslessly, with a clear error, before any forward."""

import pytest
import torch
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf import AdaFlashCandidateGenerator
from adaflash_hf.generate_hook import check_transformers_support

PROMPT = torch.tensor([[5, 17, 99, 3, 250, 8]])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_beams": 2}, ValueError, r"^num_beams: expected 1 with an AdaFlash assistant .*got 2"),
        (
            {"num_return_sequences": 2, "do_sample": True},
            ValueError,
            r"^num_return_sequences: expected 1 .*got 2",
        ),
        (
            {"cache_implementation": "static"},
            ValueError,
            r"^cache_implementation: expected None or 'dynamic'.*'static'",
        ),
        (
            {"adaflash_length_mode": "short"},
            ValueError,
            r"adaflash_length_mode: expected one of .*got 'short'",
        ),
        ({"adaflash_proposal": "beam"}, ValueError, r"adaflash_proposal: expected one of .*got 'beam'"),
        ({"adaflash_gamma": -1.0}, ValueError, r"adaflash_gamma: expected a number > 0, got -1.0"),
        ({"adaflash_min_len": 16}, ValueError, r"adaflash_min_len: expected an int in 0..15, got 16"),
        (
            {"num_assistant_tokens": 5},
            ValueError,
            r"^num_assistant_tokens: expected the default 20 .*got 5; use adaflash_length_mode='fixed'",
        ),
        (
            {"num_assistant_tokens_schedule": "heuristic"},
            ValueError,
            r"^num_assistant_tokens_schedule: expected the default 'constant' .*use adaflash_length_mode",
        ),
        (
            {"assistant_confidence_threshold": 0.9},
            ValueError,
            r"^assistant_confidence_threshold: expected the default 0.4 .*got 0.9; use adaflash_length_mode=",
        ),
        (
            {"output_attentions": True, "return_dict_in_generate": True},
            ValueError,
            r"^output_attentions: expected False with an AdaFlash assistant",
        ),
    ],
)
def test_unsupported_settings_raise_before_any_forward(watched, kwargs, error, match):
    target, drafter, calls = watched
    config = GenerationConfig(max_new_tokens=5, **kwargs)
    with pytest.raises(error, match=match):
        target.generate(PROMPT, assistant_model=drafter, generation_config=config)
    assert calls == []


def test_batch_of_two_points_to_the_engine(watched):
    target, drafter, calls = watched
    with pytest.raises(ValueError, match=r"^input_ids: expected batch size 1 .*AdaFlashEngine.*got 2"):
        target.generate(PROMPT.repeat(2, 1), assistant_model=drafter, max_new_tokens=5)
    assert calls == []


def test_mismatched_drafter_raises_check_target_error(target_factory, drafter_factory):
    target = target_factory("qwen3")
    other = drafter_factory(target_factory("qwen3", hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match=r"^hidden_size: expected the target's 64, got 32"):
        target.generate(PROMPT, assistant_model=other, max_new_tokens=5)


def test_drafter_built_for_another_target_is_rejected(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target_factory("qwen3", num_hidden_layers=6))
    with pytest.raises(
        ValueError,
        match=r"^target_num_hidden_layers: expected the target.s num_hidden_layers=4, got 6 recorded",
    ):
        drafter.check_target(target)


def test_other_assistants_are_untouched_by_the_hook(target_factory):
    target = target_factory("qwen3")
    assistant = target_factory("qwen3", seed=3)
    reference = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(
        target.generate(PROMPT, assistant_model=assistant, max_new_tokens=12, do_sample=False), reference
    )


def test_enable_and_disable_are_idempotent(target_factory, drafter_factory, monkeypatch):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    built = []
    original_init = AdaFlashCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(AdaFlashCandidateGenerator, "__init__", spy)
    try:
        adaflash_hf.enable()
        adaflash_hf.enable()
        assert adaflash_hf.is_enabled()
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, do_sample=False)
        assert len(built) == 1
        adaflash_hf.disable()
        adaflash_hf.disable()
        assert not adaflash_hf.is_enabled()
        config = GenerationConfig(max_new_tokens=4, do_sample=False, speculation_type="dflash")
        target.generate(
            PROMPT, assistant_model=drafter, generation_config=config
        )  # the native fixed-length path
        assert len(built) == 1
    finally:
        adaflash_hf.enable()


def test_untested_transformers_version_fails_clearly(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    with pytest.raises(RuntimeError, match=r"transformers version: expected >=5.24.0,<5.25.0 .*got 6.0.0"):
        check_transformers_support()


def test_knobs_passed_as_generate_kwargs_take_effect(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    out = target.generate(
        PROMPT, assistant_model=drafter, max_new_tokens=20, do_sample=False, adaflash_length_mode="fixed"
    )
    assert torch.equal(out, plain)
    assert drafter.last_stats.verify_lengths[0] == drafter.config.block_size - 1


@pytest.mark.parametrize("where", ["generation_config", "kwargs"])
def test_misspelt_knob_names_the_closest_knob_before_any_forward(watched, where):
    target, drafter, calls = watched
    if where == "kwargs":
        call = dict(max_new_tokens=5, adaflash_lenght_mode="fixed")
    else:
        call = dict(generation_config=GenerationConfig(max_new_tokens=5, adaflash_lenght_mode="fixed"))
    with pytest.raises(
        ValueError,
        match=r"^generation_config.adaflash_lenght_mode: expected one of the AdaFlash knobs .*got the unknown "
        r"name 'adaflash_lenght_mode' \(did you mean 'adaflash_length_mode'\?\)",
    ):
        target.generate(PROMPT, assistant_model=drafter, **call)
    assert calls == []


def test_prompt_past_the_target_positions_is_rejected_before_any_forward(target_factory, drafter_factory):
    target = target_factory("qwen3", max_position_embeddings=64)
    drafter = drafter_factory(target)
    calls = []
    target.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(
        ValueError,
        match=r"^prompt length \+ max_new_tokens: expected <= the target's max_position_embeddings=64, got 60 \+ 8",
    ):
        target.generate(torch.ones(1, 60, dtype=torch.long), assistant_model=drafter, max_new_tokens=8)
    assert calls == []


def test_empty_prompt_is_rejected_before_any_forward(watched):
    target, drafter, calls = watched
    with pytest.raises(ValueError, match=r"^input_ids: expected at least one token, got an empty prompt"):
        target.generate(PROMPT[:, :0], assistant_model=drafter, max_new_tokens=5)
    assert calls == []


def test_without_the_hook_generate_says_to_enable_it_or_use_native_dflash(watched):
    target, drafter, calls = watched
    adaflash_hf.disable()
    try:
        with pytest.raises(
            AttributeError,
            match=r"^generation_config: expected the adaflash_hf generate hook .*adaflash_hf.enable\(\).*"
            r"got no hook; .*speculation_type='dflash'",
        ):
            target.generate(PROMPT, assistant_model=drafter, max_new_tokens=5)
    finally:
        adaflash_hf.enable()
    assert calls == []


def test_last_stats_describes_the_last_adaflash_call_only(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    assert drafter.last_stats is None
    target.generate(PROMPT, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert drafter.last_stats.drafting_rounds > 0
    with pytest.raises(ValueError, match="adaflash_gamma"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=6, adaflash_gamma=-1.0)
    assert drafter.last_stats is None


def test_last_stats_is_cleared_when_generate_goes_back_to_the_native_path(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    target.generate(PROMPT, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert drafter.last_stats is not None
    adaflash_hf.disable()
    try:
        target.generate(
            PROMPT, assistant_model=drafter, max_new_tokens=6, do_sample=False, speculation_type="dflash"
        )
        assert drafter.last_stats is None
    finally:
        adaflash_hf.enable()


def test_inputs_embeds_without_input_ids_is_named_before_any_forward(watched):
    target, drafter, calls = watched
    embeds = target.get_input_embeddings()(PROMPT)
    calls.clear()
    with pytest.raises(ValueError, match=r"^inputs_embeds: expected input_ids with an AdaFlash assistant"):
        target.generate(inputs_embeds=embeds, assistant_model=drafter, max_new_tokens=5)
    assert calls == []


def test_a_target_outside_float32_is_warned_about_once_per_target(
    target_factory, drafter_factory, monkeypatch, caplog
):
    import logging

    target = target_factory("qwen3", dtype=torch.bfloat16)
    drafter = drafter_factory(target)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog's root handler
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            target.generate(PROMPT, assistant_model=drafter, max_new_tokens=3, adaflash_length_mode="fixed")
    warned = [r.getMessage() for r in caplog.records if "target dtype torch.bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "float32" in warned[0]


def test_a_prepared_bf16_target_is_not_warned_about(target_factory, drafter_factory, monkeypatch, caplog):
    import logging

    import adaflash_hf

    target = adaflash_hf.prepare_target(target_factory("qwen3"), dtype="bf16", check=False)
    drafter = drafter_factory(target)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog's root handler
    with caplog.at_level(logging.WARNING):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=3, adaflash_length_mode="fixed")
    assert not [r for r in caplog.records if "target dtype" in r.getMessage()]
