"""Throughput of the batched engine under concurrency: plain batched decoding vs fixed-length DFlash vs AdaFlash vs
hybrid (AdaFlash with ``draft_source="hybrid"``: per request and step, the block or a lookup continuation), and the
same two with ``length_mode="goodput"`` (``goodput``, ``hybrid_goodput``: k from 0 up per request by the step's
expected committed tokens per second on this machine, ``adaflash_hf.drafting``).

    adaflash bench serve [--drafter DIR|random] [--concurrency 1 2 4 8 16 32] [--requests-per-level 32]
                         [--max-new-tokens 128] [--modes plain dflash adaflash hybrid] [--repeats 1] [--threads 2]
                         [--output-dir runs/bench_serve] [--dtype fp32|bf16|auto] [--prepared]
                         [--plain-baselines fp32 bf16] [--warmup-waves 1]
    python -m adaflash_hf.bench.serve --quick          # smoke run: concurrency 1 2, 2 requests, 16 tokens

Requests are held-out prompts (``adaflash_hf.data``: chat, code, math in turn, chat template, at most
``--max-prompt-tokens``), greedy. At concurrency c the engine runs with ``max_running = c`` and
max(requests-per-level, c) requests queued at once (closed loop: a finished request's slot goes to the next
one), and a token budget that never binds (c·block_size + the longest prompt), so the modes differ only in
their drafts. All modes run in one process, interleaved per repeat (plain, dflash, adaflash, hybrid, then
again), after one warm-up request per mode and, at each level, ``--warmup-waves`` untimed rounds (1; 0 with
``--quick``): a process's first wave at a load meets what a running server met long before (the machine checks
of new shapes, the cost and acceptance models' first samples at that load), and costs drafting 5-10% of that wave
at 16 requests on one Intel Xeon; its tokens/s is kept (``first_wave_tokens_per_s``). ``--drafter random`` builds an untrained drafter: timing smoke
tests only (nothing gets accepted).

Per concurrency and mode: throughput = generated tokens / wall seconds (median over repeats); speed-up = that
over plain's at the same concurrency; τ = tokens committed per verify (accepted + 1); mean verify length =
drafts verified per verify; acceptance rate = accepted / verified drafts; lookup share = verifies whose drafts came
from lookup (hybrid), with their own acceptance rate. ``lossless`` checks every request's
tokens against plain's (``exact``: the share of requests equal). ``--dtype``, ``--prepared`` and
``--plain-baselines``: ``bench.targets``; ``vs fastest plain`` is each mode's speed-up against the fastest plain
baseline at that concurrency (``experiments/goals.py serve`` grades the serving goals on ``results.json``).
Outputs in ``--output-dir``: ``results.json``, ``table.md`` and ``speedup_vs_concurrency.png`` (and
``cost_curve.png``, the goodput cost model's measured target-forward seconds by tokens per running-request bucket).
Exit status 1 when a mode is not lossless.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers.utils import logging

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.bench import report
from adaflash_hf.bench.machine import cost_curve_figure
from adaflash_hf.bench.report import column_table, line_plot, percent
from adaflash_hf.bench.targets import (
    add_run_options,
    default_drafter,
    load_run_target,
    machine_settings,
    parse_run_args,
    start_run,
    timed_baselines,
)
from adaflash_hf.launch import int_at_least
from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams
from adaflash_hf.serving.cache import packed_forward_timer
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)

DOMAINS = ("chat", "code", "math")
QUICK = {
    "concurrency": [1, 2],
    "requests_per_level": 2,
    "max_new_tokens": 16,
    "repeats": 1,
    "warmup_waves": 0,
}
FULL = {
    "concurrency": [1, 2, 4, 8, 16, 32],
    "requests_per_level": 32,
    "max_new_tokens": 128,
    "repeats": 1,
    "warmup_waves": 1,
}
WARMUP_TOKENS = 8
# bench mode -> (draft source, length mode); "plain" runs without a drafter
ENGINE_SETTINGS = {
    "plain": ("diffusion", None),
    "dflash": ("diffusion", "fixed"),
    "adaflash": ("diffusion", "adaptive"),
    "hybrid": ("hybrid", "adaptive"),
    "goodput": ("diffusion", "goodput"),
    "hybrid_goodput": ("hybrid", "goodput"),
}
MODES = tuple(ENGINE_SETTINGS)
# The step stats (``StepStats``) a level's record sums over its steps.
SUMMED_STATS = (
    "verifies committed draft_tokens accepted lookup_verifies lookup_accepted zero_length_verifies".split()
)
SUMMED_STATS += ["skipped_drafter", "drafter_seconds", "target_seconds"]


def run_level(
    target,
    drafter,
    mode: str,
    prompts: list[torch.Tensor],
    concurrency: int,
    max_new_tokens: int,
    lookup_min_prob: float = 0.0,
):
    """Serve ``prompts`` at ``concurrency``; returns the timing, the summed step stats and the outputs."""
    block = drafter.config.block_size if drafter is not None else 16
    admission = AdmissionConfig(
        max_running=concurrency, token_budget=concurrency * block + max(len(p) for p in prompts)
    )
    source, length_mode = ENGINE_SETTINGS[mode]
    engine = AdaFlashEngine(
        target,
        drafter if mode != "plain" else None,
        admission=admission,
        draft_source=source,
        lookup_min_prob=lookup_min_prob if source == "hybrid" else 0.0,
        length_mode=length_mode,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ids = [engine.add_request(p, params) for p in prompts]
    finished, stats = {}, []  # every step's stats: the engine keeps only a window of them
    started = time.perf_counter()
    while engine.has_unfinished():
        finished |= {output.request_id: output.request for output in engine.step() if output.finished}
        stats.append(engine.stats[-1])  # with nothing aborted, every step records its stats
    seconds = time.perf_counter() - started
    outputs = [finished[i].output for i in ids]
    sums = {name: sum(getattr(s, name) for s in stats) for name in SUMMED_STATS}
    return {
        "seconds": seconds,
        "generated": sum(len(o) for o in outputs),
        "steps": len(stats),
        "mean_running": statistics.fmean(s.running for s in stats),
        **sums,
    }, outputs


def _summarise(
    concurrency: int, mode: str, runs: list[dict], plain_tps: float, lossless: bool, requests: int
) -> dict:
    tps = statistics.median(r["generated"] / r["seconds"] for r in runs)
    first = runs[0]  # greedy: every repeat takes the same steps, only the times differ
    return {
        "concurrency": concurrency,
        "mode": mode,
        "requests": requests,
        "tokens_per_s": tps,
        "speedup_vs_plain": tps / plain_tps,
        "tau": tau_of(first["committed"], first["verifies"]),
        "mean_verify_length": first["draft_tokens"] / first["verifies"] if first["verifies"] else 0.0,
        "acceptance_rate": first["accepted"] / first["draft_tokens"] if first["draft_tokens"] else 0.0,
        "lookup_share": first["lookup_verifies"] / first["verifies"] if first["verifies"] else 0.0,
        "zero_length_share": first["zero_length_verifies"] / first["verifies"] if first["verifies"] else 0.0,
        "skipped_drafter_share": first["skipped_drafter"] / first["verifies"] if first["verifies"] else 0.0,
        "steps": first["steps"],
        "mean_running": first["mean_running"],
        "drafter_share": statistics.median(r["drafter_seconds"] / r["seconds"] for r in runs),
        "seconds": [r["seconds"] for r in runs],
        "lossless": lossless,
    }


def _check_run(drafter, prompts, concurrency, modes, requests_per_level, max_new_tokens, repeats) -> None:
    if "plain" not in modes or not set(modes) <= set(MODES):
        raise ValueError(f"modes: expected a subset of {MODES} including 'plain', got {list(modes)}")
    if drafter is None and set(modes) != {"plain"}:
        raise ValueError(f"drafter: expected an AdaFlashDrafter for modes {list(modes)}, got None")
    if repeats < 1 or requests_per_level < 1 or max_new_tokens < 2:
        raise ValueError(
            f"repeats, requests_per_level, max_new_tokens: expected >= 1, >= 1, >= 2, got {repeats}, "
            f"{requests_per_level}, {max_new_tokens}"
        )
    needed = max(max(concurrency), requests_per_level)
    if len(prompts) < needed:
        raise ValueError(
            f"prompts: expected at least {needed} (requests at the highest level), got {len(prompts)}"
        )


def _run_level_repeats(
    target, drafter, modes, prompts, level, max_new_tokens, repeats, lookup_min_prob, timed, warmup_waves=0
):
    """Every mode and timed baseline at one concurrency, interleaved per repeat, after ``warmup_waves`` untimed
    rounds of the same (returned third: each mode's tokens/s in its first wave at this level, or None)."""
    runs = {mode: [] for mode in modes}
    baseline_runs = {name: [] for name in timed}
    outputs, first_waves = {}, {}
    for repeat in range(-warmup_waves, repeats):
        for mode in modes:
            run, outputs[mode] = run_level(
                target, drafter, mode, prompts, level, max_new_tokens, lookup_min_prob
            )
            tokens_per_s = run["generated"] / run["seconds"]
            first_waves.setdefault(mode, tokens_per_s)
            if repeat >= 0:
                runs[mode].append(run)
            logger.info(f"c={level} {mode}{' (warm-up)' if repeat < 0 else ''}: {tokens_per_s:.1f} tok/s")
        for name, model in timed.items():
            run = run_level(model, None, "plain", prompts, level, max_new_tokens)[0]
            if repeat >= 0:
                baseline_runs[name].append(run)
    return runs, baseline_runs, outputs, (first_waves if warmup_waves else {})


def _level_rows(level, modes, runs, baseline_runs, outputs, baselines, requests, first_waves) -> list[dict]:
    """One summary row per mode at this level, against plain and against the fastest plain baseline."""
    plain_tps = statistics.median(r["generated"] / r["seconds"] for r in runs["plain"])
    baseline_tps = {
        name: statistics.median(r["generated"] / r["seconds"] for r in baseline_runs[name])
        if name in baseline_runs
        else plain_tps
        for name in baselines
    }
    fastest = max(baseline_tps, key=baseline_tps.get)
    rows = []
    for mode in modes:
        lossless = outputs[mode] == outputs["plain"]
        row = _summarise(level, mode, runs[mode], plain_tps, lossless, requests)
        row.update(
            fastest_plain=fastest,
            plain_baseline_tokens_per_s=baseline_tps,
            speedup_vs_fastest_plain=row["tokens_per_s"] / baseline_tps[fastest],
            exact_rate=statistics.fmean(o == p for o, p in zip(outputs[mode], outputs["plain"])),
            first_wave_tokens_per_s=first_waves.get(mode),
        )
        rows.append(row)
    return rows


def run_benchmark(
    target,
    drafter: AdaFlashDrafter | None,
    prompts: list[torch.Tensor],
    concurrency: list[int],
    modes: tuple[str, ...] = MODES,
    requests_per_level: int = 32,
    max_new_tokens: int = 128,
    repeats: int = 1,
    lookup_min_prob: float = 0.0,
    baselines: dict | None = None,
    warmup_waves: int = 0,
) -> dict:
    """Every mode at every concurrency, interleaved per repeat; the results dict of the module docstring.
    ``lookup_min_prob`` is the hybrid mode's engine setting. ``baselines``: the plain batched decodings timed beside
    the modes (``targets.plain_baselines``); per level the fastest is each row's ``fastest_plain``.
    ``warmup_waves``: untimed rounds of every mode before each level's timed ones (``first_wave_tokens_per_s``)."""
    if not isinstance(warmup_waves, int) or warmup_waves < 0:
        raise ValueError(f"warmup_waves: expected an int >= 0, got {warmup_waves!r}")
    baselines, timed = timed_baselines(baselines)
    _check_run(drafter, prompts, concurrency, modes, requests_per_level, max_new_tokens, repeats)
    modes = tuple(m for m in MODES if m in modes)  # plain first: it is the reference
    for mode in modes:
        run_level(target, drafter, mode, prompts[:1], 1, WARMUP_TOKENS, lookup_min_prob)
    for model in timed.values():
        run_level(model, None, "plain", prompts[:1], 1, WARMUP_TOKENS)
    summary = []
    for level in concurrency:
        level_prompts = prompts[: max(requests_per_level, level)]
        runs, baseline_runs, outputs, first_waves = _run_level_repeats(
            target,
            drafter,
            modes,
            level_prompts,
            level,
            max_new_tokens,
            repeats,
            lookup_min_prob,
            timed,
            warmup_waves,
        )
        summary += _level_rows(
            level, modes, runs, baseline_runs, outputs, baselines, len(level_prompts), first_waves
        )
    return {
        "settings": {
            "modes": list(modes),
            "concurrency": list(concurrency),
            "requests_per_level": requests_per_level,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "warmup_waves": warmup_waves,
            "block_size": None if drafter is None else drafter.config.block_size,
            "gamma": None if drafter is None else drafter.config.length_head_gamma,
            "lookup_min_prob": lookup_min_prob,
            "plain_baselines": list(baselines),
            **machine_settings(),
        },
        "ok": all(row["lossless"] for row in summary),
        "cost_curve": _cost_curves(target, concurrency) if {"goodput", "hybrid_goodput"} & set(modes) else {},
        "summary": summary,
    }


def _cost_curves(target, concurrency: list[int]) -> dict:
    """The engine cost model's relative curve per running-request bucket measured in this run."""
    from adaflash_hf.cost_model import cost_model_for

    cost = cost_model_for(target, "engine")
    curves = {str(level): cost.relative_curve(level) for level in concurrency}
    return {level: curve for level, curve in curves.items() if curve}


# The table's columns: header -> the cell of a summary row.
COLUMNS = {
    "concurrency": lambda r: r["concurrency"],
    "mode": lambda r: r["mode"],
    "tokens/s": lambda r: f"{r['tokens_per_s']:.1f}",
    "speed-up vs plain": lambda r: f"{r['speedup_vs_plain']:.2f}x",
    "vs fastest plain": lambda r: f"{r['speedup_vs_fastest_plain']:.2f}x ({r['fastest_plain']})",
    "τ": lambda r: f"{r['tau']:.2f}",
    "mean verify length": lambda r: f"{r['mean_verify_length']:.2f}",
    "k=0 verifies": lambda r: percent(r.get("zero_length_share", 0)),
    "drafter skipped": lambda r: percent(r.get("skipped_drafter_share", 0)),
    "acceptance": lambda r: f"{r['acceptance_rate']:.2f}",
    "lookup share": lambda r: percent(r["lookup_share"]),
    "lossless": lambda r: "yes" if r["lossless"] else "NO",
    "exact": lambda r: percent(r["exact_rate"]),
}


def markdown_table(results: dict) -> str:
    settings = results["settings"]
    return column_table(COLUMNS, results["summary"], "rl" + "r" * 9 + "cr") + (
        f"\nGreedy, {settings['max_new_tokens']} new tokens per request, max(requests_per_level="
        f"{settings['requests_per_level']}, concurrency) requests per level, {settings['repeats']} repeat(s) after "
        f"{settings.get('warmup_waves', 0)} untimed warm-up wave(s) per level, {settings['threads']} thread(s).\n"
        f"CPU: {settings['cpu_model']} ({settings['cpu']}); target {settings.get('target_dtype', '?')}, prepared: "
        f"{settings.get('prepared')}. vs fastest plain: against the fastest of {settings['plain_baselines']} plain "
        "batched decoding at that concurrency (named in brackets).\n"
    )


def write_outputs(results: dict, output_dir: Path) -> None:
    modes = results["settings"]["modes"]
    lines = {
        m: [(r["concurrency"], r["speedup_vs_plain"]) for r in results["summary"] if r["mode"] == m]
        for m in modes
    }
    figures = {
        "speedup_vs_concurrency.png": lambda path: line_plot(
            path,
            {mode: tuple(zip(*points)) for mode, points in lines.items()},
            "concurrency (running requests)",
            "throughput speed-up vs plain batched decoding",
            log2_x=True,
            unit_line=True,
        )
    }
    report.write_outputs(output_dir, results, markdown_table(results), figures | cost_curve_figure(results))


def heldout_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[torch.Tensor]:
    """``count`` held-out prompts, chat/code/math in turn, each at most ``max_prompt_tokens`` long."""
    from adaflash_hf.data import heldout_prompt_ids

    prompts = heldout_prompt_ids(tokenizer, DOMAINS, count, max_prompt_tokens)
    if len(prompts) < count:
        raise ValueError(
            f"--max-prompt-tokens: expected a length {count} held-out prompts fit in (the requests of the highest "
            f"level), got {max_prompt_tokens}, which {len(prompts)} fit in"
        )
    return prompts


# ---------------------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash bench serve",
        description="Throughput of the batched engine (plain / fixed-length DFlash / AdaFlash / hybrid) under "
        "concurrency.",
    )
    add_run_options(parser, "serve", QUICK, ("modes", MODES), drafter=", or 'random' (untrained)")
    parser.add_argument("--concurrency", type=int_at_least(1), nargs="+", help=f"levels ({FULL})")
    parser.add_argument("--requests-per-level", type=int_at_least(1), help="at least the concurrency")
    parser.add_argument(
        "--max-prompt-tokens", type=int_at_least(1), default=384, help="skip longer prompts (384)"
    )
    parser.add_argument(
        "--warmup-waves",
        type=int_at_least(0),
        help="untimed rounds of every mode at each level before its timed repeats: what a server meets once "
        "(shapes checked, the cost and acceptance models' first samples at that load); the first one's tokens/s "
        f"is kept as first_wave_tokens_per_s (FULL {FULL['warmup_waves']}, --quick {QUICK['warmup_waves']})",
    )
    return parser


def _load_drafter(args, parser) -> AdaFlashDrafter | None:
    """The drafter of ``--drafter`` (None for plain alone and for 'random', which needs the target), loaded before
    the target so that a bad folder fails in seconds."""
    if args.modes == ["plain"] or args.drafter == "random":
        return None
    default_drafter(parser, args)
    return AdaFlashDrafter.from_pretrained(args.drafter).eval()


def _random_drafter(target) -> AdaFlashDrafter:
    torch.manual_seed(0)
    return AdaFlashDrafter(AdaFlashConfig.for_target(target.config, num_hidden_layers=2)).eval()


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parse_run_args(parser, argv, QUICK, FULL, "modes")
    start_run(args.threads)
    drafter = _load_drafter(args, parser)
    # "auto" times what the engine runs, as `adaflash serve --dtype auto` does
    target, tokenizer, baselines, settings = load_run_target(args, "serve", argv, timer=packed_forward_timer)
    if args.drafter == "random" and args.modes != ["plain"]:
        drafter = _random_drafter(target)
    if drafter is not None:
        drafter = drafter.to(next(target.parameters()).dtype)
    prompts = heldout_prompts(
        tokenizer, max(max(args.concurrency), args.requests_per_level), args.max_prompt_tokens
    )
    results = run_benchmark(
        target,
        drafter,
        prompts,
        args.concurrency,
        modes=tuple(args.modes),
        requests_per_level=args.requests_per_level,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        lookup_min_prob=args.lookup_min_prob,
        baselines=baselines,
        warmup_waves=args.warmup_waves,
    )
    results["settings"].update(settings)
    write_outputs(results, args.output_dir)
    failure = "a mode's tokens differ from plain's"
    return report.finish("serve", results, args.output_dir, markdown_table(results), failure)


if __name__ == "__main__":
    raise SystemExit(main())
