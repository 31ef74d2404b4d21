"""Sharded training (--strategy fsdp, FSDP2 over gloo, 2 processes): equal to one process, exact
resume after kill -9, sharded checkpoints exported as Hugging Face directories (unit by unit, into
shards), LoRA, bf16, CPU offload and activation checkpointing (neither changes a loss). Starting
from a Hugging Face directory without a whole model anywhere: test_fsdp_meta.py.

Tolerance: FSDP sums the two processes' gradients in another order than one process does (a
reduce-scatter per micro-batch), so float32 results differ by rounding: losses and gradient norms
within rel 1e-5, weights after 12 steps within 1e-5 absolute (seen: under 1e-7 relative, 3e-7). A
resumed FSDP run equals the uninterrupted FSDP run exactly.

Every 2-process training here but the one killed runs in one torchrun launch (`runs`), and the
one-process references run in this process: each launch of its own would start Python, torch and
the process group again, which takes far longer than the few steps each run takes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import transformers

import refusion.training.sharded_checkpoint as sharded_checkpoint
from refusion.cli import main
from refusion.model.checkpoint import INDEX, CheckpointError, load_model, save_model, weight_files
from refusion.model.config import ModelConfig
from refusion.decoding import decode, default_decoder
from refusion.model.transformer import Transformer
from refusion.training.sharded_checkpoint import export_checkpoint
from refusion.model.tokenizer import Tokenizer
from refusion.training.setup import setup
from tests.training.test_train import TINY, _tokenizer_without_mask, data_file, losses, tiny_config  # noqa: F401 (data_file: a fixture)
from tests.helpers.train_helpers import torchrun_train, train_here

STEPS = 12
# micro-batches of 2 (accumulation), activation checkpointing and a clip that bites at every step:
# everything the sharded path does differently is in play
COMMON = ["--set=vocab_size=300", f"--set=model={json.dumps(TINY)}", "--set=batch_size=8", "--set=micro_batch_size=2",
          "--set=max_steps=1000", "--set=warmup_steps=3", "--set=save_every=4", "--set=grad_clip=0.5",
          "--set=gradient_checkpointing=true", "--no-progress"]
LORA = '--set=lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}'


def _fsdp(data_file: Path, out: Path, *extra: str) -> list[str]:
    """The arguments of `refusion train` for COMMON's run under FSDP, into `out`."""
    return [f"--data={data_file}", *COMMON, "--strategy=fsdp", f"--out={out}", *extra]


def _lora(data_file: Path, base: Path, out: Path, *extra: str) -> list[str]:
    """The arguments of `refusion train` for 4 steps of LoRA on `base`, into `out`."""
    return [f"--init={base}", f"--data={data_file}", "--set=batch_size=8", "--set=max_steps=4", "--set=warmup_steps=1",
            "--set=save_every=2", "--no-progress", LORA, f"--out={out}", *extra]


@pytest.fixture(scope="module")
def lora_base(data_file, tmp_path_factory) -> Path:
    """A causal model whose tokenizer has no mask token (LoRA's run adds it)."""
    tok = _tokenizer_without_mask(data_file)
    n = max(tok.tok.get_vocab().values()) + 1
    base = Transformer(ModelConfig(vocab_size=n, eos_token_id=tok.eos_id, model_type="llama", qk_norm=False,
                                   **TINY)).init_weights(seed=1)
    return save_model(base, tmp_path_factory.mktemp("lora") / "base", tok)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (torchrun starts each worker in a session of its own)."""
    victims = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(victims, timeout=10)


@pytest.fixture(scope="module")
def killed(data_file, tmp_path_factory) -> tuple[Path, list[int]]:
    """COMMON's run on 2 processes, killed with SIGKILL after its sixth step: its directory (which
    `runs` resumes) and the steps of the checkpoints it left."""
    run = tmp_path_factory.mktemp("killed") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "refusion.cli",
           "train", *_fsdp(data_file, run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 6):
        time.sleep(0.002)
    _kill_tree(proc)
    return run, sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))


@pytest.fixture(scope="module")
def runs(data_file, lora_base, killed, tmp_path_factory) -> dict[str, Path]:
    """The run directories of every 2-process training of this file, trained in one torchrun launch:
    fsdp: COMMON's run, 12 steps (of a 1000-step schedule), checkpoints every 4;
    cpu_offload, no_checkpointing, bfloat16: its first 6 steps with one setting changed;
    lora: 4 steps of LoRA on lora_base;
    resumed: the killed run, resumed up to step 12."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {name: root / name for name in ("fsdp", "cpu_offload", "no_checkpointing", "bfloat16", "lora")}
    out["resumed"] = killed[0]
    torchrun_train(2, {
        "fsdp": _fsdp(data_file, out["fsdp"], f"--set=stop_after={STEPS}"),
        "cpu_offload": _fsdp(data_file, out["cpu_offload"], "--set=stop_after=6", "--set=cpu_offload=true"),
        "no_checkpointing": _fsdp(data_file, out["no_checkpointing"], "--set=stop_after=6",
                                  "--set=gradient_checkpointing=false"),
        "bfloat16": _fsdp(data_file, out["bfloat16"], "--set=stop_after=6", '--set=dtype="bfloat16"'),
        "lora": _lora(data_file, lora_base, out["lora"], "--strategy=fsdp"),
        "resumed": _fsdp(data_file, out["resumed"], f"--set=stop_after={STEPS}"),
    }, root / "log.json")
    return out


def test_fsdp_matches_one_process_and_exports_a_model(runs, data_file, tmp_path):
    one = tmp_path / "one"
    train_here(f"--data={data_file}", *COMMON, f"--out={one}", f"--set=stop_after={STEPS}")
    la, lb = losses(one), losses(runs["fsdp"])
    assert len(la) == len(lb) == STEPS
    for a, b in zip(la, lb, strict=True):
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and a["grad_norm"] > 0.5  # clipped
    # the sharded checkpoint, consolidated, holds one process's weights
    ckpt = runs["fsdp"] / f"checkpoint-{STEPS}"
    assert {p.name for p in ckpt.iterdir()} >= {"dcp", "rng-0.pt", "rng-1.pt", "training_state.pt", "config.json",
                                              "tokenizer.json"}
    with pytest.raises(CheckpointError, match="sharded training checkpoint.*refusion export"):
        load_model(ckpt)
    assert main(["export", str(ckpt), str(tmp_path / "export")]) == 0
    ref, got = load_model(one / f"checkpoint-{STEPS}"), load_model(tmp_path / "export")
    assert got.config.tie_word_embeddings and got.lm_head.weight is got.embed_tokens.weight  # still one parameter
    for (k, x), y in zip(ref.state_dict().items(), got.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0, msg=k)
    # it decodes as the one-process model does, and transformers reads it
    tok = Tokenizer.from_dir(tmp_path / "export")
    prompt = tok.chat_prompt_ids("What is 3 plus 4?")
    dec = default_decoder(got.config)
    assert [r.tokens for r in decode(got, [prompt], dec, gen_length=16)] == \
        [r.tokens for r in decode(ref, [prompt], dec, gen_length=16)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, got(x, torch.arange(x.shape[1])[None]), atol=1e-5, rtol=0)


def test_export_reads_one_unit_at_a_time_and_writes_shards(runs, tmp_path, monkeypatch):
    ckpt = runs["fsdp"] / f"checkpoint-{STEPS}"
    whole = load_model(export_checkpoint(ckpt, tmp_path / "whole"))
    loads = []
    real = sharded_checkpoint.dcp.load

    def recording(state, **kwargs):
        loads.append({k.split(".")[1] if k.startswith("layers.") else "root" for k in state["model"]})
        return real(state, **kwargs)

    monkeypatch.setattr(sharded_checkpoint.dcp, "load", recording)
    out = export_checkpoint(ckpt, tmp_path / "sharded", max_shard_bytes=60_000)
    assert loads == [{"root"}, {"0"}, {"1"}]  # the root unit's tensors, then each block's: never the model
    assert (out / INDEX).exists() and len(weight_files(out)) >= 3
    got = load_model(out)
    assert all(torch.equal(x, y) for x, y in zip(whole.state_dict().values(), got.state_dict().values(), strict=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, got(x, torch.arange(4)[None]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", ["cpu_offload", "no_checkpointing"])
def test_fsdp_cpu_offload_and_activation_checkpointing_change_no_loss(change, runs):
    """runs["fsdp"] checkpoints activations and keeps its shards where it computes; offloading them
    to the host (a copy on a CPU-only process, yet all of FSDP's offload path) or recomputing nothing
    gives the same numbers to the bit."""
    assert losses(runs[change]) == losses(runs["fsdp"])[:6]


def test_fsdp_resume_after_kill_equals_the_uninterrupted_run(killed, runs, tmp_path):
    ckpts = killed[1]
    assert ckpts and ckpts[-1] < STEPS, f"the run was not killed in time (checkpoints {ckpts})"
    assert losses(runs["resumed"]) == losses(runs["fsdp"])  # every logged number, exactly
    a, b = (load_model(export_checkpoint(runs[name] / f"checkpoint-{STEPS}", tmp_path / name))
            for name in ("resumed", "fsdp"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_fsdp_needs_torchrun_and_strategies_do_not_mix(runs, data_file, tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match=r"strategy fsdp .* torchrun --nproc-per-node N .*\(N = 1 works too\)"):
        setup(tiny_config(data_file, tmp_path / "x", strategy="fsdp"))
    assert not (tmp_path / "x").exists()
    cfg = tiny_config(data_file, runs["fsdp"], model={}, vocab_size=300)
    with pytest.raises(ValueError, match=f"checkpoint-{STEPS} was written with strategy fsdp: resume it with "
                                         "--strategy fsdp"):
        setup(cfg)


def test_fsdp_bfloat16_keeps_float32_master_weights(runs):
    bf, f32 = losses(runs["bfloat16"]), losses(runs["fsdp"])[:6]
    # bf16 compute: close to the float32 run, yet not equal to it
    assert all(a["loss"] == pytest.approx(b["loss"], rel=3e-2) for a, b in zip(bf, f32, strict=True))
    assert any(a["loss"] != b["loss"] for a, b in zip(bf, f32, strict=True))
    # the shards (weights and Adam moments) stay float32
    meta = torch.distributed.checkpoint.FileSystemReader(str(runs["bfloat16"] / "checkpoint-6" / "dcp")).read_metadata()
    dtypes = {md.properties.dtype for md in meta.state_dict_metadata.values() if hasattr(md, "properties")}
    assert dtypes == {torch.float32}


def test_fsdp_lora_matches_one_process(runs, lora_base, data_file, tmp_path):
    train_here(*_lora(data_file, lora_base, tmp_path / "one"))
    for a, b in zip(losses(tmp_path / "one"), losses(runs["lora"]), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    base = load_model(lora_base)
    n = base.config.vocab_size
    ref, got = load_model(tmp_path / "one" / "model"), load_model(runs["lora"] / "model")
    assert got.config.mask_token_id == n
    for (k, x), y in zip(ref.state_dict().items(), got.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0, msg=k)
    # the mask's new row learned, the base vocabulary's did not move (merged weights, plain names)
    assert not torch.equal(got.embed_tokens.weight[n], ref.embed_tokens.weight[:n].mean(0))
    assert torch.equal(got.embed_tokens.weight[:n], base.embed_tokens.weight)
    assert torch.equal(got.layers[0].mlp.gate_up_proj.weight, base.layers[0].mlp.gate_up_proj.weight)
