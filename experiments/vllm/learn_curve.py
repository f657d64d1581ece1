"""Live τ of ``adaflash serve --engine vllm --learn`` per window of requests, from the trajectories the plugin records.

Not part of ``make test``. Start the server learning on a domain the shipped drafter never saw, drive it with that
domain's prompts, then read the curve (in the project's venv):

    adaflash serve --engine vllm --learn --learn-dir runs/vllm_learn --length-mode adaptive --port 8000 &
    adaflash bench http --server learn=http://127.0.0.1:8000/v1 --domains translate --concurrency 4 \\
        --requests 1000 --max-tokens 64 --duration-s 7200 --output-dir runs/vllm_learn/http
    .venv/bin/python experiments/vllm/learn_curve.py runs/vllm_learn --window 100

Each finished request's trajectory (``<learn-dir>/vllm/records/trajectories-*.jsonl``, in the order requests
finished) gives its τ = (accepted drafts + rounds) / rounds and the drafter version that drafted it; the curve is the
mean τ per ``--window`` requests with a 95% bootstrap interval, beside the version served. Writes
``<learn-dir>/learn_curve.json`` and ``learn_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def read_trajectories(learn_dir: Path) -> list[dict]:
    lines = []
    for path in sorted((learn_dir / "vllm" / "records").glob("trajectories-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def curve(trajectories: list[dict], window: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for start in range(0, len(trajectories) - window + 1, window):
        chunk = trajectories[start : start + window]
        taus = [(sum(t["accepted"]) + len(t["accepted"])) / len(t["accepted"]) for t in chunk]
        means = sorted(sum(rng.choices(taus, k=len(taus))) / len(taus) for _ in range(2000))
        out.append(
            {
                "requests": start + window,
                "tau": sum(taus) / len(taus),
                "tau_95": [means[50], means[1949]],
                "mean_draft_length": sum(sum(t["draft_lengths"]) for t in chunk)
                / sum(len(t["draft_lengths"]) for t in chunk),
                "drafter_version": max(t["drafter_version"] for t in chunk),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("learn_dir", type=Path)
    parser.add_argument("--window", type=int, default=100)
    args = parser.parse_args(argv)
    points = curve(read_trajectories(args.learn_dir), args.window)
    (args.learn_dir / "learn_curve.json").write_text(json.dumps(points, indent=1) + "\n")
    from adaflash_hf.bench.report import line_plot

    line_plot(
        args.learn_dir / "learn_curve.png",
        {"τ per window": ([p["requests"] for p in points], [p["tau"] for p in points])},
        "requests served",
        "τ (committed tokens per round)",
        title=f"adaflash serve --engine vllm --learn: live τ per {args.window} requests",
    )
    for point in points:
        print(json.dumps(point))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
