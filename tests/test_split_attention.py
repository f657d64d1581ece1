"""Split ("blockwise") training attention: the same forward and gradients as the dense [Q, S + Q] training mask.

Tolerance: everything runs in float64 and compares at atol 1e-10, rtol 0 (observed differences ~1e-15 to 5e-14; in
float32 the 256-anchor gradients differ by ~1e-6 relative, reduction order only). Each case runs the drafter (sdpa, or
eager) once with the dense mask of ``build_blocks`` and once with ``block_anchors``, or the bare attention against
``scaled_dot_product_attention`` with ``dense_block_mask``, and compares outputs and every gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from adaflash_hf.modeling.attention_adaflash import BlockwiseMask, blockwise_attention
from adaflash_hf.trainers.dflash_recipe import build_blocks, dense_block_mask

BLOCK = 16
ATOL64 = 1e-10


def _inputs(drafter, target, anchors, seq, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = anchors.shape[0]
    input_ids = torch.randint(0, 500, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        loss_mask[row, 2:length] = 1
    blocks = build_blocks(input_ids, loss_mask, anchors, BLOCK, drafter.config.mask_token_id, 7.0)
    dtype = next(drafter.parameters()).dtype
    features = torch.randn(batch, seq, drafter.fc.in_features, generator=g, dtype=dtype)
    noise = torch.nn.functional.embedding(blocks.noise_ids, target.get_input_embeddings().weight)
    return blocks, features, noise


def _run(drafter, blocks, features, noise, split):
    drafter.zero_grad()
    features = features.detach().clone().requires_grad_()
    noise = noise.detach().clone().requires_grad_()
    layout = {"block_anchors": blocks.anchors} if split else {"attention_mask": blocks.attention_mask}
    out = drafter(
        noise_embeds=noise, context_hidden_states=features, position_ids=blocks.position_ids, **layout
    )
    g = torch.Generator().manual_seed(7)
    probe = torch.randn(out.last_hidden_state.shape, generator=g, dtype=out.last_hidden_state.dtype)
    (out.last_hidden_state * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    return out, grads, features.grad, noise.grad


def _assert_split_matches_dense(drafter, blocks, features, noise, atol=ATOL64):
    dense, dense_grads, dense_dfeat, dense_dnoise = _run(drafter, blocks, features, noise, split=False)
    split, split_grads, split_dfeat, split_dnoise = _run(drafter, blocks, features, noise, split=True)
    assert torch.isfinite(split.last_hidden_state).all()
    torch.testing.assert_close(split.last_hidden_state, dense.last_hidden_state, atol=atol, rtol=0)
    torch.testing.assert_close(split.acceptance_prob, dense.acceptance_prob, atol=atol, rtol=0)
    assert split_grads.keys() == dense_grads.keys() and split_grads
    for name, grad in dense_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=atol, rtol=0, msg=name)
    torch.testing.assert_close(split_dfeat, dense_dfeat, atol=atol, rtol=0)
    torch.testing.assert_close(split_dnoise, dense_dnoise, atol=atol, rtol=0)


@pytest.fixture
def float64_pair(target_factory, drafter_factory):
    target = target_factory("qwen3", dtype=torch.float64)  # 4 query heads over 2 KV heads: GQA
    return drafter_factory(target).train(), target


@pytest.mark.parametrize(
    "anchors, lengths",
    [
        (
            [[1, 20, 44, 58], [3, 17, 30, 39]],
            [60, 48],
        ),  # first possible anchor, a block past the end, padding
        ([[5, -1, 30, -1], [-1, -1, -1, 12]], [60, 60]),  # unused slots, one row that is mostly unused
        ([[33], [7]], [60, 40]),  # one anchor
    ],
    ids=["start-end-padding", "unused-slots", "one-anchor"],
)
def test_split_equals_dense_forward_and_gradients(float64_pair, anchors, lengths):
    drafter, target = float64_pair
    blocks, features, noise = _inputs(drafter, target, torch.tensor(anchors), 60, lengths)
    _assert_split_matches_dense(drafter, blocks, features, noise)


def test_split_equals_eager_dense_for_the_learned_mask_embedding_and_the_paper_head(
    target_factory, drafter_factory
):
    target = target_factory("llama", dtype=torch.float64)
    drafter = drafter_factory(target, learned_mask_embedding=True, length_head_variant="paper").train()
    drafter.config._attn_implementation = (
        "eager"  # the dense reference through eager_attention's additive mask
    )
    blocks, features, noise = _inputs(drafter, target, torch.tensor([[2, 25], [9, -1]]), 40, [40, 30])
    _assert_split_matches_dense(drafter, blocks, features, noise)


def test_right_padding_is_never_visible(float64_pair):
    drafter, target = float64_pair
    blocks, features, noise = _inputs(drafter, target, torch.tensor([[4, 20], [6, 25]]), 60, [60, 30])

    def forward(context):
        return drafter(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=blocks.position_ids,
            block_anchors=blocks.anchors,
        ).last_hidden_state

    garbage = features.clone()
    garbage[1, 30:] = 1e3  # the padding of the shorter row
    first, second = forward(features), forward(garbage)
    assert torch.equal(first, second)


def test_a_block_without_context_gives_finite_outputs_and_gradients(float64_pair):
    drafter, target = float64_pair
    blocks, features, noise = _inputs(drafter, target, torch.tensor([[-1, -1], [0, -1]]), 30, [30, 30])
    out, grads, dfeat, dnoise = _run(drafter, blocks, features, noise, split=True)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(dnoise).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert torch.count_nonzero(dfeat) == 0  # no block sees any context
    _assert_split_matches_dense(drafter, blocks, features, noise)


def _attention_inputs(batch, heads, kv_heads, anchors, n_ctx, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_len = anchors.shape[1] * BLOCK
    query = torch.randn(batch, heads, q_len, dim, generator=g, dtype=dtype).requires_grad_()
    key = torch.randn(batch, kv_heads, n_ctx + q_len, dim, generator=g, dtype=dtype).requires_grad_()
    value = torch.randn(batch, kv_heads, n_ctx + q_len, dim, generator=g, dtype=dtype).requires_grad_()
    return query, key, value


def _attention_grads(attend, query, key, value):
    out = attend(query, key, value)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return (out, *torch.autograd.grad((out * probe).sum(), (query, key, value)))


@pytest.mark.parametrize(
    "heads, kv_heads, num_anchors",
    [(9, 3, 5), (4, 4, 3), (2, 1, 256)],
    ids=["gqa-9-over-3", "mha", "256-anchors"],  # 9 over 3: the SmolLM2 drafter's head layout
)
def test_blockwise_attention_equals_sdpa_with_the_dense_mask(heads, kv_heads, num_anchors):
    n_ctx, dim = 40, 8
    g = torch.Generator().manual_seed(num_anchors)
    batch = 1 if num_anchors > 64 else 2  # the dense reference of 256 anchors holds 4096 x 4136 scores a head
    anchors = torch.randint(1, n_ctx, (batch, num_anchors), generator=g)
    anchors[0, 0], anchors[-1, -1] = -1, n_ctx - 1  # an unused slot; an anchor that sees the whole context
    query, key, value = _attention_inputs(batch, heads, kv_heads, anchors, n_ctx, dim, torch.float64)
    blockwise = BlockwiseMask(torch.arange(n_ctx) < anchors.clamp(min=0)[..., None], BLOCK)
    allowed = dense_block_mask(anchors, n_ctx, BLOCK)
    dense = _attention_grads(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(
            1, 2
        ),
        query,
        key,
        value,
    )
    split = _attention_grads(
        lambda q, k, v: blockwise_attention(q, k, v, blockwise, dim**-0.5, 0.0, False), query, key, value
    )
    for name, want, got in zip(("out", "d_query", "d_key", "d_value"), dense, split):
        torch.testing.assert_close(got, want, atol=ATOL64, rtol=0, msg=name)


def test_block_anchors_refuse_a_mask_a_cache_or_a_wrong_shape(float64_pair):
    from transformers import DynamicCache

    drafter, target = float64_pair
    blocks, features, noise = _inputs(drafter, target, torch.tensor([[4, 20], [6, 25]]), 60, [60, 60])
    common = dict(noise_embeds=noise, context_hidden_states=features, position_ids=blocks.position_ids)
    with pytest.raises(ValueError, match="attention_mask: expected None with block_anchors"):
        drafter(**common, block_anchors=blocks.anchors, attention_mask=blocks.attention_mask)
    with pytest.raises(ValueError, match="cache: expected None with block_anchors"):
        drafter(**common, block_anchors=blocks.anchors, cache=DynamicCache())
    with pytest.raises(ValueError, match=r"block_anchors: expected shape \(2, 2\)"):
        drafter(**common, block_anchors=blocks.anchors[:, :1])
