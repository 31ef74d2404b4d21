"""No lost work in `refusion eval`: records are kept as each batch is scored, Ctrl-C says what was kept,
and the same command run again goes on from them to the records an uninterrupted run writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import refusion.evaluation.evaluate as evaluate_module
from refusion.cli import main
from refusion.evaluation.evaluate import EvalConfig, evaluate
from refusion.evaluation.records import EvalInterrupted, partial_path
from refusion.files import WriteError
from refusion.tasks import Example, Score, Task
from tests.helpers.full_disk import full_disk
from tests.helpers.tiny_sums_model import tiny_sums_model

pytestmark = pytest.mark.usefixtures("one_thread", "one_batch_a_call")
N = 7  # examples: with batches of 2, the last batch is short
CFG = EvalConfig("ar", {"max_new_tokens": 8, "temperature": 1.0}, batch_size=2, seed=5)  # sampled: seeds matter


@pytest.fixture
def one_batch_a_call(monkeypatch):
    """A continuous batch's decode() call holds one batch's worth of examples (not WAVE): records are
    kept a batch at a time, as a fixed batch's are."""
    monkeypatch.setattr(evaluate_module, "WAVE", 1)


@pytest.fixture(scope="module")
def tiny():
    return tiny_sums_model()


def echo_task(n: int = N) -> Task:
    exs = [Example(f"echo/test/{i}", f"what is {i} plus {i}?", None, i) for i in range(n)]
    return Task("echo", "math", ("test",), lambda split, n=None, seed=0: exs[:n],
                lambda ex, out: Score(str(len(out)), len(out) % 2 == 0))


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def without_time(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "wall_share")} for r in recs]


def interrupt_at_batch(monkeypatch, k: int) -> None:
    """decode() raises KeyboardInterrupt (as Ctrl-C would) on its k-th call (from 1)."""
    real, calls = evaluate_module.decode, [0]

    def decode(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(evaluate_module, "decode", decode)


def test_interrupted_eval_keeps_its_records_and_goes_on_to_the_same_result(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    whole = evaluate(model, tok, echo_task(), CFG, records_path=tmp_path / "whole.jsonl", progress=False)
    expected = lines(tmp_path / "whole.jsonl")
    assert len(expected) == N and not partial_path(tmp_path / "whole.jsonl").exists()

    path = tmp_path / "r.jsonl"
    interrupt_at_batch(monkeypatch, 3)
    with pytest.raises(EvalInterrupted) as e:
        evaluate(model, tok, echo_task(), CFG, records_path=path, progress=False)
    partial = partial_path(path)
    assert str(e.value) == (f"interrupted: 4 of {N} records kept in {partial}; run the same command again to "
                            "continue")
    assert not path.exists()
    kept = lines(partial)
    assert kept[0]["evaluation"]["task"] == "echo" and without_time(kept[1:]) == without_time(expected[:4])
    monkeypatch.undo()

    again = evaluate(model, tok, echo_task(), CFG, records_path=path, progress=False)
    assert without_time(lines(path)) == without_time(expected) and not partial.exists()
    assert {k: again[k] for k in ("accuracy", "tokens", "forwards", "n")} == \
           {k: whole[k] for k in ("accuracy", "tokens", "forwards", "n")}


def test_a_torn_line_and_part_of_a_batch_are_dropped(tiny, tmp_path):
    model, tok = tiny
    evaluate(model, tok, echo_task(), CFG, records_path=tmp_path / "whole.jsonl", progress=False)
    expected = lines(tmp_path / "whole.jsonl")
    path = tmp_path / "r.jsonl"
    evaluation = {"model": "model", "task": "echo", "split": "test", "decoder": "ar", "params": CFG.params, "n": N,
                  "seed": CFG.seed, "batch_size": 2, "system": None}
    # a kill in the middle of writing the third record: 2 whole records, one whole of the next batch, one torn
    text = "".join(json.dumps(x) + "\n" for x in [{"evaluation": evaluation}, *expected[:3]]) + '{"id": "echo/te'
    partial_path(path).write_text(text)
    evaluate(model, tok, echo_task(), CFG, records_path=path, progress=False)
    assert without_time(lines(path)) == without_time(expected)


def test_records_of_another_evaluation_are_not_mixed_in(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    path = tmp_path / "r.jsonl"
    interrupt_at_batch(monkeypatch, 2)
    with pytest.raises(EvalInterrupted):
        evaluate(model, tok, echo_task(), CFG, records_path=path, progress=False)
    monkeypatch.undo()
    other = EvalConfig("ar", {"max_new_tokens": 8, "temperature": 1.0}, batch_size=2, seed=6)
    with pytest.raises(ValueError, match="holds the records of another evaluation.*--overwrite"):
        evaluate(model, tok, echo_task(), other, records_path=path, progress=False)
    evaluate(model, tok, echo_task(), other, records_path=path, progress=False, overwrite=True)
    fresh = evaluate(model, tok, echo_task(), other, records_path=tmp_path / "fresh.jsonl", progress=False)
    assert without_time(lines(path)) == without_time(lines(tmp_path / "fresh.jsonl")) and fresh["n"] == N


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "patched"])
def test_a_full_disk_keeps_whole_batches_and_a_rerun_goes_on(tiny, tmp_path, monkeypatch, real):
    model, tok = tiny
    evaluate(model, tok, echo_task(), CFG, records_path=tmp_path / "whole.jsonl", progress=False)
    expected = lines(tmp_path / "whole.jsonl")
    long_task = Task("echo", "math", ("test",), lambda split, n=None, seed=0: [
        Example(e.id, e.prompt, None, "x" * 1500) for e in echo_task().load("test")], echo_task().score)
    with full_disk(tmp_path, monkeypatch, size_kb=4, real=real) as disk:
        path = disk.path / "r.jsonl"
        with pytest.raises(WriteError, match=f"could not write {partial_path(path)}: No space left"):
            evaluate(model, tok, long_task, CFG, records_path=path, progress=False)
        kept = lines(partial_path(path))[1:]
        assert 0 < len(kept) < N and len(kept) % 2 == 0
        assert without_time(kept) == [dict(r, answer="x" * 1500) for r in without_time(expected[:len(kept)])]
        saved = partial_path(path).read_text()
    roomy = tmp_path / "roomy" / "r.jsonl"
    roomy.parent.mkdir()
    partial_path(roomy).write_text(saved)
    evaluate(model, tok, long_task, CFG, records_path=roomy, progress=False)
    assert without_time(lines(roomy)) == [dict(r, answer="x" * 1500) for r in without_time(expected)]


def test_ctrl_c_in_a_real_eval_says_what_was_kept_and_the_same_command_finishes(tmp_path):
    n = 60
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "refusion.cli", "eval", "--task", "sort", "--n", str(n), "--gen-length", "32",
            "--decoder", "ar", "--out", str(out), "--no-progress", "--threads", "1"]
    # (a process that inherits SIGINT ignored installs no Ctrl-C handler, and a test process may have it ignored:
    # the command starts with SIGINT as a terminal gives it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        signal.signal(signal.SIGINT, previous)
    partial = out / "refusion-tiny__sort__ar.partial.jsonl"
    deadline = time.time() + 120
    while (time.time() < deadline and proc.poll() is None
           and (not partial.exists() or len(partial.read_text().splitlines()) < 3)):
        time.sleep(0.01)
    assert proc.poll() is None, f"the eval ended before it could be interrupted: {proc.returncode}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    kept = len(lines(partial)) - 1  # (every line whole: the message counts what the file holds)
    assert 2 <= kept < n, err
    assert err.strip().splitlines()[-1] == (f"refusion: interrupted: {kept} of {n} records kept in {partial}; run the "
                                            "same command again to continue"), err
    assert "Traceback" not in err
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    recs = lines(out / "refusion-tiny__sort__ar.jsonl")
    assert not partial.exists() and len(recs) == n and len({r["id"] for r in recs}) == n
    summary = json.loads((out / "refusion-tiny__sort__ar.json").read_text())
    assert summary["n"] == n and summary["accuracy"] == sum(r["correct"] for r in recs) / n


def test_the_cli_prints_what_was_kept_on_ctrl_c(tmp_path, monkeypatch, capsys):
    interrupt_at_batch(monkeypatch, 2)
    out = tmp_path / "out"
    rc = main(["eval", "--task", "sort", "--n", "3", "--gen-length", "32", "--decoder", "ar", "--out", str(out),
               "--no-progress"])
    err = capsys.readouterr().err
    partial = out / "refusion-tiny__sort__ar.partial.jsonl"
    assert rc == 130 and err.strip().splitlines()[-1] == (
        f"refusion: interrupted: 1 of 3 records kept in {partial}; run the same command again to continue")
