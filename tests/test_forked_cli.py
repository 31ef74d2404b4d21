"""tests/helpers/forked_cli.py, the fork server test_study.py runs the study script through: a command
given to it runs with the caller's arguments, directory, environment, stdout, stderr and exit code."""

import json
import os
import subprocess

from tests.helpers.forked_cli import ForkServer

SCRIPT = """
cd "$1"
$REFUSION train --plan --json > plan.json; echo "plan $?"
$REFUSION report nowhere 2> err.txt; echo "report $?"
$REFUSION report res --out report.md > /dev/null; echo "report $?"
"""


def test_a_command_through_the_fork_server_is_the_callers(tmp_path):
    (tmp_path / "res").mkdir()
    summary = {"model": "m", "task": "add", "decoder": "ar", "params": {}, "n": 2, "accuracy": 0.5, "ci95": [0.1, 0.9],
               "tokens": 8, "seconds": 1.0, "forwards": 8, "tps": 8.0, "tpf": 1.0, "latency_p50": 0.5}
    (tmp_path / "res" / "m__add__ar.json").write_text(json.dumps(summary))
    with ForkServer() as server:  # (its environment has no WORLD_SIZE: the caller's does)
        p = subprocess.run(["bash", "-c", SCRIPT, "bash", str(tmp_path)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "REFUSION": server.command, "WORLD_SIZE": "3"})
    assert (p.stdout, p.stderr) == ("plan 0\nreport 2\nreport 0\n", "")
    assert json.loads((tmp_path / "plan.json").read_text())["processes"]["total"] == 3
    assert (tmp_path / "err.txt").read_text() == "refusion: error: nowhere: no such file or directory\n"
    assert "| m | add | ar |" in (tmp_path / "report.md").read_text()
