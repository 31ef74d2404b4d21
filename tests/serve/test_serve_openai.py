"""`refusion serve` against real clients: the official `openai` package and raw HTTP (httpx), on a
uvicorn server on 127.0.0.1 serving the bundled model.

Every answer is checked against what `decode()` gives the same prompt alone, including answers to
requests that ran concurrently (continuous batching must not change anyone's output).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from refusion.serve.params import choose  # noqa: E402
from refusion.serve.schemas import parse_completion  # noqa: E402
from tests.helpers.serving import CFG, NAME, bundled, chat_ids, solo, task_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def expected(prompt_ids: list[int], body: dict):
    """decode() alone for a request body, with the server's own mapping of fields to parameters."""
    req = parse_completion({"prompt": "x", **body})
    c = choose(req, CFG, body["max_tokens"])
    return solo(prompt_ids, c.decoder, c.params, seed=body.get("seed"))


DECODER_BODIES = [
    {"max_tokens": 48},  # the default decoder (speculative)
    {"max_tokens": 48, "decoder": "refusion", "slot_size": 8},
    {"max_tokens": 64, "decoder": "refusion", "slot_size": 4, "slot_threshold": 0.7, "checks": True},
    {"max_tokens": 48, "decoder": "refusion-l2r"},
    {"max_tokens": 48, "decoder": "ar"},
    {"max_tokens": 64, "decoder": "mdm", "block_length": 32, "steps": 32},
    {"max_tokens": 64, "decoder": "mdm-threshold", "block_length": 32},
]


def test_models_health_and_page(live, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    h = httpx.get(live.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == NAME
    page = httpx.get(live.url + "/")
    assert page.status_code == 200 and "<textarea" in page.text


@pytest.mark.parametrize("body", DECODER_BODIES, ids=[b.get("decoder", "default") for b in DECODER_BODIES])
def test_chat_answer_equals_decode_alone(client, body):
    prompt = task_prompts(1)[1]
    extra = {k: v for k, v in body.items() if k != "max_tokens"}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=body["max_tokens"], extra_body=extra)
    want = expected(chat_ids(prompt), body)
    _, tok = bundled()
    ext = r.model_extra["refusion"]
    assert ext["token_ids"] == want.tokens and ext["positions"] == want.positions
    assert r.choices[0].message.content == tok.decode(want.tokens)
    assert r.choices[0].finish_reason == ("stop" if want.finished else "length")
    assert r.usage.prompt_tokens == len(chat_ids(prompt)) and r.usage.completion_tokens == len(want.tokens)


def test_completion_takes_text_or_token_ids(client):
    _, tok = bundled()
    text = "Question: what is 2 + 3?\nAnswer:"
    a = client.completions.create(model=NAME, prompt=text, max_tokens=24)
    b = client.completions.create(model=NAME, prompt=tok.encode(text), max_tokens=24)
    want = expected(tok.encode(text), {"max_tokens": 24})
    assert a.choices[0].text == b.choices[0].text == tok.decode(want.tokens)
    assert a.object == "text_completion" and a.usage.completion_tokens == len(want.tokens)


@pytest.mark.parametrize("decoder", ["speculative", "refusion", "mdm-threshold"])
def test_stream_equals_the_non_streamed_answer(client, decoder):
    prompt = task_prompts(1)[1]
    body = {"decoder": decoder, "block_length": 32} if decoder == "mdm-threshold" else {"decoder": decoder}
    msgs = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=64, extra_body=body)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=64, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    # the extension: every committed token arrives once, with its position, in commit order
    commits = [c for ch in chunks if ch.choices for c in ch.model_extra["refusion"]["commits"]]
    got = {q: t for c in commits for q, t in zip(c["positions"], c["tokens"], strict=True)}
    ext = whole.model_extra["refusion"]
    assert {q: got[q] for q in ext["positions"]} == dict(zip(ext["positions"], ext["token_ids"], strict=True))
    assert sum(len(c["positions"]) for c in commits) == len(got)
    assert chunks[0].model_extra["refusion"]["prompt_tokens"] == len(chat_ids(prompt))


def test_completion_stream_and_done_marker(live):
    body = {"model": NAME, "prompt": "Question: what is 2 + 3?\nAnswer:", "max_tokens": 16, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["refusion"]["stats"]["tokens"] >= 1


def test_stop_sequences(client):
    prompt = task_prompts(1)[1]  # a code task: the answer has several lines
    full = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=64)
    text = full.choices[0].message.content
    assert "\n" in text
    stop = text[text.index("\n"): text.index("\n") + 3]
    for stream in (False, True):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=64,
                                           stop=[stop, "zzz-never"], stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[: text.index(stop)] and reason == "stop"


def test_seeds_reproduce(client):
    prompt = [{"role": "user", "content": "Continue this Python code:\nimport os"}]  # many likely continuations
    for decoder in ("speculative", "refusion", "ar"):
        kw = dict(model=NAME, messages=prompt, max_tokens=48, temperature=1.0, extra_body={"decoder": decoder})
        a = client.chat.completions.create(seed=7, **kw).model_extra["refusion"]["token_ids"]
        b = client.chat.completions.create(seed=7, **kw).model_extra["refusion"]["token_ids"]
        c = client.chat.completions.create(seed=8, **kw).model_extra["refusion"]["token_ids"]
        assert a == b and a != c, decoder


def test_errors_through_the_openai_client(client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (openai.BadRequestError, dict(n=200), "n must be in [1, 128]"),
        (openai.BadRequestError, dict(logprobs=True, extra_body={"decoder": "refusion"}), "the decoders that can"),
        (openai.NotFoundError, dict(model="gpt-4"), "does not exist"),
        (openai.BadRequestError, dict(max_tokens=100000), "exceeds this server's cap"),
        (openai.BadRequestError, dict(extra_body={"decoder": "refusion", "slot_size": 0}), "slot_size must be"),
        (openai.BadRequestError, dict(extra_body={"decoder": "mdm", "slot_size": 8}), "does not take slot_size"),
        (openai.BadRequestError, dict(messages=[{"role": "user", "content": "many " * 1500}]), "maximum context length"),
    ]
    for exc, kw, fragment in cases:
        with pytest.raises(exc) as e:
            client.chat.completions.create(**{"model": NAME, "messages": msgs, "max_tokens": 16, **kw})
        assert fragment in e.value.body["message"], kw


RAW_CASES = [
    (b'{"prompt": "hi", "max_tokens": 8', 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 8}', 400, "not valid UTF-8"),
    (b'{"prompt": "hi", "max_tokens": "8"}', 400, "max_tokens must be an integer"),
    (b'{"prompt": "", "max_tokens": 8}', 400, "prompt is empty"),
    (b'{"prompt": [100000], "max_tokens": 8}', 400, "outside the vocabulary"),
    (b'["prompt"]', 400, "must be a JSON object"),
    (b'{"prompt": "hi", "model": "nope"}', 404, "does not exist"),
    (b'{"prompt": "hi", "max_tokens": 8, "x": 1}', 400, "unrecognized request argument"),
    (b'{"prompt": "hi"}' + b" " * (2 << 20), 413, "larger than"),
]


@pytest.mark.parametrize("body,code,fragment", RAW_CASES, ids=[str(i) for i in range(len(RAW_CASES))])
def test_raw_errors_are_openai_error_objects(live, body, code, fragment):
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == code
    err = r.json()["error"]
    assert fragment in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_unknown_routes_and_methods(live):
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_queue_full_is_429_with_retry_after(live, client):
    eng = live.server.engine
    eng.max_queue, old = 0, eng.max_queue
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=NAME, prompt="hi", max_tokens=8)
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        eng.max_queue = old


def test_concurrent_requests_each_equal_decode_alone(live, client):
    """Mixed decoders, streamed and not, all in flight together: everyone gets their solo output."""
    prompts = task_prompts(2)
    jobs = []
    for i, p in enumerate(prompts):
        body = dict(DECODER_BODIES[i % len(DECODER_BODIES)])
        if i % 3 == 0:
            body.update(temperature=0.8, seed=100 + i)
        jobs.append((p, body, i % 2 == 0))

    def run(p, body, stream):
        extra = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature", "seed")}
        kw = dict(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=body["max_tokens"],
                  temperature=body.get("temperature"), seed=body.get("seed"), extra_body=extra)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        texts = list(ex.map(lambda j: run(*j), jobs))
    _, tok = bundled()
    for (p, body, _), text in zip(jobs, texts, strict=True):
        assert text == tok.decode(expected(chat_ids(p), body).tokens), body


def wait_idle(live, timeout=10.0) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        h = httpx.get(live.url + "/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return time.time() - t0
        time.sleep(0.01)
    raise AssertionError(f"the server still runs sequences {timeout} s after the clients left: {h}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_sequence(live, stream):
    # this raw prompt makes the bundled model ramble to the length limit, one token per step (greedy AR)
    body = {"model": NAME, "prompt": "red red red red red red", "max_tokens": 400, "stream": stream, "decoder": "ar"}
    steps0 = live.server.engine.steps
    if stream:
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # one chunk, then hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.1)
    wait_idle(live)
    # freed long before the 400 tokens (steps) it asked for
    assert live.server.engine.steps - steps0 < 300


class Poisoned:
    """A batch factory whose batches fail every step while a poisoned prompt is in them."""

    def __init__(self, factory, poison):
        self.factory, self.poison = factory, poison

    def __call__(self, model, eos_ids=None, **limits):
        batch, poison = self.factory(model, eos_ids=eos_ids, **limits), self.poison
        bad: set[int] = set()
        add, step, cancel = batch.add, batch.step, batch.cancel

        def p_add(prompt, p, **kw):
            sid = add(prompt, p, **kw)
            if prompt[-len(poison):] == poison:
                bad.add(sid)
            return sid

        def p_step():
            if bad:
                raise RuntimeError("poisoned sequence")
            return step()

        def p_cancel(sid):
            bad.discard(sid)
            return cancel(sid)

        batch.add, batch.step, batch.cancel = p_add, p_step, p_cancel
        return batch


def test_an_exception_in_one_sequence_fails_only_that_request(live, client, monkeypatch):
    import refusion.serve.engine as engine_mod

    eng = live.server.engine
    _, tok = bundled()
    poison_text = "poison pill"
    poison = tok.encode(poison_text)
    monkeypatch.setattr(eng, "batch_factory", Poisoned(eng.batch_factory, poison))
    monkeypatch.setattr(eng, "batch", eng.batch_factory(eng.model, eos_ids=eng.eos_ids))  # the engine is idle
    real_decode = engine_mod.decode

    def poisoned_decode(model, prompts, *a, **kw):
        if any(p[-len(poison):] == poison for p in prompts):
            raise RuntimeError("poisoned group")
        return real_decode(model, prompts, *a, **kw)

    monkeypatch.setattr(engine_mod, "decode", poisoned_decode)
    good = task_prompts(1)
    jobs = [(p, {"max_tokens": 48, **d}) for p in good for d in ({}, {"decoder": "refusion"})]
    jobs += [(poison_text, {"max_tokens": 48}), (poison_text, {"max_tokens": 48, "decoder": "refusion"})]

    def run(p, body):
        extra = {k: v for k, v in body.items() if k != "max_tokens"}
        try:
            return client.completions.create(model=NAME, prompt=p, max_tokens=48, extra_body=extra).choices[0].text
        except openai.InternalServerError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        out = list(ex.map(lambda j: run(*j), jobs))
    for (p, body), r in zip(jobs, out, strict=True):
        if p == poison_text:
            assert isinstance(r, openai.InternalServerError) and "poisoned" in r.body["message"]
        else:
            assert r == tok.decode(expected(tok.encode(p), body).tokens)
    monkeypatch.undo()
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=8).choices[0].text is not None
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


def test_metrics(live, client):
    client.completions.create(model=NAME, prompt="hi", max_tokens=8)
    text = httpx.get(live.url + "/metrics").text
    for name in ("refusion_requests_total", "refusion_generated_tokens_total", "refusion_sequence_forwards_total",
                 "refusion_tokens_per_forward_bucket", "refusion_queue_depth", "refusion_running_sequences",
                 "refusion_time_to_first_token_seconds_bucket", "refusion_request_latency_seconds_bucket"):
        assert name in text, name
    assert 'refusion_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'status="400"' in text or 'status="413"' in text


def test_a_seeded_request_gets_the_same_text_alone_and_in_a_busy_batch(client):
    """Seeded samples are a function of the seed and the position: neither the other requests in the
    continuous batch nor the widths change them, and sampled ar gives the same text."""
    prompt = [{"role": "user", "content": "Continue this Python code:\nimport os"}]  # many likely continuations
    kw = dict(model=NAME, messages=prompt, max_tokens=64, temperature=0.9, top_p=0.95, seed=11)

    def text(**extra):
        return client.chat.completions.create(**{**kw, **extra}).choices[0].message.content

    alone = text()
    assert text(seed=12) != alone  # the seed matters
    assert text(extra_body={"decoder": "ar"}) == alone
    others = [dict(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=48 + 8 * i,
                   temperature=[0.0, 0.7, 1.2][i % 3], seed=i) for i, p in enumerate(task_prompts(1))]
    widths = [{}, {"draft_length": 4}, {"draft_length": 32}, {"draft_length": 0}]
    with concurrent.futures.ThreadPoolExecutor(len(others) + len(widths)) as ex:
        busy = [ex.submit(client.chat.completions.create, **o) for o in others]
        mine = [ex.submit(text, extra_body=w) for w in widths]
        assert [m.result() for m in mine] == [alone] * len(widths)
        for b in busy:
            b.result()
