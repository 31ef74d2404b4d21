"""Prometheus metrics for `GET /metrics` (text format, prometheus_client).

Each server gets its own registry, so several apps in one process (the tests) do not collide and
the process-wide default metrics do not leak in.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a tiny CPU model answers in milliseconds, a real one on a busy server in tens of seconds
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPF_BUCKETS = (0.5, 1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class Metrics:
    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float], compiled=None) -> None:
        """compiled: the model's CompileStats (refusion.model.compiled) when it runs compiled: compiling is
        paid once per graph over the server's lifetime, so it is shown apart from request latency."""
        r = self.registry = CollectorRegistry()
        self.served = 0  # requests other than GETs answered (a plain count, for the idle-time memory trim)
        self.requests = Counter("refusion_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("refusion_generated_tokens", "tokens generated (committed by a decoder)", registry=r)
        self.prompt_tokens = Counter("refusion_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.forwards = Counter("refusion_sequence_forwards",
                                "model forwards summed over sequences (each request's own count)", registry=r)
        self.steps = Counter("refusion_engine_steps", "engine turns that ran the model (one forward of the "
                             "continuous batch, or one static decode() group)", registry=r)
        self.tpf = Histogram("refusion_tokens_per_forward", "per request: tokens generated / its forwards",
                             buckets=_TPF_BUCKETS, registry=r)
        self.ttft = Histogram("refusion_time_to_first_token_seconds",
                              "from arrival to the first committed token", buckets=_TIME_BUCKETS, registry=r)
        self.latency = Histogram("refusion_request_latency_seconds", "from arrival to the last byte of the answer",
                                 buckets=_TIME_BUCKETS, registry=r)
        self.batch = Histogram("refusion_step_sequences", "sequences in one engine turn",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        g = Gauge("refusion_queue_depth", "requests waiting for the engine", registry=r)
        g.set_function(queue_depth)
        g = Gauge("refusion_running_sequences", "sequences the engine is decoding", registry=r)
        g.set_function(running)
        if compiled is not None:
            for name, doc, attr in (("compiled_graphs", "graphs torch.compile built (--compile)", "graphs"),
                                    ("compile_seconds", "seconds spent compiling them", "compile_seconds"),
                                    ("recompiles", "graphs compiled again for a shape already served", "recompiles")):
                g = Gauge(f"refusion_{name}", doc, registry=r)
                g.set_function(lambda attr=attr: getattr(compiled, attr))

    def on_step(self, sequences: int, seconds: float) -> None:
        self.steps.inc()
        self.batch.observe(sequences)

    def finished(self, tokens: int, forwards: int) -> None:
        self.tokens.inc(tokens)
        self.forwards.inc(forwards)
        if forwards:
            self.tpf.observe(tokens / forwards)

    def render(self) -> bytes:
        return generate_latest(self.registry)
