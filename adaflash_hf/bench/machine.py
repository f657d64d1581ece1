"""What every benchmark record says about the machine it ran on: the CPU's bf16 units, the verify-cost curve the
goodput cost model measured there (``adaflash_hf.cost_model.CostModel``), and a measurement's memory, taken in a
fresh process so that the high-water mark is its own."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
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


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_fresh_process(module: str, function: str, args: list, threads: int) -> subprocess.CompletedProcess:
    """``module.function(*args)`` in a fresh Python process with ``threads`` OpenMP threads; its JSON result is the
    last line of the returned process's stdout (``json_result``)."""
    code = f"import json; from {module} import {function}; print(json.dumps({function}(*json.loads({json.dumps(args)!r}))))"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # -P: the repository root must not shadow Hugging Face's own ``kernels`` package.
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env)


def json_result(process: subprocess.CompletedProcess) -> dict:
    return json.loads(process.stdout.strip().splitlines()[-1])
