"""The main job on its embedded default: SmolLM2-135M-Instruct with the shipped AdaFlash drafter.

    make demo                      # sets up .venv, then runs this file
    python examples/demo.py --prompts-per-domain 1 --max-new-tokens 64

For a few held-out prompts per domain (chat, code, math) it runs plain greedy ``generate`` and
``generate(assistant_model=drafter)``, prints the answer, checks the two outputs are identical token for token, and
prints tau (committed tokens per target forward), the mean verify length and the speedup. Exits non-zero if any
output differs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import adaflash_hf
from adaflash_hf.assets import load_target
from adaflash_hf.data import load_domain, prompt_ids

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-adaflash"


def timed_generate(target, prompt_ids, max_new_tokens, **kwargs):
    started = time.perf_counter()
    out = target.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="Drafter folder or Hub id.")
    parser.add_argument("--prompts-per-domain", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(
        f"adaflash-hf {adaflash_hf.__version__}: loading SmolLM2-135M-Instruct (offline GGUF) and {args.drafter}"
    )
    target, tokenizer = load_target()
    drafter = adaflash_hf.AdaFlashDrafter.from_pretrained(args.drafter, dtype=target.dtype).eval()
    drafter.check_target(target)

    all_equal = True
    speedups, taus = [], []
    for domain in ("chat", "code", "math"):
        for row in load_domain(domain, "heldout", n=args.prompts_per_domain, seed=0):
            ids = prompt_ids(tokenizer, row)
            plain, plain_seconds = timed_generate(target, ids, args.max_new_tokens)
            fast, fast_seconds = timed_generate(target, ids, args.max_new_tokens, assistant_model=drafter)
            stats = drafter.last_stats
            equal = torch.equal(plain, fast)
            all_equal &= equal
            speedups.append(plain_seconds / fast_seconds)
            taus.append(stats.tau)
            answer = tokenizer.decode(fast[0, ids.shape[1] :], skip_special_tokens=True).strip()
            print(f"\n=== {domain}: {row['prompt'][:100]!r}")
            print(answer[:600] + (" [...]" if len(answer) > 600 else ""))
            print(
                f"--- identical to plain greedy: {equal} | tau {stats.tau:.2f} | mean verify length "
                f"{stats.mean_verify_length:.1f} | {plain_seconds:.1f}s plain vs {fast_seconds:.1f}s AdaFlash "
                f"({speedups[-1]:.2f}x)"
            )
    print(
        f"\nAll outputs identical to plain greedy: {all_equal}. Median tau {statistics.median(taus):.2f}, "
        f"median speedup {statistics.median(speedups):.2f}x over {len(taus)} prompts."
    )
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
