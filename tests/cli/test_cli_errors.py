"""Every bad value a user can give ends in exactly one line `refusion: error: ...` naming it, exit
code 2, and no traceback: the table below runs each case through the command line.

Most cases run in this process through `refusion.cli.main` (a subprocess costs a second or two of
importing torch); a few run as real subprocesses, to see what a user's terminal sees: no traceback
on the way out, and nothing at all when the reader of a pipe goes away.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion.model.checkpoint import save_model
from refusion.cli import main
from refusion.model.config import ModelConfig
from refusion.training.data import train_bpe_tokenizer
from refusion.model.transformer import Transformer

README = str(Path(__file__).parents[2] / "README.md")
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Tiny models (256 positions) and every kind of broken file the table needs."""
    d = tmp_path_factory.mktemp("bad")
    tok = train_bpe_tokenizer(["hello world, the cat sat on the mat"] * 20, vocab_size=280)
    cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
               max_position_embeddings=256, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    save_model(Transformer(ModelConfig(mask_token_id=tok.mask_id, **cfg)).init_weights(seed=0), d / "m", tok)
    # a causal model without a mask token, its tokenizer without <|mask|> as a token of the model
    save_model(Transformer(ModelConfig(**cfg)).init_weights(seed=0), d / "causal", tok)
    nan = Transformer(ModelConfig(mask_token_id=tok.mask_id, **cfg)).init_weights(seed=0)
    with torch.no_grad():
        nan.layers[0].mlp.down_proj.weight[3, 5] = float("nan")
    save_model(nan, d / "nan", tok)
    shutil.copytree(d / "m", d / "badtok")
    (d / "badtok" / "tokenizer.json").write_text("this is not a tokenizer {")
    shutil.copytree(d / "m", d / "badindex")
    (d / "badindex" / "model.safetensors").unlink()
    (d / "badindex" / "model.safetensors.index.json").write_text('{"weight_map": ')
    shutil.copytree(d / "m", d / "badconfig")
    (d / "badconfig" / "config.json").write_text("{,}")
    shutil.copytree(d / "m", d / "strconfig")
    c = json.loads((d / "m" / "config.json").read_text())
    (d / "strconfig" / "config.json").write_text(json.dumps(dict(c, hidden_size="abc")))
    shutil.copytree(d / "m", d / "huge")
    (d / "huge" / "config.json").write_text(json.dumps(dict(c, hidden_size=10**12, intermediate_size=10**12)))
    shutil.copytree(d / "m", d / "badeos")
    (d / "badeos" / "config.json").write_text(json.dumps(dict(c, eos_token_id=-7)))
    (d / "full").mkdir()
    (d / "full" / "x").write_text("x")
    (d / "four.toml").write_text('batch_size = "four"\n')
    (d / "broken.toml").write_text("lr = = 3\n")
    (d / "broken.yaml").write_text("lr: 0.1\nbatch_size: 4: 5\nseed: 1\n")
    (d / "list.yaml").write_text("- lr: 0.1\n- batch_size: 4\n")
    (d / "config.txt").write_text("lr = 0.1\n")
    (d / "datadir").mkdir()
    (d / "binary.jsonl").write_bytes(b'{"query": "a", "response": "b"}\n\xff\xfe\x00garbage\n')
    res = d / "results"
    res.mkdir()
    (res / "broken.json").write_text('{"model": "m",')
    (res / "m__arith__ar.jsonl").write_text('{"id": 1}\n{"id": 2}\n')
    (d / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (d / "afile").write_text("x")
    return {k: str(d / k) for k in ("m", "causal", "nan", "badtok", "badindex", "badconfig", "strconfig", "badeos", "huge", "full", "four.toml",
                                      "broken.toml", "broken.yaml", "list.yaml", "config.txt", "datadir",
                                      "binary.jsonl", "results", "binary.json", "afile")} | {"dir": str(d)}


G = ["generate", "--model", "{m}"]
AR = G + ["hello", "--decoder", "ar"]
RF = G + ["hello", "--decoder", "refusion"]
SP = G + ["hello"]  # the default decoder of a ReFusion model: speculative
LONG_PROMPT = ",".join(["5"] * 250)

# (argv, what the one line must contain); {name} is a path from the `files` fixture
CASES = [
    # generate: sampling values
    (AR + ["--temperature", "1", "--top-p", "0"], "top_p must lie in (0, 1], got 0.0"),
    (AR + ["--temperature", "1", "--top-p", "1.5"], "top_p must lie in (0, 1], got 1.5"),
    (AR + ["--temperature", "1", "--top-k", "0"], "top_k must be an integer >= 1, got 0"),
    (AR + ["--temperature", "1", "--top-k", "-5"], "top_k must be an integer >= 1, got -5"),
    (AR + ["--temperature", "nan"], "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (AR + ["--temperature", "inf"], "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (AR + ["--temperature", "-1"], "got -1.0"),
    (AR + ["--top-k", "5"], "top_k applies only when sampling"),
    (G + ["hello", "--temperature", "nan"], "temperature must be a finite number"),
    (G + ["hello", "--decoder", "mdm", "--temperature", "inf"], "got inf"),
    # generate: flags a decoder would ignore
    (RF + ["--top-k", "5"], "--top-k does not apply to decoder 'refusion'"),
    (G + ["hello", "--decoder", "mdm-threshold", "--steps", "8"], "--steps does not apply to decoder 'mdm-threshold'"),
    (G + ["hello", "--decoder", "mdm", "--threshold", "0.5"], "--threshold does not apply to decoder 'mdm'"),
    (RF + ["--prefix-cache"], "--prefix-cache is no longer a flag: prefix_cache is a Python-only setting"),
    (SP + ["--slot-size", "4"], "--slot-size does not apply to decoder 'speculative'"),
    (AR + ["--fixed-widths"], '--fixed-widths is no longer a flag: the drafting policy is Python-only (decode(..., widths="fixed")'),
    (SP + ["--fork"], "--fork is no longer a flag: fork is a Python-only setting (decode(..., fork=...))"),
    (RF + ["--join-check"], "--join-check is now part of --checks (join check, causal infill and row recheck"),
    (RF + ["--temperature", "0.5", "--checks"], "checks compare drafts with the greedy causal prediction"),
    (AR + ["--checks"], "--checks does not apply to decoder 'ar'"),
    (SP + ["--accept-prob", "1.5"], "accept_prob must lie in [0, 1], got 1.5"),
    (SP + ["--accept-prob", "0"], "accept_prob must be > 0"),
    (SP + ["--draft-length", "-1"], "draft_length must be an integer >= 0 (0: plain AR), got -1"),
    (SP + ["--draft-length", "1000000000"],
     "draft_length 1000000000 exceeds 256, the most draft tokens a step may verify; lower draft_length"),
    (SP + ["--top-p", "0.5"], "top_p applies only when sampling"),
    (SP + ["--temperature", "1", "--top-p", "0"], "top_p must lie in (0, 1], got 0.0"),
    (AR + ["--slot-size", "4"], "--slot-size does not apply to decoder 'ar'"),
    (AR + ["--recompute-kv"], "--recompute-kv is no longer a flag"),
    # generate: sizes, refused before anything is allocated
    (G + ["hello", "--gen-length", "1000000000"], "gen_length 1000000000 exceeds"),
    (AR + ["--gen-length", "1000000000"], "gen_length 1000000000 exceeds"),
    (G + ["hello", "--decoder", "mdm", "--gen-length", "1000000000"], "gen_length 1000000000 exceeds"),
    (RF + ["--slot-size", "1000000000"], "slot_size x serial_blocks = 1000000000 x 1"),
    (G + ["hello", "--decoder", "mdm", "--block-length", "1000000000"], "block_length 1000000000"),
    (G + ["--prompt-ids", LONG_PROMPT, "--gen-length", "16"],
     "prompt (250 tokens) + gen_length (16) = 266 exceeds the model's max_position_embeddings 256"),
    (G + ["hello", "--gen-length", "0"], "gen_length must be an integer >= 1, got 0"),
    (AR + ["--gen-length", "-4"], "gen_length must be an integer >= 1, got -4"),
    (RF + ["--slot-threshold", "1.5"], "slot_threshold must lie in [0, 1], got 1.5"),
    (RF + ["--token-threshold", "nan"], "token_threshold must lie in [0, 1], got nan"),
    (G + ["hello", "--decoder", "mdm-threshold", "--threshold", "2"], "threshold must lie in [0, 1], got 2.0"),
    (G + ["hello", "--decoder", "mdm", "--gen-length", "32", "--block-length", "8", "--steps", "7"], "steps 7"),
    (G + ["hello", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    # seeds: what torch's generators take
    (AR + ["--seed", str(2**70)], f"argument --seed: a seed is an integer in [0, 2**63 - 1], got {2**70}"),
    (AR + ["--seed", "-1"], "argument --seed: a seed is an integer in [0, 2**63 - 1], got -1"),
    (["eval", "--model", "{m}", "--task", "arith", "--seed", str(2**63)], "argument --seed: a seed is an integer"),
    (["eval", "--model", "{m}", "--task", "arith", "--n", "3", "--seed", str(2**63 - 2), "--gen-length", "8"],
     f"seed {2**63 - 2} is too large for 3 examples"),
    (["self-generate", "--prompts", "stdlib", "--out", "{dir}/sg.jsonl", "--seed", str(2**64)],
     "argument --seed: a seed is an integer"),
    (G + ["hello", "--gen-length", "abc"], "argument --gen-length: invalid int value: 'abc'"),
    (G + ["hello", "--decoder", "beam"], "argument --decoder: invalid choice: 'beam'"),
    # generate: devices
    (G + ["hello", "--device", "foo"], "device 'foo' is not a device"),
    (G + ["hello", "--device", "cuda:99"], "device 'cuda:99'"),
    pytest.param(G + ["hello", "--device", "cuda"], "device 'cuda': CUDA is not available",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")),
    # generate: prompts
    (G + ["hello", "--prompt-ids", "1,2"], "give a prompt (text) or --prompt-ids, not both"),
    (G + ["--prompt-ids", "1,2", "--raw"], "--raw and --system apply to a text prompt"),
    # bytes that are not UTF-8 (Python hands them over as lone surrogates)
    (G + ["caf\udce9 au lait"], "argument prompt: not UTF-8 text (byte 0xe9 at character 3); pass UTF-8 text"),
    (G + ["hello", "--system", "\udcff"], "argument --system: not UTF-8 text (byte 0xff at character 0)"),
    (["eval", "--model", "{m}", "--task", "arith", "--tag", "x\udc80"], "argument --tag: not UTF-8 text (byte 0x80"),
    (G + ["hello", "--raw", "--system", "be brief"], "--system goes into the chat template"),
    (G + ["", "--raw"], "the prompt is empty"),
    (G + ["--prompt-ids", "3,99999"], "prompt token id 99999 is outside the vocabulary"),
    (G + ["--prompt-ids", "1,x"], "--prompt-ids takes comma-separated integers, got '1,x'"),
    (G + ["--prompt-ids", "1,,2"], "--prompt-ids has an empty item (item 2 of '1,,2'); give comma-separated token ids"),
    (G + ["--prompt-ids", "1,2,"], "--prompt-ids has an empty item (item 3 of '1,2,')"),
    (G + ["--prompt-ids", ""], "--prompt-ids is empty"),
    (G + ["--prompt-ids", "1 2,3"], "got '1 2,3' ('1 2' is not one)"),
    (G + ["--prompt-ids", "1,+2"], "('+2' is not one)"),
    (G + ["--prompt-ids", "4,-3"], "--prompt-ids takes token ids, which are >= 0, got -3"),
    (G + ["--prompt-ids", "4,280"], "prompt token id 280 is outside the vocabulary [0, 280)"),
    (["generate", "--model", "", "hello"], "the model name is empty: give a model directory or a name"),
    (["eval", "--model", " ", "--task", "arith"], "the model name is empty"),
    (["info", ""], "the model name is empty"),
    (["self-generate", "--model", "", "--prompts", "stdlib", "--out", "{dir}/sg.jsonl"], "the model name is empty"),
    (G, "give a prompt (text) or --prompt-ids"),
    (["generate", "--model", "{causal}", "hello", "--decoder", "refusion"], "needs a model with mask_token_id"),
    # model directories
    (["generate", "--model", README, "hello"], "README.md is a file; a model is a Hugging Face directory"),
    (["generate", "--model", "{dir}/missing", "hello"], "missing does not exist"),
    (["generate", "--model", "{badtok}", "hello"], "badtok/tokenizer.json is not a readable Hugging Face tokenizer"),
    (["generate", "--model", "{badindex}", "--prompt-ids", "1,2"], "badindex/model.safetensors.index.json is not valid JSON"),
    (["generate", "--model", "{nan}", "hello"], "model.layers.0.mlp.down_proj.weight holds NaN values"),
    (["eval", "--model", "{nan}", "--task", "arith", "--n", "1"], "model.layers.0.mlp.down_proj.weight holds NaN"),
    (["generate", "--model", "{huge}", "hello"], "huge/config.json describes needs about"),
    (["eval", "--model", "{huge}", "--task", "arith", "--n", "1"], "more than this machine's"),
    (["info", README], "README.md is a file"),
    (["info", "{dir}/missing"], "does not exist"),
    (["info", "{badconfig}"], "badconfig/config.json is not valid JSON"),
    (["info", "{strconfig}"], "hidden_size must be an integer >= 1, got 'abc'"),
    (["generate", "--model", "{badeos}", "hello"], "badeos/config.json: eos_token_id must be a token id or a list of "
                                                  "token ids in [0, 280), got -7"),
    (["add-mask-token", "{causal}", "{dir}/out1", "--token", ""], "the mask token must be a non-empty string"),
    (["add-mask-token", "{causal}", "{dir}/out2", "--token", "a"], "'a' is already token"),
    (["add-mask-token", "{causal}", "{dir}/out9", "--token", "<|im_end|>"],
     "'<|im_end|>' is the eos token (id 2); the mask must be a token of its own: choose a new one, e.g. <|mask|>"),
    (["add-mask-token", "{causal}", "{dir}/out9", "--token", "<|im_end|>", "--force"], "'<|im_end|>' is the eos token"),
    (["add-mask-token", "{causal}", "{dir}/out9", "--token", "<|endoftext|>"], "'<|endoftext|>' is the pad token (id 0)"),
    (["add-mask-token", "{causal}", "{dir}/out9", "--token", "<|im_start|>"],
     "'<|im_start|>' is already a special token of the tokenizer (id 1); the mask must be a token of its own"),
    (["add-mask-token", "{causal}", "{full}"], "full exists and is not empty; choose another directory or pass --overwrite"),
    (["add-mask-token", README, "{dir}/out3"], "README.md is a file"),
    (["import-gguf", README, "{dir}/out4"], "README.md is not a GGUF file"),
    (["import-gguf", "{dir}/missing.gguf", "{dir}/out5"], "missing.gguf does not exist"),
    (["import-gguf", "smollm2", "{full}"], "pass --overwrite"),
    (["export", "{m}", "{dir}/out6"], "m is not a sharded training checkpoint (no dcp/ directory)"),
    (["export", "{dir}/missing", "{dir}/out7"], "missing does not exist"),
    (["export", "{m}", "{full}"], "full exists and is not empty; choose another directory or pass --overwrite"),
    (["export", "{m}", "{dir}/out8", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    # train: configuration files and overrides
    (["train", "--config", "{four.toml}"], "batch_size must be an integer, got 'four'"),
    (["train", "--set", "lr=abc"], "lr must be a number, got 'abc'"),
    (["train", "--set", "lr=NaN"], "lr must be a finite number > 0, got nan"),
    (["train", "--set", "batch_size=true"], "batch_size must be an integer, got True"),
    (["train", "--set", "max_steps=0"], "max_steps must be >= 1, got 0"),
    (["train", "--max-steps", "-5"], "max_steps must be >= 1, got -5"),
    (["train", "--set", "warmup_steps=-1"], "warmup_steps must be >= 0, got -1"),
    (["train", "--set", "betas=[0.9]"], "betas must be two numbers"),
    (["train", "--set", "slot_sizes=[4, 0]"], "slot_sizes must be a non-empty list"),
    (["train", "--set", "dtype=float64"], "dtype must be one of float32, bfloat16, got 'float64'"),
    (["train", "--set", "lrr=1"], "unknown training options: lrr"),
    (["train", "--set", "model.hiden=3"], "unknown model fields: hiden"),
    (["train", "--set", "model.hidden_size=102"], "model: hidden_size 102 is not divisible by num_heads 4"),
    (["train", "--set", "model.hidden_size=100"], "model: head_dim 25 must be even"),
    (["train", "--set", "model.num_layers=two"], "model: num_layers must be an integer >= 1, got 'two'"),
    (["train", "--set", "model.max_position_embeddings=256"], "max_length 512 exceeds the model's max_position_embeddings 256"),
    (["train", "--set", "lr"], "--set takes key=value, got 'lr'"),
    (["train", "--set", "lr=0.1", "--set", "lr.x=1"], "--set lr.x: lr is not a table"),
    (["train", "--config", "{broken.toml}"], "broken.toml: invalid TOML"),
    (["train", "--config", "{broken.yaml}"], "broken.yaml:2: invalid YAML (mapping values are not allowed here)"),
    (["train", "--config", "{list.yaml}"], "list.yaml: expected a table of TrainConfig fields at the top level, got a list"),
    (["train", "--config", "{config.txt}"], "config.txt: use .toml, .yaml or .yml"),
    (["train", "--config", "{dir}/missing.toml"], "missing.toml does not exist"),
    (["train", "--config", "{datadir}"], "datadir is a directory"),
    (["train", "--data", "{datadir}"], "datadir is a directory, not a JSON or JSONL file"),
    (["train", "--data", "{dir}/missing.jsonl"], "missing.jsonl: no such file"),
    (["train", "--init", README], "init " + README + ": not a directory"),
    (["train", "--init", "{datadir}"], "datadir has no config.json"),
    (["train", "--init", "{m}", "--set", "model.num_layers=2"], "model describes a fresh model; init"),
    (["train", "--set", "out_dir=\"{afile}\""], "afile is a file, not a directory"),
    (["train", "--set", "device=\"cuda:99\""], "device 'cuda:99'"),
    (["train", "--set", "device=\"foo\""], "device 'foo' is not a device"),
    (["train", "--set", 'lora={"r": 0}'], "lora.r must be an integer >= 1, got 0"),
    (["train", "--set", 'lora={"target_modules": ["qproj"]}'], "lora.target_modules must be a list of"),
    (["train", "--set", 'lora={"rank": 4}'], "lora: unknown keys rank"),
    (["train", "--objective", "bert"], "argument --objective: invalid choice: 'bert'"),
    (["train", "--strategy", "zero"], "argument --strategy: invalid choice: 'zero'"),
    (["train", "--set", 'strategy="zero"'], "strategy must be one of ddp, fsdp, got 'zero'"),
    (["train", "--strategy", "fsdp", "--out", "{dir}/fsdp"],
     "strategy fsdp shards the model over the processes torchrun starts: run it as torchrun --nproc-per-node N"),
    (["train", "--threads", "0"], "argument --threads: must be >= 1"),
    # eval
    (["eval", "--model", "{m}", "--task", "arith", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["eval", "--model", "{m}", "--task", "arith", "--n", "0"], "argument --n: must be >= 1, got 0"),
    (["eval", "--model", "{m}", "--task", "arith", "--n", "-3"], "argument --n: must be >= 1, got -3"),
    (["eval", "--model", "{m}", "--task", "arith,foo", "--out", "{dir}/never"], "unknown task 'foo'"),
    (["eval", "--model", "{m}", "--task", "arith,,code"], "--task takes distinct comma-separated task names"),
    (["eval", "--model", "{m}", "--task", "arith", "--split", "dev"], "task 'arith' has no split 'dev'"),
    (["eval", "--model", "{m}", "--task", "code", "--n", "1000000000"],
     "task 'code' supplies at most 600 distinct test examples; n 1000000000 asks for more: ask for at most 600"),
    (["eval", "--model", "{m}", "--task", "sort,add", "--n", "4001"], "task 'add' supplies at most 4000 distinct test"),
    (["eval", "--model", "{m}", "--task", "repeat", "--split", "train", "--n", "1000000001"],
     "task 'repeat' supplies at most 1000000 train examples"),
    (["eval", "--model", "{m}", "--task", "arith", "--out", "{afile}"], "afile is a file, not a directory"),
    (["eval", "--model", "{m}", "--task", "arith", "--decoder", "refusion", "--top-p", "0.5"],
     "--top-p does not apply to decoder 'refusion'"),
    (["eval", "--model", "{m}", "--task", "arith", "--gen-length", "1000000000"], "gen_length 1000000000 exceeds"),
    (["eval", "--model", "{m}", "--task", "arith", "--decoder", "ar", "--setting", "ar"],
     "--setting names its decoder (and --tag) itself"),
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "beam"], "--setting 'beam': argument decoder: invalid choice"),
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "ar --bogus 1"],
     "--setting 'ar --bogus 1': unrecognized arguments: --bogus 1"),
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "ar --tag 'x"], "--setting \"ar --tag 'x\": No closing quotation"),
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "ar", "--setting", "refusion --top-p 0.5"],
     "--top-p does not apply to decoder 'refusion'"),
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "ar", "--setting", "refusion", "--slot-size", "4"],
     "--slot-size does not apply to decoder 'ar'"),  # the flags outside apply to every setting
    (["eval", "--model", "{m}", "--task", "arith", "--setting", "refusion --tag a", "--setting", "refusion --slot-size 4 --tag a"],
     "two decoder settings would write the same results (refusion-a); tell them apart with --tag"),
    # report
    (["report", "{results}"], "broken.json:1: not valid JSON"),
    (["report", "{results}/m__arith__ar.jsonl"], "m__arith__ar.jsonl is a per-sample records file"),
    (["report", "{binary.json}"], "binary.json is not UTF-8 text"),
    (["report", "{dir}/missing"], "missing: no such file or directory"),
    # the rest
    (["data", "nosuch"], "unknown benchmark(s) nosuch"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
]


def _argv(argv, files):
    out = []
    for a in argv:
        for k, v in files.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


def run_main(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("argv, message", CASES,
                         ids=[" ".join(c.values[0] if hasattr(c, "values") else c[0])[-60:] for c in CASES])
def test_bad_value_is_one_line_naming_it(argv, message, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a train case that got through would write runs/ here, not in the repository
    rc, out, err = run_main(_argv(argv, files), capsys)
    assert rc == 2, (rc, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("refusion: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert not (tmp_path / "runs").exists() and not Path(files["dir"], "never").exists()


def test_data_that_fails_when_read_leaves_no_run_directory(files, capsys, tmp_path):
    out = tmp_path / "run"
    rc, _, err = run_main(["train", "--data", files["binary.jsonl"], "--out", str(out), "--set", "vocab_size=270",
                           "--no-progress"], capsys)
    assert rc == 2 and err.splitlines()[-1].endswith("binary.jsonl:2: not UTF-8 text (invalid start byte at byte 32); "
                                                     "records are JSON or JSONL")
    assert "Traceback" not in err and not out.exists()
    # too few examples shows only after the run directory got its tokenizer: the directory goes again
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"query": f"q{i}", "response": f"r{i}"}) + "\n" for i in range(3)))
    rc, _, err = run_main(["train", "--data", str(few), "--out", str(out), "--set", "vocab_size=270",
                           "--no-progress"], capsys)
    assert rc == 2 and "only 3 examples after filtering, fewer than batch_size 16" in err.splitlines()[-1]
    assert "trained a" in err and not out.exists()


# ---- real processes -----------------------------------------------------------------------------


def _cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refusion.cli", *argv], capture_output=True, text=True, **kw)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{m}", "hello", "--gen-length", "1000000000"], "gen_length 1000000000 exceeds"),
    (["generate", "--model", "{m}", "hello", "--draft-length", "1000000000"], "draft_length 1000000000 exceeds 256"),
    (["generate", "--model", "{m}", "hello", "--seed", "1180591620717411303424"], "argument --seed"),
    (["generate", "--model", "{badtok}", "hello"], "is not a readable Hugging Face tokenizer file"),
    (["generate", "--model", "{m}", "hello", "--device", "foo"], "device 'foo'"),
    (["train", "--config", "{broken.yaml}"], "invalid YAML"),
    (["eval", "--task", "arith", "--n", "-3"], "must be >= 1, got -3"),
])
def test_in_a_real_process(argv, message, files):
    p = _cli(*_argv(argv, files), timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [p.stderr.strip()] and p.stderr.startswith("refusion: error: ")
    assert message in p.stderr and "Traceback" not in p.stderr


def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line(files):
    p = subprocess.run([sys.executable, "-m", "refusion.cli", "generate", "--model", files["m"], b"caf\xe9 au lait"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.splitlines() == ["refusion: error: argument prompt: not UTF-8 text (byte 0xe9 at character 3); "
                                     "pass UTF-8 text (is the terminal's encoding UTF-8?) (see: refusion generate --help)"]


def test_the_tokenizer_names_text_that_is_not_unicode(files):
    from refusion.model.tokenizer import Tokenizer, TokenizerError

    tok = Tokenizer.from_dir(files["m"])
    with pytest.raises(TokenizerError, match="the text is not valid Unicode"):
        tok.chat_prompt_ids("caf\udce9")
    assert tok.encode("café") == tok.encode("caf\u00e9")


def test_a_reader_that_leaves_early_is_not_an_error():
    r, w = os.pipe()
    os.close(r)  # `refusion info | head` where head has already gone
    p = subprocess.run([sys.executable, "-m", "refusion.cli", "info"], stdout=w, stderr=subprocess.PIPE, text=True,
                       timeout=120)
    os.close(w)
    assert p.stderr == "" and p.returncode == 1


def test_help_and_version_do_not_import_torch():
    code = ("import sys; from refusion.cli import build_parser; build_parser().format_help(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    p = _cli("--version", timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("refusion ")
