"""Reduced draft vocabulary: the builder, the config field, proposals only inside the subset (generate and engine),
lossless greedy decoding with it, and its round trip through save/load and export/import.

The sampling law with a subset is tested in test_generation_sampling.py (its ``draft_vocab`` cases)."""

import json

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter, RoundRecord
from adaflash_hf.draft_vocab import build_draft_vocab, draft_logits
from adaflash_hf.interop import export_dflash, import_checkpoint
from adaflash_hf.serving import AdaFlashEngine, SamplingParams

PROMPT = torch.tensor([[5, 17, 99, 3, 250, 8, 41, 77, 12]])
EVERY_EIGHTH = list(range(0, 512, 8))


def greedy(target, n, **kwargs):
    config = GenerationConfig(max_new_tokens=n, do_sample=False, **kwargs.pop("config", {}))
    return target.generate(PROMPT, generation_config=config, **kwargs)


def recorded_drafts(drafter) -> list[RoundRecord]:
    records = []
    drafter.round_recorder = records.append
    return records


# ----------------------------------------------------------------------------------------------------- the builder
def test_builder_counts_response_tokens_only():
    sequences = [
        {"input_ids": [7, 7, 7, 7, 1, 2, 2], "prompt_length": 4},
        {"input_ids": [7, 3], "prompt_length": 1},
    ]
    ids, coverage = build_draft_vocab(sequences, size=2)
    assert ids == [
        1,
        2,
    ]  # 7 fills the prompts but no response; 2 (twice), then 1 beats 3 (once each) on id order
    assert coverage == pytest.approx(3 / 4)


def test_builder_takes_the_most_frequent_tokens_ties_by_lower_id():
    sequences = [{"input_ids": torch.tensor([9, 5, 5, 5, 4, 4, 8, 8, 6]), "prompt_length": 1}]
    ids, coverage = build_draft_vocab(sequences, size=3)
    assert ids == [4, 5, 8]  # 5 x3, then 4 and 8 x2 (6 x1 loses)
    assert coverage == pytest.approx(7 / 8)


def test_builder_pads_with_the_lowest_unused_ids():
    ids, coverage = build_draft_vocab([{"input_ids": [3, 1, 4], "prompt_length": 0}], size=6)
    assert ids == [0, 1, 2, 3, 4, 5]
    assert coverage == 1.0


def test_builder_always_keeps_eos():
    sequences = [{"input_ids": [6, 6, 7, 7, 8], "prompt_length": 0}]
    ids, coverage = build_draft_vocab(sequences, size=2, eos_token_id=100)
    assert ids == [6, 100]
    assert coverage == pytest.approx(2 / 5)
    assert build_draft_vocab(sequences, size=3, eos_token_id=[8, 9])[0] == [6, 8, 9]


def test_builder_without_any_response_token_is_a_clear_error():
    with pytest.raises(ValueError, match="sequences: expected at least one response token"):
        build_draft_vocab([{"input_ids": [1, 2], "prompt_length": 2}], size=4)


# ------------------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    "bad, message",
    [
        ([], r"a non-empty sorted list .*got \[\]"),
        ([4, 9, 2], "strictly increasing .*got 2 after 9"),
        ([4, 4, 9], "strictly increasing .*got 4 after 4"),
        ([4, 512], r"ids in 0\.\.511 \(vocab_size=512\), got 512"),
        ([-1, 4], "ids >= 0, got -1"),
    ],
    ids=["empty", "unsorted", "duplicate", "out_of_range", "negative"],
)
def test_bad_draft_token_ids_fail_at_config_construction(bad, message, qwen3_target):
    with pytest.raises(
        (ValueError, StrictDataclassClassValidationError), match=f"draft_token_ids: expected {message}"
    ):
        AdaFlashConfig.for_target(qwen3_target.config, mask_token_id=511, draft_token_ids=bad)


def test_bad_draft_token_ids_given_to_from_pretrained_fail_before_loading(
    qwen3_target, drafter_factory, tmp_path
):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft_token_ids: expected strictly increasing"):
        AdaFlashDrafter.from_pretrained(tmp_path, draft_token_ids=[5, 3])


def test_drafter_exposes_the_subset_as_a_long_tensor_outside_the_state_dict(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    assert drafter.draft_token_ids.dtype == torch.long
    assert drafter.draft_token_ids.tolist() == EVERY_EIGHTH
    assert not any("draft_token_ids" in name for name in drafter.state_dict())
    assert drafter_factory(qwen3_target).draft_token_ids is None


def test_the_subset_rows_follow_a_target_cast_in_place(qwen3_target):
    # prepare_target casts the target in place: the lm_head keeps its Parameter (and version) with new data.
    token_ids = torch.tensor(EVERY_EIGHTH)
    hidden = torch.randn(2, qwen3_target.config.hidden_size)
    lm_head = qwen3_target.get_output_embeddings()
    with torch.no_grad():
        draft_logits(hidden, lm_head, token_ids)
        qwen3_target.to(torch.bfloat16)
        logits, _ = draft_logits(hidden.to(torch.bfloat16), lm_head, token_ids)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(
        logits, torch.nn.functional.linear(hidden.to(torch.bfloat16), lm_head.weight[token_ids])
    )


# ------------------------------------------------------------------------------------------------------- proposals
@pytest.mark.parametrize(
    "config",
    [
        {"do_sample": False},
        {"do_sample": True, "adaflash_proposal": "argmax"},
        {"do_sample": True, "adaflash_proposal": "sample"},
    ],
    ids=["greedy", "sample-argmax", "sample-sample"],
)
def test_generate_proposes_only_subset_tokens(config, qwen3_target, drafter_factory):
    torch.manual_seed(0)
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    records = recorded_drafts(drafter)
    qwen3_target.generate(
        PROMPT,
        assistant_model=drafter,
        generation_config=GenerationConfig(max_new_tokens=24, adaflash_draft_source="diffusion", **config),
    )
    drafted = {t for r in records for t in r.drafted_tokens}
    assert drafted and drafted <= set(EVERY_EIGHTH)


def test_the_same_drafter_without_the_subset_proposes_outside_it(qwen3_target, drafter_factory):
    # The control for the test above: the subset, not the random weights, keeps the proposals inside.
    drafter = drafter_factory(qwen3_target)
    records = recorded_drafts(drafter)
    greedy(qwen3_target, 24, assistant_model=drafter)
    assert {t for r in records for t in r.drafted_tokens} - set(EVERY_EIGHTH)


def test_engine_proposes_only_subset_tokens_and_stays_lossless(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    prompts = [PROMPT[0], PROMPT[0, 2:], torch.tensor([400, 3, 77])]
    expected = [
        qwen3_target.generate(p[None], max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = AdaFlashEngine(qwen3_target, drafter, length_mode="fixed")
    engine.record_full_drafts = True
    drafted = set()
    engine.round_recorder = lambda request, record: drafted.update(record.drafted_tokens)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=16)) == expected
    assert drafted and drafted <= set(EVERY_EIGHTH)


# --------------------------------------------------------------------------------------------------- greedy lossless
@pytest.mark.parametrize(
    "config",
    [{"adaflash_length_mode": "adaptive", "adaflash_gamma": 2.0}, {"adaflash_length_mode": "fixed"}],
    ids=["adaptive", "fixed"],
)
def test_greedy_with_a_subset_equals_plain_greedy(config, target_factory, oracle_factory):
    target = target_factory("qwen3")
    reference = greedy(target, 60)
    generated = reference[0, PROMPT.shape[1] :].tolist()
    # Every other generated token: the oracle's drafts are often accepted, and often impossible inside the subset.
    subset = sorted(set(generated[::2]))
    assert set(generated) - set(subset)
    oracle = oracle_factory(target, reference, seed=3, draft_token_ids=subset)
    records = recorded_drafts(oracle)
    assert torch.equal(greedy(target, 60, assistant_model=oracle, config=config), reference)
    assert oracle.last_stats.tau > 1.5
    assert {t for r in records for t in r.drafted_tokens} <= set(subset)


def test_native_dflash_path_drafts_over_the_full_vocabulary_and_stays_lossless(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    reference = greedy(qwen3_target, 24)
    adaflash_hf.disable()
    try:
        out = greedy(qwen3_target, 24, assistant_model=drafter, config={"speculation_type": "dflash"})
    finally:
        adaflash_hf.enable()
    assert torch.equal(out, reference)


# ------------------------------------------------------------------------------------------------------ round trips
def test_save_and_load_keep_the_subset(qwen3_target, drafter_factory, tmp_path):
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    drafter.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_token_ids"] == EVERY_EIGHTH
    loaded = AdaFlashDrafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_token_ids, drafter.draft_token_ids)


def test_export_and_import_keep_the_subset(qwen3_target, drafter_factory, tmp_path):
    drafter = drafter_factory(qwen3_target, draft_token_ids=EVERY_EIGHTH)
    export_dflash(drafter, tmp_path / "dflash")
    exported = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["draft_token_ids"] == EVERY_EIGHTH
    assert AdaFlashDrafter.from_pretrained(tmp_path / "dflash").draft_token_ids.tolist() == EVERY_EIGHTH
    import_checkpoint(tmp_path / "dflash", tmp_path / "ours")
    imported = AdaFlashDrafter.from_pretrained(tmp_path / "ours")
    assert imported.draft_token_ids.tolist() == EVERY_EIGHTH
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name


def test_a_drafters_linears_run_on_packed_weights_at_inference_and_follow_a_reload():
    from adaflash_hf.prepared.linear import FastLinear, can_pack, fast_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 3, 32).to(torch.bfloat16)
    expected = model(x)
    assert fast_linears(model) == 2 and fast_linears(model) == 0
    assert all(type(m) is FastLinear for m in (model[0], model[2]))
    with torch.inference_mode():
        assert torch.allclose(model(x), expected, rtol=2e-2, atol=2e-2)
    # a hot reload writes the weights in place: the next call packs them again
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    reference = torch.nn.functional.linear(
        torch.relu(torch.nn.functional.linear(x, state["0.weight"], state["0.bias"])), state["2.weight"]
    )
    with torch.inference_mode():
        assert torch.allclose(model(x), reference, rtol=2e-2, atol=5e-2)
    # a call that wants gradients runs F.linear and gets them
    model(x).float().sum().backward()
    assert model[0].weight.grad is not None and model[2].weight.grad is not None
    assert model.state_dict().keys() == state.keys()
    if can_pack(model[0].weight):
        from adaflash_hf.prepared import linear

        assert id(model[0].weight) in linear._FAST
