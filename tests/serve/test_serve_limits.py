"""The server's limits over real HTTP: what one request may cost (the context, the per-request token
limit, max_tokens in whole blocks), and what one connection may hold (header and keep-alive
timeouts, HTTP/0.9), on uvicorn servers on 127.0.0.1 serving the bundled model.

Requests go through the official `openai` client or httpx; the connection cases through raw
sockets, since no HTTP client sends a request line a byte at a time. Timeouts are set short here
(seconds), so these cases take seconds.
"""

from __future__ import annotations

import concurrent.futures
import json
import select
import socket
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from refusion.model.cache import RaggedKVCache  # noqa: E402
from refusion.serve.app import ServeConfig, Server  # noqa: E402
from refusion.serve.params import choose  # noqa: E402
from refusion.serve.schemas import parse_completion  # noqa: E402
from tests.helpers.serving import CFG, LiveServer, bundled, solo, task_prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "refusion-tiny"
CONTEXT = CFG.max_position_embeddings
TIGHT = 450  # the per-request token limit of the `tight` server
TIMEOUT = 2.0  # header and keep-alive timeouts of both servers, in seconds


def start(**cfg) -> LiveServer:
    model, tok = bundled()
    return LiveServer(Server(model, tok, ServeConfig(model_name=NAME, header_timeout=TIMEOUT,
                                                     keep_alive_timeout=TIMEOUT, **cfg)))


@pytest.fixture(scope="module")
def live(one_thread):
    srv = start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def tight(one_thread):
    srv = start(max_request_tokens=TIGHT)
    yield srv
    srv.close()


def client_of(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ids(text: str) -> list[int]:
    return bundled()[1].encode(text)


def expected(prompt_ids: list[int], body: dict) -> list[int]:
    """The tokens decode() gives the request's prompt alone, cut at max_tokens."""
    req = parse_completion({"prompt": "x", **body})
    c = choose(req, CFG, body["max_tokens"])
    return solo(prompt_ids, c.decoder, c.params, seed=body.get("seed")).tokens[: body["max_tokens"]]


def complete(client: openai.OpenAI, prompt: list[int], body: dict):
    extra = {k: v for k, v in body.items() if k != "max_tokens"}
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=body["max_tokens"], extra_body=extra)


def refusal(client: openai.OpenAI, prompt: list[int], body: dict) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt, body)
    return e.value.body


# ---- what one request may cost -------------------------------------------------------------------

# the draft is capped (decoding.params: at most 256 draft tokens a step), and 1 + draft_length + its
# draft_length + 1 masks fed per step must fit the context (512 positions)
TOO_WIDE = [
    ({"draft_length": 10**6}, "draft_length"),
    ({"draft_length": 10**9}, "draft_length"),
    ({"draft_length": 256}, "draft_length"),  # within its cap, the step not
]


@pytest.mark.parametrize("body,param", TOO_WIDE, ids=[t[1] + str(i) for i, t in enumerate(TOO_WIDE)])
def test_a_step_wider_than_the_context_is_refused(live, body, param):
    err = refusal(client_of(live), ids("hi"), {"max_tokens": 16, **body})
    assert err["param"] == param, err
    if body["draft_length"] <= 256:  # only the step's width is too large
        assert err["code"] == "step_too_wide" and err["message"] == (
            f"1 + draft_length 256 + 257 masks = 514 tokens fed per step exceeds the model's context of {CONTEXT} "
            f"tokens; lower {param}")
    else:
        assert f"{param} {body[param]} exceeds 256" in err["message"], err


def test_costly_requests_leave_the_other_clients_served(live):
    """Requests that would have allocated gigabytes, and the widest and longest ones the limits
    admit, sent together with ordinary ones: the first are refused at once, every other one gets
    exactly what decode() gives it alone, and the server is healthy afterwards."""
    client = client_of(live)
    prompts = [ids(p) for p in task_prompts(1)]
    hostile = [{"max_tokens": 16, "draft_length": 10**6}, {"max_tokens": 16, "draft_length": 10**9},
               {"max_tokens": 16, "decoder": "refusion", "slot_size": 10**9},
               {"max_tokens": 10**6}]
    admitted = [{"max_tokens": 48, "draft_length": 255},  # a step as wide as the context (1 + 255 + 256)
                {"max_tokens": 48}, {"max_tokens": 40, "decoder": "refusion"},
                {"max_tokens": 50, "decoder": "mdm-threshold", "block_length": 32}]
    jobs = [(prompts[0], b, False) for b in hostile] + [(p, b, True) for p in prompts for b in admitted]
    jobs += [(p, {"max_tokens": CONTEXT - len(p), "decoder": "ar"}, True) for p in prompts]  # the whole context

    def run(prompt, body, ok):
        try:
            return complete(client, prompt, body).model_extra["refusion"]["token_ids"]
        except openai.BadRequestError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        out = list(ex.map(lambda j: run(*j), jobs))
    for (prompt, body, ok), got in zip(jobs, out, strict=True):
        if ok:
            assert got == expected(prompt, body), body
        else:
            assert isinstance(got, openai.BadRequestError), body
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


def test_the_per_request_token_limit(tight):
    client = client_of(tight)
    prompt = ids("Question: what is 2 + 3?\nAnswer:")
    P = len(prompt)
    assert client.models.list().data[0].model_extra["max_request_tokens"] == TIGHT
    # speculative by default: prompt + max_tokens + 1 + (1 + draft_length 32 + 33 masks) columns
    most = TIGHT - P - 67
    body = {"max_tokens": most}
    assert complete(client, prompt, body).model_extra["refusion"]["token_ids"] == expected(prompt, body)
    err = refusal(client, prompt, {"max_tokens": most + 1})
    assert err["param"] == "max_tokens" and err["code"] == "request_too_large", err
    assert err["message"] == (f"this request needs {TIGHT + 1} tokens (prompt {P} + max_tokens {most + 1} + 67 for "
                              "one step's drafts and masks (1 + draft_length 32 + 33 masks + 1)); this "
                              f"server admits at most {TIGHT} tokens per request")
    err = refusal(client, prompt, {"max_tokens": 16, "draft_length": 220})  # its step: 1 + 220 + 221 masks
    assert err["param"] == "draft_length" and f"needs {P + 16 + 443} tokens" in err["message"], err
    # a decoder that decodes whole blocks holds the rounded length
    err = refusal(client, prompt, {"max_tokens": 420, "decoder": "mdm", "block_length": 32})
    assert err["param"] == "max_tokens" and "max_tokens 420 rounded up to whole blocks, 448" in err["message"], err
    assert httpx.get(tight.url + "/health").json()["status"] == "ok"


def test_the_batch_rows_stay_within_the_limit(tight, monkeypatch):
    """Two requests each within the limit whose rows together would not be (a long answer, then a
    wide step while it runs): the second waits until the first has left the continuous batch, so
    no cache row is ever asked for, or allocated (the cache grows geometrically, but not past the
    limit), beyond the limit, and both get their solo output."""
    # this prompt makes the bundled model ramble to the length limit, one token per step (greedy AR)
    long_prompt, long_body = ids("red red red red red red"), {"max_tokens": 400, "decoder": "ar", "stream": True}
    wide_prompt, wide_body = ids("Question: what is 2 + 3?\nAnswer:"), {"max_tokens": 32, "draft_length": 30}
    # (the solo outputs first: decode() runs its own batch, a RaggedKVCache with no limit, `ar`'s too)
    want_long, want_wide = expected(long_prompt, long_body), expected(wide_prompt, wide_body)
    reserved: list[int] = []
    init, reserve = RaggedKVCache.__init__, RaggedKVCache.reserve

    def recording_init(self, *a, capacity=64, **kw):
        init(self, *a, capacity=capacity, **kw)
        reserved.extend((capacity, self.capacity))

    def recording_reserve(self, rows, capacity, *limits):
        reserve(self, rows, capacity, *limits)
        reserved.extend((capacity, self.capacity))

    monkeypatch.setattr(RaggedKVCache, "__init__", recording_init)
    monkeypatch.setattr(RaggedKVCache, "reserve", recording_reserve)
    assert len(long_prompt) + 400 + 2 <= TIGHT and len(wide_prompt) + 32 + 63 <= TIGHT  # each alone fits
    assert len(long_prompt) + 400 + 63 > TIGHT  # together they would not
    with httpx.stream("POST", tight.url + "/v1/completions", timeout=120,
                      json={"model": NAME, "prompt": long_prompt, **long_body}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: ")
        wide = complete(client_of(tight), wide_prompt, wide_body)  # sent while the long answer runs
        chunks = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
    long_tokens = [t for c in chunks for commit in c["refusion"]["commits"] for t in commit["tokens"]]
    assert long_tokens == want_long
    assert wide.model_extra["refusion"]["token_ids"] == want_wide
    assert reserved and max(reserved) <= TIGHT, reserved


# ---- max_tokens in whole blocks ------------------------------------------------------------------

ROUNDED = [
    {"max_tokens": 50, "decoder": "mdm", "block_length": 32},
    {"max_tokens": 20, "decoder": "mdm-threshold", "block_length": 16},
    {"max_tokens": 30, "decoder": "refusion", "slot_size": 7},
    {"max_tokens": 36, "decoder": "refusion-l2r", "slot_size": 8},
]


@pytest.mark.parametrize("body", ROUNDED, ids=[b["decoder"] for b in ROUNDED])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_that_is_not_whole_blocks_is_cut_from_whole_blocks(live, body, stream):
    """The decoder runs on max_tokens rounded up to whole blocks; the answer is that decode's first
    max_tokens tokens, streamed or not, and no commit past them is sent."""
    _, tok = bundled()
    prompt = ids(task_prompts(1)[1])
    want = expected(prompt, body)
    extra = {k: v for k, v in body.items() if k != "max_tokens"}
    kw = dict(model=NAME, prompt=prompt, max_tokens=body["max_tokens"], extra_body=extra)
    client = client_of(live)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        commits = [c for ch in chunks if ch.choices for c in ch.model_extra["refusion"]["commits"]]
        assert all(len(prompt) <= q < len(prompt) + body["max_tokens"] for c in commits for q in c["positions"])
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kw)
        assert r.model_extra["refusion"]["token_ids"] == want
        text, reason, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert text == tok.decode(want)
    assert usage.completion_tokens == len(want) <= body["max_tokens"]
    assert reason == ("stop" if want and want[-1] in CFG.eos_ids else "length")


def test_rounding_up_past_the_context_speaks_of_max_tokens(live):
    prompt = ids("hi")[:1] * (CONTEXT - 40)  # prompt + max_tokens fill the context; whole blocks would not
    err = refusal(client_of(live), prompt, {"max_tokens": 40, "decoder": "mdm", "block_length": 32})
    assert err["param"] == "max_tokens" and "decodes max_tokens 40 in whole blocks, 64 tokens" in err["message"], err


# ---- connections ----------------------------------------------------------------------------------


def connect(srv: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=30)  # a hang fails the test


UNREAD: dict[socket.socket, bytes] = {}  # socket -> bytes received past the responses read so far (pipelining)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (after what read_response left)."""
    out = UNREAD.pop(sock, b"")
    while chunk := sock.recv(65536):
        out += chunk
    return out


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response (with a Content-Length) from a kept-alive connection: (status, body). Bytes of
    the next response that arrived with this one (pipelined requests) are kept for the next call."""
    data = UNREAD.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    n = int(next(v for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length"))
    while len(body) < n:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-body: {body!r}"
        body += chunk
    if len(body) > n:
        UNREAD[sock] = body[n:]
    return int(lines[0].split()[1]), body[:n]


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_connection_that_sends_nothing_is_closed(live):
    with connect(live) as s:
        assert read_to_close(s) == b""
    assert httpx.get(live.url + "/health").status_code == 200


def test_headers_a_byte_at_a_time_get_408_and_a_close(live):
    with connect(live) as s:
        s.sendall(HEALTH)  # a first request on the connection is served; the next one dribbles
        assert read_response(s)[0] == 200
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for byte in b"X-Slow: " + b"a" * 200:  # never ends in time
            if select.select([s], [], [], 0.25)[0]:  # the server answered (and closes)
                break
            s.sendall(bytes([byte]))
        got = read_to_close(s)
    status_line, _, rest = got.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", got
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["message"] == \
        f"request headers not received within {TIMEOUT:g} s"


def test_http_0_9_is_answered_at_once(live):
    """A request line with no version would wait for a blank line; it is a 400 at once (not the
    header timeout's 408)."""
    with connect(live) as s:
        s.sendall(b"GET /\r\n")
        got = read_to_close(s)
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n"), got
    assert "HTTP/0.9 is not supported" in json.loads(got.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_an_idle_kept_alive_connection_is_closed(live):
    with connect(live) as s:
        s.sendall(HEALTH)
        assert read_response(s)[0] == 200
        assert read_to_close(s) == b""


def test_slow_bodies_kept_alive_and_pipelined_requests_are_served(live):
    """The header timeout stops once the headers are in: a body that takes longer than it (but not
    the body timeout) is answered; so are requests after a pause on a kept-alive connection, and
    two requests sent in one write."""
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 4}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with connect(live) as s:
        s.sendall(head)
        for i in range(0, len(body), 4):  # over about 1.5 header timeouts
            time.sleep(1.5 * TIMEOUT / (len(body) / 4))
            s.sendall(body[i: i + 4])
        status, answer = read_response(s)
        assert status == 200 and json.loads(answer)["object"] == "text_completion"
        time.sleep(TIMEOUT / 4)
        s.sendall(HEALTH)
        assert read_response(s)[0] == 200
        s.sendall(HEALTH + HEALTH)
        assert [read_response(s)[0] for _ in range(2)] == [200, 200]
        assert UNREAD.pop(s, b"") == b"", "more bytes than the two responses"


def test_the_step_width_names_the_branches_of_a_forking_request():
    """A request that forks (the model's decoding.json can set fork) reserves columns for its branches,
    and a refusal says so."""
    from refusion.decoding.params import MAX_BRANCHES, SpeculativeParams
    from refusion.serve import budget
    from refusion.serve.params import DecoderChoice

    spec = SpeculativeParams(gen_length=64, draft_length=100, mask_length=100, widths="fixed", fork=True)
    choice = DecoderChoice("speculative", {}, spec, 64)
    assert budget.step_width(choice) == 1 + 100 + 100 + MAX_BRANCHES * 100
    with pytest.raises(budget.RequestError, match=rf"1 \+ draft_length 100 \+ 100 masks \+ {MAX_BRANCHES * 100} "
                                                  r"for redraft blocks or branches = 501 tokens fed per step"):
        budget.check(10, choice, 400, 10_000)
