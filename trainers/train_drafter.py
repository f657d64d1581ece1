"""Train an AdaFlash drafter for any causal LM target (offline DFlash recipe plus the length head).

    adaflash corpus --out-dir examples/corpus/smollm2 --features-dir runs/features/smollm2                  # the data
    accelerate launch trainers/train_drafter.py --config examples/configs/train_smollm2.yaml
    accelerate launch --num_processes 2 trainers/train_drafter.py --config ... --max_steps 50   # DDP
    adaflash train --config examples/configs/train_smollm2.yaml                                 # the same, via the CLI

Steps: load the target (offline SmolLM2 by default, or any Hub id / folder), read the training sequences of the corpus
that ``adaflash corpus`` wrote (``corpus_dir``, the one corpus builder: the target's own greedy responses, resumable),
build or load the drafter, then train with ``DrafterTrainer``; checkpoints every ``save_steps``,
``--max_train_seconds`` for a time budget and ``--resume_from_checkpoint`` as any Trainer, or
``--resume_from_checkpoint last``: the newest complete checkpoint in ``output_dir``, or a fresh start when there is none
(what a run restarted many times passes each time). The final drafter is saved to ``output_dir`` (safetensors +
remote code).
"""

from __future__ import annotations

from pathlib import Path

import datasets
from transformers.utils import logging
from trl import TrlParser

from adaflash_hf.assets import load_target
from adaflash_hf.atomic import check_folder_path
from adaflash_hf.data import load_domain, prompt_ids
from adaflash_hf.launch import run_command, warn_if_cpu_threads_idle
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.trainers.corpus_format import drop_prompt_twins, read_corpus
from adaflash_hf.trainers.drafter_setup import add_config_option, build_drafter, parse_script_args
from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig
from adaflash_hf.trainers.train_drafter_trainer import DrafterTrainer
from adaflash_hf.trainers.weights_only_checkpoint import complete_checkpoints

logger = logging.get_logger(__name__)


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The highest-numbered ``checkpoint-N`` under ``output_dir`` that holds ``trainer_state.json`` (the Trainer writes
    it last, so a run killed while saving leaves a folder without it, which is passed over); None when there is none."""
    steps = complete_checkpoints(Path(output_dir))
    return str(steps[max(steps)]) if steps else None


def check_output_dir(args: DrafterTrainingConfig) -> None:
    """Refuse to train into an ``output_dir`` that holds files unless the run continues there
    (``resume_from_checkpoint``) or replaces it (``overwrite_output_dir``): a second run would otherwise mix its
    checkpoints with the first's and replace its drafter without a word."""
    output_dir = Path(args.output_dir)
    check_folder_path(output_dir, "output_dir")
    if args.resume_from_checkpoint is not None or args.overwrite_output_dir or not output_dir.is_dir():
        return
    entries = sorted(p.name for p in output_dir.iterdir())
    if entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise FileExistsError(
            f"output_dir: expected a new or empty folder, got {output_dir}, which holds {shown}; pass "
            "--resume_from_checkpoint last to continue that run, --overwrite_output_dir true to replace it, or "
            "another --output_dir"
        )


def main(args: DrafterTrainingConfig) -> AdaFlashDrafter:
    warn_if_cpu_threads_idle(logger, args.device, args.world_size, command="adaflash train")
    resume = args.resume_from_checkpoint
    if resume not in (None, "last") and not Path(resume).is_dir():
        raise FileNotFoundError(
            f"resume_from_checkpoint: expected 'last' or an existing checkpoint folder, got {resume!r}, which does "
            "not exist"
        )
    check_output_dir(args)
    if not args.corpus_dir:
        raise ValueError(
            "corpus_dir: expected a corpus written by `adaflash corpus --out-dir DIR` (the training sequences), "
            "got None"
        )
    # Read first: a missing domain file fails before the target loads.
    records = read_corpus(args.corpus_dir, args.domains)
    target, tokenizer = load_target(args.target_model, option="target_model")
    if args.drop_heldout_twins:
        records = _without_heldout_twins(records, tokenizer, args.heldout_domains)
    if args.max_train_sequences is not None:
        records = records[: args.max_train_sequences]
    train_dataset = datasets.Dataset.from_list(
        [
            {
                "input_ids": r["input_ids"],
                "prompt_length": r["prompt_length"],
                "id": r.get("id", ""),
                "domain": r.get("domain", ""),
            }
            for r in records
        ]
    )
    eval_prompts = [
        prompt_ids(tokenizer, row)
        for domain in (args.heldout_domains if args.eval_prompts_per_domain > 0 else ())
        for row in load_domain(domain, "heldout", n=args.eval_prompts_per_domain, seed=args.seed)
    ]
    drafter = build_drafter(args, target, records)
    logger.info(
        f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, {len(records)} sequences"
    )
    trainer = DrafterTrainer(
        model=drafter,
        args=args,
        target=target,
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_prompts=eval_prompts,
    )
    if resume == "last":
        resume = last_complete_checkpoint(args.output_dir)
        # A warning, so that a run restarted many times says in its log where each start began.
        logger.warning(f"resume_from_checkpoint last: {resume or 'no complete checkpoint, a fresh start'}")
    trainer.train(resume_from_checkpoint=resume)
    if args.eval_prompts_per_domain > 0 or (args.heldout_corpus_dir and not args.curve_points_per_decade):
        trainer.evaluate()
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(args.output_dir)
    return trainer.model


def _without_heldout_twins(records: list[dict], tokenizer, domains) -> list[dict]:
    heldout = [
        prompt_ids(tokenizer, row)[0].tolist() for domain in domains for row in load_domain(domain, "heldout")
    ]
    records, dropped = drop_prompt_twins(records, heldout)
    logger.info(
        f"dropped {dropped} training sequences whose prompt is a held-out prompt ({len(heldout)} held out)"
    )
    return records


def make_parser(subparsers=None) -> TrlParser:
    if subparsers is not None:
        parser = subparsers.add_parser(
            "train", help="Train an AdaFlash drafter.", dataclass_types=DrafterTrainingConfig
        )
    else:
        parser = TrlParser(DrafterTrainingConfig)
    return add_config_option(parser)


if __name__ == "__main__":
    run_command(Path(__file__).name, lambda: main(*parse_script_args(make_parser())))
