"""The trainer: schedule, config files, data errors, falling loss, exact resume after a kill, torchrun."""

import dataclasses
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion.model.checkpoint import load_model, save_model, to_hf
from refusion.model.config import ModelConfig
from refusion.training.data import (BatchOrder, DataError, Example, encode_records, filter_by_length, length_batches,
                                    load_records, train_bpe_tokenizer)
from refusion.model.transformer import Transformer
from refusion.model.tokenizer import Tokenizer
from refusion.cli import main
from refusion.decoding import default_decoder
from refusion.model.lora import apply_lora, merged_state_dict
from refusion.training.optimizer import lr_at
from refusion.training.setup import setup
from refusion.training.trainer import TrainConfig, fit, load_train_config, train
from tests.helpers.tiny_causal_lm import tokenizer_without_mask
from tests.helpers.train_helpers import TINY, data_file, tiny_config, torchrun_train, train_here  # noqa: F401 (data_file: a fixture; test_fsdp imports them from here)

def losses(out: Path) -> list[dict]:
    keep = ("step", "loss", "ar_loss", "mdm_loss", "grad_norm", "lr", "tokens")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


# ---- pieces ------------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert lr_at(14, cfg) == pytest.approx(0.1)


def test_config_file_and_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('objective = "mdm"\nlr = 0.01\n[model]\nhidden_size = 32\nnum_heads = 2\n')
    cfg = load_train_config(toml, ["lr=5e-4", "model.num_layers=3", "out_dir=runs/x", "slot_sizes=[2,4]"])
    assert (cfg.objective, cfg.lr, cfg.out_dir, cfg.slot_sizes) == ("mdm", 5e-4, "runs/x", [2, 4])
    assert cfg.model == {"hidden_size": 32, "num_heads": 2, "num_layers": 3}
    yml = tmp_path / "c.yaml"
    yml.write_text("objective: ar\nbatch_size: 4\n")
    assert load_train_config(yml).batch_size == 4
    with pytest.raises(ValueError, match="unknown training options: lrr"):
        load_train_config(None, ["lrr=1"])
    with pytest.raises(ValueError, match="objective must be one of"):
        load_train_config(None, ["objective=bert"])
    with pytest.raises(ValueError, match="unknown model fields: hiden"):
        load_train_config(None, ["model.hiden=3"])


def test_data_errors_name_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"query": "a", "response": "b"}\n\n{"query": "a", "answer": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: record has no 'response' field"):
        load_records(f)
    f.write_text('{"query": "a", "response": "b"}\n{"query": "a", "response": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        load_records(f)
    g = tmp_path / "bad.json"
    g.write_text('[\n  {"query": "a", "response": "b"},\n  {"query": "a", "response": 3}\n]')
    with pytest.raises(DataError, match=r"bad.json:3: 'response' must be a string, got int"):
        load_records(g)
    g.write_text('[{"query": "a", "response": "b"}, {"query": "c", "response": "d"}]')
    assert load_records(g) == [{"query": "a", "response": "b"}, {"query": "c", "response": "d"}]
    with pytest.raises(DataError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")


def test_encoding_and_length_filter():
    tok = train_bpe_tokenizer(["What is 2 plus 3?", "2 + 3 = 5."] * 20, vocab_size=280)
    (ex,) = encode_records([{"query": "What is 2 plus 3?", "response": "5"}], tok)
    assert tok.decode(ex.prompt, skip_special_tokens=False) == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    assert ex.response == tok.encode("5") + [tok.eos_id]
    assert (tok.eos_id, tok.pad_id, tok.mask_id) == (2, 0, 3)
    exs = [Example([1] * 3, [2] * n) for n in (1, 5, 9)]
    kept, dropped = filter_by_length(exs, 8)
    assert [len(e) for e in kept] == [4, 8] and dropped == 1


def test_length_batches_cover_epoch_once_and_are_deterministic():
    rng = random.Random(1)
    lengths = [rng.randint(1, 100) for _ in range(103)]
    a = length_batches(lengths, 8, seed=3, epoch=0, pool=4)
    assert a == length_batches(lengths, 8, seed=3, epoch=0, pool=4)
    assert a != length_batches(lengths, 8, seed=3, epoch=1, pool=4)
    flat = [i for b in a for i in b]
    assert len(flat) == len(set(flat)) and all(len(b) == 8 for b in a)
    assert len(a) == 12  # the pools of 32 give 4 + 4 + 4 batches, the last 7 examples are dropped
    # batches are groups of similar length: padding well below a random split's
    pad = sum(max(lengths[i] for i in b) * 8 - sum(lengths[i] for i in b) for b in a)
    rnd = list(range(103))
    random.Random(0).shuffle(rnd)
    pad_rnd = sum(max(lengths[i] for i in rnd[k:k + 8]) * 8 - sum(lengths[i] for i in rnd[k:k + 8])
                  for k in range(0, 96, 8))
    assert pad < 0.5 * pad_rnd
    # the trainer's order: step s is batch s % 12 of epoch s // 12 (the default pool of 50 batches)
    order = BatchOrder(lengths, 8, seed=3)
    assert [order(s) for s in range(30)] == [length_batches(lengths, 8, 3, s // 12)[s % 12] for s in range(30)]


# ---- training ------------------------------------------------------------------------------


@pytest.mark.parametrize("objective", ["refusion", "ar", "mdm"])
def test_loss_falls_for_every_objective(objective, data_file, tmp_path):
    torch.manual_seed(0)
    final = train(tiny_config(data_file, tmp_path, objective=objective, max_steps=40), progress=False)
    ls = [r["loss"] for r in losses(tmp_path)]
    assert len(ls) == 40 and all(math.isfinite(x) for x in ls)
    assert sum(ls[-5:]) / 5 < 0.6 * sum(ls[:5]) / 5
    model = load_model(final)
    assert model.config.bidirectional == (objective == "mdm")
    assert (model.config.mask_token_id is None) == (objective == "ar")
    # the objective is recorded, and picks the decoder that fits it
    assert model.config.training_objective == objective
    assert default_decoder(model.config) == {"refusion": "speculative", "ar": "ar", "mdm": "mdm-threshold"}[objective]


def test_micro_batches_and_gradient_checkpointing_match_one_batch(data_file, tmp_path):
    ref = losses_of(tiny_config(data_file, tmp_path / "a", max_steps=4))
    acc = losses_of(tiny_config(data_file, tmp_path / "b", max_steps=4, micro_batch_size=2))
    ckp = losses_of(tiny_config(data_file, tmp_path / "c", max_steps=4, gradient_checkpointing=True))
    for a, b, c in zip(ref, acc, ckp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tokens"] == b["tokens"]
        assert a["loss"] == c["loss"]  # recomputing the forward changes nothing in float32


def losses_of(cfg: TrainConfig) -> list[dict]:
    train(cfg, progress=False)
    return losses(Path(cfg.out_dir))


def test_bfloat16_autocast_trains(data_file, tmp_path):
    ls = [r["loss"] for r in losses_of(tiny_config(data_file, tmp_path, dtype="bfloat16", max_steps=30))]
    assert all(math.isfinite(x) for x in ls) and sum(ls[-5:]) < 0.7 * sum(ls[:5])


def test_no_resume_never_continues_a_run_and_deletes_nothing(data_file, tmp_path, capsys):
    cfg = tiny_config(data_file, tmp_path, max_steps=2, warmup_steps=1)
    train(cfg, resume=False, progress=False)  # a fresh directory: an ordinary run
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint-2\) and resuming is off"):
        setup(cfg, resume=False)
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "model").is_dir()
    # the help says what it does
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--no-resume never continue a run: stop with an error if out_dir already has checkpoints" in help_text


def test_warmup_longer_than_the_run_is_scaled_with_a_note(data_file, tmp_path, capsys):
    cfg = TrainConfig(max_steps=50).validate()  # the default warm-up is 100 steps
    assert cfg.warmup_steps == 5 and "warm-up scaled to 5 steps" in cfg.notes[0]
    assert TrainConfig(max_steps=50, warmup_steps=50).validate().warmup_steps == 50  # as asked: kept
    train(tiny_config(data_file, tmp_path, max_steps=4, warmup_steps=100), progress=False)
    assert "warmup_steps 100 is more than max_steps 4: warm-up scaled to 0 steps" in capsys.readouterr().err
    assert json.loads((tmp_path / "train_config.json").read_text())["warmup_steps"] == 0


def test_print_config_round_trips(tmp_path, capsys):
    argv = ["train", "--set", "lr=0.01", "--set", "model.num_layers=2", "--set", 'lora={"r": 4}', "--max-steps", "7",
            "--print-config"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "lr = 0.01" in text and "[model]" in text and "# init =" in text
    (tmp_path / "c.toml").write_text(text)
    expected = load_train_config(None, ["lr=0.01", "model.num_layers=2", 'lora={"r": 4}', "max_steps=7"])
    assert dataclasses.asdict(load_train_config(tmp_path / "c.toml")) == dataclasses.asdict(expected)


@pytest.mark.parametrize("tied", [True, False])
def test_lora_trains_the_new_token_rows_and_nothing_else_of_the_embedding(tied):
    cfg = ModelConfig(vocab_size=40, tie_word_embeddings=tied, **TINY)
    m = Transformer(cfg).init_weights(seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    apply_lora(m, {"r": 2, "target_modules": ["q_proj"]}, new_tokens=[39])
    ids, pos = torch.tensor([[1, 39, 2, 39, 5]]), torch.arange(5)[None]
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        logits = m(ids, pos)
        loss = torch.nn.functional.cross_entropy(logits[0], torch.tensor([2, 39, 5, 39, 1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert not m.embed_tokens.weight.requires_grad and m.lora_token_rows.grad is None
    merged = merged_state_dict(m)
    emb = merged["embed_tokens.weight"]
    assert torch.equal(emb[:39], before["embed_tokens.weight"][:39])  # every other row as it was
    assert not torch.equal(emb[39], before["embed_tokens.weight"][39])  # the new token's row learned
    if not tied:
        head = merged["lm_head.weight"]
        assert torch.equal(head[:39], before["lm_head.weight"][:39]) and not torch.equal(head[39], before["lm_head.weight"][39])
    # the merged weights are the adapted model: same logits without adapters or hooks
    plain = Transformer(cfg)
    plain.load_state_dict({k: v for k, v in merged.items() if not (tied and k == "lm_head.weight")}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, pos), m(ids, pos), atol=1e-5, rtol=1e-5)


def test_resume_after_kill_is_bit_exact(data_file, tmp_path):
    common = [f"--data={data_file}", "--set=vocab_size=300", f"--set=model={json.dumps(TINY)}", "--set=batch_size=8",
              "--set=max_steps=1000", "--set=warmup_steps=3", "--set=save_every=5", "--no-progress"]
    # an uninterrupted run of 20 steps (of a 1000-step schedule)
    ref = tmp_path / "ref"
    train_here(*common, f"--out={ref}", "--set=stop_after=20")
    # the same run, killed with SIGKILL some steps after its first checkpoint
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "refusion.cli", "train", *common, f"--out={run}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 7):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpts = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    assert ckpts and ckpts[-1] < 20, f"the run was not killed in time (checkpoints {ckpts})"
    # its lock file still names it, yet blocks nothing: the lock went with the process
    assert (run / ".lock").read_text().startswith(f"pid {proc.pid} on ")
    # resume to step 20: every logged number equals the uninterrupted run's
    train_here(*common, f"--out={run}", "--set=stop_after=20")
    assert losses(run) == losses(ref)
    a, b = load_model(ref / "checkpoint-20"), load_model(run / "checkpoint-20")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_two_processes_match_one(data_file, tmp_path):
    common = [f"--data={data_file}", "--set=vocab_size=300", f"--set=model={json.dumps(TINY)}", "--set=batch_size=8",
              "--set=max_steps=6", "--set=warmup_steps=2", "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_here(*common, f"--out={one}")
    torchrun_train(2, {"two": [*common, f"--out={two}"]}, tmp_path / "log.json")
    la, lb = losses(one), losses(two)
    assert len(la) == len(lb) == 6
    for a, b in zip(la, lb, strict=True):
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    ma, mb = load_model(one / "model"), load_model(two / "model")
    for (k, x), y in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=1e-5), k


def _tokenizer_without_mask(data_file: Path) -> Tokenizer:
    return tokenizer_without_mask([r["query"] + r["response"] for r in load_records(data_file)], vocab_size=300)


def test_init_from_a_causal_checkpoint_adds_the_mask_token_and_lora(data_file, tmp_path):
    tok = _tokenizer_without_mask(data_file)
    assert tok.token_id("<|mask|>") is None
    n = max(tok.tok.get_vocab().values()) + 1
    base = Transformer(ModelConfig(vocab_size=n, eos_token_id=tok.eos_id, model_type="llama", qk_norm=False,
                                   **TINY)).init_weights(seed=1)
    save_model(base, tmp_path / "base", tok)
    cfg = tiny_config(data_file, tmp_path / "lora", init=str(tmp_path / "base"), model={}, max_steps=6, save_every=3,
                      lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    run = setup(cfg)
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and "lora_token_rows" in trainable
    mean_row = run.model.lora_token_rows.detach().clone()  # the new <|mask|> row starts at the mean
    final = fit(run, progress=False)
    model = load_model(final)
    assert model.config.mask_token_id == n and model.config.vocab_size == n + 1
    assert Tokenizer.from_dir(final).token_id("<|mask|>") == n
    # the mask's row learned; the base vocabulary's rows did not move
    assert not torch.allclose(model.embed_tokens.weight[n], mean_row[0])
    assert torch.equal(model.embed_tokens.weight[:n], base.embed_tokens.weight)
    # only the adapted projections moved; the merged weights are what the adapters give
    got, was = to_hf(model.state_dict(), model.config), to_hf(base.state_dict(), base.config)
    for name in ("mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"):
        moved = not torch.equal(got[f"model.layers.0.{name}.weight"], was[f"model.layers.0.{name}.weight"])
        assert moved == (name in ("self_attn.q_proj", "self_attn.v_proj")), name
    # a LoRA run resumed from its checkpoint continues exactly
    ref = losses(tmp_path / "lora")
    shutil.rmtree(tmp_path / "lora" / "checkpoint-6")
    shutil.rmtree(tmp_path / "lora" / "model")
    fit(setup(cfg), progress=False)
    assert losses(tmp_path / "lora") == ref


def test_a_checkpoint_of_the_old_weight_layout_is_refused_by_name(data_file, tmp_path):
    """A run checkpointed by refusion 0.1 (separate q/k/v and gate/up, so optimizer groups of other
    sizes) gets a message that says why and what to do, never a resume with mismatched state."""
    import torch

    cfg = tiny_config(data_file, tmp_path, max_steps=10, save_every=2, stop_after=2)
    train(cfg, progress=False)
    state = tmp_path / "checkpoint-2" / "training_state.pt"
    s = torch.load(state, weights_only=False)
    s["optimizer"]["param_groups"][0]["params"].append(10_000)  # one more weight in the decay group
    torch.save(s, state)
    with pytest.raises(ValueError, match=r"written by refusion 0\.1.*optimizer state cannot be loaded.*--init"):
        train(tiny_config(data_file, tmp_path, max_steps=10, save_every=2), progress=False)
