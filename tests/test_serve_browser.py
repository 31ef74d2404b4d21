"""The web page at / in a real headless Chromium (Debian's package, driven by Playwright).

The test types a prompt, picks decoder settings, waits for the answer, and checks that the text
the page shows equals the API's answer to the same request, and that the slot view filled every
committed position. Skipped, with the reason, only where no Chromium is installed
(`scripts/setup.sh` installs it).
"""

from __future__ import annotations

import os
import shutil

import pytest

playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from refusion.serve.app import ServeConfig, Server  # noqa: E402
from serving import LiveServer, bundled, task_prompts  # noqa: E402

CHROMIUM = os.environ.get("REFUSION_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)"),
              pytest.mark.usefixtures("one_thread")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def live(one_thread):
    model, tok = bundled()
    srv = LiveServer(Server(model, tok, ServeConfig(model_name="refusion-tiny")))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def page(live):
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page()
        pg.goto(live.url + "/")
        pg.wait_for_selector("body[data-state=ready]", timeout=30_000)
        yield pg
        browser.close()


@pytest.mark.parametrize("decoder,settings", [
    ("refusion", {"#slot_size": "8", "#serial_blocks": "1"}),
    ("speculative", {}),
    ("mdm-threshold", {"#block_length": "32"}),
])
def test_the_page_shows_the_api_answer(live, page, decoder, settings):
    prompt = task_prompts(1)[1]
    page.fill("#prompt", "")
    page.type("#prompt", prompt)  # typed, key by key, as a person would
    page.select_option("#decoder", decoder)
    page.fill("#max_tokens", "64")
    for sel, value in settings.items():
        page.fill(sel, value)
    page.click("#run")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    shown = page.inner_text("#answer")
    stats = page.inner_text("#stats")
    # the same request through the API, built by the page itself
    body = dict(page.evaluate("requestBody()"), stream=False)
    assert body["decoder"] == decoder and body["messages"][0]["content"] == prompt
    api = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert shown == api["choices"][0]["message"]["content"]
    assert "TPF" in stats and "TPS" in stats and f"{len(api['refusion']['token_ids'])} tokens" in stats
    filled = page.locator("#slots span.filled").count()
    assert filled == len(api["refusion"]["token_ids"])
    # each filled cell is coloured by the step that committed it
    steps = {int(t.split("step ")[1]) for t in page.locator("#slots span.filled").evaluate_all(
        "els => els.map(e => e.title)")}
    assert steps == set(api["refusion"]["steps"])


def test_the_page_reports_errors(page):
    page.fill("#prompt", "hi")
    page.select_option("#decoder", "speculative")
    page.fill("#max_tokens", "60")
    page.fill("#mask_length", "100000")  # a step wider than the model's context
    page.click("#run")
    page.wait_for_selector("body[data-state=error]", timeout=30_000)
    assert "tokens fed per step exceeds the model's context" in page.inner_text("#error")
    page.fill("#mask_length", "")


def test_the_controls_are_the_decoders_fields_from_the_server(live, page):
    """The page builds each decoder's controls from GET /v1/decoders: one per field, with its
    default; a typed value is kept across decoder changes and goes into the request."""
    fields = {d["id"]: d["fields"] for d in httpx.get(live.url + "/v1/decoders").json()["data"]}
    for decoder in ("speculative", "refusion", "ar", "mdm", "mdm-threshold"):
        page.select_option("#decoder", decoder)
        shown = page.locator("#params input").evaluate_all(
            "els => els.map(e => [e.id, e.type === 'checkbox' ? e.checked : e.value])")
        assert shown == [[f["name"], f["default"] if f["type"] == "boolean" else
                          ("" if f["default"] is None else str(f["default"]))] for f in fields[decoder]]
    page.select_option("#decoder", "refusion")
    page.fill("#slot_size", "4")
    page.check("#recompute_kv")
    page.select_option("#decoder", "mdm")
    page.select_option("#decoder", "refusion-l2r")
    assert page.input_value("#slot_size") == "4" and page.is_checked("#recompute_kv")
    body = page.evaluate("requestBody()")
    assert (body["decoder"], body["slot_size"], body["recompute_kv"]) == ("refusion-l2r", 4, True)
    assert "block_length" not in body
