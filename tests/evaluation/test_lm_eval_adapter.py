"""The lm-evaluation-harness adapter, offline: lm-eval's own command line on tiny task YAMLs over
local JSONL files, with the bundled model; the reported metrics are checked against a hand
computation (one forward per scored token; decode() one prompt at a time)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from refusion.decoding import decode  # noqa: E402
from refusion.evaluation.lm_eval import HOOK_LINE, ReFusionLM, hook_path  # noqa: E402
from refusion.tasks.synthetic import TASKS  # noqa: E402
from tests.helpers.serving import bundled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.inference_mode()
def hand_logprob(ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """One forward per continuation token: the first read from a mask at its position (the model
    has one), each later one from the causal prediction after the tokens before it."""
    model, _ = bundled()
    mask = model.config.mask_token_id
    total, greedy = 0.0, True
    for i, t in enumerate(cont):
        ids = ctx + [mask] if i == 0 else ctx + cont[:i]
        lp = model(torch.tensor([ids]), torch.tensor([list(range(len(ids)))]))[0, -1].float().log_softmax(-1)
        total += float(lp[t])
        greedy &= int(lp.argmax()) == t
    return total, greedy


def write_tasks(d: Path) -> tuple[list[dict], list[dict]]:
    _, tok = bundled()

    def chat(q):
        return tok.apply_chat_template([{"role": "user", "content": q}])

    mc = []
    for ex in TASKS["choice"].load("test", n=6, seed=1):
        lines = ex.prompt.split("\n")
        kind = lines[0].removeprefix("Which number is ").rstrip("?")
        choices = [f"{line[3:]} is {kind}" for line in lines[1:5]]
        mc.append({"context": chat(ex.prompt), "choices": choices, "gold": "ABCD".index(ex.answer)})
    gen = [{"context": chat(ex.prompt), "answer": ex.target.split("\n")[0]}
           for ex in TASKS["code"].load("test", n=6, seed=1)]
    for name, rows in (("mc", mc), ("gen", gen)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{context}}\"\ntarget_delimiter: \"\"\n"
    (d / "mc.yaml").write_text(
        f"task: refusion_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (d / "gen.yaml").write_text(
        f"task: refusion_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 30\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return mc, gen


def subprocess_env() -> dict:
    # the child imports the same refusion as this test (PYTHONPATH may be relative to the repo)
    import refusion.model.checkpoint

    src = str(Path(refusion.model.checkpoint.__file__).resolve().parents[2])
    path = os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return {**os.environ, "PYTHONPATH": path, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def lm_eval_command(tmp_path: Path) -> list[str]:
    """The plain `lm_eval` console script where the hook is installed (scripts/setup.sh does it);
    else the same command line through `python -m refusion.evaluation.lm_eval`."""
    script = Path(sys.executable).parent / "lm_eval"
    if hook_path().exists() and script.exists():
        return [str(script)]
    return [sys.executable, "-m", "refusion.evaluation.lm_eval"]


def test_lm_eval_metrics_equal_a_hand_computation(tmp_path):
    model, tok = bundled()
    mc, gen = write_tasks(tmp_path)
    out = tmp_path / "out"
    env = subprocess_env()
    cmd = lm_eval_command(tmp_path) + [
        "--model", "refusion", "--model_args", "decoder=refusion,slot_size=8,checks=True",
        "--tasks", "refusion_mc,refusion_gen", "--include_path", str(tmp_path), "--device", "cpu",
        "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(Path(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]).read_text())
    res = results["results"]

    # multiple choice: the choice with the highest log-likelihood, scored by hand
    correct = []
    for doc in mc:
        ctx = tok.encode(doc["context"])
        lls = [hand_logprob(ctx, tok.encode(doc["context"] + c)[len(ctx):])[0] for c in doc["choices"]]
        correct.append(max(range(4), key=lambda i: lls[i]) == doc["gold"])
    assert res["refusion_mc"]["acc,none"] == pytest.approx(sum(correct) / len(mc))
    samples = [json.loads(line) for line in open(glob.glob(str(out / "**" / "samples_refusion_mc_*"),
                                                           recursive=True)[0])]
    for s in samples:  # and every single log-likelihood, not only the argmax
        doc = mc[s["doc_id"]]
        ctx = tok.encode(doc["context"])
        for c, resp in zip(doc["choices"], s["resps"], strict=True):
            ll, greedy = hand_logprob(ctx, tok.encode(doc["context"] + c)[len(ctx):])
            assert float(resp[0][0]) == pytest.approx(ll, abs=1e-3) and resp[0][1] in (greedy, str(greedy))

    # generation: decode() alone, cut at the stop string, compared with the first line of the answer
    hits = []
    for doc in gen:
        (d,) = decode(model, [tok.encode(doc["context"])], "refusion", gen_length=32, slot_size=8)
        text = tok.decode(d.tokens[:30]).split("\n")[0]
        hits.append(text == doc["answer"])
    assert res["refusion_gen"]["exact_match,none"] == pytest.approx(sum(hits) / len(gen))
    assert 0 < sum(hits)  # the bundled model writes these signatures: the metric is not vacuous


def test_loglikelihood_rolling_is_the_sum_over_windows(one_thread):
    lm = ReFusionLM(decoder="ar", max_length=24, batch_size=3)
    _, tok = bundled()
    text = "def count_evens(xs):\n    return sum(1 for x in xs if x % 2 == 0)\n" * 2
    ids = tok.encode(text)
    assert len(ids) > 24  # several windows
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    want = sum(hand_logprob(*make_disjoint_window(w))[0]
               for w in get_rolling_token_windows(ids, lm.prefix_id, 23, 1))
    assert got == pytest.approx(want, abs=1e-3)
    # no windowing needed: the whole text after the prefix token, by hand
    lm = ReFusionLM(decoder="ar")
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got == pytest.approx(hand_logprob([lm.prefix_id], ids)[0], abs=1e-3)


def test_loglikelihood_and_greedy_flags_in_batches(one_thread):
    lm = ReFusionLM(decoder="ar", batch_size=2)
    reqs = [("Which number is odd?\nA. 21", " is odd"), ("", "hello"), ("x = ", "1"), ("def f(", "x):\n    return x")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    for (ctx, cont), (ll, greedy) in zip(reqs, got, strict=True):
        want = hand_logprob(*lm._pair(ctx, cont))
        assert ll == pytest.approx(want[0], abs=1e-3) and greedy == want[1]


@pytest.mark.parametrize("decoder", ["ar", "speculative"])
def test_sampled_repeats_of_one_request_are_different_samples(one_thread, decoder):
    """lm-eval sends a task's repeats (pass@k, majority votes) as copies of one request: each is
    decoded with a seed of its own (seed + its index), as decode() gives that prompt alone."""
    lm = ReFusionLM(decoder=decoder, batch_size=2, seed=7)
    _, tok = bundled()
    context = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    kw = {"until": [], "max_gen_toks": 24, "do_sample": True, "temperature": 1.0}
    got = lm.generate_until([Instance("generate_until", {}, (context, dict(kw)), i) for i in range(4)])
    assert len(set(got)) > 1
    params = lm._params(24, 1.0, {})
    for i, text in enumerate(got):
        (res,) = decode(lm.model, [lm.tok.encode(context)], decoder, eos_ids=lm.eos_ids, seed=7 + i, **params)
        assert text == lm.tok.decode(res.tokens[:24])


def test_bad_model_args_are_refused():
    with pytest.raises(ValueError, match="does not take slot_size"):
        ReFusionLM(decoder="mdm", slot_size=8)
    with pytest.raises(ValueError, match="unknown decoder"):
        ReFusionLM(decoder="beam")
    with pytest.raises(ValueError, match="seed must be an integer"):
        ReFusionLM(seed=2**70)
    with pytest.raises(ValueError, match="the model name is empty"):
        ReFusionLM(pretrained="")


def test_bad_model_args_are_one_line_from_the_command_line(tmp_path):
    write_tasks(tmp_path)
    r = subprocess.run([sys.executable, "-m", "refusion.evaluation.lm_eval", "--model", "refusion", "--model_args",
                        "decoder=beam", "--tasks", "refusion_mc", "--include_path", str(tmp_path), "--device", "cpu"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == ("refusion: error: --model_args: unknown decoder 'beam'; choose one of "
                                         "speculative, refusion, refusion-l2r, ar, mdm, mdm-threshold")


def test_bad_model_args_are_one_line_from_the_plain_lm_eval_command(tmp_path):
    """The `lm_eval` command itself (the .pth hook registers the model: scripts/setup.sh installs it)."""
    write_tasks(tmp_path)
    (tmp_path / "refusion_lm_eval.pth").write_text(HOOK_LINE)
    # the hook line, processed as site-packages processes it, then lm-eval's own entry point
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); sys.argv[0] = 'lm_eval'; "
            "from lm_eval.__main__ import cli_evaluate; cli_evaluate()")
    r = subprocess.run([sys.executable, "-c", code, "--model", "refusion", "--model_args", "decoder=beam", "--tasks",
                        "refusion_mc", "--include_path", str(tmp_path), "--device", "cpu"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.splitlines()[-1].startswith("refusion: error: --model_args: unknown decoder 'beam'")


def test_the_pth_hook_registers_the_model_in_a_fresh_interpreter(tmp_path):
    """What `--install-hook` writes, processed as site-packages would process it."""
    (tmp_path / "refusion_lm_eval.pth").write_text(HOOK_LINE)
    code = (f"import site; site.addsitedir({str(tmp_path)!r}); import sys; "
            "assert 'torch' not in sys.modules and 'lm_eval' not in sys.modules; "
            "from lm_eval.api.registry import get_model; import lm_eval.models; print(get_model('refusion'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env(),
                       cwd=tmp_path)
    assert r.returncode == 0 and "refusion.evaluation.lm_eval.ReFusionLM" in r.stdout, r.stderr[-2000:]

