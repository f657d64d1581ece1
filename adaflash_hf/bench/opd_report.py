"""What ``adaflash bench opd`` reports: the table and the plots, from its evaluations.

An evaluation summary (``online.evaluate.evaluate_drafter``) holds, per domain, the pooled figures (τ, τ_full,
per-position acceptance, the length head's mean |â - a*|) and ``per_prompt`` counts. Every variant and round serves
the same evaluation prompts, so τ's intervals are paired bootstraps over the prompts (``online.evaluate.bootstrap``;
``experiments/goals.py`` grades the experiment's goals with them).
"""

from __future__ import annotations

from pathlib import Path

from adaflash_hf.bench.report import panels, save, table
from adaflash_hf.online.evaluate import tau_interval

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


# ---------------------------------------------------------------------------------------------- table
def _by_round(results: dict) -> dict:
    """The evaluation keyed by int rounds (results.json keys them as strings)."""
    return {v: {int(r): s for r, s in rounds.items()} for v, rounds in results["evaluation"].items()}


def markdown_table(results: dict) -> str:
    """Per variant and round: τ [95% interval] and τ_full per evaluation domain, the head's |â - a*| on the new
    domain, and the live traffic τ."""
    evaluation, domains = _by_round(results), results["settings"]["domains"]
    new = results["settings"]["new_domain"]
    header = ["variant", "round", "samples trained", *(f"{d} τ [95%] (τ full)" for d in domains)]
    header += [f"{new} head abs(â - a*)", "live traffic τ"]
    rows, threshold = [], results["settings"]["train_threshold"]
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
            rows.append([variant, rnd, trained, *cells, f"{row[new]['head_error']:.3f}", traffic])
    return table(header, rows, "l" + "r" * (len(header) - 1))


# ---------------------------------------------------------------------------------------------- plots
def plot_tau(results: dict, path: Path) -> None:
    """Evaluation τ per domain over rounds (95% intervals as bars), one panel per domain, and the live traffic τ."""
    evaluation, domains = _by_round(results), results["settings"]["domains"]
    new = results["settings"]["new_domain"]
    figure, axes = panels(len(domains) + 1, width=4)
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
    save(figure, axes, "τ (committed tokens per verify), 95% CI", path)


def plot_per_position(results: dict, path: Path) -> None:
    """Per-position acceptance of the full draft before (round 0) and after each variant's last round."""
    evaluation, domains = _by_round(results), results["settings"]["domains"]
    figure, axes = panels(len(domains), width=4, sharey=True)
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
    save(figure, axes, "P(first j proposals accepted)", path)


def plot_head_error(results: dict, path: Path) -> None:
    """The length head's mean |â - a*| over rounds, per domain and variant (a* = the full draft's accepted share)."""
    evaluation, domains = _by_round(results), results["settings"]["domains"]
    figure, axes = panels(len(domains), height=3.4, width=4, sharey=True)
    for ax, domain in zip(axes, domains):
        for variant in results["settings"]["variants"]:
            rounds = sorted(evaluation[variant])
            errors = [evaluation[variant][r][domain]["head_error"] for r in rounds]
            ax.plot(rounds, errors, marker="o", ms=3, color=color(variant), label=variant)
        ax.set_title(f"length head abs(â - a*): {domain}")
        ax.set_xlabel("OPD round")
    save(figure, axes, "mean abs(â - a*) per round", path)
