"""`refusion serve`: its flags and what it runs. Imports nothing heavy until it runs, so that
`refusion --help` works without the serve extra installed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Serve a model over HTTP with OpenAI's API (continuous batching; streaming with SSE).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET / (a web page showing slots being filled live).

Requests take OpenAI's fields (max_tokens, temperature, top_p, stop, seed, stream,
stream_options) plus the decoder and its parameters as extra body fields, e.g.
{"decoder": "refusion", "slot_size": 8, "serial_blocks": 2}. The default decoder is
speculative on a model with a mask token (exact AR output, several tokens per forward), ar
otherwise; see the README's "Serving" section for every field."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a model with an OpenAI-compatible HTTP API and a live web page",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", help="Hugging Face model directory (default: the bundled default model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    s.add_argument("--served-model-name", help="the model id clients send and /v1/models lists "
                                               "(default: the directory's name)")
    lim = s.add_argument_group("limits (each refusal is a 4xx in OpenAI's error JSON)")
    lim.add_argument("--max-tokens-cap", type=int, default=1024,
                     help="largest max_tokens a request may ask for (also bounded by the context; default: %(default)s)")
    lim.add_argument("--default-max-tokens", type=int, default=128,
                     help="max_tokens when a request gives none (default: %(default)s)")
    lim.add_argument("--max-body-bytes", type=int, default=1 << 20,
                     help="largest request body; more is a 413 (default: %(default)s)")
    lim.add_argument("--body-timeout", type=float, default=10.0,
                     help="seconds to receive a whole body; slower is a 408 (default: %(default)s)")
    lim.add_argument("--max-queue", type=int, default=256,
                     help="requests waiting for the engine; one more is a 429 with Retry-After (default: %(default)s)")
    eng = s.add_argument_group("engine")
    eng.add_argument("--max-running", type=int, default=64,
                     help="sequences decoded together in the continuous batch (default: %(default)s)")
    eng.add_argument("--static-batch", type=int, default=16,
                     help="requests for the other decoders (refusion, ar, mdm, ...) run together in one "
                          "decode() call when their parameters match (default: %(default)s)")
    eng.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's")
    eng.add_argument("--device", default="cpu")
    eng.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    try:
        import uvicorn

        from .app import ServeConfig, build
    except ImportError as e:
        raise ValueError(f"refusion serve needs the serve extra ({e.name} is missing): "
                         "pip install 'refusion[serve]'") from None
    import torch

    from ..cli import default_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("max_tokens_cap", "default_max_tokens", "max_body_bytes", "max_queue", "max_running", "static_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model_dir = Path(args.model) if args.model else default_model_dir()
    cfg = ServeConfig(model_name=args.served_model_name or model_dir.name, max_tokens_cap=args.max_tokens_cap,
                      default_max_tokens=args.default_max_tokens, max_body_bytes=args.max_body_bytes,
                      body_timeout=args.body_timeout, max_queue=args.max_queue, max_running=args.max_running,
                      static_batch=args.static_batch, aliases=[str(model_dir)])
    server = build(model_dir, cfg, dtype=args.dtype, device=args.device)
    print(f"refusion: serving {cfg.model_name} on http://{args.host}:{args.port}/ "
          f"(OpenAI API under /v1, metrics at /metrics)", file=sys.stderr)
    uvicorn.run(server.app(), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
