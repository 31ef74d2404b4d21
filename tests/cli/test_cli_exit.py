"""`refusion` as a process (refusion.cli.main.console_main): the exit skips the interpreter's slow
teardown, and loses nothing a command left behind."""

import subprocess
import sys

COMMAND = """
import importlib
import sys

cli = importlib.import_module("refusion.cli.main")  # (refusion.cli.main, the attribute, is the function)


class Dropped:  # garbage in a reference cycle: only the cyclic collector finalizes it
    def __init__(self):
        self.me = self

    def __del__(self):
        with open(sys.argv[1], "w") as f:
            f.write("finalized")


def command():
    Dropped()
    print("done", end="")  # (stdout left unflushed)
    return 3


cli.main = command
sys.exit(cli.console_main())
"""


def test_an_exit_through_console_main_keeps_the_exit_code_and_finalizes_what_the_command_dropped(tmp_path):
    path = tmp_path / "out.txt"
    p = subprocess.run([sys.executable, "-c", COMMAND, str(path)], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (3, "done", "")
    assert path.read_text() == "finalized"
