"""`refusion adapt --quick` on a tiny causal LM: every stage runs, the adapter it exports names its base and
decodes the base's own greedy answers, a cut run finishes to the same adapter, a second run redoes nothing,
and what cannot be adapted (or resumed) is refused in one line. On SmolLM2 itself with -m slow."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion.bundled import BUNDLED, resolve_model
from refusion.cli import main
from refusion.decoding import decode
from refusion.decoding.corpus import read_corpus
from refusion.model.checkpoint import LOOKUP_CORPUS, load_model
from refusion.model.tokenizer import Tokenizer
from refusion.training.adapt import Options, recipe
from refusion.training.adapt.measure import CANDIDATES
from refusion.training.adapt.pipeline import Pipeline
from refusion.training.adapt.recipe import QUICK, QUICK_PROMPTS, RANK
from tests.helpers.tiny_causal_lm import make_causal_lm
from tests.helpers.tiny_gguf import write_byte_level_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).parents[2]
STAGES = ("base", "prompts", "data", "train", "sampler", "export", "measure")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("adapt") / "base", std=0.3)


def adapt(base, out, *extra) -> int:
    return main(["adapt", str(base), "--out", str(out), "--quick", "--threads", "1", "--no-progress", *extra])


@pytest.fixture(scope="module")
def quick_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("quick") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFUSION_CACHE", str(out.parent / "cache"))
        torch.set_num_threads(1)
        assert adapt(base, out) == 0
    return out


def test_quick_run_exports_an_adapter_whose_output_is_the_bases(base, quick_run, capsys, monkeypatch):
    out = quick_run
    monkeypatch.setenv("REFUSION_CACHE", str(out.parent / "cache"))
    state = json.loads((out / "state.json").read_text())
    assert all(state["stages"][s]["done"] for s in STAGES)
    prompts = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    data = [json.loads(x) for x in (out / "data.jsonl").read_text().splitlines()]
    assert len(prompts) == state["stages"]["prompts"]["count"] <= QUICK_PROMPTS
    assert [r["query"] for r in data] != [] and {r["query"] for r in data} == {p["query"] for p in prompts}
    assert {p["domain"] for p in prompts} <= {"prose", "maths", "code"} and {"maths", "code"} <= {
        p["domain"] for p in prompts}
    # the sampler learned from a seeded sample of the answers, at most its budget's
    features = torch.load(out / "sampler" / "features.pt", weights_only=True)
    assert features["config"]["examples"] == min(len(data), QUICK.sampler_examples) < len(data)
    # the export: the mask path naming its base, and the answers kept as lookup drafts, one per record
    adapter = out / "adapter"
    meta = json.loads((adapter / "mask_adapter.json").read_text())
    assert meta["base"] == str(base.resolve()) and meta["rank"] == RANK
    settings = json.loads((adapter / "decoding.json").read_text())
    if settings["params"]["lookup"]:
        assert int((read_corpus(adapter / LOOKUP_CORPUS).tokens == -1).sum()) == len(data)
    else:  # (the timing chose the masks alone: the corpus, which only lookup drafts from, went)
        assert not (adapter / LOOKUP_CORPUS).exists()
    # the measurement: every candidate's every output the base's, and the settings it chose written
    summary = json.loads((out / "measure.json").read_text())["summary"]
    assert {s["name"] for s in summary} == {"base ar", "speculative", "speculative +lookup"}
    assert all(s["identical"] == s["n"] == 2 for s in summary)
    assert settings["decoder"] == "speculative" and settings["measured_by"].startswith("refusion adapt ")
    # the setting chosen at batch 1 was run at batch 2 beside AR there (and its figure is in the note)
    chosen = next(n for n, p in CANDIDATES.items() if p == settings["params"])
    assert {(s["name"], s["batch_size"]) for s in summary if s["batch_size"] == 2} >= {("base ar", 2), (chosen, 2)}
    assert "; batch 2: chat" in settings["note"]
    # `--model DIR/adapter` decodes with them, and its greedy answer is the base's, token for token
    model, ref, tok = load_model(resolve_model(str(adapter))), load_model(base), Tokenizer.from_dir(base)
    ids = [tok.chat_prompt_ids("Write a short email to my landlord.")]
    assert decode(model, ids, gen_length=24)[0].tokens == decode(ref, ids, "ar", gen_length=24)[0].tokens
    # the same command again finds every stage done and changes nothing
    files = {p: p.read_bytes() for p in (out / "data.jsonl", adapter / "mask_adapter.safetensors",
                                         adapter / "decoding.json")}
    assert adapt(base, out) == 0
    assert all(p.read_bytes() == b for p, b in files.items())
    log = (out / "log").read_text()
    assert log.count("starting") == 1 and log.count("resuming") == 1 and log.count("train: done") == 1
    # --export copies the adapter into a directory (the package's asset), leaving no adapter file of an older one
    asset = out.parent / "asset"
    asset.mkdir()
    (asset / "mask_sampler.safetensors").write_bytes(b"an older adapter's")
    (asset / "notes.txt").write_text("kept")
    (adapter / "mask_sampler.safetensors").unlink(missing_ok=True)
    assert adapt(base, out, "--export", str(asset)) == 0
    assert {p.name for p in asset.iterdir()} == {p.name for p in adapter.iterdir()} | {"notes.txt"}
    assert all((asset / p.name).read_bytes() == p.read_bytes() for p in adapter.iterdir())


def test_the_benchmark_counts_every_output_the_bases(quick_run, tmp_path):
    """With --against, a second adapter (here the same one) is timed beside the first on the same prompts."""
    env = {**os.environ, "REFUSION_CACHE": str(quick_run.parent / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adapt.py"), "--model", str(quick_run / "adapter"),
                           "--against", str(quick_run / "adapter"), "--quick", "--out", str(tmp_path / "adapt.json")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "adapt.json").read_text())
    rows = {(s["name"], s["batch_size"]): s for s in got["summary"]}
    assert set(rows) == {(m, b) for m in ("base ar", "adapted", "against") for b in (1, 2)}
    assert all(s["identical"] == s["n"] == 2 and s["bench"] == "chat" for s in rows.values())
    assert got["decoding"] == json.loads((quick_run / "adapter" / "decoding.json").read_text())
    assert got["costs"]["extra_parameters"] > 0 and "chat: TPF" in proc.stdout


def test_a_cut_run_finishes_to_the_adapter_of_an_uncut_one(base, quick_run, tmp_path):
    whole, cut = quick_run, tmp_path / "cut"
    opts = Options(prompts=QUICK_PROMPTS, quick=True, max_tokens=16)
    Pipeline(str(base), cut, opts, threads=1, progress=False)(("base", "prompts", "data"))
    # killed in the middle of answering: the last answers and a torn line lost
    lines = (cut / "data.jsonl").read_text().splitlines()
    (cut / "data.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:7])
    state = json.loads((cut / "state.json").read_text())
    state["stages"]["data"]["done"] = False
    (cut / "state.json").write_text(json.dumps(state))
    assert adapt(base, cut) == 0
    for f in ("prompts.jsonl", "data.jsonl", "train/adapter/mask_adapter.safetensors"):
        assert (cut / f).read_bytes() == (whole / f).read_bytes(), f


def test_a_killed_stage_keeps_its_seconds(base, tmp_path, monkeypatch):
    """`kill` (SIGTERM) stops a run as Ctrl-C does: exit 130, the stage that was running keeps its seconds so
    far, and a resume adds to them (state.json's seconds are a stage's whole wall time)."""
    out = tmp_path / "run"
    train = Pipeline.train

    def killed_while_training(self):
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # (the signal ends this)

    monkeypatch.setattr(Pipeline, "train", killed_while_training)
    before = signal.getsignal(signal.SIGTERM)
    assert adapt(base, out) == 130
    assert signal.getsignal(signal.SIGTERM) is before
    cut = json.loads((out / "state.json").read_text())["stages"]["train"]
    assert not cut.get("done") and 0.5 <= cut["seconds"] < 30
    assert "train: stopped after" in (out / "log").read_text()
    resumed = []

    def timed_train(self):
        t = time.perf_counter()
        train(self)
        resumed.append(time.perf_counter() - t)

    monkeypatch.setattr(Pipeline, "train", timed_train)
    assert adapt(base, out) == 0
    whole = json.loads((out / "state.json").read_text())["stages"]["train"]
    # added, not replaced (state.json rounds a stage's seconds to 0.1)
    assert whole["done"] and whole["seconds"] >= cut["seconds"] + resumed[0] - 0.06


def test_what_cannot_be_adapted_or_resumed_is_refused_in_one_line(base, tmp_path, capsys):
    out = tmp_path / "run"
    Pipeline(str(base), out, Options(prompts=QUICK_PROMPTS, quick=True, max_tokens=16), threads=1,
             progress=False)(("base",))
    other = make_causal_lm(tmp_path / "other", seed=2)
    cases = [
        ([str(other), "--out", str(out), "--quick"], f"--out {out} holds a run of another model ({base})"),
        ([str(base), "--out", str(out), "--quick", "--prompts", "9"], "holds a run with other prompts (prompts=8)"),
        ([str(BUNDLED), "--out", str(tmp_path / "x")], "is a ReFusion model already (its masks draft), not a causal LM"),
        ([str(base), "--out", str(tmp_path / "y"), "--mix", "poetry=1"], "--mix: 'poetry=1' is not DOMAIN=SHARE"),
        ([str(base), "--out", str(tmp_path / "z"), "--hours", "-1"], "--hours -1.0: give a positive number"),
        ([str(base), "--out", str(tmp_path / "w"), "--prompts-file", str(tmp_path / "none.txt")],
         "--prompts-file " + str(tmp_path / "none.txt") + ": cannot read it"),
        (["smollm2-refusion", "--out", str(tmp_path / "v")], "smollm2-refusion is a mask adapter already: adapt its "
         "base (smollm2) instead"),
    ]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases.append(([str(base), "--out", str(tmp_path / "full")], "is a directory with other files in it"))
    for argv, message in cases:
        capsys.readouterr()
        assert main(["adapt", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("refusion: error: ") and message in err, (argv, err)
    assert not (tmp_path / "x").exists() and (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_own_prompts_file_joins_the_mix(base, tmp_path):
    (tmp_path / "mine.jsonl").write_text(json.dumps({"query": "What is 3 plus 4?"}) + "\n"
                                         + json.dumps({"query": "How do I clean a cast iron pan?"}) + "\n")
    out = tmp_path / "run"
    assert adapt(base, out, "--mix", "code=1", "--prompts-file", str(tmp_path / "mine.jsonl")) == 0
    prompts = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    # the second repeats a held-out chat request, so it is dropped (and counted)
    assert [p["query"] for p in prompts if p["domain"] == "user"] == ["What is 3 plus 4?"]
    assert {p["domain"] for p in prompts} == {"code", "user"}
    assert json.loads((out / "state.json").read_text())["stages"]["prompts"]["held_out_repeats_dropped"] == 1


def test_hours_fit_training_into_the_budget(base, tmp_path, monkeypatch):
    """A budget already spent: training stops after the steps it timed (5 of the recipe's 40), and the
    adapter is exported from them; the steps chosen are kept for a resume."""
    monkeypatch.setattr(recipe, "QUICK", dataclasses.replace(recipe.QUICK, steps=40, save_every=20))
    out = tmp_path / "run"
    Pipeline(str(base), out, Options(prompts=QUICK_PROMPTS, quick=True, max_tokens=16), hours=1e-6, threads=1,
             progress=False)(("base", "prompts", "data", "train"))
    state = json.loads((out / "state.json").read_text())
    assert state["stages"]["train"]["steps"] == 5 and state["stages"]["train"]["done"]
    assert [json.loads(x)["step"] for x in (out / "train" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert (out / "train" / "adapter" / "mask_adapter.safetensors").is_file()
    assert "--hours 1e-06:" in (out / "log").read_text()


def test_a_gguf_file_is_imported_once_into_the_run(tmp_path):
    write_byte_level_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "run"
    assert adapt(tmp_path / "tiny.gguf", out) == 0
    assert (out / "base" / "config.json").is_file()
    assert json.loads((out / "adapter" / "mask_adapter.json").read_text())["base"] == str((out / "base").resolve())
    summary = json.loads((out / "measure.json").read_text())["summary"]
    assert all(s["identical"] == s["n"] for s in summary)
    assert adapt(tmp_path / "tiny.gguf", out) == 0 and (out / "log").read_text().count("base: importing") == 1


@pytest.mark.slow
def test_quick_run_on_smollm2(tmp_path):
    out = tmp_path / "run"
    assert main(["adapt", "smollm2", "--out", str(out), "--quick", "--threads", "1", "--no-progress"]) == 0
    summary = json.loads((out / "measure.json").read_text())["summary"]
    assert all(s["identical"] == s["n"] == 2 for s in summary)
    assert json.loads((out / "adapter" / "mask_adapter.json").read_text())["base"] == "smollm2"


def _benchmark(quick_run, tmp_path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "REFUSION_CACHE": str(quick_run.parent / "cache")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adapt.py"), *args, "--quick",
                           "--out", str(tmp_path / "adapt.json")], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_benchmark_refuses_an_against_that_is_no_adapter(quick_run, tmp_path):
    proc = _benchmark(quick_run, tmp_path, "--model", str(quick_run / "adapter"), "--against", str(tmp_path))
    assert proc.returncode == 2 and f"--against {tmp_path}: not a mask adapter directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "adapt.json").exists()


@pytest.mark.parametrize("named", ["another base", "a missing base"])
def test_the_benchmark_refuses_an_against_of_another_or_a_missing_base(base, quick_run, tmp_path, named):
    other = tmp_path / "other"
    shutil.copytree(quick_run / "adapter", other)
    config = json.loads((other / "mask_adapter.json").read_text())
    config["base"] = str(shutil.copytree(base, tmp_path / "copy") if named == "another base" else tmp_path / "gone")
    (other / "mask_adapter.json").write_text(json.dumps(config))
    proc = _benchmark(quick_run, tmp_path, "--model", str(quick_run / "adapter"), "--against", str(other))
    wanted = "an adapter of another base than --model's" if named == "another base" else "cannot be found"
    assert proc.returncode == 2 and f"--against {other}: " in proc.stderr and wanted in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "adapt.json").exists()
