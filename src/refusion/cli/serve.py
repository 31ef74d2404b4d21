"""`refusion serve`: its flags and what it runs. Imports nothing heavy until it runs, so that
`refusion --help` works without the serve extra installed."""

from __future__ import annotations

import argparse
import sys

from refusion.cli.args import MODEL_HELP, add_compile_flag, positive_int, resolve_model_dir

DESCRIPTION = """\
Serve a model over HTTP with OpenAI's API (continuous batching; streaming with SSE).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET / (a web page showing slots being filled live).

Requests take OpenAI's fields (max_tokens, temperature, top_p, stop, seed, stream,
stream_options) plus the decoder and its parameters as extra body fields, e.g.
{"decoder": "refusion", "slot_size": 8, "checks": true}. The default decoder is the one
the model's training objective fits (speculative for a ReFusion model: AR's output at several
tokens per forward). See docs/serving.md for every field."""


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port: {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in [0, 65535], got {v}")
    return v


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a model with an OpenAI-compatible HTTP API and a live web page",
                       description=DESCRIPTION)
    s.add_argument("--model", help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on; 127.0.0.1 is this machine only")
    s.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    s.add_argument("--served-model-name", help="the model id clients send and /v1/models lists "
                                               "(default: the directory's name)")
    lim = s.add_argument_group("limits (each refusal is a 4xx in OpenAI's error JSON)")
    lim.add_argument("--max-tokens-cap", type=positive_int, default=1024,
                     help="largest max_tokens a request may ask for (also bounded by the model's context)")
    lim.add_argument("--default-max-tokens", type=positive_int, default=128, help="max_tokens when a request gives none")
    lim.add_argument("--max-request-tokens", type=positive_int,
                     help="the most tokens one request may hold in the cache: prompt + max_tokens (rounded up to "
                          "whole blocks) + one step's draft and masks (speculative: 2 + draft_length + "
                          "mask_length); checked before the request is admitted (default: twice the model's context, "
                          "max_position_embeddings, which admits every request that fits the context); the continuous "
                          "batch keeps each of its rows within it too (a request waits until it fits). A step wider "
                          "than the context is refused whatever this is")
    lim.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body; more is a 413")
    lim.add_argument("--body-timeout", type=_seconds, default=10.0,
                     help="seconds to receive a whole request body; slower is a 408")
    lim.add_argument("--header-timeout", type=_seconds, default=10.0,
                     help="seconds to receive a request line and its headers, from the connection's opening or the "
                          "request's first byte; slower is a 408 and the connection is closed")
    lim.add_argument("--keep-alive-timeout", type=_seconds, default=5.0,
                     help="seconds an idle connection stays open after a response")
    lim.add_argument("--max-queue", type=positive_int, default=256,
                     help="sequences waiting for the engine (a request with n choices is n); more is a 429 "
                          "with Retry-After")
    eng = s.add_argument_group("engine")
    eng.add_argument("--max-running", type=positive_int, default=64,
                     help="sequences decoded together in the continuous batch (speculative, greedy ar)")
    eng.add_argument("--static-batch", type=positive_int, default=16,
                     help="requests for the other decoders (refusion, sampled ar, mdm, ...) run together in one "
                          "decode() call when their parameters match")
    eng.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype")
    eng.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    eng.add_argument("--threads", type=positive_int,
                     help="torch CPU threads (default: 1 for a model under 50M parameters, else torch's default)")
    add_compile_flag(eng)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from refusion.serve.app import ServeConfig, build
        from refusion.serve.connection import listen, uvicorn_server
    except ImportError as e:
        raise ValueError(f"refusion serve needs the serve extra ({e.name} is missing): "
                         "pip install 'refusion[serve]'") from None
    from refusion.runtime import count_parameters, resolve_device, set_threads

    model_dir = resolve_model_dir(args)
    device = resolve_device(args.device)
    socks = listen(args.host, args.port)  # a port in use fails here, before the model loads
    aliases = [str(model_dir)] + ([args.model] if args.model and args.model != str(model_dir) else [])
    cfg = ServeConfig(model_name=args.served_model_name or model_dir.name, max_tokens_cap=args.max_tokens_cap,
                      default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
                      body_timeout=args.body_timeout, max_queue=args.max_queue, max_running=args.max_running,
                      static_batch=args.static_batch, aliases=aliases, max_request_tokens=args.max_request_tokens,
                      header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout)
    server = build(model_dir, cfg, dtype=args.dtype, device=device, compile=args.compile)
    set_threads(args.threads, count_parameters(server.model))
    port = socks[0].getsockname()[1]  # the one bound: --port 0 lets the system choose
    where = f"[{args.host}]" if ":" in args.host else args.host
    print(f"refusion: serving {cfg.model_name} on http://{where}:{port}/ (OpenAI API under /v1, metrics at "
          f"/metrics; at most {server.max_request_tokens} tokens per request)", file=sys.stderr)
    uvicorn_server(server.app(), cfg, args.log_level).run(sockets=socks)
