"""The goals the experiments of LOG.md were run against, graded from a bench's results file.

    python experiments/goals.py serve runs/bench_serve/results.json
    python experiments/goals.py opd runs/opd_new_domain/results.json [--plot runs/opd_new_domain/replay.png]
    python experiments/goals.py kernels runs/kernels.json

The benches (``adaflash bench ...``) measure and judge nothing; each goal here is one experiment's target. Prints
every goal with its verdict (JSON) and exits 1 when one is not met.

- ``serve``: AdaFlash at least plain's throughput at every concurrency and 1.2x fixed-length DFlash's at 8 and more;
  goodput at least 0.97x plain everywhere (never slower beyond noise); hybrid ahead of plain and AdaFlash at 8 and 16.
- ``opd``: on the new domain (the traffic's last phase) AdaFlash's evaluation τ +25% within the rounds run, every
  other domain within -5% of its start (AdaFlash, and each replay variant), AdaFlash ahead of CE-only and of
  unclipped reverse KL on the new domain beyond the noise (the paired 95% interval of the difference above 0).
- ``kernels``: the fused clipped-KL loss at V=151936 in at most 1/4 of the naive loss's peak memory, and on a GPU at
  least 2x faster than it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaflash_hf.online.evaluate import bootstrap, pooled_tau

NEW_DOMAIN_GAIN = 0.25
OTHER_DOMAINS_FLOOR = -0.05
RIVALS = ("ce", "rkl", "head_frozen")


# ---------------------------------------------------------------------------------------------- serve
def serve_goals(results: dict) -> dict[str, bool]:
    """The serving goals that ``results`` (``adaflash bench serve``) has the modes and levels for."""
    rows = {(r["concurrency"], r["mode"]): r for r in results["summary"]}
    levels = sorted({r["concurrency"] for r in results["summary"]})
    goals = {}
    if all((c, "adaflash") in rows for c in levels):
        goals["adaflash_at_least_plain_everywhere"] = all(
            rows[c, "adaflash"]["speedup_vs_plain"] >= 1.0 for c in levels
        )
    high = [c for c in levels if c >= 8 and (c, "adaflash") in rows and (c, "dflash") in rows]
    if high:
        goals["adaflash_1.2x_dflash_at_8_plus"] = all(
            rows[c, "adaflash"]["tokens_per_s"] >= 1.2 * rows[c, "dflash"]["tokens_per_s"] for c in high
        )
    if all((c, "goodput") in rows for c in levels):
        goals["goodput_at_least_0.97x_plain_everywhere"] = all(
            rows[c, "goodput"]["speedup_vs_plain"] >= 0.97 for c in levels
        )
    both = [c for c in (8, 16) if all((c, m) in rows for m in ("plain", "adaflash", "hybrid"))]
    if both:
        goals["hybrid_ahead_of_plain_and_adaflash_at_8_16"] = all(
            rows[c, "hybrid"]["tokens_per_s"] > max(rows[c, m]["tokens_per_s"] for m in ("plain", "adaflash"))
            for c in both
        )
    return goals


# ---------------------------------------------------------------------------------------------- opd
def change(after: dict, before: dict) -> dict:
    """τ after / τ before - 1 on the same prompts, with its paired 95% interval."""
    ratio = lambda a, b: pooled_tau(a) / pooled_tau(b) - 1.0  # noqa: E731
    low, high = bootstrap(ratio, after["per_prompt"], before["per_prompt"])
    return {"value": ratio(after["per_prompt"], before["per_prompt"]), "low": low, "high": high}


def difference(first: dict, second: dict) -> dict:
    """τ first - τ second on the same prompts, with its paired 95% interval."""
    diff = lambda a, b: pooled_tau(a) - pooled_tau(b)  # noqa: E731
    low, high = bootstrap(diff, first["per_prompt"], second["per_prompt"])
    return {"value": diff(first["per_prompt"], second["per_prompt"]), "low": low, "high": high}


def opd_goals(evaluation: dict, new_domain: str) -> dict:
    """The online-distillation goals on an evaluation (variant -> round -> domain -> summary, ``adaflash bench
    opd``'s), per trained variant, and AdaFlash against each rival at their last common round."""
    start = next(iter(evaluation.values()))[0]  # round 0: the same starting drafter in every variant
    out = {
        "new_domain": new_domain,
        "new_domain_is_weakest": min(start, key=lambda d: start[d]["tau"]) == new_domain,
    }
    for variant, rounds in evaluation.items():
        trained = sorted(r for r in rounds if r > 0)
        if variant == "none" or not trained:
            continue
        last = trained[-1]
        gains = {r: change(rounds[r][new_domain], start[new_domain]) for r in trained}
        best = max(gains, key=lambda r: gains[r]["value"])
        others = {d: change(rounds[last][d], start[d]) for d in start if d != new_domain}
        out[variant] = {
            "final_round": last,
            "new_domain_gain": gains[last],
            "best_round": best,
            "best_gain": gains[best],
            "gain_25pct": gains[best]["value"] >= NEW_DOMAIN_GAIN,
            "other_domain_change": others,
            "others_within_5pct": all(c["value"] >= OTHER_DOMAINS_FLOOR for c in others.values()),
        }
    ada = evaluation.get("adaflash")
    for rival in RIVALS:
        if ada is None or rival not in evaluation:
            continue
        last = min(max(ada), max(evaluation[rival]))
        diff = difference(ada[last][new_domain], evaluation[rival][last][new_domain])
        out[f"adaflash_minus_{rival}"] = {**diff, "round": last, "beyond_noise": diff["low"] > 0}
    return out


def opd_verdicts(goals: dict) -> dict[str, bool]:
    """The graded goals: AdaFlash's gain and every trained variant's other domains; AdaFlash beyond CE and RKL."""
    verdicts = {}
    for variant, graded in goals.items():
        if isinstance(graded, dict) and "others_within_5pct" in graded:
            verdicts[f"{variant}: others within -5%"] = graded["others_within_5pct"]
            if variant == "adaflash":
                verdicts["adaflash: new domain +25%"] = graded["gain_25pct"]
    for rival in ("ce", "rkl"):
        if f"adaflash_minus_{rival}" in goals:
            verdicts[f"adaflash ahead of {rival} beyond the noise"] = goals[f"adaflash_minus_{rival}"][
                "beyond_noise"
            ]
    return verdicts


def plot_replay(evaluation: dict, goals: dict, fractions: dict[str, float], path: Path) -> None:
    """Forgetting against the replay fraction: each domain's τ change at the last round (AdaFlash = fraction 0),
    beside the -5% floor; nothing with fewer than two fractions."""
    from matplotlib.figure import Figure

    arms = sorted((f, v) for v, f in {"adaflash": 0.0, **fractions}.items() if v in goals)
    if len(arms) < 2:
        return
    figure = Figure(figsize=(5, 3.6), layout="constrained")
    ax = figure.add_subplot()
    for domain in next(iter(evaluation.values()))[0]:
        new = domain == goals["new_domain"]
        changes = [
            goals[v]["new_domain_gain"] if new else goals[v]["other_domain_change"][domain] for _, v in arms
        ]
        low = [100 * (c["value"] - c["low"]) for c in changes]
        high = [100 * (c["high"] - c["value"]) for c in changes]
        values = [100 * c["value"] for c in changes]
        ax.errorbar([f for f, _ in arms], values, yerr=[low, high], marker="o", capsize=3, label=domain)
    ax.axhline(100 * OTHER_DOMAINS_FLOOR, color="k", linestyle=":", linewidth=0.8)
    ax.set(xlabel="replay fraction of each buffer", ylabel="τ change at the last round (%), 95% CI")
    ax.set_title("replay against forgetting")
    ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------- kernels
def kernels_goals(results: dict) -> dict[str, bool]:
    """The fused loss against the naive one at V=151936 (``adaflash bench kernels --output``'s record)."""
    rows = [e for e in results["loss"] if e["vocab"] == 151936 and e["variant"] != "naive"]
    goals = {}
    if rows and all(e.get("memory_vs_naive") is not None for e in rows):
        goals["fused_peak_at_most_quarter_of_naive"] = all(e["memory_vs_naive"] <= 0.25 for e in rows)
    gpu = [e for e in rows if e["variant"] == "triton" and e.get("speedup_vs_naive") is not None]
    if results.get("device") == "cuda" and gpu:
        goals["fused_2x_faster_than_naive_on_gpu"] = all(e["speedup_vs_naive"] >= 2.0 for e in gpu)
    return goals


# ---------------------------------------------------------------------------------------------- command
def grade(bench: str, results: dict, plot: Path | None = None) -> dict:
    """``{"goals": ..., "verdicts": {goal: met}}`` of a results record of ``bench``."""
    if bench == "serve":
        goals = serve_goals(results)
        return {"goals": goals, "verdicts": goals}
    if bench == "kernels":
        goals = kernels_goals(results)
        return {"goals": goals, "verdicts": goals}
    evaluation = {v: {int(r): s for r, s in rounds.items()} for v, rounds in results["evaluation"].items()}
    goals = opd_goals(evaluation, results["settings"]["new_domain"])
    if plot is not None:
        plot_replay(evaluation, goals, results["settings"].get("replay_fractions", {}), plot)
    return {"goals": goals, "verdicts": opd_verdicts(goals)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", choices=("serve", "opd", "kernels"), help="the bench that wrote the results")
    parser.add_argument("results", type=Path, help="its results JSON")
    parser.add_argument("--plot", type=Path, help="opd: draw forgetting against the replay fraction here")
    args = parser.parse_args(argv)
    graded = grade(args.bench, json.loads(args.results.read_text()), args.plot)
    print(json.dumps(graded, indent=1))
    return 0 if all(graded["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
