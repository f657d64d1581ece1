"""No function of the library (adaflash_hf/, trainers/, kernels/, modeling/) is longer than 80 lines, so each reads
in one sitting."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("adaflash_hf", "trainers", "kernels", "modeling")
MAX_LINES = 80


def test_no_library_function_is_longer_than_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for root in LIBRARY
        for path in sorted((ROOT / root).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert not long, long
