"""OPDTrainer: the loss on the drafter's own serving blocks, the detached length head, the two optimizer groups,
per-group clipping and the non-finite guard."""

import copy

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, TrainerCallback

from adaflash_hf.kernels.clipped_kl import clipped_distill_loss_reference, fused_clipped_distill_loss
from adaflash_hf.online.buffer import EngineRecorder, ReplayBuffer, TrajectoryDataset
from adaflash_hf.serving import AdaFlashEngine, SamplingParams
from adaflash_hf.trainers.dflash_recipe import IGNORE, build_blocks
from adaflash_hf.trainers.opd_config import OPDConfig
from adaflash_hf.trainers.opd_trainer import OPDTrainer, TrajectoryCollator


def tiny_tokenizer(vocab_size=512):
    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t1"
    )


def served_trajectories(target, drafter, n=4, max_new_tokens=24, seed=0):
    """Greedy trajectories from the batched engine, exactly as the online loop records them."""
    buffer = ReplayBuffer(train_threshold=n)
    engine = AdaFlashEngine(target, copy.deepcopy(drafter), length_mode="fixed")
    engine.round_recorder = EngineRecorder(buffer)
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 500, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g) for _ in range(n)
    ]
    engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return buffer.take(current_version=0)


def make_trainer(target, drafter, tmp_path, trajectories=None, **overrides):
    values = dict(output_dir=str(tmp_path / "opd"), use_cpu=True, disable_tqdm=True, seed=0)
    values.update(overrides)
    args = OPDConfig(**values)
    dataset = TrajectoryDataset(trajectories) if trajectories is not None else None
    trainer = OPDTrainer(drafter, target, args, train_dataset=dataset, processing_class=tiny_tokenizer())
    trainer.model.train()  # metrics land in the "train" bucket, as inside train()
    return trainer


@pytest.fixture
def setup(target_factory, drafter_factory, tmp_path):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    return target, drafter, served_trajectories(target, drafter)


def test_defaults_are_the_papers_and_cpu_safe(tmp_path):
    args = OPDConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (args.alpha, args.delta, args.clip_mode) == (0.8, 0.01, "entry")
    assert (args.learning_rate, args.length_head_learning_rate) == (3e-4, 2e-4)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_train_epochs) == (
        1,
        2,
        2,
    )
    assert (args.bf16, args.gradient_checkpointing) == (False, False)
    assert args.lr_scheduler_type == "constant"


@pytest.mark.parametrize(
    "field,value",
    [("alpha", 1.5), ("delta", 0.0), ("clip_mode", "token"), ("max_nonfinite_steps", 0), ("max_steps", -3)],
)
def test_bad_settings_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        OPDConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


def test_seed_worked_example_with_the_trainers_alpha(tmp_path):
    # q=(0.55,0.2,0.2,0.05), p=(0.6,0.2,0.05,0.15): hard 0.598, unclipped reverse KL 0.174, mixed 0.5132 (α=0.8).
    args = OPDConfig(output_dir=str(tmp_path), use_cpu=True)
    q = torch.tensor([[0.55, 0.2, 0.2, 0.05]], dtype=torch.float64)
    p = torch.tensor([[0.6, 0.2, 0.05, 0.15]], dtype=torch.float64)
    eye = torch.eye(4, dtype=torch.float64)
    unclipped = fused_clipped_distill_loss(q.log(), eye, p.log(), alpha=args.alpha, delta=1.0)
    assert round(unclipped.ce.item(), 3) == 0.598
    assert round(unclipped.rkl_raw.item(), 3) == 0.174
    assert round(unclipped.loss.item(), 4) == 0.5132
    # The default δ=0.01 clips every entry above it: 0.2·log(0.2/0.05)=0.277 and 0.55·log(0.55/0.6)<0 stays.
    clipped = fused_clipped_distill_loss(q.log(), eye, p.log(), alpha=args.alpha, delta=args.delta)
    entries = q * (q / p).log()
    assert clipped.rkl_clipped.item() == pytest.approx(entries.clamp(max=0.01).sum().item(), abs=1e-12)
    assert clipped.loss.item() < unclipped.loss.item() and clipped.rkl_raw.item() == unclipped.rkl_raw.item()


def _reference_loss(trainer, batch, token_ids=None):
    """The loss re-derived densely: row j of the block at anchor a against the target's logits at a + j - 1; with
    ``token_ids`` both distributions over those vocabulary columns only."""
    drafter, target, args = trainer.drafter, trainer.teacher_model, trainer.args
    config = drafter.config
    seq = batch["input_ids"].shape[1]
    blocks = build_blocks(
        batch["input_ids"], batch["loss_mask"], batch["anchors"], config.block_size, config.mask_token_id, 7.0
    )
    with torch.no_grad():
        out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in config.target_layer_ids], -1)
    states = drafter(
        noise_embeds=torch.nn.functional.embedding(blocks.noise_ids, target.get_input_embeddings().weight),
        context_hidden_states=features,
        position_ids=blocks.position_ids,
        attention_mask=blocks.attention_mask,
    ).last_hidden_state
    rows = blocks.labels != IGNORE
    b, q = rows.nonzero(as_tuple=True)
    source = blocks.position_ids[:, seq:][b, q] - 1
    weights = blocks.weights[rows] if args.loss_decay_gamma else torch.ones(int(rows.sum()))
    columns = slice(None) if token_ids is None else token_ids
    return clipped_distill_loss_reference(
        states[rows].double(),
        target.get_output_embeddings().weight[columns].double(),
        out.logits[b, source][:, columns].double(),
        alpha=args.alpha,
        delta=args.delta,
        row_weights=weights.double(),
        clip_mode=args.clip_mode,
    )


@pytest.mark.parametrize("clip_mode,decay", [("entry", None), ("row", 7.0), ("entry", 7.0)])
def test_loss_on_serving_blocks_matches_a_dense_reference(setup, tmp_path, clip_mode, decay):
    target, drafter, trajectories = setup
    trainer = make_trainer(
        target, drafter, tmp_path, clip_mode=clip_mode, loss_decay_gamma=decay, delta=0.001
    )
    batch = trainer.data_collator(trajectories[:2])
    loss = trainer.compute_loss(trainer.model, batch)
    head_mse = trainer._metrics["train"]["head_mse"][-1]
    reference = _reference_loss(trainer, batch)
    assert loss.item() - head_mse == pytest.approx(reference.loss.item(), rel=1e-4, abs=1e-6)
    assert trainer._metrics["train"]["rkl_raw"][-1] == pytest.approx(reference.rkl_raw.item(), rel=1e-4)
    assert trainer._metrics["train"]["clip_ratio"][-1] == pytest.approx(reference.clip_ratio.item(), abs=1e-6)


def test_loss_with_a_draft_vocabulary_is_the_dense_loss_over_that_subset(
    target_factory, drafter_factory, tmp_path
):
    target = target_factory("llama")
    subset = list(range(0, 512, 4))
    drafter = drafter_factory(target, draft_token_ids=subset)
    trajectories = served_trajectories(target, drafter, n=2)
    trainer = make_trainer(target, drafter, tmp_path, delta=0.001)
    batch = trainer.data_collator(trajectories)
    loss = trainer.compute_loss(trainer.model, batch)
    head_mse = trainer._metrics["train"]["head_mse"][-1]
    reference = _reference_loss(trainer, batch, torch.tensor(subset))
    assert loss.item() - head_mse == pytest.approx(reference.loss.item(), rel=1e-4, abs=1e-6)
    assert trainer._metrics["train"]["rkl_raw"][-1] == pytest.approx(reference.rkl_raw.item(), rel=1e-4)


def test_target_top1_at_the_preceding_position_is_the_committed_token_under_greedy_serving(setup):
    target, _, trajectories = setup
    batch = TrajectoryCollator(0, 2048, 512)(trajectories)
    with torch.no_grad():
        logits = target(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for row, trajectory in enumerate(trajectories):
        start, end = len(trajectory.prompt), len(trajectory.input_ids)
        assert torch.equal(logits[row, start - 1 : end - 1].argmax(-1), batch["input_ids"][row, start:end])


def test_collator_keeps_serving_anchors_and_caps_them(setup):
    _, _, trajectories = setup
    batch = TrajectoryCollator(0, 2048, 3, seed=0)(trajectories)
    for row, trajectory in enumerate(trajectories):
        kept = batch["anchors"][row][batch["anchors"][row] >= 0].tolist()
        assert len(kept) == min(3, len(trajectory.anchors)) and set(kept) <= set(trajectory.anchors)
        assert kept == sorted(kept)
        assert batch["loss_mask"][row, : len(trajectory.prompt)].sum() == 0


def _grads(trainer, batch):
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    head = set(trainer.drafter.length_head_parameter_names())
    named = dict(trainer.model.named_parameters())
    drafter = {n: p.grad.clone() for n, p in named.items() if n not in head and p.grad is not None}
    heads = {n: p.grad.clone() for n, p in named.items() if n in head}
    return drafter, heads


def test_length_head_loss_leaves_drafter_gradients_unchanged(setup, tmp_path):
    target, drafter, trajectories = setup
    with_head = make_trainer(target, copy.deepcopy(drafter), tmp_path, length_head_loss_weight=1.0)
    without = make_trainer(target, copy.deepcopy(drafter), tmp_path, length_head_loss_weight=0.0)
    batch = with_head.data_collator(trajectories[:2])
    drafter_a, head_a = _grads(with_head, batch)
    drafter_b, head_b = _grads(without, batch)
    assert drafter_a.keys() == drafter_b.keys() and drafter_a
    for name in drafter_a:
        assert torch.equal(drafter_a[name], drafter_b[name]), name
    assert any(g.abs().sum() > 0 for g in head_a.values())
    assert all(g is None or g.abs().sum() == 0 for g in head_b.values())


def test_clipping_is_per_group_so_a_huge_head_loss_never_shrinks_the_drafter_update(setup, tmp_path):
    target, drafter, trajectories = setup
    clipped = []
    for weight in (1.0, 1e6):
        trainer = make_trainer(target, copy.deepcopy(drafter), tmp_path, length_head_loss_weight=weight)
        batch = trainer.data_collator(trajectories[:2])
        _grads(trainer, batch)
        norm = trainer._clip_grad_norm(trainer.model)
        assert torch.isfinite(norm)
        head = set(trainer.drafter.length_head_parameter_names())
        clipped.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if n not in head})
        head_norm = torch.cat(
            [p.grad.flatten() for n, p in trainer.model.named_parameters() if n in head]
        ).norm()
        assert head_norm <= trainer.args.max_grad_norm * (1 + 1e-5)
    for name in clipped[0]:
        assert torch.allclose(clipped[0][name], clipped[1][name]), name


def test_two_adamw_groups_with_their_learning_rates(setup, tmp_path):
    target, drafter, _ = setup
    trainer = make_trainer(target, drafter, tmp_path)
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.AdamW)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert (groups["drafter"]["lr"], groups["length_head"]["lr"]) == (3e-4, 2e-4)
    head = {id(p) for n, p in drafter.named_parameters() if n in set(drafter.length_head_parameter_names())}
    assert {id(p) for p in groups["length_head"]["params"]} == head
    assert len(groups["drafter"]["params"]) + len(head) == len(list(drafter.parameters()))


class PoisonedTrainer(OPDTrainer):
    """Makes the loss of chosen micro-batches (counted from 0) NaN."""

    poisoned: set = set()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.calls = getattr(self, "calls", -1) + 1
        return loss * float("nan") if self.calls in self.poisoned else loss


def _poisoned(target, drafter, trajectories, tmp_path, poisoned, **overrides):
    args = OPDConfig(
        output_dir=str(tmp_path / "p"),
        use_cpu=True,
        disable_tqdm=True,
        gradient_accumulation_steps=1,
        **overrides,
    )
    trainer = PoisonedTrainer(
        drafter,
        target,
        args,
        train_dataset=TrajectoryDataset(trajectories),
        processing_class=tiny_tokenizer(),
    )
    trainer.poisoned = poisoned
    return trainer


def test_non_finite_step_leaves_parameters_and_optimizer_state_unchanged(setup, tmp_path):
    target, drafter, trajectories = setup
    snapshots = {}

    class Snapshot(TrainerCallback):
        """Parameters and AdamW state after each optimizer step."""

        def on_step_end(self, args, state, control, **kwargs):
            optimizer_state = {
                id(p): {k: v.clone() for k, v in s.items()}
                for p, s in trainer.optimizer.optimizer.state.items()
            }
            params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            snapshots[state.global_step] = (params, optimizer_state)

    trainer = _poisoned(target, drafter, trajectories[:3], tmp_path, {1}, num_train_epochs=1)
    trainer.add_callback(Snapshot())
    trainer.train()
    (params_1, state_1), (params_2, state_2), (params_3, _) = snapshots[1], snapshots[2], snapshots[3]
    assert trainer.skipped_steps == 1 and not trainer.diverged
    for name in params_1:
        assert torch.equal(params_1[name], params_2[name]), name  # the NaN step changed nothing
    for key in state_1:
        for field, value in state_1[key].items():
            assert torch.equal(value, state_2[key][field])
    assert any(not torch.equal(params_2[n], params_3[n]) for n in params_2)  # and training went on
    assert all(torch.isfinite(p).all() for p in params_3.values())


def test_a_run_of_non_finite_steps_stops_training(setup, tmp_path):
    target, drafter, trajectories = setup
    trainer = _poisoned(target, drafter, trajectories, tmp_path, set(range(100)), max_nonfinite_steps=3)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    trainer.train()
    assert trainer.diverged and trainer.skipped_steps == 3 and trainer.state.global_step == 3
    assert all(torch.equal(before[n], p) for n, p in drafter.named_parameters())


def test_non_finite_gradient_alone_is_skipped(setup, tmp_path):
    target, drafter, trajectories = setup
    trainer = _poisoned(target, drafter, trajectories[:1], tmp_path, set(), num_train_epochs=1)
    drafter.fc.weight.register_hook(lambda grad: grad * float("inf"))
    before = drafter.fc.weight.detach().clone()
    trainer.train()
    assert trainer.skipped_steps == 1 and torch.equal(before, drafter.fc.weight)


def test_training_on_a_buffer_logs_the_metrics_and_learns(setup, tmp_path):
    target, drafter, trajectories = setup
    trainer = make_trainer(target, drafter, tmp_path, trajectories)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 4  # 4 samples, batch 1, accumulation 2, 2 epochs
    for key in ("ce", "rkl_clipped", "rkl_raw", "clip_ratio", "head_mse", "accuracy", "accept_len"):
        assert key in logs[0], key
    assert logs[-1]["loss"] < logs[0]["loss"]


def test_head_only_updates_the_length_head_and_nothing_else(setup, tmp_path):
    target, drafter, trajectories = setup
    head_names = set(drafter.length_head_parameter_names())
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    trainer = make_trainer(target, drafter, tmp_path, trajectories, head_only=True)
    groups = {g["name"]: g for g in trainer.create_optimizer().param_groups}
    assert groups["drafter"]["params"] == [] and len(groups["length_head"]["params"]) == len(head_names)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "head_mse" in e]
    assert logs and logs[-1]["head_mse"] < logs[0]["head_mse"]
    for name, param in drafter.named_parameters():
        if name not in head_names:
            assert torch.equal(param.detach(), before[name]), f"{name} changed under head_only"
    assert any(
        not torch.equal(p.detach(), before[n]) for n, p in drafter.named_parameters() if n in head_names
    )


def test_freeze_length_head_updates_the_drafter_and_leaves_the_head_as_loaded(setup, tmp_path):
    target, drafter, trajectories = setup
    head_names = set(drafter.length_head_parameter_names())
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    trainer = make_trainer(target, drafter, tmp_path, trajectories, freeze_length_head=True)
    groups = {g["name"]: g for g in trainer.create_optimizer().param_groups}
    assert groups["length_head"]["params"] == [] and groups["drafter"]["params"]
    trainer.train()
    assert all(torch.equal(p.detach(), before[n]) for n, p in drafter.named_parameters() if n in head_names)
    assert any(
        not torch.equal(p.detach(), before[n]) for n, p in drafter.named_parameters() if n not in head_names
    )


def test_freezing_the_head_with_head_only_is_refused_as_training_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"freeze_length_head: expected False with head_only=True"):
        OPDConfig(output_dir=str(tmp_path), use_cpu=True, head_only=True, freeze_length_head=True)


def test_freeze_length_head_also_freezes_the_head_copy_a_lora_drafter_trains(setup, tmp_path):
    from peft import LoraConfig

    target, drafter, _ = setup
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=[drafter.length_head_name])
    args = OPDConfig(
        output_dir=str(tmp_path / "opd"), use_cpu=True, disable_tqdm=True, freeze_length_head=True
    )
    trainer = OPDTrainer(drafter, target, args, processing_class=tiny_tokenizer(), peft_config=config)
    groups = {g["name"]: g["params"] for g in trainer.create_optimizer().param_groups}
    assert (
        groups["length_head"] == [] and groups["drafter"]
    )  # the LoRA adapters train, no head parameter does
    head = [p for n, p in trainer.model.named_parameters() if drafter.length_head_name in n]
    assert head and not any(p.requires_grad for p in head)
