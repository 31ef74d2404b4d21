"""The eval harness and report on a tiny random model and a hand-made task."""

import json
from dataclasses import replace

import pytest

from refusion.cli import main
from refusion.model.checkpoint import save_model
from refusion.evaluation.evaluate import EvalConfig, evaluate, model_label, wilson_interval
from refusion.evaluation.run import eval_tasks, run_eval
from refusion.evaluation.report import averages, curve_point, last_steps, load_summaries, report
from refusion.tasks import Example, Score, Task
from tests.helpers.tiny_sums_model import tiny_sums_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_sums_model()


def echo_task(n: int = 5) -> Task:
    """Correct when the output's length is even: the outcome depends on the model, as a real task's does."""
    exs = [Example(f"echo/test/{i}", f"what is {i} plus {i}?", None, i) for i in range(n)]
    return Task("echo", "math", ("test",), lambda split, n=None, seed=0: exs[:n],
                lambda ex, out: Score(str(len(out)), len(out) % 2 == 0))


def test_wilson_interval_hand_computed():
    lo, hi = wilson_interval(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0


@pytest.mark.parametrize("decoder,params", [("ar", {"max_new_tokens": 12}),
                                            ("refusion", {"gen_length": 16, "slot_size": 4}),
                                            ("mdm", {"gen_length": 16, "block_length": 8, "steps": 8})])
def test_records_and_summary_are_consistent(tiny, tmp_path, decoder, params):
    model, tok = tiny
    task = echo_task()
    s1 = evaluate(model, tok, task, EvalConfig(decoder, params), records_path=tmp_path / "r.jsonl",
                  progress=False)
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"echo/test/{i}" for i in range(5)]
    assert all(r["correct"] == (len(r["output"]) % 2 == 0) for r in recs)
    assert s1["accuracy"] == sum(r["correct"] for r in recs) / 5
    assert s1["tokens"] == sum(r["tokens"] for r in recs) and s1["tps"] == pytest.approx(s1["tokens"] / s1["seconds"])
    assert s1["tpf"] == pytest.approx(s1["tokens"] / s1["forwards"])
    # a batch of 3 gives every sample the output it gets alone
    s3 = evaluate(model, tok, task, EvalConfig(decoder, params, batch_size=3),
                  records_path=tmp_path / "r3.jsonl", progress=False)
    recs3 = [json.loads(x) for x in (tmp_path / "r3.jsonl").read_text().splitlines()]
    assert [r["output"] for r in recs3] == [r["output"] for r in recs] and s3["accuracy"] == s1["accuracy"]


@pytest.mark.parametrize("decoder,params", [("ar", {"max_new_tokens": 12, "temperature": 1.0}),
                                            ("speculative", {"gen_length": 12, "temperature": 1.0})])
def test_a_continuous_batch_gives_each_example_the_record_batch_size_1_gives(tiny, tmp_path, monkeypatch, decoder,
                                                                              params):
    import refusion.evaluation.evaluate as evaluate_module

    model, tok = tiny
    task = echo_task(7)
    calls: list[tuple[int, int | None]] = []  # (prompts, batch_size) of every decode() call
    real = evaluate_module.decode
    monkeypatch.setattr(evaluate_module, "decode",
                        lambda m, ps, *a, **kw: calls.append((len(ps), kw.get("batch_size"))) or real(m, ps, *a, **kw))
    monkeypatch.setattr(evaluate_module, "WAVE", 2)

    def records(batch_size: int) -> tuple[dict, list[dict]]:
        path = tmp_path / f"b{batch_size}.jsonl"
        s = evaluate(model, tok, task, EvalConfig(decoder, params, batch_size=batch_size, seed=3),
                     records_path=path, progress=False)
        return s, [json.loads(x) for x in path.read_text().splitlines()]

    s1, one = records(1)
    assert calls == [(1, None)] * 7
    calls.clear()
    s3, three = records(3)
    assert calls == [(6, 3), (1, 3)]  # WAVE batches of examples a call, at most batch_size at once
    # sampled, yet every example's output is the one it gets alone: its seed is its own (seed + its index)
    assert [r["output"] for r in three] == [r["output"] for r in one]
    assert len({r["output"] for r in one}) > 1
    assert s3["seconds"] == pytest.approx(sum(r["wall_share"] for r in three))
    assert all(0 < r["seconds"] <= s3["seconds"] for r in three)


def test_cli_eval_then_report(tiny, tmp_path, monkeypatch, capsys):
    model, tok = tiny
    save_model(model, tmp_path / "m", tok)
    import refusion.tasks as tasks

    monkeypatch.setattr(tasks, "all_tasks", lambda: {"echo": echo_task(4)})
    out = tmp_path / "res"
    for dec, flags in (("ar", []), ("refusion", ["--slot-size", "4"])):
        assert main(["eval", "--model", str(tmp_path / "m"), "--task", "echo", "--decoder", dec, "--gen-length", "8",
                     *flags, "--out", str(out), "--no-progress"]) == 0
    rows = load_summaries([out])
    assert sorted(r["decoder"] for r in rows) == ["ar", "refusion"] and all(r["n"] == 4 for r in rows)
    text = report([out], out=tmp_path / "r.md", plot=tmp_path / "p.png")
    assert "| m | echo | ar | 4 |" in text and (tmp_path / "p.png").stat().st_size > 1000
    avg = averages(rows)
    assert [a["decoder"] for a in avg] == ["ar", "refusion"]
    tagged = tmp_path / "tagged"
    assert main(["eval", "--model", str(tmp_path / "m"), "--task", "echo", "--decoder", "refusion", "--gen-length", "8",
                 "--slot-size", "4", "--tag", "s4", "--out", str(tagged), "--no-progress"]) == 0
    assert [r["decoder"] for r in load_summaries([tagged])] == ["refusion-s4"]
    assert (tagged / "m__echo__refusion-s4.jsonl").exists()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_settings_in_one_eval_write_what_separate_evals_write(tiny, tmp_path, monkeypatch, capsys):
    """--setting, repeated: the files, records and summaries of one eval per setting (times aside),
    in the same order, from one load of the model; the flags outside a setting apply to each."""
    model, tok = tiny
    save_model(model, tmp_path / "m", tok)
    import refusion.evaluation.run as run
    import refusion.tasks as tasks

    monkeypatch.setattr(tasks, "all_tasks", lambda: {"echo": echo_task(3), "echo2": replace(echo_task(2), name="echo2")})
    loads = []
    real_load = run.load_model
    monkeypatch.setattr(run, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    common = ["eval", "--model", str(tmp_path / "m"), "--task", "echo,echo2", "--gen-length", "8", "--no-progress"]
    settings = ["ar", "refusion --slot-size 4 --tag s4", "refusion --slot-size 2 --gen-length 12", "speculative"]
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "one")] + [a for s in settings for a in ("--setting", s)]) == 0
    together = capsys.readouterr().out
    assert len(loads) == 1
    for s in settings:
        assert main(common + ["--out", str(tmp_path / "each"), "--decoder", *s.split()]) == 0
    separately = capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "each").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "one").iterdir()) and len(names) == 16
    timing = ("seconds", "tps", "latency_mean", "latency_p50", "latency_p90", "model_path", "wall_share")
    for name in names:
        a, b = ((tmp_path / d / name).read_text() for d in ("one", "each"))
        if name.endswith(".jsonl"):
            a, b = ([{k: v for k, v in json.loads(x).items() if k not in timing} for x in t.splitlines()]
                    for t in (a, b))
        else:
            a, b = ({k: v for k, v in json.loads(t).items() if k not in timing} for t in (a, b))
        assert a == b, name
    assert json.loads((tmp_path / "one" / "m__echo__refusion.json").read_text())["params"]["gen_length"] == 12
    heads = lambda out: [line.split(":")[0] for line in out.splitlines()]
    assert heads(together) == heads(separately) == [f"m {t} {d}" for d in ("ar", "refusion-s4", "refusion", "speculative")
                                                    for t in ("echo", "echo2")]
    # a setting whose result exists is refused before any runs
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "m__echo2__speculative.json").write_text("{}")
    assert main(common + ["--out", str(tmp_path / "some"), "--setting", "ar", "--setting", "speculative"]) == 2
    assert "m__echo2__speculative.json exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "some").iterdir()] == ["m__echo2__speculative.json"]


def test_two_runs_named_model_keep_their_results_apart(tiny, tmp_path, monkeypatch, capsys):
    model, tok = tiny
    for run in ("a", "b"):  # runs/a/model and runs/b/model, as `refusion train` leaves them
        save_model(model, tmp_path / "runs" / run / "model", tok)
    import refusion.tasks as tasks

    monkeypatch.setattr(tasks, "all_tasks", lambda: {"echo": echo_task(2)})
    out = tmp_path / "res"
    for run in ("a", "b"):
        argv = ["eval", "--model", str(tmp_path / "runs" / run / "model"), "--task", "echo", "--decoder", "ar",
                "--gen-length", "4", "--out", str(out), "--no-progress"]
        assert main(argv) == 0
    assert sorted(p.name for p in out.glob("*.json")) == ["a__echo__ar.json", "b__echo__ar.json"]
    assert model_label(tmp_path / "runs" / "a" / "checkpoint-40") == "a-checkpoint-40"
    # the same again would replace a result: refused, unless asked for
    capsys.readouterr()
    assert main(argv) == 2 and "b__echo__ar.json exists (an earlier eval); pass --overwrite" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0


def test_run_eval_writes_what_evaluate_returns_and_claims_its_files_first(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    save_model(model, tmp_path / "m", tok)
    import refusion.tasks as tasks

    two = {"echo": echo_task(3), "echo2": replace(echo_task(2), name="echo2")}
    monkeypatch.setattr(tasks, "all_tasks", lambda: two)
    cfg = EvalConfig("ar", {"gen_length": 6})
    seen = []
    got = run_eval(tmp_path / "m", eval_tasks("echo,echo2", "test"), cfg, tmp_path / "res", progress=False,
                   on_summary=lambda s, path: seen.append(path.name))
    assert seen == ["m__echo__ar.json", "m__echo2__ar.json"] and [s["n"] for s in got] == [3, 2]
    for s in got:  # each file holds the summary returned, which is evaluate()'s on the same model
        assert json.loads((tmp_path / "res" / f"m__{s['task']}__ar.json").read_text()) == s
        direct = evaluate(model, tok, tasks.get_task(s["task"]), cfg, model_name="m", progress=False)
        keys = ("accuracy", "tokens", "forwards")
        assert {k: s[k] for k in keys} == {k: direct[k] for k in keys}
    with pytest.raises(ValueError, match="m__echo__ar.json exists"):  # refused before the model is read
        run_eval(tmp_path / "nowhere", eval_tasks("echo", "test"), cfg, tmp_path / "res", label="m")
    with pytest.raises(ValueError, match="--task takes distinct comma-separated task names, got 'echo,echo'"):
        eval_tasks("echo,echo", "test")
    with pytest.raises(ValueError, match="task 'echo' has no split 'train'"):
        eval_tasks("echo", "train")


def test_every_task_name_is_checked_before_any_runs(tiny, tmp_path, monkeypatch, capsys):
    model, tok = tiny
    save_model(model, tmp_path / "m", tok)
    import refusion.tasks as tasks

    ran = []
    task = echo_task(2)
    real_load = task.load
    task.load = lambda *a, **k: ran.append(1) or real_load(*a, **k)
    monkeypatch.setattr(tasks, "all_tasks", lambda: {"echo": task})
    assert main(["eval", "--model", str(tmp_path / "m"), "--task", "echo,foo", "--out", str(tmp_path / "res"),
                 "--no-progress"]) == 2
    assert "unknown task 'foo'; known tasks: echo" in capsys.readouterr().err
    assert not ran and not (tmp_path / "res").exists()


def test_report_keeps_parameter_settings_apart_and_flags_other_task_sets(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    save_model(model, tmp_path / "m", tok)
    import refusion.tasks as tasks

    monkeypatch.setattr(tasks, "all_tasks", lambda: {"echo": echo_task(2), "echo2": replace(echo_task(2), name="echo2")})
    out = tmp_path / "res"
    common = ["eval", "--model", str(tmp_path / "m"), "--decoder", "refusion", "--out", str(out), "--no-progress"]
    assert main(common + ["--task", "echo,echo2", "--gen-length", "8", "--slot-size", "4"]) == 0
    assert main(common + ["--task", "echo", "--gen-length", "8", "--slot-size", "8", "--tag", "s8"]) == 0
    assert main(common + ["--task", "echo", "--gen-length", "8", "--slot-size", "2", "--overwrite"]) == 0
    rows = load_summaries([out, out / "m__echo__refusion-s8.json"])  # a file reached twice counts once
    assert len(rows) == 3
    avg = {a["decoder"]: a for a in averages(rows)}
    # the overwritten echo result has slot 2, echo2 still has slot 4: two settings, never one average
    assert sorted(avg) == ["refusion#1", "refusion#2", "refusion-s8"]
    assert sorted(a["tasks"] for a in averages(rows)) == [["echo"], ["echo"], ["echo2"]]
    assert [a["mixed"] for a in averages(rows) if a["tasks"] == ["echo2"]] == [True]
    text = report([out], plot=tmp_path / "p.png")
    assert "slot_size 2" in text and "slot_size 4" in text and "not comparable" in text


def _summary(model, task, decoder, correct, n=100, tokens=1000, seconds=1.0, forwards=1000, params=None):
    """A hand-made eval summary: what `refusion report` reads of one."""
    from refusion.evaluation.evaluate import wilson_interval

    return {"model": model, "task": task, "decoder": decoder, "params": params or {}, "n": n,
            "accuracy": correct / n, "ci95": list(wilson_interval(correct, n)), "tokens": tokens,
            "seconds": seconds, "forwards": forwards, "tps": tokens / seconds, "tpf": tokens / forwards,
            "latency_p50": 0.25}


def _write(summaries, out):
    out.mkdir(parents=True, exist_ok=True)
    for s in summaries:
        (out / f"{s['model']}__{s['task']}__{s['decoder']}.json").write_text(json.dumps(s))
    return out


PLAIN = [_summary("base", "add", "ar", 40), _summary("base", "sort", "ar", 20, seconds=2.0),
         _summary("refusion", "add", "refusion", 55, tokens=900, forwards=300, params={"slot_size": 8}),
         _summary("refusion", "add", "refusion-fast", 45, tokens=900, forwards=200, params={"slot_size": 4})]
CURVES = [_summary("ar@2000", "add", "ar", 50), _summary("ar@2000", "sort", "ar", 70),
          _summary("ar@4000", "add", "ar", 100, seconds=0.5), _summary("ar@4000", "sort", "ar", 90, seconds=0.5),
          _summary("ar@16000", "add", "ar", 100),
          _summary("refusion@2000", "add", "speculative", 30, tokens=900, forwards=300),
          _summary("refusion@2000", "sort", "speculative", 30, tokens=900, forwards=300, seconds=0.5),
          _summary("refusion@2000", "add", "refusion-fast", 50, params={"slot_size": 8}),
          _summary("refusion@2000", "sort", "refusion-fast", 70, params={"slot_size": 8})]


def test_report_without_curve_labels_is_unchanged(tmp_path):
    """Models not labelled NAME@STEP: the report as it was before curves existed, to the character."""
    text = report([_write(PLAIN, tmp_path / "res")])
    assert text == PLAIN_REPORT


PLAIN_REPORT = """\
## Per task

| model | task | decoder | n | accuracy (95% CI) | TPS | TPF | latency p50 (s) |
|---|---|---|---|---|---|---|---|
| base | add | ar | 100 | 40.0 (30.9-49.8) | 1000.0 | 1.00 | 0.250 |
| refusion | add | refusion | 100 | 55.0 (45.2-64.4) | 900.0 | 3.00 | 0.250 |
| refusion | add | refusion-fast | 100 | 45.0 (35.6-54.8) | 900.0 | 4.50 | 0.250 |
| base | sort | ar | 100 | 20.0 (13.3-28.9) | 500.0 | 1.00 | 0.250 |

## Averaged over tasks

| model | decoder | tasks | mean accuracy | TPS | TPF |
|---|---|---|---|---|---|
| base | ar | add, sort * | 30.0 | 666.7 | 1.00 |
| refusion | refusion | add | 55.0 | 900.0 | 3.00 |
| refusion | refusion-fast | add | 45.0 | 900.0 | 4.50 |

\\* averaged over a different set of tasks from the other rows: not comparable with them.

## Decoder settings

| decoder | settings |
|---|---|
| ar | defaults |
| refusion | slot_size 8 |
| refusion-fast | slot_size 4 |
"""


def test_report_plots_into_a_directory_under_their_names(tmp_path, capsys):
    out = _write(PLAIN[:2] + CURVES, tmp_path / "res")
    plots = tmp_path / "plots"
    plots.mkdir()
    assert main(["report", str(out), "--plot", str(plots), "--curves-plot", str(plots)]) == 0
    assert sorted(p.name for p in plots.iterdir()) == ["accuracy_vs_steps.png", "accuracy_vs_tps.png"]
    assert not (tmp_path / "plots.png").exists()
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in plots.iterdir())
    capsys.readouterr()
    assert main(["report", str(out), "--out", str(plots)]) == 2  # markdown needs a file name
    assert capsys.readouterr().err == (f"refusion: error: --out {plots} is a directory; name the markdown file, "
                                       f"e.g. {plots / 'report.md'}\n")


def test_curve_labels_name_a_run_and_a_step():
    assert curve_point("refusion-ar-share-25@4000") == ("refusion-ar-share-25", 4000)
    assert curve_point("a@b@16000") == ("a@b", 16000)
    assert [curve_point(m) for m in ("refusion", "refusion@", "@4000", "ar@4k", "ar@4000-fast")] == [None] * 5


def test_report_draws_curves_of_models_labelled_with_steps(tmp_path, capsys):
    out = _write(PLAIN[:2] + CURVES, tmp_path / "res")
    text = report([out], out=tmp_path / "r.md", plot=tmp_path / "tps.png", curves_plot=tmp_path / "steps.png")
    curves = text[text.index("## Over training steps"):]
    # per run, a row per decoder x step (steps in numeric order); the interval is Wilson's over all 200
    # prompts; a point missing a task shows - and is marked
    assert curves == """\
## Over training steps

### ar

| decoder | step | mean accuracy (95% CI) | add | sort | TPS | TPF |
|---|---|---|---|---|---|---|
| ar | 2000 | 60.0 (53.1-66.5) | 50.0 | 70.0 | 1000.0 | 1.00 |
| ar | 4000 | 95.0 (91.0-97.3) | 100.0 | 90.0 | 2000.0 | 1.00 |
| ar | 16000 | 100.0 (96.3-100.0) * | 100.0 | - | 1000.0 | 1.00 |

### refusion

| decoder | step | mean accuracy (95% CI) | add | sort | TPS | TPF |
|---|---|---|---|---|---|---|
| refusion-fast | 2000 | 60.0 (53.1-66.5) | 50.0 | 70.0 | 1000.0 | 1.00 |
| speculative | 2000 | 30.0 (24.1-36.7) | 30.0 | 30.0 | 1200.0 | 3.00 |

\\* averaged over a different set of tasks from the other rows: not comparable with them.
"""
    assert (tmp_path / "r.md").read_text() == text
    # the tables before the curves list the curve points too, ordered by step
    assert text.index("| ar@2000 | ar |") < text.index("| ar@4000 | ar |") < text.index("| ar@16000 | ar |")
    assert (tmp_path / "steps.png").stat().st_size > 1000 and (tmp_path / "tps.png").stat().st_size > 1000
    # the accuracy-vs-TPS plot shows each run at its last step only
    rows = load_summaries([out])
    assert [(a["model"], a["decoder"]) for a in last_steps(averages(rows))] == [
        ("ar@16000", "ar"), ("base", "ar"), ("refusion@2000", "refusion-fast"), ("refusion@2000", "speculative")]
    # the same through the CLI; a curves plot of results without steps is refused
    assert main(["report", str(out), "--curves-plot", str(tmp_path / "cli.png")]) == 0
    assert "### refusion" in capsys.readouterr().out and (tmp_path / "cli.png").stat().st_size > 1000
    plain = _write(PLAIN, tmp_path / "plain")
    assert main(["report", str(plain), "--curves-plot", str(tmp_path / "never.png")]) == 2
    assert "--curves-plot needs results of models labelled NAME@STEP" in capsys.readouterr().err
    assert not (tmp_path / "never.png").exists()
