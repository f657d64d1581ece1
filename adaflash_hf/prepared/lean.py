"""The prepared target's decoder layer with less Python around the same ops: a decode step of a small target is
mostly the interpreter's time between kernels, not the kernels'.

transformers' Llama decoder layer makes nine module calls a layer (two norms, the attention and the MLP, five
linears), each through ``nn.Module.__call__`` and its hook and kwargs plumbing, and the projections of one input
(q/k/v, gate/up) hand their parts around through the group's stash (``adaflash_hf.prepared.linear``).
``lean_layer_forward`` runs the same layer as one function: the norms' own ``forward``, each projection group as one
linear call, the rotary embedding's ops once over the query and key heads together, the cache's ``update`` and the
registered attention function with the arguments ``LlamaAttention`` gives it. Every op is the one the transformers
layer runs on the prepared target, on the same inputs, in the same order and dtype, so a layer's output is bitwise
the transformers layer's (``tests/test_lean_forward.py`` compares them for prefills, decode steps, verifies and the
engine's packed forward); only the Python between the ops goes.

The rotary arithmetic is transformers' own ``apply_rotary_pos_emb``'s (a Hub kernel swapped in for it with
``kernelize`` is not followed). Installed by ``install_invariant_forward`` on the layers whose classes are exactly
transformers' Llama ones (``LlamaDecoderLayer`` with ``LlamaAttention``, ``LlamaMLP``, ``LlamaRMSNorm``) and whose
projections run as groups; other architectures keep transformers' layer. A call runs transformers' layer instead
where the lean one would not be the same: gradients enabled, hidden states in another dtype than the linears' or
empty, or a forward hook or pre-hook on one of the layer's modules (other than transformers' own output-capturing
hooks, which record nothing from a layer's inner modules with this attention: it returns no attention weights).
Where the compiled layer is loaded and applies (``adaflash_hf.prepared.native``), a call runs its one compiled call
of these same ops instead of the ops one by one.
"""

from __future__ import annotations

import types

import torch
from torch.nn.modules import module as nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from adaflash_hf.prepared import native
from adaflash_hf.prepared.linear import GROUP, InvariantLinear, group_matrix, group_output, runs_fast

_INNER = "_adaflash_lean"  # on a lean layer: its inner modules, in the order the layer runs them
_CAPTURING_HOOK = "output_capturing_hook"  # transformers' hook for output_hidden_states / output_attentions


def lean_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` on the prepared target, bitwise, with less Python (module docstring)."""
    inner = self.__dict__[_INNER]
    cache = kwargs.pop("past_key_values", cache)
    if not _applies(inner, hidden_states):
        return type(self).forward(
            self,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    if native.loaded():
        output = native.layer_forward(
            self, inner, hidden_states, attention_mask, position_embeddings, cache, kwargs
        )
        if output is not None:
            return output
    attention, mlp = self.self_attn, self.mlp
    # as LlamaDecoderLayer passes them on to its attention, and the attention to the cache and its function
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
    hidden = self.input_layernorm.forward(hidden_states)
    input_shape = hidden.shape[:-1]
    query, key, value = _rotated_projections(inner[0], hidden, attention.head_dim, position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        attention.config._attn_implementation, modeling_llama.eager_attention_forward
    )
    attended, _ = attend(
        attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs
    )
    attended = attended.reshape(*input_shape, -1).contiguous()
    hidden_states = hidden_states + attention.o_proj.forward(attended)
    hidden = self.post_attention_layernorm.forward(hidden_states)
    gate, up = group_output(inner[1], hidden)
    return hidden_states + mlp.down_proj.forward(mlp.act_fn(gate) * up)


def _rotated_projections(qkv, hidden: torch.Tensor, head_dim: int, position_embeddings):
    """query ``[B, Hq, n, D]``, key and value ``[B, Hkv, n, D]`` of ``hidden [B, n, hidden]``, query and key rotated:
    ``apply_rotary_pos_emb``'s ops (``x * cos + rotate_half(x) * sin``) run once over the query and key heads side
    by side rather than once for each, element for element the same arithmetic."""
    heads = group_matrix(qkv, hidden).view(*hidden.shape[:-1], -1, head_dim)  # [B, n, Hq + 2 Hkv, D]
    query_heads, key_heads = qkv[0].out_features // head_dim, qkv[1].out_features // head_dim
    query_key, value = heads[:, :, : query_heads + key_heads], heads[:, :, query_heads + key_heads :]
    cos, sin = (t.unsqueeze(2) for t in position_embeddings)  # [B, n, 1, D]
    half = head_dim // 2
    rotated = torch.cat((-query_key[..., half:], query_key[..., :half]), dim=-1)
    query_key = (query_key * cos) + (rotated * sin)
    return (
        query_key[:, :, :query_heads].transpose(1, 2),
        query_key[:, :, query_heads:].transpose(1, 2),
        value.transpose(1, 2),
    )


def _applies(inner, hidden_states: torch.Tensor) -> bool:
    """Whether the lean layer is the transformers layer for this call (module docstring)."""
    if torch.is_grad_enabled() or not runs_fast(inner[0][0], hidden_states):
        return False
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return False
    for module in inner[2]:
        if module._forward_pre_hooks:
            return False
        if module._forward_hooks and any(
            getattr(hook, "__name__", "") != _CAPTURING_HOOK for hook in module._forward_hooks.values()
        ):
            return False
    return True


def install_lean_layers(target) -> int:
    """Run every decoder layer of ``target`` whose classes are transformers' Llama ones, and whose projections are
    grouped (``adaflash_hf.prepared.linear.group_projections``), through ``lean_layer_forward`` (idempotent); how
    many."""
    count = 0
    for layer in target.modules():
        inner = _inner_modules(layer)
        if inner is None:
            continue
        layer.__dict__[_INNER] = inner
        if "forward" not in vars(layer):
            layer.forward = types.MethodType(lean_layer_forward, layer)
        count += 1
    return count


def _inner_modules(layer):
    """``(q/k/v group, gate/up group, every module the layer calls)`` of a Llama decoder layer whose linears are
    grouped invariant linears, else None."""
    if type(layer) is not modeling_llama.LlamaDecoderLayer:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        type(attention) is not modeling_llama.LlamaAttention
        or type(mlp) is not modeling_llama.LlamaMLP
        or any(type(norm) is not modeling_llama.LlamaRMSNorm for norm in norms)
    ):
        return None
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up = (mlp.gate_proj, mlp.up_proj)
    linears = (*qkv, attention.o_proj, *gate_up, mlp.down_proj)
    if not all(type(m) is InvariantLinear for m in linears):
        return None
    if any(m.__dict__.get(GROUP, (None,))[0] != group for group in (qkv, gate_up) for m in group):
        return None
    called = (*norms, attention, mlp, mlp.act_fn, *linears)
    return qkv, gate_up, tuple(m for m in called if isinstance(m, torch.nn.Module))
