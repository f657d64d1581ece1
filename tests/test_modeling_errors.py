"""Bad drafters, targets, configs and inputs raise a specific error naming the field, the expected and the actual
value, before any forward pass runs: a drafter checked against a target (or given something else), a config of the
wrong type or value at construction and at load, a folder that does not exist, and a drafter in another dtype than
its inputs (which says to load it in the target's dtype, and runs under autocast)."""

import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import adaflash_hf
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, target_layer_ids=[0])


@pytest.fixture
def forward_calls():
    """``watch(*models)`` counts forward calls of every module inside ``models``; returns the live list of calls."""
    calls = []

    def watch(*models):
        for model in models:
            for name, module in model.named_modules():
                module.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
        return calls

    return watch


def assert_check_target_raises(drafter, target, forward_calls, error, match):
    calls = forward_calls(drafter, target)
    with pytest.raises(error, match=match):
        drafter.check_target(target)
    assert calls == [], f"a forward ran before the error: {calls[:3]}"


# ------------------------------------------------------------------------------------------ drafter vs target
def test_matching_drafter_and_target_pass(any_target, drafter_factory, forward_calls):
    drafter = drafter_factory(any_target)
    calls = forward_calls(drafter, any_target)
    drafter.check_target(any_target)
    assert calls == []


def test_hidden_size_mismatch_raises(qwen3_target, target_factory, drafter_factory, forward_calls):
    drafter = drafter_factory(target_factory("qwen3", hidden_size=32, head_dim=8))
    assert_check_target_raises(
        drafter, qwen3_target, forward_calls, ValueError, r"^hidden_size: expected the target's 64, got 32"
    )


def test_vocabulary_mismatch_raises(qwen3_target, target_factory, drafter_factory, forward_calls):
    drafter = drafter_factory(target_factory("qwen3", vocab_size=600), mask_token_id=3)
    assert_check_target_raises(
        drafter, qwen3_target, forward_calls, ValueError, r"^vocab_size: expected the target's 512, got 600"
    )


@pytest.mark.parametrize(("layer_ids", "bad"), [([-1, 2], -1), ([0, 4], 4), ([0, 99], 99)])
def test_target_layer_id_outside_the_target_raises(
    qwen3_target, drafter_factory, forward_calls, layer_ids, bad
):
    drafter = drafter_factory(qwen3_target, target_layer_ids=layer_ids)
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        ValueError,
        rf"^target_layer_ids: expected every id in 0\.\.3 \(the target has 4 layers\), got {bad} in",
    )


@pytest.mark.parametrize("mask_token_id", [512, 10_000, -1])
def test_mask_token_outside_the_target_vocabulary_raises(
    qwen3_target, drafter_factory, forward_calls, mask_token_id
):
    drafter = drafter_factory(qwen3_target, mask_token_id=mask_token_id)
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        ValueError,
        rf"^mask_token_id: expected a row of the target embedding \(0\.\.511\) or learned_mask_embedding=True, "
        rf"got {mask_token_id}$",
    )


def test_learned_mask_embedding_accepts_any_placeholder_row(qwen3_target, drafter_factory, forward_calls):
    # Targets without a spare row (SmolLM2) use an ordinary token as placeholder; the learned vector replaces it.
    drafter = drafter_factory(qwen3_target, mask_token_id=0, learned_mask_embedding=True)
    calls = forward_calls(drafter, qwen3_target)
    drafter.check_target(qwen3_target)
    assert calls == []


def test_learned_mask_embedding_still_needs_a_placeholder_inside_the_vocabulary(
    qwen3_target, drafter_factory, forward_calls
):
    # The native DFlash generator looks the placeholder up in the target embedding before the drafter replaces it.
    drafter = drafter_factory(qwen3_target, mask_token_id=512, learned_mask_embedding=True)
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        ValueError,
        r"^mask_token_id: expected a placeholder row 0\.\.511.*got 512",
    )


def test_linear_attention_target_is_not_implemented(qwen3_target, drafter_factory, forward_calls):
    drafter = drafter_factory(qwen3_target)
    qwen3_target.config.layer_types = ["full_attention", "linear_attention"] * 2
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        NotImplementedError,
        r"cannot be cropped.*\['linear_attention'\]",
    )


def test_stateful_target_is_not_implemented(qwen3_target, drafter_factory, forward_calls):
    drafter = drafter_factory(qwen3_target)
    qwen3_target._is_stateful = True
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        NotImplementedError,
        r"cannot be cropped.*stateful.*Qwen3ForCausalLM",
    )


def test_drafter_dtype_different_from_the_target_raises(qwen3_target, drafter_factory, forward_calls):
    drafter = drafter_factory(qwen3_target).to(torch.float64)
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        TypeError,
        r"^drafter dtype: expected the target's torch\.float32, got torch\.float64",
    )


def test_unsupported_target_dtype_raises(qwen3_target, drafter_factory, forward_calls):
    drafter = drafter_factory(qwen3_target)
    qwen3_target.to(torch.float8_e4m3fn)
    assert_check_target_raises(
        drafter,
        qwen3_target,
        forward_calls,
        TypeError,
        r"^target dtype: expected one of .*got torch\.float8_e4m3fn",
    )


# ------------------------------------------------------------------------------------------------ drafter forward
def drafter_inputs(drafter, q_len=None, n_ctx=4, hidden=None, width=None):
    q_len = q_len or drafter.config.block_size
    return dict(
        noise_embeds=torch.randn(1, q_len, hidden or drafter.config.hidden_size),
        context_hidden_states=torch.randn(1, n_ctx, width or drafter.fc.in_features),
    )


@pytest.mark.parametrize(
    ("bad_input", "match"),
    [
        (dict(q_len=10), r"^noise_embeds: expected a multiple of block_size=16 rows, got 10"),
        (dict(hidden=32), r"^noise_embeds: expected hidden size 64, got 32"),
        (dict(width=64), r"^context_hidden_states: expected last dim 128 .*got 64"),
    ],
)
def test_malformed_forward_inputs_raise_before_any_layer_runs(
    qwen3_target, drafter_factory, forward_calls, bad_input, match
):
    drafter = drafter_factory(qwen3_target)
    calls = forward_calls(*drafter.children())
    with pytest.raises(ValueError, match=match):
        drafter(**drafter_inputs(drafter, **bad_input))
    assert calls == []


def test_forward_watch_sees_a_valid_forward(qwen3_target, drafter_factory, forward_calls):
    # Negative control for the "no forward ran" assertions above: the hooks do record a real forward.
    drafter = drafter_factory(qwen3_target)
    calls = forward_calls(*drafter.children())
    with torch.no_grad():
        drafter(**drafter_inputs(drafter))
    assert len(calls) > 10


def test_attention_mask_with_the_wrong_number_of_keys_raises(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target)
    with pytest.raises(ValueError, match=r"^attention_mask: expected 20 columns .*got 19"):
        drafter(**drafter_inputs(drafter), attention_mask=torch.ones(1, 19))


# ------------------------------------------------------------------------------------------------ config checks
def config_error(match):
    # The strict config dataclass wraps a validator's ValueError in its own error, keeping the message.
    return pytest.raises((ValueError, StrictDataclassClassValidationError), match=match)


@pytest.mark.parametrize("block_size", [1, 0, -4])
def test_block_size_below_two_is_rejected_at_config_construction(block_size):
    with config_error(rf"block_size: expected >= 2 .*got {block_size}"):
        AdaFlashConfig(**TINY, block_size=block_size)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(length_head_variant="mlp"),
            r"length_head_variant: expected one of \('two_model', 'paper'\), got 'mlp'",
        ),
        (dict(length_head_min_len=16), r"length_head_min_len: expected 0\.\.15 \(block_size - 1\), got 16"),
        (dict(length_head_gamma=0.0), r"length_head_gamma: expected > 0, got 0\.0"),
        (dict(source_layout="eagle"), r"source_layout: expected one of .*got 'eagle'"),
        (
            dict(num_key_value_heads=3),
            r"num_attention_heads: expected a multiple of num_key_value_heads=3, got 4",
        ),
        (dict(target_layer_ids=[]), r"target_layer_ids: expected a non-empty list .*got \[\]"),
        (
            dict(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
            r"rope_parameters\.rope_type: expected one of \('default', 'linear'.*\), got 'bogus'",
        ),
    ],
)
def test_invalid_config_fields_are_rejected_at_construction(overrides, match):
    with config_error(match):
        AdaFlashConfig(**{**TINY, **overrides})


def test_a_drafter_folder_with_an_unknown_rope_type_is_refused_when_loaded(
    qwen3_target, drafter_factory, tmp_path
):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "bogus"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with config_error(r"rope_parameters\.rope_type: expected one of .*got 'bogus'"):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_sliding_drafter_layers_are_not_implemented():
    with pytest.raises(
        NotImplementedError, match=r"layer_types: only 'full_attention' .*\['sliding_attention'\]"
    ):
        AdaFlashConfig(**TINY, num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])


def test_generate_and_the_engine_cast_a_bf16_drafter_to_the_fp32_target_once(qwen3_target, drafter_factory):
    from adaflash_hf import AdaFlashEngine, SamplingParams

    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    expected = qwen3_target.generate(prompt, max_new_tokens=8, do_sample=False)
    drafter = drafter_factory(qwen3_target).to(torch.bfloat16)  # as a drafter stored in bf16 loads
    out = qwen3_target.generate(prompt, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, expected)
    assert next(drafter.parameters()).dtype == torch.float32
    engine = AdaFlashEngine(qwen3_target, drafter_factory(qwen3_target).to(torch.bfloat16))
    assert next(engine.drafter.parameters()).dtype == torch.float32
    assert engine.generate([prompt[0]], SamplingParams(max_new_tokens=8)) == [expected[0, 5:].tolist()]


# ----------------------------------------------------------------------------------- loading a missing folder
@pytest.mark.parametrize("name", ["absolute", "path object", "./relative", "a/b/c"])
def test_from_pretrained_of_a_missing_folder_says_no_such_folder(tmp_path, name):
    path = {"absolute": str(tmp_path / "nope"), "path object": tmp_path / "nope"}.get(name, name)
    with pytest.raises(FileNotFoundError, match=rf"got '{path}', which does not exist"):
        AdaFlashDrafter.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match=rf"got '{path}', which does not exist"):
        AdaFlashConfig.from_pretrained(path)


# --------------------------------------------------------------------------------------- config types at load
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 16.5, r"block_size: expected int, got 16\.5 \(float\)"),
        ("block_size", "16", r"block_size: expected int, got '16' \(str\)"),
        ("block_size", True, r"block_size: expected int, got True \(bool\)"),
        ("hidden_size", 64.0, r"hidden_size: expected int, got 64\.0 \(float\)"),
        ("learned_mask_embedding", 1, r"learned_mask_embedding: expected bool, got 1 \(int\)"),
        ("length_head_gamma", "1.0", r"length_head_gamma: expected float, got '1\.0' \(str\)"),
        ("target_layer_ids", [1, 2.0], r"target_layer_ids: expected list\[int\] \| None, got \[1, 2\.0\]"),
    ],
)
def test_a_drafter_config_of_the_wrong_type_fails_at_load_naming_the_field(
    target_factory, drafter_factory, tmp_path, field, value, message
):
    drafter_factory(target_factory("qwen3")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        AdaFlashDrafter.from_pretrained(tmp_path)


def test_an_int_is_a_valid_float_field(target_factory):
    config = AdaFlashConfig.for_target(target_factory("qwen3").config, length_head_gamma=1, mask_token_id=3)
    assert config.length_head_gamma == 1


# ----------------------------------------------------------------------------------------------------- dtypes
def test_a_drafter_in_another_dtype_than_its_inputs_says_to_load_it_in_the_target_dtype(
    target_factory, drafter_factory
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target).to(torch.bfloat16)
    ids = torch.tensor([[3, 4, 5, 6]])
    adaflash_hf.disable()  # transformers' native DFlash path, as remote code without adaflash_hf runs it
    try:
        with pytest.raises(
            TypeError,
            match=r"noise_embeds: expected the drafter's dtype torch.bfloat16, got torch.float32; load the drafter "
            r"in the target's dtype with from_pretrained\(\.\.\., dtype=target.dtype\), or call drafter.to",
        ):
            target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=4)
    finally:
        adaflash_hf.enable()


def test_a_drafter_in_another_dtype_runs_under_autocast(target_factory, drafter_factory):
    drafter = drafter_factory(target_factory("qwen3")).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(noise_embeds=torch.randn(1, 16, 64), context_hidden_states=torch.randn(1, 3, 128))
    assert out.last_hidden_state.shape == (1, 16, 64)


# ----------------------------------------------------------------------------- check_target of something else
def test_check_target_of_a_tokenizer_says_it_expects_the_target_model(target_factory, drafter_factory):
    drafter = drafter_factory(target_factory("qwen3"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    )
    with pytest.raises(
        TypeError, match=rf"target: expected the target model .*got a {type(tokenizer).__name__}$"
    ):
        drafter.check_target(tokenizer)
