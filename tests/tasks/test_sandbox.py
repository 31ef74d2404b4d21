"""The code sandbox: results, limits, and hostile programs contained, with the harness unharmed."""

import os
import sys
import time
import uuid

import pytest

from refusion.tasks import sandbox
from refusion.tasks.sandbox import isolation, run_many, run_python

# Programs that get around the Python guard (ctypes) are only safe to run where the namespaces hold
# them: without a pid namespace, ctypes kill(-1, 9) as root would kill every process on the machine.
NAMESPACES = sandbox._namespaces() is not None
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="user namespaces unavailable: " + isolation())


def marker() -> str:
    return "sbx" + uuid.uuid4().hex[:10]  # fits the 15 characters of a process name


def name_process(mark: str) -> str:
    """Program prelude: name the process `mark` (PR_SET_NAME); forked children inherit the name."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {mark.encode()!r}, 0, 0, 0)\n"


def alive(mark: str) -> list[int]:
    """Live (not zombie) processes with `mark` in their name or command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            with open(f"/proc/{pid}/comm", "rb") as f, open(f"/proc/{pid}/cmdline", "rb") as g:
                text = f.read() + g.read()
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X") and mark.encode() in text:
            found.append(int(pid))
    return found


def test_pass_fail_syntax_error_and_output():
    r = run_python("print('hello')\nprint(1 + 1)")
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("passed", 0, "hello\n2\n", "") and r.passed
    r = run_python("def f(x):\n    return x\nassert f(1) == 2")
    assert (r.status, r.returncode) == ("failed", 1) and not r.passed
    assert r.stderr.rstrip().endswith("AssertionError") and "assert f(1) == 2" in r.stderr
    r = run_python("def f(:\n")
    assert (r.status, r.returncode) == ("failed", 1) and "SyntaxError" in r.stderr
    r = run_python("import sys\nprint('partial')\nsys.exit(3)")
    assert (r.status, r.returncode, r.stdout) == ("failed", 3, "partial\n")


def test_ordinary_programs_run():
    r = run_python("import heapq, math, re, tempfile, shutil, asyncio, threading\n"
                   "d = tempfile.mkdtemp()\nopen(d + '/f.txt', 'w').write('ok')\nshutil.rmtree(d)\n"
                   "async def main():\n    return 7\n"
                   "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
                   "print(sorted(heapq.nsmallest(2, [5, 1, 3])), math.gcd(12, 18), re.findall('a', 'banana'),"
                   " asyncio.run(main()), input.__name__)")
    assert r.passed, r.stderr
    assert r.stdout == "thread\n[1, 3] 6 ['a', 'a', 'a'] 7 input\n"
    r = run_python("input()")  # stdin is /dev/null
    assert r.status == "failed" and "EOFError" in r.stderr


def test_isolation_reports_what_is_active():
    text = isolation()
    assert "Python guard" in text and "rlimits" in text
    if NAMESPACES:
        ns = sandbox._namespaces()
        assert ns["interfaces"] == ["lo"] and ns["pid"] == 2 and ns["capabilities"] == 0
        assert "network namespaces" in text


def test_infinite_loop_times_out():
    t = time.perf_counter()
    r = run_python("while True:\n    pass", timeout_s=1)
    assert (r.status, r.returncode, r.passed) == ("timeout", None, False)
    assert 1 <= r.seconds < 3 and time.perf_counter() - t < 3


@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()",
    "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()",
    "import multiprocessing as mp\nmp.set_start_method('spawn')\nwhile True:\n    mp.Process(target=print).start()",
    "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, 'program.py'])",
    "import os\nwhile True:\n    os.system('python3 -c 1 &')",
])
def test_fork_bombs_are_refused(bomb):
    mark = marker()
    r = run_python(name_process(mark) + bomb, timeout_s=2)
    assert r.status == "failed" and "PermissionError" in r.stderr, r.stderr
    assert alive(mark) == []


@needs_namespaces
def test_native_fork_bomb_is_contained_and_cleaned_up():
    mark = marker()
    t = time.perf_counter()
    r = run_python(name_process(mark) + "libc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()", timeout_s=1)
    assert r.status == "timeout" and time.perf_counter() - t < 10
    assert alive(mark) == []


@needs_namespaces
def test_children_that_escape_the_session_are_killed():
    # setsid + chdir('/') leaves the process group, the session and the scratch directory;
    # only the pid namespace still holds these children.
    mark = marker()
    r = run_python(name_process(mark) + "import os, time\nlibc = ctypes.CDLL(None)\n"
                   "for _ in range(3):\n    if libc.fork() == 0:\n        libc.setsid()\n        os.chdir('/')\n"
                   "        time.sleep(100)\nprint('parent done')")
    assert r.passed and r.stdout == "parent done\n" and r.seconds < 5
    assert alive(mark) == []


def test_background_child_is_killed_at_the_end():
    mark = marker()
    arg = f"{900 + uuid.uuid4().int % 99}.{uuid.uuid4().int % 10**6}"  # a unique `sleep` argument
    r = run_python(name_process(mark) + "import time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n"
                   f"    libc.execv(b'/bin/sleep', (ctypes.c_char_p * 3)(b'sleep', b'{arg}', None))\n"
                   "    time.sleep(100)\n"
                   "if libc.fork() == 0:\n    time.sleep(100)\ntime.sleep(0.3)\nprint('parent done')")
    assert r.passed and r.stdout == "parent done\n" and r.seconds < 5
    assert alive(mark) == [] and alive(arg) == []
    r = run_python("import os\nos.system('sleep 100 &')")
    assert r.status == "failed" and "PermissionError" in r.stderr


def test_memory_hog_hits_the_limit():
    r = run_python("x = bytearray(10 * 1024**3)", memory_mb=256)
    assert (r.status, r.returncode) == ("memory", 1) and "MemoryError" in r.stderr
    r = run_python("xs = [0] * (10 * 1024**3)", memory_mb=256)
    assert r.status == "memory"
    r = run_python("xs = []\nwhile True:\n    xs.append(bytearray(10**7))", memory_mb=256, timeout_s=5)
    assert r.status == "memory" and r.seconds < 5
    assert run_python("x = bytearray(100 * 1024**2)\nprint(len(x))", memory_mb=256).stdout == "104857600\n"


def test_writing_outside_the_scratch_directory_is_refused(tmp_path):
    home = os.path.expanduser("~")
    targets = [str(tmp_path / "escape.txt"), os.path.join(home, f"refusion-sandbox-escape-{uuid.uuid4().hex}.txt")]
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    try:
        for target in targets:
            for program in (f"open({target!r}, 'w').write('x')",
                            f"import pathlib\npathlib.Path({target!r}).write_text('x')",
                            f"import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
                            f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')",
                            f"import os, shutil\nos.chdir({os.path.dirname(target)!r})\n"
                            f"open({os.path.basename(target)!r}, 'a').write('x')"):
                r = run_python(program)
                assert r.status == "failed" and "PermissionError" in r.stderr, (program, r.stderr)
                assert not os.path.exists(target)
        for program in (f"import os\nos.remove({str(keep)!r})", f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                        f"import os\nos.rename({str(keep)!r}, 'stolen.txt')"):
            r = run_python(program)
            assert r.status == "failed" and "PermissionError" in r.stderr, (program, r.stderr)
        assert keep.read_text() == "mine"
        if NAMESPACES:  # below the guard, the filesystem itself is read-only
            for target in targets:
                r = run_python(f"import posix\nposix.open({target!r}, posix.O_WRONLY | posix.O_CREAT)")
                assert r.status == "failed" and "Read-only file system" in r.stderr, r.stderr
                assert not os.path.exists(target)
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)
    r = run_python("import os\nopen('inside.txt', 'w').write('ok')\nos.mkdir('d')\nos.rename('inside.txt', 'd/x')\n"
                   "print(open(os.path.expanduser('~/d/x')).read(), os.listdir('d'))\nos.remove('d/x')\nos.rmdir('d')")
    assert r.passed and r.stdout == "ok ['x']\n", r.stderr


def test_killing_the_parent_is_refused_and_the_harness_survives():
    me = os.getpid()
    programs = ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
                "import signal\nsignal.pidfd_send_signal(0, 9)"]
    for program in programs:
        r = run_python(program)
        assert r.status == "failed" and "PermissionError" in r.stderr, r.stderr
    if NAMESPACES:  # below the guard, nothing outside the pid namespace can be reached
        for program in ("import ctypes, os\nlibc = ctypes.CDLL(None)\nlibc.kill(os.getppid(), 9)\nlibc.kill(-1, 9)\n"
                        "libc.kill(0, 9)",
                        f"import ctypes\nctypes.CDLL(None).kill({me}, 9)\nraise SystemExit(ctypes.get_errno())"):
            assert not run_python(program).passed
    assert os.getpid() == me and os.getppid() != 1
    assert run_python("print('still here')").stdout == "still here\n"


def test_no_network():
    for program in ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
                    "import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)"):
        r = run_python(program)
        assert r.status == "failed" and "PermissionError" in r.stderr, r.stderr
    if NAMESPACES:  # below the guard, the network namespace has no route at all
        r = run_python("import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
                       "s.settimeout(2)\ns.connect(('1.1.1.1', 53))")
        assert r.status == "failed" and "Network is unreachable" in r.stderr, r.stderr


def test_huge_output_is_truncated():
    r = run_python("print('x' * 10**8)", max_output=1000)
    assert r.stdout == "x" * 1000 and r.status == "failed" and "File too large" in r.stderr
    r = run_python("import sys\nwhile True:\n    print('y' * 1000)\n    print('e' * 1000, file=sys.stderr)",
                   max_output=500)
    assert r.stdout == "y" * 500 and len(r.stderr) <= 500 and not r.passed and r.seconds < 5


def test_could_not_start_is_an_error(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    r = run_python("print(1)")
    assert (r.status, r.returncode, r.passed) == ("error", None, False) and "/nonexistent/python3" in r.stderr


def test_run_many_keeps_order():
    programs = [f"print({i})\nassert {i} % 3 != 1" for i in range(7)] + ["while True: pass"]
    results = run_many(programs, timeout_s=1, workers=2)
    assert [r.status for r in results] == ["passed", "failed", "passed", "passed", "failed", "passed", "passed",
                                           "timeout"]
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(7)] + [""]


# Answers that try to pass a task's tests without passing them: each leaves the process before the tests
# end. With tests given, only the harness's nonce written after them makes a pass; exit status 0 does not.
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
WRONG = "def add(a, b):\n    return a - b\n"
WAYS_OUT = {
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "raise SystemExit": "raise SystemExit\n",
    "os._exit(0)": "import os\nos._exit(0)\n",
    "atexit os._exit": "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "atexit sys.exit": "import atexit, sys\natexit.register(lambda: sys.exit(0))\n",
    "kill itself": "import os, signal\nos.kill(os.getpid(), 9)\n",
    "kill itself (ctypes)": "import ctypes, os\nctypes.CDLL(None).kill(os.getpid(), 9)\n",
    "close stdout": "import os\nos.close(1)\n",
    "close every fd": "import os\nos.closerange(0, 1024)\n",
    "exit in the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os._exit in the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "thread exits": "import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\nimport time\n"
                    "time.sleep(1)\n",
    "replace os.write and exit": "import os\nos.write = lambda fd, b: len(b)\nos._exit = lambda c: None\n",
    "print a fake marker": "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'0' * 32)\n"
                           "    except OSError:\n        pass\nos._exit(0)\n",
    "excepthook swallows": "import sys\nsys.excepthook = lambda *a: None\n",
    # (in a plain exec of the tests after it, this jumps from the first assert to the last line, a pass)
    "trace skips the asserts": "import sys\ndef skip(frame, event, arg):\n"
                               "    if frame.f_code.co_filename == 'tests.py' and event == 'line' and frame.f_lineno == 1:\n"
                               "        frame.f_lineno = 3\n    return skip\n"
                               "sys.settrace(skip)\nsys.setprofile(lambda *a: None)\nsys.settrace = lambda f: None\n",
}


@pytest.mark.parametrize("way", list(WAYS_OUT))
def test_an_answer_that_leaves_before_the_tests_end_fails(way):
    program = WAYS_OUT[way] + ("" if "def add" in WAYS_OUT[way] else WRONG)
    r = run_python(program, tests=TESTS + "pass\n", timeout_s=5)
    assert not r.passed and r.status in ("failed", "memory"), (way, r)
    if way in ("sys.exit(0)", "raise SystemExit", "os._exit(0)", "exit in the function", "os._exit in the function",
               "print a fake marker", "thread exits"):
        # the exit status alone said "passed" before: the harness now says why it is not
        assert r.returncode == 0 and "exited before the tests ran to their end" in r.stderr, r
    # the way out does not break an honest answer's pass on its own: the same prelude before a right
    # answer passes wherever it lets the program go on (closing stdout, an atexit hook, a harmless hook)
    if way in ("close stdout", "atexit os._exit", "atexit sys.exit", "excepthook swallows",
               "replace os.write and exit", "trace skips the asserts"):
        r = run_python(WAYS_OUT[way] + "def add(a, b):\n    return a + b\n", tests=TESTS, timeout_s=5)
        assert r.passed, (way, r)


def test_the_honest_right_answer_passes_and_a_wrong_one_fails():
    r = run_python("def add(a, b):\n    return a + b\nprint('defined')\n", tests=TESTS + "print('tested')\n")
    assert (r.status, r.returncode, r.stdout) == ("passed", 0, "defined\ntested\n") and r.passed
    r = run_python(WRONG, tests=TESTS)
    assert (r.status, r.returncode) == ("failed", 1)
    assert "tests.py" in r.stderr and "assert add(2, 3) == 5" in r.stderr  # the failing test's line
    r = run_python("def add(a, b):\n    return a +\n", tests=TESTS)  # a syntax error in the answer
    assert r.status == "failed" and "SyntaxError" in r.stderr
    # an answer whose tests print a lot still passes (output is flushed before the nonce is written)
    r = run_python("def add(a, b):\n    return a + b\n", tests=TESTS + "print('x' * 100000)\n", max_output=10)
    assert r.passed and r.stdout == "x" * 10


def test_run_many_pairs_programs_with_their_tests():
    rs = run_many(["def add(a, b):\n    return a + b\n", WRONG, "import sys\nsys.exit(0)\n"], tests=[TESTS] * 3,
                  timeout_s=5, workers=2)
    assert [r.passed for r in rs] == [True, False, False]
    with pytest.raises(ValueError):
        run_many(["x = 1"], tests=[TESTS, TESTS])


@pytest.mark.parametrize("way", ["sys.exit(0)", "os._exit(0)", "atexit os._exit", "kill itself", "close stdout",
                                 "print a fake marker", "trace skips the asserts"])
def test_without_namespaces_the_ways_out_fail_too(way):
    # the harness without its namespace layer (what runs where unshare --user does not work)
    program = WAYS_OUT[way] + ("" if "def add" in WAYS_OUT[way] else WRONG)
    r = sandbox._run(program, 5.0, 1024, 10_000, ns=False, tests=TESTS + "pass\n")
    assert not r.passed, (way, r)
    assert sandbox._run("def add(a, b):\n    return a + b\n", 5.0, 1024, 10_000, ns=False, tests=TESTS).passed
