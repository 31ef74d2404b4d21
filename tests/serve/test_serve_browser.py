"""The web page at / in a real headless Chromium (Debian's package, driven by Playwright).

The tests type a prompt, pick decoder settings, wait for the answer, and check that the text
the page shows equals the API's answer to the same request, and that the slot view filled every
committed position; that the replay shows the recorded commits step by step (every intermediate
state, against the API's steps), that the legend's colours are the cells', and that the side-by-side
panes show the API's counters for the same prompt and decoders. Screenshots go to
$REFUSION_SCREENSHOTS (docs/figures/page holds the committed ones:
`REFUSION_SCREENSHOTS=docs/figures/page pytest tests/serve/test_serve_browser.py`), else to a temporary
directory. Skipped, with the reason, only where no Chromium is installed (`scripts/setup.sh`
installs it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from refusion.bundled import BUNDLED  # noqa: E402
from refusion.decoding.model_settings import ModelSettings, write  # noqa: E402
from refusion.model.checkpoint import load_model  # noqa: E402
from refusion.model.tokenizer import Tokenizer  # noqa: E402
from refusion.serve.app import ServeConfig, Server  # noqa: E402
from tests.helpers.serving import LiveServer, task_prompts  # noqa: E402

CHROMIUM = os.environ.get("REFUSION_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)"),
              pytest.mark.usefixtures("one_thread")]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def live(one_thread, tmp_path_factory):
    # the bundled model with adaptive widths in its decoding.json: the default (cost) policy's steps
    # follow measured timings and what earlier requests taught it, so the API's repeat of the
    # page's request could take other steps than the page showed
    path = tmp_path_factory.mktemp("served") / "refusion-tiny"
    shutil.copytree(BUNDLED, path)
    write(path, ModelSettings("speculative", {"widths": "adaptive"}))
    model, tok = load_model(path), Tokenizer.from_dir(path)
    srv = LiveServer(Server(model, tok, ServeConfig(model_name="refusion-tiny")))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    d = Path(os.environ.get("REFUSION_SCREENSHOTS") or tmp_path_factory.mktemp("page"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def page(live):
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1150, "height": 800})
        pg.goto(live.url + "/")
        pg.wait_for_selector("body[data-state=ready]", timeout=30_000)
        yield pg
        browser.close()


@pytest.mark.parametrize("decoder,settings", [
    ("refusion", {"#slot_size": "8", "#checks": True}),
    ("speculative", {"#draft_length": "16"}),
    ("mdm-threshold", {"#block_length": "32"}),
])
def test_the_page_shows_the_api_answer(live, page, decoder, settings):
    prompt = task_prompts(1)[1]
    run_on_page(page, prompt, decoder, settings, typed=True)
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
    for sel, value in settings.items():  # back to the defaults (typed values outlive the test)
        if value is True:
            page.uncheck(sel)
        elif sel == "#draft_length":
            page.fill(sel, "")


def test_the_page_reports_errors(page):
    page.fill("#prompt", "hi")
    page.select_option("#decoder", "speculative")
    page.fill("#max_tokens", "60")
    page.fill("#draft_length", "256")  # within its cap, the step (with its masks) wider than the model's context
    page.click("#run")
    page.wait_for_selector("body[data-state=error]", timeout=30_000)
    assert "tokens fed per step exceeds the model's context" in page.inner_text("#error")
    page.fill("#draft_length", "")  # back to its default


def test_the_controls_are_the_decoders_fields_from_the_server(live, page):
    """The page builds each decoder's controls from GET /v1/decoders: one per field, with its
    default; a typed value is kept across decoder changes and goes into the request. A boolean
    whose default is unset (the model's choice) is a three-way choice: unset, on or off."""
    fields = {d["id"]: d["fields"] for d in httpx.get(live.url + "/v1/decoders").json()["data"]}

    def shown_default(f):
        if f["type"] == "boolean":
            return "" if f["default"] is None else bool(f["default"])
        if isinstance(f["default"], float) and f["default"].is_integer():
            return str(int(f["default"]))  # (as the page's number input writes it: 1.0 is "1")
        return "" if f["default"] is None else str(f["default"])

    for decoder in ("speculative", "refusion", "ar", "mdm", "mdm-threshold"):
        page.select_option("#decoder", decoder)
        shown = page.locator("#params input, #params select").evaluate_all(
            "els => els.map(e => [e.id, e.type === 'checkbox' ? e.checked : e.value])")
        assert shown == [[f["name"], shown_default(f)] for f in fields[decoder]]
    page.select_option("#decoder", "speculative")
    assert "draft_length" not in page.evaluate("requestBody()")  # unset: the model's settings decide
    page.select_option("#decoder", "refusion")
    page.fill("#slot_size", "4")
    page.check("#checks")
    page.select_option("#decoder", "mdm")
    page.select_option("#decoder", "refusion-l2r")
    assert page.input_value("#slot_size") == "4" and page.is_checked("#checks")
    body = page.evaluate("requestBody()")
    assert (body["decoder"], body["slot_size"], body["checks"]) == ("refusion-l2r", 4, True)
    assert "block_length" not in body
    page.uncheck("#checks")


SCHEMA = {"type": "object", "properties": {"op": {"enum": ["add", "sort"]},
                                          "sum": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["op", "sum"], "additionalProperties": False}


def test_a_json_schema_and_token_probabilities_on_hover(live, page, shots):
    """The schema box sends response_format json_schema; with probabilities on, hovering over a
    cell shows its token's probability and the alternatives the API reports there."""
    import math

    jsonschema = pytest.importorskip("jsonschema")
    page.select_option("#decoder", "speculative")
    page.fill("#json_schema", json.dumps(SCHEMA))
    page.check("#logprobs")
    prompt = next(p for p in task_prompts(1) if p.startswith("Add"))
    run_on_page(page, prompt, "speculative", {})
    body = dict(page.evaluate("requestBody()"), stream=False)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "page", "schema": SCHEMA}}
    assert (body["logprobs"], body["top_logprobs"]) == (True, 5)
    api = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    shown = page.inner_text("#answer")
    assert shown == api["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(shown), SCHEMA)
    content = api["choices"][0]["logprobs"]["content"]
    assert len(content) >= 5
    for i in (0, 1, len(content) - 1):
        page.hover(f"#slots span:nth-child({i + 1})")
        page.wait_for_selector("#tip", state="visible")
        rows = page.locator("#tip tr").evaluate_all("els => els.map(e => [...e.cells].map(c => c.textContent))")
        entry = content[i]
        # the alternatives the distribution allows (-9999: excluded, by the grammar here)
        alts = [a for a in entry["top_logprobs"] if a["token"] != entry["token"] and a["logprob"] > -9999]
        want = [entry] + alts
        assert [r[0] for r in rows] == [json.dumps(a["token"]) for a in want]
        # (rounded by JavaScript's toFixed, half away from zero: compared to within the rounding)
        assert [float(r[1].removesuffix("%")) for r in rows] == pytest.approx(
            [100 * math.exp(a["logprob"]) for a in want], abs=0.05 + 1e-9)
        assert [float(r[2]) for r in rows] == pytest.approx([a["logprob"] for a in want], abs=0.005 + 1e-9)
    # the screenshot shows the cell with the most alternatives the grammar allowed
    richest = max(range(len(content)), key=lambda i: sum(a["logprob"] > -9999 for a in content[i]["top_logprobs"]))
    page.hover(f"#slots span:nth-child({richest + 1})")
    page.screenshot(path=str(shots / "json_schema_logprobs.png"), full_page=True)
    # a decoder that cannot apply them: both controls off, and the request carries neither
    page.select_option("#decoder", "refusion")
    assert page.is_disabled("#json_schema") and page.is_disabled("#logprobs")
    assert "response_format" not in page.evaluate("requestBody()")
    page.select_option("#decoder", "speculative")
    page.fill("#json_schema", "{not json")
    page.click("#run")
    page.wait_for_selector("body[data-state=error]", timeout=30_000)
    assert "the JSON schema is not JSON" in page.inner_text("#error")
    page.fill("#json_schema", "")
    page.uncheck("#logprobs")
    page.mouse.move(0, 0)


# Records a view's state each time the page shows another step in it: the step, the answer cells
# filled and dropped, the answer text, and when.
WATCH = """([sel, key]) => {
  window[key] = [];
  const root = document.querySelector(sel);
  new MutationObserver(() => {
    const cells = [...root.querySelectorAll('.slots span')];
    const idx = (cls) => cells.flatMap((c, i) => c.classList.contains(cls) ? [i] : []);
    window[key].push({k: +root.dataset.step, filled: idx('filled'), dropped: idx('dropped'),
                      text: root.querySelector('.answer').textContent, t: performance.now()});
  }).observe(root, {attributes: true, attributeFilter: ['data-step']});
}"""


def distinct_steps(snaps: list[dict]) -> list[dict]:
    """One snapshot per step shown (a view that has finished keeps showing its last step)."""
    out = []
    for s in snaps:
        if not out or out[-1]["k"] != s["k"]:
            out.append(s)
    return out


def run_on_page(page, prompt: str, decoder: str, settings: dict, typed: bool = False) -> None:
    """Fill the form and run it; `typed`: the prompt is typed key by key, as a person would."""
    if typed:
        page.fill("#prompt", "")
        page.type("#prompt", prompt)
    else:
        page.fill("#prompt", prompt)
    page.select_option("#decoder", decoder)
    page.fill("#max_tokens", "64")
    for sel, value in settings.items():
        if value is True:
            page.check(sel)
        else:
            page.fill(sel, value)
    page.click("#run")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)


def check_replayed(snaps: list[dict], api: dict, final_text: str) -> None:
    """Step by step, the view shows exactly the answer tokens committed before that step, and a
    prefix of the answer that grows to the whole of it."""
    steps = api["refusion"]["steps"]
    n = max(steps) + 1
    assert [s["k"] for s in snaps] == list(range(n + 1))
    for s in snaps:
        assert set(s["filled"]) == {i for i, st in enumerate(steps) if st < s["k"]}
        assert all(i >= len(steps) for i in s["dropped"])  # only slots after the answer's end
        assert final_text.startswith(s["text"])
    assert snaps[0]["filled"] == [] and snaps[0]["text"] == "" and snaps[-1]["text"] == final_text
    lengths = [len(s["filled"]) for s in snaps]
    assert lengths == sorted(lengths)
    if min(steps) < max(steps):  # answer tokens came in more than one step: states between are shown
        assert any(0 < m < len(steps) for m in lengths)


REPEAT = {"#slot_size": "4", "#slot_threshold": "0.999", "#token_threshold": "0.99"}


def test_the_replay_shows_the_commits_step_by_step(live, page, shots):
    """Plan-and-infill, strict thresholds: slots commit over several steps and out of order. The
    replay redraws the answer step by step at the chosen speed; the slider shows any step."""
    prompt = next(p for p in task_prompts(1) if p.startswith("Repeat"))
    run_on_page(page, prompt, "refusion", REPEAT)
    api = httpx.post(live.url + "/v1/chat/completions", json=dict(page.evaluate("requestBody()"), stream=False),
                     timeout=60).json()
    steps, final = api["refusion"]["steps"], page.inner_text("#answer")
    assert final == api["choices"][0]["message"]["content"]
    page.screenshot(path=str(shots / "answer.png"), full_page=True)

    page.evaluate(WATCH, ["#main", "snaps"])
    page.select_option("#speed", "25")
    page.click("#replay")
    page.wait_for_selector("body[data-replay=done]", timeout=30_000)
    snaps = distinct_steps(page.evaluate("window.snaps"))
    check_replayed(snaps, api, final)
    # slots fill out of order on the page exactly when the decoder committed them out of order
    in_order = steps == sorted(steps)
    assert in_order == all(s["filled"] == list(range(len(s["filled"]))) for s in snaps)
    assert not in_order  # this prompt and these settings do commit out of order
    # at 25 steps a second, never faster
    assert snaps[-1]["t"] - snaps[0]["t"] >= (len(snaps) - 1) * 40 - 5
    assert page.locator("#slots span.filled").count() == len(steps)  # ends as the answer ended

    # the slider: the state after step k, which the replay passed through
    k = next(s for s in snaps if 0 < len(s["filled"]) < len(steps))["k"]
    page.evaluate("k => { const r = document.getElementById('scrub'); r.value = k;"
                  " r.dispatchEvent(new Event('input')); }", k)
    shown = page.locator("#slots span").evaluate_all("els => els.flatMap((e, i) => e.classList.contains('filled') ? [i] : [])")
    assert set(shown) == {i for i, st in enumerate(steps) if st < k}
    assert f"after step {k} of {max(steps) + 1}" in page.inner_text("#replay_info")
    page.screenshot(path=str(shots / "replay_step.png"), full_page=True)


def test_the_legend_has_the_colours_of_the_steps(live, page):
    run_on_page(page, next(p for p in task_prompts(1) if p.startswith("Repeat")), "refusion", REPEAT)
    body = dict(page.evaluate("requestBody()"), stream=False)
    api = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()
    cells = page.locator("#slots span.filled, #slots span.dropped").evaluate_all(
        "els => els.map(e => [+e.title.split('step ')[1], e.style.backgroundColor])")  # (computed: mid-transition)
    swatches = page.locator("#legend span[data-step]").evaluate_all(
        "els => els.map(e => [+e.dataset.step, e.style.backgroundColor, e.title])")
    legend = {step: colour for step, colour, _ in swatches}
    assert [s for s, _, _ in swatches] == sorted({s for s, _ in cells})  # every step that committed, in order
    assert set(api["refusion"]["steps"]) <= set(legend)
    for step, colour in cells:
        assert colour == legend[step]
    assert len(set(legend.values())) == len(legend)  # steps tell apart
    for step, _, title in swatches:  # and each says how many tokens its step committed
        assert title.startswith(f"step {step}: {sum(s == step for s, _ in cells)} token")
    assert page.locator("#legend span.pending").count() == 1 and page.locator("#legend span.dropped").count() == 1


@pytest.mark.parametrize("left,right", [("ar", "speculative"), ("speculative", "refusion")])
def test_two_decoders_side_by_side(live, page, shots, left, right):
    """Each pane shows the API's answer and counters for the same prompt with its decoder, and the
    summary says what the right one buys over the left."""
    prompt = next(p for p in task_prompts(1) if p.startswith("Add"))
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", "96")  # the whole working of an addition
    page.select_option("#decoder", "speculative")
    page.select_option("#cmp_a", left)
    page.select_option("#cmp_b", right)
    page.click("#compare")
    page.wait_for_selector("body[data-compare=done]", timeout=60_000)
    bodies = page.evaluate("window.compareBodies")
    assert [b["decoder"] for b in bodies] == [left, right]
    apis = []
    for body, pane in zip(bodies, ("#pane_a", "#pane_b"), strict=True):
        assert body["messages"][0]["content"] == prompt and body["max_tokens"] == 96
        api = httpx.post(live.url + "/v1/chat/completions", json=dict(body, stream=False), timeout=60).json()
        ext = api["refusion"]
        apis.append(api)
        assert page.inner_text(f"{pane} h3") == body["decoder"]
        assert page.inner_text(f"{pane} .answer") == api["choices"][0]["message"]["content"]
        counters = {k: page.inner_text(f"{pane} td[data-k={k}]") for k in ("tokens", "forwards", "tpf", "ms", "wall_ms")}
        assert counters["tokens"] == str(len(ext["token_ids"])) == str(api["usage"]["completion_tokens"])
        # (the page rounds with JavaScript's toFixed, half away from zero, Python's format half to even:
        # 69 / 8 = 8.625 shows as 8.63 there and formats as 8.62 here)
        assert counters["forwards"] == str(ext["forwards"])
        assert float(counters["tpf"]) == pytest.approx(ext["tpf"], abs=0.005 + 1e-9)
        ms, wall = (float(counters[k].removesuffix(" ms")) for k in ("ms", "wall_ms"))
        assert 0 < ms <= wall
        assert page.locator(f"{pane} .slots span.filled").count() == len(ext["token_ids"])
    a, b = (x["refusion"] for x in apis)
    same = apis[0]["choices"][0]["message"]["content"] == apis[1]["choices"][0]["message"]["content"]
    summary = page.inner_text("#summary")
    assert summary.startswith(f"{right} against {left}: {'the same answer' if same else 'a different answer'}, "
                              f"{b['forwards']} forwards instead of {a['forwards']} (")
    # (rounded by toFixed, half away from zero: 9 / 8 shows as 1.13, which Python formats as 1.12)
    fewer = float(summary.split(" (", 1)[1].split("x fewer)", 1)[0])
    assert fewer == pytest.approx(a["forwards"] / b["forwards"], abs=0.005 + 1e-9)
    if (left, right) == ("ar", "speculative"):
        assert same and b["forwards"] < a["forwards"]  # greedy speculative is ar's answer, in fewer forwards
    page.screenshot(path=str(shots / f"compare_{left}_{right}.png"), full_page=True)

    # replayed in lock step: the pane that needs fewer steps is complete sooner
    page.evaluate(WATCH, ["#pane_a", "snaps_a"])
    page.evaluate(WATCH, ["#pane_b", "snaps_b"])
    page.select_option("#speed", "25")
    page.click("#replay_both")
    page.wait_for_selector("body[data-replay=done]", timeout=60_000)
    snaps = [distinct_steps(page.evaluate(f"window.{k}")) for k in ("snaps_a", "snaps_b")]
    for s, api in zip(snaps, apis, strict=True):
        check_replayed(s, api, api["choices"][0]["message"]["content"])
    done = [s[-1]["t"] for s in snaps]
    n = [len(s) for s in snaps]
    if n[0] != n[1]:
        assert (done[0] < done[1]) == (n[0] < n[1])
    page.select_option("#decoder", "speculative")
