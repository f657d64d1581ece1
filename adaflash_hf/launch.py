"""How a command starts: its options (``--config`` YAML files read through each option's own parser action), and for
the training scripts where an installation keeps them and their ``accelerate launch`` command line.

Used by ``adaflash`` (``adaflash_hf.cli``, which nothing imports) and by every module with a command line of its own:
the benchmarks, ``trainers/corpus.py``, ``trainers/calibrate_head.py`` and the trainer scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import importlib.util
import os
import sys
from pathlib import Path

# Raised by our checks of the user's input, files and environment: one line on stderr, exit status 1. Anything else is
# a bug and keeps its traceback; ADAFLASH_DEBUG=1 shows the traceback of these too.
USER_ERRORS = (ValueError, OSError, ImportError, NotImplementedError)

CONFIG_HELP = "YAML file of this command's options (keys: option names); the command line wins"


def config_help(parser: argparse.ArgumentParser) -> str:
    """``CONFIG_HELP`` with an example key: the first option of ``parser`` that takes a value."""
    keys = [a.dest for a in parser._actions if a.option_strings and a.nargs != 0 and a.dest != "config"]
    return CONFIG_HELP.replace("option names", f"option names, e.g. {keys[0]}") if keys else CONFIG_HELP


def int_at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum``. A bad value is a usage error while the arguments are parsed
    (``argument --repeats: expected an int >= 1, got 0``, exit status 2), before anything loads."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
        return value

    parse.__name__ = f"an int >= {minimum}"  # what a --config file's error says is expected
    return parse


def number_in(low: float, high: float | None = None, *, open_low: bool = False):
    """An argparse ``type``: a float >= ``low`` (> with ``open_low``) and <= ``high`` when given; refused as
    ``int_at_least`` refuses."""
    expected = f"a number {'>' if open_low else '>='} {low:g}"
    if high is not None:
        expected = f"a number in {'(' if open_low else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (value > low if open_low else value >= low) or (high is not None and not value <= high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value:g}")
        return value

    parse.__name__ = expected
    return parse


def load_yaml_mapping(path: str, option: str = "--config") -> dict:
    """The mapping a YAML file of options holds. A missing file, a syntax error (its line and column) or a document
    that is not a mapping is a one-line error naming ``option`` and the file."""
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{option}: expected an existing YAML file, got {path!r}") from error
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(
            f"{option} {path}: expected valid YAML, got {getattr(error, 'problem', None) or error}{where}"
        ) from error
    if not isinstance(values, dict):
        raise ValueError(
            f"{option} {path}: expected a mapping of option names to values, got {type(values).__name__}"
        )
    return values


def config_files_in(argv: list[str]) -> list[str]:
    """The files ``--config FILE`` / ``--config=FILE`` name in ``argv`` (a TRL script's arguments)."""
    files = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _expected_value(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(repr, action.choices))
    return getattr(action.type, "__name__", "a string") if action.type is not None else "a string"


def _command_line_strings(action: argparse.Action, value, where: str) -> list[tuple[str, list[str]]]:
    """``value`` of a config file as the command line would give it: (option string, its strings) per occurrence."""
    option = action.option_strings[-1]
    if action.nargs == 0:  # a flag: store_true / store_false / BooleanOptionalAction
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false (the flag {option}), got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [(action.option_strings[0] if value else action.option_strings[-1], [])]
        return [(option, [])] if value == action.const else []
    takes_list = action.nargs in ("+", "*", argparse.REMAINDER) or isinstance(action.nargs, int)
    repeatable = isinstance(action, argparse._AppendAction)  # also extend: each list item is one occurrence
    occurrences = []
    for item in value if repeatable and isinstance(value, list) else [value]:
        if isinstance(item, list) and not takes_list:
            raise ValueError(f"{where}: expected one value (as {option} takes), got the list {item!r}")
        strings = item if isinstance(item, list) else [item]
        if any(v is None or isinstance(v, (bool, list, dict)) for v in strings):
            raise ValueError(
                f"{where}: expected {_expected_value(action)} (as {option} takes), got {value!r}"
            )
        if (action.nargs == "+" and not strings) or (
            isinstance(action.nargs, int) and len(strings) != action.nargs
        ):
            count = "at least 1" if action.nargs == "+" else str(action.nargs)
            raise ValueError(f"{where}: expected {count} values (as {option} takes), got {value!r}")
        occurrences.append((option, [str(v) for v in strings]))
    return occurrences


def read_option_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """The option values of a ``--config`` YAML file, keyed by ``parser``'s option names (dashes or underscores).

    Each value goes through exactly what the same option on the command line goes through: its type, choices, nargs
    and action (a YAML ``16`` for ``--steps`` is the string "16" typed on the command line). Flags take YAML booleans
    (``overwrite: true``); any other value for a flag, the string "false" included, is an error. ``null`` leaves an
    option at its default. Errors name the file and the key.
    """
    values = load_yaml_mapping(path)
    actions = {
        a.dest: a
        for a in parser._actions
        if a.option_strings
        and a.dest != "config"
        and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
    }
    namespace = argparse.Namespace()
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            options = sorted(actions)
            closest = difflib.get_close_matches(dest, options, n=1, cutoff=0.0)
            raise ValueError(
                f"--config {path}: expected option names of this command {options}, got {key!r}"
                + (f" (did you mean {closest[0]!r}?)" if closest else "")
            )
        if value is None:
            continue
        action, where = actions[dest], f"--config {path}: {key}"
        setattr(namespace, dest, copy.copy(action.default))
        for option, strings in _command_line_strings(action, value, where):
            try:
                action(parser, namespace, parser._get_values(action, strings), option)
            except argparse.ArgumentError as error:
                raise ValueError(
                    f"{where}: expected {_expected_value(action)} (as {option} takes), got {value!r}"
                ) from error
    return vars(namespace)


@contextlib.contextmanager
def _not_required(actions: list[argparse.Action]):
    for action in actions:
        action.required = False
    try:
        yield
    finally:
        for action in actions:
            action.required = True


def parse_args_with_config(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    config_parser: argparse.ArgumentParser | None = None,
):
    """``parser.parse_args(argv)`` where a ``--config FILE`` supplies option values (``read_option_file``).

    Explicit arguments still win: the file's values become defaults, and a repeatable option given on the command line
    replaces the file's list. An option the file sets is no longer required on the command line. ``config_parser`` is
    the subcommand's parser that owns ``--config`` (default: ``parser`` itself).
    """
    owner = parser if config_parser is None else config_parser
    for action in owner._actions:  # its --help names one of its own options (the parser is complete by now)
        if action.dest == "config" and action.help == CONFIG_HELP:
            action.help = config_help(owner)
    required = [a for a in owner._actions if a.option_strings and a.required]
    with _not_required(required):
        path = getattr(parser.parse_args(argv), "config", None)
    if not path:
        return parser.parse_args(argv)
    values = read_option_file(path, owner)
    owner.set_defaults(**values)
    with _not_required([a for a in required if a.dest in values]):
        args = parser.parse_args(argv)
    for action in owner._actions:
        from_file = values.get(action.dest)
        given = getattr(args, action.dest, None)
        if isinstance(action, argparse._AppendAction) and isinstance(from_file, list) and given is not None:
            if len(given) > len(from_file):  # append adds to its default: keep only the command line's items
                setattr(args, action.dest, given[len(from_file) :])
    return args


# ------------------------------------------------------------------------------------------------- errors
def user_error(error: Exception) -> Exception | None:
    """The error to show as one line (our checks of the user's input, files and environment), or None for a bug."""
    if isinstance(error, USER_ERRORS):
        return error
    # A config validator's error, wrapped by the strict dataclass.
    from huggingface_hub.errors import StrictDataclassError

    if isinstance(error, StrictDataclassError) and isinstance(error.__cause__, USER_ERRORS):
        return error.__cause__
    return None


def show_tracebacks() -> bool:
    return os.environ.get("ADAFLASH_DEBUG", "") not in ("", "0")


def error_line(command: str, error: Exception) -> str:
    return f"{command}: error: {' '.join(str(error).split()) or type(error).__name__}"


def run_command(command: str, run):
    """``run()`` as a script's entry point: an error in the input (``user_error``) is one line ``command: error: ...``
    on stderr and exit status 1, as in ``adaflash``; a bug, or any error with ADAFLASH_DEBUG=1, keeps its traceback."""
    try:
        return run()
    except Exception as error:
        shown = user_error(error)
        if shown is None or show_tracebacks():
            raise
        print(error_line(command, shown), file=sys.stderr)
        raise SystemExit(1) from None


# ------------------------------------------------------------------------------------- training scripts


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
    ``--quiet``: a script that fails has said why (one line for an input error, ``run_command``); accelerate would add
    a traceback of its own.
    """
    if {"-h", "--help"} & set(script_args):
        return [sys.executable, str(script), *script_args]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--quiet"]
    if launcher_args.accelerate_config:
        command += ["--config_file", launcher_args.accelerate_config]
    if launcher_args.num_processes is not None:
        command += ["--num_processes", str(launcher_args.num_processes)]
    if not launcher_args.accelerate_config:  # a config file carries its own thread count
        command += cpu_thread_args(launcher_args.num_processes or 1)
    return [*command, str(script), *script_args]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container can restrict below ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def cpu_thread_args(num_processes: int = 1, environ=os.environ) -> list[str]:
    """``--num_cpu_threads_per_process N`` for ``accelerate launch`` on a machine without CUDA: every usable core,
    shared by the processes. Without it ``accelerate launch`` (no ``--cpu``) sets OMP_NUM_THREADS=1 and a CPU-only
    run trains on one core (measured here: 2.6 s a drafter step on one of 2 cores, 1.45 s on both). Nothing when
    OMP_NUM_THREADS is set (the user chose) or CUDA is present (GPU runs want one thread per process)."""
    if environ.get("OMP_NUM_THREADS"):
        return []
    import torch

    if torch.cuda.is_available():
        return []
    threads = max(1, usable_cores() // max(1, num_processes))
    return ["--num_cpu_threads_per_process", str(threads)] if threads > 1 else []


# Set by ``adaflash train`` / ``adaflash opd`` for the script they launch: its hints then name what that user can change.
LAUNCHER_ENV = "ADAFLASH_LAUNCHED_BY"


def warn_if_cpu_threads_idle(
    logger, device, num_processes: int = 1, command: str = "adaflash train", environ=os.environ
) -> bool:
    """Log a warning (and return True) when a run on the CPU leaves cores idle: fewer threads per process than its
    share of the usable cores. The fix it names depends on how the script was started: by ``adaflash train|opd``
    (``LAUNCHER_ENV``: OMP_NUM_THREADS was set, or an accelerate config or a GPU machine kept the launcher from passing
    the cores), by a plain ``accelerate launch`` without ``--cpu`` (which sets OMP_NUM_THREADS=1), or by Python.
    ``command`` is the script's ``adaflash`` command."""
    import torch

    if getattr(device, "type", str(device)) != "cpu":
        return False
    threads, share = torch.get_num_threads(), usable_cores() // max(1, num_processes)
    if threads >= share:
        return False
    launcher = environ.get(LAUNCHER_ENV)
    if launcher:
        fix = (
            f"start it as `OMP_NUM_THREADS={share} {launcher} ...` (`{launcher}` passes every usable core only "
            "when OMP_NUM_THREADS is unset, no --accelerate-config is given and there is no CUDA device)"
        )
    elif "ACCELERATE_MIXED_PRECISION" in environ:  # set by every `accelerate launch`
        fix = (
            f"`accelerate launch` without --cpu sets it to 1: pass `accelerate launch --num_cpu_threads_per_process "
            f"{share}`, or start it with `{command}`, which does"
        )
    else:
        fix = f"set OMP_NUM_THREADS={share}, or start it with `{command}`"
    logger.warning(
        f"torch uses {threads} thread(s) per process, of {share} usable cores per process (OMP_NUM_THREADS="
        f"{environ.get('OMP_NUM_THREADS', 'unset')}): {fix} (a drafter step here: 2.6 s on one of 2 cores, 1.45 s "
        "on both)"
    )
    return True
