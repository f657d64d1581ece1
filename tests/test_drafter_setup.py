"""``init_from_target``: a fresh drafter starts from the target's last layers (a Llama target's missing q/k norms
left at identity) with ``fc`` passing the deepest tapped layer through; a drafter of another head count is refused
before anything is copied; and the training config asks for it only of a fresh drafter."""

import pytest
import torch

from adaflash_hf.trainers import DrafterTrainingConfig
from adaflash_hf.trainers.drafter_setup import build_drafter, init_from_target


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_init_from_target_copies_the_last_layers_and_fc_passes_the_deepest_tapped_layer(
    target_factory, drafter_factory, kind
):
    target = target_factory(kind)
    drafter = drafter_factory(target, num_hidden_layers=2)
    init_from_target(drafter, target)
    layers = target.model.layers
    for i, layer in enumerate(drafter.layers):
        source = dict(layers[len(layers) - 2 + i].named_parameters())
        for name, param in layer.named_parameters():
            if name in source:
                assert torch.equal(param, source[name]), f"layers.{i}.{name}"
            else:  # a Llama target has no q_norm / k_norm: identity
                assert kind == "llama" and name.endswith(("q_norm.weight", "k_norm.weight"))
                assert torch.equal(param, torch.ones_like(param))
    assert torch.equal(drafter.hidden_norm.weight, layers[2].input_layernorm.weight)
    hidden = target.config.hidden_size
    ids = drafter.config.target_layer_ids
    parts = [torch.randn(3, hidden) for _ in ids]
    passed = drafter.fc(torch.cat(parts, dim=-1))
    torch.testing.assert_close(passed, parts[ids.index(max(ids))], atol=0, rtol=0)


def test_init_from_target_refuses_a_drafter_with_another_head_count(target_factory, drafter_factory):
    target = target_factory("llama")  # 4 heads of 16
    drafter = drafter_factory(target, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    before = {n: p.clone() for n, p in drafter.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"init_from_target: layers.0.self_attn.q_proj.weight: expected shape \(32, 64\) \(the drafter's\), "
        r"got \(64, 64\) in target layer 3",
    ):
        init_from_target(drafter, target)
    assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())  # nothing half-copied


def test_init_from_target_is_a_config_field_of_a_fresh_drafter_only(target_factory, tmp_path):
    target = target_factory("llama")
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path), init_from_target=True, drafter_layers=1, mask_token_id=3, report_to="none"
    )
    drafter = build_drafter(args, target)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.model.layers[-1].mlp.down_proj.weight)
    with pytest.raises(ValueError, match="init_from_target: expected False when drafter_init is set"):
        DrafterTrainingConfig(
            output_dir=str(tmp_path), init_from_target=True, drafter_init="some/drafter", report_to="none"
        )
