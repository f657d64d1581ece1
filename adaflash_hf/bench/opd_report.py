"""What ``adaflash bench opd`` reports: intervals, the goals, the table and the plots, from its evaluations.

An evaluation summary (``opd.evaluate_drafter``) holds, per domain, the pooled figures (τ, τ_full, per-position
acceptance, the length head's mean |â - a*|) and ``per_prompt`` counts ``[accepted, verifies, full_rounds,
full_accepted]``. Every variant and round serves the same evaluation prompts, so intervals are paired bootstraps over
prompts: resample the prompts with replacement (the same indices for both sides of a comparison) and recompute the
pooled statistic; the 2.5th and 97.5th percentiles of 2000 resamples are the 95% interval. A difference is "beyond the
noise" when its interval excludes 0.
"""

from __future__ import annotations

import random
from pathlib import Path

ACCEPTED, VERIFIES, FULL_ROUNDS, FULL_ACCEPTED = range(4)
RESAMPLES = 2000
COLORS = {
    "none": "tab:gray",
    "ce": "tab:blue",
    "rkl": "tab:orange",
    "adaflash": "tab:green",
    "head_frozen": "tab:olive",
}
REPLAY_COLORS = ("tab:purple", "tab:pink", "tab:brown", "tab:cyan")


def color(variant: str) -> str | None:
    if variant.startswith("replay-"):
        return REPLAY_COLORS[sum(map(ord, variant)) % len(REPLAY_COLORS)]  # the same in every process
    return COLORS.get(variant)


# ---------------------------------------------------------------------------------------------- intervals
def pooled_tau(rows: list[list[float]]) -> float:
    """τ of per-prompt counts: committed tokens per verify, pooled over the prompts."""
    verifies = sum(r[VERIFIES] for r in rows)
    return (sum(r[ACCEPTED] for r in rows) + verifies) / verifies if verifies else 0.0


def bootstrap(statistic, *paired: list, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``statistic(*resampled)``, every list in ``paired`` resampled with the same prompt
    indices (they hold the same prompts in the same order)."""
    sizes = {len(p) for p in paired}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"paired: expected non-empty per-prompt lists of one length, got lengths {sorted(sizes)}"
        )
    (n,) = sizes
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        values.append(statistic(*[[p[i] for i in picks] for p in paired]))
    values.sort()
    return values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]


def tau_interval(summary: dict) -> tuple[float, float]:
    return bootstrap(pooled_tau, summary["per_prompt"])


def change(after: dict, before: dict) -> dict:
    """τ after / τ before - 1 on the same prompts, with its paired interval."""
    ratio = lambda a, b: pooled_tau(a) / pooled_tau(b) - 1.0  # noqa: E731
    low, high = bootstrap(ratio, after["per_prompt"], before["per_prompt"])
    return {"value": ratio(after["per_prompt"], before["per_prompt"]), "low": low, "high": high}


def difference(first: dict, second: dict) -> dict:
    """τ first - τ second on the same prompts, with its paired interval."""
    diff = lambda a, b: pooled_tau(a) - pooled_tau(b)  # noqa: E731
    low, high = bootstrap(diff, first["per_prompt"], second["per_prompt"])
    return {"value": diff(first["per_prompt"], second["per_prompt"]), "low": low, "high": high}


# ---------------------------------------------------------------------------------------------- goals
def goals(evaluation: dict, new_domain: str) -> dict:
    """The issue's goals on the evaluation τ: the new domain +25% within the rounds run (AdaFlash loss), every other
    domain within -5% of its start (AdaFlash, and each replay variant), AdaFlash ahead of CE-only and of unclipped
    reverse KL on the new domain beyond the noise; the online head against the frozen one is timed apart."""
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
            "gain_25pct": gains[best]["value"] >= 0.25,
            "other_domain_change": others,
            "others_within_5pct": all(c["value"] >= -0.05 for c in others.values()),
        }
    ada = evaluation.get("adaflash")
    for rival in ("ce", "rkl", "head_frozen"):
        if ada is None or rival not in evaluation:
            continue
        last = min(max(ada), max(evaluation[rival]))
        diff = difference(ada[last][new_domain], evaluation[rival][last][new_domain])
        out[f"adaflash_minus_{rival}"] = {**diff, "round": last, "beyond_noise": diff["low"] > 0}
    return out


# ---------------------------------------------------------------------------------------------- table
def markdown_table(results: dict) -> str:
    """Per variant and round: τ [95% interval] and τ_full per evaluation domain, the head's |â - a*| on the new
    domain, and the live traffic τ."""
    evaluation, domains = results["evaluation"], results["settings"]["domains"]
    new = results["goals"]["new_domain"]
    lines = [
        "| variant | round | samples trained | "
        + " | ".join(f"{d} τ [95%] (τ full)" for d in domains)
        + f" | {new} head abs(â - a*) | live traffic τ |",
        "|---|---:|---:|" + "---:|" * len(domains) + "---:|---:|",
    ]
    threshold = results["settings"]["train_threshold"]
    for variant in results["settings"]["variants"]:
        live = {int(r["round"]): r.get("tau") for r in results["live"].get(variant, [])}
        for rnd in sorted(evaluation[variant]):
            row = evaluation[variant][rnd]
            cells = []
            for d in domains:
                low, high = tau_interval(row[d])
                cells.append(f"{row[d]['tau']:.3f} [{low:.3f}, {high:.3f}] ({row[d]['tau_full']:.3f})")
            trained = 0 if variant == "none" else rnd * threshold
            traffic = f"{live[rnd]:.3f}" if isinstance(live.get(rnd), float) else "-"
            head = f"{row[new]['head_error']:.3f}"
            lines.append(
                f"| {variant} | {rnd} | {trained} | " + " | ".join(cells) + f" | {head} | {traffic} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- plots
def _domain_panels(results: dict, extra: int = 0, height: float = 3.6, sharey: bool = False):
    """A figure with one panel per evaluation domain (and ``extra`` more): the figure and its axes."""
    from matplotlib.figure import Figure

    panels = len(results["settings"]["domains"]) + extra
    figure = Figure(figsize=(4 * panels, height))
    return figure, figure.subplots(1, panels, sharey=sharey)


def _finish(figure, axes, ylabel: str, path: Path) -> None:
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_tau(results: dict, path: Path) -> None:
    """Evaluation τ per domain over rounds (95% intervals as bars), one panel per domain, and the live traffic τ."""
    evaluation, domains = results["evaluation"], results["settings"]["domains"]
    new = results["goals"]["new_domain"]
    figure, axes = _domain_panels(results, extra=1)
    variants = results["settings"]["variants"]
    for ax, domain in zip(axes, domains):
        for k, variant in enumerate(variants):
            rounds = sorted(evaluation[variant])
            taus = [evaluation[variant][r][domain]["tau"] for r in rounds]
            bounds = [tau_interval(evaluation[variant][r][domain]) for r in rounds]
            errors = [
                [t - lo for t, (lo, _) in zip(taus, bounds)],
                [hi - t for t, (_, hi) in zip(taus, bounds)],
            ]
            offset = (k - (len(variants) - 1) / 2) * 0.06  # side by side, so the bars do not hide each other
            ax.errorbar(
                [r + offset for r in rounds], taus, yerr=errors, marker="o", ms=3, capsize=2,
                color=color(variant), label=variant,
            )  # fmt: skip
        ax.set_title(f"eval τ: {domain}" + (" (new domain)" if domain == new else ""))
        ax.set_xlabel("OPD round (buffers trained)")
    live_ax = axes[-1]
    for variant in variants:
        rows = results["live"].get(variant, [])
        live_ax.plot(
            [r["round"] for r in rows], [r.get("tau") for r in rows], marker=".", color=color(variant)
        )
    live_ax.set_title("live traffic τ (all served domains)")
    live_ax.set_xlabel("OPD round")
    _finish(figure, axes, "τ (committed tokens per verify), 95% CI", path)


def plot_per_position(results: dict, path: Path) -> None:
    """Per-position acceptance of the full draft before (round 0) and after each variant's last round."""
    evaluation, domains = results["evaluation"], results["settings"]["domains"]
    figure, axes = _domain_panels(results, sharey=True)
    start = next(iter(evaluation.values()))[0]
    last_seen = 2  # the x range ends one position past the last position any curve reaches
    for ax, domain in zip(axes, domains):
        curves = [("before (round 0)", start[domain]["per_position"], "k", "--")]
        for variant in results["settings"]["variants"]:
            if variant != "none":
                last = max(evaluation[variant])
                curve = evaluation[variant][last][domain]["per_position"]
                curves.append((f"{variant} after round {last}", curve, color(variant), "-"))
        for label, curve, line_color, style in curves:
            reached = [p for p in curve if p > 0]  # a log axis cannot show 0: a curve stops where it hits 0
            last_seen = max(last_seen, len(reached) + 1)
            ax.plot(
                range(1, len(reached) + 1),
                reached,
                linestyle=style,
                marker=".",
                color=line_color,
                label=label,
            )
        ax.set_yscale("log")
        ax.set_title(f"per-position acceptance: {domain}")
        ax.set_xlabel("draft position j")
    for ax in axes:
        ax.set_xlim(0.5, last_seen + 0.5)
    _finish(figure, axes, "P(first j proposals accepted)", path)


def plot_head_error(results: dict, path: Path) -> None:
    """The length head's mean |â - a*| over rounds, per domain and variant (a* = the full draft's accepted share)."""
    evaluation, domains = results["evaluation"], results["settings"]["domains"]
    figure, axes = _domain_panels(results, height=3.4, sharey=True)
    for ax, domain in zip(axes, domains):
        for variant in results["settings"]["variants"]:
            rounds = sorted(evaluation[variant])
            errors = [evaluation[variant][r][domain]["head_error"] for r in rounds]
            ax.plot(rounds, errors, marker="o", ms=3, color=color(variant), label=variant)
        ax.set_title(f"length head abs(â - a*): {domain}")
        ax.set_xlabel("OPD round")
    _finish(figure, axes, "mean abs(â - a*) per round", path)


def plot_replay(results: dict, path: Path) -> None:
    """Forgetting against the replay fraction: each domain's τ change at the last round (AdaFlash = fraction 0)."""
    from matplotlib.figure import Figure

    evaluation, goal = results["evaluation"], results["goals"]
    fractions = {"adaflash": 0.0, **results["settings"].get("replay_fractions", {})}
    arms = sorted((f, v) for v, f in fractions.items() if v in goal)
    if len(arms) < 2:
        return
    start = next(iter(evaluation.values()))[0]
    figure = Figure(figsize=(5, 3.6))
    ax = figure.add_subplot()
    for domain in start:
        changes = [
            goal[v]["new_domain_gain"]
            if domain == goal["new_domain"]
            else goal[v]["other_domain_change"][domain]
            for _, v in arms
        ]
        ax.errorbar(
            [f for f, _ in arms], [100 * c["value"] for c in changes], marker="o", capsize=3, label=domain,
            yerr=[[100 * (c["value"] - c["low"]) for c in changes], [100 * (c["high"] - c["value"]) for c in changes]],
        )  # fmt: skip
    ax.axhline(-5, color="k", linestyle=":", linewidth=0.8)
    ax.set_xlabel("replay fraction of each buffer")
    ax.set_ylabel("τ change at the last round (%), 95% CI")
    ax.set_title("replay against forgetting")
    ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
