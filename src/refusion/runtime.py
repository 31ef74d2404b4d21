"""Where computation runs: the device a user names (checked to exist), the number of CPU threads, and
giving freed memory back to the system."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
