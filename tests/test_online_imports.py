"""adaflash_hf/online/ depends on nothing in trainers/: the loop gets its trainer from the caller and uses it only
through ``OnlineLearner``. Checked on the source (no import statement names ``adaflash_hf.trainers``, lazy ones
included) and at run time (importing every online module in a fresh interpreter loads no trainers module)."""

import ast
import subprocess
import sys
from pathlib import Path

ONLINE = Path(__file__).resolve().parents[1] / "adaflash_hf" / "online"
MODULES = sorted(
    "adaflash_hf.online" + ("" if p.stem == "__init__" else f".{p.stem}") for p in ONLINE.glob("*.py")
)


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_online_module_imports_the_trainers():
    offending = {
        path.name: sorted(
            n for n in imported_names(path) if n.startswith(("adaflash_hf.trainers", "trainers"))
        )
        for path in ONLINE.glob("*.py")
    }
    assert len(offending) >= 5 and not any(offending.values()), offending


def test_importing_the_online_modules_loads_no_trainers_module():
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('adaflash_hf.trainers')))\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
