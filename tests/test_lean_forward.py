"""The lean decoder layer of a prepared Llama target gives bitwise what transformers' layer gives on the same
prepared target: prefills, decode steps, verifies (with the hidden states the drafter reads) and the engine's packed
forward; where it would not be the same (gradients, a hook on an inner module) the layer runs transformers' path."""

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf import prepare_target
from adaflash_hf.prepared import four_bit
from adaflash_hf.prepared.lean import install_lean_layers
from adaflash_hf.serving.cache import RaggedBatch, SlotKVStore, packed_target_forward
from tests.conftest import four_bit_target

IDS = torch.randint(0, 500, (1, 90), generator=torch.Generator().manual_seed(3))


def lean_layers(target) -> list:
    return [layer for layer in target.model.layers if "forward" in vars(layer)]


class TransformersLayers:
    """Within the block, the target's layers run transformers' forward; the lean one is put back after."""

    def __init__(self, target):
        self.layers = lean_layers(target)

    def __enter__(self):
        self.forwards = [vars(layer).pop("forward") for layer in self.layers]

    def __exit__(self, *exc):
        for layer, forward in zip(self.layers, self.forwards):
            layer.forward = forward


@torch.no_grad()
def decoding_outputs(target) -> list[torch.Tensor]:
    """Logits and hidden states of a prefill, then logits of decode steps and of verifies of 3, 16 and 40 tokens
    (one across a key block), each cropped away after."""
    cache = DynamicCache()
    prefill = target(input_ids=IDS[:, :40], cache=cache, use_cache=True, output_hidden_states=True)
    outputs = [prefill.logits, *prefill.hidden_states]
    for count in (1, 1, 3, 16, 40):
        out = target(input_ids=IDS[:, 40 : 40 + count], cache=cache, use_cache=True)
        outputs.append(out.logits)
        cache.crop(-count)
    return outputs


def assert_bitwise_equal(first, second):
    assert len(first) == len(second)
    for index, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {index} differs"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_lean_layers_decode_bitwise_as_transformers_layers(dtype, target_factory):
    target = prepare_target(target_factory("llama"), dtype=dtype, invariant=True, rows=4)
    assert len(lean_layers(target)) == target.config.num_hidden_layers
    lean = decoding_outputs(target)
    with TransformersLayers(target):
        reference = decoding_outputs(target)
    assert_bitwise_equal(lean, reference)


@pytest.mark.skipif(not four_bit.available(), reason="this torch has no CPU kernel for 4-bit weights")
def test_the_lean_layers_of_a_four_bit_target_decode_bitwise_as_transformers_layers(target_factory):
    target = prepare_target(four_bit_target(target_factory), dtype="int4", rows=4)
    assert len(lean_layers(target)) == target.config.num_hidden_layers
    lean = decoding_outputs(target)
    with TransformersLayers(target):
        reference = decoding_outputs(target)
    assert_bitwise_equal(lean, reference)


@torch.no_grad()
def packed_outputs(target) -> list[torch.Tensor]:
    """Logits of one packed forward prefilling two requests, then of one verifying 4 and 1 tokens for them."""
    store = SlotKVStore(target.config.num_hidden_layers)
    store.reserve(2, 128)
    outputs = []
    for starts, lengths in (([0, 0], [30, 21]), ([30, 21], [4, 1])):
        tokens = torch.cat([IDS[0, s : s + n] for s, n in zip(starts, lengths)])[None]
        batch = RaggedBatch.build(store, [0, 1], starts, lengths, group_width=8, device=tokens.device)
        outputs.append(packed_target_forward(target, tokens, batch, output_hidden_states=True).logits)
    return outputs


def test_the_engine_packed_forward_through_lean_layers_is_bitwise_the_transformers_one(target_factory):
    target = prepare_target(target_factory("llama"), dtype="bf16", rows=4)
    lean = packed_outputs(target)
    with TransformersLayers(target):
        reference = packed_outputs(target)
    assert_bitwise_equal(lean, reference)


def test_a_hook_on_an_inner_module_makes_the_layer_run_transformers_path(target_factory):
    target = prepare_target(target_factory("llama"), dtype="bf16", rows=4)
    seen = []
    handle = target.model.layers[1].self_attn.o_proj.register_forward_hook(lambda *args: seen.append(1))
    try:
        with torch.no_grad():
            target(IDS[:, :10])
    finally:
        handle.remove()
    assert seen == [1]


def test_with_gradients_enabled_the_layers_run_transformers_path_and_give_the_same_logits(target_factory):
    target = prepare_target(target_factory("llama"), dtype="fp32", invariant=True, rows=4)
    with torch.no_grad():
        without = target(IDS[:, :10]).logits
    with torch.enable_grad():
        logits = target(IDS[:, :10]).logits
    assert logits.requires_grad
    assert torch.equal(logits.detach(), without)


def test_only_llama_layers_with_grouped_projections_are_made_lean(target_factory):
    qwen3 = prepare_target(target_factory("qwen3"), dtype="bf16", rows=4)
    assert lean_layers(qwen3) == []
    eager = target_factory("llama")
    assert install_lean_layers(eager) == 0  # plain nn.Linear projections: not a prepared target
    assert lean_layers(eager) == []
