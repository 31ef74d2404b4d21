"""benchmarks/gpu.py, the one command a GPU machine runs, on a CPU at tiny sizes (--quick): every
part's code path runs, so that the script cannot rot between the rare machines that have a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORDS = ROOT / "tests" / "fixtures" / "refusion-words"


@pytest.mark.long
def test_gpu_script_quick_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick",
                           "--model", str(WORDS), "--budget-s", "1200", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert {k: v["status"] for k, v in parts.items()} == dict(correctness="ok", decode="ok", serve="ok", forward="ok")
    # on a CPU greedy speculative is ar token for token, both models, float32 and bfloat16, batch 1 and 2
    checks = parts["correctness"]["speculative_vs_ar"]
    assert {(r["model"], r["dtype"], r["batch"]) for r in checks} == {
        (m, d, b) for m in ("bundled", str(WORDS)) for d in ("float32", "bfloat16") for b in (1, 2)}
    assert all(r["same"] == r["prompts"] == 4 and r["differences"] == [] for r in checks)
    # and plan-and-infill gives the recorded CPU outputs
    record = parts["correctness"]["plan_and_infill_vs_cpu_record"]["settings"]
    assert [(r["setting"], r["same"], r["prompts"]) for r in record] == [("refusion s8 0.9/0.4 | batch 1", 4, 4)]
    rows = parts["decode"]["rows"]
    assert {(r["decoder"], r["batch"]) for r in rows} == {
        (d, b) for d in ("ar", "speculative", "plan-and-infill", "mdm-threshold") for b in (1, 2)}
    for r in rows:
        assert r["tokens"] > 0 and r["tpf"] == r["tokens"] / r["forwards"]
        if r["decoder"] in ("ar", "speculative"):
            assert r["same_as_ar"] == r["prompts"]
    assert set(parts["decode"]["syncs"]) == {"ar", "speculative", "plan-and-infill", "mdm-threshold"}
    assert all(lv["ok"] == lv["requests"] == lv["correct"] for lv in parts["serve"]["load"])
    assert [lv["clients"] for lv in parts["serve"]["load"]] == [1, 2]
    models = parts["forward"]["models"]
    assert set(models) == {str(WORDS), "qwen3-tiny-shaped"}
    modes = {(label, r["mode"]) for label, m in models.items() for r in m["rows"]}
    assert modes == {(str(WORDS), "eager"), ("qwen3-tiny-shaped", "eager"), ("qwen3-tiny-shaped", "compiled")}
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for m in models.values() for r in m["rows"])
    assert "| part | status | seconds |" in proc.stdout
