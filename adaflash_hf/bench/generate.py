"""τ and speed-up of AdaFlash against the baselines, all through ``target.generate`` (greedy, batch size 1).

    adaflash bench generate [--drafter DIR] [--domains chat code math] [--prompts-per-domain 4]
                            [--max-new-tokens 256] [--repeats 3] [--threads 2] [--output-dir runs/bench_generate]
                            [--dtype fp32|bf16|auto] [--prepared] [--plain-baselines fp32 bf16]
    python -m adaflash_hf.bench.generate --quick --drafter DIR      # smoke run: 1 prompt, 16 tokens, 1 repeat

Methods (``RUNNERS``), on the same held-out prompts (``adaflash_hf.data``, chat template): ``plain``;
``prompt_lookup`` (10 tokens); ``native_dflash`` (transformers' ``speculation_type="dflash"`` with our weights, the
hook off; it embeds ``mask_token_id`` with the target's embedding, so a learned mask embedding drafts worse there);
``adaflash_fixed`` (``block_size - 1`` drafts); ``adaflash_adaptive`` (the length head's k̂); ``adaflash_hybrid``
(adaptive, each round the block or a lookup continuation); ``adaflash_goodput`` and ``adaflash_hybrid_goodput``
(``adaflash_length_mode="goodput"``), side by side in one run, since the comparison is the point.

Every timed call's output must equal plain greedy's token for token (``lossless``; ``exact``: the share of prompts
that do); calls are interleaved per prompt and repeat after one warm-up call per method, so machine noise hits all
alike. A forward pre-hook on the target records each forward's query and cache lengths, which give every method the
same accounting: the forwards after the prefill are its rounds, a round verifies ``query length - 1`` drafts and
commits the cache's growth up to the next forward. τ = tokens committed per round (prompt lookup's drafts inside its
prefill are left out); for the AdaFlash methods the rounds must agree with ``drafter.last_stats`` (``stats_agree``).
Speed-up = median plain seconds / median method seconds per prompt, geometric mean over a domain's prompts. A
lossless or stats_agree failure exits with status 1 after the outputs are written.

``--dtype``, ``--prepared`` and ``--plain-baselines``: ``bench.targets`` ("plain" is plain decoding of the target as
benchmarked; ``speedup_vs_fastest_plain``: over the fastest plain baseline, ``_fastest_plain``).

Outputs in ``--output-dir``: ``results.json`` (``settings``, ``ok``, ``summary`` per domain and method, ``records``
per prompt too), ``table.md`` and the figures: P(draft j accepted | verified) per domain, the per-round accepted /
verified histogram, the share of rounds each draft source won, the k̂ distribution, and the goodput cost model's
measured verify-cost curve (``cost_curve``).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.utils import logging

import adaflash_hf
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.bench import report
from adaflash_hf.bench.machine import cost_curve_figure
from adaflash_hf.bench.report import column_table, fmt, panels, percent, save
from adaflash_hf.bench.targets import (
    add_run_options,
    default_drafter,
    load_run_target,
    machine_settings,
    parse_run_args,
    start_run,
    timed_baselines,
)
from adaflash_hf.launch import int_at_least, number_in
from adaflash_hf.online.evaluate import acceptance_per_position, length_head_figures
from adaflash_hf.stats import tau_of

logger = logging.get_logger(__name__)

PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 16
QUICK = {"prompts_per_domain": 1, "max_new_tokens": 16, "repeats": 1}
FULL = {"prompts_per_domain": 4, "max_new_tokens": 256, "repeats": 3}


# ------------------------------------------------------------------------------------------------------ methods
def _runner(assistant: bool = False, **fields):
    """A method: ``target.generate`` with these generation-config ``fields`` set, the drafter as its assistant when
    ``assistant``."""

    def run(target, drafter, input_ids, config):
        for name, value in fields.items():
            setattr(config, name, value)
        drafting = {"assistant_model": drafter} if assistant else {}
        return target.generate(input_ids, generation_config=config, **drafting)

    return run


def _native_dflash(target, drafter, input_ids, config):
    # The AdaFlash hook claims AdaFlashDrafter assistants even under speculation_type="dflash": switch it off so
    # transformers' own DFlashTokenCandidateGenerator runs.
    was_enabled = adaflash_hf.is_enabled()
    adaflash_hf.disable()
    try:
        return _runner(True, speculation_type="dflash")(target, drafter, input_ids, config)
    finally:
        if was_enabled:
            adaflash_hf.enable()


def _adaflash(length_mode: str, draft_source: str = "diffusion"):
    return _runner(True, adaflash_length_mode=length_mode, adaflash_draft_source=draft_source)


# Looked up at call time, so a test can swap one entry.
RUNNERS = {
    "plain": _runner(),
    "prompt_lookup": _runner(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
    "native_dflash": _native_dflash,
    "adaflash_fixed": _adaflash("fixed"),
    "adaflash_adaptive": _adaflash("adaptive"),
    "adaflash_hybrid": _adaflash("adaptive", "hybrid"),
    "adaflash_goodput": _adaflash("goodput"),
    "adaflash_hybrid_goodput": _adaflash("goodput", "hybrid"),
}
METHODS = tuple(RUNNERS)
ADAFLASH_METHODS = tuple(m for m in METHODS if m.startswith("adaflash_"))


# --------------------------------------------------------------------------------------------- forward accounting
class ForwardRecorder:
    """Forward pre-hook on the target: (query length, cached length) of every forward since the last ``reset``."""

    def __init__(self, target):
        self.calls: list[tuple[int, int]] = []
        self.handle = target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = args[0] if args else kwargs["inputs_embeds"]
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        self.calls.append((tokens.shape[1], 0 if cache is None else cache.get_seq_length()))

    def reset(self) -> None:
        self.calls = []

    def remove(self) -> None:
        self.handle.remove()


def decode_rounds(calls: list[tuple[int, int]], final_length: int) -> tuple[list[int], list[int]]:
    """(verified drafts, accepted drafts) of every forward after the prefill.

    Before each forward the target cache holds every committed token but the newest (the one the forward starts
    from); a round therefore commits the cache growth up to the next forward, or up to ``final_length - 1`` for the
    last one, and accepts one token less (the bonus token).
    """
    verified = [query - 1 for query, _ in calls[1:]]
    starts = [cached for _, cached in calls[1:]] + [final_length - 1]
    accepted = [end - start - 1 for start, end in zip(starts, starts[1:])]
    return verified, accepted


def stats_agree(stats, forwards: int, verified: list[int], accepted: list[int]) -> bool:
    """Whether the forward accounting matches ``AdaFlashStats``. A last forward that only had room for the bonus token
    (verifies 0, accepts 0) is a round here but not a drafting round there."""
    rounds = list(zip(verified, accepted))
    stats_rounds = list(zip(stats.verify_lengths, stats.accepted_lengths))
    return stats.target_forwards == forwards and rounds in (stats_rounds, stats_rounds + [(0, 0)])


def _first_mismatch(output: torch.Tensor, reference: torch.Tensor) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other), None when equal."""
    out, ref = output[0].tolist(), reference[0].tolist()
    if out == ref:
        return None
    return next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))


def _caller(target, drafter, gamma, min_len, lookup_min_prob):
    """``call(method, input_ids, tokens, model=None) -> (output, seconds)``: one timed greedy decoding."""
    eos = target.generation_config.eos_token_id
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    def call(method: str, input_ids: torch.Tensor, tokens: int, model=None) -> tuple[torch.Tensor, float]:
        config = GenerationConfig(max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
        if method in ADAFLASH_METHODS:
            config.adaflash_gamma, config.adaflash_min_len = gamma, min_len
            config.adaflash_lookup_min_prob = lookup_min_prob
        started = time.perf_counter()
        with torch.inference_mode():
            output = RUNNERS[method](target if model is None else model, drafter, input_ids, config)
        return output, time.perf_counter() - started

    return call


def _run_prompts(
    call, target, drafter, prompts, methods, repeats, max_new_tokens, timed, progress
) -> list[dict]:
    """Warm every method and baseline up once, then every prompt's records (``_bench_prompt``)."""
    recorder = ForwardRecorder(target)
    records = []
    try:
        first_ids = next(ids for pairs in prompts.values() for _, ids in pairs)
        for method in methods:
            call(method, first_ids, min(WARMUP_TOKENS, max_new_tokens))
        for model in timed.values():
            call("plain", first_ids, min(WARMUP_TOKENS, max_new_tokens), model)
        total = sum(len(pairs) for pairs in prompts.values()) * repeats * (len(methods) + len(timed))
        with tqdm(total=total, desc="bench generate", disable=not progress) as bar:
            bench = functools.partial(
                _bench_prompt, call, recorder, drafter, methods, repeats, max_new_tokens, bar
            )
            for domain, pairs in prompts.items():
                for prompt_id, input_ids in pairs:
                    records += bench(domain, prompt_id, input_ids, timed)
    finally:
        recorder.remove()
    return records


# --------------------------------------------------------------------------------------------------------- run
def run_benchmark(
    target,
    drafter: AdaFlashDrafter | None,
    prompts: dict[str, list[tuple[str, torch.Tensor]]],
    methods: tuple[str, ...] = METHODS,
    max_new_tokens: int = 256,
    repeats: int = 3,
    gamma: float | None = None,
    min_len: int | None = None,
    progress: bool = True,
    lookup_min_prob: float = 0.0,
    baselines: dict | None = None,
) -> dict:
    """Run every method on every prompt ``repeats`` times, interleaved; return the results dict (see module doc).

    ``prompts`` maps a domain to ``(prompt id, input ids [1, L])`` pairs. ``drafter`` may be None when ``methods``
    holds no drafter method. ``gamma`` / ``min_len`` override the drafter's length-head settings for the AdaFlash
    methods; ``lookup_min_prob`` is the hybrid method's ``adaflash_lookup_min_prob``. ``baselines``: the plain
    decodings timed beside the methods (``targets.plain_baselines``), the fastest of them ``_fastest_plain``'s.
    """
    _check_run(target, drafter, methods, repeats, max_new_tokens)
    methods = tuple(m for m in METHODS if m in methods)  # plain first: it is the reference
    if drafter is not None:
        gamma = drafter.config.length_head_gamma if gamma is None else gamma
        min_len = drafter.config.length_head_min_len if min_len is None else min_len
    baselines, timed = timed_baselines(baselines)
    call = _caller(target, drafter, gamma, min_len, lookup_min_prob)
    records = _run_prompts(call, target, drafter, prompts, methods, repeats, max_new_tokens, timed, progress)
    fastest = _fastest_plain(records, baselines)
    summary = [
        _summarise([r for r in records if r["domain"] == domain and r["method"] == method])
        for domain in prompts
        for method in methods
    ]
    from adaflash_hf.cost_model import cost_model_for

    cost = cost_model_for(target, "generate")
    return {
        "settings": {
            **_settings(drafter, prompts, methods, max_new_tokens, repeats, gamma, min_len),
            "lookup_min_prob": lookup_min_prob,
            "fastest_plain": fastest,
        },
        "cost_curve": {"1": cost.relative_curve(1)} if cost.target[0] else {},
        "ok": all(r["lossless"] and r["stats_agree"] is not False for r in records),
        "summary": summary,
        "records": records,
    }


def _fastest_plain(records: list[dict], baselines: dict) -> dict:
    """The baseline whose plain decoding generates the most tokens per second over the prompts (a baseline None is
    the benchmarked target's own ``plain``): sets every record's ``speedup_vs_fastest_plain`` (its tokens/s over that
    baseline's on the same prompt); returns its name and each baseline's tokens/s. Rates, not times: an fp32 and a
    bf16 greedy text part where two tokens nearly tie, so a baseline's output can end at another length."""
    own = {(r["domain"], r["prompt_id"]): r for r in records if r["method"] == "plain"}

    def tokens_and_seconds(record: dict, name: str) -> tuple[int, float]:
        if baselines[name] is None:
            plain = own[record["domain"], record["prompt_id"]]
            return plain["new_tokens"], plain["median_seconds"]
        return record["plain_baseline_tokens"][name], record["plain_baseline_seconds"][name]

    plains = list(own.values())
    rates = {}
    for name in baselines:
        runs = [tokens_and_seconds(r, name) for r in plains]
        rates[name] = sum(tokens for tokens, _ in runs) / sum(seconds for _, seconds in runs)
    fastest = max(rates, key=rates.get)
    for record in records:
        tokens, seconds = tokens_and_seconds(record, fastest)
        record["speedup_vs_fastest_plain"] = (record["new_tokens"] / record["median_seconds"]) / (
            tokens / seconds
        )
    return {"name": fastest, "tokens_per_s": rates}


def _check_run(target, drafter, methods, repeats: int, max_new_tokens: int) -> None:
    """``run_benchmark``'s arguments, checked before any forward."""
    if not set(methods) <= set(METHODS) or "plain" not in methods:
        raise ValueError(f"methods: expected a subset of {METHODS} including 'plain', got {list(methods)}")
    if drafter is None and set(methods) - {"plain", "prompt_lookup"}:
        raise ValueError(f"drafter: expected an AdaFlashDrafter for methods {list(methods)}, got None")
    if drafter is not None:
        drafter.check_target(target)
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    if max_new_tokens < 2:
        raise ValueError(
            f"max_new_tokens: expected >= 2 (τ needs a forward after the prefill), got {max_new_tokens}"
        )


def _settings(drafter, prompts, methods, max_new_tokens: int, repeats: int, gamma, min_len) -> dict:
    """The results' ``settings``: what was run, and on which threads and library versions."""
    return {
        "decoding": "greedy",
        "methods": list(methods),
        "domains": list(prompts),
        "prompts_per_domain": {domain: len(pairs) for domain, pairs in prompts.items()},
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "block_size": None if drafter is None else drafter.config.block_size,
        "gamma": gamma,
        "min_len": min_len,
        **machine_settings(),
    }


def _bench_prompt(
    call, recorder, drafter, methods, repeats, max_new_tokens, bar, domain, prompt_id, input_ids, baselines
) -> list[dict]:
    """One record per method for one prompt: ``repeats`` passes over the methods in turn, then the ``baselines``' plain
    decoding (name -> model), each method's output checked against the first plain one; forward accounting and stats
    from the first pass; every record holds the baselines' median seconds and new tokens (``plain_baseline_seconds``,
    ``plain_baseline_tokens``)."""
    baseline_seconds = {name: [] for name in baselines}
    baseline_tokens = {}
    new = {"domain": domain, "prompt_id": prompt_id, "seconds": [], "first_mismatch": None}
    records = {method: {**new, "method": method, "seconds": []} for method in methods}
    prompt_length = input_ids.shape[1]
    reference = None
    for repeat in range(repeats):
        for method in methods:
            recorder.reset()
            output, seconds = call(method, input_ids, max_new_tokens)
            record = records[method]
            record["seconds"].append(seconds)
            if reference is None:  # plain runs first
                reference = output
            mismatch = _first_mismatch(output, reference)
            if record["first_mismatch"] is None and mismatch is not None:
                record["first_mismatch"] = mismatch - prompt_length
            if repeat == 0:
                _account(record, recorder.calls, prompt_length, output.shape[1], method, drafter)
            bar.update()
        for name, model in baselines.items():
            output, seconds = call("plain", input_ids, max_new_tokens, model)
            baseline_seconds[name].append(seconds)
            baseline_tokens[name] = output.shape[1] - prompt_length
            bar.update()
    plain_seconds = statistics.median(records["plain"]["seconds"])
    medians = {name: statistics.median(seconds) for name, seconds in baseline_seconds.items()}
    for record in records.values():
        record["plain_baseline_seconds"] = medians
        record["plain_baseline_tokens"] = baseline_tokens
        record["median_seconds"] = statistics.median(record["seconds"])
        record["tokens_per_s"] = record["new_tokens"] / record["median_seconds"]
        record["speedup"] = plain_seconds / record["median_seconds"]
        record["lossless"] = record["first_mismatch"] is None
        if not record["lossless"]:
            logger.error(
                f"{domain}/{prompt_id}/{record['method']}: output differs from plain greedy at new token "
                f"{record['first_mismatch']}"
            )
    return list(records.values())


def _account(record: dict, calls, prompt_length: int, final_length: int, method: str, drafter) -> None:
    """Fill a record's forward accounting (and, for AdaFlash, its stats) from the first repeat's call."""
    verified, accepted = decode_rounds(calls, final_length)
    record.update(
        prompt_tokens=prompt_length,
        new_tokens=final_length - prompt_length,
        target_forwards=len(calls),
        verify_lengths=verified,
        accepted_lengths=accepted,
        tau=tau_of(sum(accepted) + len(accepted), len(accepted)) if accepted else None,
        tau_stats=None,
        stats_agree=None,
        stats=None,
    )
    if method in ADAFLASH_METHODS:
        stats = drafter.last_stats
        record.update(
            tau_stats=stats.tau,
            stats_agree=stats_agree(stats, len(calls), verified, accepted),
            stats=stats.to_dict(),
        )
        if not record["stats_agree"]:
            logger.error(
                f"{record['domain']}/{record['prompt_id']}/{method}: forward accounting (forwards={len(calls)}, "
                f"verified={verified}, accepted={accepted}) differs from drafter.last_stats ({stats.summary()})"
            )


def _summarise(records: list[dict]) -> dict:
    verified = [k for r in records for k in r["verify_lengths"]]
    accepted = [a for r in records for a in r["accepted_lengths"]]
    row = {
        "domain": records[0]["domain"],
        "method": records[0]["method"],
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "rounds": len(verified),
        "tau": tau_of(sum(accepted) + len(accepted), len(accepted)) if accepted else None,
        "tau_stats": None,
        "tokens_per_s": sum(r["new_tokens"] for r in records) / sum(r["median_seconds"] for r in records),
        "speedup": math.exp(statistics.fmean(math.log(r["speedup"]) for r in records)),
        "speedup_vs_fastest_plain": math.exp(
            statistics.fmean(math.log(r["speedup_vs_fastest_plain"]) for r in records)
        ),
        "exact_rate": statistics.fmean(r["lossless"] for r in records),
        "mean_verify_length": statistics.fmean(verified) if verified else None,
        "zero_length_share": verified.count(0) / len(verified) if verified else None,
        "acceptance_rate": sum(accepted) / sum(verified) if sum(verified) else None,
        "acceptance_per_position": acceptance_per_position(verified, accepted),
        "lossless": all(r["lossless"] for r in records),
        "stats_agree": None,
        "lookup_share": None,
        "lookup_acceptance": None,
    }
    if records[0]["stats"] is not None:
        rounds = sum(r["stats"]["drafting_rounds"] for r in records)
        committed = sum(r["stats"]["committed_tokens"] for r in records)
        row["tau_stats"] = tau_of(committed, rounds) if rounds else None
        row["stats_agree"] = all(r["stats_agree"] for r in records)
        lookup = [
            (k, a)
            for r in records
            for k, a, source in zip(
                r["stats"]["verify_lengths"], r["stats"]["accepted_lengths"], r["stats"]["sources"]
            )
            if source == "lookup"
        ]
        row["lookup_share"] = len(lookup) / rounds if rounds else None
        skipped = sum(r["stats"]["skipped_drafter_forwards"] for r in records)
        row["skipped_drafter_share"] = skipped / rounds if rounds else None
        verified = sum(k for k, _ in lookup)
        row["lookup_acceptance"] = sum(a for _, a in lookup) / verified if verified else None
        row.update(length_head_figures([r["stats"] for r in records]))
    return row


# ------------------------------------------------------------------------------------------------------- outputs
# The table's columns: header -> the cell of a summary row.
COLUMNS = {
    "domain": lambda r: r["domain"],
    "method": lambda r: r["method"],
    "τ": lambda r: fmt(r["tau"]),
    "τ (stats)": lambda r: fmt(r["tau_stats"]),
    "tokens/s": lambda r: fmt(r["tokens_per_s"], ".1f"),
    "speed-up": lambda r: fmt(r["speedup"], ".2f", "x"),
    "vs fastest plain": lambda r: fmt(r["speedup_vs_fastest_plain"], ".2f", "x"),
    "mean verify len": lambda r: fmt(r["mean_verify_length"]),
    "k=0 rounds": lambda r: percent(r.get("zero_length_share")),
    "drafter skipped": lambda r: percent(r.get("skipped_drafter_share")),
    "acceptance": lambda r: fmt(r["acceptance_rate"]),
    "lookup rounds": lambda r: percent(r["lookup_share"]),
    "lookup acceptance": lambda r: fmt(r["lookup_acceptance"]),
    "length head mean abs(â - a*)": lambda r: fmt(r.get("head_abs_error")),
    "lossless": lambda r: "yes" if r["lossless"] else "NO",
    "exact": lambda r: percent(r["exact_rate"]),
}


def markdown_table(results: dict) -> str:
    """One row per (domain, method)."""
    settings = results["settings"]
    fastest = settings["fastest_plain"]
    rates = ", ".join(f"{k} {v:.1f}" for k, v in sorted(fastest["tokens_per_s"].items()))
    return (
        f"Greedy, {settings['max_new_tokens']} new tokens, median of {settings['repeats']} repeats, "
        f"{settings['threads']} threads; prompts per domain: {settings['prompts_per_domain']}.\n"
        f"CPU: {settings['cpu_model']} ({settings['cpu']}); target {settings.get('target_dtype', '?')}, "
        f"prepared: {settings.get('prepared')}. Speed-up: against plain decoding of this target; vs fastest plain: "
        f"against {fastest['name']} plain decoding, the fastest of {sorted(fastest['tokens_per_s'])} here "
        f"(tokens/s: {rates}).\n\n" + column_table(COLUMNS, results["summary"], "ll" + "r" * 12 + "lr")
    )


NOTE_STYLE = {"ha": "right", "va": "top", "fontsize": "x-small"}  # a note in a panel's upper right corner


def _color(method: str) -> str:
    return f"C{METHODS.index(method)}"  # the same colour for a method in every panel


def plot_acceptance_per_position(results: dict, path: Path) -> None:
    """Figure 3 analogue: P(draft j accepted | verified) per position, one panel per domain."""
    domains = results["settings"]["domains"]
    figure, axes = panels(len(domains))
    for ax, domain in zip(axes, domains):
        for row in results["summary"]:
            curve = row["acceptance_per_position"]
            if row["domain"] == domain and row["method"] != "plain" and curve:
                points = [(j + 1, p) for j, p in enumerate(curve) if p is not None]
                ax.plot(*zip(*points), marker="o", ms=3, label=row["method"], color=_color(row["method"]))
        ax.set(title=domain, xlabel="draft position j", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    save(figure, axes, "P(accepted | verified)", path)


def plot_acceptance_hist(results: dict, path: Path) -> None:
    """Figure 1 analogue: histogram of the per-round acceptance ratio (accepted / verified), one panel per domain."""
    domains = results["settings"]["domains"]
    figure, axes = panels(len(domains))
    for ax, domain in zip(axes, domains):
        for method in (m for m in results["settings"]["methods"] if m != "plain"):
            ratios = [
                a / k
                for r in results["records"]
                if r["domain"] == domain and r["method"] == method
                for k, a in zip(r["verify_lengths"], r["accepted_lengths"])
                if k > 0
            ]
            if ratios:
                weights = [1 / len(ratios)] * len(ratios)
                bins = [i / 10 for i in range(11)]
                ax.hist(ratios, bins, weights=weights, histtype="step", label=method, color=_color(method))
        ax.set(title=domain, xlabel="accepted / verified drafts per round", xlim=(0, 1))
        ax.grid(alpha=0.3)
    save(figure, axes, "fraction of rounds", path)


def plot_source_share(results: dict, path: Path) -> None:
    """Per domain, the share of drafting rounds won by the diffusion block and by lookup, per AdaFlash method
    (diffusion-only methods are all diffusion: the hybrid's bar is the one that says something)."""
    domains = results["settings"]["domains"]
    methods = [m for m in results["settings"]["methods"] if m in ADAFLASH_METHODS]
    figure, axes = panels(len(domains))
    rows = {(r["domain"], r["method"]): r for r in results["summary"]}
    for ax, domain in zip(axes, domains):
        shares = [rows[domain, m]["lookup_share"] or 0.0 for m in methods]
        ax.bar(methods, [1 - s for s in shares], label="diffusion", color="C0")
        ax.bar(methods, shares, bottom=[1 - s for s in shares], label="lookup", color="C1")
        ax.set(title=domain, ylim=(0, 1))
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    save(figure, axes, "share of rounds", path)


def plot_k_hat_distribution(results: dict, path: Path) -> None:
    """Per domain, the share of diffusion rounds that verified k̂ drafts, per AdaFlash method (fixed-length is one
    bar at its length; the adaptive bars are the length head's choices), with the head's mean |â - a*| in the legend."""
    domains = results["settings"]["domains"]
    methods = [m for m in results["settings"]["methods"] if m in ADAFLASH_METHODS]
    figure, axes = panels(len(domains))
    rows = {(r["domain"], r["method"]): r for r in results["summary"]}
    width = 0.8 / max(len(methods), 1)
    for ax, domain in zip(axes, domains):
        for i, method in enumerate(methods):
            histogram = rows[domain, method].get("k_hat_histogram") or []
            total, error = sum(histogram), rows[domain, method].get("head_abs_error")
            if not total:
                continue
            x = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(histogram))]
            ax.bar(x, [n / total for n in histogram], width=width, color=_color(method), label=method)
            if error is not None:
                note = f"{method}: |â-a*| {error:.2f}"
                ax.text(0.98, 0.95 - 0.08 * i, note, transform=ax.transAxes, **NOTE_STYLE)
        ax.set(title=domain, xlabel="k̂ (drafts verified per diffusion round)")
        ax.grid(alpha=0.3)
    save(figure, axes, "share of diffusion rounds", path)


def write_outputs(results: dict, output_dir: Path) -> None:
    figures = {
        "acceptance_per_position.png": lambda path: plot_acceptance_per_position(results, path),
        "acceptance_hist.png": lambda path: plot_acceptance_hist(results, path),
    }
    if set(results["settings"]["methods"]) & set(ADAFLASH_METHODS):
        figures["source_share.png"] = lambda path: plot_source_share(results, path)
        figures["k_hat_distribution.png"] = lambda path: plot_k_hat_distribution(results, path)
    report.write_outputs(output_dir, results, markdown_table(results), figures | cost_curve_figure(results))


# ---------------------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash bench generate",
        description="τ, tokens/s and speed-up of plain generate, prompt lookup, native DFlash and AdaFlash fixed, "
        "adaptive and hybrid on held-out chat/code/math prompts (greedy, lossless-checked).",
    )
    add_run_options(parser, "generate", QUICK, ("methods", METHODS))
    domains = ["chat", "code", "math"]
    parser.add_argument("--domains", nargs="+", default=domains, choices=domains)
    parser.add_argument(
        "--prompts-per-domain", type=int_at_least(1), help=f"held-out prompts per domain ({FULL})"
    )
    parser.add_argument(
        "--gamma", type=number_in(0, open_low=True), help="adaflash_gamma (default: drafter's)"
    )
    parser.add_argument("--min-len", type=int_at_least(0), help="adaflash_min_len (default: drafter's)")
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The options with their defaults filled in, every check that needs no model done (usage errors exit 2)."""
    parser = make_parser()
    args = parse_run_args(parser, argv, QUICK, FULL, "methods")
    if not set(args.methods) - {"plain", "prompt_lookup"}:
        args.drafter = None  # no method drafts with it
    else:
        default_drafter(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start_run(args.threads)
    from adaflash_hf.data import heldout_rows, prompt_ids

    # The drafter and the prompts before the target: a bad folder or prompt count fails in seconds.
    drafter = None if args.drafter is None else AdaFlashDrafter.from_pretrained(args.drafter).eval()
    if drafter is not None and args.min_len is not None and args.min_len > drafter.config.block_size - 1:
        raise ValueError(
            f"--min-len: expected 0..{drafter.config.block_size - 1} (the drafter's block_size - 1), got {args.min_len}"
        )
    rows = heldout_rows(args.domains, args.prompts_per_domain, "--prompts-per-domain")
    target, tokenizer, baselines, settings = load_run_target(args, "generate", argv)
    if drafter is not None:
        drafter = drafter.to(next(target.parameters()).dtype)
    prompts = {domain: [(row["id"], prompt_ids(tokenizer, row)) for row in rows[domain]] for domain in rows}
    results = run_benchmark(
        target,
        drafter,
        prompts,
        methods=tuple(args.methods),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        gamma=args.gamma,
        min_len=args.min_len,
        lookup_min_prob=args.lookup_min_prob,
        baselines=baselines,
    )
    results["settings"].update(settings)
    write_outputs(results, args.output_dir)
    failure = "a method's output differs from plain greedy, or its forward accounting from drafter.last_stats"
    return report.finish("generate", results, args.output_dir, markdown_table(results), failure)


if __name__ == "__main__":
    raise SystemExit(main())
