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

import httpx
import jsonschema
import openai
import pytest
import torch

from refusion.decoding import Controls, decode, grammar
from tests.helpers.serving import NAME, bundled, chat_ids

pytestmark = pytest.mark.usefixtures("one_thread")
CODE = "Continue this Python code:\nimport os"  # many likely continuations: samples differ
ADD = "Add: 12 + 30 + 7"


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


def test_several_prompts_n_choices_each(client):
    """OpenAI's batch of prompts: choice p * n + j is prompt p's j-th, seeded seed + its index."""
    _, tok = bundled()
    model, _ = bundled()
    prompts = [CODE, tok.encode(ADD)]
    r = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=16, temperature=1.0, seed=3, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        p = prompts[c.index // 2]
        ids = tok.encode(p) if isinstance(p, str) else p
        want = decode(model, [ids], "ar", eos_ids=model.config.eos_ids, gen_length=16, temperature=1.0,
                      seed=3 + c.index)[0]
        echo = p if isinstance(p, str) else tok.decode(p)
        assert c.text == echo + tok.decode(answer_ids(want)), c.index
    assert r.usage.prompt_tokens == len(tok.encode(CODE)) + len(tok.encode(ADD))
    chunks = list(client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=16, temperature=1.0, seed=3,
                                            echo=True, stream=True))
    got = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(4)]
    assert got == [c.text for c in r.choices]


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


def test_echo_streamed_with_max_tokens_0(client):
    chunks = list(client.completions.create(model=NAME, prompt=ADD, max_tokens=0, echo=True, logprobs=2, stream=True))
    whole = client.completions.create(model=NAME, prompt=ADD, max_tokens=0, echo=True, logprobs=2)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ADD == whole.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) == 1 and streamed[0].tokens == whole.choices[0].logprobs.tokens
    assert streamed[0].token_logprobs[0] is None
    assert streamed[0].token_logprobs[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], rel=1e-5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_echo_scores_each_prompt_once_for_its_n_choices(client, monkeypatch):
    import refusion.serve.engine as engine

    calls = []
    real = engine.prompt_logprobs
    monkeypatch.setattr(engine, "prompt_logprobs", lambda model, prompt, top: calls.append(prompt) or real(model, prompt, top))
    prompts = [ADD, "Sort: 5 3 9"]
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=4, echo=True, logprobs=1, n=3,
                                    temperature=0.8, seed=5)
    ids = [bundled()[1].encode(p) for p in prompts]
    assert sorted(calls) == sorted(ids)  # once per prompt, not per choice
    assert len(got.choices) == 6
    for p, k, group in zip(prompts, map(len, ids), (got.choices[:3], got.choices[3:]), strict=True):
        first = group[0].logprobs
        assert first.token_logprobs[0] is None and all(v is not None for v in first.token_logprobs[1:k])
        for c in group:  # (each choice's echo: the prompt's logprobs, then its own answer's)
            assert c.text.startswith(p)
            assert c.logprobs.tokens[:k] == first.tokens[:k]
            assert c.logprobs.token_logprobs[:k] == first.token_logprobs[:k]


def test_echo_with_an_answer_and_streamed(client, live):
    _, tok = bundled()
    body = dict(model=NAME, prompt=ADD, max_tokens=12, echo=True, logprobs=1)
    whole = client.completions.create(**body)
    plain = client.completions.create(model=NAME, prompt=ADD, max_tokens=12)
    assert whole.choices[0].text == ADD + plain.choices[0].text
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    # (two forwards of one prompt agree to float rounding, not always bit for bit)
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], rel=1e-5)
    n_prompt = len(tok.encode(ADD))
    answer = answer_ids(type("R", (), {"tokens": whole.model_extra["refusion"]["token_ids"]}))
    assert whole.choices[0].logprobs.tokens == [tok.decode([t]) for t in tok.encode(ADD) + answer]
    assert len(answer) >= 3 and n_prompt > 3
    # the text offsets point into the text
    lp = whole.choices[0].logprobs
    assert all(whole.choices[0].text.startswith(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True))


# ---- logprobs -----------------------------------------------------------------------------------


def chat_logprobs_of(res, tok) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """decode()'s logprobs as chat entries: (token text, logprob, [(alternative, logprob)])."""
    n = len(answer_ids(res))
    return [(tok.decode([t], skip_special_tokens=False), lp, [(tok.decode([a], skip_special_tokens=False), alp)
                                                             for a, alp in top])
            for t, lp, top in zip(res.tokens[:n], res.logprobs.chosen[:n], res.logprobs.top[:n], strict=True)]


def entries(content) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]


def assert_same_logprobs(got, want):
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        # (speculative's forwards are wider than ar's: the same numbers to float rounding)
        assert g[1] == pytest.approx(w[1], rel=1e-5, abs=1e-5)
        assert [a for a, _ in g[2]] == [a for a, _ in w[2]]
        assert [x for _, x in g[2]] == pytest.approx([x for _, x in w[2]], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("decoder,temperature", [("speculative", 0.0), ("speculative", 0.8), ("ar", 0.0)])
def test_chat_logprobs_equal_ar_decodings(client, decoder, temperature):
    _, tok = bundled()
    msgs = [{"role": "user", "content": ADD}]
    kw = dict(model=NAME, messages=msgs, max_tokens=24, logprobs=True, top_logprobs=3, temperature=temperature,
              seed=5, extra_body={"decoder": decoder})
    r = client.chat.completions.create(**kw)
    want = ar(chat_ids(ADD), 24, Controls(logprobs=3), temperature=temperature, seed=5)
    assert r.choices[0].message.content == tok.decode(answer_ids(want))
    got = entries(r.choices[0].logprobs.content)
    assert len(got) >= 5
    assert_same_logprobs(got, chat_logprobs_of(want, tok))
    assert all(bytes(e.bytes).decode() == e.token for e in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert_same_logprobs(entries(streamed), got)


def test_completion_logprobs_and_a_stop_string(client):
    _, tok = bundled()
    full = client.completions.create(model=NAME, prompt=CODE, max_tokens=24, logprobs=2)
    text = full.choices[0].text
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(t) <= 3 and max(t.values()) >= x for t, x in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # a stop string: the logprobs end with the token that completes it, as the usage does
    stop = text[len(text) // 2: len(text) // 2 + 2]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=CODE, max_tokens=24, logprobs=2, stop=[stop], stream=stream)
        if stream:
            cut = [t for c in r if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        else:
            cut = r.choices[0].logprobs.tokens
        k = len(cut)
        assert cut == lp.tokens[:k] and stop in "".join(cut) and stop not in "".join(cut[:-1])


# ---- logit_bias and penalties -------------------------------------------------------------------


def test_logit_bias_against_the_greedy_token(client):
    _, tok = bundled()
    ids = chat_ids(ADD)
    plain = ar(ids, 16)
    first = plain.tokens[0]
    for bias in ({first: -100}, {first: -100, tok.encode(" 9")[0]: 30}):
        body = {str(k): v for k, v in bias.items()}
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ADD}], max_tokens=16,
                                           logit_bias=body)
        want = ar(ids, 16, Controls(logit_bias=bias))
        assert want.tokens[0] != first  # the banned token never comes first
        assert r.model_extra["refusion"]["token_ids"] == want.tokens
        chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ADD}],
                                                max_tokens=16, logit_bias=body, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize("prompt,presence,frequency", [
    ("red red red red red red", 0.0, 2.0), ("red red red red red red", -1.0, 0.5), (CODE, 2.0, 0.0),
    (CODE, -2.0, 0.0)])
def test_penalties_equal_ar_with_the_same_penalties(client, prompt, presence, frequency):
    ids = bundled()[1].encode(prompt)  # raw text: the model is less sure of itself than in its chat format
    want = ar(ids, 32, Controls(presence_penalty=presence, frequency_penalty=frequency))
    assert want.tokens != ar(ids, 32).tokens  # the penalties change the answer
    kw = dict(model=NAME, prompt=prompt, max_tokens=32, presence_penalty=presence, frequency_penalty=frequency)
    r = client.completions.create(**kw)
    assert r.model_extra["refusion"]["token_ids"] == want.tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].text == bundled()[1].decode(answer_ids(want))


# ---- structured outputs ---------------------------------------------------------------------------


def test_regex_and_choice(client):
    msgs = [{"role": "user", "content": ADD}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{1,3} is the sum"}})
    assert re.fullmatch("[0-9]{1,3} is the sum", r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    choices = ["forty-nine", "49", "fifty"]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=ADD + " =", max_tokens=12, stream=stream,
                                      extra_body={"structured_outputs": {"choice": choices}})
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text in choices


def test_bad_controls_are_400s_and_the_server_stays_up(client, live):
    msgs = [{"role": "user", "content": ADD}]
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
         "response_format", "invalid json schema"),
        (dict(extra_body={"structured_outputs": {"regex": "(["}}), "structured_outputs.regex", "invalid regex"),
        (dict(logit_bias={"100000": 3}), "logit_bias", "outside the vocabulary"),
        (dict(logprobs=True, top_logprobs=30), "top_logprobs", "top_logprobs must be in [0, 20]"),
        (dict(extra_body={"guided_choice": ["a"]}), "guided_choice", "structured_outputs.choice"),
        (dict(response_format={"type": "json_object"}, extra_body={"decoder": "mdm"}), "response_format",
         "the decoders that can: speculative, ar"),
    ]
    for kw, param, fragment in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, **kw)
        assert e.value.body["param"] == param and fragment in e.value.body["message"], e.value.body
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    assert client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_while_decoding_is_a_400(client, live, stream):
    """llguidance compiles lazily: `a{1000000}` passes compilation and fails at its first token,
    inside the engine, before anything was sent: a 400 naming the grammar, streamed or not, and the
    next request is answered as before."""
    msgs = [{"role": "user", "content": ADD}]
    (want,) = decode(bundled()[0], [chat_ids(ADD)], "speculative", gen_length=8)
    body = dict(model=NAME, messages=msgs, max_tokens=8, extra_body={"structured_outputs": {"regex": "a{1000000}"}})
    with pytest.raises(openai.BadRequestError) as e:
        if stream:
            for _ in client.chat.completions.create(stream=True, **body):
                pass
        else:
            client.chat.completions.create(**body)
    assert "the grammar failed while decoding" in e.value.body["message"], e.value.body
    ok = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, extra_body={"decoder": "speculative"})
    assert ok.choices[0].message.content == bundled()[1].decode(want.tokens)
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


SCHEMAS = [
    {"type": "object", "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "op": {"enum": ["add", "sort", "repeat"]}},
     "required": ["sum", "op"], "additionalProperties": False},
    {"type": "object", "properties": {"terms": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99},
                                                "minItems": 2, "maxItems": 4},
                                      "result": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                                  "checked": {"type": "boolean"}},
                                                 "required": ["value", "checked"], "additionalProperties": False}},
     "required": ["terms", "result"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "words": {"type": "array", "items": {"enum": ["sun", "moon", "star"]},
                                                "maxItems": 3}},
     "required": ["code", "words"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "nested-array-bounds", "pattern"])
def test_response_format_json_schema_validates_and_equals_ar(client, schema):
    _, tok = bundled()
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw = dict(model=NAME, messages=[{"role": "user", "content": ADD}], max_tokens=96, response_format=rf)
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"
    want = ar(chat_ids(ADD), 96, Controls(grammar=grammar.json_schema(tok, schema)))
    assert r.model_extra["refusion"]["token_ids"] == want.tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text
    # sampled, several choices: each one valid
    many = client.chat.completions.create(n=3, temperature=1.0, seed=1, **kw)
    for c in many.choices:
        jsonschema.validate(json.loads(c.message.content), schema)


def test_parse_with_a_pydantic_model(client):
    import pydantic

    from typing import Annotated, Literal

    class Sum(pydantic.BaseModel):  # bounded: a tiny model may not stop a free list by itself
        op: Literal["add", "sort"]
        terms: Annotated[list[Annotated[int, pydantic.Field(ge=0, le=99)]], pydantic.Field(max_length=3)]
        total: Annotated[int, pydantic.Field(ge=0, le=999)]

    r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": ADD}], max_tokens=96,
                                      response_format=Sum)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Sum) and parsed == Sum.model_validate_json(r.choices[0].message.content)


def test_json_object_and_structured_outputs_json(client):
    schema = SCHEMAS[0]
    for kw in (dict(extra_body={"response_format": {"type": "json_object"}}),
               dict(extra_body={"structured_outputs": {"json": schema}}),
               dict(extra_body={"structured_outputs": {"json": json.dumps(schema)}})):
        r = client.completions.create(model=NAME, prompt=ADD, max_tokens=64, **kw)
        value = json.loads(r.choices[0].text)
        assert isinstance(value, dict) and r.choices[0].finish_reason == "stop"
        if "structured_outputs" in kw["extra_body"]:
            jsonschema.validate(value, schema)
