"""Reduced draft vocabulary (EAGLE-3 / FR-Spec): the drafter's logits over a subset of the target's lm_head rows.

``build_draft_vocab`` picks the N most frequent response tokens of the (regenerated) training data; the ids go into
``AdaFlashConfig(draft_token_ids=...)`` and come back as ``drafter.draft_token_ids``. ``draft_logits`` /
``draft_tokens`` are the only way drafter states become proposals (``generate``, the serving engine, OPD), so no
token outside the subset is ever proposed. No parameter is added: the checkpoint stays a z-lab DFlash one, and the
lm_head matmul shrinks from V to N rows. Verification is still by the full target, so decoding stays lossless; tokens
outside the subset are only ever produced by the target's own correction or bonus token.

transformers' native path (``speculation_type="dflash"``, hook disabled) projects the block through the full
lm_head itself: it drafts over the whole vocabulary with the same weights (still lossless, other proposals).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adaflash_hf.prepared.linear import fast_linear, kept_for_weight


def build_draft_vocab(
    sequences: Iterable[Mapping], size: int, eos_token_id: int | Sequence[int] | None = None
) -> tuple[list[int], float]:
    """The ``size`` most frequent response tokens (positions >= ``prompt_length``) and their coverage.

    Each item has ``input_ids`` (a list or 1-D tensor) and ``prompt_length``. Ties are broken by the lower id; the
    eos id(s) are always kept (without them no draft could end an answer); with fewer distinct tokens than ``size``
    the lowest unused ids fill up the list. Returns the sorted ids and the fraction of response tokens they cover.
    """
    if size < 1:
        raise ValueError(f"size: expected >= 1, got {size}")
    eos_ids = (
        []
        if eos_token_id is None
        else sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    )
    if len(eos_ids) > size:
        raise ValueError(f"size: expected >= the {len(eos_ids)} eos ids {eos_ids}, got {size}")
    counts = torch.zeros(0, dtype=torch.long)
    for index, sequence in enumerate(sequences):
        input_ids = torch.as_tensor(sequence["input_ids"], dtype=torch.long).reshape(-1)
        prompt_length = int(sequence["prompt_length"])
        if not 0 <= prompt_length <= input_ids.numel():
            raise ValueError(
                f"sequences[{index}].prompt_length: expected 0..{input_ids.numel()} (the length of input_ids), "
                f"got {prompt_length}"
            )
        found = torch.bincount(input_ids[prompt_length:])
        if found.numel() > counts.numel():
            counts = F.pad(counts, (0, found.numel() - counts.numel()))
        counts[: found.numel()] += found
    total = int(counts.sum())
    if total == 0:
        raise ValueError(
            "sequences: expected at least one response token (input_ids past prompt_length), got none"
        )
    # Enough zero-count ids that padding never runs out (a stable sort puts them after every seen token, by id), and a
    # count for every eos id.
    width = max(counts.numel(), size + len(eos_ids), max(eos_ids, default=-1) + 1)
    counts = F.pad(counts, (0, width - counts.numel()))
    ranked = torch.sort(counts, descending=True, stable=True).indices.tolist()
    reserved = set(eos_ids)
    token_ids = sorted(eos_ids + [t for t in ranked if t not in reserved][: size - len(eos_ids)])
    return token_ids, int(counts[token_ids].sum()) / total


def draft_logits(
    block_hidden: torch.Tensor, lm_head: nn.Module, token_ids: torch.LongTensor | None
) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """Drafter states through the target's lm_head: ``(logits [..., N], token_ids)`` over the draft vocabulary, where
    column c scores target token ``token_ids[c]``, or ``(logits [..., V], None)`` when ``token_ids`` is None."""
    weight = lm_head.weight
    block_hidden = block_hidden.to(weight.device)
    if token_ids is None:
        return lm_head(block_hidden), None
    token_ids = token_ids.to(weight.device)
    bias = getattr(lm_head, "bias", None)
    # as rows: a 3-D input in inference mode makes torch's matmul copy the whole weight at every call (a batched
    # product over an expanded weight: 3.7 ms against 0.4 for 4 rows of an 8,192-token draft vocabulary on one CPU)
    rows = fast_linear(
        block_hidden.reshape(-1, block_hidden.shape[-1]),
        _subset_rows(weight, token_ids),
        None if bias is None else bias[token_ids],
    )
    return rows.reshape(*block_hidden.shape[:-1], rows.shape[-1]), token_ids


def _subset_rows(weight: torch.Tensor, token_ids: torch.LongTensor) -> torch.Tensor:
    """``weight[token_ids]``, gathered once per (weight, subset) while neither changes: at inference the gather of
    N x H rows would otherwise be paid every drafting round. Gradients never flow into a frozen target's lm_head; when
    the weight requires grad the gather is done afresh so autograd sees it."""
    if weight.requires_grad and torch.is_grad_enabled():
        return weight[token_ids]
    # The storage and dtype too: a cast in place (``prepare_target``, ``model.to(dtype)``) keeps the Parameter and
    # its version but gives it new data.
    key = (weight._version, weight.data_ptr(), weight.dtype, token_ids.data_ptr(), token_ids.numel())
    return kept_for_weight(_SUBSET_CACHE, weight, key, lambda: _gathered(weight, token_ids))


def _gathered(weight: torch.Tensor, token_ids: torch.LongTensor) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor: fast_linear keeps its packed copy by its version
        return weight.detach()[token_ids]


# id(weight) -> (weakref to the weight, (version, subset), rows); an entry leaves with its weight tensor.
_SUBSET_CACHE: dict[int, tuple] = {}


def draft_tokens(
    block_hidden: torch.Tensor, lm_head: nn.Module, token_ids: torch.LongTensor | None
) -> torch.LongTensor:
    """Argmax proposals of drafter states, as target token ids (inside ``token_ids`` when given)."""
    from adaflash_hf.kernels._utils import row_argmax  # here: importing the package loads no kernel module

    logits, token_ids = draft_logits(block_hidden, lm_head, token_ids)
    best = row_argmax(logits)
    return best if token_ids is None else token_ids[best]


def block_confidences(states, spans: list[tuple[int, int]], lm_head, token_ids):
    """Per block (a row of ``states``: [anchor, MASK...] after the drafter), the argmax proposals of its rows
    start+1..end (``spans[row] = (start, end)``) and the drafter's confidence (softmax maximum) in each, as lists;
    one projection for every block (lm_head rows are what costs: a policy says how many it reads)."""
    confidences, tokens = [[] for _ in spans], [[] for _ in spans]
    pieces = [states[row, 1 + start : 1 + end] for row, (start, end) in enumerate(spans) if end > start]
    if not pieces:
        return confidences, tokens
    logits, subset = draft_logits(torch.cat(pieces), lm_head, token_ids)
    confidence, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    best = best if subset is None else subset[best]
    flat_confidence, flat_tokens, offset = confidence.nan_to_num(0.0).tolist(), best.tolist(), 0
    for row, (start, end) in enumerate(spans):
        n = max(0, end - start)
        confidences[row], tokens[row] = flat_confidence[offset : offset + n], flat_tokens[offset : offset + n]
        offset += n
    return confidences, tokens
