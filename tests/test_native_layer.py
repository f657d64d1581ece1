"""The compiled layer of a prepared Llama target gives bitwise what the Python layer gives, for prefills, decode steps
and verifies across key blocks, in bf16, fp32 and on 4-bit weights; batches, padding and other caches run the Python
layer; a weight written between steps is read at the next; where it cannot be built the Python layer runs."""

import logging
import shutil

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf import prepare_target
from adaflash_hf.prepared import four_bit, native
from adaflash_hf.serving.cache import RaggedBatch, SlotKVStore, packed_target_forward
from tests.conftest import four_bit_target

IDS = torch.randint(0, 500, (1, 260), generator=torch.Generator().manual_seed(5))
COMPILER = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(
    COMPILER is None, reason="no C++ compiler here: the compiled layer cannot be built"
)


@pytest.fixture
def compiled_calls(monkeypatch):
    """The compiled layer (built here) with its calls counted."""
    assert native.load(), (
        "a C++ compiler is here, yet the compiled layer did not build (see the warning logged)"
    )
    calls = []
    for name in ("_DECODE_LAYER", "_PACKED_LAYER"):
        real = getattr(native, name)

        def counted(*args, real=real, name=name):
            calls.append(args[0].shape[1] if name == "_DECODE_LAYER" else ("packed", args[0].shape[1]))
            return real(*args)

        monkeypatch.setattr(native, name, counted)
    return calls


class PythonLayer:
    """Within the block, the prepared target's layers run the Python layer."""

    def __enter__(self):
        self.was = native._STATE["loaded"]
        native._STATE["loaded"] = False

    def __exit__(self, *exc):
        native._STATE["loaded"] = self.was


@torch.no_grad()
def decoding(target) -> list[torch.Tensor]:
    """Logits and the cache after: a prefill over two key blocks, decode steps across the next block's start, verifies
    of 3, 16 and 70 tokens (the last across two blocks), each cropped away after."""
    cache = DynamicCache(config=target.config)
    outputs = [target(input_ids=IDS[:, :120], cache=cache, use_cache=True).logits]
    for position in range(120, 132):
        outputs.append(target(input_ids=IDS[:, position : position + 1], cache=cache).logits)
    for count in (3, 16, 70):
        outputs.append(target(input_ids=IDS[:, 132 : 132 + count], cache=cache).logits)
        cache.crop(-count)
    for layer in cache.layers:
        outputs += [layer.keys, layer.values]
    return outputs


def assert_bitwise_equal(first, second):
    assert len(first) == len(second)
    for index, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {index} differs"


def prepared(kind: str, target_factory):
    if kind == "int4":
        if not four_bit.available():
            pytest.skip("this torch has no CPU kernel for 4-bit weights")
        return prepare_target(four_bit_target(target_factory), dtype="int4", rows=4)
    return prepare_target(target_factory("llama"), dtype=kind, invariant=True, rows=4)


@pytest.mark.parametrize("kind", ["bf16", "fp32", "int4"])
def test_the_compiled_layer_gives_bitwise_the_python_layers_results(kind, target_factory, compiled_calls):
    target = prepared(kind, target_factory)
    compiled_calls.clear()  # prepare_target's own check ran decode steps
    with PythonLayer():
        reference = decoding(target)
    assert not compiled_calls
    compiled = decoding(target)
    layers = target.config.num_hidden_layers
    assert compiled_calls == [n for n in (120, *[1] * 12, 3, 16, 70) for _ in range(layers)]
    assert_bitwise_equal(compiled, reference)


@torch.no_grad()
def packed(target) -> list[torch.Tensor]:
    """Logits of the engine's packed forwards, then its pools: three requests prefilled (one across two key blocks),
    decode steps, verifies of 4 and 16 tokens beside a decode step and a prefill (one verify across a key block),
    then decode steps whose key block's requests sit in slots far apart (their keys gathered) and in a range with
    another request's slot among them (a view of the pools)."""
    store = SlotKVStore(target.config.num_hidden_layers)
    store.reserve(4, 256)
    rounds = [
        ([0, 1, 2], [0, 0, 0], [30, 70, 5]),
        ([0, 1, 2], [30, 70, 5], [1, 1, 1]),
        ([0, 1, 2, 3], [31, 71, 6, 0], [4, 16, 1, 40]),
        ([0, 1, 2, 3], [35, 87, 7, 40], [1, 1, 16, 1]),
        ([0, 3, 1], [36, 41, 88], [1, 1, 1]),
        ([0, 2, 3], [37, 23, 42], [1, 1, 1]),
    ]
    outputs = []
    for slots, starts, lengths in rounds:
        tokens = torch.cat(
            [
                IDS[0, 7 * slot + start : 7 * slot + start + n]
                for slot, start, n in zip(slots, starts, lengths)
            ]
        )
        batch = RaggedBatch.build(store, slots, starts, lengths, group_width=8, device=tokens.device)
        outputs.append(packed_target_forward(target, tokens[None], batch).logits)
    return outputs + [t for t in (*store.keys, *store.values)]


@pytest.mark.parametrize("kind", ["bf16", "int4"])
def test_the_engines_packed_forward_through_the_compiled_layer_is_bitwise_the_python_layers(
    kind, target_factory, compiled_calls
):
    target = prepared(kind, target_factory)
    with PythonLayer():
        reference = packed(target)
    compiled_calls.clear()
    compiled = packed(target)
    layers = target.config.num_hidden_layers
    assert compiled_calls == [("packed", n) for n in (105, 3, 61, 19, 3, 3) for _ in range(layers)]
    assert_bitwise_equal(compiled, reference)


def test_generate_through_the_compiled_layer_equals_the_python_layer(target_factory, compiled_calls):
    target = prepared("bf16", target_factory)
    compiled_calls.clear()
    with torch.no_grad(), PythonLayer():
        reference = target.generate(
            IDS[:, :20], max_new_tokens=150, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert not compiled_calls
    with torch.no_grad():
        compiled = target.generate(
            IDS[:, :20], max_new_tokens=150, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert len(compiled_calls) > 100 * target.config.num_hidden_layers
    assert torch.equal(compiled.sequences, reference.sequences)
    assert_bitwise_equal(compiled.logits, reference.logits)


def test_batches_padding_and_other_attentions_run_the_python_layer(target_factory, compiled_calls):
    target = prepared("bf16", target_factory)
    compiled_calls.clear()
    ids = IDS[:, :12].repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        target(input_ids=ids, attention_mask=mask)
        target(input_ids=IDS[:, :12], attention_mask=mask[1:])
    assert compiled_calls == []
    target.set_attn_implementation(
        "sdpa"
    )  # not the invariant attention: the compiled layer does not serve it
    with torch.no_grad():
        target(input_ids=IDS[:, :12])
    assert compiled_calls == []


def test_a_weight_written_between_steps_is_read_at_the_next(target_factory, compiled_calls):
    target = prepared("bf16", target_factory)
    decoding(target)
    layer = target.model.layers[1]
    with torch.no_grad():
        layer.post_attention_layernorm.weight.mul_(1.5)
        layer.mlp.down_proj.weight.mul_(-1)
    with PythonLayer():
        reference = decoding(target)
    compiled_calls.clear()
    compiled = decoding(target)
    assert compiled_calls
    assert_bitwise_equal(compiled, reference)


def test_a_four_bit_weight_written_after_prepare_is_refused_on_the_compiled_path(
    target_factory, compiled_calls
):
    target = prepared("int4", target_factory)
    decoding(target)
    with torch.no_grad():
        target.model.layers[0].self_attn.q_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="written after prepare_target"):
        decoding(target)


def test_without_the_compiled_layer_the_python_layer_runs(monkeypatch, caplog):
    monkeypatch.setenv(native.ENVIRONMENT, "0")
    assert native._load() is False
    monkeypatch.delenv(native.ENVIRONMENT)

    def no_compiler():
        raise RuntimeError("Error building extension 'adaflash_native'\nc++: not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # to caplog's root handler
    with caplog.at_level(logging.WARNING):
        assert native._load() is False
    assert "could not be built: the Python layer runs, with SDPA in tiles" in caplog.text
    assert "c++: not found" in caplog.text
