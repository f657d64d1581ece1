"""The price of a verify forward: seconds of a target forward of n = 1..16 new tokens after ~200 tokens of context,
relative to a 1-token forward, for each way of running the target.

    adaflash bench verify-cost [--target smollm2-135m-instruct] [--context 200] [--max-tokens 16] [--repeats 5]
                               [--threads 1] [--arms fp32 bf16 prepared-bf16 prepared-fp32] [--output FILE.json]

Arms: ``fp32`` and ``bf16`` are the target as transformers runs it (SDPA attention; bf16 by ``.to``);
``prepared-bf16``, ``prepared-fp32`` and ``prepared-int4`` are ``adaflash_hf.prepare_target(dtype=...,
invariant=True)`` (the batch-invariant forward, checked; int4 on a 4-bit target's own codes); ``prepared`` is ``prepare_target``'s own choice on this host (``dtype="auto"``).
Each arm gets its own copy of the target. Per repeat and size, a 1-token forward is timed right before the n-token one
on the same cropped dynamic cache (as ``generate`` verifies), so a neighbour's load hits both sides of the ratio; the
record holds the median ratio, the median milliseconds per size, the CPU's model and bf16 flags, and the settings
``prepare_target`` chose. Speculative decoding pays where this curve is flat: a τ-2 drafter needs c(k) well under 2.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from tqdm.auto import tqdm

from adaflash_hf.bench.report import add_record_options, parse_record_args, print_record, table
from adaflash_hf.bench.targets import preparation
from adaflash_hf.cost_model import verify_timer
from adaflash_hf.launch import int_at_least
from adaflash_hf.prepared.cpu import cpu_record

ARMS = ("fp32", "bf16", "prepared-bf16", "prepared-fp32", "prepared-int4", "prepared")
DEFAULT_ARMS = ("fp32", "bf16", "prepared-bf16", "prepared-fp32")


def build_arm(target, arm: str):
    """A copy of ``target`` run the way ``arm`` says (module docstring), and what ``prepare_target`` chose (or None)."""
    from adaflash_hf.prepared.prepare import prepare_target

    if arm not in ARMS:
        raise ValueError(f"arm: expected one of {ARMS}, got {arm!r}")
    copied = copy.deepcopy(target)
    if arm in ("fp32", "bf16"):
        return copied.to(torch.float32 if arm == "fp32" else torch.bfloat16), None
    if arm == "prepared":
        prepare_target(copied)
    else:
        prepare_target(copied, dtype=arm.removeprefix("prepared-"), invariant=True)
    return copied, preparation(copied)


@torch.inference_mode()
def measure_curve(target, max_tokens: int = 16, context: int = 200, repeats: int = 5) -> dict:
    """Median seconds of forwards of 1..max_tokens new tokens after ``context`` tokens, and their median ratio to the
    1-token forward timed just before each (``cost_model.verify_timer``)."""
    sizes = range(1, max_tokens + 1)
    forward = verify_timer(target, sizes, context)
    seconds = {n: [] for n in sizes}
    ratios = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            one, many = forward(1), forward(n)
            seconds[n].append(many)
            ratios[n].append(many / one)
    return {
        "one_token_ms": 1e3 * statistics.median(seconds[1]),
        "ms": {n: 1e3 * statistics.median(s) for n, s in seconds.items()},
        "relative": {n: statistics.median(r) for n, r in ratios.items()},
    }


def run_verify_cost(target, arms=DEFAULT_ARMS, max_tokens=16, context=200, repeats=5, progress=True) -> dict:
    """The record: settings, the CPU, and per arm its curve and what ``prepare_target`` chose."""
    if max_tokens < 1 or context < 1 or repeats < 1:
        raise ValueError(
            f"max_tokens, context, repeats: expected >= 1 each, got {max_tokens}, {context}, {repeats}"
        )
    results = {}
    for arm in tqdm(arms, desc="verify cost", disable=not progress):
        built, prepared = build_arm(target, arm)
        results[arm] = {"prepared": prepared, **measure_curve(built, max_tokens, context, repeats)}
        del built
    return {
        "settings": {"context": context, "max_tokens": max_tokens, "repeats": repeats},
        "threads": torch.get_num_threads(),
        "cpu": cpu_record(),
        "torch": torch.__version__,
        "arms": results,
    }


def markdown_table(record: dict) -> str:
    """One row per size n: each arm's forward cost relative to its own 1-token forward; the 1-token ms first."""
    cpu, arms = record["cpu"], record["arms"]
    rows = [["1-token ms", *(f"{arms[a]['one_token_ms']:.1f}" for a in arms)]]
    rows += [
        [n, *(f"{arms[a]['relative'][n]:.2f}x" for a in arms)] for n in next(iter(arms.values()))["relative"]
    ]
    return (
        f"CPU: {cpu['model']}; bf16 units: {', '.join(cpu['bf16_units']) or 'none'} "
        f"(missing: {', '.join(cpu['missing_bf16_units']) or 'none'}); torch ISA {cpu['torch_capability']}; "
        f"{record['threads']} threads; {record['settings']['context']} tokens of context.\n\n"
        + table(["n", *arms], rows, "r" * (len(arms) + 1))
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash bench verify-cost",
        description="Cost of a target forward of n = 1..16 new tokens relative to a 1-token forward: fp32 and bf16 "
        "as transformers runs them, and the prepared (batch-invariant) target.",
    )
    parser.add_argument("--target", default="smollm2-135m-instruct", help="adaflash_hf.assets.load_target's")
    parser.add_argument(
        "--context", type=int_at_least(1), default=200, help="tokens before the forward (200)"
    )
    parser.add_argument(
        "--max-tokens", type=int_at_least(1), default=16, help="largest forward, n = 1.. (16)"
    )
    parser.add_argument("--repeats", type=int_at_least(1), default=5, help="timed pairs per size (5)")
    parser.add_argument(
        "--arms", nargs="+", default=list(DEFAULT_ARMS), choices=ARMS, help="ways to run the target"
    )
    add_record_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_record_args(make_parser(), argv)
    from adaflash_hf.assets import load_target

    target, _ = load_target(args.target)
    record = run_verify_cost(target, args.arms, args.max_tokens, args.context, args.repeats)
    return print_record(markdown_table(record), record, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
