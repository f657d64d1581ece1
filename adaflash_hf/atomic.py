"""Atomic files and folders: a reader sees the old version or the whole new one, never half of either.

``atomic_write(path, write)`` has ``write`` fill a temporary sibling of ``path``, fsyncs it and renames it over
``path``; ``atomic_write_json`` does that for a JSON document, and ``read_json`` reads one back (a damaged file is an
error naming it). ``atomic_folder(out)`` is the same for a folder: the ``with`` block writes into a fresh staging
sibling, and only once it ends without error are the files fsynced and the folder renamed into place (an existing
``out`` is renamed aside first and deleted after). A failure anywhere leaves ``out`` as it was and no staging folder
behind. ``blocking_file(out)`` finds a file where a folder is to be made, before anything is written.

Used by the online weights and checkpoints (``online/weights.py``), the export and import of drafters
(``interop.py``), the online loop's metrics file and the corpus's feature files.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None], durable: bool = True) -> None:
    """``write(tmp_path)`` then fsync and rename over ``path``: readers see the old file or the whole new one.

    ``durable=False`` skips the fsyncs: the rename still never exposes half a file to a reader or to a later run after
    the writer is killed, but a power loss may lose the newest version."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: str | Path, data: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def read_json(path: str | Path):
    """The JSON document in ``path``; a damaged one is a ValueError that names the file (``json`` names only the
    line and column)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: expected valid JSON, got {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None


def check_folder_path(path: str | Path, option: str) -> None:
    """Raise ``FileExistsError`` naming ``option`` when a file stands where the folder ``path`` is to be made."""
    blocker = blocking_file(path)
    if blocker is not None:
        where = "the file" if blocker == Path(path) else f"{path}, inside the file"
        raise FileExistsError(f"{option}: expected a folder to write, got {where} {blocker}")


def blocking_file(path: str | Path) -> Path | None:
    """The file at ``path`` or at one of its parents that keeps a folder from being made at ``path``, or None: a
    check before anything loads, so the error names the option and the file, not a bare "File exists"."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


@contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """Yield a fresh, empty staging folder beside ``out``; when the block completes, it becomes ``out``.

    The staging folder is made with the umask's mode (not ``tempfile.mkdtemp``'s 0700) and its files get that mode
    too (safetensors writes 0600), so the result is readable by another service user, e.g. an SGLang or vLLM server.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_sibling(out, "staging")
    staging.mkdir()
    try:
        yield staging
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fresh_sibling(path: Path, role: str) -> Path:
    while True:
        sibling = path.parent / f".{role}-{path.name}-{secrets.token_hex(4)}"
        if not sibling.exists():
            return sibling


def _move_into_place(staging: Path, out: Path) -> None:
    file_mode = stat.S_IMODE(staging.stat().st_mode) & 0o666
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            path.chmod(file_mode)
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    fsync_dir(staging)
    if out.exists() or out.is_symlink():
        trash = _fresh_sibling(out, "trash")
        os.replace(out, trash)
        os.replace(staging, out)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)
    else:
        os.replace(staging, out)
    fsync_dir(out.parent)
