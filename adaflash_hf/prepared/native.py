"""A prepared Llama layer's forward as one compiled call, and the invariant attention's row kernel.

A decode step of a small target is mostly Python: some 70 ops a layer, each a few microseconds of interpreter and
dispatch around kernels that take tens (on one Intel Xeon with AMX, a 4-bit step of the offline target spent 5 ms
in its linears, 2 in its output embedding and 2 in attention out of 23). ``csrc/decode_layer.cpp`` runs in C++ the
ops the Python layer runs (``adaflash_hf.prepared.lean``: the norms, each projection group's linear in its tiles,
the rotary embedding, the attention, the MLP), in the same order, on the same shapes and dtypes, on the same
kernels, in two forms:

- ``decode_layer``: one sequence's new tokens over transformers' dynamic cache (``generate``'s prefill, decode steps
  and verifies): the cache's concatenation, then the row attention;
- ``packed_layer``: the serving engine's packed forward (``adaflash_hf.serving.cache``): the new keys and values
  written to the slot pools, then every request's rows through the row attention over its slot.

``csrc/row_attention.cpp`` is the attention itself: causal attention computed row by row in one order written out in
the source (its scores, softmax and value sums in float32), so a row's result is a function of the row, its position
and the keys it sees, whatever else the call holds, on any CPU. Where this library is loaded, the Python attention
(``adaflash_hf.prepared.attention``) calls it too, so every forward of the process attends the same way; preparing
a target loads it (``adaflash_hf.prepared.forward``).

The result is bitwise the Python layer's (``tests/test_native_layer.py`` compares them for prefills, decode steps
and verifies across key blocks, and for packed forwards of prefills, decode steps and verifies together), so every
guarantee of the prepared forward holds unchanged.

It is built from source on first use on a machine (torch's C++ extension loader with ninja and the system's C++
compiler, for this CPU, about 20 s, kept in torch's extensions folder under the CPU's model and flags for later
processes) and loaded as ``torch.ops``. Where it cannot be built (no compiler), or with ``ADAFLASH_NATIVE=0``, the
Python layer runs and the attention runs SDPA in tiles (``adaflash_hf.prepared.attention``), with one warning.

A layer call runs here only where the Python layer would run exactly these ops: a CPU tensor, a SiLU MLP, and either
one sequence (batch of one) with transformers' dynamic cache layer, the invariant attention and no attention mask or
a causal one (``generate``'s unpadded sequence), or the engine's invariant packed forward (its attention function
marked ``packed_attention``). Anything else (batches, padding, other caches and attentions) runs the Python layer.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import activations
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from adaflash_hf.prepared import attention as invariant_attention
from adaflash_hf.prepared.attention import ATTENTION_NAME
from adaflash_hf.prepared.cpu import cpu_digest
from adaflash_hf.prepared.four_bit import four_bit_linear
from adaflash_hf.prepared.linear import _packed_linear, group_route, linear_route

logger = logging.get_logger(__name__)

ENVIRONMENT = "ADAFLASH_NATIVE"  # "0": run the Python layer
SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("decode_layer.cpp", "row_attention.cpp"))
_KINDS = {four_bit_linear: 0, _packed_linear: 1, F.linear: 2}  # decode_layer.cpp's kFourBit, kPacked, kPlain
_SILU = (activations.SiLUActivation, torch.nn.SiLU)
_EMPTY = torch.empty(0)
_PLAN = "_adaflash_native"  # on a layer: its _Plan
_LOCK = threading.Lock()
_STATE: dict[str, bool] = {}


def load() -> bool:
    """Whether the compiled layer is loaded: built and loaded on the first call of a process (module docstring); False,
    with a warning, where it cannot be or ``ADAFLASH_NATIVE=0``."""
    loaded = _STATE.get("loaded")
    if loaded is not None:
        return loaded
    with _LOCK:
        if "loaded" not in _STATE:
            _STATE["loaded"] = _load()
    return _STATE["loaded"]


def loaded() -> bool:
    """Whether a forward runs the compiled layer where it applies (``load`` has succeeded in this process)."""
    return _STATE.get("loaded", False)


def _load() -> bool:
    if os.environ.get(ENVIRONMENT, "1") == "0":
        logger.info(f"prepared forward: {ENVIRONMENT}=0, the Python layer runs")
        return False
    try:
        _build()
    except Exception as error:  # no compiler, no ninja, a build error: the Python layer is the same forward
        logger.warning(
            f"prepared forward: the compiled layer ({', '.join(p.name for p in SOURCES)}) could not be built: the "
            f"Python layer runs, with SDPA in tiles for the attention (slower decode steps): {type(error).__name__}: "
            f"{str(error).strip().splitlines()[-1:]}"
        )
        return False
    global _DECODE_LAYER, _PACKED_LAYER, ROW_ATTENTION, PACKED_ROW_ATTENTION
    _DECODE_LAYER = torch.ops.adaflash_native.decode_layer.default
    _PACKED_LAYER = torch.ops.adaflash_native.packed_layer.default
    ROW_ATTENTION = torch.ops.adaflash_native.row_attention.default
    PACKED_ROW_ATTENTION = torch.ops.adaflash_native.packed_row_attention.default
    invariant_attention.ROW_OPS.update(row=ROW_ATTENTION, packed=PACKED_ROW_ATTENTION)
    return True


# the loaded ops; ROW_ATTENTION (query [n, Hq, D], keys/values [L, Hkv, D], start, scale, allowed [n, L] or empty)
# and PACKED_ROW_ATTENTION (query [T, Hq, D], pools, requests (slot, start, offset, length)..., scale): row_attention.cpp
_DECODE_LAYER = _PACKED_LAYER = ROW_ATTENTION = PACKED_ROW_ATTENTION = None


def _build() -> None:
    import ninja  # its binary, which torch's loader runs from PATH
    from torch.utils import cpp_extension

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    cpp_extension.load(
        name=f"adaflash_native_{cpu_digest()}",  # built with -march=native: kept per CPU
        sources=[str(source) for source in SOURCES],
        # this CPU's vector units; no fast-math: the row attention's order of operations is its source's (without
        # trapping math, its selects vectorise)
        extra_cflags=[
            "-O3",
            "-march=native",
            "-fno-fast-math",
            "-fno-trapping-math",
            "-fopenmp",
            "-mprefer-vector-width=512",
        ],
        is_python_module=False,
        verbose=False,
    )


def layer_forward(layer, inner, hidden_states, attention_mask, position_embeddings, cache, kwargs):
    """``lean_layer_forward``'s result through the compiled layer, the cache layer (or the engine's pools) updated as
    the Python layer would; None where it does not apply (module docstring), nothing changed then."""
    if (
        hidden_states.shape[0] != 1
        or hidden_states.device.type != "cpu"
        or not invariant_attention.ROW_KERNEL
    ):
        return None  # (the attention switched to SDPA in tiles: the Python layer runs it)
    plan = _plan(layer, inner)
    if plan is None:
        return None
    if cache is None:
        ragged = kwargs.get("ragged")
        return None if ragged is None else _packed_forward(plan, hidden_states, position_embeddings, ragged)
    if plan.config._attn_implementation != ATTENTION_NAME:
        return None
    layers = getattr(cache, "layers", None)
    cached = layers[plan.index] if layers is not None and plan.index < len(layers) else None
    if type(cached) is not DynamicLayer:
        return None
    if cached.is_initialized:
        keys = cached.keys
        if keys.numel() and (keys.dtype != hidden_states.dtype or keys.shape[:2] != (1, plan.key_heads)):
            return None
        length = keys.shape[-2] if keys.numel() else 0
    else:
        length = 0
    count = hidden_states.shape[1]
    if attention_mask is not None and not _causal(attention_mask, count, length + count):
        return None
    if not cached.is_initialized:
        cached.lazy_initialization(hidden_states, hidden_states)
    cos, sin = position_embeddings
    output, cached.keys, cached.values = _DECODE_LAYER(
        hidden_states,
        cos,
        sin,
        plan.weights,
        plan.numbers,
        cached.keys,
        cached.values,
        *plan.layer_numbers(),
    )
    return output


def _packed_forward(plan: _Plan, hidden_states, position_embeddings, ragged):
    """The engine's packed forward through the compiled layer: where its attention is the engine's slot attention
    (``packed_attention`` marks it) with the invariant attention (a prepared target), else None."""
    function = ALL_ATTENTION_FUNCTIONS.get(plan.config._attn_implementation)
    if not getattr(function, "packed_attention", False) or not getattr(ragged, "invariant", False):
        return None
    store = ragged.store
    store._layer(plan.index, hidden_states.new_empty(0, plan.key_heads, plan.head_dim))  # allocated or grown
    if store.keys[plan.index].dtype != hidden_states.dtype:
        return None  # the Python layer casts the new keys to the pools' dtype
    cos, sin = position_embeddings
    return _PACKED_LAYER(
        hidden_states,
        cos,
        sin,
        plan.weights,
        plan.numbers,
        store.keys[plan.index],
        store.values[plan.index],
        ragged.packing.token_slots,
        ragged.packing.token_positions,
        ragged.packing.row_requests,
        *plan.layer_numbers(),
    )


def _causal(mask: torch.Tensor, count: int, total: int) -> bool:
    """Whether ``mask`` (transformers' boolean ``[1, 1, count, total]``) lets each of the ``count`` new tokens see
    exactly the keys up to its own position: the mask of one unpadded sequence, which the invariant attention applies
    on top of the causal mask it builds itself, so it changes nothing there. Checked once per forward (every layer
    gets the same mask)."""
    last = _LAST_MASK
    if last[0] is mask:
        return last[1]
    causal = mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, count, total)
    if causal:
        positions = torch.arange(total, device=mask.device)
        causal = torch.equal(mask[0, 0], positions[None, :] <= positions[total - count :, None])
    globals()["_LAST_MASK"] = (mask, causal)
    return causal


_LAST_MASK: tuple = (None, False)  # the mask last checked by _causal, and whether it was causal


@dataclass
class _Plan:
    """What a layer's compiled call takes besides the inputs, kept on the layer while its weights stay the same."""

    stamp: tuple
    config: object  # the attention's config: its attention implementation is read at every call
    index: int
    query_heads: int
    key_heads: int
    head_dim: int
    input_eps: float
    post_eps: float
    scale: float
    weights: list
    numbers: list

    def layer_numbers(self) -> tuple:
        """What both compiled calls take after their tensors: the heads, the norms' epsilons and the attention's
        scale."""
        return (self.query_heads, self.key_heads, self.input_eps, self.post_eps, self.scale)


def _plan(layer, inner) -> _Plan | None:
    """The layer's plan, made again where a weight was replaced or written, or the thread count changed (the stamp of
    the linears' routes); None where the compiled layer does not serve this layer."""
    stamp = (
        torch.get_num_threads(),
        *((t.data_ptr(), t._version) for m in inner[2] for t in m._parameters.values() if t is not None),
    )
    plan = layer.__dict__.get(_PLAN)
    if plan is not None and plan.stamp == stamp:
        return plan
    attention, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = inner[0], inner[1]
    if type(mlp.act_fn) not in _SILU or gate_up[0].out_features != gate_up[1].out_features:
        return None
    weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    numbers = []
    for route in (
        group_route(qkv),
        linear_route(attention.o_proj),
        group_route(gate_up),
        linear_route(mlp.down_proj),
    ):
        numbers += _linear_numbers(route, weights)
    head_dim = attention.head_dim
    plan = layer.__dict__[_PLAN] = _Plan(
        stamp=stamp,
        config=attention.config,
        index=attention.layer_idx,
        query_heads=qkv[0].out_features // head_dim,
        key_heads=qkv[1].out_features // head_dim,
        head_dim=head_dim,
        input_eps=layer.input_layernorm.variance_epsilon,
        post_eps=layer.post_attention_layernorm.variance_epsilon,
        scale=attention.scaling,
        weights=weights,
        numbers=numbers,
    )
    return plan


def _linear_numbers(route, weights: list) -> tuple[int, int, int, int]:
    """``(kind, tile rows, small rows, large calls)`` of a linear's route (``Tiles.large_mask``), its two tensors and bias
    appended to ``weights``."""
    _, op, tiles, _ = route
    keywords = op.keywords
    kind = _KINDS[op.func]  # every op linear._route makes
    if kind == 0:
        tensors = (keywords["codes"], keywords["scales"])
    elif kind == 1:
        tensors = (keywords["packed"], _EMPTY)
    else:
        tensors = (keywords["weight"], _EMPTY)
    bias = keywords["bias"]
    weights += (*tensors, _EMPTY if bias is None else bias)
    return kind, tiles.rows, tiles.small, tiles.large_mask()
