"""The main job on its embedded default: SmolLM2-135M-Instruct with the shipped AdaFlash drafter.

    make demo                      # sets up .venv, then runs this file
    python examples/demo.py --prompts-per-domain 1 --max-new-tokens 64

The target goes through ``adaflash_hf.prepare_target`` first (``--dtype auto``): timed on this CPU, bf16 with a
batch-invariant forward on a CPU with bf16 units (``avx512_bf16``, ``amx_bf16``), where verifying several tokens costs
about what one costs, or the same forward on the target's own 4-bit codes (the offline GGUF is 4-bit), whichever
serves most; fp32 elsewhere. For a few held-out prompts per domain (chat, code, math) it runs plain greedy ``generate`` of that
target and two AdaFlash modes side by side: the default (``adaflash_length_mode="auto"``: goodput under greedy; ``adaflash_draft_source="auto"``: each
round verifies the drafter's block or a prompt-lookup continuation) and the drafter alone
(``adaflash_draft_source="diffusion"``: block drafts only). It
prints the answer, checks each mode's output is identical to plain greedy token for token, and prints tau (committed
tokens per target forward) and the speed-up per prompt, their medians per mode, and what the figure means on this CPU
(the measured price of a verify forward). Exits non-zero if any output differs.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import adaflash_hf
from adaflash_hf.assets import load_target
from adaflash_hf.cost_model import cost_model_for
from adaflash_hf.data import load_domain, prompt_ids
from adaflash_hf.prepared.prepare import is_prepared

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-adaflash"
# name -> (what it runs, generation-config fields)
MODES = {
    "default": (
        "the defaults: goodput under greedy, the drafter's block or a prompt-lookup continuation",
        {},
    ),
    "diffusion": (
        'adaflash_draft_source="diffusion": the drafter\'s block only',
        {"adaflash_draft_source": "diffusion"},
    ),
}
WARMUP_TOKENS = 16


def timed_generate(target, ids, max_new_tokens, drafter=None, **settings):
    config = copy.deepcopy(target.generation_config)
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    for name, value in settings.items():
        setattr(config, name, value)
    started = time.perf_counter()
    out = target.generate(ids, generation_config=config, assistant_model=drafter)
    return out, time.perf_counter() - started


def verify_price(target) -> str:
    """The measured cost of a verify forward relative to a 1-token one, as the goodput cost model learnt it here."""
    curve = cost_model_for(target, "generate").relative_curve(1)
    sizes = [n for n in curve if n > 1]
    if not sizes:
        return "no verify forward was measured"
    first, last = min(sizes), max(sizes)
    text = f"a {first}-token verify forward costs {curve[first]:.2f}x a 1-token one"
    return text + (f" ({last} tokens: {curve[last]:.2f}x)" if last != first else "")


def describe_target(target) -> str:
    preparation = is_prepared(target)
    if preparation is None:
        return "fp32 as loaded"
    invariant = ", batch-invariant forward" if preparation.invariant else ""
    return f"prepare_target: {preparation.reason}{invariant}"


def run_prompt(
    target, tokenizer, drafter, domain, row, max_new_tokens
) -> dict[str, tuple[bool, float, float]]:
    """Plain, then each mode, on one prompt; prints the answer and per mode (identical, tau, speed-up)."""
    ids = prompt_ids(tokenizer, row)
    plain, plain_seconds = timed_generate(target, ids, max_new_tokens)
    answer = tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True).strip()
    print(f"\n=== {domain}: {row['prompt'][:100]!r}")
    print(answer[:600] + (" [...]" if len(answer) > 600 else ""))
    results = {}
    for mode, (_, settings) in MODES.items():
        out, seconds = timed_generate(target, ids, max_new_tokens, drafter, **settings)
        stats = drafter.last_stats
        results[mode] = (torch.equal(plain, out), stats.tau, plain_seconds / seconds)
        lookup = stats.source_share.get("lookup", 0.0)
        print(
            f"--- {mode + ':':8} identical to plain greedy: {results[mode][0]} | tau {stats.tau:.2f} | "
            f"lookup rounds {lookup:.0%} | {plain_seconds:.1f}s plain vs {seconds:.1f}s ({results[mode][2]:.2f}x)"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="Drafter folder or Hub id.")
    parser.add_argument("--prompts-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "int4"),
        default="auto",
        help="auto: adaflash_hf.prepare_target's choice, timed here (bf16 with the batch-invariant forward, or on the "
        "target's 4-bit codes, where this CPU has bf16 units and it is faster, else fp32); fp32: the target as loaded",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(
        f"adaflash-hf {adaflash_hf.__version__}: loading SmolLM2-135M-Instruct (offline GGUF) and {args.drafter}"
    )
    target, tokenizer = load_target(fresh=True)  # a private copy: prepare_target changes the model in place
    if args.dtype != "fp32":
        adaflash_hf.prepare_target(target, dtype=args.dtype)
    print(
        f"target: {describe_target(target)}; plain greedy below is this target's own, what lossless compares with"
    )
    drafter = adaflash_hf.AdaFlashDrafter.from_pretrained(args.drafter, dtype=target.dtype).eval()
    drafter.check_target(target)
    rows = [
        (d, row)
        for d in ("chat", "code", "math")
        for row in load_domain(d, "heldout", args.prompts_per_domain)
    ]
    # One short untimed call per method first: the first calls pay one-off costs (and the cost model's first sizes).
    warmup_ids = prompt_ids(tokenizer, rows[0][1])
    timed_generate(target, warmup_ids, WARMUP_TOKENS)
    for _, settings in MODES.values():
        timed_generate(target, warmup_ids, WARMUP_TOKENS, drafter, **settings)

    per_prompt = [run_prompt(target, tokenizer, drafter, d, row, args.max_new_tokens) for d, row in rows]
    all_equal = all(equal for results in per_prompt for equal, _, _ in results.values())
    print(
        f"\nAll outputs identical to plain greedy: {all_equal} ({len(rows)} prompts, greedy, {args.max_new_tokens} "
        f"new tokens, {args.threads} thread(s)). Medians per mode:"
    )
    for mode, (what, _) in MODES.items():
        taus = [results[mode][1] for results in per_prompt]
        speedups = [results[mode][2] for results in per_prompt]
        print(
            f"  {mode:8} tau {statistics.median(taus):.2f}, speed-up {statistics.median(speedups):.2f}x  ({what})"
        )
    print(
        f"On this CPU (measured in this run) {verify_price(target)}: a draft pays only when enough of it is accepted "
        "to beat that price, so the drafter's blocks alone stay near plain speed where few of them are accepted, and "
        'the default gains where lookup continuations run long (repeated text). BENCHMARKS.md ("Generate") has '
        "the figures at 256 tokens per prompt."
    )
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
