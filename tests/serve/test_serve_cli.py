"""`refusion serve` as a user starts it: a real subprocess, what it prints, the port it listens on."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

SERVE = [sys.executable, "-m", "refusion.cli", "serve", "--log-level", "warning", "--threads", "1"]


def test_port_0_prints_the_port_it_listens_on():
    p = subprocess.Popen([*SERVE, "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        m = re.fullmatch(r"refusion: serving \S+ on http://127\.0\.0\.1:(\d+)/ \(OpenAI API under /v1, metrics at "
                         r"/metrics; at most 1024 tokens per request\)\n", line)
        assert m and int(m[1]) > 0, line
        r = httpx.get(f"http://127.0.0.1:{m[1]}/health", timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        p.terminate()
        p.wait(60)


def test_a_port_in_use_is_one_line_before_serving():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([*SERVE, "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"refusion: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                        "choose another --port (0: any free one)\n")
