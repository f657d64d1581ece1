"""Throughput of one offline drafter-training step: ``adaflash bench train [--threads 1] [--steps 3] [--output t.json]``.

A step is ``DrafterTrainer``'s without data loading, feature lookup and scheduler: ``sample_anchors``,
``recipe_loss`` (blocks, drafter forward, CE + length-head MSE), backward, both groups clipped, AdamW step; bf16
variants run it under ``torch.autocast("cpu", bfloat16)``, as accelerate does for ``bf16=True`` with ``use_cpu=True``
(float32 master weights, CE in float32). No target model is loaded: the context features (``--context-layers`` target
layers), the tied embedding and lm_head are random tensors of the real target's shapes and the trainer's batch
(``shapes``), the first tokens of each sequence prompt (unsupervised). Speed does not depend on the values.

Variants (``VARIANTS``) start from ``today`` (the original recipe: dense [Q, S + Q] mask, float32, full
vocabulary, 24 anchors) and change the attention layout and anchor count, bf16 autocast, the vocabulary (``dv``: a
draft vocabulary of 8192 ids, ``top_label_vocab``), the drafter's depth and the soft-target KL (``soft``: random
top-32 targets).
A row has 384 candidate anchors, so ``split-512`` trains 384 blocks a row: ``blocks/step`` counts the trained ones.

Each variant runs in a fresh process: one warm-up step, then ``--steps`` timed steps; blocks/s is the median over
the timed steps, peak RSS the process's high-water mark (``step MiB``: that mark minus the RSS before the first step).
``--quick`` uses tiny shapes (seconds; for tests), ``--in-process`` runs every variant in this process (no fresh
process: peak RSS is then the running maximum over variants).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import LlamaConfig

from adaflash_hf.bench.machine import in_fresh_process, memory_base, memory_peak
from adaflash_hf.bench.report import add_record_options, fmt, parse_record_args, print_record, table
from adaflash_hf.launch import int_at_least
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.modeling.configuration_adaflash import build_target_layer_ids
from adaflash_hf.trainers.dflash_recipe import IGNORE, SoftTargets, recipe_loss, sample_anchors
from adaflash_hf.trainers.optim import clip_each_group, split_drafter_and_head, two_group_adamw
from adaflash_hf.trainers.train_drafter_config import DrafterTrainingConfig

# The recipe of the shipped SmolLM2 drafter (examples/configs/train_smollm2.yaml): every position an anchor.
SHIPPED_RECIPE = {"num_anchors": 512, "draft_vocab": True, "drafter_layers": 1}
VARIANTS = {
    "today": {"attention_layout": "dense", "num_anchors": 24},
    "dense-96": {"attention_layout": "dense", "num_anchors": 96},
    "split-24": {"num_anchors": 24},
    "split-96": {"num_anchors": 96},
    "split-256": {"num_anchors": 256},
    "split-512": {"num_anchors": 512},
    "split-24-bf16": {"num_anchors": 24, "bf16": True},
    "split-24-dv": {"num_anchors": 24, "draft_vocab": True},
    "split-24-bf16-dv": {"num_anchors": 24, "bf16": True, "draft_vocab": True},
    "split-24-dv-1layer": {"num_anchors": 24, "draft_vocab": True, "drafter_layers": 1},
    "split-256-bf16-dv": {"num_anchors": 256, "bf16": True, "draft_vocab": True},
    "split-512-dv-1layer": SHIPPED_RECIPE,
    # The same with CE on the first 6 or 3 drafted positions only (loss_positions).
    "split-512-dv-1layer-lp6": {**SHIPPED_RECIPE, "loss_positions": 6},
    "split-512-dv-1layer-lp3": {**SHIPPED_RECIPE, "loss_positions": 3},
    # The soft-target arm of the sweep (experiments/configs/sweep_soft_targets.yaml): CE mixed with the KL to a top-32.
    "split-512-dv-1layer-lp6-soft": {**SHIPPED_RECIPE, "loss_positions": 6, "soft_target_weight": 0.5},
}
VARIANT_DEFAULTS = {
    "attention_layout": "split",
    "bf16": False,
    "draft_vocab": False,
    "drafter_layers": 2,
    "loss_positions": None,
    "soft_target_weight": 0.0,
}
SOFT_TOPK = 32  # the corpus builder's default --topk
# The trainer's default batch; the real shapes are those of the default target of trainers/train_drafter.py
# (SmolLM2-135M-Instruct, ``shapes``).
SHAPES = {
    "real": {"batch": 4, "seq": 448, "prompt": 64, "draft_vocab": 8192},
    "quick": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "num_hidden_layers": 8,
        "batch": 2,
        "seq": 64,
        "prompt": 8,
        "draft_vocab": 128,
    },
}
# The target config's fields a shape sets (the rest is the batch).
TARGET_SHAPE = tuple(name for name in SHAPES["quick"] if name not in SHAPES["real"])
BLOCK = 16


def shapes(quick: bool) -> dict:
    """``SHAPES["quick"]``, or the default target's ``TARGET_SHAPE`` read from its config with ``SHAPES["real"]``'s
    batch (the config needs the offline SmolLM2 package; ``--quick`` runs without it)."""
    if quick:
        return SHAPES["quick"]
    from adaflash_hf.assets import load_target_config

    config = load_target_config()
    return {name: getattr(config, name) for name in TARGET_SHAPE} | SHAPES["real"]


def top_label_vocab(
    labels: torch.Tensor, size: int, vocab_size: int, generator: torch.Generator
) -> torch.Tensor:
    """Sorted ids: the ``size`` most frequent labels (ties by id), filled up with random other ids (random labels are
    nearly all covered; a real draft vocabulary comes from corpus frequencies)."""
    counts = torch.bincount(labels[labels >= 0].flatten(), minlength=vocab_size)
    seen = counts.nonzero().flatten()
    frequent = seen[counts[seen].argsort(descending=True, stable=True)][:size]
    unseen = torch.ones(vocab_size, dtype=torch.bool)
    unseen[frequent] = False
    fill = unseen.nonzero().flatten()
    fill = fill[torch.randperm(fill.numel(), generator=generator)[: size - frequent.numel()]]
    return torch.cat([frequent, fill]).sort().values


def _setup(variant: str, shape: dict, context_layers: int):
    spec = {**VARIANT_DEFAULTS, **VARIANTS[variant]}
    target_config = LlamaConfig(**{k: shape[k] for k in TARGET_SHAPE}, tie_word_embeddings=True)
    torch.manual_seed(0)
    # No spare vocabulary row in SmolLM2: the drafter learns its mask embedding, as train_drafter.py builds it.
    config = AdaFlashConfig.for_target(
        target_config, num_hidden_layers=spec["drafter_layers"], block_size=BLOCK
    )
    config.target_layer_ids = build_target_layer_ids(shape["num_hidden_layers"], context_layers)
    drafter = AdaFlashDrafter(config).train()
    # Nothing is written: output_dir keeps its default and no Trainer is built.
    args = DrafterTrainingConfig(
        use_cpu=True,
        report_to="none",
        num_anchors=spec["num_anchors"],
        attention_layout=spec["attention_layout"],
        bf16=spec["bf16"],
        draft_vocab_size=shape["draft_vocab"] if spec["draft_vocab"] else None,
        loss_positions=spec["loss_positions"],
        soft_target_weight=spec["soft_target_weight"],
    )
    return spec, drafter, args


def measure_variant(
    variant: str, shape: dict, steps: int, warmup: int, threads: int, context_layers: int
) -> dict:
    """Median blocks/s and peak memory of ``steps`` training steps of ``variant`` at ``shape`` (``shapes``), in this
    process."""
    torch.set_num_threads(threads)
    spec, drafter, args = _setup(variant, shape, context_layers)
    batch, seq, hidden, vocab = shape["batch"], shape["seq"], shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq, dtype=torch.long)
    loss_mask[:, shape["prompt"] :] = 1
    features = torch.randn(batch, seq, drafter.fc.in_features, generator=g)
    embedding = torch.randn(vocab, hidden, generator=g) * hidden**-0.5  # tied embedding = lm_head
    draft_ids = None
    if args.draft_vocab_size:
        labels = torch.where(loss_mask.bool(), input_ids, torch.full_like(input_ids, IGNORE))
        draft_ids = top_label_vocab(labels, args.draft_vocab_size, vocab, g)
    soft = None
    if args.soft_target_weight > 0:
        # Log-probs of a top-k out of a larger distribution (their mass below 1), as the corpus records them.
        logprobs = torch.log_softmax(torch.randn(batch, seq, SOFT_TOPK + 1, generator=g), dim=-1)[
            ..., :SOFT_TOPK
        ]
        soft = SoftTargets(
            ids=torch.randint(0, vocab, (batch, seq, SOFT_TOPK), generator=g), logprobs=logprobs
        )
    groups = split_drafter_and_head(drafter)
    optimizer = two_group_adamw(groups, args)

    def step() -> int:
        anchors = sample_anchors(loss_mask, args.num_anchors, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, _, metrics = recipe_loss(
                drafter,
                drafter.config,
                args,
                input_ids,
                loss_mask,
                features,
                anchors,
                embedding,
                embedding,
                draft_ids,
                soft,
            )
        loss.backward()
        clip_each_group(groups, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return metrics["blocks"]

    base = memory_base()
    for _ in range(warmup):
        step()
    seconds, rates, blocks = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        trained = step()
        elapsed = time.perf_counter() - start
        seconds.append(elapsed)
        rates.append(trained / elapsed)
        blocks.append(trained)
    peak = memory_peak()
    return {
        "variant": variant,
        "attention_layout": spec["attention_layout"],
        "num_anchors": spec["num_anchors"],
        "blocks_per_step": statistics.median(blocks),
        "bf16": spec["bf16"],
        "draft_vocab_size": args.draft_vocab_size,
        "drafter_layers": spec["drafter_layers"],
        "loss_positions": spec["loss_positions"],
        "soft_target_weight": spec["soft_target_weight"],
        "seconds_per_step": statistics.median(seconds),
        "blocks_per_s": statistics.median(rates),
        "peak_rss_mib": peak / 2**20,
        "step_mib": (peak - base) / 2**20,
    }


def _measure_isolated(variant, shape, steps, warmup, threads, context_layers) -> dict:
    """One fresh process per variant, so the RSS high-water mark belongs to that variant alone; a variant whose
    process failed (killed for memory, say) is a row with its ``error``, and the others go on."""
    spec = [variant, shape, steps, warmup, threads, context_layers]
    return {"variant": variant} | in_fresh_process(
        "adaflash_hf.bench.train", "measure_variant", spec, threads
    )


def run(args) -> dict:
    measure = measure_variant if args.in_process else _measure_isolated
    shape = shapes(args.quick)
    entries = []
    for variant in args.variants:
        entry = measure(variant, shape, args.steps, args.warmup, args.threads, args.context_layers)
        entries.append(entry)
        print(f"{variant}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    today = next((e for e in entries if e["variant"] == "today" and "error" not in e), None)
    for entry in entries:
        ok = today is not None and "error" not in entry
        entry["speedup_vs_today"] = entry["blocks_per_s"] / today["blocks_per_s"] if ok else None
    settings = {
        "shape": "quick" if args.quick else "real",
        **shape,
        "context_layers": args.context_layers,
        "block_size": BLOCK,
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
    }
    return {"settings": settings, "variants": entries}


def format_table(results: dict) -> str:
    s = results["settings"]
    header = (
        "variant|layout|anchors|blocks/step|bf16|draft vocab|layers|CE positions|soft KL weight|s/step|blocks/s|"
        "speed-up vs today|peak RSS MiB|step MiB"
    ).split("|")
    rows = [
        [e["variant"], e["error"], *[""] * 12]
        if "error" in e
        else [e["variant"], e["attention_layout"], e["num_anchors"], f"{e['blocks_per_step']:.0f}"]
        + ["yes" if e["bf16"] else "no", e["draft_vocab_size"] or "full", e["drafter_layers"]]
        + [
            e.get("loss_positions") or "all",
            f"{e.get('soft_target_weight') or 0:g}",
            fmt(e["seconds_per_step"], ".3f"),
        ]
        + [fmt(e["blocks_per_s"], ".1f"), fmt(e["speedup_vs_today"]), fmt(e["peak_rss_mib"], ".0f")]
        + [fmt(e["step_mib"], ".0f")]
        for e in results["variants"]
    ]
    return (
        f"One drafter training step (forward, backward, clip, AdamW), {s['shape']} shapes: batch {s['batch']} x "
        f"{s['seq']} tokens, hidden {s['hidden_size']}, vocabulary {s['vocab_size']}, {s['context_layers']} context "
        f"layers, block {s['block_size']}; {s['threads']} thread(s), median of {s['steps']} steps\n\n"
        + table(header, rows)
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash bench train", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="default: all"
    )
    parser.add_argument(
        "--steps", type=int_at_least(1), default=3, help="timed steps per variant, after the warm-up"
    )
    parser.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed steps first")
    parser.add_argument(
        "--context-layers", type=int, choices=(3, 5), default=3, help="target layers the drafter reads"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a whole run in seconds (tests)")
    parser.add_argument(
        "--in-process", action="store_true", help="no fresh process per variant (peak RSS: running max)"
    )
    add_record_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_record_args(make_parser(), argv)
    results = run(args)
    return print_record(format_table(results), results, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
