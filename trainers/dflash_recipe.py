"""The DFlash training recipe (as in SpecForge): random anchors, block inputs, masks, labels and the losses.

For a sequence of length S and anchors a_1..a_n, block b is ``[token[a_b], MASK x (k-1)]`` at positions
``a_b .. a_b+k-1``; row j of the block is labelled with ``token[a_b + j]`` (same-position labels, j >= 1). A block sees
the context strictly before its anchor (the target's hidden state at a_b is not known at inference) and all rows of its
own block (bidirectional), never another block. CE is weighted by ``exp(-(j-1)/gamma)``, optionally mixed with a KL
to the target's recorded top-k distribution over the same label (``soft_target_kl``). The length head learns the
realised accepted fraction of each block, ``cumprod(argmax == label).sum() / (k-1)``, from detached states.

Two layouts of that attention: ``dense`` builds the [B, 1, Q, S + Q] mask (Q = num_anchors * k, so cost grows with
anchors squared); ``split`` hands the drafter the anchors (``AdaFlashDrafter.forward(block_anchors=...)``), which
scores each row against the context and its own block only, linear in anchors, with the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaflash_hf.modeling.length_head_adaflash import length_head_loss, realised_acceptance

IGNORE = -100


@dataclass
class BlockBatch:
    """Inputs of one drafter training forward. Q = num_anchors * block_size rows."""

    anchors: torch.Tensor  # [B, n] anchor positions, -1 for unused slots
    noise_ids: torch.Tensor  # [B, Q] target token ids of [anchor, MASK...] per block
    position_ids: torch.Tensor  # [B, S + Q] context positions 0..S-1, then each block's absolute positions
    attention_mask: torch.Tensor | None  # [B, 1, Q, S + Q] bool, True = may attend; None unless dense_mask
    labels: torch.Tensor  # [B, Q] same-position labels, IGNORE where unsupervised
    weights: torch.Tensor  # [B, Q] CE weight per row (0 where unsupervised)


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to ``num_anchors`` sorted anchor positions per row; -1 pads unused slots.

    An anchor a needs at least one context position (a >= 1) and a supervised next token (``loss_mask[a + 1]``).
    Slots that no row can fill are dropped (at least one is kept): a block without an anchor costs a full block of
    drafter rows and teaches nothing.
    """
    batch, seq = loss_mask.shape
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, 1 : seq - 1] = loss_mask[:, 2:].bool()
    anchors = torch.full((batch, num_anchors), -1, dtype=torch.long)
    for row in range(batch):
        positions = candidates[row].nonzero().flatten().cpu()
        if positions.numel() == 0:
            continue
        chosen = positions[torch.randperm(positions.numel(), generator=generator)[:num_anchors]]
        anchors[row, : chosen.numel()] = chosen.sort().values
    used = max(int((anchors >= 0).sum(dim=1).max()), 1)
    return anchors[:, :used].to(loss_mask.device)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    decay_gamma: float,
    dense_mask: bool = True,
) -> BlockBatch:
    """The blocks of ``anchors`` (see the module docstring); the dense attention mask only when ``dense_mask``."""
    batch, seq = input_ids.shape
    num_blocks = anchors.shape[1]
    device = input_ids.device
    valid = anchors >= 0
    offsets = torch.arange(block_size, device=device)
    block_positions = anchors.clamp(min=0)[..., None] + offsets  # [B, n, k]
    in_range = block_positions < seq
    gathered = torch.gather(input_ids, 1, block_positions.clamp(max=seq - 1).flatten(1)).view(
        batch, num_blocks, -1
    )
    supervised = torch.gather(loss_mask.bool(), 1, block_positions.clamp(max=seq - 1).flatten(1)).view_as(
        gathered
    )

    noise_ids = torch.full_like(gathered, mask_token_id)
    noise_ids[..., 0] = torch.where(valid, gathered[..., 0], torch.full_like(gathered[..., 0], mask_token_id))
    labelled = valid[..., None] & in_range & supervised & (offsets > 0)
    labels = torch.where(labelled, gathered, torch.full_like(gathered, IGNORE))
    decay = torch.exp(-(offsets.clamp(min=1) - 1).float() / decay_gamma)
    weights = labelled.float() * decay

    context_positions = torch.arange(seq, device=device).expand(batch, seq)
    position_ids = torch.cat([context_positions, block_positions.flatten(1)], dim=1)

    return BlockBatch(
        anchors=anchors,
        noise_ids=noise_ids.flatten(1),
        position_ids=position_ids,
        attention_mask=dense_block_mask(anchors, seq, block_size) if dense_mask else None,
        labels=labels.flatten(1),
        weights=weights.flatten(1),
    )


def dense_block_mask(anchors: torch.Tensor, seq: int, block_size: int) -> torch.Tensor:
    """[B, 1, Q, S + Q] bool: a row sees the context strictly before its block's anchor and its own block only."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    rows = num_blocks * block_size
    # Context keys: strictly before the row's anchor (invalid blocks see no context).
    row_anchor = anchors.clamp(min=0).repeat_interleave(block_size, dim=1)  # [B, Q]
    context_visible = torch.arange(seq, device=device)[None, None, :] < row_anchor[..., None]  # [B, Q, S]
    # Block keys: the row's own block only.
    block_of_row = torch.arange(rows, device=device) // block_size
    own_block = block_of_row[:, None] == block_of_row[None, :]  # [Q, Q]
    return torch.cat([context_visible, own_block.expand(batch, rows, rows)], dim=-1)[:, None]


@dataclass
class SoftTargets:
    """The target's top-k distribution over the token at each position of a batch (the corpus records it per response
    token, ``corpus_format.load_soft_targets``; row r of a record sits at position prompt_length + r)."""

    ids: torch.Tensor  # [B, S, k] target vocabulary ids, -1 where nothing is recorded (prompt, padding)
    logprobs: torch.Tensor  # [B, S, k] log-softmax over the target's whole vocabulary

    def at_rows(self, blocks: BlockBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, logprobs)`` [R, k] of the block rows selected by ``rows`` [B, Q]: the distribution over each row's
        label, the token at the row's absolute position."""
        positions = blocks.position_ids[:, -rows.shape[1] :].clamp(max=self.ids.shape[1] - 1)
        batch_index = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
        index = (batch_index[rows], positions[rows])
        return self.ids[index], self.logprobs[index]


def soft_target_kl(
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    weights: torch.Tensor,
    draft_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean over rows of KL(p || q), the target's recorded top-k against the drafter, and the rows used.

    ``logits`` [R, V] are the drafter's (over ``draft_token_ids`` when given), ``topk_ids`` / ``topk_logprobs`` [R, k]
    the target's (-1 ids: nothing recorded), ``weights`` [R] the CE's position weights. Both distributions are
    coarse-grained to k + 1 outcomes, the top-k tokens and the lumped tail (p's tail: 1 - its top-k mass; q's: the
    drafter's mass on every other token), so the KL is exactly 0 when the drafter equals the target and needs nothing
    unrecorded. Top-k ids outside the draft vocabulary are dropped and p renormalised over the rest: the target
    conditioned on what the drafter can draft (its unrecorded tail taken as draftable). The tail is 1 minus the recorded
    top-k mass, good to the log-probs' fp16 rounding (~1e-3), so a row whose dropped ids hold nearly all the mass is
    conditioned only approximately. Float32 throughout.
    """
    recorded = topk_ids >= 0
    if draft_token_ids is None:
        slots = topk_ids.clamp(min=0)
        kept = recorded
    else:
        slots = torch.searchsorted(draft_token_ids, topk_ids.clamp(min=0)).clamp(
            max=draft_token_ids.numel() - 1
        )
        kept = recorded & (draft_token_ids[slots] == topk_ids)
    target_probs = topk_logprobs.float().exp() * recorded
    tail = (1.0 - target_probs.sum(-1)).clamp(min=0.0)  # fp16 log-probs can sum a little past 1
    p_kept = target_probs * kept
    total = p_kept.sum(-1) + tail
    tiny = torch.finfo(torch.float32).tiny
    used = recorded.any(-1) & (total > tiny)
    p_kept, p_tail = p_kept / total.clamp(min=tiny)[:, None], tail / total.clamp(min=tiny)

    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_q_kept = log_q.gather(-1, slots)
    is_kept = torch.zeros_like(log_q, dtype=torch.bool)
    row_index = torch.arange(logits.shape[0], device=logits.device)[:, None].expand_as(slots)
    is_kept[row_index[kept], slots[kept]] = True
    # A finite fill (not -inf) keeps logsumexp's backward finite when every token is kept (V <= k).
    log_q_tail = torch.logsumexp(log_q.masked_fill(is_kept, -1e4), dim=-1)
    kl_rows = (torch.xlogy(p_kept, p_kept) - p_kept * log_q_kept).sum(-1)
    kl_rows = kl_rows + torch.xlogy(p_tail, p_tail) - p_tail * log_q_tail
    row_weights = weights.float() * used
    kl = (kl_rows * row_weights).sum() / row_weights.sum().clamp(min=tiny)
    return kl, used


def recipe_loss(
    model,
    config,
    args,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    embedding_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    draft_token_ids: torch.Tensor | None = None,
    soft_targets: SoftTargets | None = None,
):
    """One training forward of the recipe and its loss ``token_loss + length_head_loss_weight * head_mse``.

    ``model`` is the drafter (or its DDP wrapper), ``config`` its ``AdaFlashConfig``; ``args`` supplies
    ``loss_decay_gamma``, ``length_head_loss_weight``, ``attention_layout``, ``loss_positions`` and
    ``soft_target_weight`` (the token loss mixes the CE with a KL to ``soft_targets``). Shared by ``DrafterTrainer`` and
    ``adaflash bench train`` so the benchmark times the trainer's own step. Returns (loss, drafter output, metrics).
    """
    split = args.attention_layout == "split"
    blocks = build_blocks(
        input_ids,
        loss_mask,
        anchors,
        config.block_size,
        config.mask_token_id,
        args.loss_decay_gamma,
        dense_mask=not split,
    )
    out = model(
        noise_embeds=F.embedding(blocks.noise_ids, embedding_weight),
        context_hidden_states=features,
        position_ids=blocks.position_ids,
        attention_mask=blocks.attention_mask,
        block_anchors=blocks.anchors if split else None,
    )
    acceptance = out.acceptance_prob
    if acceptance.dim() == 1:
        acceptance = acceptance[:, None]
    token_loss, head_mse, metrics = block_ce_and_head_loss(
        out.last_hidden_state,
        acceptance,
        lm_head_weight,
        blocks,
        config.block_size,
        draft_token_ids,
        loss_positions=getattr(args, "loss_positions", None),
        soft_targets=soft_targets,
        soft_target_weight=getattr(args, "soft_target_weight", 0.0),
    )
    return token_loss + args.length_head_loss_weight * head_mse, out, metrics


def block_ce_and_head_loss(
    drafter_hidden: torch.Tensor,
    acceptance_prob: torch.Tensor,
    lm_head_weight: torch.Tensor,
    blocks: BlockBatch,
    block_size: int,
    draft_token_ids: torch.Tensor | None = None,
    loss_positions: int | None = None,
    soft_targets: SoftTargets | None = None,
    soft_target_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The drafter's token loss (weighted same-position CE, mixed with a KL to the target's distribution) and the
    length head's MSE against realised acceptance.

    ``drafter_hidden`` [B, Q, H]; ``acceptance_prob`` [B, n] (from detached states). Logits are computed only for
    supervised rows, and only over ``draft_token_ids`` (sorted target ids, a reduced draft vocabulary) when given:
    a label outside it has no CE term (EAGLE-3) but still counts as a wrong draft in the accuracy and in the realised
    acceptance the length head learns, as it would at inference. Log-softmax and CE run in float32 whatever the
    logits' dtype (bf16 under autocast).

    ``loss_positions`` N limits the CE (and so the lm_head projection, the step's largest cost) to rows 1..N of each
    block; the rest weigh ``exp(-(j-1)/gamma)``, little under a short decay. The realised acceptance stays exact: the
    rows after N are projected (without gradient) only for blocks whose first N drafts were all correct, the only
    blocks where they decide it. ``accuracy`` is then over rows 1..N.

    With ``soft_target_weight`` w > 0 the token loss is (1 - w) CE + w KL, the KL (``soft_target_kl``, metric
    ``soft_kl``) over the same rows, logits and position weights as the CE, against ``soft_targets``. Returns
    (token loss, head_mse, metrics); ``ce`` in the metrics is always the hard CE.
    """
    labels = blocks.labels
    rows = labels != IGNORE
    late = None
    if loss_positions is not None and loss_positions < block_size - 1:
        offset = torch.arange(labels.shape[1], device=labels.device) % block_size
        late = rows & (offset > loss_positions)
        rows = rows & (offset <= loss_positions)
    if not rows.any():
        zero = drafter_hidden.sum() * 0.0
        return zero, acceptance_prob.sum() * 0.0, {"ce": 0.0, "accuracy": 0.0, "head_mse": 0.0, "blocks": 0}
    row_labels = labels[rows]
    weights = blocks.weights[rows]
    head = lm_head_weight if draft_token_ids is None else lm_head_weight[draft_token_ids]
    logits = drafter_hidden[rows] @ head.T  # [R, V], or [R, N] over the draft vocabulary
    ce, extra = _weighted_ce(logits, row_labels, weights, draft_token_ids)
    token_loss = ce
    if soft_target_weight > 0:
        if soft_targets is None:
            raise ValueError(
                f"soft_targets: expected the target's top-k with soft_target_weight={soft_target_weight}, got None"
            )
        kl, used = soft_target_kl(logits, *soft_targets.at_rows(blocks, rows), weights, draft_token_ids)
        token_loss = (1.0 - soft_target_weight) * ce + soft_target_weight * kl
        extra.update(soft_kl=float(kl.detach()), soft_target_rows=float(used.float().mean()))

    predicted = logits.detach().argmax(-1)
    if draft_token_ids is not None:
        predicted = draft_token_ids[predicted]
    correct = torch.zeros_like(labels, dtype=torch.bool)
    correct[rows] = predicted == row_labels
    accepted = _realised_accepted(
        correct, late, drafter_hidden, head, labels, block_size, loss_positions, draft_token_ids
    )
    realised = realised_acceptance(accepted, block_size)
    valid_blocks = blocks.anchors >= 0
    head_mse = length_head_loss(acceptance_prob[valid_blocks], realised[valid_blocks])
    metrics = {
        "ce": float(ce.detach()),
        "accuracy": float((predicted == row_labels).float().mean()),
        "head_mse": float(head_mse.detach()),
        "accept_len": float(accepted[valid_blocks].float().mean()),
        "blocks": int(valid_blocks.sum()),
        **extra,
    }
    return token_loss, head_mse, metrics


def _weighted_ce(
    logits: torch.Tensor,
    row_labels: torch.Tensor,
    weights: torch.Tensor,
    draft_token_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The position-weighted CE of ``logits`` [R, V or N] against ``row_labels`` [R] (target ids); a label outside the
    draft vocabulary has no term. Returns (ce, metrics: the draft vocabulary's coverage of the labels)."""
    extra = {}
    targets, ce_weights = row_labels, weights
    if draft_token_ids is not None:
        slot = torch.searchsorted(draft_token_ids, row_labels).clamp(max=draft_token_ids.numel() - 1)
        in_vocab = draft_token_ids[slot] == row_labels
        targets = torch.where(in_vocab, slot, torch.full_like(slot, IGNORE))
        ce_weights = weights * in_vocab
        extra["draft_vocab_coverage"] = float(in_vocab.float().mean())
    ce_rows = F.cross_entropy(logits.float(), targets, reduction="none", ignore_index=IGNORE)
    # Rows 1.. of a supervised block weigh >= exp(-(k-2)/gamma) each, so the sum is 0 only when no label is in the
    # draft vocabulary; then the CE is 0 rather than 0/0.
    return (ce_rows * ce_weights).sum() / ce_weights.sum().clamp(min=torch.finfo(torch.float32).tiny), extra


def _realised_accepted(
    correct: torch.Tensor,
    late: torch.Tensor | None,
    drafter_hidden: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    block_size: int,
    loss_positions: int | None,
    draft_token_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Accepted drafts per block [B, n] from ``correct`` (rows 1..N scored); the ``late`` rows after N are projected,
    without gradient, only for blocks that accepted all N, the only blocks where they decide the acceptance."""
    accepted = accepted_drafts(correct, block_size)
    if late is None:
        return accepted
    full = (accepted == loss_positions).repeat_interleave(block_size, dim=1) & late
    if not full.any():
        return accepted
    with torch.no_grad():
        late_predicted = (drafter_hidden[full] @ head.T).argmax(-1)
        if draft_token_ids is not None:
            late_predicted = draft_token_ids[late_predicted]
    correct = correct.clone()
    correct[full] = late_predicted == labels[full]
    return accepted_drafts(correct, block_size)


def accepted_drafts(correct: torch.Tensor, block_size: int) -> torch.Tensor:
    """Accepted drafts per block, [B, n]: the leading run of correct rows 1..k-1 of each block of ``correct`` [B, Q]
    (Q = n * k; row 0 is the anchor). The realised acceptance of the recipe and of OPD."""
    return correct.view(correct.shape[0], -1, block_size)[..., 1:].long().cumprod(dim=-1).sum(-1)


def position_weights(block_size: int, decay_gamma: float) -> list[float]:
    """The CE weight of rows 0..k-1 (row 0, the anchor, is never supervised)."""
    return [0.0] + [math.exp(-(j - 1) / decay_gamma) for j in range(1, block_size)]
