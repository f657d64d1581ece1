"""Packed verify on the torch path: acceptance against a per-request reference, the slot-pool packing geometry,
and the slot-pool attention against per-request attention."""

from collections import namedtuple

import pytest
import torch

from adaflash_hf.kernels._utils import row_argmax
from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.kernels.verify_attention import slot_verify_attention
from adaflash_hf.kernels.verify_packing import SlotPacking

Packed = namedtuple("Packed", "draft_tokens cu_seqlens_q total")


def pack_drafts(drafts: list[torch.Tensor]) -> Packed:
    """The acceptance layout: request i has k̂_i draft rows and a bonus row, ``cu_seqlens_q`` over k̂_i + 1."""
    cu = torch.tensor([0, *[d.numel() + 1 for d in drafts]]).cumsum(0).int()
    return Packed(torch.cat(drafts).long(), cu, int(cu[-1]))


def reference_accept(logits, drafts, temperatures, draft_probs, accept_uniforms, sample_uniforms):
    """One request at a time, float64, straight from the definition of speculative sampling."""
    accepted, next_tokens, row, d = [], [], 0, 0
    for i, draft in enumerate(drafts):
        k, temp = len(draft), float(temperatures[i])
        rows = logits[row : row + k + 1].double()
        n = 0
        while n < k:
            token = int(draft[n])
            if temp <= 0:
                ok = int(rows[n].argmax()) == token
            else:
                p = torch.softmax(rows[n] / temp, -1)
                q = 1.0 if draft_probs is None else float(draft_probs[d + n, token])
                ok = float(accept_uniforms[d + n]) * q < float(p[token])
            if not ok:
                break
            n += 1
        if temp <= 0:
            token = int(rows[n].argmax())
        else:
            weights = torch.softmax(rows[n] / temp, -1)
            if n < k:
                q = torch.zeros_like(weights)
                if draft_probs is None:
                    q[int(draft[n])] = 1.0
                else:
                    q = draft_probs[d + n].double()
                residual = (weights - q).clamp_min(0.0)
                weights = residual if residual.sum() > 0 else weights
            cdf = torch.cumsum(weights, 0)
            token = int((cdf <= float(sample_uniforms[i]) * cdf[-1]).sum())
        accepted.append(n)
        next_tokens.append(token)
        row, d = row + k + 1, d + k
    return accepted, next_tokens


def random_verify_case(g, vocab, max_batch=6, with_q=False, lengths=None):
    """A ragged batch whose draft tokens are often the target's choice, so acceptance runs are long."""
    batch = len(lengths) if lengths is not None else int(torch.randint(1, max_batch + 1, (1,), generator=g))
    lengths = lengths if lengths is not None else torch.randint(0, 17, (batch,), generator=g).tolist()
    drafts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    packed = pack_drafts(drafts)
    logits = torch.randn(packed.total, vocab, generator=g) * 2
    # Every packed row but the last of each request scores a draft, in packed draft order.
    is_bonus_row = torch.zeros(packed.total, dtype=torch.bool)
    is_bonus_row[packed.cu_seqlens_q[1:].long() - 1] = True
    draft_rows = torch.nonzero(~is_bonus_row).squeeze(1)
    logits[draft_rows, packed.draft_tokens] += torch.rand(draft_rows.numel(), generator=g) * 8
    temperatures = torch.where(
        torch.rand(batch, generator=g) < 0.4, 0.0, 0.3 + torch.rand(batch, generator=g)
    )
    draft_probs = None
    if with_q:
        draft_probs = torch.softmax(torch.randn(packed.draft_tokens.numel(), vocab, generator=g) * 2, -1)
    accept_u = torch.rand(packed.draft_tokens.numel(), generator=g)
    sample_u = torch.rand(batch, generator=g)
    return drafts, packed, logits, temperatures, draft_probs, accept_u, sample_u


@pytest.mark.parametrize("with_q", [False, True])
def test_acceptance_matches_per_request_reference_on_random_ragged_batches(with_q):
    g = torch.Generator().manual_seed(1234 + with_q)
    for _ in range(300):
        drafts, packed, logits, temps, q, accept_u, sample_u = random_verify_case(g, vocab=64, with_q=with_q)
        out = verify_accept(
            logits, packed.draft_tokens, packed.cu_seqlens_q, temps, q, accept_u, sample_u, impl="torch"
        )
        expected = reference_accept(logits, drafts, temps, q, accept_u, sample_u)
        assert (out.accepted.tolist(), out.next_tokens.tolist()) == expected


def test_all_greedy_batches_take_the_argmax_path_and_match_the_reference():
    # No request samples: the torch path decides by argmaxes alone (no vocabulary softmax); the same tokens.
    g = torch.Generator().manual_seed(77)
    for _ in range(100):
        drafts, packed, logits, temps, _, accept_u, sample_u = random_verify_case(g, vocab=64)
        greedy = torch.zeros_like(temps)
        out = verify_accept(
            logits, packed.draft_tokens, packed.cu_seqlens_q, greedy, None, accept_u, sample_u
        )
        expected = reference_accept(logits, drafts, greedy, None, accept_u, sample_u)
        assert (out.accepted.tolist(), out.next_tokens.tolist()) == expected
        mixed = greedy.clone()
        mixed[0] = 0.7  # one sampling request: the full path, and the greedy requests' results do not change
        out_mixed = verify_accept(
            logits, packed.draft_tokens, packed.cu_seqlens_q, mixed, None, accept_u, sample_u
        )
        assert out_mixed.accepted.tolist()[1:] == expected[0][1:]
        assert out_mixed.next_tokens.tolist()[1:] == expected[1][1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_on_ties_nans_and_wide_rows(dtype):
    # The greedy path's argmax runs through max(-1): the same index, the first of tied maxima, a NaN the maximum.
    g = torch.Generator().manual_seed(5)
    for vocab in (7, 1000, 70000):
        rows = torch.randint(0, 4, (9, vocab), generator=g).to(dtype)  # many ties
        rows[2, vocab // 2] = float("nan")
        rows[3] = 1.0  # a row of one value
        rows[4, 3:] = float("-inf")
        assert torch.equal(row_argmax(rows), rows.argmax(-1))
        assert torch.equal(row_argmax(rows), rows.float().argmax(-1))  # a widening cast keeps the order
    # Greedy verification takes the first tied maximum: the draft of the lower index is accepted.
    logits = torch.zeros(2, 10)
    logits[0, [4, 6]] = 1.0
    assert verify_accept(logits, torch.tensor([4]), torch.tensor([0, 2])).accepted.tolist() == [1]
    assert verify_accept(logits, torch.tensor([6]), torch.tensor([0, 2])).accepted.tolist() == [0]


def test_greedy_accepts_the_target_argmax_and_emits_the_bonus_token():
    logits = torch.full((4, 10), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 7] = logits[3, 2] = 1.0
    out = verify_accept(logits, torch.tensor([3, 5, 7]), torch.tensor([0, 4]))
    assert out.accepted.tolist() == [3] and out.next_tokens.tolist() == [2]
    out = verify_accept(logits, torch.tensor([3, 4, 7]), torch.tensor([0, 4]))
    assert out.accepted.tolist() == [1] and out.next_tokens.tolist() == [5]


def test_zero_length_draft_emits_one_token_from_the_anchor_row():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = verify_accept(logits, torch.zeros(0, dtype=torch.long), torch.tensor([0, 1]))
    assert out.accepted.tolist() == [0] and out.next_tokens.tolist() == [1]


def _first_token_distribution(p, q, claimed_q=None, n=40000, seed=0):
    """Empirical law of the first committed token when a one-draft request proposes x ~ q and the
    acceptance rule is told the proposal law is ``claimed_q`` (default: q itself)."""
    claimed_q = q if claimed_q is None else claimed_q
    g = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    logits = p.log().expand(2 * n, vocab).contiguous()
    cu = torch.arange(0, 2 * n + 1, 2)
    out = verify_accept(logits, drafts, cu, torch.ones(n), claimed_q.expand(n, vocab), generator=g)
    first = torch.where(out.accepted == 1, drafts, out.next_tokens)
    return torch.bincount(first, minlength=vocab).double() / n


def test_one_hot_proposals_are_lossless_for_any_draft_law():
    # With draft_probs=None the rule treats q as one-hot at the draft, which is exact for any proposal law.
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    g = torch.Generator().manual_seed(1)
    n = 40000
    drafts = torch.multinomial(torch.tensor([0.1, 0.4, 0.1, 0.2, 0.2]), n, replacement=True, generator=g)
    out = verify_accept(
        p.log().expand(2 * n, 5).contiguous(),
        drafts,
        torch.arange(0, 2 * n + 1, 2),
        torch.ones(n),
        generator=g,
    )
    first = torch.where(out.accepted == 1, drafts, out.next_tokens)
    assert 0.5 * (torch.bincount(first, minlength=5).double() / n - p.double()).abs().sum() < 0.015


def test_speculative_sampling_is_lossless():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.2, 0.2])
    tv = 0.5 * (_first_token_distribution(p, q) - p.double()).abs().sum()
    assert tv < 0.015


def test_negative_control_wrong_proposal_probabilities_break_losslessness():
    # Telling the acceptance rule the wrong proposal law (uniform, while drafts come from q) must show up.
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.4, 0.1, 0.2, 0.2])
    tv = 0.5 * (_first_token_distribution(p, q, claimed_q=torch.full((5,), 0.2)) - p.double()).abs().sum()
    assert tv > 0.1


def test_acceptance_input_errors_name_the_field():
    with pytest.raises(ValueError, match=r"draft_tokens must be \(3,\)"):
        verify_accept(torch.zeros(4, 5), torch.zeros(2, dtype=torch.long), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"temperatures must be \(1,\)"):
        verify_accept(
            torch.zeros(4, 5), torch.zeros(3, dtype=torch.long), torch.tensor([0, 4]), torch.ones(2)
        )


def test_packing_geometry_of_prefills_and_verifies():
    slots, starts, lengths = [5, 0, 2, 7], [0, 40, 3, 19], [7, 1, 16, 9]
    packing = SlotPacking.build(slots, starts, lengths, 16, torch.device("cpu"))
    assert packing.offsets == [0, 7, 8, 24]
    assert packing.token_slots.tolist() == [s for s, n in zip(slots, lengths) for _ in range(n)]
    assert packing.token_positions.tolist() == [p for s, n in zip(starts, lengths) for p in range(s, s + n)]
    assert packing.request_table.dtype == torch.int32
    assert packing.request_table.tolist() == [[5, 0, 0, 7], [0, 40, 7, 1], [2, 3, 8, 16], [7, 19, 24, 9]]


def test_short_requests_share_one_group_and_each_long_one_gets_its_own():
    packing = SlotPacking.build([3, 1, 0], [10, 0, 4], [5, 23, 1], 16, torch.device("cpu"))
    short, long = packing.groups
    assert short.slots.tolist() == [3, 0] and short.key_length == 15
    assert short.query_index.tolist() == [[0, 1, 2, 3, 4], [28, 0, 0, 0, 0]]
    assert short.query_valid.sum(1).tolist() == [5, 1]
    # A query sees its own slot up to its own position; padding queries see key 0 only.
    assert short.mask[0, 0].sum(-1).tolist() == [11, 12, 13, 14, 15]
    assert short.mask[1, 0].sum(-1).tolist() == [5, 1, 1, 1, 1]
    assert long.slots.tolist() == [1] and long.key_length == 23 and long.query_index.shape == (1, 23)


def per_request_attention(query, key_pool, value_pool, packing):
    """One request at a time, float64: its queries against its own slot, causal from its start position."""
    outputs = []
    groups = query.shape[1] // key_pool.shape[2]
    for slot, start, offset, length in zip(packing.slots, packing.starts, packing.offsets, packing.lengths):
        q = query[offset : offset + length].double().transpose(0, 1)
        k = key_pool[slot, : start + length].double().transpose(0, 1).repeat_interleave(groups, 0)
        v = value_pool[slot, : start + length].double().transpose(0, 1).repeat_interleave(groups, 0)
        allowed = torch.arange(start + length)[None] <= torch.arange(length)[:, None] + start
        scores = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


def random_slot_case(g, lengths, starts, heads=4, kv_heads=2, head_dim=24, capacity=128):
    """Distinct slots per request; every pool entry random, so unmasked stale keys would show."""
    slots = torch.randperm(len(lengths) + 2, generator=g)[: len(lengths)].tolist()
    packing = SlotPacking.build(slots, starts, lengths, 16, torch.device("cpu"))
    query = torch.randn(sum(lengths), heads, head_dim, generator=g)
    key_pool = torch.randn(len(lengths) + 2, capacity, kv_heads, head_dim, generator=g)
    value_pool = torch.randn(len(lengths) + 2, capacity, kv_heads, head_dim, generator=g)
    return query, key_pool, value_pool, packing


def test_slot_attention_matches_per_request_attention():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = int(torch.randint(1, 7, (1,), generator=g))
        lengths = (torch.randint(0, 17, (batch,), generator=g) + 1).tolist()
        lengths[0] = int(torch.randint(1, 40, (1,), generator=g))  # sometimes a prefill, alone in its group
        starts = torch.randint(0, 60, (batch,), generator=g).tolist()
        query, key_pool, value_pool, packing = random_slot_case(g, lengths, starts)
        out = slot_verify_attention(query, key_pool, value_pool, packing, impl="torch")
        expected = per_request_attention(query, key_pool, value_pool, packing)
        assert (out.double() - expected).abs().max().item() < 1e-5


def test_slot_attention_errors_name_the_shapes():
    g = torch.Generator().manual_seed(0)
    query, key_pool, value_pool, packing = random_slot_case(g, [3], [0], heads=3)
    with pytest.raises(ValueError, match="multiple of key heads"):
        slot_verify_attention(query, key_pool, value_pool, packing)
    with pytest.raises(ValueError, match="key/value pools"):
        slot_verify_attention(query, key_pool[0], value_pool[0], packing)
