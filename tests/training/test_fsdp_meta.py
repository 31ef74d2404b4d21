"""FSDP runs that start from a Hugging Face directory build no whole model (training/fsdp.py): each of
2 gloo processes reads only its own rows of the safetensors files, and the sharded model they build
is, gathered, exactly the model one process builds the whole way (load_model, add_mask_token,
seeded LoRA), which is what every FSDP process built before sharding until now. One torchrun
launch sets up every case and trains one run (tests/helpers/fsdp_meta_worker.py), with load_model and
load_state_dict made to fail in the workers.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from refusion.model.checkpoint import INDEX, load_config, load_model, save_model, weight_files
from refusion.model.config import ConfigError, ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.training.config import TrainConfig
from refusion.training.setup import setup
from tests.training.test_train import data_file, losses  # noqa: F401 (data_file: a fixture)
from tests.helpers.tiny_causal_lm import SHAPE, addition_records, make_causal_lm, tokenizer_without_mask
from tests.helpers.train_helpers import train_here

WORKER = Path(__file__).parents[1] / "helpers" / "fsdp_meta_worker.py"
# adapters on parts of both fused projections (k of q/k/v, up of gate/up) and on a plain one
LORA = {"r": 4, "alpha": 8, "target_modules": ["k_proj", "up_proj", "o_proj"]}
CASES = {  # name: (model directory, training options, resume from a checkpoint of the first setup)
    "tied-lora": ("tied", {"lora": LORA}, True),
    "untied": ("untied", {}, False),
    "untied-lora": ("untied", {"lora": LORA}, False),
    "untied-offload": ("untied", {"cpu_offload": True}, False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """tied: SmolLM2's layout (Llama, tied embeddings, no mask token: the vocabulary grows by one
    row), stored as bfloat16 in several shards with an index. untied: Qwen3's layout with q/k norms
    and attention biases, float32 in one file, its vocabulary padded past the tokenizer (the mask
    takes an existing, untrained row)."""
    root = tmp_path_factory.mktemp("models")
    causal = make_causal_lm(root / "causal")
    save_model(load_model(causal), root / "tied", Tokenizer.from_dir(causal), dtype=torch.bfloat16,
               max_shard_bytes=40_000)
    tok = tokenizer_without_mask([r["query"] + r["response"] for r in addition_records()])
    cfg = ModelConfig(vocab_size=len(tok) + 6, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, qkv_bias=True,
                      o_bias=True, tie_word_embeddings=False, max_position_embeddings=1024, **SHAPE)
    save_model(Transformer(cfg).init_weights(seed=2), root / "untied", tok)
    return root


def _fields(data_file: Path, init: Path, out: Path, options: dict, strategy: str) -> dict:
    return dict(init=str(init), data=str(data_file), out_dir=str(out), batch_size=8, max_steps=4, warmup_steps=1,
                strategy=strategy, **options)


def _train_args(models: Path, data_file: Path, out: Path) -> list[str]:
    """The arguments of `refusion train` for 4 steps from the tied model, saving every 2, into `out`."""
    return [f"--init={models / 'tied'}", f"--data={data_file}", "--set=batch_size=8", "--set=max_steps=4",
            "--set=warmup_steps=1", "--set=save_every=2", "--no-progress", f"--out={out}"]


@pytest.fixture(scope="module")
def sharded(models, data_file, tmp_path_factory) -> Path:
    """The worker's OUT: every case set up, and OUT/trained: _train_args' run on 2 FSDP processes."""
    out = tmp_path_factory.mktemp("sharded")
    cases = {name: [_fields(data_file, models / d, out / f"run-{name}", options, "fsdp"), resume]
             for name, (d, options, resume) in CASES.items()}
    train = [*_train_args(models, data_file, out / "trained"), "--strategy=fsdp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(out), json.dumps(cases), json.dumps(train)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[r.stderr.find("Traceback"):][:4000]
    return out


@pytest.mark.parametrize("name", CASES)
def test_sharded_setup_builds_the_model_one_process_builds(name, models, sharded, data_file, tmp_path):
    model_dir, options, _ = CASES[name]
    one = {k: v for k, v in options.items() if k != "cpu_offload"}  # (FSDP's alone)
    ref = setup(TrainConfig(**_fields(data_file, models / model_dir, tmp_path / "one", one, "ddp")))
    got = torch.load(sharded / f"{name}.pt", weights_only=False)
    want = dict(ref.model.named_parameters())
    assert list(got["params"]) == list(want)  # the same parameters (a tied head is the embedding's)
    for k, v in want.items():
        assert torch.equal(got["params"][k], v), k
    for k, v in ref.model.named_buffers():
        assert torch.equal(got["buffers"][k], v), k
    assert got["config"] == dataclasses.asdict(ref.model.config)
    assert got["new_tokens"] == ref.new_tokens == [ref.model.config.mask_token_id]
    assert got["offload"] == options.get("cpu_offload", False)


@pytest.mark.parametrize("name", CASES)
def test_each_process_reads_only_its_own_rows(name, models, sharded):
    """What each process read from the files, element for element: the rows of its slices (of
    every tensor the files hold, each row read by one process), and on rank 0 the embedding (and
    an untied LM head) once more, whole, for the mask token's mean row."""
    model_dir, _, _ = CASES[name]
    path = models / model_dir
    file_cfg = load_config(path)
    got = torch.load(sharded / f"{name}.pt", weights_only=False)["params"]
    in_files = 0
    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as h:
            in_files += sum(h.get_slice(k).get_shape()[0] * torch.Size(h.get_slice(k).get_shape()[1:]).numel()
                            for k in h.keys())
    tied = file_cfg.tie_word_embeddings
    # the mask's row starts at the mean of the file's rows (all of them; the text tokens' where padded)
    mean_of = file_cfg.vocab_size if tied else len(Tokenizer.from_dir(path))
    slices = 0
    for rank in (0, 1):
        info = json.loads((sharded / f"{name}-{rank}.json").read_text())
        expected = 0
        for k, (start, stop) in info["rows"].items():
            if "lora_" in k:  # adapters: made from the run's seed; token rows: the mean
                continue
            p = got[k]
            file_rows = file_cfg.vocab_size if k in ("embed_tokens.weight", "lm_head.weight") else p.shape[0]
            expected += (min(stop, file_rows) - min(start, file_rows)) * (p.numel() // p.shape[0])
        slices += expected
        if rank == 0:
            expected += mean_of * file_cfg.hidden_size * (1 if tied else 2)
        assert info["elements_read"] == expected, rank
    assert slices == in_files  # every element of the files read once, by one process
    assert (models / "tied" / INDEX).exists() and len(weight_files(models / "tied")) >= 3


def test_resumed_sharded_setup_reads_the_checkpoint_not_the_model(sharded):
    first, resumed = (torch.load(sharded / f"tied-lora{s}.pt", weights_only=False)["params"] for s in ("", "-resumed"))
    assert list(first) == list(resumed) and all(torch.equal(first[k], resumed[k]) for k in first)
    assert all(json.loads((sharded / f"tied-lora-resumed-{r}.json").read_text())["elements_read"] == 0 for r in (0, 1))


def test_fsdp_from_a_model_directory_trains_as_one_process(models, data_file, sharded, tmp_path):
    """Every parameter trained (the tied bf16 model, sharded files, a new mask row): the losses of one
    process, to FSDP's rounding (test_fsdp.py), and the exported model its weights."""
    train_here(*_train_args(models, data_file, tmp_path / "one"))
    for a, b in zip(losses(tmp_path / "one"), losses(sharded / "trained"), strict=True):
        assert a["tokens"] == b["tokens"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    ref, got = load_model(tmp_path / "one" / "model"), load_model(sharded / "trained" / "model")
    assert got.lm_head.weight is got.embed_tokens.weight
    for (k, x), y in zip(ref.state_dict().items(), got.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0, msg=k)


def test_cpu_offload_needs_fsdp(data_file, tmp_path):
    with pytest.raises(ConfigError, match="cpu_offload .* needs strategy fsdp"):
        TrainConfig(data=str(data_file), out_dir=str(tmp_path), cpu_offload=True).validate()
