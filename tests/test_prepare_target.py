"""``prepare_target``: bf16 only where the CPU reports a bf16 unit (both answers injected), fp32 with one line naming
the missing flags otherwise; bad settings are errors before any forward; and on the prepared bf16 target greedy
AdaFlash equals plain greedy token for token, in generate (every length mode and draft source) and in the engine
(batched == serial == plain)."""

import copy
import logging

import pytest
import torch
from transformers import GenerationConfig

from adaflash_hf import prepare_target
from adaflash_hf.cost_model import CostModel, use_cost_model
from adaflash_hf.prepared.cpu import bf16_units, cpu_digest, cpu_model
from adaflash_hf.prepared.linear import InvariantLinear
from adaflash_hf.prepared.prepare import is_prepared
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from tests.conftest import (
    assert_outputs_equal_references,
    finished_requests,
    greedy_reference,
    make_batched_oracle,
    random_prompts,
    serve_with_oracle,
)

# 70 tokens: generation crosses the attention's key-block boundary at 128 only with longer runs; the prompt
# itself spans two blocks.
PROMPT = torch.randint(0, 500, (1, 70), generator=torch.Generator().manual_seed(3))
CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 {}\n"


def greedy(target, n, **kwargs):
    return target.generate(
        PROMPT, generation_config=GenerationConfig(max_new_tokens=n, do_sample=False, **kwargs)
    )


@pytest.fixture
def forwards():
    """Attach to a target: the list its forward pre-hook appends to (no forward: stays empty)."""
    calls = []

    def attach(target):
        target.register_forward_pre_hook(lambda *args: calls.append(1))
        return calls

    return attach


def test_bf16_units_are_read_from_the_cpu_flags():
    assert bf16_units(CPUINFO.format("avx512f avx512_bf16 amx_tile amx_bf16")) == ("amx_bf16", "avx512_bf16")
    assert bf16_units(CPUINFO.format("avx512f avx512_vnni")) == ()
    assert bf16_units("") == ()
    assert cpu_model(CPUINFO.format("")) == "AMD EPYC 9R14"


def test_code_built_for_this_cpu_is_kept_under_its_model_and_flags():
    amx = cpu_digest(CPUINFO.format("avx512f avx512_bf16 amx_bf16"))
    assert amx == cpu_digest(
        CPUINFO.format("amx_bf16 avx512f avx512_bf16")
    )  # the flags' order does not matter
    assert amx != cpu_digest(CPUINFO.format("avx512f avx512_bf16"))
    assert amx != cpu_digest(
        CPUINFO.format("avx512f avx512_bf16 amx_bf16").replace("AMD EPYC 9R14", "Intel Xeon")
    )
    assert len(amx) == 8 and int(amx, 16) >= 0


def test_auto_from_the_flags_alone_casts_to_bf16_where_the_cpu_has_a_bf16_unit(target_factory):
    target = prepare_target(target_factory("llama"), bf16_units=["avx512_bf16"], rows=4, measure=False)
    settings = is_prepared(target)
    assert (settings.dtype, settings.invariant, settings.bf16_units) == (
        torch.bfloat16,
        True,
        ("avx512_bf16",),
    )
    assert next(target.parameters()).dtype == torch.bfloat16
    assert target.model.rotary_emb.inv_freq.dtype == torch.float32
    assert isinstance(target.lm_head, InvariantLinear)


def test_auto_keeps_fp32_without_a_bf16_unit_and_says_which_flags_are_missing(
    target_factory, monkeypatch, caplog
):
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog's root handler
    with caplog.at_level(logging.WARNING):
        target = prepare_target(target_factory("llama"), bf16_units=[])
    lines = [r.getMessage() for r in caplog.records if "prepare_target" in r.getMessage()]
    assert len(lines) == 1 and "amx_bf16" in lines[0] and "avx512_bf16" in lines[0]
    settings = is_prepared(target)
    assert (settings.dtype, settings.invariant) == (torch.float32, False)
    assert type(target.lm_head) is torch.nn.Linear


@pytest.mark.parametrize(
    "settings, error",
    [
        ({"dtype": "float16"}, "dtype: expected one of"),
        ({"dtype": torch.float16}, "dtype: expected one of"),
        ({"dtype": ["bf16"]}, "dtype: expected one of"),
        ({"rows": 0}, "rows: expected an int >= 1"),
        ({"rows": 2.0}, "rows: expected an int >= 1"),
        ({"bf16_units": ["avx2"]}, "bf16_units: expected flags among"),
        ({"invariant": "yes"}, "invariant: expected a bool or None"),
        ({"check": None}, "check: expected a bool"),
    ],
)
def test_bad_settings_are_errors_before_any_forward(settings, error, target_factory, forwards):
    target = target_factory("qwen3")
    calls = forwards(target)
    with pytest.raises((ValueError, TypeError), match=error):
        prepare_target(target, **settings)
    assert calls == [] and next(target.parameters()).dtype == torch.float32 and is_prepared(target) is None


def test_a_target_that_is_not_a_causal_lm_is_refused(drafter_factory, target_factory):
    with pytest.raises(TypeError, match="target: expected a transformers causal LM"):
        prepare_target(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="target: expected a transformers causal LM.*got AdaFlashDrafter"):
        prepare_target(drafter_factory(target_factory("qwen3")))


def test_preparing_again_returns_the_target_or_refuses_other_settings(target_factory):
    target = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    assert prepare_target(target, dtype=torch.bfloat16) is target
    with pytest.raises(ValueError, match="target: expected a target not yet prepared"):
        prepare_target(target, dtype="fp32")


def test_a_prepared_target_cast_afterwards_is_no_longer_prepared(target_factory):
    target = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    target.to(torch.float32)
    assert is_prepared(target) is None


def test_a_linear_swapped_in_afterwards_unprepares_the_target_at_the_next_check(target_factory):
    # The check walks the modules only where a module was registered since its last walk, or every WALK_EVERY
    # checks: a linear set as an attribute (as PEFT swaps one) is seen at once; one written straight into a
    # module's children, which no registration hook sees, within WALK_EVERY checks.
    from adaflash_hf.prepared import forward

    target = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    assert all(is_prepared(target) is not None for _ in range(3 * forward.WALK_EVERY))
    mlp = target.model.layers[0].mlp
    kept = mlp.down_proj
    mlp.down_proj = torch.nn.Linear(kept.in_features, kept.out_features, bias=False).to(torch.bfloat16)
    assert is_prepared(target) is None
    mlp.down_proj = kept
    assert is_prepared(target) is not None
    mlp._modules["down_proj"] = torch.nn.Linear(kept.in_features, kept.out_features, bias=False).to(
        torch.bfloat16
    )
    checks = [is_prepared(target) is None for _ in range(forward.WALK_EVERY + 1)]
    assert checks[-1] and checks.index(True) <= forward.WALK_EVERY
    mlp._modules["down_proj"] = kept
    assert is_prepared(target) is not None
    copied = copy.deepcopy(target)  # a copy's modules are new: its first check walks them
    copied.model.layers[0].mlp._modules["down_proj"] = torch.nn.Linear(4, 4)
    assert is_prepared(copied) is None and is_prepared(target) is not None


def test_the_check_refuses_a_forward_whose_rows_depend_on_the_row_count(target_factory):
    class RowCountLinear(torch.nn.Linear):  # a subclass the preparation leaves alone
        def forward(self, x):
            return super().forward(x) * (1 + 1e-2 * x.shape[-2])

    target = target_factory("qwen3")
    old = target.model.layers[0].mlp.down_proj
    target.model.layers[0].mlp.down_proj = RowCountLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(RuntimeError, match="not batch-invariant on this machine"):
        prepare_target(target, dtype="bf16", rows=4)


def test_the_check_refuses_a_forward_whose_rows_depend_on_their_position_in_the_call(target_factory):
    class PositionLinear(
        torch.nn.Linear
    ):  # a subclass the preparation leaves alone: a kernel with an uneven tail
        def forward(self, x):
            out = super().forward(x)
            last = (torch.arange(x.shape[-2]) == x.shape[-2] - 1)[:, None] * (x.shape[-2] > 1)
            return out + (1e-2 * last).to(out.dtype)

    target = target_factory("qwen3")
    old = target.model.layers[1].self_attn.o_proj
    target.model.layers[1].self_attn.o_proj = PositionLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(RuntimeError, match="row 1 of a 2-token forward differs"):
        prepare_target(target, dtype="bf16", rows=4)


def test_auto_keeps_fp32_where_a_bf16_linear_finds_no_tile(target_factory, monkeypatch, caplog):
    import adaflash_hf.prepared.prepare as prepare

    class RowByRow:
        rows = 1

    monkeypatch.setattr(prepare, "linear_tiles", lambda *args: RowByRow())
    with caplog.at_level(logging.WARNING):
        target = prepare_target(target_factory("qwen3"), bf16_units=["avx512_bf16"], rows=4, measure=False)
    settings = is_prepared(target)
    assert settings.dtype == torch.float32 and not settings.invariant
    assert "one row per call" in settings.reason and "one row per call" in caplog.text


def curves(fp32: dict, bf16: dict, calls: list):
    """A timer that answers fixed curves by the dtype of the model it times, and records each call."""

    def timer(model):
        dtype = next(model.parameters()).dtype
        calls.append(dtype)
        return fp32 if dtype == torch.float32 else bf16

    return timer


@pytest.mark.parametrize(
    "bf16, expected",
    [
        ({1: 1.0, 4: 1.0, 16: 1.1}, torch.bfloat16),  # verifies cheaply, decodes as fast: bf16
        ({1: 1.02, 4: 1.0, 16: 1.1}, torch.bfloat16),  # within timing noise of fp32's step
        (
            {1: 1.3, 4: 1.3, 16: 1.4},
            torch.float32,
        ),  # verifies cheaply but decodes slower: never slower than fp32
    ],
)
def test_auto_takes_the_measured_faster_forward_that_decodes_no_slower_than_fp32(
    bf16, expected, target_factory
):
    calls = []
    timer = curves({1: 1.0, 4: 1.6, 16: 2.0}, bf16, calls)
    target = prepare_target(target_factory("qwen3"), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    settings = is_prepared(target)
    assert settings.dtype == expected and settings.invariant == (expected == torch.bfloat16)
    assert "measured" in settings.reason and "1-token step 1000.0 ms" in settings.reason
    assert calls == [torch.float32, torch.bfloat16]
    assert prepare_target(target, bf16_units=["avx512_bf16"], timer=timer) is target
    assert len(calls) == 2  # "auto" on a prepared target keeps its choice without timing again


def test_auto_measures_nothing_without_a_bf16_unit(target_factory):
    calls = []
    prepare_target(target_factory("qwen3"), bf16_units=[], timer=curves({1: 1.0}, {1: 0.5}, calls))
    assert calls == []


def test_the_measured_choice_is_kept_for_the_next_process_on_this_machine(
    target_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    calls = []
    timer = curves({1: 1.0, 16: 2.0}, {1: 1.0, 16: 1.0}, calls)
    first = prepare_target(target_factory("qwen3"), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    second = prepare_target(target_factory("qwen3"), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    assert calls == [torch.float32, torch.bfloat16]  # timed once
    assert is_prepared(first).dtype == is_prepared(second).dtype == torch.bfloat16
    assert "kept from an earlier run" in is_prepared(second).reason
    kept = next(tmp_path.glob("dtype/*.json"))
    kept.write_text("{not json")
    third = prepare_target(target_factory("qwen3"), bf16_units=["avx512_bf16"], rows=4, timer=timer)
    assert len(calls) == 4 and is_prepared(third).dtype == torch.bfloat16  # an unreadable file is timed again


def test_the_default_timer_times_every_verify_size_on_a_copy(target_factory):
    from adaflash_hf.prepared.choice import forward_timer

    target = target_factory("qwen3")
    before = {name: p.clone() for name, p in target.state_dict().items()}
    seconds = forward_timer(target, sizes=(1, 3), context=9, repeats=1)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())
    assert all(torch.equal(before[name], p) for name, p in target.state_dict().items())


def test_plain_generate_of_the_prepared_target_runs_the_invariant_attention(target_factory, monkeypatch):
    import adaflash_hf.prepared.forward as invariant_forward

    target = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    calls = []
    original = invariant_forward.sequence_attention
    monkeypatch.setattr(
        invariant_forward, "sequence_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    greedy(target, 3)
    assert len(calls) == 3 * target.config.num_hidden_layers


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def prepared(request, target_factory):
    target = prepare_target(target_factory(request.param), dtype="bf16")
    return target, greedy(target, 60)


@pytest.mark.parametrize("source", ["diffusion", "hybrid"])
@pytest.mark.parametrize("length_mode", ["fixed", "adaptive", "goodput"])
def test_greedy_adaflash_equals_plain_greedy_on_the_prepared_bf16_target(
    length_mode, source, prepared, oracle_factory
):
    target, reference = prepared
    if length_mode == "goodput":
        use_cost_model(
            target, "generate", CostModel.profile({1: 1.0, 16: 1.0})
        )  # verification free: long drafts
    oracle = oracle_factory(target, reference, seed=len(length_mode) + len(source))
    knobs = {"adaflash_length_mode": length_mode, "adaflash_draft_source": source}
    out = target.generate(
        PROMPT,
        assistant_model=oracle,
        generation_config=GenerationConfig(max_new_tokens=60, do_sample=False, **knobs),
    )
    assert torch.equal(out, reference)
    assert max(oracle.last_stats.verify_lengths) > 1 and sum(oracle.last_stats.accepted_lengths) > 0


@pytest.mark.parametrize(
    "length_mode, source", [("fixed", "diffusion"), ("adaptive", "hybrid"), ("goodput", "diffusion")]
)
def test_engine_batched_equals_serial_equals_plain_on_the_prepared_bf16_target(
    length_mode, source, prepared, drafter_factory
):
    target, _ = prepared
    if length_mode == "goodput":
        use_cost_model(
            target, "engine", CostModel.profile({1: 1.0, 64: 1.0})
        )  # verification free: long drafts
    prompts = random_prompts(5, seed=4, max_len=80)
    expected = [greedy_reference(target, p, 16) for p in prompts]
    oracle, weight = make_batched_oracle(target, drafter_factory(target))
    oracle.to(torch.bfloat16)

    def run(indices):
        return serve_with_oracle(
            target, oracle, weight, prompts, expected, indices, length_mode=length_mode, draft_source=source
        )

    engine, batched = run(range(len(prompts)))
    assert batched == expected
    assert max(s.running for s in engine.stats) > 1 and sum(s.accepted for s in engine.stats) > 0
    assert [run([i])[1][0] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sixteen_requests_at_once_equal_each_request_served_alone_on_a_prepared_target(
    dtype, target_factory, drafter_factory
):
    # Mixed prompt lengths (some across the attention's key-block boundary), requests joining at random steps and
    # two aborted, goodput on a cost curve where drafts pay for some requests and not others: steps mix prefills,
    # verifies with drafts and verifies without.
    target = prepare_target(target_factory("qwen3"), dtype=dtype, invariant=True, rows=4)
    use_cost_model(target, "engine", CostModel.profile({1: 1.0, 2: 1.2, 8: 2.0}, drafter_seconds=0.05))
    prompts = random_prompts(16, seed=21, max_len=110)
    params = [
        SamplingParams(max_new_tokens=n)
        for n in torch.randint(4, 25, (16,), generator=torch.Generator().manual_seed(21)).tolist()
    ]
    expected = [greedy_reference(target, p, s.max_new_tokens) for p, s in zip(prompts, params)]
    oracle, weight = make_batched_oracle(target, drafter_factory(target))
    oracle.to(dtype)

    def engine():
        built = AdaFlashEngine(
            target, oracle, length_mode="goodput", admission=AdmissionConfig(max_running=16)
        )
        references = {}
        oracle.arm(built, references, weight, seed=21)
        return built, references

    batched, references = engine()
    arrivals = {i: 0 if i < 12 else 2 * i - 21 for i in range(16)}  # twelve at once, four joining later
    aborts = {4: 3, 9: 13}  # step -> request: one leaves early, one right after it joined
    ids, step, finished = {}, 0, {}
    while len(ids) < len(prompts) or batched.has_unfinished():
        for i in [i for i, at in arrivals.items() if at == step]:
            ids[i] = batched.add_request(prompts[i], params[i])
            references[ids[i]] = prompts[i].tolist() + expected[i]
        if step in aborts and ids[aborts[step]] in batched.requests:
            batched.abort(ids[aborts[step]])
        finished |= finished_requests(batched.step())
        step += 1
    results = {i: finished[rid] for i, rid in ids.items()}
    assert_outputs_equal_references(results, set(aborts.values()), expected)
    assert max(s.running for s in batched.stats) >= 12
    assert any(s.zero_length_verifies and s.draft_tokens for s in batched.stats), (
        "no step mixed k = 0 with drafts"
    )
    for i, prompt in enumerate(prompts):
        alone, references = engine()
        rid = alone.add_request(prompt, params[i])
        references[rid] = prompt.tolist() + expected[i]
        assert finished_requests(alone.stream())[rid].output == expected[i], f"request {i} served alone"


def test_a_prepared_target_decodes_the_same_in_and_out_of_inference_mode(target_factory):
    # a decode step pads its one row into a tile kept per thread: made in one mode, written in the other
    target = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    with torch.inference_mode():
        first = target(PROMPT[:, :1]).logits
    with torch.no_grad():
        second = target(PROMPT[:, :1]).logits
    third = target(PROMPT[:, :1]).logits  # gradients on: the weights require them
    assert torch.equal(first, second) and torch.equal(first, third.detach())


def test_projections_of_one_input_run_as_one_linear_and_each_member_returns_its_part(target_factory):
    target = prepare_target(target_factory("llama"), dtype="bf16", rows=4)
    attention = target.model.layers[0].self_attn
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        # another input: the group runs again and this member takes its part
        assert torch.equal(attention.k_proj(x.clone()), k)
        for out, module in ((q, attention.q_proj), (k, attention.k_proj), (v, attention.v_proj)):
            expected = x.float() @ module.weight.float().T
            assert out.shape[-1] == module.out_features and torch.allclose(out.float(), expected, atol=0.05)
        attention.k_proj.weight.mul_(2)  # a member's weight written: the group's weights are taken again
        assert torch.equal(attention.k_proj(x), 2 * k)


def test_a_timed_prefill_weighs_in_the_choice_of_a_served_dtype():
    from adaflash_hf.prepared.choice import PREFILL, PROMPT_TOKENS_PER_TOKEN, choose, expected_rate

    decoding_fast = {1: 0.055, 4: 0.150}  # a 16-request step; its prefill is slow
    prefilling_fast = {1: 0.062, 4: 0.110}
    assert expected_rate(decoding_fast) > expected_rate(prefilling_fast)
    assert choose({"fp32": {1: 0.09}, "int4": decoding_fast, "bf16": prefilling_fast})[0] == "int4"
    timings = {"fp32": {PREFILL: 0.050, 1: 0.09}, "int4": {PREFILL: 0.027, **decoding_fast}}
    timings["bf16"] = {PREFILL: 0.015, **prefilling_fast}
    best, why = choose(timings)
    assert best == "bf16" and "prefill 27.0 ms a prompt token" in why
    rate = 1 / (0.062 / 1 + PROMPT_TOKENS_PER_TOKEN * 0.015)
    assert expected_rate(timings["bf16"]) == pytest.approx(max(rate, 1 / (0.110 / 1.875 + 2 * 0.015)))
