"""refusion.files: a write is whole or absent, and a failed one is one line naming the file; on a small
tmpfs that fills up (tests/helpers/full_disk.py; the same failure monkeypatched where no tmpfs can
be mounted) and with writes that fail on purpose."""

from __future__ import annotations

import errno
import json

import pytest
from safetensors import SafetensorError

from refusion.files import WriteError, atomic, write_bytes, write_error, write_text
from tests.helpers.full_disk import full_disk

FULL = "No space left on device (the disk is full: free some space or write somewhere else)"


def leftovers(d) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "patched"])
def test_a_write_that_fills_the_disk_leaves_the_old_file_and_one_line(tmp_path, monkeypatch, real):
    with full_disk(tmp_path, monkeypatch, size_kb=64, real=real) as disk:
        target = disk.path / "records.json"
        write_text(target, json.dumps({"kept": 1}))
        assert json.loads(target.read_text()) == {"kept": 1}
        with pytest.raises(WriteError) as e:
            write_bytes(target, b"x" * 200_000)
        assert str(e.value) == f"could not write {target}: {FULL}" and e.value.errno == errno.ENOSPC
        assert "\n" not in str(e.value)
        assert json.loads(target.read_text()) == {"kept": 1}  # the old file, whole
        assert leftovers(disk.path) == ["records.json"]  # no temporary file left


def test_an_error_inside_atomic_removes_the_temporary_and_passes_unchanged(tmp_path):
    target = tmp_path / "f.txt"
    with pytest.raises(KeyError):
        with atomic(target) as tmp:
            tmp.write_text("half")
            raise KeyError("not a write error")
    assert leftovers(tmp_path) == []
    with atomic(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole" and leftovers(tmp_path) == ["f.txt"]


def test_write_errors_wrapped_by_libraries_are_recognised(tmp_path):
    p = tmp_path / "model.safetensors"
    e = write_error(p, SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                       'message: "No space left on device" })'))
    assert str(e) == f"could not write {p}: {FULL}" and e.errno == errno.ENOSPC
    e = write_error(p, Exception("No space left on device (os error 28)"))  # tokenizers' Rust io::Error
    assert e.errno == errno.ENOSPC
    e = write_error(p, OSError(errno.EROFS, "Read-only file system"))
    assert str(e) == f"could not write {p}: Read-only file system (the file system is read-only: write somewhere else)"
    e = write_error(p, OSError(errno.EIO, "Input/output error"))
    assert str(e) == f"could not write {p}: Input/output error"
    assert write_error(p, ValueError("a bad value")) is None  # not a write: passes through `writing` as it is
    assert write_error(p, RuntimeError("shape mismatch")) is None
