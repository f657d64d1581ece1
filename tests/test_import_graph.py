"""The package's import graph has no cycle and no upward edge, and nothing imports the command line.

The graph is read from the source (every ``import`` statement, the lazy ones inside functions included), with
setup.cfg's ``package_dir`` mapping resolved: ``modeling/`` is ``adaflash_hf.modeling``, ``kernels/`` is
``adaflash_hf.kernels``, ``trainers/`` is ``adaflash_hf.trainers``. An edge goes from a module to the module its
statement names: ``from P import N`` to ``P.N`` when that is a module, else to ``P``. The parents Python imports on
the way (a package's ``__init__``) are not edges: ``adaflash_hf/__init__.py`` installs the generate hook for every
importer, which would put the whole package on one cycle.

The layers, from the bottom; a module may import its own layer and the layers below it, never a layer above:

0. model and kernels: ``adaflash_hf.modeling.*`` (Hub remote code: it imports only its siblings, with a single dot)
   and ``adaflash_hf.kernels.*``;
1. foundations: plain helpers every layer above shares: ``stats``, ``draft_vocab``, ``lookup``, ``drafting``, ``cost_model``, ``acceptance``, ``policy`` (each round's drafting decisions),
   ``atomic``, ``assets``, ``data``, ``launch`` (how a command starts: options, ``--config`` files, the training
   scripts' launch line), ``registration`` and ``prepared.*`` (the prepared target: the CPU's bf16 units, the
   batch-invariant forward and its tiled linear and attention);
2. decoding and checkpoints: the public package ``adaflash_hf`` (its ``__init__``), ``generation`` (the candidate generator), ``generate_hook`` (the generate hook),
   ``serving.*`` (the engine), ``interop`` and ``hub``;
3. online learning: ``online.*`` (buffer, hot reload, the serve/train loop; it gets its trainer from the caller);
4. training: ``trainers.*``, every module used only by training (the trainers, the recipe, the corpus, the learning
   curve, the head calibration);
5. other engines: ``vllm.*`` (the vLLM plugin, and ``adaflash serve --engine vllm``, which trains beside it);
6. benchmarks: ``bench.*``;
7. the console script: ``cli``, which only dispatches; nothing imports it.

The tests have a graph too: no test file imports another one. What several test files share (builders, fixtures)
lives in ``tests/conftest.py``, which they import as ``tests.conftest``.
"""

import ast
import configparser
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> layer; "P.*" is the package P and everything in it, any other name that one module only
LAYERS = [
    ("model and kernels", ("adaflash_hf.modeling.*", "adaflash_hf.kernels.*")),
    (
        "foundations",
        (
            "adaflash_hf.stats",
            "adaflash_hf.draft_vocab",
            "adaflash_hf.lookup",
            "adaflash_hf.drafting",
            "adaflash_hf.cost_model",
            "adaflash_hf.acceptance",
            "adaflash_hf.policy",
            "adaflash_hf.atomic",
            "adaflash_hf.assets",
            "adaflash_hf.data",
            "adaflash_hf.launch",
            "adaflash_hf.registration",
            "adaflash_hf.version",
            "adaflash_hf.prepared.*",
        ),
    ),
    (
        "decoding and checkpoints",
        (
            "adaflash_hf",
            "adaflash_hf.generation",
            "adaflash_hf.generate_hook",
            "adaflash_hf.serving.*",
            "adaflash_hf.interop",
            "adaflash_hf.hub",
        ),
    ),
    ("online learning", ("adaflash_hf.online.*",)),
    ("training", ("adaflash_hf.trainers.*",)),
    ("other engines", ("adaflash_hf.vllm.*",)),
    ("benchmarks", ("adaflash_hf.bench.*",)),
    ("console script", ("adaflash_hf.cli",)),
]


def package_folders() -> dict[str, Path]:
    """Package name -> its folder, from setup.cfg's ``packages`` and ``package_dir``."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    mapping = {}
    for line in config["options"]["package_dir"].strip().splitlines():
        name, folder = (part.strip() for part in line.split("="))
        mapping[name] = folder
    packages = config["options"]["packages"].split()
    folders = {}
    for package in packages:
        mapped = next((p for p in sorted(mapping, key=len, reverse=True) if package.startswith(p)), None)
        if mapped is None:
            folders[package] = REPO.joinpath(*package.split("."))
        else:
            folders[package] = REPO / mapping[mapped] / Path(*package[len(mapped) :].split(".")[1:])
    return folders


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def statements(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module named, names imported from it, relative level)`` of every import statement in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", [alias.name for alias in node.names], node.level))
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        edges = set()
        for module, names, level in statements(path):
            if level:
                base = package.split(".")[: len(package.split(".")) - (level - 1)]
                module = ".".join([*base, module] if module else base)
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in known] or [module]:
                if target in known and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            package = name.removesuffix(".*")
            if module == package or (name.endswith(".*") and module.startswith(package + ".")):
                return index
    raise AssertionError(
        f"{module}: in no layer of tests/test_import_graph.py; give it one (and its docstring)"
    )


def test_the_graph_covers_the_package_with_the_mapping_resolved():
    graph = import_graph()
    assert {"adaflash_hf.modeling.modeling_adaflash", "adaflash_hf.kernels.clipped_kl"} <= set(graph)
    assert {"adaflash_hf.trainers.corpus", "adaflash_hf.cli", "adaflash_hf.online.loop"} <= set(graph)
    assert "adaflash_hf.modeling.configuration_adaflash" in graph["adaflash_hf.modeling.modeling_adaflash"]
    assert "adaflash_hf.trainers.dflash_recipe" in graph["adaflash_hf.trainers.train_drafter_trainer"]
    assert sum(len(edges) for edges in graph.values()) > 60


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for module, edges in sorted(import_graph().items())
        for target in sorted(edges)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycles, state, stack = [], {}, []

    def visit(module):  # depth-first; a back edge to a module on the stack closes a cycle
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []


def test_modeling_imports_only_its_siblings_with_a_single_dot():
    # Hub remote code: save_pretrained copies these files beside the weights, where adaflash_hf may not exist.
    offending = [
        f"{path.name}: {'.' * level}{module}"
        for name, path in modules().items()
        if name.startswith("adaflash_hf.modeling.")
        for module, _, level in statements(path)
        if level > 1 or module.startswith("adaflash_hf") or (level == 1 and not module)
    ]
    assert offending == []


def test_nothing_but_the_console_script_imports_cli():
    importers = sorted(module for module, edges in import_graph().items() if "adaflash_hf.cli" in edges)
    assert importers == []


# modules that run inside vLLM's processes and import vLLM (which lives in an environment of its own)
NEEDS_VLLM = {"adaflash_hf.vllm.model", "adaflash_hf.vllm.proposer"}


def test_importing_every_other_module_loads_no_cli():
    import importlib.util

    skip = {"adaflash_hf.cli"} | (NEEDS_VLLM if importlib.util.find_spec("vllm") is None else set())
    names = sorted(name for name in modules() if name not in skip)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print('adaflash_hf.cli' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def names_a_test_module(name: str) -> bool:
    """``tests.test_x``, ``test_x`` or ``.test_x`` (any number of dots), and anything inside one."""
    return name.lstrip(".").removeprefix("tests.").split(".")[0].startswith("test_")


def imported_test_modules(path: Path) -> list[str]:
    """Every ``test_*`` module an import statement in ``path`` names, as written: ``import tests.test_x``,
    ``from tests.test_x import f``, ``from .test_x import f``, and ``from tests import test_x`` /
    ``from . import test_x``."""
    named = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            named.extend(alias.name for alias in node.names if names_a_test_module(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if names_a_test_module(base):
                named.append(base)
                continue
            joiner = "" if base.endswith(".") else "."
            modules = [f"{base}{joiner}{alias.name}" for alias in node.names]
            named.extend(name for name in modules if names_a_test_module(name))
    return named


def test_no_test_file_imports_another_test_file():
    offending = [
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for name in imported_test_modules(path)
    ]
    assert offending == []
