"""The target a benchmark runs, in the dtype and preparation its options ask for, the plain decodings a user could
run instead, and the options, start and record of a run; shared by ``adaflash bench generate`` and ``serve``.

- ``--dtype {fp32,bf16,auto}``: the benchmarked target's dtype (``auto``: bf16 where this CPU reports a bf16 unit,
  ``adaflash_hf.prepared.prepare.choose_dtype``);
- ``--prepared``: ``adaflash_hf.prepare_target(target, dtype=...)`` (bf16: the checked batch-invariant forward);
- ``--plain-baselines {fp32,bf16}``: plain decoding as transformers runs it in each dtype, timed beside the methods;
  the fastest is what a user would otherwise run, and every method's speed-up is also reported against it.

Each is a private copy of the loaded target (``load_target``'s object is shared and must stay as it is).
"""

from __future__ import annotations

import copy
import dataclasses
import logging as std_logging
import os
from pathlib import Path

import torch
import transformers

from adaflash_hf.bench.machine import cpu_flags
from adaflash_hf.bench.report import command
from adaflash_hf.launch import CONFIG_HELP, int_at_least, number_in, parse_args_with_config
from adaflash_hf.prepared.cpu import cpu_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_CHOICES = (*DTYPES, "int4", "auto")  # int4: a prepared target on its 4-bit codes (--prepared)
DEFAULT_DRAFTER = Path(__file__).resolve().parents[2] / "examples" / "drafters" / "smollm2-135m-adaflash"


def add_run_options(parser, name: str, quick: dict, compared: tuple[str, tuple], drafter: str = "") -> None:
    """The options of a run: the target and its dtype and preparation (``add_target_options``), the drafter
    (``drafter``: what else ``--drafter`` takes), what is compared (``compared``: the option's name and choices, all
    by default), the decoding, threads, outputs, ``--quick`` (the defaults in ``quick``) and ``--config``."""
    option, choices = compared
    parser.add_argument(f"--{option}", nargs="+", default=list(choices), choices=choices, help="needs plain")
    parser.add_argument("--max-new-tokens", type=int_at_least(2), help="new tokens per prompt or request")
    parser.add_argument("--repeats", type=int_at_least(1), help=f"timed runs of every one of the {option}")
    parser.add_argument("--lookup-min-prob", type=number_in(0, 1), default=0.0, help="hybrid drafting's (0)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="adaflash_hf.assets.load_target's")
    parser.add_argument(
        "--drafter", help=f"drafter folder (default: {DEFAULT_DRAFTER}, when it exists){drafter}"
    )
    parser.add_argument(
        "--threads", type=int_at_least(1), default=2, help="torch threads, OMP_NUM_THREADS (2)"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path(f"runs/bench_{name}"), help="where outputs go"
    )
    smoke = ", ".join(f"{k}={v}" for k, v in quick.items())
    parser.add_argument("--quick", action="store_true", help=f"smoke run: defaults become {smoke}")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    add_target_options(parser)


def parse_run_args(parser, argv: list[str] | None, quick: dict, full: dict, compared: str):
    """The options, those left out taking ``quick``'s values under ``--quick`` and ``full``'s otherwise; a usage error
    unless the ``compared`` option includes plain (every other one is checked against it)."""
    args = parse_args_with_config(parser, argv)
    if args.dtype == "int4" and not args.prepared:
        parser.error(
            "--dtype int4: expected --prepared with it (the 4-bit codes run in the prepared forward)"
        )
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if "plain" not in getattr(args, compared):
        parser.error(
            f"--{compared}: expected a list including plain (the reference), got {getattr(args, compared)}"
        )
    return args


def default_drafter(parser, args) -> None:
    """``--drafter`` left out: the shipped drafter, or a usage error in a checkout without it."""
    if args.drafter is None:
        if not DEFAULT_DRAFTER.is_dir():
            parser.error(
                f"--drafter: expected a drafter folder (the default {DEFAULT_DRAFTER} does not exist)"
            )
        args.drafter = str(DEFAULT_DRAFTER)


def start_run(threads: int) -> None:
    """Logging to the console, and ``threads`` torch and OpenMP threads."""
    std_logging.basicConfig(level=std_logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def machine_settings() -> dict:
    """What a record says about where it ran: threads, the CPU and its bf16 units, the library versions."""
    return {
        "threads": torch.get_num_threads(),
        "cpu": cpu_flags(),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def load_run_target(args, name: str, argv: list[str] | None, timer=None) -> tuple:
    """The target of ``--target`` as ``--dtype`` and ``--prepared`` ask (``benchmarked_target``; ``timer``: what
    ``--dtype auto`` times, as ``prepare_target`` takes it), its tokenizer, the ``--plain-baselines``
    (``plain_baselines``), and what the record says about the run's target and drafter and the command that started
    it."""
    from adaflash_hf.assets import load_target

    loaded, tokenizer = load_target(args.target)
    target, prepared = benchmarked_target(loaded, args.dtype, args.prepared, timer)
    settings = {
        "target": args.target,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "prepared": prepared,
        "drafter": None if args.drafter is None else str(args.drafter),
        "command": command(name, argv),
    }
    return target, tokenizer, plain_baselines(loaded, args.plain_baselines, target, prepared), settings


def add_target_options(parser) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="fp32",
        help="the target's dtype (default fp32; auto: bf16 where this CPU has avx512_bf16 or amx_bf16, timed with "
        "--prepared; int4, with --prepared: a 4-bit target on its own codes)",
    )
    parser.add_argument(
        "--prepared",
        action="store_true",
        help="run the target through adaflash_hf.prepare_target(dtype=--dtype): bf16 gets the batch-invariant "
        "forward, so every method must equal plain decoding of the prepared target",
    )
    parser.add_argument(
        "--plain-baselines",
        nargs="*",
        choices=tuple(DTYPES),
        default=list(DTYPES),
        help="plain decodings (transformers' own forward) timed beside the methods; speed-ups are also reported "
        "against the fastest (default: fp32 bf16; none: against this target's plain only)",
    )


def benchmarked_target(loaded, dtype: str, prepared: bool, timer=None):
    """A copy of ``loaded`` in ``dtype``, through ``prepare_target`` (with ``timer``) when ``prepared``; and the
    preparation's record (dtype, invariant, why) or None."""
    from adaflash_hf.prepared.cpu import bf16_units
    from adaflash_hf.prepared.prepare import choose_dtype, prepare_target

    target = copy.deepcopy(loaded)
    if prepared:
        return target, preparation(prepare_target(target, dtype=dtype, timer=timer))
    chosen = DTYPES.get(dtype) or choose_dtype(next(target.parameters()).device, bf16_units())[0]
    return target.to(chosen), None


def timed_baselines(baselines: dict | None) -> tuple[dict, dict]:
    """``baselines`` (``plain_baselines``; none: the benchmarked target's own plain decoding alone) and those of them
    timed beside the methods, each a model of its own."""
    baselines = baselines or {"target": None}
    return baselines, {name: model for name, model in baselines.items() if model is not None}


def preparation(target) -> dict:
    """What ``prepare_target`` chose for the prepared ``target``, for a record (``TargetPreparation``'s fields)."""
    from adaflash_hf.prepared.prepare import is_prepared

    settings = is_prepared(target)
    return {**dataclasses.asdict(settings), "dtype": str(settings.dtype)}


def plain_baselines(loaded, names, target, prepared: dict | None) -> dict:
    """The ``baselines`` of a run: name -> a copy of ``loaded`` in that dtype, or None where the benchmarked
    ``target`` is that plain decoding itself (not prepared, same dtype)."""
    own = None if prepared is not None else next(target.parameters()).dtype
    return {
        name: None if DTYPES[name] == own else copy.deepcopy(loaded).to(DTYPES[name])
        for name in dict.fromkeys(names)
    }
