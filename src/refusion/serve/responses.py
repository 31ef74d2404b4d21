"""One generation request on the asyncio side: the engine's events in, OpenAI's shapes out, as one
JSON object (`RequestRun.collect`) or as SSE chunks (`RequestRun.sse`, sent by `StreamResponse`).

A RequestRun knows its server only through what `ServerView` names, so this module imports nothing
from the app (which imports it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from starlette.requests import Request

from refusion.decoding.common import DecodeResult
from refusion.model.tokenizer import Tokenizer
from refusion.serve.engine import Engine, Event, Job
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


class RequestRun:
    """One generation request on the asyncio side: events in, OpenAI shapes out."""

    def __init__(self, server: ServerView, req: CompletionRequest | ChatRequest, prompt: list[int],
                 choice: DecoderChoice, chat: bool, arrived: float) -> None:
        self.server, self.req, self.prompt, self.choice, self.chat = server, req, prompt, choice, chat
        self.arrived = arrived
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.job: Job | None = None
        self.text = TextAssembler(server.tok, len(prompt), server.eos_ids, req.stop)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.watcher: asyncio.Task | None = None
        self.first_token: float | None = None

    def sink(self, ev: Event) -> None:
        """Called on the engine thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)

    def watch(self, request: Request) -> None:
        async def wait_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait(Event("gone"))
        self.watcher = asyncio.create_task(wait_gone())

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """("commit", (delta_text, commits)) ... then ("done", (result, finish_reason)) or ("error", message).

        Events that arrived together are merged into one, so a slow reader gets fewer, larger chunks.
        """
        server, job = self.server, self.job
        try:
            while True:
                evs = [await self.queue.get()]
                while not self.queue.empty():
                    evs.append(self.queue.get_nowait())
                commits, delta = [], ""
                for ev in evs:
                    if ev.kind == "gone":
                        server.engine.cancel(job)
                        return
                    if ev.kind == "error":
                        yield "error", ev.message
                        return
                    if ev.kind == "commit":
                        ev = self._within(ev)
                        if not ev.positions:
                            continue
                        if self.first_token is None:
                            self.first_token = time.perf_counter()
                            server.metrics.ttft.observe(self.first_token - self.arrived)
                        commits.append({"positions": ev.positions, "tokens": ev.tokens, "step": ev.step,
                                        "pieces": [server.tok.decode([t]) for t in ev.tokens]})
                        delta += self.text.add(ev.positions, ev.tokens)
                        if self.text.stopped:
                            server.engine.cancel(job)  # the answer is complete: free the sequence now
                    elif ev.kind == "done":
                        res = _cut(ev.result, self.choice.cut)
                        if not self.text.stopped and not ev.cancelled:
                            delta += self.text.add(res.positions, res.tokens) + self.text.finish()
                        if commits or delta:
                            yield "commit", (delta, commits)
                        reason = "stop" if self.text.stopped or res.finished else "length"
                        server.metrics.finished(len(res.tokens), res.forwards)
                        yield "done", (res, reason)
                        return
                if commits or delta:
                    yield "commit", (delta, commits)
        finally:
            if self.watcher is not None:
                self.watcher.cancel()
            if job is not None and not job.closed:
                server.engine.cancel(job)

    def _within(self, ev: Event) -> Event:
        """A commit event without the positions past max_tokens (a decoder that works in whole
        blocks decodes up to the end of the last one)."""
        end = len(self.prompt) + self.choice.cut
        if all(q < end for q in ev.positions):
            return ev
        keep = [i for i, q in enumerate(ev.positions) if q < end]
        return Event("commit", [ev.positions[i] for i in keep], [ev.tokens[i] for i in keep], step=ev.step)

    # ---- non-streaming ------------------------------------------------------------------------

    async def collect(self) -> dict | RequestError:
        result, reason = None, "length"
        async for kind, payload in self.events():
            if kind == "error":
                return RequestError(500, payload, type="server_error")
            if kind == "done":
                result, reason = payload
        if result is None:  # the client went away; nobody reads this
            return RequestError(499, "client closed the request")
        text = self.text.sent
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.cfg.model_name, "choices": [choice],
                "usage": self._usage(result), "refusion": self._stats(result, full=True)}

    # ---- streaming ----------------------------------------------------------------------------

    async def sse(self) -> AsyncIterator[bytes | RequestError]:
        first = True
        async for kind, payload in self.events():
            if kind == "error":
                if first:
                    yield RequestError(500, payload, type="server_error")
                else:  # headers are out: OpenAI's way is an error object in the stream
                    yield _sse({"error": {"message": payload, "type": "server_error", "param": None, "code": None}})
                return
            ext: dict[str, Any] = {}
            if first:
                ext = {"decoder": self.choice.decoder, "prompt_tokens": len(self.prompt),
                       "gen_length": self.choice.gen_length}
            if kind == "commit":
                delta, commits = payload
                yield _sse(self._chunk(delta, None, {**ext, "commits": commits}, role=first))
            else:
                res, reason = payload
                out = _sse(self._chunk("", reason, {**ext, "commits": [], "stats": self._stats(res)}, role=first))
                if self.req.include_usage:
                    out += _sse({"id": self.id, "object": self._object(), "created": self.created,
                                 "model": self.server.cfg.model_name, "choices": [], "usage": self._usage(res)})
                yield out + b"data: [DONE]\n\n"
            first = False

    def _chunk(self, delta: str, reason: str | None, ext: dict, role: bool) -> dict:
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": delta} if role else (
                {"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {"id": self.id, "object": self._object(), "created": self.created,
                "model": self.server.cfg.model_name, "choices": [choice], "refusion": ext}

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _usage(self, res: DecodeResult) -> dict:
        n = self.text.tokens_at_stop if self.text.stopped else len(res.tokens)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}

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
    return replace(res, tokens=res.tokens[:n], positions=res.positions[:n], steps=res.steps[:n], finished=False)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
