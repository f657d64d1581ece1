"""Held-out teacher-forced acceptance, the learning curve it feeds, and training from a recorded corpus."""

import json

import datasets
import pytest
import torch
import torch.nn.functional as F

from adaflash_hf.trainers.learning_curve import LearningCurve, heldout_acceptance
from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig
from adaflash_hf.trainers.train_drafter_trainer import DrafterTrainer
from tests.conftest import corpus, drafts_one_token, features_of


def test_batched_teacher_forced_acceptance_equals_one_block_at_a_time(
    target_factory, drafter_factory, tmp_path
):
    target = target_factory("llama")
    drafter = drafter_factory(target, block_size=4)
    layer_ids = drafter.config.target_layer_ids
    records, _ = corpus(target, tmp_path, layer_ids)
    features = [features_of(target, r, layer_ids) for r in records]
    embedding, lm_weight = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    # With no attention or MLP output every MASK row drafts one token T; making ~60% of the response tokens T gives
    # blocks accepted to every depth, so the cumulative product and the anchor offsets are both exercised.
    token = drafts_one_token(drafter, target)
    g = torch.Generator().manual_seed(0)
    for record in records:
        for i in range(record["prompt_length"], len(record["input_ids"])):
            if torch.rand((), generator=g) < 0.6:
                record["input_ids"][i] = token
    metrics = heldout_acceptance(drafter, target, records, features)

    accepted, predicted = [], []
    for record, feature in zip(records, features):
        ids = record["input_ids"]
        for anchor in range(record["prompt_length"], len(ids) - 4 + 1):
            block = torch.tensor([[ids[anchor]] + [drafter.config.mask_token_id] * 3])
            out = drafter(
                noise_embeds=F.embedding(block, embedding),
                context_hidden_states=feature[None, :anchor],
                position_ids=torch.arange(anchor + 4)[None],
            )
            drafts = (out.last_hidden_state[0, 1:] @ lm_weight.T).argmax(-1)
            right = (drafts == torch.tensor(ids[anchor + 1 : anchor + 4])).long().cumprod(0)
            accepted.append(int(right.sum()))
            predicted.append(float(out.acceptance_prob.reshape(-1)[0]))
    accepted = torch.tensor(accepted)
    head_error = (torch.tensor(predicted) - accepted.float() / 3).abs().mean().item()
    assert metrics["all"]["head_mae"] == pytest.approx(head_error, abs=1e-5)
    assert metrics["all"]["head_mean_predicted"] == pytest.approx(sum(predicted) / len(predicted), abs=1e-5)
    assert metrics["all"]["blocks"] == accepted.numel()
    assert metrics["all"]["tau_fixed"] == pytest.approx(1.0 + accepted.double().mean().item(), abs=1e-12)
    assert metrics["all"]["first_position"] == (accepted >= 1).float().mean().item()
    assert 0 < metrics["all"]["first_position"] < 1 and accepted.max() == 3, (
        "needs right, wrong and full blocks"
    )
    assert set(metrics) == {"chat", "math", "all"}


POINT = {"chat": {"tau_fixed": 1.5, "first_position": 0.3}, "all": {"tau_fixed": 1.5, "first_position": 0.3}}


def test_the_curve_json_and_its_plot_come_from_one_record(tmp_path):
    curve = LearningCurve(tmp_path, meta={"title": "t"})
    curve.claim(tmp_path / "run", resumed=False)
    curve.add(100, POINT, step=1)
    curve.add(1000, POINT, step=10)
    saved = json.loads((tmp_path / "learning_curve.json").read_text())
    assert [p["blocks_seen"] for p in saved["points"]] == [100, 1000]
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
    # The run that wrote the curve, resumed, continues it and replaces the points past its restart.
    resumed = LearningCurve(tmp_path)
    resumed.claim(tmp_path / "run", resumed=True)
    resumed.add(500, POINT, step=5)
    assert [p["blocks_seen"] for p in json.loads(resumed.json_path.read_text())["points"]] == [100, 500]


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("owner", [None, "runs/other"])
def test_a_curve_of_another_run_is_refused_and_left_as_it_was(tmp_path, owner, resumed):
    meta = {"title": "shipped"} | ({"run": owner} if owner else {})
    points = [{"blocks_seen": b, "step": b, "metrics": POINT} for b in (100, 200, 300)]
    (tmp_path / "learning_curve.json").write_text(json.dumps({"meta": meta, "points": points}))
    before = (tmp_path / "learning_curve.json").read_bytes()
    curve = LearningCurve(tmp_path)
    with pytest.raises(
        ValueError, match=r"learning_curve_dir: expected a folder without another run's curve, got "
    ):
        curve.claim(tmp_path / "mine", resumed=resumed)
    with pytest.raises(ValueError, match="would drop 3 later points"):
        curve.add(10, POINT, step=1)
    assert (tmp_path / "learning_curve.json").read_bytes() == before


def test_a_fresh_run_of_the_same_folder_does_not_cut_back_its_earlier_curve(tmp_path):
    first = LearningCurve(tmp_path)
    first.claim(tmp_path / "run", resumed=False)
    first.add(100, POINT, step=1)
    with pytest.raises(ValueError, match="1 points of run "):
        LearningCurve(tmp_path).claim(tmp_path / "run", resumed=False)


def test_training_into_a_folder_with_another_runs_curve_is_refused_before_any_step(
    target_factory, drafter_factory, tmp_path, monkeypatch
):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    records, tokenizer = corpus(target, tmp_path, drafter.config.target_layer_ids, per_domain=2)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    points = [{"blocks_seen": b, "step": b, "metrics": POINT} for b in range(100, 5300, 100)]
    (shipped / "learning_curve.json").write_text(json.dumps({"meta": {}, "points": points}))
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path / "out"),
        domains=["chat", "math"],
        heldout_corpus_dir=str(tmp_path / "c"),
        learning_curve_dir=str(shipped),
        max_steps=2,
        num_anchors=4,
        eval_prompts_per_domain=0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    dataset = datasets.Dataset.from_list(
        [{k: r[k] for k in ("input_ids", "prompt_length", "id", "domain")} for r in records]
    )
    trainer = DrafterTrainer(
        model=drafter, args=args, target=target, tokenizer=tokenizer, train_dataset=dataset
    )
    monkeypatch.setattr(
        target, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("target ran"))
    )
    with pytest.raises(ValueError, match=r"with 52 points of a run that did not record its folder"):
        trainer.train()
    assert len(json.loads((shipped / "learning_curve.json").read_text())["points"]) == 52


@pytest.mark.parametrize(
    ("schedule", "steps"),
    [({"eval_strategy": "steps", "eval_steps": 2}, [2, 4]), ({"curve_points_per_decade": 2}, [1, 3, 4])],
)
def test_training_from_a_recorded_corpus_uses_its_features_and_draws_the_curve(
    target_factory, drafter_factory, tmp_path, monkeypatch, schedule, steps
):
    target = target_factory("llama")
    drafter = drafter_factory(target)
    layer_ids = drafter.config.target_layer_ids
    records, tokenizer = corpus(target, tmp_path, layer_ids)
    corpus(target, tmp_path, layer_ids, name="heldout", per_domain=2)
    args = DrafterTrainingConfig(
        output_dir=str(tmp_path / "out"),
        domains=["chat", "math"],
        corpus_dir=str(tmp_path / "c"),
        corpus_features_dir=str(tmp_path / "c-features"),
        heldout_corpus_dir=str(tmp_path / "heldout"),
        heldout_features_dir=str(tmp_path / "heldout-features"),
        max_steps=4,
        per_device_train_batch_size=2,
        num_anchors=8,
        logging_steps=2,
        eval_prompts_per_domain=0,
        save_strategy="no",
        learning_rate=3e-3,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **schedule,
    )
    dataset = datasets.Dataset.from_list(
        [{k: r[k] for k in ("input_ids", "prompt_length", "id", "domain")} for r in records]
    )
    trainer = DrafterTrainer(
        model=drafter, args=args, target=target, tokenizer=tokenizer, train_dataset=dataset
    )
    # Every feature is on disk, so training never runs the target.
    monkeypatch.setattr(
        target, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("target ran"))
    )
    trainer.train()
    points = json.loads((tmp_path / "out" / "learning_curve.json").read_text())["points"]
    assert [p["step"] for p in points] == steps  # log-spaced: 10^0, 10^0.5 ~ 3, and the last step
    seen = [p["blocks_seen"] for p in points]
    assert 0 < seen[0] and seen == sorted(set(seen)) and seen[-1] <= 4 * 2 * 8
    assert {"chat", "math", "all"} == set(points[-1]["metrics"])
    assert (tmp_path / "out" / "learning_curve.png").is_file()
    logged = [e for e in trainer.state.log_history if "blocks_seen" in e]
    assert logged[-1]["blocks_seen"] == trainer.blocks_seen
