"""The ``adaflash`` command line (console script declared in setup.cfg).

    adaflash export --format dflash PATH OUT    drafter -> z-lab DFlash layout for SGLang/vLLM (+ length-head sidecar)
    adaflash import PATH OUT                    z-lab DFlash / official AdaFlash / Muse-Glimmer / exported -> ours
    adaflash publish PATH REPO_ID               upload with a model card in one commit (``--dry-run`` to preview)
    adaflash serve [--learn]                    OpenAI-compatible HTTP server, optionally learning from its traffic
    adaflash bench NAME ...                     run ``adaflash_hf.bench.NAME:main`` (kernels, generate, serve, verify-cost, opd, train, http)
    adaflash train ... / adaflash opd ...       ``accelerate launch`` the trainer scripts shipped in adaflash_hf.trainers
    adaflash corpus ...                         regenerate the drafter training corpus (``trainers/corpus.py``)
    adaflash calibrate-head ...                 fit only the length head from realised acceptance (``trainers/calibrate_head.py``)

Subcommands backed by modules or scripts missing from this installation are listed as "not available in this version"
and exit with status 2. ``adaflash <command> --help`` describes each. ``--config FILE`` (YAML) supplies a command's
options, each checked as on the command line. A usage error (an unknown option, a value an option refuses while the
command line is parsed) is argparse's usage and ``error: ...``, exit status 2; any other error in the input is one line
``adaflash <command>: error: ...`` on stderr with exit status 1; ``ADAFLASH_DEBUG=1`` shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import adaflash_hf
from adaflash_hf.launch import (
    CONFIG_HELP,
    LAUNCHER_ENV,
    config_files_in,
    error_line,
    int_at_least,
    launch_command,
    load_yaml_mapping,
    number_in,
    parse_args_with_config,
    show_tracebacks,
    trainer_script,
    user_error,
)

# Heavy modules (torch, transformers, the interop and hub code) are imported by the handlers that need them, and
# adaflash_hf.install() runs only once a command is chosen: `adaflash --help` stays an argparse program.

BENCH_MODULES = {
    "kernels": (
        "adaflash_hf.bench.kernels",
        "micro-benchmark the Triton kernels against their torch references",
    ),
    "generate": (
        "adaflash_hf.bench.generate",
        "τ and speed-up of AdaFlash vs baselines with target.generate",
    ),
    "serve": ("adaflash_hf.bench.serve", "throughput of the batched serving engine under concurrency"),
    "verify-cost": (
        "adaflash_hf.bench.verify_cost",
        "cost of a target forward of n = 1..16 tokens vs 1: fp32, bf16 and the prepared target",
    ),
    "opd": ("adaflash_hf.bench.opd", "online distillation experiment: τ per domain over OPD rounds per loss"),
    "train": ("adaflash_hf.bench.train", "blocks/s and peak memory of one offline drafter-training step"),
    "http": (
        "adaflash_hf.bench.http",
        "tokens/s, time to first token and inter-token latency of adaflash serve",
    ),
}
TRAINER_SCRIPTS = {
    "train": ("train_drafter.py", "train a drafter from scratch for a causal LM (accelerate launch)"),
    "opd": ("opd.py", "online on-policy distillation of a drafter (accelerate launch)"),
}
UNAVAILABLE = 2


def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _not_available(what: str, reason: str) -> int:
    print(f"adaflash {what}: not available in this version ({reason})", file=sys.stderr)
    return UNAVAILABLE


# -------------------------------------------------------------------------------------------- handlers
def _run_export(args) -> int:
    from adaflash_hf.interop import check_out_folder, export_dflash

    check_out_folder(args.out, args.overwrite, hint="--overwrite")
    out = export_dflash(
        args.path,
        args.out,
        format=args.format,
        target_config=args.target_config,
        revision=args.revision,
        overwrite=args.overwrite,
    )
    print(f"wrote {args.format} checkpoint to {out}")
    return 0


def _run_import(args) -> int:
    from adaflash_hf.interop import check_out_folder, import_checkpoint

    check_out_folder(args.out, args.overwrite, hint="--overwrite")
    out = import_checkpoint(
        args.path,
        args.out,
        target_config=args.target_config,
        revision=args.revision,
        overwrite=args.overwrite,
    )
    print(f"wrote AdaFlash checkpoint to {out}")
    return 0


def _run_publish(args) -> int:
    from adaflash_hf.hub import push_drafter

    result = push_drafter(
        args.path,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        bench_json=args.bench_json,
        training_command=args.training_command,
        datasets=args.dataset or None,
        license=args.license,
        base_model=args.base_model,
        target_config=args.target_config,
        tags=args.tag or None,
        commit_message=args.commit_message,
        create_pr=args.create_pr,
        dry_run=args.dry_run,
    )
    if args.dry_run:
        print(f"would upload to {args.repo_id}@{args.revision or 'main'} in one commit:")
        for path, size in result:
            print(f"  {path}  ({size:,} bytes)")
    else:
        print(f"published {args.repo_id}@{args.revision or 'main'}: {getattr(result, 'commit_url', result)}")
    return 0


LEARN_ONLY = ("learn_dir", "train_threshold", "opd_config")  # serve options that only --learn reads
DRAFTER_ONLY = ("draft_source", "length_mode")  # and those that only a drafter reads
VLLM_ONLY = ("vllm_python", "vllm_dir", "vllm_arg")  # and those that only --engine vllm reads


def _serve_usage_error(args) -> str | None:
    """An option ``adaflash serve`` would otherwise ignore: a --learn option without --learn, a drafting option
    with --drafter none."""

    def given(dest: str) -> str:
        return f"--{dest.replace('_', '-')} {getattr(args, dest)}"

    if not args.learn:
        for dest in LEARN_ONLY:
            if getattr(args, dest) is not None:
                return f"{given(dest)}: expected together with --learn (the drafter learns only then), got no --learn"
    if args.drafter == "none":
        for dest in DRAFTER_ONLY:
            if getattr(args, dest) is not None:
                return f"{given(dest)}: expected a drafter to draft with, got --drafter none (plain decoding)"
    if args.token_budget is not None and args.token_budget < args.max_running:
        return (
            f"--token-budget {args.token_budget}: expected at least --max-running {args.max_running} (every running "
            "request verifies at least one token per step)"
        )
    return None


def _run_serve(args) -> int:
    if (problem := _serve_usage_error(args)) is not None:
        args.serve_parser.error(problem)
    args.learn_dir = args.learn_dir or DEFAULT_LEARN_DIR
    if args.engine == "vllm":
        from adaflash_hf.vllm.launch import serve_vllm, usage_error

        if (problem := usage_error(args)) is not None:
            args.serve_parser.error(problem)
        return serve_vllm(args)
    from adaflash_hf.serving.server import serve

    for dest in VLLM_ONLY:
        if getattr(args, dest) is not None:
            flag = f"--{dest.replace('_', '-')}"
            args.serve_parser.error(f"{flag}: expected together with --engine vllm, got --engine embedded")
    args.max_waiting = 64 if args.max_waiting is None else args.max_waiting
    args.default_max_tokens = 256 if args.default_max_tokens is None else args.default_max_tokens
    args.draft_source = args.draft_source or "auto"
    factory = None
    if args.learn:
        from adaflash_hf.trainers.opd_live import live_learner

        def factory(engine, target, tokenizer):
            return live_learner(
                engine,
                target,
                tokenizer,
                args.learn_dir,
                args.opd_config,
                train_threshold=args.train_threshold,
            )

    return serve(args, factory)


def _run_bench(name: str, argv: list[str]) -> int:
    module_name = BENCH_MODULES[name][0]
    if not module_available(module_name):
        return _not_available(f"bench {name}", f"module {module_name} is not installed")
    main = getattr(importlib.import_module(module_name), "main", None)
    if main is None:
        return _not_available(f"bench {name}", f"{module_name} has no main()")
    saved_argv, sys.argv = sys.argv, [f"adaflash bench {name}", *argv]
    try:
        # bench mains take argv as their first parameter, or read sys.argv when they take none
        result = main(list(argv)) if inspect.signature(main).parameters else main()
    finally:
        sys.argv = saved_argv
    return result if isinstance(result, int) else 0


_LAUNCHER_OPTIONS = ("--accelerate-config", "--num-processes")


def split_launcher_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``adaflash train|opd`` arguments into ours (launcher options, --dry-run, --help) and the script's.

    The script's arguments keep their order; a ``--`` ends our options so the script can receive ``--help``.
    """
    ours: list[str] = []
    script: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            script += argv[i + 1 :]
            break
        if arg.split("=", 1)[0] in _LAUNCHER_OPTIONS:
            take = 1 if "=" in arg else 2
            ours += argv[i : i + take]
            i += take
            continue
        (ours if arg in ("--dry-run", "-h", "--help") else script).append(arg)
        i += 1
    return ours, script


def _run_trainer(name: str, launcher_args: argparse.Namespace, script_args: list[str]) -> int:
    filename = TRAINER_SCRIPTS[name][0]
    script = trainer_script(filename)
    if script is None:
        return _not_available(name, f"adaflash_hf/trainers/{filename} is not installed")
    command = launch_command(script, launcher_args, script_args)
    if launcher_args.dry_run:
        print(" ".join(command))
        return 0
    for path in config_files_in(script_args):  # a broken file is one line here, before accelerate starts
        load_yaml_mapping(path)
    from transformers.utils import logging

    logging.get_logger(__name__).info(f"Running {' '.join(command)}")
    return subprocess.call(command, env={**os.environ, LAUNCHER_ENV: f"adaflash {name}"})


# ---------------------------------------------------------------------------------------------- parser
def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target-config",
        help="target config.json, model folder or repo id: refuse a drafter recorded for another target",
    )
    parser.add_argument("--revision", help="branch, tag or commit when PATH is a Hub repo id")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT folder")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)


def _add_export(commands) -> None:
    export = commands.add_parser(
        "export",
        help="write a drafter in the z-lab DFlash layout that SGLang and vLLM load",
        description="Write PATH (our layout, z-lab, official AdaFlash, Muse-Glimmer; folder or repo id) to OUT. "
        "The length head goes to adaflash_length_head.{safetensors,json}; a learned mask embedding also to "
        "mask_embedding.pt (vLLM).",
    )
    export.add_argument(
        "--format",
        choices=("dflash", "adaflash-official"),
        default="dflash",
        help="dflash: z-lab layout + sidecar; adaflash-official: head inside model.safetensors (SGLang PR #34171)",
    )
    export.add_argument("path", metavar="PATH", help="drafter folder or Hub repo id")
    export.add_argument("out", metavar="OUT", help="output folder (new or empty)")
    _add_checkpoint_options(export)
    export.set_defaults(handler=_run_export)

    imp = commands.add_parser(
        "import",
        help="convert a z-lab DFlash, official AdaFlash or Muse-Glimmer checkpoint to the AdaFlash layout",
        description="Load PATH (folder or repo id; an exported sidecar and mask_embedding.pt are restored) and save "
        "it in our layout with remote code. With --target-config, missing target fingerprint fields are recorded.",
    )
    imp.add_argument("path", metavar="PATH", help="checkpoint folder or Hub repo id")
    imp.add_argument("out", metavar="OUT", help="output folder (new or empty)")
    _add_checkpoint_options(imp)
    imp.set_defaults(handler=_run_import)


def _add_publish(commands) -> None:
    publish = commands.add_parser(
        "publish",
        help="upload a drafter with its model card to the Hub in one commit",
        description="Upload safetensors weights, config, remote code and a README model card to REPO_ID in a single "
        "commit (a failed upload leaves the repo as it was).",
    )
    publish.add_argument("path", metavar="PATH", help="drafter folder (any supported layout) or Hub repo id")
    publish.add_argument("repo_id", metavar="REPO_ID", help="target repo, e.g. my-org/Qwen3-8B-AdaFlash")
    publish.add_argument("--private", action="store_true", help="create the repo as private")
    publish.add_argument("--revision", help="branch to commit to (created if missing)")
    publish.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    publish.add_argument("--bench-json", help="bench JSON whose τ/speed-up rows go into the card")
    publish.add_argument("--training-command", help="the command that trained the drafter, shown in the card")
    publish.add_argument("--dataset", action="append", help="training dataset repo id (repeatable)")
    publish.add_argument("--license", default="apache-2.0", help="license identifier (default: apache-2.0)")
    publish.add_argument("--base-model", help="the target's Hub repo id (default: from --target-config)")
    publish.add_argument(
        "--target-config", help="target config.json, folder or repo id to check the drafter against"
    )
    publish.add_argument("--tag", action="append", help="extra card tag (repeatable)")
    publish.add_argument("--commit-message", help="commit message")
    publish.add_argument(
        "--dry-run", action="store_true", help="stage and check, then list the files; upload nothing"
    )
    publish.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    publish.set_defaults(handler=_run_publish)


DEFAULT_LEARN_DIR = "runs/serve"


def _port(text: str) -> int:
    """An argparse ``type``: a TCP port, or 0 for a free one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an int in 0..65535 (0: a free one), got {text!r}"
        ) from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected an int in 0..65535 (0: a free one), got {value}")
    return value


_port.__name__ = "an int in 0..65535"  # what a --config file's error says is expected


def _add_serve_vllm_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--engine",
        choices=("embedded", "vllm"),
        default="embedded",
        help="embedded (default: this package's engine) or vllm (vLLM's OpenAI server with the AdaFlash plugin, "
        "from its own environment: make vllm-env; fp32 under --dtype auto; --length-mode auto: goodput, adaptive with --learn)",
    )
    serve.add_argument(
        "--vllm-python",
        help="--engine vllm: vLLM's Python (default $ADAFLASH_VLLM_PYTHON, else .venv-vllm/bin/python)",
    )
    serve.add_argument(
        "--vllm-dir",
        help="--engine vllm: where the target and drafter folders vLLM loads are written (runs/vllm)",
    )
    serve.add_argument(
        "--vllm-arg",
        action="append",
        help="--engine vllm: one more option for vLLM's server, e.g. --vllm-arg=--enforce-eager (repeatable)",
    )


def _add_serve(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and completions, streamed or not) that can keep learning",
        description="Serve TARGET with DRAFTER over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
        "/health, /metrics (Prometheus). With no options: the offline SmolLM2 target and the shipped drafter on "
        "http://127.0.0.1:8000/v1. SIGTERM stops it gracefully (exit status 0).",
    )
    serve.add_argument(
        "--target", default="smollm2-135m-instruct", help="target (adaflash_hf.assets.load_target)"
    )
    serve.add_argument(
        "--drafter", help="drafter folder or repo id (default: the shipped SmolLM2 drafter); none = plain"
    )
    serve.add_argument(
        "--draft-source",
        choices=("auto", "diffusion", "hybrid"),
        help="drafts from (default auto: hybrid); needs a drafter",
    )
    serve.add_argument(
        "--length-mode",
        choices=("auto", "adaptive", "fixed", "goodput"),
        help="draft lengths (default auto; adaptive with --learn, the feedback OPD learns from); needs a drafter",
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "int4"),
        default="auto",
        help="the target's dtype (auto: adaflash_hf.prepare_target's choice, timed on this machine: bf16 with the "
        "batch-invariant forward, its 4-bit codes where the target is 4-bit already (a Q4 GGUF), or fp32; fp32 "
        "with --learn); bf16 and int4 are always prepared, so every greedy output equals plain decoding of the "
        "same target",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=_port, default=8000, help="port, 0..65535 (default 8000; 0 = a free one, printed)"
    )
    serve.add_argument(
        "--max-running", type=int_at_least(1), default=16, help="requests in the engine's batch (default 16)"
    )
    serve.add_argument(
        "--max-waiting",
        type=int_at_least(0),
        help="accepted requests waiting beyond those; more get 429 (default 64)",
    )
    serve.add_argument(
        "--token-budget",
        type=int_at_least(1),
        help="the most tokens one step's target forward takes, prompts being prefilled and drafts being verified "
        "together; a longer prompt is refused with a 400 (default: the model's context)",
    )
    serve.add_argument(
        "--default-max-tokens", type=int_at_least(1), help="max_tokens when a request has none (default 256)"
    )
    serve.add_argument("--served-model-name", help="the model id clients send (default: the target's name)")
    serve.add_argument(
        "--grace-period", type=number_in(0), default=30.0, help="seconds running requests get at SIGTERM"
    )
    serve.add_argument(
        "--learn", action="store_true", help="train the drafter on the traffic and hot-reload it"
    )
    serve.add_argument(
        "--learn-dir", help=f"--learn: weights/ and checkpoints/, resumed (default {DEFAULT_LEARN_DIR})"
    )
    serve.add_argument(
        "--train-threshold", type=int_at_least(1), help="--learn: finished requests per training round (128)"
    )
    serve.add_argument("--opd-config", metavar="FILE", help="--learn: OPD trainer and buffer settings (YAML)")
    _add_serve_vllm_options(serve)
    serve.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    serve.set_defaults(handler=_run_serve, serve_parser=serve)


def _add_pass_through(commands) -> None:
    """Commands whose arguments go to a module's or script's own parser (described here, parsed there)."""
    bench = commands.add_parser(
        "bench",
        help="run a benchmark",
        description="Benchmarks. `adaflash bench NAME ARGS...` passes ARGS (--help included) to NAME's main(), "
        "e.g. `adaflash bench opd --config examples/configs/opd_smollm2.yaml`.",
    )
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, (module_name, summary) in BENCH_MODULES.items():
        available = module_available(module_name)
        bench_commands.add_parser(
            name, help=summary if available else f"{summary} (not available in this version)"
        )
    commands.add_parser(
        "corpus",
        help="regenerate the drafter training corpus with the target (resumable), recording target features",
        add_help=False,
    )
    commands.add_parser(
        "calibrate-head",
        help="fit only the length head (drafter frozen) from realised acceptance, e.g. for a DFlash checkpoint",
        add_help=False,
    )
    for name, (filename, summary) in TRAINER_SCRIPTS.items():
        available = trainer_script(filename) is not None
        sub = commands.add_parser(
            name,
            help=summary if available else f"{summary} (not available in this version)",
            allow_abbrev=False,
            description=f"accelerate launch adaflash_hf/trainers/{filename} ARGS. Options below go to accelerate; "
            f"everything else goes to the script; `adaflash {name} -- --help` shows its options.",
        )
        sub.add_argument(
            "--config", metavar="FILE", help="the script's YAML config (passed to it, TRL style)"
        )
        sub.add_argument(
            "--accelerate-config", help="accelerate config file (accelerate launch --config_file)"
        )
        sub.add_argument(
            "--num-processes", type=int, help="processes to launch (accelerate launch --num_processes)"
        )
        sub.add_argument(
            "--dry-run", action="store_true", help="print the launch command instead of running it"
        )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash",
        description="AdaFlash adaptive-length speculative decoding drafters: convert, publish, benchmark, train.",
        epilog="A usage error (an unknown option, a value an option refuses) exits with status 2, as argparse does; "
        "any other error in the input is one line on stderr (exit status 1); ADAFLASH_DEBUG=1 shows its traceback.",
    )
    parser.add_argument("--version", action="version", version=f"adaflash-hf {adaflash_hf.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_export(commands)
    _add_publish(commands)
    _add_serve(commands)
    _add_pass_through(commands)
    parser.commands = commands.choices  # name -> subparser, for --config defaults
    return parser


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    # Pass-through commands keep argparse away from the arguments of the module or script they run.
    if argv[:1] and argv[0] in TRAINER_SCRIPTS:  # a subprocess: the script imports adaflash_hf itself
        ours, script_args = split_launcher_args(argv[1:])
        return _run_trainer(argv[0], parser.parse_args([argv[0], *ours]), script_args)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH_MODULES:
        adaflash_hf.install()
        return _run_bench(argv[1], argv[2:])
    if argv[:1] == ["corpus"]:
        from adaflash_hf.trainers.corpus import main as corpus_main

        adaflash_hf.install()
        print(json.dumps(corpus_main(argv[1:])))
        return 0
    if argv[:1] == ["calibrate-head"]:
        from adaflash_hf.trainers.calibrate_head import main as calibrate_main
        from adaflash_hf.trainers.calibrate_head import summary_line

        adaflash_hf.install()
        print(summary_line(calibrate_main(argv[1:])))
        return 0
    # the file's values become defaults, so explicit arguments still win
    args = parse_args_with_config(parser, argv, parser.commands.get(argv[0]) if argv else None)
    adaflash_hf.install()
    return args.handler(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(make_parser(), argv)
    except Exception as error:
        shown = user_error(error)
        if shown is None or show_tracebacks():
            raise
        command = " ".join(["adaflash", *argv[: 2 if argv[:1] == ["bench"] else 1]])
        print(error_line(command, shown), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
