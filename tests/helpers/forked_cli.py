"""`refusion` commands run as forks of one process that has imported torch and refusion once.

For a test that runs a script of many short commands (test_study.py: `scripts/study.sh --quick`
starts about thirty), where a fresh interpreter spends most of each command importing torch. Each
command is still a process of its own, forked from a server that has imported and done nothing
else: the caller's arguments, working directory, environment, stdin / stdout / stderr (the file
descriptors themselves, passed over a Unix socket) and exit code, and the code `python -m
refusion.cli` runs (refusion.cli.main.console_main).

    with ForkServer() as server:
        env["REFUSION"] = server.command   # "python -S tests/helpers/forked_cli.py SOCKET", then the arguments
        subprocess.run(["bash", "scripts/study.sh", "--quick"], env=env)

One command at a time (a second caller waits for the first). A caller that goes away (killed by
a timeout) takes its command with it.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback

STDIO = (0, 1, 2)


def serve(path: str) -> None:
    """Import what the commands import, then run each request in a fork, one at a time."""
    sys.path[0] = os.getcwd()  # not tests/ (each command puts its own directory there, as `python -m` does)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it when a trainer makes its optimizer)

    import refusion.cli.main  # noqa: F401
    import refusion.evaluation.run  # noqa: F401
    import refusion.training.trainer  # noqa: F401

    gc.freeze()  # what is imported stays out of each command's collections (and its pages shared)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, len(STDIO))
            request = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                _command(request, fds, [listener, conn])  # never returns
            for fd in fds:
                os.close(fd)
            code = _wait(pid, conn)
            try:
                conn.sendall(str(code).encode())
            except OSError:  # the caller is gone
                pass


def _wait(pid: int, conn: socket.socket) -> int:
    """The child's exit code (128 + N for a signal, as a shell reports it); the child is killed if
    the caller goes away first (its end of the connection closes)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if select.select([conn], [], [], 0.02)[0]:
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
            break
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _command(request: dict, fds: list[int], server_sockets: list[socket.socket]) -> None:
    """The forked child: become the caller's command, run it, exit as an interpreter would (exit
    functions run, output flushed), never returning into the server's loop."""
    code = 1
    try:
        for s in server_sockets:
            s.close()
        for target in STDIO:
            if target in request["stdio"]:
                os.dup2(fds[request["stdio"].index(target)], target)
            else:
                os.close(target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["refusion", *request["argv"]]
        from refusion.cli.main import console_main

        code = console_main()
    except SystemExit as e:  # as the interpreter handles it
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def call(path: str, argv: list[str]) -> int:
    """The caller's side: hand this process's arguments, directory, environment and stdio to the server."""
    stdio = []
    for fd in STDIO:
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:  # closed here: left closed there
            pass
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "stdio": stdio}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(path)
        socket.send_fds(s, [json.dumps(request).encode()], stdio)
        return int(s.recv(16))


class ForkServer:
    """The server as a context manager: started (and ready) on entry, stopped on exit.
    `command` is what to run in place of `python -m refusion.cli`."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._dir.name, "cli.sock")
        self.command = f"{sys.executable} -S {os.path.abspath(__file__)} {self.path}"
        self._env = env

    def __enter__(self) -> "ForkServer":
        self._proc = subprocess.Popen([sys.executable, __file__, "serve", self.path], env=self._env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline() != "ready\n":
            self._proc.kill()
            raise RuntimeError(f"the fork server did not start (exit code {self._proc.wait()})")
        return self

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=60)
        self._proc.stdout.close()
        self._dir.cleanup()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(call(sys.argv[1], sys.argv[2:]))
