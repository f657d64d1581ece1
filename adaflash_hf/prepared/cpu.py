"""What this CPU offers bf16 matrix products: its model name and which bf16 dot-product flags it reports.

``bf16_units()`` reads the flags from ``/proc/cpuinfo`` (an unreadable file, as on macOS or Windows, reports none:
bf16 support is never assumed); pass the file's text to read another machine's. ``amx_bf16`` (AMX tiles) and
``avx512_bf16`` (AVX-512 ``vdpbf16ps``) are the units oneDNN runs bf16 GEMMs on; without either, torch's bf16 GEMM
converts to fp32 as it goes and is slower than fp32 itself, so ``adaflash_hf.prepare_target`` keeps fp32 there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BF16_UNITS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(text: str | None) -> str:
    if text is not None:
        return text
    try:
        return CPUINFO.read_text()
    except OSError:
        return ""


def bf16_units(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The flags of ``BF16_UNITS`` the CPU reports (``cpuinfo``: /proc/cpuinfo's text; read when None)."""
    flags = set()
    for line in _cpuinfo(cpuinfo).splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return tuple(unit for unit in BF16_UNITS if unit in flags)


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("unknown" where /proc/cpuinfo does not say)."""
    for line in _cpuinfo(cpuinfo).splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return "unknown"


def cpu_digest(cpuinfo: str | None = None) -> str:
    """Eight hex digits of the CPU's model name and flags: what code compiled for this CPU's instructions is kept
    under, so that a home folder shared by machines of other CPUs never loads it there."""
    flags = ""
    for line in _cpuinfo(cpuinfo).splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags = " ".join(sorted(value.split()))
            break
    return hashlib.sha256(f"{cpu_model(cpuinfo)}|{flags}".encode()).hexdigest()[:8]


def cpu_record() -> dict:
    """What a benchmark record says about the CPU: model, bf16 flags (present and missing), torch's vector ISA."""
    import torch

    units = bf16_units()
    return {
        "model": cpu_model(),
        "bf16_units": list(units),
        "missing_bf16_units": [unit for unit in BF16_UNITS if unit not in units],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }
