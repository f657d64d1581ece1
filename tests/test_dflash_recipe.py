"""The recipe's soft-target loss: the KL from the target's recorded top-k to the drafter is zero when the drafter is
the target and positive otherwise; over a draft vocabulary the target is conditioned on it, and rows without a
recorded top-k weigh nothing; and a training step through ``recipe_loss`` lowers it."""

from types import SimpleNamespace

import torch

from adaflash_hf.trainers.dflash_recipe import recipe_loss, sample_anchors, soft_target_kl
from adaflash_hf.trainers.target_features import TargetFeatures
from tests.conftest import toy_batch


def test_soft_target_kl_is_zero_when_the_drafter_is_the_target_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(6, 50, generator=g)
    logprobs, ids = torch.log_softmax(logits, dim=-1).topk(8, dim=-1)
    weights = torch.rand(6, generator=g) + 0.1
    kl, used = soft_target_kl(logits.clone(), ids, logprobs, weights)
    assert used.all() and abs(float(kl)) < 1e-6
    other, _ = soft_target_kl(logits + torch.randn(6, 50, generator=g), ids, logprobs, weights)
    assert float(other) > 1e-2


def test_soft_target_kl_over_a_draft_vocabulary_conditions_the_target_on_it():
    g = torch.Generator().manual_seed(1)
    logits = 3.0 * torch.randn(6, 50, generator=g)
    logits[:, [3, 7]] += 8.0  # in every row's top-k, and outside the draft vocabulary
    logprobs, ids = torch.log_softmax(logits, dim=-1).topk(8, dim=-1)
    assert all({3, 7} <= set(row.tolist()) for row in ids)
    draft = torch.tensor([t for t in range(50) if t not in (3, 7)])
    # The drafter's distribution is the target's over the draft vocabulary: the target conditioned on it.
    kl, used = soft_target_kl(logits[:, draft], ids, logprobs, torch.ones(6), draft)
    assert used.all() and abs(float(kl)) < 1e-5
    unrecorded = torch.full_like(ids, -1)
    zero, used = soft_target_kl(logits[:, draft], unrecorded, logprobs, torch.ones(6), draft)
    assert not used.any() and float(zero) == 0.0  # rows without a recorded top-k weigh nothing


def test_the_soft_target_kl_falls_under_a_training_step(target_factory, drafter_factory):
    target = target_factory("qwen3")
    with torch.no_grad():  # a random tiny lm_head spans logits of +-0.2; real heads span far more
        target.lm_head.weight.mul_(20.0)
    drafter = drafter_factory(target).train()
    input_ids, loss_mask = toy_batch()
    features, soft = TargetFeatures(target, drafter.config.target_layer_ids, soft_topk=8)(
        input_ids, torch.ones_like(input_ids)
    )
    anchors = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(3))
    args = SimpleNamespace(
        loss_decay_gamma=7.0, length_head_loss_weight=1.0, attention_layout="split", soft_target_weight=1.0
    )
    embedding, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight

    def step_loss():
        return recipe_loss(
            drafter,
            drafter.config,
            args,
            input_ids,
            loss_mask,
            features,
            anchors,
            embedding,
            lm_head,
            None,
            soft,
        )

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    loss, _, before = step_loss()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        _, _, after = step_loss()
    assert before["soft_target_rows"] == 1.0 and before["soft_kl"] > 0
    assert after["soft_kl"] < before["soft_kl"]
