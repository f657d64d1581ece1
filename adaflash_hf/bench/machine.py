"""What every benchmark record says about the machine it ran on: the CPU's bf16 units, and the verify-cost curve the
goodput cost model measured there (``adaflash_hf.cost_model.CostModel``)."""

from __future__ import annotations

from pathlib import Path

from adaflash_hf.bench.report import line_plot


def cpu_flags() -> str:
    """Which bf16 matrix units this CPU has (``amx_bf16``, ``avx512_bf16``, or none): benchmark records say it,
    since these machines change from day to day and bf16 speed depends on it."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return ", ".join(f if f in flags else f"no {f}" for f in ("amx_bf16", "avx512_bf16"))


def plot_cost_curve(curves: dict, path: Path, cpu: str | None = None) -> None:
    """The cost model's measured target-forward seconds by tokens in the forward, relative to one token; one line per
    running-request bucket (``curves``: bucket -> {tokens: relative seconds}, keys as ints or as JSON's strings)."""
    lines = {}
    for running, curve in sorted(curves.items(), key=lambda item: int(item[0])):
        relative = {int(n): seconds for n, seconds in curve.items()}
        lines[f"{running} running"] = (sorted(relative), [relative[n] for n in sorted(relative)])
    title = f"measured verify cost ({cpu})" if cpu else "measured verify cost"
    xlabel, ylabel = "tokens in the target forward", "seconds relative to a 1-token forward"
    line_plot(path, lines, xlabel, ylabel, title=title, log2_x=True, unit_line=True)
