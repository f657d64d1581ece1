"""What every benchmark record says about the machine it ran on: the CPU's bf16 units, and the verify-cost curve the
goodput cost model measured there (``adaflash_hf.cost_model.CostModel``)."""

from __future__ import annotations

from pathlib import Path


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
    running-request bucket (``curves``: bucket -> {tokens: relative seconds})."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for running, curve in sorted(curves.items(), key=lambda item: int(item[0])):
        sizes = sorted(int(n) for n in curve)
        axes.plot(
            sizes,
            [curve[n] if n in curve else curve[str(n)] for n in sizes],
            marker="o",
            label=f"{running} running",
        )
    axes.set_xscale("log", base=2)
    axes.set(xlabel="tokens in the target forward", ylabel="seconds relative to a 1-token forward")
    axes.set_title(f"measured verify cost ({cpu})" if cpu else "measured verify cost", fontsize="small")
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
