"""A float32 product of a few rows at memory speed, each row's result the same bits alone or beside others:
the project's own kernel (few_rows.cpp), built for this machine on first use.

Why by hand: a decode step multiplies 1 to 16 rows by every weight, so its cost is reading the weights.
MKL's one-row product (gemv) reads them at memory speed, but its products of a few rows repack the
weight on every call; oneDNN's packed product reads them well below memory speed for so few rows
(packed.py). This kernel reads each weight row once for up to eight input rows at a time (two
without AVX-512), in its plain layout (no second copy), and sums every output in one order whatever
the rows or threads. On this project's CPU it makes SmolLM2's forwards of 2 to 16 tokens 7 to 20%
cheaper than the library's (`python benchmarks/forward_cost.py --model smollm2 --modes
eager,eager-packed`); packed.py times it against the library paths once per process and uses it
where it is faster.

Built with the C++ compiler in $CXX (else c++, g++ or clang++) and -march=native into
$REFUSION_CACHE/kernels (default ~/.cache/refusion, the project's cache), keyed by the source, the
compiler and the CPU, so a rebuild happens only when one changes (about a second). No compiler, a failed
build or REFUSION_NO_KERNEL=1: `library()` is None and the products take packed.py's paths, with a
warning that says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from refusion.model.fetch import cache_dir

SOURCE = Path(__file__).with_name("few_rows.cpp")
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DISABLE = "REFUSION_NO_KERNEL"


def compiler() -> str | None:
    found = (shutil.which(name) for name in (os.environ.get("CXX"), "c++", "g++", "clang++") if name)
    return next((path for path in found if path), None)


def _cpu() -> str:
    """What -march=native compiles for: the machine and, on Linux, the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return platform.machine() + "".join(l for l in lines if l.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.machine() + platform.processor()


def build(cxx: str, out_dir: Path) -> Path:
    """The shared library for this source, compiler and CPU, compiled once into out_dir (written to
    a temporary name and renamed, so a concurrent build or a stop never leaves a partial file)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *FLAGS, _cpu()]).encode()).hexdigest()[:16]
    target = out_dir / f"few_rows-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (with a warning saying why) where it cannot be had."""
    if os.environ.get(DISABLE, "") not in ("", "0"):
        return None
    cxx = compiler()
    if cxx is None:
        warnings.warn("no C++ compiler (set CXX, or install g++): float32 decoding on a CPU takes the slower "
                      "library products (refusion/model/few_rows.py)", RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(build(cxx, cache_dir() / "kernels")))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"the few-row kernel could not be built, float32 decoding on a CPU takes the slower library "
                      f"products: {e}", RuntimeWarning, stacklevel=2)
        return None
    fn = lib.few_rows_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = None
    return lib


def available() -> bool:
    return library() is not None


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """F.linear(x, w, b) for float32 CPU tensors, by the kernel (which `available()` must have)."""
    if not (x.dtype == w.dtype == torch.float32 and x.is_cpu and w.is_cpu and (b is None or b.dtype == torch.float32)):
        raise TypeError("few_rows.linear takes float32 CPU tensors")
    w, x = w.contiguous(), x.contiguous()
    K, O = w.shape[1], w.shape[0]
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {K}")
    y = torch.empty(*x.shape[:-1], O)
    b = None if b is None else b.contiguous()
    library().few_rows_linear(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                              x.numel() // K if K else 0, K, O, torch.get_num_threads())
    return y
