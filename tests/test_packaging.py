"""The wheel installs one top-level package, ``adaflash_hf``, with modeling/kernels/trainers mapped inside it
(a top-level ``kernels`` would shadow Hugging Face's own package of that name)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    "outputs",
    "runs",
    ".pytest_cache",
    ".ruff_cache",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the sources, so the build leaves nothing in the shared checkout (~3 s)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            ".",
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp / "dist").glob("adaflash_hf-*.whl")
    return path


def wheel_names(wheel):
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_has_only_the_adaflash_hf_top_level_package(wheel):
    names = wheel_names(wheel)
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(top_level).decode().split() == ["adaflash_hf"]
    assert {name.split("/")[0] for name in names} == {"adaflash_hf", top_level.split("/")[0]}


@pytest.mark.parametrize(
    "module",
    [
        "adaflash_hf/__init__.py",
        "adaflash_hf/modeling/__init__.py",
        "adaflash_hf/modeling/configuration_adaflash.py",
        "adaflash_hf/modeling/modeling_adaflash.py",
        "adaflash_hf/modeling/sidecar_adaflash.py",
        "adaflash_hf/trainers/corpus.py",
        "adaflash_hf/kernels/__init__.py",
    ],
)
def test_wheel_contains_the_mapped_subpackages(wheel, module):
    assert module in wheel_names(wheel)


@pytest.mark.skipif(not list((ROOT / "trainers").glob("*.py")), reason="trainers/ holds no modules yet")
def test_wheel_contains_the_trainers_subpackage(wheel):
    assert "adaflash_hf/trainers/__init__.py" in wheel_names(wheel)


def test_installed_wheel_imports_from_the_wheel_not_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    script = (
        "import adaflash_hf, adaflash_hf.modeling, adaflash_hf.kernels; "
        "print(adaflash_hf.__file__); print(adaflash_hf.modeling.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for path in result.stdout.split():
        assert Path(path).is_relative_to(site), path
