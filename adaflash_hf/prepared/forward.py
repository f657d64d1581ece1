"""The batch-invariant forward of a prepared target, installed on the model itself so that every caller runs it:
plain ``generate``, assisted decoding, the serving engine's packed forward and the cost model's timing forwards.

``install_invariant_forward(target)`` makes every row of a forward bitwise what it would be among any other rows:

- linears (q/k/v/o, the MLP, lm_head): every plain ``nn.Linear`` becomes ``InvariantLinear``
  (``adaflash_hf.prepared.linear``, same parameters and state dict); the projections of one input (q/k/v, gate/up)
  run as one linear over their concatenated weights;
- layers: a Llama decoder layer runs as one function of the same ops (``adaflash_hf.prepared.lean``), bitwise the
  transformers layer with less Python;
- attention: ``"ada_invariant"``, registered with ``transformers.AttentionInterface`` (and transformers'
  SDPA mask under the same name), calls ``adaflash_hf.prepared.attention.sequence_attention`` per
  sequence. It reads the dynamic cache ``generate`` uses: the n new queries are the cache's last n positions.
  The engine's packed forward switches to its own attention, which runs the same function per request
  (``adaflash_hf.serving.cache``);
- rotary embeddings: positions padded to a multiple of ``ROTARY_ROWS`` before cos/sin, so that every position's
  cos/sin comes from the vectorised loop (a vector loop's scalar tail can round a transcendental differently);
- RMSNorm, residual adds and the MLP activation need nothing: row-wise reductions over fewer elements than torch's
  parallel grain (one thread sums a row, in one vectorised order, whatever the row count) and exact elementwise
  arithmetic. An elementwise op split across a thread count that does not divide its rows could still give a
  tensor's chunk a scalar tail; use a power-of-two thread count.

Why this is invariant by construction: the attention computes each query row on its own, in one order of float32
operations written out in this package's C++ source (``adaflash_hf.prepared.native``; where that library cannot be
built, SDPA in tiles as the linears run); every linear runs in tiles of one row count per op
(``adaflash_hf.prepared.tiles``), so no library sees a second shape and picks a second kernel; what remains, a row's
position inside its tile, is checked for every position when the op's tiles are made. A linear whose one-row call
gives every row bitwise what its tile gives it (checked then too) runs a decode step's single row as it is.
``prepare_target``'s check then runs the whole forward as a bitwise proof on this machine.

Not covered: static caches (the query positions come from the dynamic cache's length), sliding-window layers
beyond what transformers' mask says; on GPUs it ran (one H200) but cuBLAS is not oneDNN: the tiles' position check
and ``prepare_target``'s check are what hold there.
"""

from __future__ import annotations

import types
import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from adaflash_hf.prepared import native
from adaflash_hf.prepared.attention import ATTENTION_NAME, sequence_attention
from adaflash_hf.prepared.lean import install_lean_layers
from adaflash_hf.prepared.linear import InvariantLinear, group_projections

ROTARY_ROWS = 16
# ``runs_invariant_forward`` walks a target's modules again after this many checks, even where no module registered a
# child since its last walk (the registration hook below misses a direct write to a module's ``_modules``)
WALK_EVERY = 64
# in a target's __dict__: ((the target's id, the structure count) at its last clean walk, checks since)
_WALKED = "_adaflash_walked"
_STRUCTURE = [0]  # child modules registered into a watched module (torch's global registration hook)
_STRUCTURE_HOOK: list = []
_WATCHED: weakref.WeakSet = weakref.WeakSet()  # every module of each target at its last clean walk


def invariant_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs
):
    """``AttentionInterface`` function: query ``[B, Hq, n, D]``, key/value ``[B, Hkv, L, D]`` (the dynamic cache
    after this forward's update) -> ``([B, n, Hq, D], None)``."""
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} attention: expected dropout 0 (inference only), got {dropout}")
    start = key.shape[2] - query.shape[2]
    if query.shape[0] == 1 and attention_mask is None:  # a decode step or a verify of generate
        return sequence_attention(query[0], key[0], value[0], start, scaling).transpose(0, 1)[None], None
    outputs = []
    for b in range(query.shape[0]):
        allowed = None
        if attention_mask is not None:
            mask = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0]
            allowed = mask if mask.dtype == torch.bool else mask == 0
        outputs.append(
            sequence_attention(query[b], key[b], value[b], start, scaling, allowed).transpose(0, 1)
        )
    return torch.stack(outputs), None


def register_invariant_attention() -> str:
    """Register the attention and its mask with transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, invariant_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


def _padded_rotary_forward(self, x, position_ids):
    count = position_ids.shape[-1]
    missing = -count % ROTARY_ROWS
    if missing:
        tail = position_ids[..., -1:].expand(*position_ids.shape[:-1], missing)
        position_ids = torch.cat([position_ids, tail], dim=-1)
    cos, sin = type(self).forward(self, x, position_ids)
    return cos[..., :count, :], sin[..., :count, :]


def _is_rotary(module: torch.nn.Module) -> bool:
    # Read where a module keeps it (a buffer, or a plain attribute): getattr on a module that lacks it raises and
    # catches an AttributeError inside torch, the most of a walk's time over a target's modules
    value = module._buffers.get("inv_freq")
    if value is None:
        value = module.__dict__.get("inv_freq")
    if value is None:
        value = module._parameters.get("inv_freq")
    return isinstance(value, torch.Tensor)


def rotary_modules(target) -> list[torch.nn.Module]:
    """The target's rotary embeddings (the modules holding an ``inv_freq`` buffer)."""
    return [m for m in target.modules() if _is_rotary(m)]


def install_invariant_forward(target) -> None:
    """Swap in the invariant linears, rotary padding and attention (idempotent); see the module docstring."""
    watch_structure()
    for module in target.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = InvariantLinear
    group_projections(target)
    install_lean_layers(target)
    native.load()  # the compiled layer and the row attention every prepared forward attends with
    for module in rotary_modules(target):
        if "forward" not in vars(module):
            module.forward = types.MethodType(_padded_rotary_forward, module)
    target.set_attn_implementation(register_invariant_attention())


def _count_registration(module, name, child):
    # A module of a walked target (not, say, the ModuleList that slicing a target's layers builds at every forward)
    if module in _WATCHED:
        _STRUCTURE[0] += 1  # returns None: the child is registered unchanged


def watch_structure() -> None:
    """Count every child module registered from now on into a module of a walked target (``setattr`` of a module,
    ``add_module``: how PEFT and hand-made patches swap a linear), so that ``runs_invariant_forward`` need not walk a
    target that nothing changed (idempotent)."""
    if not _STRUCTURE_HOOK:
        _STRUCTURE_HOOK.append(
            torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
        )


def runs_invariant_forward(target) -> bool:
    """Whether ``target`` still runs the invariant forward (attention, every linear, every rotary embedding). The
    engine asks at every forward, and a walk over a 30-layer target's 397 modules costs 0.2-0.7 ms, 1-3% of a decode
    step: so the attention is read every time, and the modules are walked where a child module was registered into
    a walked target's module since this target's last clean walk (``watch_structure``), for a copy of the target
    (whose modules no walk has seen), and at least every ``WALK_EVERY`` checks."""
    if target.config._attn_implementation != ATTENTION_NAME:
        return False
    walked = target.__dict__.get(_WALKED)
    if (
        _STRUCTURE_HOOK
        and walked is not None
        and walked[0] == (id(target), _STRUCTURE[0])
        and walked[1] < WALK_EVERY
    ):
        target.__dict__[_WALKED] = (walked[0], walked[1] + 1)
        return True
    structure = _STRUCTURE[0]
    clean = _walk_invariant(target)
    target.__dict__[_WALKED] = ((id(target), structure), 1) if clean else None
    return clean


def _walk_invariant(target) -> bool:
    stack, seen = [target], []
    while stack:
        module = stack.pop()
        if type(module) is torch.nn.Linear:
            return False
        if _is_rotary(module) and "forward" not in vars(module):
            return False
        seen.append(module)
        stack.extend(child for child in module._modules.values() if child is not None)
    if _STRUCTURE_HOOK:
        _WATCHED.update(seen)
    return True
