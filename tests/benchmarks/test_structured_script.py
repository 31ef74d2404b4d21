"""benchmarks/structured.py --quick: the JSON-extraction benchmark runs end to end on SmolLM2 with its
adapter, and what it reports holds: every constrained answer valid and equal to constrained `ar`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_structured_quick(tmp_path):
    out = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "structured.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["settings"]
    assert set(s) == {"speculative constrained", "ar constrained", "speculative unconstrained"}
    for name in ("speculative constrained", "ar constrained"):
        assert s[name]["valid"] == s[name]["identical"] == s[name]["n"] == 5, s[name]
        assert s[name]["tokens"] == sum(map(len, s[name]["outputs"])) and 0 < s[name]["grammar_ms_per_token"]
    for v in s.values():
        assert v["tpf"] == v["tokens"] / v["forwards"]
    assert "| speculative constrained | 5/5 | 5/5 |" in proc.stdout
