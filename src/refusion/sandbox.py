"""Run untrusted, model-written Python: one process per program, limits, no network, cleanup.

Layers, outermost first:
  - Linux namespaces (util-linux `unshare`, where the kernel allows it, checked once): a new network
    namespace (no interfaces but a down loopback: no network) and a new PID namespace whose init is
    the program; when it ends or is killed, the kernel kills every process left inside, so nothing a
    program forks survives it.
  - resource limits set in the child before exec: address space (memory_mb), CPU seconds, file
    size, open files, no core dumps; a new session, so signals to the parent's group miss it and
    the whole group can be killed at once.
  - a wall-clock timeout in the parent, then SIGKILL to the process group; a sweep of /proc for
    any process still running in the scratch directory.
  - a Python guard installed before the program runs: fork/exec/kill/setsid and friends removed,
    files opened for writing only inside the scratch directory, sockets refused. This is defence
    in depth against accidents, not a security boundary: Python code can get around it.
Each program runs with a fresh scratch directory as cwd, HOME and TMPDIR, removed afterwards.
Where namespaces are unavailable, the other layers still apply (see `isolation()`).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Runs in the child before the program: the guard, then the program as __main__.
_BOOTSTRAP = r"""
import builtins, io, os, shutil, socket, subprocess, sys
scratch = os.path.realpath(sys.argv[1])
src = open(os.path.join(scratch, "program.py")).read()

def _refuse(*a, **k):
    raise PermissionError("not allowed in the sandbox")

_open = builtins.open
def _guarded_open(file, mode="r", *a, **k):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
        path = os.path.realpath(os.fsdecode(file))
        if path != scratch and not path.startswith(scratch + os.sep):
            raise PermissionError(f"writing outside the sandbox: {path}")
    return _open(file, mode, *a, **k)
builtins.open = io.open = _guarded_open

for name in ("kill", "killpg", "fork", "forkpty", "setsid", "setpgid", "setpgrp", "system", "popen", "execv",
             "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
             "spawnvpe", "spawnl", "spawnle", "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir",
             "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown", "lchown", "link",
             "symlink", "putenv", "unsetenv", "setuid", "setgid", "nice"):
    if hasattr(os, name):
        setattr(os, name, _refuse)
shutil.rmtree = shutil.move = shutil.chown = _refuse
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _refuse
socket.socket = socket.create_connection = socket.socketpair = _refuse
sys.modules["multiprocessing"] = None  # import fails cleanly
exec(compile(src, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass
class ExecResult:
    status: str  # passed | failed | timeout | memory
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


_UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--net"]


@lru_cache(maxsize=1)
def _namespaces_work() -> bool:
    try:
        return subprocess.run(_UNSHARE + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def isolation() -> str:
    """Which isolation is active on this machine (for logs and reports)."""
    ns = "pid+network namespaces" if _namespaces_work() else "no namespaces (unshare unavailable)"
    return f"{ns}, rlimits, process-group kill, Python guard"


def _limits(timeout_s: float, memory_mb: int):
    def apply() -> None:
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _sweep(scratch: Path) -> None:
    """Kill any process still running with its cwd in the scratch directory (belt and braces)."""
    root = str(scratch)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(root):
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def _read(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_python(program: str, timeout_s: float = 10.0, memory_mb: int = 1024, max_output: int = 10_000) -> ExecResult:
    """Run `program` in a fresh sandboxed interpreter; exit status 0 is a pass."""
    scratch = Path(tempfile.mkdtemp(prefix="refusion-sandbox-")).resolve()
    try:
        (scratch / "program.py").write_text(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, str(scratch)]
        if _namespaces_work():
            cmd = _UNSHARE + cmd
        t0 = time.perf_counter()
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, preexec_fn=_limits(timeout_s, memory_mb))
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                _sweep(scratch)
        seconds = time.perf_counter() - t0
        stdout, stderr = _read(scratch / ".stdout", max_output), _read(scratch / ".stderr", max_output)
        rc = None if timed_out else proc.returncode
        if timed_out or rc == -signal.SIGXCPU:
            status = "timeout"
        elif rc == 0:
            status = "passed"
        elif "MemoryError" in stderr or rc == -signal.SIGKILL:
            status = "memory"
        else:
            status = "failed"
        return ExecResult(status, rc, stdout, stderr, seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_many(programs: list[str], timeout_s: float = 10.0, memory_mb: int = 1024, workers: int | None = None
             ) -> list[ExecResult]:
    """run_python over many programs in parallel; results in input order."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda p: run_python(p, timeout_s, memory_mb), programs))
