"""The drafter's forward: cached rounds equal a from-scratch recomputation, it plugs into transformers' Auto classes
and native DFlash generation losslessly, and the length head gives a bounded k̂ from detached states."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModel
from transformers.cache_utils import DFlashCache

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

# Context grows by a different number of accepted positions each round, including 1 and a whole block.
ROUND_GROWTH = [9, 1, 5, 16, 3, 2]


def target_context_features(target, drafter, length, seed=0):
    """Real target features for a random prompt: [1, length, n_ids * H]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, length), generator=g)
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
    return drafter.context_features(hidden_states)


def random_block(drafter, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(
        1, drafter.config.block_size, drafter.config.hidden_size, generator=g, dtype=torch.float64
    )


def full_recompute(drafter, block, context):
    n = context.shape[1]
    positions = torch.arange(n + drafter.config.block_size)[None]
    with torch.no_grad():
        return drafter(noise_embeds=block, context_hidden_states=context, position_ids=positions, cache=None)


@pytest.mark.parametrize("learned_mask_embedding", [False, True])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_cached_rounds_equal_full_recompute_in_float64(
    target_factory, drafter_factory, kind, learned_mask_embedding
):
    target = target_factory(kind, dtype=torch.float64)
    drafter = drafter_factory(target, learned_mask_embedding=learned_mask_embedding)
    block_size = drafter.config.block_size
    features = target_context_features(target, drafter, sum(ROUND_GROWTH))
    cache = DFlashCache(config=drafter.config)
    committed = 0
    for round_idx, growth in enumerate(ROUND_GROWTH):
        if round_idx:
            cache.crop(-block_size)  # evict last round's block K/V, as DFlashTokenCandidateGenerator does
        block = random_block(drafter, seed=round_idx)
        positions = torch.arange(committed, committed + growth + block_size)[None]
        with torch.no_grad():
            cached = drafter(
                noise_embeds=block,
                context_hidden_states=features[:, committed : committed + growth],
                position_ids=positions,
                cache=cache,
            )
        committed += growth
        reference = full_recompute(drafter, block, features[:, :committed])
        torch.testing.assert_close(cached.last_hidden_state, reference.last_hidden_state, rtol=0, atol=1e-12)
        torch.testing.assert_close(cached.acceptance_prob, reference.acceptance_prob, rtol=0, atol=1e-12)
        assert cache.get_seq_length() == committed + block_size


def test_dropping_one_context_token_changes_the_output(qwen3_target, drafter_factory):
    target = qwen3_target.double()
    drafter = drafter_factory(target)
    features = target_context_features(target, drafter, 12)
    block = random_block(drafter, seed=0)
    full = full_recompute(drafter, block, features).last_hidden_state
    dropped = full_recompute(
        drafter, block, torch.cat([features[:, :5], features[:, 6:]], dim=1)
    ).last_hidden_state
    assert (full - dropped).abs().max() > 1e-4


def test_eager_and_sdpa_attention_agree_in_float64(qwen3_target, drafter_factory):
    target = qwen3_target.double()
    drafter = drafter_factory(target)
    features = target_context_features(target, drafter, 10)
    block = random_block(drafter, seed=0)
    drafter.set_attn_implementation("sdpa")
    sdpa = full_recompute(drafter, block, features).last_hidden_state
    drafter.set_attn_implementation("eager")
    eager = full_recompute(drafter, block, features).last_hidden_state
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-12)


def test_auto_model_from_config_builds_an_adaflash_drafter():
    config = AdaFlashConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        target_layer_ids=[1],
        mask_token_id=0,
        block_size=4,
    )
    assert type(AutoModel.from_config(config)) is AdaFlashDrafter


def test_a_new_drafter_has_no_stats_no_round_recorder_and_weights_version_0(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target)
    assert (drafter.last_stats, drafter.round_recorder, drafter.weights_version) == (None, None, 0)


def test_auto_config_knows_the_adaflash_model_type():
    assert type(AutoConfig.for_model("adaflash", target_layer_ids=[0])) is AdaFlashConfig


@pytest.mark.parametrize("learned_mask_embedding", [False, True])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_native_dflash_generate_equals_greedy(target_factory, drafter_factory, kind, learned_mask_embedding):
    target = target_factory(kind)
    drafter = drafter_factory(target, learned_mask_embedding=learned_mask_embedding)
    ids = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    greedy = target.generate(ids, max_new_tokens=40, do_sample=False)
    calls = []
    drafter.register_forward_pre_hook(lambda *_: calls.append(1))
    speculative = target.generate(
        ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=40, do_sample=False
    )
    assert calls, "the drafter never ran"
    assert torch.equal(speculative, greedy)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_native_dflash_generate_commits_accepted_blocks(target_factory, drafter_factory, kind):
    # Zeroed final norms make target and drafter logits all zero, so both pick token 0 and every draft is accepted.
    target = target_factory(kind)
    drafter = drafter_factory(target)
    with torch.no_grad():
        target.model.norm.weight.zero_()
        drafter.norm.weight.zero_()
    ids = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    greedy = target.generate(ids, max_new_tokens=40, do_sample=False)
    target_calls = []
    target.register_forward_pre_hook(lambda *_: target_calls.append(1))
    speculative = target.generate(
        ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=40, do_sample=False
    )
    assert torch.equal(speculative, greedy)
    assert len(target_calls) <= 40 // 4  # plain greedy needs 40 target forwards


# -------------------------------------------------------------------------------------------------- length head
LENGTH_HEAD_VARIANTS = ["two_model", "paper"]


def head_inputs():
    """Final drafter states [cases, blocks=2, block_size=16, H=64]: ordinary, extreme, infinite and NaN values."""
    g = torch.Generator().manual_seed(0)
    ordinary = torch.randn(4, 2, 16, 64, generator=g)
    extreme = torch.randn(4, 2, 16, 64, generator=g).sign() * 1e4
    special = torch.stack(
        [
            torch.full((2, 16, 64), math.nan),
            torch.full((2, 16, 64), math.inf),
            torch.full((2, 16, 64), -math.inf),
            torch.zeros(2, 16, 64),
        ]
    )
    partial_nan = torch.randn(1, 2, 16, 64, generator=g)
    partial_nan[0, 0, 3, 7] = math.nan
    return torch.cat([ordinary, extreme, special, partial_nan])


@pytest.mark.parametrize("gamma", [None, 0.01, 1.0, 1.3, 1e6])
@pytest.mark.parametrize("variant", LENGTH_HEAD_VARIANTS)
def test_predicted_length_stays_within_min_len_and_block_size_minus_one(
    qwen3_target, drafter_factory, variant, gamma
):
    drafter = drafter_factory(qwen3_target, length_head_variant=variant, length_head_min_len=2)
    with torch.no_grad():
        prob = drafter.length_head(head_inputs())
    for min_len in (None, 0, 15):
        length = drafter.predict_draft_length(prob, gamma=gamma, min_len=min_len)
        low = drafter.config.length_head_min_len if min_len is None else min_len
        assert length.dtype == torch.long and length.shape == prob.shape
        assert ((length >= low) & (length <= drafter.config.block_size - 1)).all()


@pytest.mark.parametrize("variant", LENGTH_HEAD_VARIANTS)
def test_nan_hidden_states_give_min_len(qwen3_target, drafter_factory, variant):
    drafter = drafter_factory(qwen3_target, length_head_variant=variant, length_head_min_len=3)
    noise = torch.full((1, 16, 64), math.nan)
    with torch.no_grad():
        prob = drafter(
            noise_embeds=noise, context_hidden_states=torch.randn(1, 4, drafter.fc.in_features)
        ).acceptance_prob
    assert prob.isnan().all()
    assert drafter.predict_draft_length(prob).tolist() == [3]


def test_predicted_length_follows_the_formula(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target, length_head_gamma=1.3, length_head_min_len=1)
    prob = torch.tensor([0.0, 0.2, 0.5, 0.77, 1.0])
    expected = [max(1, min(15, math.floor(1.3 * p * 15))) for p in prob.tolist()]
    assert drafter.predict_draft_length(prob).tolist() == expected


@pytest.mark.parametrize(
    ("gamma", "min_len", "field"), [(0.0, 1, "gamma"), (math.nan, 1, "gamma"), (1.0, 16, "min_len")]
)
def test_predict_draft_length_rejects_bad_settings(qwen3_target, drafter_factory, gamma, min_len, field):
    drafter = drafter_factory(qwen3_target)
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        drafter.predict_draft_length(torch.tensor([0.5]), gamma=gamma, min_len=min_len)


@pytest.mark.parametrize("variant", LENGTH_HEAD_VARIANTS)
def test_acceptance_prob_has_one_entry_per_block(qwen3_target, drafter_factory, variant):
    drafter = drafter_factory(qwen3_target, length_head_variant=variant)
    context = torch.randn(2, 5, drafter.fc.in_features)
    with torch.no_grad():
        one = drafter(noise_embeds=torch.randn(2, 16, 64), context_hidden_states=context).acceptance_prob
        three = drafter(noise_embeds=torch.randn(2, 48, 64), context_hidden_states=context).acceptance_prob
    assert one.shape == (2,) and three.shape == (2, 3)
    assert ((one > 0) & (one < 1)).all() and ((three > 0) & (three < 1)).all()


@pytest.mark.parametrize("variant", LENGTH_HEAD_VARIANTS)
def test_length_head_loss_does_not_reach_the_drafter(qwen3_target, drafter_factory, variant):
    drafter = drafter_factory(qwen3_target, length_head_variant=variant).train()
    out = drafter(
        noise_embeds=torch.randn(1, 16, 64), context_hidden_states=torch.randn(1, 5, drafter.fc.in_features)
    )
    ((out.acceptance_prob - 0.7) ** 2).sum().backward()
    head = set(drafter.length_head_parameter_names())
    assert head
    for name, param in drafter.named_parameters():
        if name in head:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


@pytest.mark.parametrize("variant", LENGTH_HEAD_VARIANTS)
def test_reset_length_head_gives_a_fresh_head_of_the_same_shape_dtype_and_name(
    qwen3_target, drafter_factory, variant
):
    drafter = drafter_factory(qwen3_target, length_head_variant=variant).to(torch.float64)
    old = drafter.length_head
    drafter.reset_length_head(seed=3)
    new = drafter.length_head
    assert new is not old and getattr(drafter, drafter.length_head_name) is new
    assert [(p.shape, p.dtype) for p in new.parameters()] == [(p.shape, p.dtype) for p in old.parameters()]
    assert drafter.length_head_parameter_names() == [
        f"{drafter.length_head_name}.{name}" for name, _ in new.named_parameters()
    ]
    drafter.reset_length_head(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), drafter.length_head.parameters()))


def test_length_head_names_follow_the_checkpoint_layouts(qwen3_target, drafter_factory):
    names = {
        variant: drafter_factory(qwen3_target, length_head_variant=variant).length_head_name
        for variant in LENGTH_HEAD_VARIANTS
    }
    assert names == {"two_model": "thresh_head_two_model", "paper": "length_head"}


def test_the_length_heads_signal_is_the_realised_fraction_and_its_error():
    from adaflash_hf.modeling.length_head_adaflash import (
        length_head_error,
        length_head_loss,
        realised_acceptance,
    )

    accepted = torch.tensor([0, 3, 15])
    realised = realised_acceptance(accepted, block_size=16)
    assert realised.dtype == torch.float32 and torch.equal(realised, torch.tensor([0.0, 3.0, 15.0]) / 15)
    assert realised_acceptance(3, block_size=16) == 3 / 15
    predicted = torch.tensor([0.5, 0.2, 0.75])
    assert torch.allclose(length_head_error(predicted, realised), torch.tensor([0.5, 0.0, 0.25]))
    expected = ((predicted - realised) ** 2).mean()
    assert torch.allclose(length_head_loss(predicted.to(torch.bfloat16), realised), expected, atol=1e-3)


def test_align_dtype_casts_the_drafter_to_the_targets_dtype_once(qwen3_target, drafter_factory):
    drafter = drafter_factory(qwen3_target).to(torch.bfloat16)
    drafter.align_dtype(qwen3_target)
    assert next(drafter.parameters()).dtype == next(qwen3_target.parameters()).dtype
    drafter.check_target(qwen3_target)


@pytest.mark.parametrize("relative", [False, True])
def test_a_weights_file_instead_of_its_folder_is_refused_naming_the_folder(
    qwen3_target, drafter_factory, tmp_path, monkeypatch, relative
):
    drafter_factory(qwen3_target).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    if relative:
        monkeypatch.chdir(tmp_path)
        path = "model.safetensors"
    with pytest.raises(ValueError, match="expected a drafter folder") as error:
        AdaFlashDrafter.from_pretrained(path)
    assert f"got the file '{path}'; pass its folder '{tmp_path}'" in str(error.value)
    assert "Repo id" not in str(error.value)
