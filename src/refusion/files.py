"""Writing files: whole or not at all, and a failure in one line.

Every writer of something a user keeps (checkpoints, exported models, adapters, evaluation records,
self-generated data, lookup corpora, decoding.json) writes through `atomic` (a temporary file beside
the target, renamed over it at the end) or inside `writing` (for a temporary directory its caller
renames), so that a full disk or any other failed write leaves no half-written file under the
target's name, and is reported as a WriteError: an OSError whose message names the file and what
to do, which the command line prints as its one line. Libraries that write files themselves wrap
the operating system's error in their own (safetensors' SafetensorError, torch.save's
RuntimeError); `writing` turns those into a WriteError too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

_HINTS = {errno.ENOSPC: "the disk is full: free some space or write somewhere else",
          errno.EDQUOT: "the disk quota is used up: free some space or write somewhere else",
          errno.EROFS: "the file system is read-only: write somewhere else",
          errno.EACCES: "no permission to write there: write somewhere else",
          errno.EFBIG: "the file is larger than this file system (or a limit) allows"}
# how libraries that wrap the OS's error spell it: Rust's io::Error (safetensors, tokenizers) and
# the C library's messages that torch.save passes on
_WRAPPED = re.compile(r"(?:os error|code:)\s*(\d+)|(No space left on device|Disk quota exceeded|"
                      r"Read-only file system|Permission denied|File too large)")
_BY_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
            "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES, "File too large": errno.EFBIG}


class WriteError(OSError):
    """A write that failed, in one line: the file, the reason and what to do; nothing half-written
    is left under the file's name."""

    def __str__(self) -> str:
        return self.args[0]


def _os_errno(e: BaseException) -> int | None:
    """The operating system's error number behind `e`, when it is an OSError or a library's wrapper
    of one (its message names it), else None."""
    if isinstance(e, OSError):
        return e.errno
    m = _WRAPPED.search(str(e))
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else _BY_TEXT[m.group(2)]


def write_error(path: str | Path, e: BaseException) -> WriteError | None:
    """`e` as a WriteError about `path`, or None when `e` is not a failed write."""
    if isinstance(e, WriteError):
        return e
    code = _os_errno(e)
    if code is None and not isinstance(e, OSError):
        return None
    reason = os.strerror(code) if code else (getattr(e, "strerror", None) or str(e))
    hint = _HINTS.get(code)
    err = WriteError(f"could not write {path}: {reason}" + (f" ({hint})" if hint else ""))
    err.errno = code
    return err


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Failed writes inside the block (OSError, or a library's error wrapping one) leave it as a
    WriteError about `path`; other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        err = write_error(path, e)
        if err is None or err is e:
            raise
        raise err from e


def _remove(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink()


@contextlib.contextmanager
def atomic(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; when the block ends without error it replaces
    `path` (a rename: readers see the old file or the new one, never part of one), otherwise it is
    removed and a failed write is raised as a WriteError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


class Appender:
    """Appends whole pieces of text to a file (records, one per line): a piece that cannot be
    written whole is cut off again, so the file ends after the last whole piece, and the failure
    is a WriteError."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with writing(self.path):
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise write_error(self.path, e) from e

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "Appender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_bytes(path: str | Path, data: bytes) -> None:
    """`data` as the whole of `path`, atomically."""
    with atomic(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    """`text` (UTF-8) as the whole of `path`, atomically."""
    write_bytes(path, text.encode("utf-8"))
