"""Calibrate the length head alone, drafter frozen: ``adaflash calibrate-head``.

A published DFlash checkpoint (z-lab's drafters, or any export without the AdaFlash sidecar) loads with an untrained
length head and must run fixed-length. Calibration gives it an adaptive length from real acceptance, in minutes:

1. the target answers a set of prompts greedily, recording its tapped hidden states in the same forwards
   (``corpus.build_corpus``; an existing corpus with features can be passed instead);
2. the frozen drafter drafts a block at every response position of those answers in one forward per answer, and each
   block's realised accepted fraction a* = accepted / (block_size - 1) is read off against the answer itself. The
   answers are the target's greedy outputs, so this is exactly what greedy verification accepts
   (``learning_curve.record_blocks``);
3. only the length head is fitted (MSE of â against a*) on the cached block states, which are the head's whole input
   (it reads detached drafter states): the drafter's forward runs once per answer, never per step.

Sequences are split into a fit set and a held-out set (one in ``1 / holdout_fraction``, and at least one: a split
with nothing held out is refused); the report gives the head's mean |â - a*| and the adaptive draft length's expected
accepted drafts on the held-out blocks, before and after. ``holdout_fraction=0`` scores the fit blocks instead, and
the report and its summary say so.

    report = calibrate_length_head(drafter, records, features, target)          # in place; returns figures
    adaflash calibrate-head --drafter path/to/dflash --output-dir out/          # the same from the command line
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from transformers.utils import logging

from adaflash_hf.modeling.length_head_adaflash import length_head_error, length_head_loss, realised_acceptance
from adaflash_hf.trainers.learning_curve import record_blocks

logger = logging.get_logger(__name__)


def collect_blocks(
    drafter,
    target,
    records: list[dict],
    features: list[torch.Tensor],
    max_anchors: int = 256,
    progress: bool = True,
):
    """Per record with at least one full block: (block states [n, k, H] float32, realised fraction a* [n])."""
    from tqdm.auto import tqdm

    was_training = drafter.training
    drafter.eval()
    out = []
    pairs = zip(records, features)
    for record, feature in tqdm(pairs, total=len(records), desc="drafting blocks", disable=not progress):
        blocks = record_blocks(drafter, target, record, feature, max_anchors)
        if blocks is not None:
            out.append(
                (blocks.states.float(), realised_acceptance(blocks.accepted, drafter.config.block_size))
            )
    drafter.train(was_training)
    return out


@torch.no_grad()
def head_figures(
    drafter, states: torch.Tensor, realised: torch.Tensor, head: torch.nn.Module | None = None
) -> dict:
    """Mean |â - a*|, mean â, and per block the drafts the adaptive length k̂ verifies and would get accepted, for
    ``head`` (default: the drafter's own length head)."""
    head = drafter.length_head if head is None else head
    dtype = next(head.parameters()).dtype
    predicted = head(states.to(dtype)).float()
    k_hat = drafter.predict_draft_length(predicted)
    accepted = torch.round(realised * (drafter.config.block_size - 1)).long()
    committed = torch.minimum(k_hat, accepted)
    return {
        "blocks": int(realised.numel()),
        "head_mae": float(length_head_error(predicted, realised).mean()),
        "mean_predicted": float(predicted.mean()),
        "mean_realised": float(realised.mean()),
        "mean_k_hat": float(k_hat.float().mean()),
        # Greedy: a round verifies k̂ drafts and commits min(k̂, a) + 1 tokens; per verified draft that is the
        # acceptance rate the adaptive length achieves (higher: fewer wasted target positions).
        "accepted_per_round": float(committed.float().mean()),
        "acceptance_of_verified": float(committed.sum() / k_hat.sum().clamp(min=1)),
    }


def fit_length_head(
    drafter,
    states: torch.Tensor,
    realised: torch.Tensor,
    steps: int = 300,
    learning_rate: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
    time_budget_s: float | None = None,
) -> list[float]:
    """AdamW on the length head's parameters only (MSE of â against ``realised``); returns the loss per step."""
    head = drafter.length_head
    head.train()
    params = list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    dtype = params[0].dtype
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        rows = torch.randint(0, realised.numel(), (min(batch_size, realised.numel()),), generator=generator)
        loss = length_head_loss(head(states[rows].to(dtype)), realised[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
    head.eval()
    return losses


def calibrate_length_head(
    drafter,
    records: list[dict],
    features: list[torch.Tensor],
    target,
    *,
    holdout_fraction: float = 0.25,
    steps: int = 300,
    learning_rate: float = 1e-3,
    batch_size: int = 256,
    max_anchors: int = 256,
    seed: int = 0,
    time_budget_s: float | None = None,
    reference_heads: dict[str, torch.nn.Module] | None = None,
) -> dict:
    """Fit ``drafter``'s length head in place on ``records`` (the target's greedy answers) and their ``features``.

    Every ``1 / holdout_fraction``-th record is held out, and at least one: fewer than two records with a full block
    are refused. Returns the held-out figures before and after, those of each of ``reference_heads`` (e.g. the head a
    checkpoint was trained with) on the same blocks, the fit loss curve and the seconds spent. With
    ``holdout_fraction=0`` nothing is held out and the figures are those of the fit blocks (``scored_on: "fit"``).
    """
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction: expected 0 <= value < 1, got {holdout_fraction}")
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    if len(records) != len(features):
        raise ValueError(f"features: expected one per record ({len(records)}), got {len(features)}")
    start = time.perf_counter()
    blocks = collect_blocks(drafter, target, records, features, max_anchors)
    if not blocks:
        raise ValueError(
            f"records: expected at least one answer of {drafter.config.block_size} tokens or more (a full block), "
            f"got none of {len(records)}"
        )
    fit, held = _split(blocks, holdout_fraction, drafter.config.block_size)
    fit_states, fit_realised = torch.cat([s for s, _ in fit]), torch.cat([r for _, r in fit])
    held_states = torch.cat([s for s, _ in held]) if held else fit_states
    held_realised = torch.cat([r for _, r in held]) if held else fit_realised
    collected = time.perf_counter() - start
    before = head_figures(drafter, held_states, held_realised)
    losses = fit_length_head(
        drafter, fit_states, fit_realised, steps, learning_rate, batch_size, seed, time_budget_s
    )
    after = head_figures(drafter, held_states, held_realised)
    report = {
        "scored_on": "held_out" if held else "fit",
        "sequences": {"fit": len(fit), "held_out": len(held)},
        "blocks": {"fit": int(fit_realised.numel()), "held_out": int(held_realised.numel())},
        "before": before,
        "after": after,
        "references": {
            name: head_figures(drafter, held_states, held_realised, head)
            for name, head in (reference_heads or {}).items()
        },
        "loss": losses,
        "steps": len(losses),
        "seconds": {"collect": collected, "total": time.perf_counter() - start},
    }
    logger.info(
        f"length head calibrated on {report['blocks']['fit']} blocks in {report['steps']} steps: "
        f"{_scored_on(report)} |â - a*| {before['head_mae']:.3f} -> {after['head_mae']:.3f}, mean k̂ "
        f"{before['mean_k_hat']:.2f} -> {after['mean_k_hat']:.2f}"
    )
    return report


def _split(blocks: list, holdout_fraction: float, block_size: int) -> tuple[list, list]:
    """``(fit, held out)``: every ``1 / holdout_fraction``-th sequence's blocks held out, and at least one."""
    every = max(2, round(1 / holdout_fraction)) if holdout_fraction > 0 else 0
    held_out = {i for i in range(len(blocks)) if every and i % every == every - 1}
    if every and not held_out:
        if len(blocks) < 2:
            raise ValueError(
                _too_few_to_hold_out(
                    f"records with a full block ({block_size} tokens)", len(blocks), holdout_fraction
                )
            )
        held_out = {len(blocks) - 1}  # fewer sequences than one period of the split: still hold one out
    fit = [b for i, b in enumerate(blocks) if i not in held_out]
    return fit, [b for i, b in enumerate(blocks) if i in held_out]


def _too_few_to_hold_out(what: str, count: int, holdout_fraction: float) -> str:
    return (
        f"{what}: expected at least 2 sequences to hold one out (holdout_fraction={holdout_fraction}), got {count}; add "
        "prompts, or pass holdout_fraction=0 (--holdout-fraction 0) to score the fit set"
    )


def _scored_on(report: dict) -> str:
    return "held-out" if report.get("scored_on", "held_out") == "held_out" else "fit-set (nothing held out)"


# ----------------------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    from adaflash_hf.data import ALL_DOMAINS
    from adaflash_hf.launch import CONFIG_HELP, int_at_least, number_in

    parser = argparse.ArgumentParser(
        prog="adaflash calibrate-head", description=__doc__.splitlines()[0].rstrip(":")
    )
    parser.add_argument("--drafter", required=True, help="drafter folder (any layout from_pretrained loads)")
    parser.add_argument(
        "--target", default="smollm2-135m-instruct", help="target (adaflash_hf.assets.load_target)"
    )
    parser.add_argument(
        "--output-dir", required=True, help="where the calibrated drafter and calibration.json go"
    )
    parser.add_argument(
        "--corpus-dir",
        help="an existing corpus of the target's greedy answers (else one is generated under "
        "<output-dir>/corpus from --prompts-per-domain prompts)",
    )
    parser.add_argument(
        "--features-dir",
        help="the features of --corpus-dir (adaflash corpus --features-dir); required with --corpus-dir, else "
        "recorded while generating",
    )
    parser.add_argument(
        "--max-sequences",
        type=int_at_least(1),
        default=None,
        help="use at most this many corpus answers (evenly spaced)",
    )
    parser.add_argument("--domains", nargs="+", choices=ALL_DOMAINS, default=["chat", "code", "math"])
    parser.add_argument("--prompts-per-domain", type=int_at_least(1), default=16)
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    parser.add_argument("--steps", type=int_at_least(1), default=300)
    parser.add_argument("--learning-rate", type=number_in(0, open_low=True), default=1e-3)
    parser.add_argument("--batch-size", type=int_at_least(1), default=256)
    parser.add_argument("--holdout-fraction", type=float, default=0.25)
    parser.add_argument(
        "--reinit-head", action="store_true", help="start from a fresh head (to measure calibration)"
    )
    parser.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    return parser


def _check_args(args) -> None:
    """Every check that needs no model, before the drafter, the target or any prompt loads."""
    if args.corpus_dir is not None:
        if not Path(args.corpus_dir).is_dir():
            raise FileNotFoundError(
                f"--corpus-dir: expected an existing corpus folder, got {args.corpus_dir!r}"
            )
        if args.features_dir is None:
            raise ValueError(
                "--features-dir: expected the features of --corpus-dir (adaflash corpus --features-dir), got none"
            )
        if not Path(args.features_dir).is_dir():
            raise FileNotFoundError(
                f"--features-dir: expected an existing features folder, got {args.features_dir!r}"
            )
    if not 0 <= args.holdout_fraction < 1:
        raise ValueError(f"--holdout-fraction: expected 0 <= value < 1, got {args.holdout_fraction}")
    if args.corpus_dir is None:
        sequences = args.prompts_per_domain * len(args.domains)
        if args.max_sequences is not None:
            sequences = min(sequences, args.max_sequences)
        if args.holdout_fraction > 0 and sequences < 2:
            raise ValueError(
                _too_few_to_hold_out(
                    f"--prompts-per-domain {args.prompts_per_domain} x {len(args.domains)} domain(s)",
                    sequences,
                    args.holdout_fraction,
                )
            )


def _corpus(args, target, tokenizer, layer_ids) -> tuple[list[dict], list[torch.Tensor]]:
    from adaflash_hf.data import load_domain
    from adaflash_hf.trainers.corpus import build_corpus
    from adaflash_hf.trainers.corpus_format import load_features, read_corpus

    corpus_dir, features_dir = args.corpus_dir, args.features_dir
    if corpus_dir is None:
        corpus_dir = Path(args.output_dir) / "corpus"
        features_dir = corpus_dir / "features"
        rows = [
            row
            for domain in args.domains
            for row in load_domain(domain, "train", n=args.prompts_per_domain, seed=args.seed)
        ]
        build_corpus(
            target,
            tokenizer,
            rows,
            corpus_dir,
            features_dir,
            layer_ids=layer_ids,
            max_new_tokens=args.max_new_tokens,
        )
    records = read_corpus(corpus_dir, args.domains)
    if args.max_sequences is not None and len(records) > args.max_sequences:
        step = len(records) / args.max_sequences
        records = [records[int(i * step)] for i in range(args.max_sequences)]
    features = [load_features(features_dir, record, layer_ids) for record in records]
    missing = [r["id"] for r, f in zip(records, features) if f is None]
    if missing:
        raise ValueError(
            f"--features-dir: expected features of every record, {len(missing)} missing (first {missing[0]})"
        )
    return records, features


def main(argv: list[str] | None = None) -> dict:
    from adaflash_hf.assets import load_target
    from adaflash_hf.launch import parse_args_with_config
    from adaflash_hf.modeling import AdaFlashDrafter

    parser = make_parser()
    args = parse_args_with_config(parser, argv)
    _check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    drafter = AdaFlashDrafter.from_pretrained(args.drafter)
    target, tokenizer = load_target(args.target, option="--target")
    drafter = drafter.to(next(target.parameters()).dtype)  # a bf16 checkpoint is fitted in the target's dtype
    drafter.check_target(target)
    references = {}
    if args.reinit_head:  # the loaded head is the reference the fresh one is measured against
        references["loaded_head"] = copy.deepcopy(drafter.length_head).eval()
        drafter.reset_length_head(args.seed)
    records, features = _corpus(args, target, tokenizer, list(drafter.config.target_layer_ids))
    report = calibrate_length_head(
        drafter,
        records,
        features,
        target,
        holdout_fraction=args.holdout_fraction,
        steps=args.steps,
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        seed=args.seed,
        reference_heads=references,
    )
    out = Path(args.output_dir)
    drafter.save_pretrained(out / "drafter")
    report["drafter"] = str(out / "drafter")
    (out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def summary_line(report: dict) -> str:
    before, after = report["before"], report["after"]
    line = (
        f"{_scored_on(report)} |â - a*| {before['head_mae']:.3f} -> {after['head_mae']:.3f}; accepted drafts per verified "
        f"{before['acceptance_of_verified']:.2f} -> {after['acceptance_of_verified']:.2f}; "
        f"mean k̂ {before['mean_k_hat']:.2f} -> {after['mean_k_hat']:.2f} ({report['steps']} steps, "
        f"{report['seconds']['total']:.0f} s)"
    )
    for name, figures in report["references"].items():
        line += (
            f"; {name}: |â - a*| {figures['head_mae']:.3f}, accepted per verified "
            f"{figures['acceptance_of_verified']:.2f}, mean k̂ {figures['mean_k_hat']:.2f}"
        )
    return line


if __name__ == "__main__":
    from adaflash_hf.launch import run_command

    logging.set_verbosity_info()
    print(summary_line(run_command("calibrate_head.py", main)))
