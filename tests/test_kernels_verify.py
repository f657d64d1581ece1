"""Varlen verify on the torch path: packing geometry, acceptance against a per-request reference, packed
attention against per-request attention, and a packed verify through a Hugging Face Llama target."""

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf.kernels.verify_accept import verify_accept
from adaflash_hf.kernels.verify_attention import (
    ATTENTION_NAME,
    packed_verify_attention,
    register_packed_verify_attention,
    segment_causal_mask,
)
from adaflash_hf.kernels.verify_packing import pack_verify_batch


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
    packed = pack_verify_batch(torch.zeros(batch, dtype=torch.long), drafts, [3] * batch)
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


@pytest.mark.parametrize("lengths", [[0], [1], [15], [16], [0, 1, 15, 16], [16, 0, 0, 3]])
def test_packing_geometry(lengths):
    g = torch.Generator().manual_seed(0)
    drafts = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    anchors = torch.arange(len(lengths)) + 1000
    starts = [5 * i + 2 for i in range(len(lengths))]
    packed = pack_verify_batch(anchors, drafts, starts)
    assert packed.cu_seqlens_q.dtype == torch.int32 and packed.cu_seqlens_k.dtype == torch.int32
    assert packed.cu_seqlens_q.tolist() == [0] + torch.tensor(lengths).add(1).cumsum(0).tolist()
    assert (
        packed.cu_seqlens_k.tolist()
        == [0] + torch.tensor([s + n + 1 for s, n in zip(starts, lengths)]).cumsum(0).tolist()
    )
    assert packed.max_seqlen_q == max(lengths) + 1
    for i, n in enumerate(lengths):
        lo, hi = packed.cu_seqlens_q[i], packed.cu_seqlens_q[i + 1]
        assert packed.input_ids[lo:hi].tolist() == [1000 + i] + drafts[i].tolist()
        assert packed.position_ids[lo:hi].tolist() == list(range(starts[i], starts[i] + n + 1))
        assert packed.request_index[lo:hi].tolist() == [i] * (n + 1)
    assert packed.draft_tokens.tolist() == torch.cat(drafts).tolist()
    assert packed.draft_lengths.tolist() == lengths


def test_padded_drafts_with_lengths_pack_like_a_list():
    padded = torch.tensor([[5, 6, 7], [8, 9, 0], [1, 0, 0]])
    from_padded = pack_verify_batch(torch.tensor([1, 2, 3]), padded, [0, 4, 9], draft_lengths=[3, 2, 0])
    from_list = pack_verify_batch(
        torch.tensor([1, 2, 3]), [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([])], [0, 4, 9]
    )
    assert from_padded.input_ids.tolist() == from_list.input_ids.tolist() == [1, 5, 6, 7, 2, 8, 9, 3]
    assert from_padded.cu_seqlens_k.tolist() == from_list.cu_seqlens_k.tolist()


def test_packing_errors_name_the_field():
    with pytest.raises(ValueError, match="start_positions must be B=2"):
        pack_verify_batch(torch.tensor([1, 2]), [torch.tensor([3]), torch.tensor([4])], [0])
    with pytest.raises(ValueError, match=r"draft_lengths must be in \[0, 2\]"):
        pack_verify_batch(torch.tensor([1]), torch.tensor([[3, 4]]), [0], draft_lengths=[3])


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


def per_request_attention(query, key, value, cu_q, cu_k):
    outputs = []
    groups = query.shape[1] // key.shape[1]
    for i in range(cu_q.numel() - 1):
        q = query[cu_q[i] : cu_q[i + 1]].double().transpose(0, 1)
        k = key[cu_k[i] : cu_k[i + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        v = value[cu_k[i] : cu_k[i + 1]].double().transpose(0, 1).repeat_interleave(groups, 0)
        len_q, len_k = q.shape[1], k.shape[1]
        allowed = torch.arange(len_k)[None] <= torch.arange(len_q)[:, None] + len_k - len_q
        scores = (q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outputs)


def random_attention_case(g, q_lens, prefix_lens, heads=4, kv_heads=2, head_dim=24):
    k_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).int()
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).int()
    query = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    key = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g)
    value = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g)
    return query, key, value, cu_q, cu_k


def test_packed_attention_matches_per_request_attention():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = int(torch.randint(1, 7, (1,), generator=g))
        q_lens = (torch.randint(0, 17, (batch,), generator=g) + 1).tolist()
        prefix_lens = torch.randint(0, 60, (batch,), generator=g).tolist()
        query, key, value, cu_q, cu_k = random_attention_case(g, q_lens, prefix_lens)
        out = packed_verify_attention(query, key, value, cu_q, cu_k, impl="torch")
        expected = per_request_attention(query, key, value, cu_q, cu_k)
        assert (out.double() - expected).abs().max().item() < 1e-5


def test_segment_mask_hides_rejected_keys():
    mask = segment_causal_mask(
        torch.tensor([0, 1]),
        torch.tensor([2, 1]),
        torch.tensor([0, 0, -1, 1, 1]),
        torch.tensor([0, 1, 2, 0, 1]),
    )
    assert mask.tolist() == [[True, True, False, False, False], [False, False, False, True, True]]


def test_register_is_idempotent_and_rejects_flash_names():
    assert register_packed_verify_attention() == register_packed_verify_attention() == ATTENTION_NAME
    with pytest.raises(ValueError, match="must not contain 'flash'"):
        register_packed_verify_attention("adaflash_verify")


@pytest.fixture
def llama_verify_setup(target_factory):
    model = target_factory("llama")
    g = torch.Generator().manual_seed(0)
    prefix_lens, draft_lens = [7, 12, 3], [4, 0, 16]
    prefixes = [torch.randint(0, 512, (n,), generator=g) for n in prefix_lens]
    anchors = torch.randint(0, 512, (3,), generator=g)
    drafts = [torch.randint(0, 512, (n,), generator=g) for n in draft_lens]
    with torch.no_grad():
        expected = [
            model(torch.cat([prefixes[i], anchors[i : i + 1], drafts[i]])[None]).logits[0, prefix_lens[i] :]
            for i in range(3)
        ]
    model.set_attn_implementation(register_packed_verify_attention())
    return model, prefixes, anchors, drafts, torch.cat(expected)


def test_hf_packed_verify_without_cache_equals_per_request_forwards(llama_verify_setup):
    # Layout: every request's prefix + anchor + drafts in one row, positions restarting per request.
    model, prefixes, anchors, drafts, expected = llama_verify_setup
    rows = [torch.cat([prefixes[i], anchors[i : i + 1], drafts[i]]) for i in range(3)]
    lengths = [r.numel() for r in rows]
    cu = torch.tensor([0, *lengths]).cumsum(0).int()
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        logits = model(
            torch.cat(rows)[None],
            position_ids=positions[None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        ).logits[0]
    verify_rows = torch.cat([torch.arange(cu[i] + prefixes[i].numel(), cu[i + 1]) for i in range(3)])
    assert (logits[verify_rows] - expected).abs().max().item() < 1e-4


def test_hf_packed_verify_on_a_packed_cache_equals_per_request_forwards(llama_verify_setup):
    # Layout: a batch-1 DynamicCache holding all prefixes (packed prefill), then the verify tokens of all
    # requests appended; a segment mask keeps each request to its own keys.
    model, prefixes, anchors, drafts, expected = llama_verify_setup
    prefix_lens = [p.numel() for p in prefixes]
    cu = torch.tensor([0, *prefix_lens]).cumsum(0).int()
    prefix_positions = torch.cat([torch.arange(n) for n in prefix_lens])
    prefix_segments = torch.repeat_interleave(torch.arange(3), torch.tensor(prefix_lens))
    cache = DynamicCache()
    packed = pack_verify_batch(anchors, drafts, prefix_lens)
    mask = segment_causal_mask(
        packed.request_index,
        packed.position_ids,
        torch.cat([prefix_segments, packed.request_index]),
        torch.cat([prefix_positions, packed.position_ids]),
    )
    with torch.no_grad():
        model(
            torch.cat(prefixes)[None],
            position_ids=prefix_positions[None],
            cache=cache,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
        )
        logits = model(
            packed.input_ids[None],
            position_ids=packed.position_ids[None],
            cache=cache,
            attention_mask=mask[None, None],
        ).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4


def test_hf_attention_without_layout_raises(llama_verify_setup):
    model = llama_verify_setup[0]
    with pytest.raises(ValueError, match="needs cu_seq_lens_q and cu_seq_lens_k"):
        model(torch.tensor([[1, 2, 3]]))
