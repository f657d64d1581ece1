"""Restore the pinned drafter an experiment starts from, out of git history.

The tree keeps one drafter checkpoint (the shipped one). An experiment that starts from an older drafter names it in
its config as ``drafter_init: runs/starts/<name>``; this script writes that folder from the commit that holds it:

    python experiments/restore_start.py long_run_start                  # -> runs/starts/long_run_start
    python experiments/restore_start.py --config experiments/configs/long_run.yaml   # the config's start, if pinned
    python experiments/restore_start.py --list

``run_long.sh`` and ``run_sweep.sh`` call it with ``--config`` before they launch. Needs a clone with history (not a
shallow one).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The last commit whose tree held every pinned start (under examples/results/), and where.
COMMIT = "5b891d120b739665101030ca3ad92e360cc5881a"
STARTS = {
    "sweep_start": (
        "examples/results/sweep/stage2_start",
        "the continued first run's checkpoint-1800 (387,403 blocks), where the sweep arms resume",
    ),
    "long_run_start": (
        "examples/results/stage3/start",
        "the sweep's baseline arm after 700 steps (539,703 blocks), where the long run starts",
    ),
    "long_run_end": (
        "examples/results/stage3/resume/checkpoint-6000",
        "the long run's last checkpoint (1,826,590 blocks), where its warm restart starts",
    ),
    "opd_new_domain_start": (
        "examples/results/opd_shift/start",
        "the long run's checkpoint-3200 (1,225,796 blocks), the new-domain OPD experiment's drafter",
    ),
}
FILES = ("config.json", "model.safetensors")
STARTS_DIR = Path("runs") / "starts"


def restore(name: str, starts_dir: Path = ROOT / STARTS_DIR) -> Path:
    """Write ``<starts_dir>/<name>`` (config and weights) from ``COMMIT``; an existing complete folder is kept."""
    if name not in STARTS:
        raise ValueError(f"name: expected one of {sorted(STARTS)}, got {name!r}")
    folder = Path(starts_dir) / name
    if all((folder / f).is_file() for f in FILES):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for file in FILES:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{COMMIT}:{STARTS[name][0]}/{file}"], capture_output=True
        )
        if blob.returncode != 0:
            raise RuntimeError(
                f"git show {COMMIT[:12]}:{STARTS[name][0]}/{file}: {blob.stderr.decode().strip()} "
                "(a shallow clone lacks it: `git fetch --unshallow`)"
            )
        partial = folder / f".{file}.partial"
        partial.write_bytes(blob.stdout)
        partial.rename(folder / file)
    return folder


def pinned_start_of(config: str | Path) -> str | None:
    """The start name a config's ``drafter_init: runs/starts/<name>`` pins, or None."""
    text = Path(config).read_text(encoding="utf-8")
    match = re.search(r"^drafter_init:\s*[\"']?runs/starts/([\w-]+)", text, flags=re.MULTILINE)
    return match.group(1) if match else None


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", choices=sorted(STARTS), help="the start to restore")
    parser.add_argument("--config", help="restore the start this config's drafter_init pins, if any")
    parser.add_argument("--list", action="store_true", help="list the pinned starts")
    args = parser.parse_args(argv)
    if args.list:
        for name, (path, what) in STARTS.items():
            print(f"{name}: {what} ({COMMIT[:12]}:{path})")
        return None
    name = pinned_start_of(args.config) if args.config else args.name
    if args.config and name is None:
        return None
    if name is None:
        parser.error("expected a start name, --config or --list")
    folder = restore(name)
    print(folder)
    return folder


if __name__ == "__main__":
    main()
