"""The general-text corpus (standard library source) and the study script's smoke mode (scripts/study.sh --quick)."""

import gzip
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from refusion.model.config import ConfigError
from refusion.training.corpus import corpus_records, stdlib_files, stdlib_records
from refusion.training.data import training_records
from refusion.training.trainer import TrainConfig

from tests.helpers.forked_cli import ForkServer

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


# the stages the quick study runs here: all of them
QUICK_STAGES = ["base", "ar", "refusion", "mdm", "refusion-boundary", "refusion-ar-share-25", "refusion-joint",
                "refusion-hybrid", "refusion-decoupled", "refusion-joint-hybrid", "refusion-hybrid-8k", "report"]


@pytest.fixture
def refusion_command():
    """`python -m refusion.cli` for a script of many short commands: each command a fork of one
    interpreter that has imported torch and refusion once (tests/helpers/forked_cli.py), with the script's
    thread settings."""
    with ForkServer({**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}) as server:
        yield server.command


@pytest.mark.long
def test_study_quick_runs_every_stage_and_writes_the_curves(tmp_path, refusion_command):
    """scripts/study.sh --quick: base -> ar/refusion/mdm fine-tunes, each one run with a checkpoint at
    every curve point (steps 4 and 8) -> every decoder on every checkpoint -> report (untrained)."""
    env = {**os.environ, "RUNS": str(tmp_path / "runs"), "OUT": str(tmp_path / "out"), "N": "2",
           "REFUSION": refusion_command}

    def study(*stages):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "study.sh"), "--quick", *stages], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    study(*QUICK_STAGES)
    runs, out = tmp_path / "runs", tmp_path / "out"
    for stage in ("base", "refusion", "ar", "mdm"):
        cfg = json.loads((runs / stage / "model" / "config.json").read_text())
        assert cfg["training_objective"] == ("ar" if stage == "base" else stage)
        metrics = gzip.decompress((out / "logs" / f"{stage}.metrics.jsonl.gz").read_bytes()).splitlines()
        assert [json.loads(line)["step"] for line in metrics] == list(range(1, 9))  # a line per step, kept whole
    for stage in ("refusion", "ar", "mdm"):  # every curve point kept, and the final model is the last one
        assert sorted(p.name for p in (runs / stage).glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
        assert json.loads((runs / stage / "train_config.json").read_text())["max_steps"] == 8
        assert ((runs / stage / "model" / "model.safetensors").read_bytes()
                == (runs / stage / "checkpoint-8" / "model.safetensors").read_bytes())
    # every fine-tune starts from the base: same tokenizer, and the mask token only where the objective needs it
    base_tok = (runs / "base" / "model" / "tokenizer.json").read_text()
    assert all((runs / s / "model" / "tokenizer.json").read_text() == base_tok for s in ("ar", "mdm"))
    paper_cfg = json.loads((runs / "refusion" / "model" / "config.json").read_text())
    assert not paper_cfg.get("causal_first_token", False)  # the paper's objective drafts the first token
    ar_cfg = json.loads((runs / "ar" / "model" / "config.json").read_text())
    assert "mask_token_id" in ar_cfg and ar_cfg["causal_first_token"]  # the ReFusion vocabulary, never a mask fed
    for v in ("boundary", "ar-share-25", "joint", "hybrid", "decoupled", "joint-hybrid"):
        cfg = json.loads((runs / f"refusion-{v}" / "model" / "config.json").read_text())
        assert cfg["causal_first_token"] and ("mask_adapter" in cfg) == (v == "decoupled")
        assert sorted(p.name for p in (runs / f"refusion-{v}").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
        assert all((out / f"refusion-{v}@{s}__{t}__speculative.json").is_file() for s in (4, 8) for t in ("sort", "code"))
    # the bundled model's stage trains the bundled recipe itself (its budget shrunk), from the study's base
    recipe = tomllib.loads((ROOT / "src/refusion/assets/refusion-tiny/recipe.toml").read_text())
    bundled_run = json.loads((runs / "refusion-hybrid-8k" / "train_config.json").read_text())
    assert bundled_run["init"] == str(runs / "base" / "model") and bundled_run["max_steps"] == 8
    assert all(bundled_run[k] == v for k, v in recipe.items()
               if k not in ("init", "max_steps", "save_every", "out_dir", "synthetic_examples", "warmup_steps"))
    assert sorted(p.name for p in (runs / "refusion-hybrid-8k").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    # the decoupled variant's shared weights are the ARM's, to the bit; its mask path is its own
    from safetensors.torch import load_file
    arm = load_file(runs / "ar" / "model" / "model.safetensors")
    dec = load_file(runs / "refusion-decoupled" / "model" / "model.safetensors")
    assert all(torch.equal(arm[k], dec[k]) for k in arm) and any("mask_adapter" in k for k in dec)
    report = (out / "report.md").read_text()
    assert "| base | ar |" in report
    for model, decoders in (("ar", ["ar"]),
                            ("refusion", ["ar", "refusion", "refusion-checked", "refusion-fast", "speculative"]),
                            ("mdm", ["mdm", "mdm-threshold"])):
        table = report[report.index(f"### {model}\n"):].split("\n\n")[1].splitlines()[2:]
        assert [row.split(" | ")[:2] for row in table] == [[f"| {d}", str(s)] for d in decoders for s in (4, 8)]
        assert json.loads((out / f"{model}@4__sort__{decoders[0]}.json").read_text())["model_path"] == str(
            runs / model / "checkpoint-4")
    for plot in ("accuracy_vs_steps.png", "accuracy_vs_tps.png"):
        assert (out / plot).stat().st_size > 1000
    # cut off: ar lost its final model, its last checkpoint and one summary; the same command resumes
    # the run from checkpoint-4 (to the same weights) and evaluates only what is missing
    weights = (runs / "ar" / "checkpoint-8" / "model.safetensors").read_bytes()
    shutil.rmtree(runs / "ar" / "model")
    shutil.rmtree(runs / "ar" / "checkpoint-8")
    (out / "ar@8__add__ar.json").unlink()
    log = study(*QUICK_STAGES)
    assert "study: training ar" in log and "study: training refusion" not in log
    assert (runs / "ar" / "checkpoint-8" / "model.safetensors").read_bytes() == weights
    evaluated = [line.split(":")[0] for line in log.splitlines() if not line.startswith("study:")]
    assert evaluated == ["ar@8 add ar"]
