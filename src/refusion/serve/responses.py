"""One generation request on the asyncio side: the engine's events in, OpenAI's shapes out, as one
JSON object (`RequestRun.collect`) or as SSE chunks (`RequestRun.sse`, sent by `StreamResponse`).

A request with n choices is n engine jobs, one per choice (a completions request with several
prompts: n per prompt, choice p * n + j for prompt p); their events come through one queue,
tagged with the choice's index. A stream's chunks each carry one choice (its `index`), as
OpenAI's do. Logprobs follow the text: a token's entry goes out once it is in the complete prefix
(never past a stop string or the EOS), with the prompt's entries first under echo.

A RequestRun knows its server only through what `ServerView` names, so this module imports nothing
from the app (which imports it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from starlette.requests import Request

from refusion.decoding.common import DecodeResult
from refusion.decoding.controls import Logprobs
from refusion.model.tokenizer import Tokenizer
from refusion.serve.engine import Engine, Event, Job
from refusion.serve.logprobs import TokenText, merge_completion
from refusion.serve.metrics import Metrics
from refusion.serve.params import DecoderChoice
from refusion.serve.schemas import ChatRequest, CompletionRequest, RequestError
from refusion.serve.text import TextAssembler


class ServerView(Protocol):
    """What a RequestRun reads of its server (refusion.serve.app.Server)."""

    tok: Tokenizer
    eos_ids: list[int]
    engine: Engine
    metrics: Metrics
    cfg: Any  # ServeConfig: its model_name


@dataclass
class _Choice:
    """One choice's state: its prompt, its job, its text so far, its tokens' logprobs by position."""

    index: int
    prompt: list[int]
    source: str | list[int]  # the prompt as the request gave it (echo returns its text)
    text: TextAssembler
    job: Job | None = None
    logprobs: dict[int, tuple[float, Any]] = field(default_factory=dict)  # position -> (logprob, top)
    emitted: int = 0  # prefix tokens whose logprobs were handed out
    prompt_logprobs: Logprobs | None = None  # echo's
    started: bool = False  # its first chunk went out
    done: bool = False
    result: DecodeResult | None = None

    def note(self, positions: list[int], lp: Logprobs | None) -> None:
        if lp is not None:
            for q, c, t in zip(positions, lp.chosen, lp.top, strict=True):
                self.logprobs[q] = (c, t)

    def fresh(self) -> tuple[list[int], list[float], list[Any]]:
        """The prefix tokens whose logprobs are due: in the text's prefix, up to a stop string."""
        prefix = self.text.prefix
        end = self.text.tokens_at_stop if self.text.stopped else len(prefix)
        toks, chosen, top = [], [], []
        while self.emitted < end and (q := self.text.start + self.emitted) in self.logprobs:
            c, t = self.logprobs[q]
            toks.append(prefix[self.emitted])
            chosen.append(c)
            top.append(t)
            self.emitted += 1
        return toks, chosen, top


class RequestRun:
    """One generation request on the asyncio side: events in, OpenAI shapes out."""

    def __init__(self, server: ServerView, req: CompletionRequest | ChatRequest, prompts: list[list[int]],
                 choice: DecoderChoice, chat: bool, arrived: float) -> None:
        self.server, self.req, self.prompts, self.choice, self.chat = server, req, prompts, choice, chat
        self.arrived = arrived
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        sources = [None] if chat else req.prompts
        self.choices = [_Choice(p * req.n + j, ids, src, TextAssembler(server.tok, len(ids), server.eos_ids, req.stop))
                        for p, (ids, src) in enumerate(zip(prompts, sources, strict=True)) for j in range(req.n)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.watcher: asyncio.Task | None = None
        self.first_token: float | None = None
        self.shapes = TokenText(server.tok) if req.logprobs is not None else None
        self.echo = not chat and getattr(req, "echo", False)

    def sink(self, index: int) -> Callable[[Event], None]:
        """The sink of choice `index`'s job; called on the engine thread."""
        return lambda ev: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))

    def jobs(self, seeds: list[int | None]) -> list[Job]:
        """One job per choice (the app submits them)."""
        score = self.req.logprobs if self.echo else None
        scored: set[tuple[int, ...]] = set()  # (a prompt's n choices share its logprobs: events())
        for c, seed in zip(self.choices, seeds, strict=True):
            first = tuple(c.prompt) not in scored
            scored.add(tuple(c.prompt))
            c.job = Job(prompt=c.prompt, choice=self.choice, seed=seed, sink=self.sink(c.index),
                        score=score if first else None)
        return [c.job for c in self.choices]

    def cancel(self) -> None:
        for c in self.choices:
            if c.job is not None and not c.job.closed:
                self.server.engine.cancel(c.job)

    def watch(self, request: Request) -> None:
        async def wait_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait((-1, Event("gone")))
        self.watcher = asyncio.create_task(wait_gone())

    async def events(self) -> AsyncIterator[tuple]:
        """("commit", choice, delta_text, commits, logprobs) ... ("done", choice, result,
        finish_reason, logprobs) for each choice, or ("error", message, status), which ends the request.
        logprobs: (tokens, logprobs, tops) newly due. Events that arrived together are merged per
        choice, so a slow reader gets fewer, larger chunks."""
        try:
            while not all(c.done for c in self.choices):
                evs = [await self.queue.get()]
                while not self.queue.empty():
                    evs.append(self.queue.get_nowait())
                pending: dict[int, tuple[str, list]] = {}  # choice -> (text, commits) not yet handed out
                for i, ev in evs:
                    if ev.kind == "gone":
                        self.cancel()
                        return
                    if ev.kind == "error":
                        yield "error", ev.message, ev.status
                        return
                    c = self.choices[i]
                    if ev.kind == "prompt":  # (scored by its first choice: the engine admits it first)
                        for d in self.choices:
                            if d.prompt == c.prompt:
                                d.prompt_logprobs = ev.logprobs
                    elif ev.kind == "commit":
                        pending[i] = self._commit(c, ev, *pending.get(i, ("", [])))
                    elif ev.kind == "done":
                        for out in self._done(c, ev, *pending.pop(i, ("", []))):
                            yield out
                for i, (delta, commits) in pending.items():
                    if delta or commits:
                        yield "commit", self.choices[i], delta, commits, self.choices[i].fresh()
        finally:
            if self.watcher is not None:
                self.watcher.cancel()
            self.cancel()

    def _commit(self, c: _Choice, ev: Event, delta: str, commits: list) -> tuple[str, list]:
        """A commit event into the choice's text and logprobs; the text and commits gathered."""
        ev = self._within(c, ev)
        if not ev.positions:
            return delta, commits
        server = self.server
        if self.first_token is None:
            self.first_token = time.perf_counter()
            server.metrics.ttft.observe(self.first_token - self.arrived)
        commits.append({"positions": ev.positions, "tokens": ev.tokens, "step": ev.step,
                        "pieces": [server.tok.decode([t]) for t in ev.tokens]})
        c.note(ev.positions, ev.logprobs)
        delta += c.text.add(ev.positions, ev.tokens)
        if c.text.stopped:
            server.engine.cancel(c.job)  # the answer is complete: free the sequence now
        return delta, commits

    def _done(self, c: _Choice, ev: Event, delta: str, commits: list) -> list[tuple]:
        """The choice's last commit (if any) and its done."""
        res = _cut(ev.result, self.choice.cut)
        c.note(res.positions, res.logprobs)
        if not c.text.stopped and not ev.cancelled:
            delta += c.text.add(res.positions, res.tokens) + c.text.finish()
        out: list[tuple] = [("commit", c, delta, commits, ([], [], []))] if commits or delta else []
        reason = "stop" if c.text.stopped or res.finished else "length"
        self.server.metrics.finished(len(res.tokens), res.forwards)
        c.done, c.result = True, res
        return out + [("done", c, res, reason, c.fresh())]

    def _within(self, c: _Choice, ev: Event) -> Event:
        """A commit event without the positions past max_tokens (a decoder that works in whole
        blocks decodes up to the end of the last one)."""
        end = len(c.prompt) + self.choice.cut
        if all(q < end for q in ev.positions):
            return ev
        keep = [i for i, q in enumerate(ev.positions) if q < end]
        lp = ev.logprobs
        if lp is not None:
            lp = Logprobs([lp.chosen[i] for i in keep], [lp.top[i] for i in keep])
        return Event("commit", [ev.positions[i] for i in keep], [ev.tokens[i] for i in keep], step=ev.step,
                     logprobs=lp)

    # ---- echo and logprobs ----------------------------------------------------------------------

    def _echo_text(self, c: _Choice) -> str:
        return c.source if isinstance(c.source, str) else self.server.tok.decode(c.source)

    def _prompt_logprobs(self, c: _Choice) -> dict | None:
        """Completions' logprobs of the prompt's tokens (echo), the first with none."""
        if self.shapes is None or c.prompt_logprobs is None:
            return None
        chosen: list[float | None] = [None, *c.prompt_logprobs.chosen]
        top: list = [None, *c.prompt_logprobs.top]
        return self.shapes.completion(c.prompt, chosen, top, 0)[0]

    def _answer_logprobs(self, due: tuple, offset: int) -> tuple[Any, int]:
        """The due tokens' logprobs in the endpoint's shape, and the text offset after them."""
        if self.chat:
            return self.shapes.chat(*due), offset
        return self.shapes.completion(*due, offset)

    # ---- non-streaming ------------------------------------------------------------------------

    async def collect(self) -> dict | RequestError:
        reasons: dict[int, str] = {}
        logprobs: dict[int, Any] = {}
        offsets = {c.index: len(self._echo_text(c)) if self.echo else 0 for c in self.choices}
        async for kind, *payload in self.events():
            if kind == "error":
                return error_of(*payload)
            c, due = payload[0], payload[-1]
            if self.shapes is not None and due[0]:
                part, offsets[c.index] = self._answer_logprobs(due, offsets[c.index])
                logprobs[c.index] = (logprobs.get(c.index, []) + part if self.chat
                                     else merge_completion(logprobs.get(c.index), part))
            if kind == "done":
                reasons[c.index] = payload[2]
        if len(reasons) < len(self.choices):  # the client went away; nobody reads this
            return RequestError(499, "client closed the request")
        out = []
        for c in self.choices:
            text, lp = c.text.sent, logprobs.get(c.index)
            if self.chat:
                if self.shapes is not None:
                    lp = {"content": lp or [], "refusal": None}
                out.append({"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": reasons[c.index]})
                continue
            if self.echo:
                text = self._echo_text(c) + text
                if self.shapes is not None:
                    lp = merge_completion(self._prompt_logprobs(c), lp or self.shapes.completion([], [], [], 0)[0])
            elif self.shapes is not None and lp is None:
                lp = self.shapes.completion([], [], [], 0)[0]
            out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": reasons[c.index]})
        first = self.choices[0].result
        ext = self._stats(first, full=True)
        if len(self.choices) > 1:
            ext["choices"] = [self._stats(c.result, full=True) for c in self.choices]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.cfg.model_name, "choices": out,
                "usage": self._usage(), "refusion": ext}

    # ---- streaming ----------------------------------------------------------------------------

    async def sse(self) -> AsyncIterator[bytes | RequestError]:
        first = True
        offsets = {c.index: len(self._echo_text(c)) if self.echo else 0 for c in self.choices}
        async for kind, *payload in self.events():
            if kind == "error":
                if first:
                    yield error_of(*payload)
                else:  # headers are out: OpenAI's way is an error object in the stream
                    yield _sse({"error": error_of(*payload).body()["error"]})
                return
            first = False
            c, due = payload[0], payload[-1]
            ext: dict[str, Any] = {}
            prefix, lp = "", None
            if not c.started:
                ext = {"decoder": self.choice.decoder, "prompt_tokens": len(c.prompt),
                       "gen_length": self.choice.gen_length}
                if self.echo:
                    prefix, lp = self._echo_text(c), self._prompt_logprobs(c)
            if self.shapes is not None and (due[0] or lp is not None):
                part, offsets[c.index] = self._answer_logprobs(due, offsets[c.index])
                lp = {"content": part, "refusal": None} if self.chat else merge_completion(lp, part)
            if kind == "commit":
                delta, commits = payload[1], payload[2]
                yield _sse(self._chunk(c, prefix + delta, None, lp, {**ext, "commits": commits}))
            else:
                res, reason = payload[1], payload[2]
                yield _sse(self._chunk(c, prefix, reason, lp, {**ext, "commits": [], "stats": self._stats(res)}))
        if first:
            return
        out = b""
        if self.req.include_usage:
            out += _sse({"id": self.id, "object": self._object(), "created": self.created,
                         "model": self.server.cfg.model_name, "choices": [], "usage": self._usage()})
        yield out + b"data: [DONE]\n\n"

    def _chunk(self, c: _Choice, delta: str, reason: str | None, logprobs: Any, ext: dict) -> dict:
        role, c.started = not c.started, True
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": delta} if role else (
                {"content": delta} if delta else {})
            choice = {"index": c.index, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": c.index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"id": self.id, "object": self._object(), "created": self.created,
                "model": self.server.cfg.model_name, "choices": [choice], "refusion": ext}

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _usage(self) -> dict:
        n = sum((c.text.tokens_at_stop if c.text.stopped else len(c.result.tokens)) for c in self.choices
                if c.result is not None)
        p = sum(len(ids) for ids in self.prompts)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _stats(self, res: DecodeResult, full: bool = False) -> dict:
        out = {"decoder": self.choice.decoder, "tokens": len(res.tokens), "forwards": res.forwards,
               "tokens_fed": res.tokens_fed, "tpf": res.tpf, "tps": res.tps, "seconds": res.seconds}
        if full:
            out.update(token_ids=res.tokens, positions=res.positions, steps=res.steps)
        return out


class StreamResponse:
    """An ASGI response for a server-sent event stream whose first chunk is already in hand.

    Not Starlette's StreamingResponse: that one also listens for the disconnect, and two readers of
    one connection would race; here RequestRun's watcher is the only reader.
    """

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self.first, self.rest = first, rest

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for chunk in self.rest:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote
            pass
        finally:
            await self.rest.aclose()


def _cut(res: DecodeResult, n: int) -> DecodeResult:
    """The result's first n tokens (its tokens are in position order, from the prompt's end); past
    n there is no EOS before the cut, so a cut result did not finish."""
    if len(res.tokens) <= n:
        return res
    lp = res.logprobs and Logprobs(res.logprobs.chosen[:n], res.logprobs.top[:n])
    return replace(res, tokens=res.tokens[:n], positions=res.positions[:n], steps=res.steps[:n], finished=False,
                   logprobs=lp)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def error_of(message: str, status: int) -> RequestError:
    """The error a failed job's request answers: the request's fault (4xx), or the server's."""
    if status < 500:
        return RequestError(status, message)
    return RequestError(status, message, type="server_error")
