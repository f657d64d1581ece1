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


# The decoding hot path: what runs every round of generate and every engine step.
HOT_PATH = ("adaflash_hf/generation.py", "adaflash_hf/policy.py", "adaflash_hf/serving/engine.py")
HOT_MAX_LINES = 60


def test_no_function_on_the_decoding_hot_path_is_longer_than_60_lines():
    long = [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in HOT_PATH
        for node in ast.walk(ast.parse((ROOT / path).read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name != "__init__"
        and node.end_lineno - node.lineno + 1 > HOT_MAX_LINES
    ]
    assert not long, long
