"""Where one wave of requests at full concurrency goes, step by step: the engine's plain decoding and the default
(hybrid goodput) alternating in one process, each step's stats beside what goodput's plan expected of it.

    .venv/bin/python experiments/wave_trace.py --rounds 3 --out experiments/results/<host>/wave_trace/trace.json
    .venv/bin/python experiments/wave_trace.py --rounds 3 --plain-from 12 --out ...   # the drafter and lookups
                                                                                     # kept out at >= 12 running
    .venv/bin/python experiments/wave_trace.py --rounds 3 --requests 48 --concurrency 16 --max-slowdown none ...

The prepared target as `adaflash bench serve --prepared --dtype auto` runs it, the shipped drafter, the first
`--requests` held-out prompts, `--concurrency` of them in flight (default: all; fewer: finished requests replaced by
waiting ones), 64 new tokens, a fresh engine per wave; the default's `max_slowdown` is `--max-slowdown` (0.03;
`none`: no bound). Per wave it prints the steps grouped by
phase (prefill or decode; 12-16, 4-11, 1-3 requests running): seconds, committed tokens and tokens a second, drafts,
accepted drafts and the plan's expected accepted drafts (lookup and drafter blocks apart), and per decode step the
time before the target's forward (drafting and planning), the forward, and after it (commit). A figure, not a test:
nothing else may run meanwhile.
"""

import argparse
import json
import time

import adaflash_hf.policy as policy
from adaflash_hf.bench import serve as bench_serve
from adaflash_hf.bench.targets import load_run_target
from adaflash_hf.drafting import DraftingSettings
from adaflash_hf.serving.admission import AdmissionConfig
from adaflash_hf.serving.cache import packed_forward_timer
from adaflash_hf.serving.engine import AdaFlashEngine
from adaflash_hf.serving.requests import SamplingParams

STATS = (
    "running",
    "prefill_tokens",
    "draft_tokens",
    "verify_tokens",
    "accepted",
    "committed",
    "verifies",
    "lookup_verifies",
    "lookup_accepted",
    "drafter_seconds",
    "target_seconds",
    "seconds",
)


def record_plans(log: list) -> None:
    """Keep, for every round goodput plans, its expected accepted drafts by source."""
    plan_round, choices = policy.plan_round, policy.GoodputPolicy._choices
    last = {}

    def planned(options, **kwargs):
        plan = plan_round(options, **kwargs)
        if "budget" in kwargs:  # the round's plan (the lookup-alone checks plan without a budget)
            last["options"] = options
        return plan

    def chosen(self, round_, blocks, plan, kinds, budget):
        expected = {"diffusion": 0.0, "lookup": 0.0}
        for i, (length, source) in enumerate(zip(plan.lengths, plan.sources)):
            if source is not None and length:
                expected[kinds[i][source]] += sum(last["options"][i][source][:length])
        log.append(expected)
        return choices(self, round_, blocks, plan, kinds, budget)

    policy.plan_round, policy.GoodputPolicy._choices = planned, chosen


def plain_from(running: int) -> None:
    """Goodput plans no drafts (and no lookups) while ``running`` or more requests run."""
    start = policy.GoodputPolicy.start

    def gated(self, slots, step):
        round_ = start(self, slots, step)
        if step.running < running:
            return round_
        return policy.Round(round_.slots, step, (False,) * len(slots), ((),) * len(slots), ((),) * len(slots))

    policy.GoodputPolicy.start = gated


def wave(
    target, drafter, prompts, mode: str, concurrency: int, max_new_tokens: int, plans: list, max_slowdown=0.03
) -> dict:
    admission = AdmissionConfig(
        max_running=concurrency, token_budget=concurrency * 16 + max(len(p) for p in prompts)
    )
    source, length_mode = bench_serve.ENGINE_SETTINGS[mode]
    drafting = None
    if mode != "plain":
        drafting = DraftingSettings(draft_source=source, length_mode=length_mode, max_slowdown=max_slowdown)
    engine = AdaFlashEngine(
        target, drafter if mode != "plain" else None, admission=admission, drafting=drafting
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    steps, finished = [], {}
    started = time.perf_counter()
    while engine.has_unfinished():
        before = len(plans)
        finished |= {o.request_id: o.request for o in engine.step() if o.finished}
        row = {name: getattr(engine.stats[-1], name) for name in STATS}
        row["expected"] = plans[-1] if len(plans) > before else None
        steps.append(row)
    seconds = time.perf_counter() - started
    outputs = [finished[i].output for i in ids]
    return {
        "mode": mode,
        "seconds": seconds,
        "generated": sum(map(len, outputs)),
        "steps": steps,
        "outputs": outputs,
    }


def phase(step: dict) -> tuple[str, str]:
    n = step["running"]
    return (
        "prefill" if step["prefill_tokens"] else "decode",
        "12-16" if n >= 12 else "4-11" if n >= 4 else "1-3",
    )


def summary(result: dict) -> list[str]:
    lines = [
        f"{result['mode']}: {result['generated'] / result['seconds']:.1f} tok/s, {len(result['steps'])} steps, "
        f"{result['seconds']:.2f} s"
    ]
    groups = {}
    for step in result["steps"]:
        g = groups.setdefault(phase(step), dict(steps=0, seconds=0.0, committed=0, drafts=0, accepted=0))
        g["steps"] += 1
        g["seconds"] += step["seconds"]
        for name in ("committed", "accepted"):
            g[name] += step[name]
        g["drafts"] += step["draft_tokens"]
    for key, g in sorted(groups.items()):
        lines.append(
            f"  {key[0]:7s} {key[1]:5s}: {g['steps']:3d} steps {g['seconds']:.2f} s, {g['committed']} committed "
            f"({g['committed'] / g['seconds']:.0f} tok/s), {g['drafts']} drafts, {g['accepted']} accepted"
        )
    planned = [s for s in result["steps"] if s["expected"]]
    if planned:
        lookup = sum(s["expected"]["lookup"] for s in planned)
        block = sum(s["expected"]["diffusion"] for s in planned)
        lookup_real = sum(s["lookup_accepted"] for s in result["steps"])
        block_real = sum(s["accepted"] for s in result["steps"]) - lookup_real
        lines.append(
            f"  accepted drafts, expected / realised: lookup {lookup:.0f} / {lookup_real}, "
            f"drafter blocks {block:.0f} / {block_real}"
        )
    decode = [s for s in result["steps"] if not s["prefill_tokens"] and s["running"] >= 12]
    if decode:
        before = sum(s["drafter_seconds"] for s in decode) / len(decode)
        forward = sum(s["target_seconds"] for s in decode) / len(decode)
        after = sum(s["seconds"] for s in decode) / len(decode) - before - forward
        lines.append(
            f"  decode steps at >= 12 running, a step: {1e3 * before:.1f} ms before the target's forward, "
            f"{1e3 * forward:.1f} ms in it, {1e3 * after:.1f} ms after"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="waves of each mode after one untimed pair (3)")
    parser.add_argument("--requests", type=int, default=16, help="requests in the wave (16)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all)")
    parser.add_argument(
        "--max-slowdown",
        type=lambda v: None if v == "none" else float(v),
        default=0.03,
        help="the default's max_slowdown (0.03; none: no bound)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--plain-from", type=int, default=None, help="no drafts while this many requests run")
    parser.add_argument("--out", required=True, help="where the per-step trace goes (JSON)")
    args = parser.parse_args()
    concurrency = args.concurrency or args.requests
    argv = ["--prepared", "--dtype", "auto", "--concurrency", str(concurrency)]
    run_parser = bench_serve.make_parser()
    run_args = bench_serve.parse_run_args(run_parser, argv, bench_serve.QUICK, bench_serve.FULL, "modes")
    bench_serve.start_run(run_args.threads)
    drafter = bench_serve._load_drafter(run_args, run_parser)
    target, tokenizer, _, settings = load_run_target(run_args, "serve", argv, timer=packed_forward_timer)
    drafter = drafter.to(next(target.parameters()).dtype)
    prompts = bench_serve.heldout_prompts(tokenizer, args.requests, 384)
    plans: list = []
    record_plans(plans)
    if args.plain_from is not None:
        plain_from(args.plain_from)
    results = []
    for round_ in range(-1, args.rounds):
        for mode in ("plain", "hybrid_goodput"):
            result = wave(
                target, drafter, prompts, mode, concurrency, args.max_new_tokens, plans, args.max_slowdown
            )
            if mode == "plain":
                reference = result["outputs"]
            elif result["outputs"] != reference:
                raise SystemExit("the default's texts differ from plain decoding's")
            if round_ >= 0:
                results.append(result)
                print("\n".join(summary(result)), flush=True)
    with open(args.out, "w") as f:
        options = {
            "plain_from": args.plain_from,
            "concurrency": concurrency,
            "max_slowdown": args.max_slowdown,
        }
        json.dump({"settings": settings, **options, "waves": results}, f)


if __name__ == "__main__":
    main()
