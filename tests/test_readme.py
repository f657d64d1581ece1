"""README.md's Python code blocks run as written, so the README cannot drift from the code (integration).

Convention: every ```python block of README.md runs, in file order, in one shared namespace (a later block may use
the names an earlier one defined), from the repository root, offline. A block that cannot run offline (it needs the
Hub or a GPU) is marked by the line ``<!-- readme-test: skip (REASON) -->`` right before its fence; the reason is
required. Blocks are read from the file itself.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"(?:<!-- readme-test: skip \((?P<reason>[^)]+)\) -->\n)?```python\n(?P<code>.*?)```", re.S
)

pytestmark = pytest.mark.integration


def readme_blocks() -> list[tuple[str, str | None]]:
    """(code, skip reason or None) for each ```python block of README.md, in order."""
    text = (REPO / "README.md").read_text()
    return [(m["code"], m["reason"]) for m in BLOCK.finditer(text)]


def test_readme_marks_only_blocks_that_cannot_run_offline():
    blocks = readme_blocks()
    skipped = [code for code, reason in blocks if reason]
    assert len(blocks) >= 3 and len(skipped) < len(blocks)
    # An unmarked block must not reach for the Hub: a repo id given to from_pretrained means it has to be marked.
    for code, reason in blocks:
        if reason is None:
            assert not re.search(r'from_pretrained\("[\w.-]+/[\w.-]+"', code), code


def test_readme_offline_blocks_run_as_written(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    namespace: dict = {"__name__": "readme"}
    ran = 0
    for code, reason in readme_blocks():
        if reason is None:
            exec(compile(code, "README.md", "exec"), namespace)
            ran += 1
    assert ran >= 2
    out = capsys.readouterr().out
    assert "tau=" in out  # the quick start printed drafter.last_stats.summary()
    assert namespace["drafter"].last_stats is not None
