"""A training run's output directory on disk: its lock, its checkpoints (the newest complete one,
pruning, which strategy wrote one), metrics.jsonl and TensorBoard logs.

    OUT/.lock           held by the training that uses OUT (names its process)
    OUT/train_config.json  the configuration the checkpoints were trained with
    OUT/checkpoint-N/   complete checkpoints (written elsewhere and renamed into place)
    OUT/metrics.jsonl   one JSON line per step
    OUT/tensorboard/    when TensorBoard is installed
    OUT/model/          the final model
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from refusion.files import write_text
from refusion.model.checkpoint import SHARDED_DIR, STATE_FILE

LOCK_FILE = ".lock"


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on run directory `out` (created if need be) while the block runs: a
    second training into `out` fails at once, naming the process that holds it.

    The lock is the operating system's (flock on OUT/.lock), which it releases when the process ends
    however it ends (an exception, a crash, SIGKILL): a lock never outlives its run, and the file it
    leaves behind blocks nothing (a directory of an older run, which has none, gets one).
    Where the file system or the platform has no such locks, the run goes on unlocked, with a warning.
    """
    out.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    with open(out / LOCK_FILE, "a+") as f:  # a+: created when missing, never truncated before it is ours
        try:
            if fcntl is None:
                raise OSError("this platform has no flock")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "a process that has not written its name yet"
            raise ValueError(f"{out} is in use by another training ({holder}): wait for it to end, or choose "
                             "another --out") from None
        except OSError as e:  # a file system without locks (some network mounts)
            print(f"refusion train: warning: cannot lock {out} ({e.strerror or e}): make sure no other training "
                  "uses it", file=sys.stderr)
        else:
            f.seek(0)
            f.truncate()
            since = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
            f.flush()
        yield


def checkpoints(out: Path) -> list[Path]:
    """checkpoint-N directories, oldest first (temporary .checkpoint-N.tmp ones do not match)."""
    return sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    found = [p for p in checkpoints(out) if (p / STATE_FILE).exists()]
    return found[-1] if found else None


def prune_checkpoints(out: Path, keep: int) -> None:
    for p in checkpoints(out)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def written_by(ckpt: Path) -> str:
    """The strategy whose checkpoint this is: fsdp (sharded) or ddp (a Hugging Face directory)."""
    return "fsdp" if (ckpt / SHARDED_DIR).is_dir() else "ddp"


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines past `step`: a killed run may have logged steps after its last checkpoint (and
    the line it was writing, torn)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if (rec := _record(ln)) is not None and rec["step"] <= step]
    write_text(path, "".join(ln + "\n" for ln in lines))


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None


def tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # TensorBoard is optional; metrics.jsonl always has everything
        return None
    return SummaryWriter(str(out / "tensorboard"))
