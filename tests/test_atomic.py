"""adaflash_hf.atomic: a file or folder is replaced whole or not at all, and a failed write leaves nothing behind."""

import os
import stat

import pytest

from adaflash_hf.atomic import atomic_folder, atomic_write, atomic_write_json


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path, durable):
    path = tmp_path / "a.txt"
    path.write_text("old")
    atomic_write(path, lambda tmp: tmp.write_text("new"), durable=durable)
    assert path.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_json(path, {"version": 1})

    def fail(tmp):
        tmp.write_text("{half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == '{\n "version": 1\n}' and sorted(os.listdir(tmp_path)) == ["a.json"]


def test_atomic_folder_replaces_an_existing_folder_only_when_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")
    with atomic_folder(out) as staging:
        (staging / "new.bin").write_bytes(b"new")
        assert sorted(os.listdir(out)) == ["old.bin"]  # nothing visible before the block ends
    assert sorted(os.listdir(out)) == ["new.bin"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_failed_atomic_folder_leaves_out_untouched_and_no_staging(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.bin").write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"), atomic_folder(out) as staging:
        (staging / "half.bin").write_bytes(b"ha")
        raise OSError("disk full")
    assert sorted(os.listdir(out)) == ["old.bin"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_atomic_folder_gives_its_files_the_umask_mode(tmp_path):
    out = tmp_path / "new" / "out"
    with atomic_folder(out) as staging:
        (staging / "private.bin").write_bytes(b"x")
        (staging / "private.bin").chmod(0o600)  # as safetensors writes its files
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((out / "private.bin").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
