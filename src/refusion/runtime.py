"""Where computation runs: the device a user names (checked to exist), the number of CPU threads,
giving freed memory back to the system, copies to the device that do not wait for it, and counting
where the host waits for the device (count_host_syncs)."""

from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

# Below this many parameters a model's matrices are too small for several CPU threads to pay off,
# and with more than one, every operation waits for the slowest thread: when another process holds
# a core, decoding the bundled model fell from 120 to 1.4 tokens/s. One thread is immune to that.
SMALL_MODEL_PARAMS = 50_000_000


def resolve_device(name: str | torch.device) -> torch.device:
    """A torch device from 'cpu', 'cuda', 'cuda:N', 'mps' or 'auto' (cuda when available), refused
    with one line when it does not exist on this machine."""
    import torch

    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {name!r} is not a device; use cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device {name!r}: CUDA is not available ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; use cpu, cuda, cuda:N, mps or auto")
    return dev


def set_threads(threads: int | None, n_params: int | None = None) -> int:
    """Set torch's CPU threads: `threads` when given, else 1 for a model under SMALL_MODEL_PARAMS,
    else torch's default. Returns the number in use."""
    import torch

    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    elif n_params is not None and n_params < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def malloc_trim():
    """glibc's malloc_trim, or None on another C library. glibc keeps what Python and torch free in its
    heaps and arenas, so a process that allocated much (a burst of requests, forwards of many
    lengths) stays at its peak resident size until this is called: malloc_trim(0) releases it."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


# Tensor methods that make the host wait for an accelerator's queued work: reading values
# (item, tolist, bool(), int(), float(), an index), copying to the host (cpu), and nonzero, whose
# output size depends on the values
SYNCING_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str) -> Iterator[collections.Counter]:
    """Count where the host waits for `device` while the block runs: a Counter, filled when the block
    ends, of "sync" and, on a CPU, of each method and `.to(device)` copy by its caller's file:line.

    On CUDA these are the real synchronisations (torch.cuda.set_sync_debug_mode's warnings). On a
    CPU nothing waits, so the calls that would wait on an accelerator are counted instead: the
    SYNCING_METHODS on any tensor, and every `.to(...)` naming a device without non_blocking=True
    (a copy from pageable host memory waits for the device's stream). Host-side tensors count too
    (there is no telling them apart on a CPU): an upper bound, for tests that bound a decoder's
    syncs per forward."""
    import torch

    counts: collections.Counter = collections.Counter()
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        counts["sync"] += sum("synchronizing" in str(w.message) for w in caught)
        return
    saved = {name: getattr(torch.Tensor, name) for name in (*SYNCING_METHODS, "to")}

    def where() -> str:
        frame = sys._getframe(2)
        return f"{frame.f_code.co_filename.rsplit('/src/', 1)[-1]}:{frame.f_lineno}"

    def counted(name: str):
        method = saved[name]

        def call(self, *args, **kwargs):
            counts["sync"] += 1
            counts[f"{name} {where()}"] += 1
            return method(self, *args, **kwargs)
        return call

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and not kwargs.get("non_blocking", False):
            counts["sync"] += 1
            counts[f"to {where()}"] += 1
        return saved["to"](self, *args, **kwargs)

    try:
        for name in SYNCING_METHODS:
            setattr(torch.Tensor, name, counted(name))
        torch.Tensor.to = to
        yield counts
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def to_device(array: np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array or tensor on `device` (as `dtype`): on CUDA staged in pinned memory and copied
    without making the host wait for the device (a copy from pageable memory waits for its stream:
    every queued kernel); on a CPU the same tensor, no copy."""
    import torch

    t = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    else:
        t = t.to(device)
    return t if dtype is None else t.to(dtype)
