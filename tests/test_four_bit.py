"""``prepare_target(dtype="int4")``: a target whose linears are 4-bit already runs them on their own 4-bit codes; the
codes are recovered exactly or the dtype is refused (naming the linear) before anything changes; greedy AdaFlash on
the 4-bit target equals its plain greedy decoding token for token, in generate and in the engine; "auto" times it
where the target is 4-bit."""

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf import prepare_target
from adaflash_hf.cost_model import CostModel, use_cost_model
from adaflash_hf.prepared import four_bit
from adaflash_hf.prepared.prepare import is_prepared
from tests.conftest import (
    four_bit_target,
    greedy_reference,
    make_batched_oracle,
    random_prompts,
    serve_with_oracle,
    snapped,
)

pytestmark = pytest.mark.skipif(
    not four_bit.available(), reason="this torch has no CPU kernel for 4-bit weights"
)

PROMPT = torch.randint(0, 500, (1, 70), generator=torch.Generator().manual_seed(5))


def test_the_codes_of_a_four_bit_weight_are_recovered_and_other_weights_give_none():
    weight = snapped(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)))
    codes, steps_and_offsets = four_bit.four_bit_codes(weight)
    assert codes.shape == (48, 96) and int(codes.min()) == 0 and int(codes.max()) == 15
    step, offset = steps_and_offsets.unbind(-1)  # [K / 32, N]
    rebuilt = offset.T.repeat_interleave(32, 1) + step.T.repeat_interleave(32, 1) * codes
    assert torch.equal(rebuilt, weight)
    assert four_bit.four_bit_codes(torch.randn(48, 96)) is None  # 96 levels per group, not 16
    assert four_bit.four_bit_codes(snapped(torch.randn(40, 96))) is None  # N not a multiple of 16


def test_the_kernel_multiplies_by_the_codes_with_bf16_steps_and_offsets():
    weight = snapped(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)))
    codes, steps_and_offsets = four_bit.four_bit_codes(weight)
    packed, scales = four_bit.kernel_weights(codes, steps_and_offsets)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = four_bit.four_bit_linear(x, packed, scales, None).float()
    scale, zero = (scales[..., i].float().T.repeat_interleave(32, 1) for i in (0, 1))
    expected = x.float() @ ((codes - 8) * scale + zero).T
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2)
    assert torch.allclose(out, x.float() @ weight.T, rtol=5e-2, atol=5e-2)  # the same weights, bf16 steps


def test_int4_runs_every_linear_but_the_output_embedding_on_its_codes_and_keeps_the_state_dict(
    target_factory,
):
    target = four_bit_target(target_factory)
    keys = set(target.state_dict())
    reference = target(PROMPT).logits.float()
    prepare_target(target, dtype="int4", rows=4)
    settings = is_prepared(target)
    assert (settings.dtype, settings.invariant, settings.weights) == (torch.bfloat16, True, "int4")
    attention, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
    qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
    fused = four_bit.kernel_of(attention.q_proj, qkv)[0]  # one set of codes for the three
    assert fused.shape[0] == sum(m.out_features for m in qkv)
    assert four_bit.kernel_of(mlp.up_proj, gate_up)[0] is four_bit.kernel_of(mlp.gate_proj, gate_up)[0]
    assert all(four_bit.kernel_of(m) is not None for m in (attention.o_proj, mlp.down_proj))
    assert four_bit.kernel_of(target.lm_head) is None
    assert set(target.state_dict()) == keys
    logits = target(PROMPT).logits.float()
    assert (
        logits.argmax(-1) == reference.argmax(-1)
    ).float().mean() > 0.9  # the same model, in bf16 activations


@pytest.mark.parametrize(
    "make, settings, error",
    [
        (
            "random",
            {},
            r"dtype='int4': expected every linear's weights 4-bit .* got model.layers.0.self_attn.q_proj",
        ),
        (
            "bf16",
            {},
            r"dtype='int4': expected a target in fp32 .* got model.layers.0.self_attn.q_proj.weight",
        ),
        ("four_bit", {"invariant": False}, r"invariant: expected True or None with dtype='int4'"),
    ],
)
def test_int4_is_refused_before_anything_changes(make, settings, error, target_factory):
    target = {
        "random": lambda: target_factory("llama"),
        "bf16": lambda: four_bit_target(target_factory).to(torch.bfloat16),
        "four_bit": lambda: four_bit_target(target_factory),
    }[make]()
    dtype = next(target.parameters()).dtype
    with pytest.raises(ValueError, match=error):
        prepare_target(target, dtype="int4", rows=4, **settings)
    assert next(target.parameters()).dtype == dtype and is_prepared(target) is None
    assert not any(four_bit.ATTRIBUTE in vars(m) for m in target.modules())


def test_a_weight_written_after_preparation_is_refused_at_the_next_forward(target_factory):
    target = prepare_target(four_bit_target(target_factory), dtype="int4", rows=4)
    with torch.no_grad():
        target.model.layers[0].mlp.up_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="weight was written after prepare_target"):
        target(PROMPT)


def test_auto_times_int4_for_a_four_bit_target_and_takes_it_where_fastest(
    target_factory, monkeypatch, tmp_path
):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    timed = []

    def timer(model):
        kind = "int4" if four_bit.ATTRIBUTE in vars(model.model.layers[0].mlp.up_proj) else None
        kind = kind or str(next(model.parameters()).dtype).removeprefix("torch.")
        timed.append(kind)
        return {"float32": {1: 1.0, 4: 1.6}, "bfloat16": {1: 1.0, 4: 1.0}, "int4": {1: 0.6, 4: 0.7}}[kind]

    target = prepare_target(four_bit_target(target_factory), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    assert timed == ["float32", "bfloat16", "int4"]
    assert is_prepared(target).weights == "int4" and "int4: measured fastest" in is_prepared(target).reason
    timed.clear()
    plain = prepare_target(target_factory("llama"), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    assert timed == ["float32", "bfloat16"] and is_prepared(plain).weights == ""  # not 4-bit: not a candidate


@pytest.fixture(scope="module")
def prepared(target_factory):
    target = prepare_target(four_bit_target(target_factory, seed=3), dtype="int4")
    return target, target.generate(
        PROMPT, generation_config=GenerationConfig(max_new_tokens=48, do_sample=False)
    )


@pytest.mark.parametrize("length_mode", ["fixed", "adaptive", "goodput"])
def test_greedy_adaflash_equals_plain_greedy_on_the_int4_target(length_mode, prepared, oracle_factory):
    target, reference = prepared
    if length_mode == "goodput":
        use_cost_model(
            target, "generate", CostModel.profile({1: 1.0, 16: 1.0})
        )  # verification free: long drafts
    oracle = oracle_factory(target, reference, seed=len(length_mode))
    out = target.generate(
        PROMPT,
        assistant_model=oracle,
        generation_config=GenerationConfig(
            max_new_tokens=48, do_sample=False, adaflash_length_mode=length_mode
        ),
    )
    assert torch.equal(out, reference)
    assert max(oracle.last_stats.verify_lengths) > 4  # verifies span several of the 4-bit linears' tiles


def test_engine_batched_equals_serial_equals_plain_on_the_int4_target(prepared, drafter_factory):
    target, _ = prepared
    use_cost_model(target, "engine", CostModel.profile({1: 1.0, 64: 1.0}))
    prompts = random_prompts(5, seed=6, max_len=80)
    expected = [greedy_reference(target, p, 16) for p in prompts]
    oracle, weight = make_batched_oracle(target, drafter_factory(target))
    oracle.to(torch.bfloat16)

    def run(indices):
        return serve_with_oracle(target, oracle, weight, prompts, expected, indices, length_mode="goodput")

    engine, batched = run(range(len(prompts)))
    assert batched == expected
    assert max(s.running for s in engine.stats) > 1 and sum(s.accepted for s in engine.stats) > 0
    assert [run([i])[1][0] for i in range(len(prompts))] == expected
