"""What every benchmark record says about the machine it ran on: the CPU's bf16 units, the verify-cost curve the
goodput cost model measured there (``adaflash_hf.cost_model.CostModel``), and a measurement's memory, taken in a
fresh process so that the high-water mark is its own."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from adaflash_hf.bench.report import line_plot
from adaflash_hf.prepared.cpu import BF16_UNITS, bf16_units


def cpu_flags() -> str:
    """Which bf16 matrix units this CPU has (``amx_bf16``, ``avx512_bf16``, or none): benchmark records say it,
    since these machines change from day to day and bf16 speed depends on it."""
    units = bf16_units()
    return ", ".join(unit if unit in units else f"no {unit}" for unit in BF16_UNITS)


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


def cost_curve_figure(results: dict) -> dict[str, Callable[[Path], None]]:
    """``cost_curve.png`` (``plot_cost_curve``) for ``report.write_outputs`` where ``results`` has a ``cost_curve``."""
    if not results.get("cost_curve"):
        return {}
    cpu = results["settings"].get("cpu")
    return {"cost_curve.png": lambda path: plot_cost_curve(results["cost_curve"], path, cpu)}


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_base(device: str = "cpu") -> int:
    """The bytes in use before a measurement, the base of its ``memory_peak``: resident memory on the CPU; on CUDA
    the allocated bytes, the peak statistics reset."""
    if device != "cuda":
        return rss_bytes()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def memory_peak(device: str = "cpu") -> int:
    """The high-water mark in bytes: this process's resident memory (on CUDA, the allocated bytes since
    ``memory_base``)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_fresh_process(module: str, function: str, args: list, threads: int) -> dict:
    """``module.function(*args)``, which returns a JSON object, in a fresh Python process with ``threads`` OpenMP
    threads, so that the process's memory high-water mark is that call's alone. A process that failed is a result
    too (one killed for memory, say): ``{"error": "exit N: why"}``."""
    code = f"import json; from {module} import {function}; print(json.dumps({function}(*json.loads({json.dumps(args)!r}))))"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # -P: the repository root must not shadow Hugging Face's own ``kernels`` package.
    process = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env)
    if process.returncode != 0:
        reason = "killed (out of memory?)" if process.returncode == -9 else process.stderr.strip()[-300:]
        return {"error": f"exit {process.returncode}: {reason}"}
    return json.loads(process.stdout.strip().splitlines()[-1])
