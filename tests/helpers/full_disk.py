"""A directory on a small file system that fills up: a real tmpfs of a few hundred KiB where this
process may mount one (root, with CAP_SYS_ADMIN), and otherwise the same failure made on purpose
(every write into the directory past the first `size_kb` fails with ENOSPC, through Python's file
objects and through safetensors, which writes from Rust). Never a skip: the test runs either way
and can ask which it got."""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import pathlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class FullDisk:
    def __init__(self, path: Path, real: bool) -> None:
        self.path, self.real = path, real


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _patch_writes(root: Path, monkeypatch: pytest.MonkeyPatch, size_kb: int) -> None:
    """Writes under `root` fail once `size_kb` KiB have been written there (a file is counted whole)."""
    room = [size_kb * 1024]

    def under(p) -> bool:
        try:
            return Path(os.fsdecode(p)).resolve().is_relative_to(root)
        except (TypeError, ValueError):
            return False

    def spend(path, n: int) -> None:
        room[0] -= n
        if room[0] < 0:
            raise _enospc(path)

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, int) or not set(mode) & set("wax+") or not under(file):
            return f
        write = f.write

        def limited(data):
            spend(file, len(data.encode() if isinstance(data, str) else data))
            return write(data)
        return _Wrapped(f, limited)

    real_os_write = os.write

    def os_write(fd, data):
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            where = None
        if where is not None and under(where):
            spend(where, len(data))
        return real_os_write(fd, data)

    monkeypatch.setattr(os, "write", os_write)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)

    def write_bytes(self, data):
        if under(self):
            spend(self, len(data))
        return real_write_bytes(self, data)

    def write_text(self, data, encoding=None, errors=None, newline=None):
        if under(self):
            spend(self, len(data.encode()))
        return real_write_text(self, data, encoding, errors, newline)

    real_write_bytes, real_write_text = pathlib.Path.write_bytes, pathlib.Path.write_text
    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)

    import safetensors.torch
    from safetensors import SafetensorError

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if under(filename):
            n = sum(t.numel() * t.element_size() for t in tensors.values())
            if room[0] < n:
                with real_open(filename, "wb") as f:  # what a full disk leaves: part of the file
                    f.write(b"\0" * max(room[0], 0))
                room[0] = -1
                raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                      'message: "No space left on device" })')
            room[0] -= n
        return real_save_file(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    import refusion.model.checkpoint
    import refusion.model.gguf

    for mod in (refusion.model.checkpoint, refusion.model.gguf):
        monkeypatch.setattr(mod, "save_file", save_file)


class _Wrapped:
    def __init__(self, f, write) -> None:
        self._f, self.write = f, write

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)


def _try_mount(path: Path, size_kb: int) -> bool:
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


@contextlib.contextmanager
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size_kb: int = 256,
              real: bool = True) -> Iterator[FullDisk]:
    """A directory with `size_kb` KiB of room (real=False: the monkeypatched failure even where a tmpfs
    could be mounted)."""
    d = (tmp_path / f"small-{size_kb}k").resolve()
    d.mkdir()
    if real and _try_mount(d, size_kb):
        try:
            yield FullDisk(d, True)
        finally:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
        return
    _patch_writes(d, monkeypatch, size_kb)
    yield FullDisk(d, False)
