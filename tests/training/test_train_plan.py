"""`refusion train --plan`: parameter counts against a real (meta-device) model, how the memory
per process scales with processes, checkpointing and micro-batch, and the command's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion.cli import main
from refusion.model.config import ConfigError, ModelConfig
from refusion.model.transformer import Transformer
from refusion.training.config import load_train_config
from refusion.training.optimizer import make_optimizer
from refusion.training.plan import (budget, decayed_parameters, largest_micro_batch, make_plan, memory, parse_memory,
                                    read_model_config)

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "configs" / "qwen3-8b"
PAPER = ROOT / "configs" / "paper-qwen3-8b.toml"


def tiny(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=24, tie_word_embeddings=tied, qkv_bias=not tied)


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_equal_a_real_model(tied):
    mc = tiny(tied)
    with torch.device("meta"):
        model = Transformer(mc)
    p = make_plan(load_train_config(None, []), mc, 1, 1, None)["model"]
    assert p["parameters"] == sum(t.numel() for t in model.parameters())  # a tied head counted once
    assert p["per_block"] == sum(t.numel() for t in model.layers[0].parameters())
    assert p["embeddings_and_head"] + mc.num_layers * p["per_block"] == p["parameters"]
    # AdamW's step temporaries are sized by its larger parameter group
    decay, no_decay = make_optimizer(model, load_train_config(None, [])).param_groups
    assert decayed_parameters(mc) == sum(t.numel() for t in decay["params"]) > 0
    assert p["parameters"] - decayed_parameters(mc) == sum(t.numel() for t in no_decay["params"]) > 0


def test_the_shipped_qwen3_8b_config_is_qwen3_8b():
    cfg = load_train_config(PAPER, ["init=\"configs/qwen3-8b\""], check_files=False)
    mc, source = read_model_config(str(QWEN3_8B), cfg)
    p = make_plan(cfg, mc, 8, 1, None, source)
    assert p["model"]["parameters"] == 8_190_735_360  # Qwen3-8B's published 8.2B, embeddings and head untied
    assert (p["row_length"], p["tokens_per_step_max"], p["micro_batch_size"], p["accumulation_steps"]) == \
        (4096, 64 * 4096, 2, 4)


def test_weights_and_optimizer_fall_as_one_over_n_under_fsdp_only():
    cfg, mc = load_train_config(None, []), tiny(False)
    P = make_plan(cfg, mc, 1, 1, None)["model"]["parameters"]

    def states(strategy, n):
        m = memory(mc, cfg, strategy, n, 1, False, False)
        return m["weights"] + m["optimizer"]

    buffers = states("fsdp", 1) - 12 * P  # the RoPE table, on every process
    for n in (1, 2, 4, 8):
        assert states("fsdp", n) - buffers == 12 * P // n
    assert states("ddp", 2) == states("ddp", 4) == states("ddp", 8) == states("fsdp", 1)
    # and the plan's table: per node 8 x 1 vs 4 nodes of 8
    one, four = (make_plan(cfg, mc, 8, k, None)["settings"] for k in (1, 4))
    fsdp = [(a, b) for a, b in zip(one, four, strict=True) if a["strategy"] == "fsdp" and not a["offload"]]
    assert fsdp and all(a["optimizer"] == 4 * b["optimizer"] for a, b in fsdp)
    ddp = [(a, b) for a, b in zip(one, four, strict=True) if a["strategy"] == "ddp"]
    assert all(a["optimizer"] == b["optimizer"] and a["weights"] == b["weights"] for a, b in ddp)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpointing_reduces_activations_which_grow_with_the_micro_batch(strategy):
    cfg = load_train_config(None, ["max_length=1024", "dtype=\"bfloat16\""])
    mc = tiny(False)
    plain, ckpt = (memory(mc, cfg, strategy, 2, 1, c, False)["activations"] for c in (False, True))
    assert ckpt < plain
    one, two = (memory(mc, cfg, strategy, 2, m, False, False)["activations"] for m in (1, 2))
    assert two == 2 * one


def test_offload_moves_the_sharded_states_to_the_host():
    cfg, mc = load_train_config(None, []), tiny(False)
    on, off = (memory(mc, cfg, "fsdp", 4, 1, False, o) for o in (True, False))
    assert on["peak"] < off["peak"] and off["host"] == 0 < on["host"]
    assert on["activations"] == off["activations"]


@pytest.mark.parametrize("offload", [False, True])
def test_the_configured_setting_is_cpu_offload_as_set(offload):
    cfg = load_train_config(None, ['strategy="fsdp"', f"cpu_offload={json.dumps(offload)}"])
    conf = [s for s in make_plan(cfg, tiny(False), 2, 1, None)["settings"] if s["configured"]]
    assert [(s["strategy"], s["checkpointing"], s["offload"]) for s in conf] == [("fsdp", False, offload)]


def test_loading_under_fsdp_from_a_model_holds_its_embedding_not_the_model():
    mc = tiny(False)
    ddp, fsdp, fresh = (make_plan(load_train_config(None, overrides, check_files=False), mc, 8, 1, None)
                        for overrides in (['init="x"'], ['init="x"', 'strategy="fsdp"'], ['strategy="fsdp"']))
    P = ddp["model"]["parameters"]
    assert ddp["host_at_load_per_node"] == fresh["host_at_load_per_node"] == 8 * 4 * P
    assert fsdp["sharded_load"] and fsdp["host_at_load_per_node"] == mc.vocab_size * mc.hidden_size * 4


def test_largest_micro_batch_is_the_edge_of_the_budget():
    cfg = load_train_config(PAPER, ["init=\"configs/qwen3-8b\""], check_files=False)
    mc, _ = read_model_config(str(QWEN3_8B), cfg)
    gb80 = parse_memory("80GB")
    m = largest_micro_batch(mc, cfg, "fsdp", 8, True, False, gb80, 1000)
    assert m >= 1
    assert memory(mc, cfg, "fsdp", 8, m, True, False)["peak"] <= budget(gb80)
    assert memory(mc, cfg, "fsdp", 8, m + 1, True, False)["peak"] > budget(gb80)


def test_parse_memory():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("81559MiB") == 81559 * 2**20
    assert parse_memory("1.5 TB") == 1_500_000_000_000
    assert parse_memory("4096") == 4096
    for bad in ("80 gigs", "GB", "-5GB", "0GB", ""):
        with pytest.raises(ConfigError):
            parse_memory(bad)


def test_steps_per_epoch_from_a_local_data_file(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"query": "q", "response": f"r{i}"}) + "\n" for i in range(10)) + "\n")
    cfg = load_train_config(None, [f"data={json.dumps(str(data))}", "batch_size=4", "max_steps=5"])
    p = make_plan(cfg, tiny(True), 1, 1, None)
    assert (p["records"], p["steps_per_epoch"], p["epochs"]) == (10, 2, 2.5)


@pytest.fixture
def cli(capsys, monkeypatch):
    """`refusion train ARGS` in this process, from the repository's root and outside torchrun (whose
    environment the plan reads): its exit status, stdout and stderr."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = main(["train", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out.out, out.err)

    return run


def test_cli_prints_the_verdict_and_json_and_exits_0(cli):
    base = ["--config", str(PAPER), "--init", str(QWEN3_8B), "--plan", "--nproc", "8"]
    fits = cli(*base, "--device-memory", "80GB")
    assert fits.returncode == 0, fits.stderr
    assert "\nFITS: peak" in fits.stdout and "8,190,735,360 parameters" in fits.stdout
    small = cli(*base, "--device-memory", "16GB", "--json")
    assert small.returncode == 0, small.stderr
    p = json.loads(small.stdout)
    conf = [s for s in p["settings"] if s["configured"]]
    assert len(conf) == 1 and (conf[0]["strategy"], conf[0]["checkpointing"]) == ("fsdp", True)
    assert conf[0]["fits"] is False and conf[0]["largest_micro_batch"] == 0
    assert p["processes"] == {"per_node": 8, "nodes": 1, "total": 8}
    tiny_gpu = cli(*base, "--device-memory", "16GB")
    assert tiny_gpu.returncode == 0 and "\nDOES NOT FIT: peak" in tiny_gpu.stdout


@pytest.mark.parametrize("args, message", [
    (["--init", "{empty}", "--device-memory", "80GB"], "init {empty} has no config.json (the plan reads only that file)"),
    (["--init", "{qwen}", "--device-memory", "80 gigs"], "device memory '80 gigs': write a size such as 80GB, 80GiB or 81559MiB"),
])
def test_cli_bad_inputs_are_one_line_errors(cli, tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    fill = {"empty": str(empty), "qwen": str(QWEN3_8B)}
    r = cli("--config", str(PAPER), "--plan", *[a.format(**fill) for a in args])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"refusion: error: {message.format(**fill)}"]


def test_plan_flags_need_plan(cli):
    r = cli("--device-memory", "80GB")
    assert r.returncode == 2 and r.stderr.strip() == "refusion: error: --device-memory goes with --plan"


def test_the_plan_bounds_a_measured_fsdp_step(tmp_path):
    """benchmarks/train_memory.py on 2 gloo processes at a tiny shape: each process's shards of the
    weights, gradients and AdamW moments are exactly the plan's 1/N of 4, 4 and 8 bytes per parameter,
    and the traced tensor peak of a step stays under the plan's peak (the plan adds up transients that
    never all live at once: at this shape the logits, freed before the backward's peak, weigh most)."""
    out = tmp_path / "memory.json"
    args = ["--procs=2", "--hidden=128", "--layers=2", "--intermediate=384", "--vocab=2048", "--steps=2", "--threads=1"]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_memory.py"), *args, f"--out={out}"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    P, (setting,) = result["parameters"], result["settings"]
    assert P == result["plan_parameters"]
    plan = setting["plan"]
    assert plan["optimizer"] == P * 8 // 2
    for rec in setting["per_process"]:
        assert rec["weights"] == rec["gradients"] == P * 4 // 2  # (these shapes split evenly: no padding)
        assert P * 8 // 2 <= rec["optimizer"] <= P * 8 // 2 + 4 * 64  # + AdamW's step counts, 4 bytes a tensor
        assert 0.5 * plan["peak"] < rec["tensor_peak"] <= plan["peak"]
