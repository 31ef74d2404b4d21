"""The live server most of the server tests share: the bundled model on a real uvicorn server, one
per test module, and the official `openai` client pointed at it. A module that needs another server
defines its own `live`."""

from __future__ import annotations

import pytest

from tests.helpers.serving import NAME, LiveServer, bundled


@pytest.fixture(scope="module")
def live(one_thread):
    from refusion.serve.app import ServeConfig, Server

    model, tok = bundled()
    srv = LiveServer(Server(model, tok, ServeConfig(model_name=NAME, max_tokens_cap=512)))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
