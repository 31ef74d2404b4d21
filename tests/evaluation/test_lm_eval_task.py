"""The offline lm-eval task group the README shows (configs/lm_eval): lm-eval's own command line
runs it on the bundled model from another directory, with no dataset hub, and every sample's answer
and each family's exact_match equal decode() on the same chat prompt."""

from __future__ import annotations

import glob
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from refusion.decoding import decode  # noqa: E402
from tests.helpers.serving import bundled  # noqa: E402
from tests.evaluation.test_lm_eval_adapter import lm_eval_command, subprocess_env  # noqa: E402

TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
pytestmark = pytest.mark.usefixtures("one_thread")


def shipped_module():
    spec = importlib.util.spec_from_file_location("refusion_tasks", TASKS / "refusion_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shipped_rows_are_the_held_out_split():
    mod = shipped_module()
    shipped = [json.loads(line) for line in mod.ROWS.read_text().splitlines()]
    assert shipped == mod.rows()
    assert [r["family"] for r in shipped] == [f for f in mod.FAMILIES for _ in range(mod.PER_FAMILY)]


def test_lm_eval_runs_the_shipped_task_offline(tmp_path):
    model, tok = bundled()
    out = tmp_path / "out"
    cmd = lm_eval_command(tmp_path) + [
        "--model", "refusion", "--tasks", "refusion_tasks", "--include_path", str(TASKS), "--apply_chat_template",
        "--limit", "3", "--batch_size", "16", "--output_path", str(out), "--log_samples"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(Path(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]).read_text())["results"]
    hits = []
    for family in shipped_module().FAMILIES:
        path = glob.glob(str(out / "**" / f"samples_refusion_{family}_*"), recursive=True)[0]
        samples = [json.loads(line) for line in open(path)]
        assert len(samples) == 3
        got = []
        for s in samples:
            (d,) = decode(model, [tok.chat_prompt_ids(s["doc"]["prompt"])], "speculative", gen_length=96,
                          eos_ids=model.config.eos_ids)
            answer = tok.decode(d.tokens[:96]).split("\n\n")[0]
            assert s["filtered_resps"] == [answer]
            got.append(answer == s["doc"]["target"])
        assert res[f"refusion_{family}"]["exact_match,none"] == pytest.approx(sum(got) / 3)
        hits += got
    assert res["refusion_tasks"]["exact_match,none"] == pytest.approx(sum(hits) / len(hits))
    assert sum(hits) >= len(hits) - 1  # the bundled model answers these: the metric is not vacuous
