"""Helpers for the server tests: a real uvicorn server on 127.0.0.1 in a thread, and what a request
would give from `decode()` alone."""

from __future__ import annotations

import dataclasses
import threading
import time

from tests.helpers.bundled import bundled, task_examples
from refusion.model.checkpoint import load_config
from refusion.bundled import BUNDLED
from refusion.decoding import decode


NAME = "refusion-tiny"  # the name tests serve the bundled model under
CFG = load_config(BUNDLED)  # the bundled model's config, and the same without a mask token
NO_MASK = dataclasses.replace(CFG, mask_token_id=None)


def chat_ids(text: str) -> list[int]:
    """The bundled model's chat prompt for one user message."""
    return bundled()[1].chat_prompt_ids(text)


def task_prompts(per_task: int = 2) -> list[str]:
    return [ex.prompt for ex in task_examples(per_task)]


class LiveServer:
    """uvicorn serving `server.app()` on a free loopback port, in a background thread, as
    `refusion serve` runs it (the same socket binding, protocol and timeouts)."""

    def __init__(self, server) -> None:
        from refusion.serve.connection import listen, uvicorn_server

        self.server = server
        socks = listen("127.0.0.1", 0)
        self.port = socks[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn_server(server.app(), server.cfg, log_level="warning")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": socks}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)


def solo(prompt: list[int], decoder: str, params: dict, seed: int | None = None):
    """What decode() gives a request's prompt alone."""
    model, _ = bundled()
    return decode(model, [prompt], decoder, eos_ids=model.config.eos_ids, seed=seed, **params)[0]
