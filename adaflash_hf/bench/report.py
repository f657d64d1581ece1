"""What every ``adaflash bench`` writes and how it ends: its markdown table, its figures, its results file and its
exit status.

A bench measures and says whether its measurement holds (``ok``: outputs lossless, its accounting consistent); it
grades nothing. Goals and acceptance criteria belong to the experiments that state them (``experiments/goals.py``
reads a bench's results file and grades it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from transformers.utils import logging

from adaflash_hf.launch import CONFIG_HELP, int_at_least, parse_args_with_config

logger = logging.get_logger(__name__)


# ----------------------------------------------------------------------------------------------------- tables
def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted, or a dash for a figure that does not exist (None)."""
    return "–" if value is None else f"{value:{spec}}{suffix}"


def percent(share) -> str:
    return fmt(None if share is None else 100 * share, ".0f", "%")


def table(header: Sequence[str], rows: Iterable[Sequence], align: str = "") -> str:
    """A markdown table; ``align`` has one letter per column (``l``: left, ``r``: right, ``c``: centred; missing
    ones are left)."""
    rules = {"l": "---", "r": "---:", "c": ":---:"}
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rules[a] for a in align.ljust(len(header), "l")) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def column_table(columns: dict[str, Callable], rows: Iterable[dict], align: str = "") -> str:
    """``table`` of ``rows`` with ``columns`` (header -> the cell of a row)."""
    return table(list(columns), [[cell(row) for cell in columns.values()] for row in rows], align)


# ----------------------------------------------------------------------------------------------------- figures
def panels(count: int, height: float = 3.6, width: float = 4.5, sharey: bool = False):
    """A figure of ``count`` panels side by side (one per domain, say): the figure and its axes."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width * count, height), layout="constrained")
    return figure, figure.subplots(1, count, squeeze=False, sharey=sharey)[0]


def save(figure, axes, ylabel: str, path: Path) -> None:
    """Label the first panel, gather every panel's labelled lines into one legend beside them, and save."""
    axes[0].set_ylabel(ylabel)
    labelled = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    if labelled:  # a panel set may have nothing labelled at all (no method drafted)
        figure.legend(labelled.values(), labelled.keys(), loc="outside right upper", fontsize="small")
    figure.savefig(path, dpi=120)


def line_plot(
    path: Path,
    lines: dict[str, tuple[Sequence, Sequence]],
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    log2_x: bool = False,
    unit_line: bool = False,
    bands: dict[str, tuple[Sequence, Sequence]] | None = None,
) -> None:
    """One panel of labelled lines (label -> (x, y)), with ``bands`` (label -> (low, high)) shaded under the line of
    the same label; ``unit_line``: a grey line at 1 (a ratio's break-even)."""
    figure, (axes,) = panels(1, height=4, width=6)
    for label, (x, y) in lines.items():
        axes.plot(x, y, marker="o", label=label)
        if bands and label in bands:
            axes.fill_between(x, *bands[label], alpha=0.3, label="95% bootstrap interval")
    if log2_x:
        axes.set_xscale("log", base=2)
    if unit_line:
        axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set(xlabel=xlabel, title=title or "")
    axes.grid(alpha=0.3)
    save(figure, [axes], ylabel, path)


# ----------------------------------------------------------------------------------------------------- outputs
def write_json(path: Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def write_outputs(
    output_dir: Path, results: dict, markdown: str, figures: dict[str, Callable[[Path], None]] | None = None
) -> None:
    """``results.json``, ``table.md`` and each figure (file name -> a function drawing it to a path) in
    ``output_dir``."""
    write_json(output_dir / "results.json", results)
    (output_dir / "table.md").write_text(markdown)
    for name, draw in (figures or {}).items():
        draw(output_dir / name)


def add_record_options(parser) -> None:
    """The options of a bench that prints its table and writes one record: ``--threads`` (1: on 2 shared cores more
    threads measure noise), ``--output`` and ``--config``."""
    parser.add_argument("--threads", type=int_at_least(1), default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--output", type=Path, help="also write the results as JSON to this path")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)


def parse_record_args(parser, argv: list[str] | None):
    """The options of ``add_record_options``' bench (``--config`` read), torch's threads set to ``--threads``."""
    import torch

    args = parse_args_with_config(parser, argv)
    torch.set_num_threads(args.threads)
    return args


def print_record(markdown: str, record: dict, output: Path | None) -> int:
    """The end of such a bench: its table printed and its record written to ``--output`` when given; status 0."""
    print(markdown)
    if output is not None:
        write_json(output, record)
    return 0


def command(name: str, argv: list[str] | None) -> str:
    """The command line a run was started with, for its record."""
    return " ".join([f"adaflash bench {name}", *(sys.argv[1:] if argv is None else argv)])


def finish(name: str, results: dict, output_dir: Path, markdown: str, failure: str = "") -> int:
    """The end of a bench run: the table printed, and exit status 1 where its ``ok`` is false (``failure`` says what
    that means), after every output is written."""
    print(markdown)
    logger.info(f"wrote results.json, table.md and figures to {output_dir}")
    if results.get("ok", True):
        return 0
    print(
        f"adaflash bench {name}: error: ok: expected true, got false ({failure}): see {output_dir / 'results.json'}",
        file=sys.stderr,
    )
    return 1
