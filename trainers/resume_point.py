"""Resume points: the weights-only checkpoints that carry a training run across working periods.

A Trainer checkpoint (``runs/<run>/checkpoint-N``) holds AdamW's moments, twice the weights again in float32, and
``runs/`` does not outlast a working period on a fresh checkout. A resume point keeps what a run needs to carry on
and is small enough to commit: the drafter's weights (bf16 by default), its config, and ``trainer_state.json`` (the
step count, blocks seen, the log). ``--resume_from_checkpoint`` on it restores the step count, the model, the data
position and the learning curve; ``DrafterTrainer`` carries the LR schedule on at that step, with fresh AdamW moments
and a short ramp (``resume_rewarmup_steps``).

    python -m adaflash_hf.trainers.resume_point save runs/train_smollm2_stage3/checkpoint-2000 examples/results/stage3/resume
    python -m adaflash_hf.trainers.resume_point restore examples/results/stage3/resume runs/train_smollm2_stage3
    # a drafter folder without trainer state (a shipped drafter): give its place in the run
    python -m adaflash_hf.trainers.resume_point save examples/drafters/x DEST --step 1600 --blocks-seen 345252 --max-steps 6000

``examples/run_long.sh`` restores the committed resume point into the run's ``output_dir`` before it launches, when
that folder has no newer complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def _step_of(folder: Path) -> int | None:
    match = _CHECKPOINT.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """``{N: folder/checkpoint-N}`` for the checkpoints that hold trainer_state.json (written last by the Trainer)."""
    return {
        step: path
        for path in (folder.iterdir() if folder.is_dir() else ())
        if (step := _step_of(path)) is not None and (path / STATE).is_file()
    }


def resume_point_state(
    step: int,
    blocks_seen: int,
    max_steps: int,
    logging_steps: int,
    save_steps: int,
    train_batch_size: int,
    eval_steps: int | None = None,
) -> dict:
    """A minimal ``trainer_state.json`` placing a drafter at ``step`` of a run (for a folder that has none). The
    Trainer takes ``logging_steps`` / ``eval_steps`` / ``save_steps`` from a resumed state, so they must be the run's:
    ``eval_steps`` defaults to ``save_steps`` (a curve point at every checkpoint)."""
    eval_steps = save_steps if eval_steps is None else eval_steps
    for name, value, low in (
        ("step", step, 1),
        ("blocks_seen", blocks_seen, 0),
        ("max_steps", max_steps, step),
        ("logging_steps", logging_steps, 1),
        ("save_steps", save_steps, 1),
        ("eval_steps", eval_steps, 1),
        ("train_batch_size", train_batch_size, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return {
        "global_step": step,
        "max_steps": max_steps,
        "num_train_epochs": 1,
        "logging_steps": logging_steps,
        "save_steps": save_steps,
        "eval_steps": eval_steps,
        "train_batch_size": train_batch_size,
        "log_history": [{"step": step, "blocks_seen": blocks_seen}],
    }


def save_resume_point(
    source: str | Path,
    dest: str | Path,
    *,
    state: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``dest/checkpoint-N`` from a drafter folder (a Trainer checkpoint, or any drafter with ``state``): the
    weights in ``dtype``, the config, and the trainer state. ``dest`` is replaced whole, once everything is written,
    so it always holds exactly one resume point. Returns the written checkpoint folder."""
    from adaflash_hf.modeling import AdaFlashDrafter

    source, dest = Path(source), Path(dest)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"source: expected a drafter folder with config.json, got {source}")
    if state is None:
        if not (source / STATE).is_file():
            raise FileNotFoundError(
                f"source: expected {source / STATE} (a Trainer checkpoint), or the run's place given as "
                "--step/--blocks-seen/--max-steps"
            )
        state = json.loads((source / STATE).read_text(encoding="utf-8"))
    step = state.get("global_step")
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"trainer state global_step: expected an integer >= 1, got {step!r}")
    if not any("blocks_seen" in entry for entry in state.get("log_history", ())):
        raise ValueError(
            "trainer state log_history: expected an entry with blocks_seen (the learning curve's x)"
        )
    drafter = AdaFlashDrafter.from_pretrained(source).to(dtype)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        folder = staging / f"checkpoint-{step}"
        drafter.save_pretrained(folder)
        # The remote-code modules save_pretrained copies in are for Hub users (the shipped drafter has them); a resume
        # point is read by this package's own classes, so it keeps no stale copy of modeling/.
        for module in folder.glob("*.py"):
            module.unlink()
        (folder / STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        staging.chmod(0o755)  # mkdtemp's 0700 would otherwise become the committed folder's mode
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest / f"checkpoint-{step}"


def restore_resume_point(resume_point: str | Path, output_dir: str | Path) -> Path | None:
    """Copy the resume point's ``checkpoint-N`` into ``output_dir`` unless that folder already has a complete
    checkpoint at step N or later (a run of this working period is ahead of it). Returns the copied folder, or None."""
    points = complete_checkpoints(Path(resume_point))
    if len(points) != 1:
        raise ValueError(
            f"resume_point: expected one complete checkpoint-N folder in {resume_point}, got {len(points)}"
        )
    ((step, source),) = points.items()
    output_dir = Path(output_dir)
    ahead = [s for s in complete_checkpoints(output_dir) if s >= step]
    if ahead:
        return None
    target = output_dir / source.name
    if target.exists():  # an incomplete folder of that step (no trainer_state.json): replaced
        shutil.rmtree(target)
    output_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target)
    return target


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser("save", help="write a resume point from a checkpoint or drafter folder")
    save.add_argument("source")
    save.add_argument("dest")
    save.add_argument("--step", type=int, help="the run's step (a source without trainer_state.json)")
    save.add_argument("--blocks-seen", type=int, help="blocks the run had seen at --step")
    save.add_argument("--max-steps", type=int, help="the run's max_steps")
    save.add_argument("--logging-steps", type=int, default=10)
    save.add_argument("--save-steps", type=int, default=400)
    save.add_argument("--eval-steps", type=int, help="the run's eval_steps (default: --save-steps)")
    save.add_argument("--train-batch-size", type=int, default=2)
    save.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    restore = commands.add_parser("restore", help="copy a resume point into a run's output_dir")
    restore.add_argument("resume_point")
    restore.add_argument("output_dir")
    args = parser.parse_args(argv)
    if args.command == "restore":
        copied = restore_resume_point(args.resume_point, args.output_dir)
        print(
            copied
            or f"{args.output_dir}: has a checkpoint at or after the resume point's step; nothing copied"
        )
        return copied
    given = [args.step, args.blocks_seen, args.max_steps]
    state = None
    if any(value is not None for value in given):
        if any(value is None for value in given):
            parser.error("--step, --blocks-seen, --max-steps: expected all three or none")
        state = resume_point_state(
            args.step,
            args.blocks_seen,
            args.max_steps,
            args.logging_steps,
            args.save_steps,
            args.train_batch_size,
        )
    written = save_resume_point(args.source, args.dest, state=state, dtype=getattr(torch, args.dtype))
    print(written)
    return written


if __name__ == "__main__":
    main()
