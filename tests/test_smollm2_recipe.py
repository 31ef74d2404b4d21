"""scripts/smollm2_refusion.sh --quick: every stage of the SmolLM2 recipe (import, self-generate, mask-only
training, the masks' sampler, export, benchmark), on a tiny llama GGUF of SmolLM2's format here (nothing downloaded), on
SmolLM2 itself with -m slow; the same command again redoes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.decoding.corpus import read_corpus
from refusion.model.checkpoint import LOOKUP_CORPUS
from refusion.model.mask_sampler import MASK_SAMPLER

from tests.helpers.tiny_gguf import write_byte_level_gguf

ROOT = Path(__file__).parents[1]
QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether?",
             "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting. "
             "How much did she earn?",
             "Betty is saving money for a new wallet which costs $100. She has half of it. "
             "How much more does she need?"]


def recipe_env(tmp: Path, **extra) -> dict:
    """Small GSM8K-format train and test files and HumanEval-format prompts, written here (the real ones are
    downloads), and every output under tmp."""
    (tmp / "train.jsonl").write_text("\n".join(json.dumps({"question": q, "answer": "#### 1"}) for q in QUESTIONS))
    (tmp / "test.jsonl").write_text("\n".join(json.dumps({"question": q.replace("clips", "pens"), "answer": "#### 72"})
                                              for q in QUESTIONS))
    (tmp / "he.jsonl").write_text("\n".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt":
                                                        f'def add{i}(a, b):\n    """Add a and b."""\n'})
                                            for i in range(3)))
    return {**os.environ, "RUNS": str(tmp / "runs"), "OUT": str(tmp / "out"), "REFUSION_CACHE": str(tmp / "cache"),
            "GSM8K_TRAIN": str(tmp / "train.jsonl"), "GSM8K_TEST": str(tmp / "test.jsonl"),
            "HUMANEVAL": str(tmp / "he.jsonl"), "REFUSION": f"{sys.executable} -m refusion.cli",
            "PYTHON": sys.executable, **extra}


def recipe(env: dict) -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "smollm2_refusion.sh"), "--quick"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def check_quick_run(tmp: Path, base: Path, env: dict) -> None:
    runs, out = tmp / "runs", tmp / "out"
    recs = [json.loads(x) for x in (runs / "data.jsonl").read_text().splitlines()]
    assert sorted(r["source"] for r in recs) == ["gsm8k", "gsm8k", "stdlib-functions", "stdlib-functions"]
    # checkpoints and the export hold the mask path alone, naming its base
    for d in (runs / "train" / "checkpoint-2", runs / "train" / "checkpoint-4"):
        assert {p.name for p in d.iterdir()} == {"mask_adapter.json", "mask_adapter.safetensors", "training_state.pt"}
    asset = runs / "asset" / "smollm2-refusion"
    meta = json.loads((asset / "mask_adapter.json").read_text())
    assert meta["base"] == str(base) and meta["rank"] == 16
    # the export keeps the data's answers beside the adapter, one per record, as lookup drafts
    assert int((read_corpus(asset / LOOKUP_CORPUS).tokens == -1).sum()) == len(recs)
    assert (asset / "mask_adapter.safetensors").read_bytes() == (runs / "train" / "adapter" /
                                                                 "mask_adapter.safetensors").read_bytes()
    # and the masks' sampler, trained on the same data, with its record
    assert (asset / MASK_SAMPLER).read_bytes() == (runs / "train" / "adapter" / MASK_SAMPLER).read_bytes()
    record = json.loads((out / "logs" / "sampler.json").read_text())
    assert record["config"]["steps"] == 4 and [c["step"] for c in record["checks"]] in ([2, 4], [])
    bench = json.loads((out / "smollm2_speculative.json").read_text())
    rows = {(s["name"], s["bench"], s["batch_size"]) for s in bench["summary"]}
    for name in ("base ar", "speculative", "refusion s8 0.9/0.4", "hf greedy"):
        assert {(name, b, bs) for b in ("gsm8k", "humaneval") for bs in (1, 2)} <= rows
    assert {("hf prompt-lookup", b, 1) for b in ("gsm8k", "humaneval")} <= rows
    # the guarantee: speculative decoding of the adapted model is the base's greedy output, every time
    assert all(s["identical"] == s["n"] == 2 for s in bench["summary"] if s["name"] == "speculative")
    assert bench["costs"]["extra_parameters"] > 0 and bench["costs"]["peak_rss_bytes"]["speculative"] > 0
    # the same command again: every stage finds its work done
    data, adapter = (runs / "data.jsonl").read_bytes(), (asset / "mask_adapter.safetensors").read_bytes()
    stdout = recipe(env)
    assert "already trained" in stdout and "sampler already trained" in stdout and "0 responses written" in stdout
    assert (runs / "data.jsonl").read_bytes() == data and (asset / "mask_adapter.safetensors").read_bytes() == adapter
    again = json.loads((out / "smollm2_speculative.json").read_text())
    assert again["rows"] == bench["rows"] and again["costs"] == bench["costs"]  # the costs kept, not measured again


@pytest.mark.long
def test_quick_recipe_on_a_tiny_gguf(tmp_path):
    write_byte_level_gguf(tmp_path / "tiny.gguf")
    env = recipe_env(tmp_path, GGUF=str(tmp_path / "tiny.gguf"))
    recipe(env)
    check_quick_run(tmp_path, tmp_path / "runs" / "base", env)


@pytest.mark.slow
def test_quick_recipe_on_smollm2(tmp_path):
    env = recipe_env(tmp_path)
    recipe(env)
    check_quick_run(tmp_path, Path("smollm2"), env)
