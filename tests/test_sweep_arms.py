"""What the sample-efficiency sweep's arms (experiments/configs/sweep_*) train with: a drafter started from the
target's last layers, the soft-target KL to the target's recorded top-k, and the resume from the newest complete
checkpoint."""

from types import SimpleNamespace

import datasets
import pytest
import torch

from adaflash_hf.trainers import DrafterTrainer, DrafterTrainingConfig
from adaflash_hf.trainers.corpus import build_corpus
from adaflash_hf.trainers.corpus_format import read_corpus
from adaflash_hf.trainers.dflash_recipe import recipe_loss, sample_anchors, soft_target_kl
from adaflash_hf.trainers.drafter_setup import build_drafter, init_from_target
from adaflash_hf.trainers.target_features import SequenceCollator, TargetFeatures
from tests.test_corpus import rows, tiny_tokenizer
from tests.test_train_drafter import toy_batch


# ------------------------------------------------------------------------------------------- init_from_target
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_init_from_target_copies_the_last_layers_and_fc_passes_the_deepest_tapped_layer(
    target_factory, drafter_factory, kind
):
    target = target_factory(kind)
    drafter = drafter_factory(target, num_hidden_layers=2)
    init_from_target(drafter, target)
    layers = target.model.layers
    for i, layer in enumerate(drafter.layers):
        source = dict(layers[len(layers) - 2 + i].named_parameters())
        for name, param in layer.named_parameters():
            if name in source:
                assert torch.equal(param, source[name]), f"layers.{i}.{name}"
            else:  # a Llama target has no q_norm / k_norm: identity
                assert kind == "llama" and name.endswith(("q_norm.weight", "k_norm.weight"))
                assert torch.equal(param, torch.ones_like(param))
    assert torch.equal(drafter.hidden_norm.weight, layers[2].input_layernorm.weight)
    hidden = target.config.hidden_size
    ids = drafter.config.target_layer_ids
    parts = [torch.randn(3, hidden) for _ in ids]
    passed = drafter.fc(torch.cat(parts, dim=-1))
    torch.testing.assert_close(passed, parts[ids.index(max(ids))], atol=0, rtol=0)


def test_init_from_target_refuses_a_drafter_with_another_head_count(target_factory, drafter_factory):
    target = target_factory("llama")  # 4 heads of 16
    drafter = drafter_factory(target, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    before = {n: p.clone() for n, p in drafter.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"init_from_target: layers.0.self_attn.q_proj.weight: expected shape \(32, 64\) \(the drafter's\), "
        r"got \(64, 64\) in target layer 3",
    ):
        init_from_target(drafter, target)
    assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())  # nothing half-copied


def test_init_from_target_is_a_config_field_of_a_fresh_drafter_only(target_factory, tmp_path):
    target = target_factory("llama")
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path), init_from_target=True, drafter_layers=1, mask_token_id=3, report_to="none"
    )
    drafter = build_drafter(args, target)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.model.layers[-1].mlp.down_proj.weight)
    with pytest.raises(ValueError, match="init_from_target: expected False when drafter_init is set"):
        DrafterTrainingConfig(
            output_dir=str(tmp_path), init_from_target=True, drafter_init="some/drafter", report_to="none"
        )


# ------------------------------------------------------------------------------------------------ soft targets
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


def _corpus(target, tmp_path, layer_ids, topk):
    tokenizer = tiny_tokenizer(target.config.vocab_size, eos="t511")
    build_corpus(
        target,
        tokenizer,
        rows(),
        tmp_path / "c",
        tmp_path / "f",
        layer_ids=layer_ids,
        max_new_tokens=24,
        topk=topk,
    )
    return read_corpus(tmp_path / "c", ["chat", "math"]), tokenizer


def test_recorded_top_k_sits_at_the_positions_of_the_tokens_it_predicts(
    target_factory, drafter_factory, tmp_path
):
    target = target_factory("llama")
    layer_ids = drafter_factory(target).config.target_layer_ids
    records, _ = _corpus(target, tmp_path, layer_ids, topk=8)
    batch = SequenceCollator(0, 512)(records[:3])
    recorded = TargetFeatures(target, layer_ids, tmp_path / "f", soft_topk=8)(
        batch["input_ids"], batch["attention_mask"], batch["records"]
    )[1]
    on_the_fly = TargetFeatures(target, layer_ids, soft_topk=8)(batch["input_ids"], batch["attention_mask"])[
        1
    ]
    for i, record in enumerate(records[:3]):
        prompt, n = record["prompt_length"], len(record["input_ids"])
        assert torch.all(recorded.ids[i, :prompt] == -1) and torch.all(recorded.ids[i, n:] == -1)
        # Greedy responses: the likeliest token at each response position is the token there.
        assert torch.equal(recorded.ids[i, prompt:n, 0], batch["input_ids"][i, prompt:n])
        assert torch.equal(on_the_fly.ids[i, prompt:n, 0], batch["input_ids"][i, prompt:n])
        torch.testing.assert_close(
            recorded.logprobs[i, prompt:n, 0], on_the_fly.logprobs[i, prompt:n, 0], atol=1e-2, rtol=0
        )


def _soft_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        domains=["chat", "math"],
        corpus_dir=str(tmp_path / "c"),
        corpus_features_dir=str(tmp_path / "f"),
        soft_target_weight=0.5,
        max_steps=2,
        per_device_train_batch_size=2,
        num_anchors=8,
        logging_steps=1,
        eval_prompts_per_domain=0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    return DrafterTrainingConfig(**{**values, **overrides})


def _dataset(records):
    return datasets.Dataset.from_list(
        [{k: r[k] for k in ("input_ids", "prompt_length", "id", "domain")} for r in records]
    )


def test_training_with_soft_targets_reads_the_recorded_top_k(
    target_factory, drafter_factory, tmp_path, monkeypatch
):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    records, tokenizer = _corpus(target, tmp_path, drafter.config.target_layer_ids, topk=8)
    trainer = DrafterTrainer(
        model=drafter,
        args=_soft_args(tmp_path),
        target=target,
        tokenizer=tokenizer,
        train_dataset=_dataset(records),
    )
    monkeypatch.setattr(
        target, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("target ran"))
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "soft_kl" in e]
    assert len(logged) == 2 and all(e["soft_kl"] > 0 and e["soft_target_rows"] == 1.0 for e in logged)


def test_a_corpus_without_top_k_is_refused_before_any_forward(
    target_factory, drafter_factory, tmp_path, monkeypatch
):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    records, tokenizer = _corpus(target, tmp_path, drafter.config.target_layer_ids, topk=0)
    monkeypatch.setattr(
        target, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("target ran"))
    )
    with pytest.raises(
        ValueError,
        match=r"soft_target_weight > 0: expected the target's top-k in every recorded feature file, got none in "
        r"6 of 6 records \(first: 'chat/0', .*--topk 32`, or set soft_target_weight: 0",
    ):
        DrafterTrainer(
            model=drafter,
            args=_soft_args(tmp_path),
            target=target,
            tokenizer=tokenizer,
            train_dataset=_dataset(records),
        )
    DrafterTrainer(  # the hard-CE recipe needs no top-k
        model=drafter,
        args=_soft_args(tmp_path, soft_target_weight=0.0),
        target=target,
        tokenizer=tokenizer,
        train_dataset=_dataset(records),
    )


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_soft_target_weight_outside_zero_one_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=rf"soft_target_weight: expected a float in \[0, 1\], got {value}"):
        DrafterTrainingConfig(output_dir=str(tmp_path), soft_target_weight=value, report_to="none")


# ------------------------------------------------------------------------------------------------ resume
def test_resume_last_takes_the_newest_complete_checkpoint(tmp_path):
    from adaflash_hf.trainers.train_drafter import last_complete_checkpoint

    assert last_complete_checkpoint(tmp_path / "missing") is None
    for step in (40, 400, 1200, 1600):  # numeric order, not lexical; 1600 was killed while saving
        (tmp_path / f"checkpoint-{step}").mkdir()
        if step != 1600:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-9999.tmp").mkdir()
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1200")
    assert last_complete_checkpoint(tmp_path / "checkpoint-40") is None
