"""The general-text corpus (standard library source) and the study script's smoke mode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.model.config import ConfigError
from refusion.training.corpus import corpus_records, stdlib_files, stdlib_records
from refusion.training.data import training_records
from refusion.training.trainer import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_stdlib_records_are_continuations_of_real_source():
    recs = stdlib_records(200, seed=3)
    assert len(recs) == 200
    sources = {p: p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()}
    for r in recs[:40]:
        assert r["query"].startswith("Continue this Python code:\n")
        head = r["query"][len("Continue this Python code:\n"):]
        passage = head + "\n" + r["response"]
        assert any(passage in text for text in sources.values()), passage  # a verbatim cut, head then tail
        assert r["response"].strip() and len(passage) <= 400
    assert not any("/test/" in str(p) or "site-packages" in str(p) for p in sources)


def test_stdlib_records_are_a_function_of_the_seed():
    assert stdlib_records(50, seed=1) == stdlib_records(50, seed=1)
    assert stdlib_records(50, seed=1) != stdlib_records(50, seed=2)
    assert stdlib_records(80, seed=1)[:50] == stdlib_records(50, seed=1)  # more records extend, not reshuffle


def test_unknown_corpus_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown corpus 'wiki'; known corpora: stdlib"):
        corpus_records("wiki", 3)
    with pytest.raises(ConfigError, match="corpus must be one of stdlib, got 'wiki'"):
        TrainConfig(corpus="wiki").validate()
    with pytest.raises(ConfigError, match="corpus_examples must be >= 1"):
        TrainConfig(corpus="stdlib", corpus_examples=0).validate()


def test_training_records_mix_the_corpus_into_the_task_data():
    got = training_records("tasks:sort,add", 30, 0, "stdlib", 20)
    assert len(got) == 50
    assert sum(r["query"].startswith("Continue this Python code:") for r in got) == 20
    assert got[30:] == stdlib_records(20, seed=0)


def test_study_quick_runs_every_stage_and_writes_the_report(tmp_path):
    """scripts/study.sh --quick: base -> refusion/ar/mdm fine-tunes -> every decoder -> report (untrained)."""
    env = {**os.environ, "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out"), "N": "2",
           "REFUSION": f"{sys.executable} -m refusion.cli"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "study.sh"), "--quick"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for stage in ("base", "refusion", "ar", "mdm"):
        cfg = json.loads((tmp_path / "runs" / stage / "model" / "config.json").read_text())
        assert cfg["training_objective"] == ("ar" if stage == "base" else stage)
        assert (tmp_path / "out" / "logs" / f"{stage}.metrics.jsonl").is_file()
    # every fine-tune starts from the base: same tokenizer, and the mask token only where the objective needs it
    base_tok = (tmp_path / "runs" / "base" / "model" / "tokenizer.json").read_text()
    assert all((tmp_path / "runs" / s / "model" / "tokenizer.json").read_text() == base_tok for s in ("ar", "mdm"))
    assert "mask_token_id" not in json.loads((tmp_path / "runs" / "ar" / "model" / "config.json").read_text())
    report = (tmp_path / "out" / "report.md").read_text()
    for row in ("| base | ar |", "| ar | ar |", "| refusion | speculative |", "| refusion | ar |",
                "| refusion | refusion |", "| refusion | refusion-fast |", "| mdm | mdm |", "| mdm | mdm-threshold |"):
        assert row in report, row
    assert (tmp_path / "out" / "accuracy_vs_tps.png").stat().st_size > 1000
