"""Run untrusted, model-written Python (HumanEval, MBPP, synthetic tasks): one process per program.

Every program gets a fresh `python -I` in its own session, a fresh scratch directory as cwd, HOME
and TMPDIR (removed afterwards), a minimal environment, stdin from /dev/null, and stdout/stderr
written to files and read back with a size cap. The harness survives whatever the program does.

Layers, outermost first:

1. Linux namespaces, where `unshare --user` works unprivileged (probed once, see `isolation()`):
   - network namespace: only a down loopback, so no network at all, whatever the program calls;
   - pid namespace: the program cannot see or signal any process outside it (os.getppid() is 0 or
     1), and when its init ends or is killed the kernel kills everything left inside, including
     processes that called setsid(); pid_max of the namespace is set to 301, the kernel's minimum,
     which caps processes + threads even for root (RLIMIT_NPROC does not apply to root);
   - mount namespace: every mount is made read-only (mount_setattr, recursive) and a small tmpfs
     (SCRATCH_MB) is mounted on the scratch directory, so writing anywhere else fails with EROFS
     and the program cannot fill the disk;
   - then all capabilities are dropped (bounding set too) and no_new_privs is set, so the program,
     root only inside its user namespace, cannot undo any of this.
   Init of the namespace is our bootstrap: it forks the program, waits, and reports its exit status.
2. Resource limits set before the program starts: RLIMIT_AS (memory_mb), RLIMIT_CPU (timeout + 1 s),
   RLIMIT_FSIZE (FILE_MB, stdout/stderr included), RLIMIT_NOFILE, RLIMIT_CORE 0, RLIMIT_NPROC
   (MAX_TASKS within the namespace; without namespaces, the user's current task count + MAX_TASKS,
   because RLIMIT_NPROC counts every task of the user; ignored by the kernel for root).
3. The harness: a wall-clock timeout, then SIGKILL to the process group, and a /proc sweep that
   kills, until none is left, every live process in the program's group, session or pid namespace
   or with its cwd in the scratch directory. It runs before the group leader is reaped, so the pids
   it matches on cannot have been reused.
4. A Python guard installed before the program runs: os.kill/killpg/fork/exec*/spawn*/system/setsid,
   subprocess, _posixsubprocess, resource.setrlimit/prlimit refused; sockets refused (socketpair
   kept, so asyncio works); open/os.open for writing, remove/rename/mkdir/... allowed only inside
   the scratch directory. This is defence in depth against accidents, NOT a security boundary:
   ctypes, `import posix` or reloading `os` get around it.

Without namespaces (unshare missing or user namespaces disabled) only layers 2-4 apply, and then
the Python guard is all that stands between a deliberately hostile program and the network, the
filesystem and your other processes (ctypes can kill(-1), fork without limit as root, write files,
setsid and chdir out of the sweep's reach). Reading files is never restricted: a program can read
whatever the user running the harness can (with no network, only into its own stdout/stderr).
A SIGKILL the harness did not send (the OOM killer's signal) is reported as "memory".

Scoring (`tests=`): the task's tests run after the program, in its process and namespace, and the
run passes only when they ran to their end: the harness then writes a nonce to a file descriptor the
program was never told about, read from a pipe closed before the program starts. An exit status of 0
is not a pass, so an answer that leaves early (sys.exit, os._exit, an atexit hook, a signal to itself,
a closed stdout) fails. Like the guard, this stops answers that game the exit status, not a program
built to search the harness's memory for the nonce.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

FILE_MB = 16  # largest file a program may write (RLIMIT_FSIZE); stdout and stderr are files too
SCRATCH_MB = 64  # size of the scratch tmpfs (namespaces only)
MAX_TASKS = 64  # processes + threads a program may add (RLIMIT_NPROC; the kernel ignores it for root)
PID_MAX = 301  # pid_max of the program's pid namespace: the kernel's minimum, a cap that holds for root
OPEN_FILES = 256

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
            "--mount", "--propagation", "private"]

# Runs as `python -I -c _BOOTSTRAP CONFIG` in the scratch directory; inside the namespaces it is pid 1.
_BOOTSTRAP = r'''
import builtins, io, json, os, resource, shutil, signal, socket, subprocess, sys, _posixsubprocess
cfg = json.loads(sys.argv[1])
scratch, ns = cfg["scratch"], cfg["ns"]
with open(os.path.join(scratch, "program.py"), encoding="utf-8") as f:
    src = f.read()
tests = None
if cfg["tests"]:
    with open(os.path.join(scratch, "tests.py"), encoding="utf-8") as f:
        tests = f.read()
    os.remove(os.path.join(scratch, "tests.py"))


def warn(what, e):
    print(f"sandbox setup: {what} failed: {e}", file=sys.stderr, flush=True)


def setup_namespaces():
    # We are root in fresh user/pid/mount/net namespaces, and nowhere else.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    try:  # per-namespace pid_max (Linux >= 6.14): a cap on tasks that also holds for root
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(cfg["pid_max"]))
    except OSError:
        pass  # older kernels: one global pid_max we may not write (isolation() reports it)
    try:  # every mount read-only: mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {attr_set=RDONLY})
        attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)
        check(libc.syscall(442, -100, b"/", 0x8000, attr, ctypes.sizeof(attr)), "mount_setattr")
        # then a fresh writable tmpfs on the scratch directory (MS_NOSUID | MS_NODEV)
        opts = f"size={cfg['scratch_mb']}m,mode=0700".encode()
        check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 2 | 4, opts), "mount tmpfs")
        os.chdir(scratch)  # enter the tmpfs: our cwd was the directory underneath it
    except OSError as e:
        warn("read-only filesystem", e)
    # Drop every capability, the bounding set first, so none of the above can be undone.
    for cap in range(64):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; fails past the last capability
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    try:
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    except OSError as e:
        warn("dropping capabilities", e)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def user_tasks():
    # RLIMIT_NPROC counts every task (threads too) of the real user, so measure them.
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return n


def set_limits():
    limits = {resource.RLIMIT_AS: cfg["memory_mb"] << 20, resource.RLIMIT_FSIZE: cfg["file_mb"] << 20,
              resource.RLIMIT_NOFILE: cfg["open_files"], resource.RLIMIT_CORE: 0}
    if ns:
        limits[resource.RLIMIT_NPROC] = cfg["max_tasks"]  # counted per user namespace: ours is new
    elif os.getuid() != 0:
        limits[resource.RLIMIT_NPROC] = user_tasks() + cfg["max_tasks"]
    for res, value in limits.items():
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))  # SIGXCPU, then SIGKILL


def refuse(*args, **kwargs):
    raise PermissionError(13, "not allowed in the sandbox")


def install_guard():
    real_open, real_os_open, readlink, realpath = builtins.open, os.open, os.readlink, os.path.realpath

    def where(path, dir_fd=None, follow=True):
        if isinstance(path, int):
            return readlink(f"/proc/self/fd/{path}")
        p = os.fsdecode(path)
        if dir_fd is not None and not p.startswith("/"):
            p = os.path.join(readlink(f"/proc/self/fd/{dir_fd}"), p)
        p = os.path.abspath(p)
        if follow:
            return realpath(p)
        head, tail = os.path.split(p)  # the entry itself (a symlink is removed, not followed)
        return os.path.join(realpath(head), tail)

    def check(path, dir_fd=None, follow=True):
        p = where(path, dir_fd, follow)
        if p != scratch and not p.startswith(scratch + "/") and p != "/dev/null":
            raise PermissionError(13, "writing outside the sandbox scratch directory", str(path))

    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and set(mode) & set("wax+"):
            check(file)
        return real_open(file, mode, *args, **kwargs)
    builtins.open = io.open = guarded_open

    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & writing:
            check(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)
    os.open = guarded_os_open

    def guarded(fn, *paths):  # paths: (argument index, its dir_fd keyword, follow symlinks)
        def wrapper(*args, **kwargs):
            for i, fd_kw, follow in paths:
                if i < len(args):
                    check(args[i], kwargs.get(fd_kw), follow)
            return fn(*args, **kwargs)
        return wrapper
    for name in ("remove", "unlink", "rmdir", "mkdir", "mkfifo", "mknod"):
        setattr(os, name, guarded(getattr(os, name), (0, "dir_fd", False)))
    for name in ("truncate", "chmod", "utime"):
        setattr(os, name, guarded(getattr(os, name), (0, "dir_fd", True)))
    for name in ("rename", "replace"):
        setattr(os, name, guarded(getattr(os, name), (0, "src_dir_fd", False), (1, "dst_dir_fd", False)))
    os.symlink = guarded(os.symlink, (1, "dir_fd", False))
    os.link = guarded(os.link, (1, "dst_dir_fd", False))

    for name in ("kill", "killpg", "fork", "forkpty", "setsid", "setpgid", "setpgrp", "system", "popen",
                 "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                 "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                 "posix_spawn", "posix_spawnp", "chroot", "chown", "lchown", "fchown", "setpriority",
                 "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid"):
        if hasattr(os, name):
            setattr(os, name, refuse)
    signal.pidfd_send_signal = refuse
    resource.setrlimit = resource.prlimit = refuse
    shutil.chown = refuse
    _posixsubprocess.fork_exec = refuse  # what subprocess and multiprocessing's spawn use

    class NoPopen(subprocess.Popen):  # a subclass, so code that subclasses Popen still imports
        def __init__(self, *args, **kwargs):
            raise PermissionError(13, "starting processes is not allowed in the sandbox")
    subprocess.Popen = NoPopen

    class NoNetSocket(socket.socket):  # wrapping an existing fd (socketpair, fromfd) stays allowed
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise PermissionError(13, "network access is disabled in the sandbox")
            super().__init__(family, type, proto, fileno)
    socket.socket = NoNetSocket


if ns:
    setup_namespaces()
set_limits()
if ns:
    child = os.fork()
    if child:  # init of the pid namespace: report the program's wait status; exiting kills the rest
        os.write(cfg["status_fd"], str(os.waitpid(child, 0)[1]).encode())
        os._exit(0)
os.close(cfg["status_fd"])


def run(src, tests, nonce_fd, done_fd, exec_=exec, compile_=compile, read=os.read, write=os.write, close=os.close,
        exit_=os._exit, flush=lambda f: f.flush(), hooks=(sys.settrace, sys.setprofile)):
    # Everything the end needs is bound here, before the program runs, so that replacing os.write,
    # exec or os._exit does not change what happens after the tests. The nonce lives only in this
    # frame: the program cannot read it from argv, the environment or a file.
    nonce = read(nonce_fd, 64) if tests is not None else b""
    close(nonce_fd)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    exec_(compile_(src, "program.py", "exec"), scope)
    if tests is None:
        return
    for set_hook in hooks:  # a trace function the program left could jump over the tests' asserts
        set_hook(None)
    exec_(compile_(tests, "tests.py", "exec"), scope)
    # The tests ran to their end in this process: only now is the nonce written, and the process
    # ends here, before atexit handlers or anything else the program left behind could run.
    for f in (sys.stdout, sys.stderr):
        try:
            flush(f)
        except BaseException:
            pass
    write(done_fd, nonce)
    exit_(0)


install_guard()
import linecache, traceback
# Tracebacks with the program's source lines, starting at the program, not at this bootstrap.
linecache.cache["program.py"] = (len(src), None, src.splitlines(True), "program.py")
if tests is not None:
    linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")


def excepthook(typ, value, tb):
    while tb is not None and tb.tb_frame.f_code.co_filename not in ("program.py", "tests.py"):
        tb = tb.tb_next
    traceback.print_exception(typ, value, tb)


sys.excepthook = excepthook
sys.argv = ["program.py"]
run(src, tests, cfg.pop("nonce_fd"), cfg.pop("done_fd"))
'''

# Run inside the namespaces once, to report what actually took effect on this machine.
_PROBE = r'''
import json, os, socket
with open("/proc/self/status") as f:
    cap_eff = [line.split()[1] for line in f if line.startswith("CapEff")][0]
with open("/proc/sys/kernel/pid_max") as f:
    pid_max = int(f.read())
print(json.dumps({"pid": os.getpid(), "pid_max": pid_max, "interfaces": [n for _, n in socket.if_nameindex()],
                  "root_read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
                  "scratch_writable": not os.statvfs(".").f_flag & os.ST_RDONLY,
                  "capabilities": int(cap_eff, 16)}))
'''


@dataclass
class ExecResult:
    status: str  # passed | failed | timeout | memory | error
    returncode: int | None  # None on timeout and error; negative: killed by that signal
    stdout: str  # the first max_output bytes
    stderr: str  # the last max_output bytes (where the traceback is)
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@lru_cache(maxsize=1)
def _namespaces() -> dict | None:
    """What the namespace layer achieves here (the probe's report), or None where it does not work."""
    if shutil.which("unshare") is None:
        return None
    r = _run(_PROBE, 20.0, 512, 10_000, ns=True)
    if not r.passed:
        return None
    try:
        report = json.loads(r.stdout)
    except ValueError:
        return None
    report["warnings"] = r.stderr.strip()
    return report


def isolation() -> str:
    """The isolation active on this machine, in words (for logs and reports)."""
    common = "rlimits (AS, CPU, FSIZE, NOFILE, NPROC, CORE), process-group/session kill + /proc sweep, Python guard"
    ns = _namespaces()
    if ns is None:
        return f"no namespaces (unshare --user unavailable); {common}"
    parts = [f"user+pid+mount+network namespaces (interfaces: {', '.join(ns['interfaces']) or 'none'}"]
    parts.append(f"pid_max {ns['pid_max']}" if ns["pid_max"] <= PID_MAX else "pid_max not settable")
    if ns["root_read_only"] and ns["scratch_writable"]:
        parts.append(f"filesystem read-only outside a {SCRATCH_MB} MiB tmpfs scratch")
    else:
        parts.append("filesystem NOT read-only")
    parts.append("no capabilities)" if ns["capabilities"] == 0 else "capabilities NOT dropped)")
    return ", ".join(parts) + f"; {common}"


def _stat(pid: str) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, session) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])


def _leftovers(leader: int, scratch: str, namespaces: set[str]) -> list[int]:
    """Live processes of the run led by `leader`: its group, its session, its pid namespace (recorded in
    `namespaces` as group members are seen), or with a cwd in the scratch directory."""
    me, my_ns, found = os.getpid(), os.readlink("/proc/self/ns/pid"), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me or (st := _stat(pid)) is None or st[0] in "ZX":
            continue
        try:
            ns = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            continue
        ours = leader in (st[2], st[3])
        if ours and ns != my_ns:
            namespaces.add(ns)
        ours = ours or ns in namespaces
        if not ours:
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            ours = cwd == scratch or cwd.startswith(scratch + "/")
        if ours:
            found.append(int(pid))
    return found


def _kill_everything(proc: subprocess.Popen, scratch: str) -> None:
    """SIGKILL every process of the run until none is left, then reap the leader. Until it is reaped the
    leader's pid, which names the group and the session, cannot be reused by an unrelated process."""
    namespaces: set[str] = set()
    deadline = time.monotonic() + 10
    while True:
        found = _leftovers(proc.pid, scratch, namespaces)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    proc.wait()


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _read_tail(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
        return f.read(limit).decode("utf-8", errors="replace")


def _run(program: str, timeout_s: float, memory_mb: int, max_output: int, ns: bool, tests: str | None = None
         ) -> ExecResult:
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="refusion-sandbox-")).resolve()
    nonce = secrets.token_hex(16).encode()
    nonce_r, nonce_w = os.pipe()
    try:
        try:
            os.write(nonce_w, nonce)  # 32 bytes: the pipe holds them until the program's harness reads them
        finally:
            os.close(nonce_w)
        (scratch / "program.py").write_text(program, encoding="utf-8", errors="replace")
        if tests is not None:
            (scratch / "tests.py").write_text(tests, encoding="utf-8", errors="replace")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch),
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # (one BLAS thread: per-core thread pools would count against MAX_TASKS and RLIMIT_AS)
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err, \
                open(scratch / ".status", "wb") as status, open(scratch / ".done", "wb") as done:
            cfg = {"scratch": str(scratch), "ns": ns, "status_fd": status.fileno(), "memory_mb": memory_mb,
                   "cpu_s": math.ceil(timeout_s) + 1, "file_mb": FILE_MB, "open_files": OPEN_FILES,
                   "max_tasks": MAX_TASKS, "pid_max": PID_MAX, "scratch_mb": SCRATCH_MB,
                   "tests": tests is not None, "nonce_fd": nonce_r, "done_fd": done.fileno()}
            cmd = [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
            try:
                proc = subprocess.Popen(_UNSHARE + cmd if ns else cmd, cwd=scratch, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        pass_fds=(status.fileno(), nonce_r, done.fileno()), start_new_session=True)
            except OSError as e:
                return ExecResult("error", None, "", f"could not start: {e}", time.perf_counter() - t0)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_everything(proc, str(scratch))
        seconds = time.perf_counter() - t0
        stdout = _read_head(scratch / ".stdout", max_output)
        stderr = _read_tail(scratch / ".stderr", max_output)
        reported = (scratch / ".status").read_text()  # the program's wait status, from the namespace init
        rc = os.waitstatus_to_exitcode(int(reported)) if reported else proc.returncode
        tail = stderr.rstrip().rsplit("\n", 1)[-1]
        if timed_out or rc == -signal.SIGXCPU:
            return ExecResult("timeout", None, stdout, stderr, seconds)
        # With tests, passing means they ran to their end: the harness wrote the nonce after them. An
        # exit status of 0 alone is not enough (sys.exit(0), os._exit(0) or an atexit hook before or
        # during the tests give one too).
        finished = (scratch / ".done").read_bytes() == nonce if tests is not None else rc == 0
        if finished:
            status = "passed"
        elif rc == 0:
            status = "failed"
            stderr += "\nsandbox: the program exited before the tests ran to their end\n"
        elif tail.startswith("MemoryError") or (rc == -signal.SIGKILL and (reported or not ns)):
            status = "memory"
        elif ns and not reported and stderr.startswith("unshare:"):
            return ExecResult("error", None, stdout, stderr, seconds)  # the program never ran
        else:
            status = "failed"
        return ExecResult(status, rc, stdout, stderr, seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        os.close(nonce_r)


def run_python(program: str, timeout_s: float = 10.0, memory_mb: int = 1024, max_output: int = 10_000,
               tests: str | None = None) -> ExecResult:
    """Run `program` as __main__ in a fresh sandboxed interpreter. Without `tests`, exit status 0 is a
    pass. With `tests`, they run after the program in its namespace and the process, and the run passes
    only when they ran to their end: exiting early in any way (sys.exit, os._exit, an atexit hook, a
    signal, a closed stdout) is a failure whatever the exit status."""
    return _run(program, timeout_s, memory_mb, max_output, ns=_namespaces() is not None, tests=tests)


def run_many(programs: list[str], timeout_s: float = 10.0, memory_mb: int = 1024, workers: int | None = None,
             max_output: int = 10_000, tests: list[str] | None = None) -> list[ExecResult]:
    """run_python over many programs (and their tests) in parallel (threads driving subprocesses);
    results in input order."""
    _namespaces()  # probe once, before the threads race to
    pairs = list(zip(programs, tests, strict=True)) if tests is not None else [(p, None) for p in programs]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pt: run_python(pt[0], timeout_s, memory_mb, max_output, pt[1]), pairs))
