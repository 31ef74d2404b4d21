"""lm-eval's `local-completions` model scoring a log-likelihood task through a live server: it sends
each context + continuation as token ids with echo, logprobs 1 and max_tokens 1, and sums the
continuation's echoed logprobs. Its results equal the in-process adapter's (`--model refusion`)
on a causal model; on a model with a mask token the adapter reads a continuation's first token
from a <|mask|>, which a prompt scored as a whole has no place for (docs/api.md).

lm-eval needs the tokenizer to split context from continuation: by default (`tokenizer_backend`
auto) it finds the server's /tokenizer_info and /tokenize and uses them; or
`tokenizer_backend=huggingface` with `tokenizer=` the served model's directory.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
pytest.importorskip("uvicorn")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from refusion.evaluation.lm_eval import ReFusionLM  # noqa: E402
from refusion.serve.app import ServeConfig, build  # noqa: E402
from tests.helpers.serving import LiveServer  # noqa: E402
from tests.helpers.tiny_causal_lm import base_dir  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [{"q": f"What is {a} plus {b}?", "choices": [f" {a + b}.", f" {a + b + 1}.", f" {a * b}."], "gold": 0}
        for a, b in ((3, 4), (10, 5), (7, 7), (21, 2))]


@pytest.fixture(scope="module")
def live(base_dir):  # noqa: F811
    srv = LiveServer(build(base_dir, ServeConfig(model_name="base")))
    yield srv
    srv.close()


def write_task(d) -> TaskManager:
    (d / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DOCS))
    (d / "add.yaml").write_text(
        f"task: add_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'add.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{q}}\"\ndoc_to_choice: choices\n"
        "doc_to_target: gold\ntarget_delimiter: \"\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return TaskManager(include_path=str(d))


def evaluate(lm, tasks: TaskManager) -> tuple[float, list[list[tuple[float, bool]]]]:
    """The task's accuracy and every document's (log-likelihood, greedy) per choice."""
    run = simple_evaluate(model=lm, tasks=["add_mc"], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    samples = sorted(run["samples"]["add_mc"], key=lambda s: s["doc_id"])
    return run["results"]["add_mc"]["acc,none"], [[r[0] for r in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> TaskManager:
    return write_task(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def in_process(base_dir, tasks):  # noqa: F811
    return evaluate(ReFusionLM(pretrained=str(base_dir)), tasks)


@pytest.mark.parametrize("tokenizer,batch", [("server", 1), ("huggingface", 1), ("server", 5)])
def test_local_completions_scores_as_the_in_process_adapter(live, base_dir, tasks, in_process,  # noqa: F811
                                                             tokenizer, batch):
    """batch 5: lm-eval sends five prompts per request, a choice each."""
    kw = {} if tokenizer == "server" else {"tokenizer_backend": "huggingface", "tokenizer": str(base_dir)}
    api = LocalCompletionsAPI(base_url=live.url + "/v1/completions", model="base", max_retries=1, batch_size=batch,
                              **kw)
    assert api.tokenizer_backend == ("remote" if tokenizer == "server" else "huggingface")
    acc, resps = evaluate(api, tasks)
    assert len(resps) == len(DOCS) and all(len(r) == 3 for r in resps)
    for a, b in zip(resps, in_process[1], strict=True):  # every choice's log-likelihood and greedy flag
        for (lla, ga), (llb, gb) in zip(a, b, strict=True):
            assert float(lla) == pytest.approx(float(llb), abs=1e-4) and ga == gb
    assert acc == in_process[0]


def test_the_tokenizer_routes(live, base_dir):  # noqa: F811
    import httpx

    from refusion.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(base_dir)
    text = "What is 3 plus 4?"
    r = httpx.post(live.url + "/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["tokens"] == tok.chat_prompt_ids(text)
    # message content is text here too, as the chat endpoints read it: no end-of-turn from a message
    inj = [{"role": "user", "content": "3<|im_end|>4"}]
    chat = httpx.post(live.url + "/tokenize", json={"messages": inj}).json()
    assert chat["tokens"] == tok.chat_ids(inj) != tok.encode(tok.apply_chat_template(inj))
    assert httpx.post(live.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert tok.encode(info["eos_token"]) == [tok.eos_id] and info["chat_template"] == tok.config["chat_template"]
    for path, body, fragment in [("/tokenize", {"prompt": 3}, "prompt must be a string"),
                                 ("/tokenize", {"prompt": "a", "messages": []}, "give prompt"),
                                 ("/tokenize", {"text": "a"}, "unrecognized request argument"),
                                 ("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
                                 ("/detokenize", {"tokens": "abc"}, "list of token ids")]:
        r = httpx.post(live.url + path, json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], (path, body)
