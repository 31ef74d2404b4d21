"""The HTTP layer: OpenAI-compatible routes on Starlette, talking to the engine thread.

A generation request goes: body (size and time limits) -> JSON (UTF-8, strict) -> schema ->
prompt ids (template, length limits) -> decoder choice (validated) -> its cost (budget.py: the
context and the per-request token limit) -> a Job in the engine's queue (429 when full). The
engine's events come back through an asyncio queue per request; a task that watches the connection
puts a "gone" marker in the same queue when the client disconnects, so the request is cancelled
within one engine step whether it streams or not.

Streams are OpenAI's SSE chunks with one extension field, `refusion`, on every chunk (see
docs/serving.md, "Streaming and out-of-order slots"): the commits as they land ({positions,
tokens, pieces, step}), which may be out of position order, while `text` / `delta.content` carry
only the complete prefix, left to right.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from refusion.model.transformer import Transformer
from refusion.model.tokenizer import Tokenizer
from refusion.runtime import malloc_trim
from refusion.serve import budget, tokenize
from refusion.serve.engine import Engine, Job, QueueFull
from refusion.serve.metrics import Metrics
from refusion.decoding import model_settings, registry
from refusion.serve.params import DecoderChoice, choose, with_controls
from refusion.serve.schemas import (MAX_SEED, OPENAI_SET, ChatRequest, CompletionRequest, RequestError, loads,
                                    parse_chat, parse_completion)
from refusion.serve.responses import RequestRun, StreamResponse

log = logging.getLogger("refusion.serve")
STATIC = Path(__file__).parent / "static"
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
_GENERATE = ("/v1/completions", "/v1/chat/completions")
DRAIN_SECONDS = 0.5  # how long an oversized body is read before its 413


@dataclass
class ServeConfig:
    """Limits and sizes; `refusion serve --help` documents each."""

    model_name: str = "refusion"
    max_tokens_cap: int = 1024  # the most max_tokens a request may ask for (also bounded by the context)
    default_max_tokens: int = 128
    max_request_tokens: int | None = None  # tokens one request may hold (budget.py); None: twice the context
    max_body_bytes: int = 1 << 20
    body_timeout: float = 10.0  # seconds to receive a whole body (slow senders are cut off: 408)
    header_timeout: float = 10.0  # seconds to receive a request line and headers (connection.py)
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open between requests
    max_queue: int = 256  # sequences waiting for the engine before 429 (a request with n choices is n)
    max_running: int = 64  # sequences in the continuous batch
    static_batch: int = 16  # jobs in one decode() group for the other decoders
    aliases: list[str] = field(default_factory=list)  # other names accepted in "model"


class Server:
    def __init__(self, model: Transformer, tok: Tokenizer, cfg: ServeConfig, engine: Engine | None = None) -> None:
        self.model, self.tok, self.cfg = model, tok, cfg
        self.context = model.config.max_position_embeddings
        self.max_request_tokens = cfg.max_request_tokens or 2 * self.context
        self.eos_ids = sorted(set(model.config.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
        self.engine = engine or Engine(model, self.eos_ids, max_running=cfg.max_running, max_queue=cfg.max_queue,
                                       static_batch=cfg.static_batch, max_row_tokens=self.max_request_tokens)
        self.metrics = Metrics(lambda: self.engine.queue_depth, lambda: self.engine.running,
                               model.compiled.stats if model.compiled is not None else None)
        self.engine.on_step = self.metrics.on_step
        self.created = int(time.time())

    @property
    def default_decoder(self) -> str:
        """The decoder a request that names none gets: the model's decoding.json's, else its objective's."""
        return model_settings.choose(model_settings.of_model(self.model), self.model.config)

    # ---- the ASGI app -------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/", self.index, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/decoders", self.decoders, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            trimmer = asyncio.create_task(self._trim_when_idle())
            try:
                yield
            finally:
                trimmer.cancel()
                self.engine.stop()

        app = Starlette(routes=routes, lifespan=lifespan,
                        exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})
        return _CountRequests(app, self.metrics)

    async def _trim_when_idle(self, every: float = 2.0) -> None:
        """Give freed memory back to the OS once a burst is over. glibc keeps what Python and torch
        free in its heaps and per-thread arenas, so after a burst (64 sequences' caches, 10 MB
        bodies) the resident size would stay at the peak for good; malloc_trim releases it. Only
        when nothing runs, and only after some work, so an idle server does nothing."""
        trim = malloc_trim()
        if trim is None:
            return
        seen = 0
        while True:
            await asyncio.sleep(every)
            served = self.metrics.served
            if self.engine.running == 0 and self.engine.queue_depth == 0 and served != seen:
                seen = served
                # first the garbage held in reference cycles (a failed request's traceback keeps
                # its frames, and their buffers, alive until the cycle collector runs)
                gc.collect()
                await asyncio.to_thread(trim, 0)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        e = RequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
        return _error(e, exc.headers)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return _error(RequestError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    # ---- small routes -------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def health(self, request: Request) -> Response:
        alive = self.engine.thread is not None and self.engine.thread.is_alive()
        body = {"status": "ok" if alive else "engine stopped", "model": self.cfg.model_name,
                "running": self.engine.running, "waiting": self.engine.queue_depth}
        return JSONResponse(body, status_code=200 if alive else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        card = {"id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "refusion",
                "max_model_len": self.context, "max_tokens_cap": self._cap(),
                "max_request_tokens": self.max_request_tokens,
                "decoders": list(registry.available(self.model.config)),
                "default_decoder": self.default_decoder}
        return JSONResponse({"object": "list", "data": [card]})

    async def decoders(self, request: Request) -> Response:
        """Every registered decoder and the extra request fields it takes (what the page's controls
        are built from): name, JSON type, whether null is allowed, its default and a line of help;
        and whether it applies response_format, logit_bias, penalties and logprobs (`controls`)."""
        available = registry.available(self.model.config)
        data = [{"id": name, "object": "decoder", "description": d.description, "available": name in available,
                 "needs_mask": d.needs_mask, "fits": list(d.fits), "controls": d.controls,
                 "fields": [{"name": o.name, "type": _JSON_TYPES.get(o.type, "string"), "nullable": o.optional,
                             "default": o.default, "help": o.help}
                            for o in registry.options(name) if o.name not in OPENAI_SET]}
                for name, d in ((n, registry.get(n)) for n in registry.names())]
        settings = model_settings.of_model(self.model)
        return JSONResponse({"object": "list", "default": self.default_decoder, "data": data,
                             "model_settings": settings.to_dict() if settings is not None else None})

    # ---- the tokenizer (vLLM's routes, which lm-eval's API models use) ---------------------------

    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_call(request, lambda body: tokenize.tokenize(self.tok, body, self.context))

    async def detokenize(self, request: Request) -> Response:
        vocab = self.model.config.vocab_size
        return await self._tokenizer_call(request, lambda body: tokenize.detokenize(self.tok, body, vocab))

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(tokenize.info(self.tok, self.context))

    async def _tokenizer_call(self, request: Request, fn) -> Response:
        try:
            body = await self._read_body(request)
            return JSONResponse(await asyncio.to_thread(lambda: fn(loads(body))))
        except RequestError as e:
            return _error(e)

    # ---- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        try:
            body = await self._read_body(request)
            # parsing and tokenizing a large body takes a while: off the event loop
            req, prompts, choice = await asyncio.to_thread(self._prepare, body, chat)
        except RequestError as e:
            return _error(e)
        run = RequestRun(self, req, prompts, choice, chat, arrived)
        jobs = run.jobs(_seeds(req.seed, len(run.choices), choice.temperature > 0))
        try:
            self.engine.submit(*jobs)
        except QueueFull as e:
            return _error(RequestError(429, f"{e}; retry later", type="rate_limit_error", code="queue_full",
                                       headers={"Retry-After": "1"}))
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        run.watch(request)
        if req.stream:
            chunks = run.sse()
            first = await anext(chunks, None)  # headers wait for the first event: an early failure is a 500
            if isinstance(first, RequestError):
                await chunks.aclose()
                return _error(first)
            return StreamResponse(first or b"", chunks)
        out = await run.collect()
        return _error(out) if isinstance(out, RequestError) else JSONResponse(out)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise RequestError(400, "Content-Length is not a number")
        receive, chunks, size = request.receive, [], 0
        if declared is not None and int(declared) > limit:
            # refused at once: what the client sends meanwhile is read for a moment (so that it gets to
            # read the 413, not a reset connection), not for the whole body timeout
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(DRAIN_SECONDS, self.cfg.body_timeout)):
                    await _drain(receive, 64 * limit)
            raise _too_large(limit)
        try:
            async with asyncio.timeout(self.cfg.body_timeout):
                while True:  # chunked bodies carry no length: count as they come
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise RequestError(400, "the client disconnected before sending the whole body")
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        chunks.clear()  # an exception's traceback keeps this frame (and its locals) alive
                        await _drain(receive, 64 * limit)
                        raise _too_large(limit)
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            chunks.clear()
            raise RequestError(408, f"request body not received within {self.cfg.body_timeout:g} s",
                               headers={"Connection": "close"}) from None
        return b"".join(chunks)

    def _prepare(self, body: bytes, chat: bool) -> tuple[CompletionRequest | ChatRequest, list[list[int]],
                                                          DecoderChoice]:
        """The request, its prompts' ids (one, or a completions request's batch), its decoder."""
        data = loads(body)
        req = parse_chat(data) if chat else parse_completion(data)
        if req.model is not None and req.model not in (self.cfg.model_name, *self.cfg.aliases):
            raise RequestError(404, f"the model {req.model!r} does not exist; this server serves "
                                    f"{self.cfg.model_name!r}", "model", code="model_not_found")
        prompts = self._prompt_ids(req)
        longest = max(len(p) for p in prompts)
        cap = self._cap()
        if req.max_tokens is not None and req.max_tokens > cap:
            raise RequestError(400, f"max_tokens {req.max_tokens} exceeds this server's cap of {cap}", "max_tokens")
        max_tokens = req.max_tokens if req.max_tokens is not None else max(
            1, min(self.cfg.default_max_tokens, self.context - longest))
        if longest + max_tokens > self.context:
            raise RequestError(400, f"this model's maximum context length is {self.context} tokens; the prompt has "
                                    f"{longest} and max_tokens asks for {max_tokens}", "prompt",
                               code="context_length_exceeded")
        choice = choose(req, self.model.config, max_tokens, model_settings.of_model(self.model))
        choice = with_controls(choice, req, self.tok, self.model.config.vocab_size)
        if choice.gen_length != max_tokens and longest + choice.gen_length > self.context:
            raise RequestError(400, f"this model's maximum context length is {self.context} tokens; decoder "
                                    f"{choice.decoder!r} decodes max_tokens {max_tokens} in whole blocks, "
                                    f"{choice.gen_length} tokens, and the prompt has {longest}: lower max_tokens",
                               "max_tokens", code="context_length_exceeded")
        budget.check(longest, choice, self.context, self.max_request_tokens, n=len(prompts) * req.n)
        return req, prompts, choice

    def _prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[list[int]]:
        vocab = self.model.config.vocab_size
        out = []
        for prompt in [req.messages] if isinstance(req, ChatRequest) else req.prompts:
            try:
                if isinstance(req, ChatRequest):
                    ids = self.tok.chat_ids(prompt)  # message content is text: no control tokens in it
                elif isinstance(prompt, str):
                    ids = self.tok.encode(prompt)
                else:
                    ids = prompt
                    bad = next((t for t in ids if not 0 <= t < vocab), None)
                    if bad is not None:
                        raise RequestError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                                           "prompt")
            except ValueError as e:  # the tokenizer's and the chat template's errors
                if isinstance(e, RequestError):
                    raise
                raise RequestError(400, f"cannot build the prompt: {e}", "messages" if isinstance(req, ChatRequest)
                                   else "prompt") from None
            if not ids:
                raise RequestError(400, "the prompt is empty after tokenization", "prompt")
            if len(ids) >= self.context:
                raise RequestError(400, f"this model's maximum context length is {self.context} tokens; the prompt "
                                        f"has {len(ids)}", "prompt", code="context_length_exceeded")
            out.append(ids)
        return out

    def _cap(self) -> int:
        return min(self.cfg.max_tokens_cap, self.context - 1)


class _CountRequests:
    """ASGI middleware: requests by endpoint and status, latency of answered generation requests."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in _GENERATE or path in ("/", "/health", "/metrics", "/v1/models") else "other"
        start, status = time.perf_counter(), [0]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                if endpoint in _GENERATE and status[0] == 200:
                    self.metrics.latency.observe(time.perf_counter() - start)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0] or 499)).inc()
            if scope["method"] != "GET":  # health checks and scrapes alone never trigger the idle trim
                self.metrics.served += 1


def _seeds(seed: int | None, n: int, sampled: bool) -> list[int | None]:
    """Each choice's seed: seed + i for choice i, taken modulo 2**63 (OpenAI's seeds are any int64,
    the decoders' are in [0, 2**63)), so a seeded request repeats choice by choice; unseeded and
    sampled, a fresh seed each; greedy, none."""
    if seed is not None:
        return [(seed + i) % (MAX_SEED + 1) for i in range(n)]
    if sampled:
        return [int.from_bytes(os.urandom(7), "little") for _ in range(n)]
    return [None] * n


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body is larger than {limit} bytes", headers={"Connection": "close"})


def _error(e: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **(headers or {})})


async def _drain(receive, limit: int) -> None:
    """Read and drop the rest of an oversized body (up to `limit` bytes), so the client, still
    sending, gets to read our 413 instead of a reset connection."""
    n = 0
    while n <= limit:
        msg = await receive()
        n += len(msg.get("body", b""))
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            return


def build(model_dir: str | Path, cfg: ServeConfig | None = None, dtype: str | None = None,
          device: str = "cpu", compile: bool | str = False) -> Server:
    """Load a model directory and make its server (the app is `server.app()`); compile: see load_model."""
    from refusion.model.checkpoint import load_model

    model_dir = Path(model_dir)
    model = load_model(model_dir, dtype=dtype, device=device, compile=compile)
    tok = Tokenizer.from_dir(model_dir)
    cfg = cfg or ServeConfig(model_name=model_dir.name)
    return Server(model, tok, cfg)
