"""The product speaks of what it does now: no words of how it was built (the sessions, stages and issue numbers of
the work) in any tracked text file, file name or test name. The history lives in experiments/LOG.md only."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"session [0-9]|stage [0-9]|issue [0-9]|working[ ]period", re.IGNORECASE)
# The same words as a file or test name spells them: issue_22, stage3, session-10, working_period, newcomer.
HISTORY_NAME = re.compile(
    r"session[_ -]?[0-9]|stage[_ -]?[0-9]|issue[_ -]?[0-9]|working[_ -]?period|newcomer", re.I
)
HISTORY_FILE = "experiments/LOG.md"


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [path for path in listed.stdout.split("\0") if path and (ROOT / path).is_file()]


def text_of(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_text_file_speaks_of_the_work_history():
    found = []
    for path in tracked_files():
        text = text_of(path) if path != HISTORY_FILE else None
        for number, line in enumerate((text or "").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path}:{number}: {HISTORY.search(line).group(0)!r}")
    assert not found, "\n".join(found)


def test_no_tracked_file_is_named_for_the_work_history():
    assert [path for path in tracked_files() if HISTORY_NAME.search(path)] == []


def test_no_test_is_named_for_the_work_history():
    names = [
        f"{path}::{node.name}"
        for path in tracked_files()
        if path.startswith("tests/") and path.endswith(".py")
        for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and HISTORY_NAME.search(node.name)
    ]
    assert names == []
