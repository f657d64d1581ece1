"""Weights-only checkpoints, and resuming training from one when the optimizer state is gone.

A Trainer checkpoint (``output_dir/checkpoint-N``) holds AdamW's moments, twice the weights again in float32. A
weights-only checkpoint keeps what a run needs to carry on: the drafter's weights (bf16 by default), its config and
``trainer_state.json`` (the step count, blocks seen, the log), small enough to keep where ``output_dir`` does not last
(scratch space, a preemptible machine's disk) or to archive. ``--resume_from_checkpoint`` on one restores the step
count, the model, the data position and the learning curve; ``CarryOnAfterResume`` carries the LR schedule on at that
step, with fresh AdamW moments and a short ramp (``resume_rewarmup_steps``). The training config's
``weights_only_checkpoint_dir`` writes one at every checkpoint save (``SaveWeightsOnly``); by hand:

    python -m adaflash_hf.trainers.weights_only_checkpoint save runs/my_run/checkpoint-2000 kept/my_run
    python -m adaflash_hf.trainers.weights_only_checkpoint restore kept/my_run runs/my_run
    # a drafter folder without trainer state (a published drafter): give its place in the run
    python -m adaflash_hf.trainers.weights_only_checkpoint save DRAFTER DEST --step 1600 --blocks-seen 345252 \
        --max-steps 6000
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from adaflash_hf.atomic import read_json

logger = logging.get_logger(__name__)

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


def weights_only_state(
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


def save_weights_only(
    source: str | Path,
    dest: str | Path,
    *,
    state: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``dest/checkpoint-N`` from a drafter folder (a Trainer checkpoint, or any drafter with ``state``): the
    weights in ``dtype``, the config, and the trainer state. ``dest`` is replaced whole, once everything is written,
    so it always holds exactly one checkpoint. Returns the written checkpoint folder."""
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
        state = read_json(source / STATE)
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
        # The remote-code modules save_pretrained copies in are for Hub users (the shipped drafter has them); a
        # weights-only checkpoint is read by this package's own classes, so it keeps no stale copy of modeling/.
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


def restore_weights_only(kept: str | Path, output_dir: str | Path) -> Path | None:
    """Copy the ``checkpoint-N`` kept in ``kept`` into ``output_dir`` unless that folder already has a complete
    checkpoint at step N or later (the run got further there). Returns the copied folder, or None."""
    points = complete_checkpoints(Path(kept))
    if len(points) != 1:
        raise ValueError(f"kept: expected one complete checkpoint-N folder in {kept}, got {len(points)}")
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


class SaveWeightsOnly(TrainerCallback):
    """Writes each checkpoint the Trainer saves weights-only to ``dest`` (``save_weights_only``: bf16 weights and
    trainer state, replacing the previous one whole), so ``dest`` always holds the run's newest checkpoint."""

    def __init__(self, dest: str):
        self.dest = dest

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            logger.info(f"weights-only checkpoint: {save_weights_only(checkpoint, self.dest)}")


class CarryOnAfterResume(TrainerCallback):
    """On a resumed run's first event (``on_train_begin``, after the Trainer loaded the checkpoint):

    - the logging / eval / save intervals come from the run's config, not the checkpoint's state (the Trainer's
      default), so a changed ``save_steps`` applies and a state written by ``weights_only_state`` sets none;
    - each exportable callback of the trainer (``callback_handler``) gets an entry in the state's
      ``stateful_callbacks`` if the checkpoint had none: without one the Trainer's next checkpoint save fails;
    - a schedule the checkpoint did not restore (no ``optimizer.pt`` / ``scheduler.pt``: a weights-only checkpoint)
      carries on at the checkpoint's step (``carry_on_schedule``) instead of starting over, with fresh AdamW moments.
    """

    def __init__(self, callback_handler, rewarmup_steps: int):
        self.callback_handler = callback_handler
        self.rewarmup_steps = rewarmup_steps

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        step = state.global_step
        if step == 0:  # a fresh run
            return
        kept = {kind: getattr(state, f"{kind}_steps") for kind in ("logging", "eval", "save")}
        state.compute_steps(args, state.max_steps)
        changed = {
            k: (v, getattr(state, f"{k}_steps")) for k, v in kept.items() if v != getattr(state, f"{k}_steps")
        }
        if changed:
            logger.warning(
                f"resumed at step {step}: intervals from the config, not the checkpoint: {changed}"
            )
        for callback in [*self.callback_handler.callbacks, control]:
            if isinstance(callback, ExportableState):
                state.stateful_callbacks.setdefault(type(callback).__name__, callback.state())
        if getattr(lr_scheduler, "scheduler", lr_scheduler).last_epoch >= step:
            return  # the checkpoint's scheduler state was restored
        logger.warning(
            f"resumed at step {step} without the checkpoint's optimizer and scheduler state (a weights-only "
            f"checkpoint): fresh AdamW moments, the LR schedule carried on at step {step} with a "
            f"{self.rewarmup_steps}-step ramp"
        )
        carry_on_schedule(lr_scheduler, step, self.rewarmup_steps)


def carry_on_schedule(scheduler, step: int, rewarmup_steps: int) -> None:
    """Put a freshly created ``LambdaLR`` (or an accelerate wrapper of one) at ``step`` of its schedule, the learning
    rate ramped linearly from ``1 / (rewarmup_steps + 1)`` of the schedule's value to all of it over ``rewarmup_steps``
    steps (fresh AdamW moments make the first updates sign-like, ``lr`` in every weight). A later checkpoint saves the
    schedule's step; a resume from it rebuilds the plain schedule, the ramp being long over by then."""
    scheduler = getattr(scheduler, "scheduler", scheduler)
    if not hasattr(scheduler, "lr_lambdas"):
        raise TypeError(
            f"lr_scheduler: expected a LambdaLR (the Trainer's get_scheduler) to carry on at step {step}, "
            f"got {type(scheduler).__name__}"
        )

    def ramped(schedule):
        def lr_lambda(current: int) -> float:
            return schedule(current) * min(1.0, (current - step + 1) / (rewarmup_steps + 1))

        return lr_lambda

    scheduler.lr_lambdas = [ramped(schedule) for schedule in scheduler.lr_lambdas]
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser(
        "save", help="write a weights-only checkpoint from a checkpoint or drafter folder"
    )
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
    restore = commands.add_parser("restore", help="copy a weights-only checkpoint into a run's output_dir")
    restore.add_argument("kept", help="the folder save wrote")
    restore.add_argument("output_dir")
    args = parser.parse_args(argv)
    if args.command == "restore":
        copied = restore_weights_only(args.kept, args.output_dir)
        print(copied or f"{args.output_dir}: has a checkpoint at or after the kept step; nothing copied")
        return copied
    given = [args.step, args.blocks_seen, args.max_steps]
    state = None
    if any(value is not None for value in given):
        if any(value is None for value in given):
            parser.error("--step, --blocks-seen, --max-steps: expected all three or none")
        state = weights_only_state(
            args.step,
            args.blocks_seen,
            args.max_steps,
            args.logging_steps,
            args.save_steps,
            args.train_batch_size,
        )
    written = save_weights_only(args.source, args.dest, state=state, dtype=getattr(torch, args.dtype))
    print(written)
    return written


if __name__ == "__main__":
    main()
