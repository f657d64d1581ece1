"""Ship a trained drafter checkpoint as the example drafter: weights in bf16, remote code, and the model card rendered
from a measured `adaflash bench generate` JSON.

    python experiments/ship_drafter.py runs/long_run_restart/checkpoint-1600 \
        --bench-json experiments/results/bench_generate.json \
        --training-command "accelerate launch trainers/train_drafter.py --config experiments/configs/long_run_restart.yaml" \
        --notes runs/ship_notes.md --curve runs/long_run_restart/learning_curve.json --curve-offset 1826590

Only the weights and config travel (no optimizer state). The card goes to the drafter folder's README.md and to its
reviewed copy under model_cards/. ``--notes`` appends a hand-written section (training budget, limits) to the card.
``--curve RUN/learning_curve.json --curve-offset N`` continues the shipped learning curve with the run's points.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.hub import drafter_card, stage_drafter

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-adaflash"


def ship(
    checkpoint: str | Path,
    out: str | Path,
    *,
    repo_id: str,
    base_model: str | None,
    bench_json: str | Path | None = None,
    training_command: str | None = None,
    datasets: list[str] | None = None,
    notes: str | None = None,
    card_copy: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``checkpoint`` to ``out`` (replaced whole, only once everything is staged and checked)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint: expected a drafter folder with config.json, got {checkpoint}")
    drafter = AdaFlashDrafter.from_pretrained(checkpoint).to(dtype)
    card = drafter_card(
        drafter,
        repo_id,
        base_model=base_model,
        bench_json=bench_json,
        training_command=training_command,
        datasets=datasets,
    )
    if notes:
        card.text = card.text.rstrip("\n") + "\n\n" + notes.strip("\n") + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        stage_drafter(drafter, staging, card)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if card_copy is not None:
        Path(card_copy).write_text((out / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    return out


def extended_curve(
    curve_json: str | Path, run_json: str | Path, offset: int, stage: str, up_to_step: int | None = None
) -> dict:
    """The shipped learning curve with a resumed run's held-out points appended, their blocks counted from ``offset``
    (the blocks the run's start checkpoint had seen), each tagged with ``stage``; only points up to ``up_to_step``
    (the shipped checkpoint's step) when given. A stage appended again replaces its earlier points. Checked here,
    written by ``write_curve``, so that a bad offset fails before anything is shipped."""
    run = [
        p
        for p in json.loads(Path(run_json).read_text())["points"]
        if up_to_step is None or p.get("step") is None or p["step"] <= up_to_step
    ]
    if not run:
        raise ValueError(f"curve: expected held-out points up to step {up_to_step} in {run_json}, got none")
    data = json.loads(Path(curve_json).read_text())
    kept = [p for p in data["points"] if p.get("stage") != stage]
    first = offset + min(p["blocks_seen"] for p in run)
    if kept and kept[-1]["blocks_seen"] >= first:
        raise ValueError(
            f"curve_offset: expected the run to start after the curve's last point ({kept[-1]['blocks_seen']} "
            f"blocks), got {offset}"
        )
    data["points"] = kept + [{**p, "blocks_seen": offset + p["blocks_seen"], "stage": stage} for p in run]
    data.setdefault("meta", {}).setdefault("stages", {})[stage] = {
        "offset_blocks": offset,
        "source": str(run_json),
    }
    return data


def checkpoint_stage_and_step(checkpoint: str | Path) -> tuple[str, int | None]:
    """A run's name and the shipped step: ``runs/x/checkpoint-2400`` is stage ``x`` at step 2400 (so shipping a later
    checkpoint of the same run replaces its points); a final output folder ``runs/x`` is stage ``x``, every point."""
    checkpoint = Path(checkpoint)
    state = checkpoint / "trainer_state.json"
    if re.fullmatch(r"checkpoint-\d+", checkpoint.name):
        step = (
            json.loads(state.read_text())["global_step"]
            if state.is_file()
            else int(checkpoint.name.split("-")[1])
        )
        return checkpoint.parent.name, step
    return checkpoint.name, None


def write_curve(curve_json: str | Path, data: dict) -> None:
    from adaflash_hf.trainers.learning_curve import plot_learning_curve

    curve_json = Path(curve_json)
    curve_json.write_text(json.dumps(data, indent=1))
    plot_learning_curve(curve_json, curve_json.with_suffix(".png"))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="trained drafter folder (config.json + model.safetensors)")
    parser.add_argument("--out", default=str(ROOT / "examples" / "drafters" / NAME))
    parser.add_argument("--repo-id", default=f"adaflash-hf/{NAME}")
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--bench-json", help="adaflash bench generate JSON for the card's results table")
    parser.add_argument("--training-command", help="shown in the card's Training section")
    parser.add_argument(
        "--dataset", action="append", default=None, help="training dataset repo id (repeatable)"
    )
    parser.add_argument("--notes", help="markdown file appended to the card")
    parser.add_argument("--card-copy", default=str(ROOT / "model_cards" / f"{NAME}.md"))
    parser.add_argument("--curve", help="the run's learning_curve.json, appended to --shipped-curve")
    parser.add_argument("--curve-offset", type=int, help="blocks the run's start checkpoint had seen")
    parser.add_argument("--curve-stage", help="the appended points' stage (default: the run folder's name)")
    parser.add_argument(
        "--shipped-curve", default=str(ROOT / "experiments" / "results" / "learning_curve.json")
    )
    args = parser.parse_args(argv)
    if args.curve and args.curve_offset is None:
        parser.error("--curve-offset: expected the blocks the run's start had seen, got nothing")
    notes = Path(args.notes).read_text(encoding="utf-8") if args.notes else None
    stage, step = checkpoint_stage_and_step(args.checkpoint)
    curve = None
    if args.curve:
        curve = extended_curve(
            args.shipped_curve, args.curve, args.curve_offset, args.curve_stage or stage, step
        )
    out = ship(
        args.checkpoint,
        args.out,
        repo_id=args.repo_id,
        base_model=args.base_model,
        bench_json=args.bench_json,
        training_command=args.training_command,
        datasets=args.dataset or ["anon8231489123/ShareGPT_Vicuna_unfiltered"],
        notes=notes,
        card_copy=args.card_copy or None,
    )
    if curve is not None:
        write_curve(args.shipped_curve, curve)
    return out


if __name__ == "__main__":
    print(main())
