"""Offline drafter training: the DFlash recipe (anchors, masks, labels, weights), the loss, DrafterTrainer, soft
targets read from the corpus's recorded top-k, and resuming from the newest complete checkpoint."""

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import TrainerCallback

from adaflash_hf.trainers import DrafterTrainer, DrafterTrainingConfig
from adaflash_hf.trainers.dflash_recipe import (
    IGNORE,
    BlockBatch,
    block_ce_and_head_loss,
    build_blocks,
    position_weights,
    sample_anchors,
)
from tests.conftest import corpus, tiny_script_inputs, toy_batch
from tests.conftest import corpus_with_top_k as _corpus
from tests.conftest import repetitive_sequences as _sequences

BLOCK = 16


def test_anchors_have_context_and_a_supervised_next_token():
    input_ids, loss_mask = toy_batch()
    anchors = sample_anchors(loss_mask, 12, torch.Generator().manual_seed(1))
    for row in range(anchors.shape[0]):
        chosen = anchors[row][anchors[row] >= 0]
        assert torch.all(chosen[1:] > chosen[:-1])  # sorted, distinct
        assert torch.all(chosen >= 1)
        assert torch.all(loss_mask[row, chosen + 1] == 1)


def test_blocks_never_see_context_at_or_after_their_anchor():
    input_ids, loss_mask = toy_batch()
    anchors = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(2))
    blocks = build_blocks(input_ids, loss_mask, anchors, BLOCK, mask_token_id=511, decay_gamma=7.0)
    seq = input_ids.shape[1]
    mask = blocks.attention_mask[:, 0]
    for row in range(anchors.shape[0]):
        for b, anchor in enumerate(anchors[row].tolist()):
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            visible_context = mask[row, rows, :seq].nonzero()[:, 1]
            if anchor < 0:
                assert visible_context.numel() == 0
                continue
            assert visible_context.max() == anchor - 1 and visible_context.numel() == anchor * BLOCK
            block_keys = mask[row, rows, seq:]
            assert block_keys[:, rows].all()  # bidirectional inside the block
            assert int(block_keys.sum()) == BLOCK * BLOCK  # and nothing of other blocks


def test_blocks_are_anchor_then_masks_with_same_position_labels():
    input_ids, loss_mask = toy_batch()
    anchors = torch.tensor([[20, 50], [15, -1]])
    blocks = build_blocks(input_ids, loss_mask, anchors, BLOCK, mask_token_id=511, decay_gamma=7.0)
    noise = blocks.noise_ids.view(2, 2, BLOCK)
    labels = blocks.labels.view(2, 2, BLOCK)
    assert int(noise[0, 0, 0]) == int(input_ids[0, 20]) and torch.all(noise[0, 0, 1:] == 511)
    assert torch.equal(labels[0, 0, 1:], input_ids[0, 21:36]) and int(labels[0, 0, 0]) == IGNORE
    # block at 50 runs past the end (seq 60): rows beyond position 59 are unsupervised
    assert torch.equal(labels[0, 1, 1:10], input_ids[0, 51:60]) and torch.all(labels[0, 1, 10:] == IGNORE)
    assert torch.all(labels[1, 1] == IGNORE) and torch.all(noise[1, 1] == 511)
    positions = blocks.position_ids.view(2, -1)[0, 60:].view(2, BLOCK)
    assert torch.equal(positions[0], torch.arange(20, 36))


def test_position_weights_decay_as_specified():
    weights = position_weights(BLOCK, 7.0)
    assert weights[0] == 0.0 and weights[1] == 1.0
    assert all(math.isclose(weights[j], math.exp(-(j - 1) / 7.0)) for j in range(1, BLOCK))
    input_ids, loss_mask = toy_batch()
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[20], [15]]), BLOCK, 511, 7.0)
    assert torch.allclose(blocks.weights[0], torch.tensor(weights))


def _forward_loss(drafter, target, input_ids, loss_mask, anchors):
    config = drafter.config
    blocks = build_blocks(input_ids, loss_mask, anchors, config.block_size, config.mask_token_id, 7.0)
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
    out = drafter(
        noise_embeds=torch.nn.functional.embedding(blocks.noise_ids, target.get_input_embeddings().weight),
        context_hidden_states=drafter.context_features(hidden),
        position_ids=blocks.position_ids,
        attention_mask=blocks.attention_mask,
    )
    return block_ce_and_head_loss(
        out.last_hidden_state,
        out.acceptance_prob,
        target.get_output_embeddings().weight,
        blocks,
        config.block_size,
    )


def test_head_loss_leaves_drafter_gradients_unchanged(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target).train()
    input_ids, loss_mask = toy_batch()
    anchors = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(3))
    ce, head, _ = _forward_loss(drafter, target, input_ids, loss_mask, anchors)
    ce.backward()
    alone = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    ce, head, _ = _forward_loss(drafter, target, input_ids, loss_mask, anchors)
    (ce + 10.0 * head).backward()
    head_names = set(drafter.length_head_parameter_names())
    for name, param in drafter.named_parameters():
        if name in head_names:
            assert param.grad is not None and param.grad.abs().sum() > 0
        else:
            assert torch.equal(param.grad, alone[name]), name


def test_loss_decreases_on_a_fixed_batch(target_factory, drafter_factory):
    target = target_factory("qwen3")
    with torch.no_grad():  # a random tiny lm_head spans logits of +-0.2; real heads span far more
        target.lm_head.weight.mul_(20.0)
    drafter = drafter_factory(target).train()
    input_ids, loss_mask = toy_batch()
    anchors = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(4))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        ce, head, metrics = _forward_loss(drafter, target, input_ids, loss_mask, anchors)
        optimizer.zero_grad()
        (ce + head).backward()
        optimizer.step()
        losses.append(float(ce.detach()))
    assert losses[-1] < losses[0] * 0.5


@pytest.fixture
def trainer_args(tmp_path):
    def make(**overrides):
        values = dict(
            output_dir=str(tmp_path / "out"),
            max_steps=6,
            per_device_train_batch_size=4,
            num_anchors=6,
            logging_steps=2,
            save_steps=3,
            learning_rate=3e-3,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            eval_max_new_tokens=12,
        )
        values.update(overrides)
        return DrafterTrainingConfig(**values)

    return make


def test_trainer_runs_logs_checkpoints_and_uses_two_learning_rates(
    target_factory, drafter_factory, trainer_args
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    args = trainer_args(length_head_learning_rate=1e-4, eval_strategy="steps", eval_steps=6)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3]])
    trainer = DrafterTrainer(
        model=drafter, args=args, target=target, train_dataset=_sequences(), eval_prompts=[prompt]
    )
    trainer.train()
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    head_ids = {id(p) for n, p in drafter.named_parameters() if n in drafter.length_head_parameter_names()}
    assert {id(p) for p in groups["length_head"]["params"]} == head_ids
    assert groups["length_head"]["initial_lr"] == 1e-4 and groups["drafter"]["initial_lr"] == 3e-3
    logged = [entry for entry in trainer.state.log_history if "ce" in entry]
    assert logged and {"ce", "accuracy", "head_mse", "accept_len"} <= set(logged[0])
    assert logged[-1]["ce"] < logged[0]["ce"]
    evaluated = [entry for entry in trainer.state.log_history if "eval_tau_adaptive" in entry]
    assert len(evaluated) == 1  # eval_steps=6 of 6 steps
    assert evaluated[0]["eval_tau_adaptive"] >= 1.0 and evaluated[0]["eval_tau_fixed"] >= 1.0
    checkpoints = sorted(
        (args.output_dir and __import__("pathlib").Path(args.output_dir)).glob("checkpoint-*")
    )
    assert [c.name for c in checkpoints] == ["checkpoint-3", "checkpoint-6"]
    assert (checkpoints[-1] / "model.safetensors").is_file()


class StopAt(TrainerCallback):
    """Stops a run at ``step`` with a checkpoint, as a time budget or a killed job leaves it."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = control.should_save = True
        return control


def test_a_resumed_run_continues_the_step_count_the_lr_schedule_and_the_learning_curve(
    target_factory, drafter_factory, trainer_args, tmp_path
):

    target = target_factory("llama")
    corpus(target, tmp_path, drafter_factory(target).config.target_layer_ids, name="heldout", per_domain=2)
    common = dict(
        max_steps=8,
        logging_steps=1,
        save_steps=4,
        warmup_ratio=0.25,
        eval_strategy="steps",
        eval_steps=2,
        domains=["chat", "math"],
        heldout_corpus_dir=str(tmp_path / "heldout"),
        heldout_features_dir=str(tmp_path / "heldout-features"),
    )

    def trainer(name, **kwargs):
        args = trainer_args(output_dir=str(tmp_path / name), **common)
        return DrafterTrainer(
            model=drafter_factory(target), args=args, target=target, train_dataset=_sequences(), **kwargs
        )

    straight = trainer("straight")
    straight.train()
    trainer("resumed", callbacks=[StopAt(4)]).train()
    curve_file = tmp_path / "resumed" / "learning_curve.json"
    before = json.loads(curve_file.read_text())["points"]
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-4"))

    assert resumed.state.global_step == 8
    learning_rates = [
        {e["step"]: e["learning_rate"] for e in t.state.log_history if "learning_rate" in e}
        for t in (straight, resumed)
    ]
    assert list(learning_rates[1]) == list(range(1, 9))
    assert learning_rates[1] == pytest.approx(learning_rates[0], rel=1e-12)  # no restart of warm-up or cosine
    points = json.loads(curve_file.read_text())["points"]
    assert [p["step"] for p in points] == [2, 4, 6, 8] and points[:2] == before  # appended, not restarted
    straight_points = json.loads((tmp_path / "straight" / "learning_curve.json").read_text())["points"]
    assert (
        [p["blocks_seen"] for p in points]
        == [p["blocks_seen"] for p in straight_points]
        == [48, 96, 144, 192]
    )


def test_a_run_resumed_from_a_weights_only_checkpoint_carries_on_the_step_weights_schedule_and_curve(
    target_factory, drafter_factory, trainer_args, tmp_path
):
    """A weights-only checkpoint (weights in bf16 and trainer_state.json, no optimizer or scheduler state)
    restored into a fresh output_dir: the run starts from its weights at its step, the LR follows the
    uninterrupted run's schedule after the ramp, and blocks seen and the curve carry on."""
    from safetensors.torch import load_file

    from adaflash_hf.trainers.weights_only_checkpoint import (
        carry_on_schedule,
        restore_weights_only,
        save_weights_only,
    )

    target = target_factory("llama")
    corpus(target, tmp_path, drafter_factory(target).config.target_layer_ids, name="heldout", per_domain=2)
    common = dict(
        max_steps=8,
        logging_steps=1,
        save_steps=4,
        warmup_ratio=0.25,
        eval_strategy="steps",
        eval_steps=2,
        domains=["chat", "math"],
        heldout_corpus_dir=str(tmp_path / "heldout"),
        heldout_features_dir=str(tmp_path / "heldout-features"),
        resume_rewarmup_steps=1,
    )

    def trainer(name, **kwargs):
        args = trainer_args(output_dir=str(tmp_path / name), **common)
        return DrafterTrainer(
            model=drafter_factory(target), args=args, target=target, train_dataset=_sequences(), **kwargs
        )

    straight = trainer("straight")
    straight.train()
    trainer("first", callbacks=[StopAt(4)]).train()
    assert (tmp_path / "first" / "checkpoint-4" / "optimizer.pt").is_file()
    point = save_weights_only(tmp_path / "first" / "checkpoint-4", tmp_path / "kept")
    assert (
        point.name == "checkpoint-4"
        and not list(point.glob("optimizer.*"))
        and not list(point.glob("scheduler.*"))
    )
    assert not list(point.glob("*.py"))  # no copy of the modeling code
    assert {v.dtype for k, v in load_file(point / "model.safetensors").items() if v.is_floating_point()} == {
        torch.bfloat16
    }
    assert (
        restore_weights_only(tmp_path / "kept", tmp_path / "second") == tmp_path / "second" / "checkpoint-4"
    )
    assert restore_weights_only(tmp_path / "kept", tmp_path / "second") is None  # already there: not again
    resumed = trainer("second")
    resumed.train(resume_from_checkpoint=str(tmp_path / "second" / "checkpoint-4"))

    assert resumed.state.global_step == 8
    rates = [
        {e["step"]: e["learning_rate"] for e in t.state.log_history if "learning_rate" in e}
        for t in (straight, resumed)
    ]
    assert list(rates[1]) == list(range(1, 9))  # steps 1-4: the log kept in the checkpoint's trainer state
    assert [rates[1][s] for s in (1, 2, 3, 4)] == pytest.approx(
        [rates[0][s] for s in (1, 2, 3, 4)], rel=1e-12
    )
    assert rates[1][5] == pytest.approx(rates[0][5] / 2, rel=1e-9)  # the ramp: half the schedule's value
    assert [rates[1][s] for s in (6, 7, 8)] == pytest.approx([rates[0][s] for s in (6, 7, 8)], rel=1e-9)
    points = json.loads((tmp_path / "second" / "learning_curve.json").read_text())["points"]
    straight_points = json.loads((tmp_path / "straight" / "learning_curve.json").read_text())["points"]
    assert [p["step"] for p in points] == [6, 8]
    assert [p["blocks_seen"] for p in points] == [p["blocks_seen"] for p in straight_points[2:]] == [144, 192]

    # The start was the kept checkpoint's weights (bf16-rounded), not the drafter the trainer was built with.
    started = trainer("check")
    started._load_from_checkpoint(str(point))
    saved = load_file(point / "model.safetensors")
    for name, value in started.model.state_dict().items():
        if name in saved and value.is_floating_point():
            torch.testing.assert_close(value, saved[name].to(value.dtype), atol=0, rtol=0)

    with pytest.raises(TypeError, match="lr_scheduler: expected a LambdaLR"):
        carry_on_schedule(object(), 4, 1)


def test_a_weights_only_checkpoint_needs_a_step_and_blocks_seen(
    tmp_path, target_factory, drafter_factory, trainer_args
):
    from adaflash_hf.trainers.weights_only_checkpoint import save_weights_only, weights_only_state

    drafter_factory(target_factory("llama")).save_pretrained(tmp_path / "drafter")
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        save_weights_only(tmp_path / "drafter", tmp_path / "point")
    with pytest.raises(ValueError, match="max_steps: expected an integer >= 1600, got 1000"):
        weights_only_state(1600, 345252, 1000, 10, 400, 2)
    with pytest.raises(ValueError, match="log_history: expected an entry with blocks_seen"):
        save_weights_only(
            tmp_path / "drafter", tmp_path / "point", state={"global_step": 3, "log_history": []}
        )
    assert not (tmp_path / "point").exists()
    state = weights_only_state(3, 48, 8, 1, 4, 2, eval_steps=500)
    written = save_weights_only(tmp_path / "drafter", tmp_path / "point", state=state)
    # A run carries on from the hand-written state through its next checkpoint saves (steps 4 and 8).
    target = target_factory("llama")
    args = trainer_args(
        output_dir=str(tmp_path / "run"), max_steps=8, logging_steps=1, save_steps=4, eval_steps=4
    )
    trainer = DrafterTrainer(
        model=drafter_factory(target), args=args, target=target, train_dataset=_sequences()
    )
    trainer.train(resume_from_checkpoint=str(written))
    assert trainer.state.global_step == 8
    assert (tmp_path / "run" / "checkpoint-8" / "trainer_state.json").is_file()
    assert [e["blocks_seen"] for e in trainer.state.log_history if "blocks_seen" in e][:2] == [48, 72]
    assert trainer.state.eval_steps == 4  # the config's, not the resumed state's 500
    assert json.loads((written / "trainer_state.json").read_text())["log_history"] == [
        {"step": 3, "blocks_seen": 48}
    ]


def test_weights_only_checkpoint_dir_holds_the_newest_checkpoint_after_every_save(
    tmp_path, target_factory, drafter_factory, trainer_args
):
    """A run with weights_only_checkpoint_dir leaves its newest checkpoint there at each save (a run killed after
    step 4 leaves step 4), and a run restored from that copy alone carries on at its step."""
    from safetensors.torch import load_file

    from adaflash_hf.trainers.weights_only_checkpoint import complete_checkpoints, restore_weights_only

    target = target_factory("llama")
    point_dir = tmp_path / "repo" / "resume"
    common = dict(max_steps=8, logging_steps=1, save_steps=4, weights_only_checkpoint_dir=str(point_dir))
    args = trainer_args(output_dir=str(tmp_path / "run"), **common)
    killed = DrafterTrainer(
        model=drafter_factory(target),
        args=args,
        target=target,
        train_dataset=_sequences(),
        callbacks=[StopAt(4)],
    )
    killed.train()
    assert list(complete_checkpoints(point_dir)) == [4]
    saved = load_file(point_dir / "checkpoint-4" / "model.safetensors")
    for name, value in killed.model.state_dict().items():
        if name in saved and value.is_floating_point():
            assert saved[name].dtype == torch.bfloat16
            torch.testing.assert_close(saved[name], value.to(torch.bfloat16), atol=0, rtol=0)

    restore_weights_only(point_dir, tmp_path / "fresh")
    resumed = DrafterTrainer(
        model=drafter_factory(target),
        args=trainer_args(output_dir=str(tmp_path / "fresh"), **common),
        target=target,
        train_dataset=_sequences(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "fresh" / "checkpoint-4"))
    assert resumed.state.global_step == 8
    assert list(complete_checkpoints(point_dir)) == [8]  # replaced whole: one point, the newest


def test_recorded_corpus_features_equal_the_on_the_fly_ones_and_nothing_is_cached(
    target_factory, drafter_factory, tmp_path
):
    from adaflash_hf.trainers.corpus_format import save_features
    from adaflash_hf.trainers.target_features import SequenceCollator, TargetFeatures

    target = target_factory("qwen3")
    layer_ids = drafter_factory(target).config.target_layer_ids
    records = [{"id": str(i), "domain": "math", **row} for i, row in enumerate(_sequences(n=3))]
    batch = SequenceCollator(0, 64)(records)
    on_the_fly, _ = TargetFeatures(target, layer_ids)(batch["input_ids"], batch["attention_mask"])
    hidden = target(batch["input_ids"][:1], output_hidden_states=True).hidden_states
    recorded = torch.stack([hidden[i + 1][0, :-1] for i in layer_ids], dim=1).to(torch.bfloat16)
    save_features(tmp_path / "features", records[0], recorded, layer_ids)  # only the first record has a file
    files = sorted((tmp_path / "features").rglob("*"))
    mixed, _ = TargetFeatures(target, layer_ids, tmp_path / "features")(
        batch["input_ids"], batch["attention_mask"], batch["records"]
    )
    assert sorted((tmp_path / "features").rglob("*")) == files  # the missing two were not written anywhere
    torch.testing.assert_close(mixed[1:], on_the_fly[1:], atol=0, rtol=0)
    torch.testing.assert_close(mixed[0, :47], on_the_fly[0, :47], atol=2e-2, rtol=2e-2)  # bf16 on disk
    assert torch.all(mixed[0, 47:] == 0)  # no anchor's context reaches the last token


def test_script_trains_under_accelerate_launch_with_two_processes(target_factory, drafter_factory, tmp_path):
    """DDP on CPU: two processes, the real script, a tiny target folder and a corpus of token ids."""
    tiny_script_inputs(target_factory("llama"), tmp_path)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(Path(__file__).resolve().parents[1] / "trainers" / "train_drafter.py"),
        "--target_model", str(tmp_path / "target"), "--corpus_dir", str(tmp_path / "corpus"),
        "--domains", "math",
        "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--num_anchors", "4", "--drafter_layers", "1", "--mask_token_id", "3", "--eval_prompts_per_domain", "0",
        "--save_steps", "3", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and any("ce" in entry for entry in state["log_history"])


def test_split_layout_gives_the_dense_loss_and_gradients(target_factory, drafter_factory):
    from types import SimpleNamespace

    from adaflash_hf.trainers.dflash_recipe import recipe_loss

    target = target_factory("qwen3", dtype=torch.float64).requires_grad_(False)
    drafter = drafter_factory(target).train()
    input_ids, loss_mask = toy_batch()
    anchors = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(5))
    features = torch.randn(*input_ids.shape, drafter.fc.in_features, dtype=torch.float64)
    results = {}
    for layout in ("dense", "split"):
        args = SimpleNamespace(loss_decay_gamma=7.0, length_head_loss_weight=1.0, attention_layout=layout)
        drafter.zero_grad()
        loss, _, metrics = recipe_loss(
            drafter,
            drafter.config,
            args,
            input_ids,
            loss_mask,
            features,
            anchors,
            target.get_input_embeddings().weight,
            target.get_output_embeddings().weight,
        )
        loss.backward()
        results[layout] = (loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters()})
    (dense_loss, dense_metrics, dense_grads), (split_loss, split_metrics, split_grads) = results.values()
    torch.testing.assert_close(split_loss, dense_loss, atol=1e-10, rtol=0)
    assert split_metrics["accept_len"] == dense_metrics["accept_len"]
    for name, grad in dense_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-10, rtol=0, msg=name)


def test_only_the_dense_layout_builds_the_dense_mask():
    input_ids, loss_mask = toy_batch()
    anchors = torch.tensor([[20], [15]])
    assert (
        build_blocks(input_ids, loss_mask, anchors, BLOCK, 511, 7.0, dense_mask=False).attention_mask is None
    )


def test_draft_vocab_ce_ignores_labels_outside_it_and_counts_them_as_wrong_drafts():
    vocab = 40
    input_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[
        None, :30
    ]  # distinct tokens
    loss_mask = torch.ones_like(input_ids)
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([[3]]), BLOCK, vocab - 1, 7.0, dense_mask=False)
    lm_head = torch.eye(vocab)
    labels = blocks.labels[0]
    # An oracle drafter: every supervised row's state points at its label.
    hidden = (10.0 * torch.nn.functional.one_hot(labels.clamp(min=0), vocab).float())[None].requires_grad_()
    missing = int(labels[5])  # row 5's label is left out of the draft vocabulary
    draft_ids = torch.tensor([t for t in range(vocab) if t != missing])
    acceptance = torch.zeros(1, 1)

    _, _, full = block_ce_and_head_loss(hidden, acceptance, lm_head, blocks, BLOCK)
    assert full["accuracy"] == 1.0 and full["accept_len"] == BLOCK - 1
    ce, _, metrics = block_ce_and_head_loss(hidden, acceptance, lm_head, blocks, BLOCK, draft_ids)
    assert metrics["accept_len"] == 4  # rows 1..4 accepted, row 5 can never be drafted
    assert metrics["accuracy"] == pytest.approx(14 / 15) == metrics["draft_vocab_coverage"]

    kept = [j for j in range(1, BLOCK) if j != 5]
    logits = hidden[0, kept] @ lm_head[draft_ids].T
    targets = torch.searchsorted(draft_ids, labels[kept])
    weights = blocks.weights[0, kept]
    rows_ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(ce, (rows_ce * weights).sum() / weights.sum())
    ce.backward()
    assert torch.count_nonzero(hidden.grad[0, 5]) == 0  # no CE term for the out-of-vocabulary label


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_loss_positions_limits_the_ce_and_keeps_the_realised_acceptance_exact(draft_vocab):
    vocab, positions = 64, 4
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab - 1, (2, 50), generator=gen)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :5] = 0
    anchors = torch.tensor([[5, 20, 44], [8, 30, -1]])  # 44: runs past the end
    blocks = build_blocks(input_ids, loss_mask, anchors, BLOCK, vocab - 1, 2.0, dense_mask=False)
    labels = blocks.labels
    lm_head = torch.eye(vocab)
    # States whose argmax is the label on a chosen prefix of each block, random elsewhere: block (0, 0) is right on
    # every row (so its late rows decide its acceptance), (0, 1) on rows 1..positions only, (1, 0) on rows 1..2.
    hidden = torch.randn(2, labels.shape[1], vocab, generator=gen)
    right = {(0, 0): range(1, BLOCK), (0, 1): range(1, positions + 1), (1, 0): range(1, 3)}
    for (b, n), rows in right.items():
        for j in rows:
            hidden[b, n * BLOCK + j] = 10.0 * torch.nn.functional.one_hot(labels[b, n * BLOCK + j], vocab)
    hidden.requires_grad_()
    acceptance = torch.full((2, 3), 0.3)
    draft_ids = torch.arange(0, vocab, 2).unique() if draft_vocab else None
    if draft_ids is not None:  # keep the labels of the right rows in the draft vocabulary
        draft_ids = torch.cat(
            [draft_ids, labels[0, : 2 * BLOCK].clamp(min=0), labels[1, :BLOCK].clamp(min=0)]
        )
        draft_ids = draft_ids.unique()

    full_ce, full_head, full = block_ce_and_head_loss(hidden, acceptance, lm_head, blocks, BLOCK, draft_ids)
    ce, head, limited = block_ce_and_head_loss(
        hidden, acceptance, lm_head, blocks, BLOCK, draft_ids, loss_positions=positions
    )
    assert limited["accept_len"] == full["accept_len"]
    torch.testing.assert_close(head, full_head)
    assert (
        full["accept_len"] > (15 + positions + 2) / 5 - 1e-4
    )  # block (0, 0)'s acceptance came from its late rows

    # The CE is the full recipe's with the weights of rows after `positions` set to zero.
    trimmed = BlockBatch(**{**blocks.__dict__})
    offset = torch.arange(labels.shape[1]) % BLOCK
    trimmed.weights = blocks.weights * (offset <= positions)
    trimmed.labels = torch.where(offset <= positions, labels, torch.full_like(labels, IGNORE))
    expected, _, _ = block_ce_and_head_loss(hidden, acceptance, lm_head, trimmed, BLOCK, draft_ids)
    torch.testing.assert_close(ce, expected)
    ce.backward()
    late_rows = hidden.grad[:, offset > positions]
    assert torch.count_nonzero(late_rows) == 0 and torch.count_nonzero(hidden.grad[:, offset == 1]) > 0


def test_loss_positions_is_validated():
    with pytest.raises(
        ValueError, match=r"loss_positions: expected None or 1..block_size - 1 \(15\), got 16"
    ):
        DrafterTrainingConfig(output_dir="unused", use_cpu=True, report_to="none", loss_positions=16)


def test_draft_vocab_size_must_match_the_drafters_draft_vocabulary():
    from adaflash_hf.trainers.train_drafter_trainer import check_draft_vocab

    check_draft_vocab(None, None)
    check_draft_vocab(torch.tensor([1, 5, 9]), None)  # None: whatever the drafter drafts
    check_draft_vocab(torch.tensor([1, 5, 9]), 3)
    with pytest.raises(
        ValueError, match=r"draft_vocab_size: expected the drafter's draft vocabulary \(3\), got 4"
    ):
        check_draft_vocab(torch.tensor([1, 5, 9]), 4)
    with pytest.raises(ValueError, match="the full vocabulary, no draft_token_ids"):
        check_draft_vocab(None, 8)


def test_config_refuses_an_unknown_attention_layout(tmp_path):
    with pytest.raises(ValueError, match="attention_layout: expected 'split' or 'dense', got 'flash'"):
        DrafterTrainingConfig(
            output_dir=str(tmp_path), attention_layout="flash", use_cpu=True, report_to="none"
        )


def test_bf16_autocast_training_on_cpu_lowers_the_loss_and_keeps_float32_weights(
    target_factory, drafter_factory, trainer_args
):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    activation_dtypes = set()
    drafter.layers[0].mlp.register_forward_hook(lambda m, i, out: activation_dtypes.add(out.dtype))
    args = trainer_args(bf16=True, max_steps=8, save_strategy="no")
    trainer = DrafterTrainer(model=drafter, args=args, target=target, train_dataset=_sequences())
    trainer.train()
    assert activation_dtypes == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    logged = [entry for entry in trainer.state.log_history if "ce" in entry]
    assert logged[-1]["ce"] < logged[0]["ce"]


def test_anchor_slots_no_row_can_fill_are_dropped():
    input_ids, loss_mask = toy_batch(seq=40, prompt=30)  # 10 candidate anchors in row 0, 3 in row 1 (padded)
    anchors = sample_anchors(loss_mask, 24, torch.Generator().manual_seed(6))
    assert anchors.shape == (2, 10)
    assert int((anchors[1] >= 0).sum()) == 3 and torch.all(anchors[1, 3:] == -1)
    nothing_to_learn = sample_anchors(torch.zeros(2, 40, dtype=torch.long), 24)
    assert nothing_to_learn.shape == (2, 1) and torch.all(nothing_to_learn == -1)


@pytest.mark.parametrize("init", ["inverse_row_norm", "target"])
def test_a_fresh_drafters_final_norm_starts_where_the_config_says(target_factory, tmp_path, init):
    from adaflash_hf.trainers.drafter_setup import build_drafter

    target = target_factory("llama")
    with torch.no_grad():
        target.model.norm.weight.uniform_(1.5, 2.0)
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path), final_norm_init=init, mask_token_id=3, report_to="none"
    )
    drafter = build_drafter(args, target)
    if init == "target":
        assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    else:
        row_norm = target.get_output_embeddings().weight.norm(dim=-1).mean()
        assert torch.allclose(drafter.norm.weight, torch.full_like(drafter.norm.weight, float(1 / row_norm)))


def test_the_example_training_config_parses_and_writes_under_runs(monkeypatch):
    """The example recipe parses as the script parses it (TrlParser, --config)."""
    from adaflash_hf.trainers.train_drafter import make_parser

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    config = root / "examples" / "configs" / "train_smollm2.yaml"
    (args,) = make_parser().parse_args_and_config(["--config", str(config)])
    assert args.drafter_layers == 1 and args.draft_vocab_size == 8192 and args.num_anchors == 512
    assert (
        args.output_dir.startswith("runs/") and args.learning_curve_dir is None
    )  # nothing over committed files


def test_offline_and_online_training_declare_the_drafter_arguments_once():
    """DrafterTrainingConfig and OPD's script arguments inherit the target/drafter fields from DrafterArguments."""
    import dataclasses

    from adaflash_hf.trainers.drafter_setup import DrafterArguments
    from adaflash_hf.trainers.opd import OPDScriptArguments

    shared = {f.name: f.default for f in dataclasses.fields(DrafterArguments)}
    for cls in (DrafterTrainingConfig, OPDScriptArguments):
        assert issubclass(cls, DrafterArguments)
        assert {f.name: f.default for f in dataclasses.fields(cls) if f.name in shared} == shared
        assert not any(name in vars(cls)["__annotations__"] for name in shared), cls.__name__


def test_a_time_budget_stops_with_a_log_line_a_checkpoint_and_a_curve_point(
    target_factory, drafter_factory, trainer_args, tmp_path
):

    target = target_factory("llama")
    corpus(target, tmp_path, drafter_factory(target).config.target_layer_ids, name="heldout", per_domain=2)
    args = trainer_args(
        max_train_seconds=1e-9,  # spent after the first step
        logging_steps=5,
        domains=["chat", "math"],
        heldout_corpus_dir=str(tmp_path / "heldout"),
        heldout_features_dir=str(tmp_path / "heldout-features"),
    )
    trainer = DrafterTrainer(
        model=drafter_factory(target), args=args, target=target, train_dataset=_sequences()
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert [c.name for c in Path(args.output_dir).glob("checkpoint-*")] == ["checkpoint-1"]
    assert trainer.state.log_history[0]["blocks_seen"] == trainer.blocks_seen  # exact on resume
    points = json.loads((Path(args.output_dir) / "learning_curve.json").read_text())["points"]
    assert [p["step"] for p in points] == [1]


def test_max_train_seconds_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_train_seconds: expected None or > 0, got 0"):
        DrafterTrainingConfig(output_dir=str(tmp_path), max_train_seconds=0, report_to="none")


@pytest.mark.parametrize("script", ["train_drafter", "opd"])
def test_the_trainer_scripts_help_lists_config(script):
    import importlib

    module = importlib.import_module(f"adaflash_hf.trainers.{script}")
    text = module.make_parser().format_help()
    assert "--config FILE" in text and "YAML file of this command's options" in text
    (parsed, *rest) = module.make_parser().parse_args_and_config(
        []
    )  # the option never reaches the dataclasses
    assert not hasattr(parsed, "config")


@pytest.mark.parametrize("script", ["train_drafter", "opd"])
def test_a_yaml_syntax_error_in_the_scripts_config_is_one_line_naming_the_file_line_and_column(
    script, tmp_path
):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\noutput_dir: [runs/x\n")
    result = subprocess.run(
        [sys.executable, "-m", f"adaflash_hf.trainers.{script}", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"{script}.py: error: --config {config}: expected valid YAML, got expected ',' or ']', but got "
        "'<stream end>' at line 3, column 1"
    )
    assert "Traceback" not in result.stderr


def test_a_fresh_drafter_without_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"drafter_layers: expected >= 1, got 0"):
        DrafterTrainingConfig(output_dir=str(tmp_path), drafter_layers=0, report_to="none")


@pytest.mark.parametrize("max_steps", [-3, 0])
def test_max_steps_other_than_minus_one_must_be_positive(tmp_path, max_steps):
    with pytest.raises(
        ValueError, match=rf"max_steps: expected >= 1, or -1 to train by num_train_epochs, got {max_steps}"
    ):
        DrafterTrainingConfig(output_dir=str(tmp_path), max_steps=max_steps, report_to="none")


def test_an_output_dir_holding_another_run_is_refused_before_anything_loads(tmp_path):
    from adaflash_hf.trainers.train_drafter import main

    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"")
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path), corpus_dir=str(tmp_path / "corpus"), report_to="none"
    )
    with pytest.raises(
        FileExistsError,
        match=rf"output_dir: expected a new or empty folder, got {tmp_path}, which holds checkpoint-4, "
        r"model.safetensors; pass --resume_from_checkpoint last",
    ):
        main(args)


@pytest.mark.parametrize(
    "option",
    [{"resume_from_checkpoint": "last"}, {"overwrite_output_dir": True}],
    ids=["resume", "overwrite"],
)
def test_resuming_or_overwriting_may_use_an_output_dir_that_holds_a_run(tmp_path, option):
    from adaflash_hf.trainers.train_drafter import main

    (tmp_path / "model.safetensors").write_bytes(b"")
    args = DrafterTrainingConfig(output_dir=str(tmp_path), report_to="none", **option)
    with pytest.raises(ValueError, match="corpus_dir: expected a corpus"):  # past the output_dir check
        main(args)


def test_a_missing_target_model_folder_is_named_with_its_field(tmp_path):
    from adaflash_hf.assets import load_target

    missing = str(tmp_path / "no-model")
    with pytest.raises(
        FileNotFoundError, match=rf"target_model: expected an existing model folder.*got '{missing}'"
    ):
        load_target(missing, option="target_model")


def test_an_output_dir_inside_a_file_is_refused_naming_the_field_and_the_file(tmp_path):
    from adaflash_hf.trainers.train_drafter import main

    (tmp_path / "file").write_text("x")
    args = DrafterTrainingConfig(output_dir=str(tmp_path / "file" / "run"), report_to="none")
    with pytest.raises(
        FileExistsError,
        match=rf"output_dir: expected a folder to write, got .*run, inside the file {tmp_path / 'file'}",
    ):
        main(args)


@pytest.mark.parametrize("script", ["train_drafter", "opd"])
def test_a_misspelt_key_in_the_scripts_config_is_refused_naming_the_nearest_option(script, tmp_path):
    import importlib

    from adaflash_hf.trainers.drafter_setup import parse_script_args

    config = tmp_path / "run.yaml"
    config.write_text("learning_ratee: 0.1\n")
    parser = importlib.import_module(f"adaflash_hf.trainers.{script}").make_parser()
    with pytest.raises(ValueError, match=r"got 'learning_ratee' \(did you mean 'learning_rate'\?\)"):
        parse_script_args(parser, ["--config", str(config)])


def test_the_script_needs_a_corpus_and_says_how_to_build_one(tmp_path):
    from adaflash_hf.trainers.train_drafter import main

    args = DrafterTrainingConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(
        ValueError, match=r"corpus_dir: expected a corpus written by `adaflash corpus --out-dir DIR`"
    ):
        main(args)


def test_a_missing_resume_folder_is_refused_before_the_corpus_or_the_target_loads(tmp_path):
    from adaflash_hf.trainers.train_drafter import main

    missing = str(tmp_path / "checkpoint-7")
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path),
        corpus_dir=str(tmp_path / "no-corpus"),
        resume_from_checkpoint=missing,
        report_to="none",
    )
    with pytest.raises(
        FileNotFoundError,
        match=rf"resume_from_checkpoint: expected 'last' or an existing checkpoint folder, got '{missing}'",
    ):
        main(args)


def _write_corpus(folder: Path, per_domain: int, offset: int) -> None:
    """A corpus of every domain, as `adaflash corpus` writes it, whose prompts use token ids of their own:
    ``offset + 100 * d`` onwards for the d-th of chat, code, math."""
    folder.mkdir()
    for d, domain in enumerate(("chat", "code", "math")):
        with gzip.open(folder / f"{domain}.jsonl.gz", "wt") as handle:
            for i in range(per_domain):
                prompt = [offset + 100 * d + i, offset + 100 * d + 50 + i, 4]
                row = {"id": f"{domain}/{i}", "domain": domain, "input_ids": prompt + [5, 6, 7] * 6}
                handle.write(json.dumps({**row, "prompt_length": 3}) + "\n")


def test_a_domain_left_out_of_training_is_in_no_training_sequence_and_still_evaluated(
    target_factory, tmp_path, monkeypatch
):
    from adaflash_hf.trainers import train_drafter

    tiny_script_inputs(target_factory("llama"), tmp_path / "script")
    _write_corpus(tmp_path / "corpus", per_domain=4, offset=10)
    _write_corpus(tmp_path / "heldout", per_domain=2, offset=30)
    trainers = []

    class Recorded(DrafterTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(train_drafter, "DrafterTrainer", Recorded)
    args = DrafterTrainingConfig(
        target_model=str(tmp_path / "script" / "target"), corpus_dir=str(tmp_path / "corpus"),
        domains=["chat", "math"], heldout_domains=["chat", "code", "math"],
        heldout_corpus_dir=str(tmp_path / "heldout"), drop_heldout_twins=False, eval_prompts_per_domain=0,
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, num_anchors=4,
        drafter_layers=1, mask_token_id=3, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    train_drafter.main(args)

    (trainer,) = trainers
    train = trainer.train_dataset
    assert sorted(set(train["domain"])) == ["chat", "math"] and len(train) == 8
    code_tokens = set(range(110, 200))  # the code prompts' token range
    assert not any(code_tokens & set(ids) for ids in train["input_ids"])
    assert sorted({r["domain"] for r in trainer.heldout_records}) == ["chat", "code", "math"]
    point = json.loads((tmp_path / "out" / "learning_curve.json").read_text())["points"][-1]
    assert {"chat", "code", "math"} <= set(point["metrics"])


def test_held_out_domains_default_to_the_training_domains(tmp_path):
    args = DrafterTrainingConfig(output_dir=str(tmp_path), domains=["chat", "math"], report_to="none")
    assert args.heldout_domains == ["chat", "math"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("domains", []), ("domains", ["chat", "poetry"]), ("heldout_domains", ["code", "code"])],
)
def test_training_and_held_out_domains_must_be_known_and_not_empty(tmp_path, field, value):
    with pytest.raises(
        ValueError, match=rf"{field}: expected distinct domains among \['chat', 'code', 'math'\], "
    ):
        DrafterTrainingConfig(output_dir=str(tmp_path), report_to="none", **{field: value})


# ----------------------------------------------------------------------------------------------- soft targets
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


# ----------------------------------------------------------------------------------------------------- resume
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
