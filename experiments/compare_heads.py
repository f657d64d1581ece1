"""Two drafters side by side in `generate`, interleaved per prompt and repeat in alternating order (e.g. a calibrated
length head against the trained one). Greedy, every output checked against the first drafter's (both are lossless,
so they must agree token for token); prints and writes per-domain median time ratios and τ.

    python experiments/compare_heads.py examples/drafters/smollm2-135m-adaflash runs/calib/drafter \
        --length-mode adaptive --out runs/calibrate_head_generate.json

`--from-end` takes the prompts from the end of each held-out shuffle, where `adaflash bench opd` takes its evaluation
prompts: prompts an online run never served (e.g. the online against the frozen length head after OPD).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="reference drafter folder")
    parser.add_argument("second", help="drafter folder compared with it")
    parser.add_argument("--length-mode", default="adaptive", choices=("adaptive", "goodput", "fixed", "auto"))
    parser.add_argument("--domains", nargs="+", default=["chat", "code", "math"])
    parser.add_argument("--prompts-per-domain", type=int, default=2)
    parser.add_argument("--from-end", action="store_true", help="the last prompts of each held-out shuffle")
    parser.add_argument(
        "--seed", type=int, default=0, help="the held-out shuffle's seed (an OPD config's seed)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="JSON to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from adaflash_hf import AdaFlashDrafter
    from adaflash_hf.assets import load_target
    from adaflash_hf.bench.machine import cpu_flags
    from adaflash_hf.data import load_domain, prompt_ids

    target, tokenizer = load_target()
    dtype = next(target.parameters()).dtype
    drafters = [AdaFlashDrafter.from_pretrained(p).to(dtype).eval() for p in (args.first, args.second)]
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
        adaflash_length_mode=args.length_mode,
    )
    prompts = []
    for domain in args.domains:
        rows = load_domain(domain, "heldout", n=len(load_domain(domain, "heldout")), seed=args.seed)
        chosen = (
            range(len(rows) - args.prompts_per_domain, len(rows))
            if args.from_end
            else range(args.prompts_per_domain)
        )
        prompts += [(domain, rows[i]) for i in chosen]
    warmup = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 16})
    for drafter in drafters:  # one-time costs (first forwards, allocations) out of the timings
        with torch.inference_mode():
            target.generate(
                prompt_ids(tokenizer, prompts[0][1]), assistant_model=drafter, generation_config=warmup
            )
    rows = []
    for domain, row in tqdm(prompts, desc="prompts", unit="prompt"):
        ids = prompt_ids(tokenizer, row)
        times, taus, outputs = [[], []], [None, None], [None, None]
        for repeat in range(args.repeats):
            order = (0, 1) if repeat % 2 == 0 else (1, 0)  # alternate: neither drafter always runs first
            for i in order:
                drafter = drafters[i]
                started = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(ids, assistant_model=drafter, generation_config=config)
                times[i].append(time.perf_counter() - started)
                taus[i], outputs[i] = drafter.last_stats.tau, out
        if not torch.equal(outputs[0], outputs[1]):
            raise AssertionError(f"{domain}/{row['id']}: the two drafters' greedy outputs differ")
        rows.append(
            {
                "domain": domain,
                "prompt": row["id"],
                "seconds": [statistics.median(t) for t in times],
                "tau": taus,
                "ratio": statistics.median(times[1]) / statistics.median(times[0]),
            }
        )
    summary = {
        domain: {
            "time_ratio_second_over_first": statistics.geometric_mean(
                r["ratio"] for r in rows if r["domain"] == domain
            ),
            "tau": [statistics.mean(r["tau"][i] for r in rows if r["domain"] == domain) for i in (0, 1)],
        }
        for domain in args.domains
    }
    result = {"settings": {**vars(args), "cpu": cpu_flags()}, "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
