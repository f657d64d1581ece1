"""Can the training recipe overfit a small set? (Rules out a defect of the recipe before a long run.)

Trains a fresh drafter on the first N sequences of the committed corpus, then measures on those same sequences:
teacher-forced greedy acceptance (first position, τ of the full block; ``adaflash_hf.trainers.learning_curve``) and τ of real
``target.generate(..., assistant_model=drafter)`` (fixed length) on a few of their prompts, before and after.

    python experiments/overfit_check.py --sequences 64 --max-steps 300 --output runs/overfit_check.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import GenerationConfig

from adaflash_hf.assets import load_target
from adaflash_hf.trainers.corpus_format import read_corpus
from adaflash_hf.trainers.drafter_setup import build_drafter
from adaflash_hf.trainers.learning_curve import heldout_acceptance
from adaflash_hf.trainers.target_features import sequence_features
from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig
from adaflash_hf.trainers.train_drafter_trainer import DrafterTrainer


def generate_tau(target, drafter, records, max_new_tokens: int) -> float:
    committed = rounds = 0
    for record in records:
        prompt = torch.tensor([record["input_ids"][: record["prompt_length"]]])
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, adaflash_length_mode="fixed"
        )
        target.generate(prompt, assistant_model=drafter, generation_config=config)
        committed += drafter.last_stats.committed_tokens
        rounds += drafter.last_stats.drafting_rounds
    return committed / max(rounds, 1)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-dir", default="examples/corpus/smollm2")
    parser.add_argument(
        "--features-dir",
        default="runs/features/smollm2",
        help="recorded target features (adaflash corpus --features-dir); those missing are computed by the target",
    )
    parser.add_argument("--domain", default="chat")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--generate-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default="runs/overfit_check.json")
    return parser


def overfit(target, tokenizer, records: list[dict], cli: argparse.Namespace) -> dict:
    """Train a fresh drafter on ``records`` and measure it on them before and after (see the module docstring)."""
    with tempfile.TemporaryDirectory() as out_dir:
        args = DrafterTrainingConfig(
            output_dir=out_dir,
            domains=[cli.domain],
            corpus_dir=cli.corpus_dir,
            corpus_features_dir=cli.features_dir,
            drafter_layers=cli.drafter_layers,
            draft_vocab_size=cli.draft_vocab_size,
            num_anchors=512,  # every response position of every sequence, every step
            per_device_train_batch_size=4,
            max_steps=cli.max_steps,
            learning_rate=cli.learning_rate,
            warmup_ratio=0.02,
            lr_scheduler_type="constant_with_warmup",
            save_strategy="no",
            eval_prompts_per_domain=0,
            logging_steps=25,
            use_cpu=True,
            report_to="none",
        )
        drafter = build_drafter(args, target, records)
        # Recorded features where the corpus has them (a fresh checkout has none), else one target forward each.
        features = sequence_features(target, records, drafter.config.target_layer_ids, cli.features_dir)
        shown = records[: cli.generate_prompts]
        before = {
            "acceptance": heldout_acceptance(drafter, target, records, features)["all"],
            "generate_tau_fixed": generate_tau(target, drafter, shown, cli.max_new_tokens),
        }
        dataset = datasets.Dataset.from_list(
            [{k: r[k] for k in ("input_ids", "prompt_length", "id", "domain")} for r in records]
        )
        trainer = DrafterTrainer(
            model=drafter, args=args, target=target, tokenizer=tokenizer, train_dataset=dataset
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    after = {
        "acceptance": heldout_acceptance(drafter, target, records, features)["all"],
        "generate_tau_fixed": generate_tau(target, drafter, shown, cli.max_new_tokens),
    }
    return {
        "sequences": len(records),
        "domain": cli.domain,
        "max_steps": cli.max_steps,
        "draft_vocab_size": cli.draft_vocab_size,
        "blocks_seen": trainer.blocks_seen,
        "train_seconds": seconds,
        "before": before,
        "after": after,
        "loss_history": [e for e in trainer.state.log_history if "loss" in e],
    }


def main(argv: list[str] | None = None) -> dict:
    cli = make_parser().parse_args(argv)
    target, tokenizer = load_target()
    records = read_corpus(cli.corpus_dir, [cli.domain])[: cli.sequences]
    result = overfit(target, tokenizer, records, cli)
    Path(cli.output).parent.mkdir(parents=True, exist_ok=True)
    Path(cli.output).write_text(json.dumps(result, indent=1))
    for name in ("before", "after"):
        values = result[name]
        print(
            f"{name}: first-position {values['acceptance']['first_position']:.3f}, teacher-forced τ "
            f"{values['acceptance']['tau_fixed']:.2f}, generate τ (fixed) {values['generate_tau_fixed']:.2f}"
        )
    return result


if __name__ == "__main__":
    main()
