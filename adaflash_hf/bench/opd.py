"""The online-distillation experiment: τ per domain over OPD rounds for each loss variant, from one offline drafter.

    adaflash bench opd [--config examples/configs/opd_bench.yaml] [--variants none ce rkl adaflash]
                       [--eval-prompts-per-domain 16] [--output-dir runs/bench_opd] [--skip-training]
    adaflash bench opd --config experiments/configs/opd_new_domain.yaml --output-dir runs/opd_new_domain \
        --variants none ce rkl adaflash head_frozen replay --replay-fraction 0.25 0.5 --eval-prompts-per-domain 32

1. **Online runs.** Per run, ``accelerate launch --cpu --num_processes 1 trainers/opd.py --config CONFIG
   --output_dir OUT/RUN FLAGS`` with the variant's flags (``VARIANTS``): no online updates (the offline DFlash-style
   drafter as shipped), CE only (α=1, OSD-style hard distillation), reverse KL unclipped (α=0, δ=1e6), AdaFlash
   (α=0.8, δ=0.01, the config's defaults), AdaFlash with the length head frozen as loaded (``head_frozen``), and on
   request (``--variants ... replay``) AdaFlash with a replay mix, one run ``replay-<f>`` per ``--replay-fraction`` f
   of each buffer drawn from recent served samples of ``--replay-domains``. All serve the same traffic (the config's
   domain phases, greedy, with backpressure, so buffer r holds the same requests in every run; a replay mix takes
   fewer fresh ones per buffer). Every run's settings are parsed as ``trainers/opd.py`` parses them before anything
   runs, so a bad setting fails at once. A run whose ``metrics.csv`` already has ``max_rounds`` rows is not rerun
   (delete its folder to rerun it).
2. **Evaluation** (``adaflash_hf.online.evaluate``). The starting drafter (round 0) and each run's checkpoint after
   every round serve (``evaluation_engine``, greedy) ``--eval-prompts-per-domain`` held-out prompts of every domain
   in ``DOMAINS`` and of the traffic's own (``evaluation_domains``) that the traffic never serves (``eval_prompts``,
   checked before any run starts); ``evaluate_drafter`` reports τ and what the full draft would have achieved
   (per-position acceptance, τ_full, the length head's mean |â - a*|). Every evaluation's outputs must equal the
   round-0 outputs token for token (lossless serving). Results are cached per (run, round) in ``OUT/eval``.
3. **Outputs** in ``OUT`` (``opd_report``): ``results.json`` (with per-prompt counts), ``table.md`` (τ with paired
   bootstrap 95% intervals over the prompts), ``tau_vs_rounds.png``, ``acceptance_per_position.png`` (round 0 against
   each run's last round) and ``head_error_vs_rounds.png``. ``experiments/goals.py opd`` grades the experiment's
   goals on ``results.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging as std_logging
import shlex
import subprocess
import time
from pathlib import Path

from transformers.utils import logging

from adaflash_hf.bench import report
from adaflash_hf.bench.opd_report import markdown_table, plot_head_error, plot_per_position, plot_tau
from adaflash_hf.bench.targets import start_run
from adaflash_hf.launch import int_at_least
from adaflash_hf.online.evaluate import (
    eval_prompts,
    eval_texts,
    evaluate_drafter,
    evaluation_domains,
    evaluation_engine,
    read_metrics,
    served_counts,
)
from adaflash_hf.online.weights import checkpoints_by_round, load_state, sha256_file

logger = logging.get_logger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "opd_bench.yaml"
VARIANTS = {
    "none": ("no online updates (offline drafter)", ["--online_updates", "false"]),
    "ce": ("CE only, α=1 (OSD-style)", ["--alpha", "1.0"]),
    "rkl": ("reverse KL unclipped, α=0", ["--alpha", "0.0", "--delta", "1e6"]),
    "adaflash": ("AdaFlash: 0.8·CE + 0.2·clipped RKL (δ=0.01)", []),
    "head_frozen": ("AdaFlash with the length head frozen as loaded", ["--freeze_length_head", "true"]),
    "replay": ("AdaFlash with a replay mix, one run per --replay-fraction (replay-<f>)", []),
}
DEFAULT_VARIANTS = ("none", "ce", "rkl", "adaflash")
# Settings the evaluation reads from the config; overriding them per launch could serve an evaluation prompt.
CONFIG_ONLY = (
    "--domains",
    "--prompts_per_domain",
    "--phase_prompts",
    "--max_prompt_tokens",
    "--seed",
    "--output_dir",
    "--config",
)


def _digest(outputs: dict[str, list[list[int]]]) -> str:
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- runs
def run_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each run's name and ``trainers/opd.py`` flags: one per variant, and for ``replay`` one per ``--replay-fraction``
    f, named ``replay-<f>`` (its replay domains from ``--replay-domains``, else the config's)."""
    runs = {}
    for variant in args.variants:
        if variant != "replay":
            runs[variant] = list(VARIANTS[variant][1])
            continue
        domains = ["--replay_domains", *args.replay_domains] if args.replay_domains else []
        for fraction in args.replay_fraction:
            runs[f"replay-{fraction:g}"] = ["--replay_fraction", str(fraction), *domains]
    return runs


def run_settings(config_path: Path, flags: list[str]) -> dict:
    """Every setting of an online run of ``config_path`` with ``flags``, defaults included, parsed and checked as
    ``trainers/opd.py`` parses them (its replay domains against its traffic too), before anything runs."""
    from adaflash_hf.online.buffer import check_replay_domains
    from adaflash_hf.trainers.opd import make_parser

    script, online, training, model = make_parser().parse_args_and_config(
        ["--config", str(config_path), *flags]
    )
    check_replay_domains(online.replay_fraction, online.replay_domains, script.domains)
    return {
        name: getattr(part, name)
        for part in (model, training, online, script)
        for name in part.__dataclass_fields__
    }


def run_variant(config_path: Path, config: dict, variant: str, output_dir: Path, flags: list[str]) -> Path:
    """Launch one online run with ``flags`` (the launch arguments, then the variant's) unless its metrics already
    cover ``max_rounds``; returns its folder."""
    run_dir = output_dir / variant
    done = len(read_metrics(run_dir)) >= int(config["max_rounds"])
    if done:
        logger.info(f"{variant}: {run_dir}/metrics.csv already has {config['max_rounds']} rounds, not rerun")
        return run_dir
    from adaflash_hf.launch import launch_command, trainer_script

    launcher = argparse.Namespace(accelerate_config=None, num_processes=1)
    arguments = ["--config", str(config_path), "--output_dir", str(run_dir), "--resume", "false", *flags]
    command = launch_command(trainer_script("opd.py"), launcher, arguments)
    command[3:3] = ["--cpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    output_dir.mkdir(parents=True, exist_ok=True)
    logger.info(f"{variant}: {' '.join(command)} (log: {output_dir / f'{variant}.log'})")
    started = time.perf_counter()
    with open(output_dir / f"{variant}.log", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{variant}: the online run failed (exit {result.returncode}); see its log")
    logger.info(f"{variant}: done in {time.perf_counter() - started:.0f} s")
    return run_dir


# ---------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash bench opd",
        description="Online distillation experiment: τ per domain over OPD rounds for four loss variants.",
    )
    variants = (
        "; ".join(f"{k}: {v[0]}" for k, v in VARIANTS.items()) + f" (default: {' '.join(DEFAULT_VARIANTS)})"
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help=f"OPD YAML (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS), help=variants
    )
    parser.add_argument(
        "--replay-fraction",
        type=float,
        nargs="+",
        default=[0.25],
        help="the replay variant's fractions of each buffer drawn from recent served samples of the replay domains, "
        "one run (replay-<f>) each (default 0.25; trainers/opd.py --replay_fraction)",
    )
    parser.add_argument(
        "--replay-domains",
        nargs="+",
        help="the replay variant's replay domains: traffic domains other than the new one, served before it "
        "(default: the config's replay_domains)",
    )
    parser.add_argument("--eval-prompts-per-domain", type=int_at_least(1), default=16, help="per domain (16)")
    parser.add_argument(
        "--eval-max-new-tokens", type=int_at_least(1), help="default: the config's max_new_tokens"
    )
    parser.add_argument(
        "--threads", type=int_at_least(1), default=2, help="torch threads for the evaluation (2)"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_opd"), help="where outputs go")
    parser.add_argument(
        "--launch-args", default="", help="more trainers/opd.py arguments for every run, one string"
    )
    parser.add_argument(
        "--skip-training", action="store_true", help="evaluate existing runs only; launch nothing"
    )
    return parser


def _evaluate_all(args, config, prompts, run_dirs, target) -> dict:
    from safetensors.torch import load_file

    from adaflash_hf import AdaFlashDrafter

    max_new = args.eval_max_new_tokens or int(config["max_new_tokens"])
    concurrency = int(config["concurrency"])
    settings = {
        "prompts": _digest(prompts),
        "max_new_tokens": max_new,
        "concurrency": concurrency,
        "full_drafts": True,
        "head_error": True,  # records carry â (an older evaluation, without it, is recomputed)
    }
    base = AdaFlashDrafter.from_pretrained(config["drafter_init"], dtype=target.dtype).eval()
    initial = {n: t.clone() for n, t in base.state_dict().items()}
    initial_digest = hashlib.sha256(
        b"".join(t.float().numpy().tobytes() for t in initial.values())
    ).hexdigest()
    cache_dir = args.output_dir / "eval"
    cache_dir.mkdir(parents=True, exist_ok=True)

    def evaluate(name: str, weights: Path | None) -> dict:
        """Evaluate ``weights`` (a checkpoint's safetensors; None = the starting drafter), cached by content."""
        path = cache_dir / f"{name}.json"
        key = {**settings, "weights": sha256_file(weights) if weights is not None else initial_digest}
        if path.is_file():
            cached = json.loads(path.read_text())
            if cached.get("settings") == key:
                return cached
        load_state(base, initial if weights is None else load_file(str(weights)))
        started = time.perf_counter()
        engine = evaluation_engine(target, base, prompts, concurrency)
        summary, outputs = evaluate_drafter(engine, prompts, max_new)
        record = {"settings": key, "summary": summary, "outputs": _digest(outputs)}
        report.write_json(path, record)
        logger.info(
            f"eval {name}: "
            + ", ".join(f"{d} τ {s['tau']:.3f}/{s['tau_full']:.3f}" for d, s in summary.items())
            + f" ({time.perf_counter() - started:.0f} s)"
        )
        return record

    start = evaluate("round0", None)
    evaluation = {}
    for variant, run_dir in run_dirs.items():
        evaluation[variant] = {0: start["summary"]}
        if variant == "none":
            rounds = len(read_metrics(run_dir))
            evaluation[variant].update({r: start["summary"] for r in range(1, rounds + 1)})
            continue
        for rnd, checkpoint in sorted(checkpoints_by_round(run_dir).items()):
            record = evaluate(f"{variant}-r{rnd}", checkpoint / "drafter.safetensors")
            if record["outputs"] != start["outputs"]:
                raise RuntimeError(
                    f"{variant} round {rnd}: evaluation outputs differ from round 0 (not lossless)"
                )
            evaluation[variant][rnd] = record["summary"]
    return evaluation


def _runs(args, settings: dict[str, dict], flags: dict[str, list[str]]) -> dict[str, Path]:
    """Each run's folder (``run_flags``): launched (or reused) by ``run_variant``, or, with ``--skip-training``, as
    found."""
    run_dirs = {}
    for variant in flags:
        if args.skip_training:
            run_dirs[variant] = args.output_dir / variant
            if not read_metrics(run_dirs[variant]):
                raise SystemExit(
                    f"--skip-training: {run_dirs[variant]}/metrics.csv has no rounds to evaluate"
                )
        else:
            run_dirs[variant] = run_variant(
                args.config, settings[variant], variant, args.output_dir, flags[variant]
            )
    return run_dirs


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    std_logging.basicConfig(level=std_logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.set_verbosity_info()
    launch_args = shlex.split(args.launch_args)
    fixed = sorted({a.split("=")[0] for a in launch_args} & set(CONFIG_ONLY))
    if fixed:
        raise SystemExit(
            f"--launch-args: expected no traffic settings ({', '.join(CONFIG_ONLY)}: the evaluation reads them from "
            f"--config, to keep its prompts unserved), got {', '.join(fixed)}"
        )
    own = run_flags(args)
    flags = {run: [*launch_args, *run_own] for run, run_own in own.items()}
    settings = {run: run_settings(args.config, run_flags_) for run, run_flags_ in flags.items()}
    config = next(iter(settings.values()))  # the traffic and serving settings, the same in every run
    eval_texts(
        config, args.eval_prompts_per_domain, evaluation_domains(config)
    )  # its counts, before the target
    from adaflash_hf.assets import load_target

    target, tokenizer = load_target(config["target_model"])
    prompts = eval_prompts(tokenizer, config, args.eval_prompts_per_domain)  # refused here, before any run
    run_dirs = _runs(args, settings, flags)
    start_run(args.threads)  # after the runs: they keep the threads they were launched with
    evaluation = _evaluate_all(args, config, prompts, run_dirs, target)
    results = {
        "settings": {
            "config": str(args.config),
            "variants": list(own),
            "variant_flags": own,
            "replay_fractions": {
                run: settings[run]["replay_fraction"] for run in own if run.startswith("replay-")
            },
            "launch_args": args.launch_args,
            "domains": list(evaluation_domains(config)),
            "new_domain": config["domains"][-1],  # the traffic shifts to its last phase's domain
            "traffic": {"domains": config["domains"], "served": served_counts(config)},
            "train_threshold": int(config["train_threshold"]),
            "max_rounds": int(config["max_rounds"]),
            "eval_prompts_per_domain": args.eval_prompts_per_domain,
            "eval_max_new_tokens": args.eval_max_new_tokens or int(config["max_new_tokens"]),
            "command": report.command("opd", argv),
        },
        "evaluation": {v: {str(r): s for r, s in rounds.items()} for v, rounds in evaluation.items()},
        "live": {v: read_metrics(d) for v, d in run_dirs.items()},
    }
    figures = {
        "tau_vs_rounds.png": plot_tau,
        "acceptance_per_position.png": plot_per_position,
        "head_error_vs_rounds.png": plot_head_error,
    }
    figures = {name: lambda path, draw=draw: draw(results, path) for name, draw in figures.items()}
    report.write_outputs(args.output_dir, results, markdown_table(results), figures)
    return report.finish("opd", results, args.output_dir, markdown_table(results))


if __name__ == "__main__":
    raise SystemExit(main())
