"""The code sandbox: results, limits, and hostile programs contained."""

import os
import time

import pytest

from refusion.sandbox import isolation, run_many, run_python


def sandbox_processes() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"refusion-sandbox-" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_pass_fail_and_output():
    r = run_python("print('hello')\nprint(1 + 1)")
    assert (r.status, r.returncode, r.stdout) == ("passed", 0, "hello\n2\n") and r.passed
    r = run_python("def f(x):\n    return x\nassert f(1) == 2")
    assert r.status == "failed" and "AssertionError" in r.stderr and not r.passed
    r = run_python("def f(:\n")
    assert r.status == "failed" and "SyntaxError" in r.stderr


def test_ordinary_library_code_runs():
    r = run_python("import re, math, heapq, itertools, collections, functools\n"
                   "print(sorted(heapq.nsmallest(2, [5, 1, 3])), math.gcd(12, 18), re.findall('a', 'banana'))")
    assert r.passed and r.stdout == "[1, 3] 6 ['a', 'a', 'a']\n"


def test_infinite_loop_times_out():
    t = time.perf_counter()
    r = run_python("while True:\n    pass", timeout_s=1)
    assert r.status == "timeout" and time.perf_counter() - t < 4


@pytest.mark.parametrize("program", [
    "import os\nwhile True:\n    os.fork()",
    "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()",
    "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()",
    "import ctypes, time\nlibc = ctypes.CDLL(None)\nfor _ in range(4):\n    libc.fork()\ntime.sleep(60)",
])
def test_fork_bombs_are_contained_and_cleaned_up(program):
    r = run_python(program, timeout_s=2)
    assert not r.passed
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_background_child_is_killed_at_the_end():
    r = run_python("import ctypes, time\nif ctypes.CDLL(None).fork() == 0:\n    time.sleep(60)\nprint('parent done')")
    assert r.passed and r.stdout == "parent done\n"
    time.sleep(0.2)
    assert sandbox_processes() == []


def test_memory_hog_hits_the_limit():
    r = run_python("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert r.status == "memory"
    r = run_python("xs = []\nwhile True:\n    xs.append(bytearray(10**7))", memory_mb=256, timeout_s=5)
    assert r.status == "memory"


def test_writing_outside_the_scratch_directory_is_refused(tmp_path):
    target = tmp_path / "escape.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                    f"import os\nos.remove({str(tmp_path)!r})"):
        r = run_python(program)
        assert not r.passed and "PermissionError" in r.stderr
    assert not target.exists() and tmp_path.exists()
    r = run_python("open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    assert r.passed and r.stdout == "ok\n"


def test_killing_the_parent_is_refused_and_the_harness_survives():
    for program in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                    "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
                    "import ctypes\nctypes.CDLL(None).kill(0, 9)\nctypes.CDLL(None).kill(-1, 9)"):
        r = run_python(program)
        assert not r.passed or "ctypes" in program
    assert run_python("print('still here')").stdout == "still here\n"


def test_no_network():
    r = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert not r.passed
    if "namespaces" in isolation() and "no namespaces" not in isolation():
        # below the guard, the network namespace has no route at all
        r = run_python("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
                       "s.settimeout(2)\ns.connect(('1.1.1.1', 53))")
        assert not r.passed and ("unreachable" in r.stderr or "Errno 101" in r.stderr), r.stderr


def test_huge_output_is_truncated():
    r = run_python("print('x' * 10**8)", max_output=1000)
    assert len(r.stdout) == 1000 and not r.passed


def test_run_many_keeps_order():
    progs = [f"assert {i} % 2 == 0" for i in range(6)]
    assert [r.passed for r in run_many(progs, workers=3)] == [True, False, True, False, True, False]
