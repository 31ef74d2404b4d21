"""The OpenAI fields that shape or report the distribution, through the official `openai` client
against a live server on the bundled model: n, echo with the prompt's logprobs, logprobs and
top_logprobs, logit_bias, presence and frequency penalties, response_format and vLLM's
structured_outputs, streamed and not; and lm-eval's `local-completions` model scoring through it.

Every answer is checked against the Python API: `decode()` with the same Controls through `ar`
(what the server's speculative decoding must equal), and the prompt's logprobs against a direct
forward's log_softmax.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from refusion.decoding import Controls, decode, grammar  # noqa: E402
from refusion.serve.app import ServeConfig, Server  # noqa: E402
from tests.helpers.serving import LiveServer, bundled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "refusion-tiny"
CODE = "Continue this Python code:\nimport os"  # many likely continuations: samples differ
ADD = "Add: 12 + 30 + 7"


@pytest.fixture(scope="module")
def live(one_thread):
    model, tok = bundled()
    srv = LiveServer(Server(model, tok, ServeConfig(model_name=NAME, max_tokens_cap=512)))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_ids(text: str) -> list[int]:
    return bundled()[1].chat_prompt_ids(text)


def ar(prompt_ids: list[int], gen_length: int, controls: Controls | None = None, **params):
    """What `ar` decoding gives the prompt alone, with these controls."""
    model, _ = bundled()
    return decode(model, [prompt_ids], "ar", eos_ids=model.config.eos_ids, gen_length=gen_length,
                  controls=controls, **params)[0]


def answer_ids(res) -> list[int]:
    """The answer's tokens as the client sees them: up to the first EOS."""
    eos = set(bundled()[0].config.eos_ids)
    out = []
    for t in res.tokens:
        if t in eos:
            break
        out.append(t)
    return out


# ---- n ------------------------------------------------------------------------------------------


def test_n_choices_are_seeded_seed_plus_index(client):
    _, tok = bundled()
    kw = dict(model=NAME, messages=[{"role": "user", "content": CODE}], max_tokens=24, temperature=1.0)
    r = client.chat.completions.create(n=4, seed=40, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    model, _ = bundled()
    for i, text in enumerate(texts):
        want = decode(model, [chat_ids(CODE)], "ar", eos_ids=model.config.eos_ids, gen_length=24, temperature=1.0,
                      seed=40 + i)[0]
        assert text == tok.decode(answer_ids(want)), i
    assert len(set(texts)) > 1  # independent samples
    assert r.usage.completion_tokens == sum(len(c["token_ids"]) for c in r.model_extra["refusion"]["choices"])
    # streamed: the same choices, each chunk carrying one of them
    chunks = list(client.chat.completions.create(n=4, seed=40, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    got = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
           for i in range(4)}
    assert [got[i] for i in range(4)] == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n_greedy_choices_are_the_same_answer(client):
    r = client.completions.create(model=NAME, prompt=ADD, max_tokens=16, n=3)
    assert len({c.text for c in r.choices}) == 1 and [c.index for c in r.choices] == [0, 1, 2]


# ---- echo and the prompt's logprobs ---------------------------------------------------------------


@torch.inference_mode()
def forward_logprobs(ids: list[int]) -> torch.Tensor:
    model, _ = bundled()
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])
    return logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("as_ids", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(client, as_ids):
    _, tok = bundled()
    text = "Sort: 42 82 64 72 63"
    ids = tok.encode(text)
    r = client.completions.create(model=NAME, prompt=ids if as_ids else text, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    lsm = forward_logprobs(ids)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [float(lsm[i - 1, t]) for i, t in enumerate(ids) if i]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    for i in range(1, len(ids)):
        top = lsm[i - 1].topk(3)
        # token texts keep special tokens (an alternative may be <|im_end|>)
        alts = {tok.decode([t], skip_special_tokens=False): v
                for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        alts[tok.decode([ids[i]])] = float(lsm[i - 1, ids[i]])  # the chosen token is always there
        assert lp.top_logprobs[i] == pytest.approx(alts, abs=1e-5)
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]


def test_echo_with_an_answer_and_streamed(client, live):
    _, tok = bundled()
    body = dict(model=NAME, prompt=ADD, max_tokens=12, echo=True, logprobs=1)
    whole = client.completions.create(**body)
    plain = client.completions.create(model=NAME, prompt=ADD, max_tokens=12)
    assert whole.choices[0].text == ADD + plain.choices[0].text
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    n_prompt = len(tok.encode(ADD))
    answer = answer_ids(type("R", (), {"tokens": whole.model_extra["refusion"]["token_ids"]}))
    assert whole.choices[0].logprobs.tokens == [tok.decode([t]) for t in tok.encode(ADD) + answer]
    assert len(answer) >= 3 and n_prompt > 3
    # the text offsets point into the text
    lp = whole.choices[0].logprobs
    assert all(whole.choices[0].text.startswith(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True))
