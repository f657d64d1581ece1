"""README.md's "Where things are" map names only files and symbols that exist, and its layout table names every module
of the package, so neither can drift from the code.

Every row of the map answers one question with at least one ``path::symbol`` reference (``symbol`` may be dotted:
``Class.method``); each reference is resolved on the file's syntax tree, nothing is imported."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"`([\w./-]+\.py)::([\w.]+)`")


def map_rows() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return rows[2:]  # after the header and its separator


def defines(path: Path, dotted: str) -> bool:
    scope = ast.parse(path.read_text()).body
    for name in dotted.split("."):
        found = [
            node
            for node in scope
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name
        ]
        if not found:
            return False
        scope = found[0].body
    return True


def test_every_row_of_the_map_names_a_file_and_symbol():
    rows = map_rows()
    assert len(rows) >= 4
    assert [row for row in rows if not REFERENCE.search(row)] == []


def test_the_map_answers_where_acceptance_loss_rollback_and_k_hat_are():
    questions = " ".join(row.split("|")[1] for row in map_rows())
    for topic in ("acceptance computed", "loss", "cache rolled back", "k̂"):
        assert topic in questions, topic


def test_every_file_and_symbol_the_map_names_exists():
    references = [ref for row in map_rows() for ref in REFERENCE.findall(row)]
    missing = [f"{path}::{symbol}" for path, symbol in references if not (REPO / path).is_file()]
    assert missing == []
    undefined = [f"{path}::{symbol}" for path, symbol in references if not defines(REPO / path, symbol)]
    assert undefined == []


def layout_rows() -> list[tuple[str, set[str]]]:
    """(folder, the ``*.py`` names its row mentions) per row of the README's layout table (``| where | what |``)."""
    text = (REPO / "README.md").read_text()
    table = text.split("\n| where | what |\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[1:]:  # after the separator
        where, what = line.split("|")[1:3]
        folder = re.match(r"\s*`([\w/]+/)`", where).group(1)
        rows.append((folder, set(re.findall(r"`([\w]+\.py)`", what))))
    return rows


def test_the_layout_table_names_every_module_of_the_package():
    named: dict[str, set[str]] = {}
    for folder, files in layout_rows():
        named.setdefault(folder, set()).update(files)
    folders = (
        "adaflash_hf/",
        "adaflash_hf/bench/",
        "adaflash_hf/online/",
        "adaflash_hf/prepared/",
        "adaflash_hf/serving/",
        "adaflash_hf/vllm/",
    )
    expected = {
        folder: {p.name for p in (REPO / folder).glob("*.py") if p.name != "__init__.py"}
        for folder in (*folders, "modeling/", "kernels/", "trainers/")
    }
    assert named == expected
