"""Launching the training scripts: where an installation keeps them and the ``accelerate launch`` command line.

Used by ``adaflash train|opd`` and by benchmarks that run a training script in a subprocess (``bench opd``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def trainer_script(filename: str) -> Path | None:
    """The installed path of ``adaflash_hf/trainers/<filename>``, or None when this installation lacks it."""
    # find_spec locates the package without running its __init__, which imports trl (seconds, for a path).
    spec = importlib.util.find_spec("adaflash_hf.trainers")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / filename
        if path.is_file():
            return path
    return None


def launch_command(script: Path, launcher_args: argparse.Namespace, script_args: list[str]) -> list[str]:
    """``accelerate launch [launcher options] SCRIPT ARGS...`` as an argv list for the current interpreter.

    The script's ``--help`` runs it with plain Python: printing options needs no processes, and accelerate would open
    the help with its warning about the process count it picked (0 on a CPU-only machine without a config).
    """
    if {"-h", "--help"} & set(script_args):
        return [sys.executable, str(script), *script_args]
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if launcher_args.accelerate_config:
        command += ["--config_file", launcher_args.accelerate_config]
    if launcher_args.num_processes is not None:
        command += ["--num_processes", str(launcher_args.num_processes)]
    return [*command, str(script), *script_args]
