"""A decoder added in this file alone, through the registry's public API, is reachable from the
CLI (its flag in --help and on the command line), the server (its request field, type-checked, and
the decoders endpoint the page builds its controls from) and lm-eval, with no other change.

The toy decoder is greedy AR cut after `keep` tokens, so every answer is exact: AR's first `keep`
tokens. It asks lm-eval for gen_length in whole units of 4, to show the rounding comes from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
from lm_eval.api.instance import Instance

from refusion.cli import main
from refusion.decoding import ARParams, Decoder, decode, register, unregister
from refusion.decoding.common import DecodeResult
from refusion.decoding.registry import option
from refusion.evaluation.lm_eval import ReFusionLM
from refusion.serve.app import ServeConfig, Server
from tests.helpers.reference_ar import generate_ar
from tests.helpers.serving import LiveServer, bundled, task_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class ToyParams:
    """toy: greedy AR, cut short"""

    gen_length: int = option(128, "tokens to generate (at most)")
    keep: int = option(2, "commit only the first KEEP tokens of greedy AR's output")

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")


def run_toy(model, prompts, params: ToyParams, *, eos_ids=None, seed=None, on_commit=None) -> list[DecodeResult]:
    results = generate_ar(model, prompts, ARParams(gen_length=params.gen_length), eos_ids=eos_ids)
    for row, r in enumerate(results):
        n = min(params.keep, len(r.tokens))
        r.tokens, r.positions, r.steps = r.tokens[:n], r.positions[:n], r.steps[:n]
        if on_commit is not None:
            on_commit(row, r.positions, r.tokens)
    return results


TOY = Decoder("toy", ToyParams, run_toy, "greedy AR cut after keep tokens (a test's decoder)", fits=("refusion",),
              needs_mask=False, gen_unit=lambda settings: 4)
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module", autouse=True)
def toy():
    register(TOY)
    yield TOY
    unregister("toy")


def greedy(prompt: list[int], gen_length: int, eos_ids=None) -> list[int]:
    model, _ = bundled()
    (r,) = decode(model, [prompt], "ar", gen_length=gen_length, eos_ids=eos_ids)
    assert len(r.tokens) >= 3  # long enough for keep=3 to cut it
    return r.tokens


def test_decode_runs_it_and_refuses_what_it_does_not_take():
    model, _ = bundled()
    assert decode(model, [PROMPT], "toy", gen_length=8, keep=3)[0].tokens == greedy(PROMPT, 8)[:3]
    with pytest.raises(ValueError, match="decoder 'toy' does not take slot_size"):
        decode(model, [PROMPT], "toy", slot_size=4)
    with pytest.raises(ValueError, match="keep must be an integer >= 1, got 0"):
        decode(model, [PROMPT], "toy", keep=0)


def test_the_cli_has_its_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--keep KEEP" in out and "greedy AR cut after keep tokens" in out and "--decoder {speculative," in out
    assert main(["generate", "--prompt-ids", "1,2,3", "--decoder", "toy", "--keep", "3", "--gen-length", "8",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["decoder"] == "toy" and got["tokens"] == greedy(PROMPT, 8)[:3]
    # its flag belongs to it alone, and the other decoders' flags are not its
    assert main(["generate", "--prompt-ids", "1,2,3", "--decoder", "ar", "--keep", "3"]) == 2
    assert "--keep does not apply to decoder 'ar'" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1,2,3", "--decoder", "toy", "--slot-size", "4"]) == 2
    assert "--slot-size does not apply to decoder 'toy' (its flags: --gen-length, --keep)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def live(toy):
    model, tok = bundled()
    srv = LiveServer(Server(model, tok, ServeConfig(model_name="m")))
    yield srv
    srv.close()


def test_the_server_takes_its_field(live):
    _, tok = bundled()
    eos = sorted(set(bundled()[0].config.eos_ids) | {tok.eos_id})
    want = greedy(PROMPT, 8, eos)[:3]
    r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "decoder": "toy",
                                                       "keep": 3}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["text"] == tok.decode(want)
    for bad, message in (({"keep": "3"}, "keep must be an integer, got str"),
                         ({"keep": 0}, "keep must be an integer >= 1, got 0"),
                         ({"slot_size": 8}, "decoder 'toy' does not take slot_size")):
        r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "decoder": "toy", **bad},
                       timeout=120)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_the_page_finds_it_at_the_decoders_endpoint(live):
    card = httpx.get(live.url + "/v1/models").json()["data"][0]
    assert "toy" in card["decoders"]
    found = {d["id"]: d for d in httpx.get(live.url + "/v1/decoders").json()["data"]}
    assert found["toy"]["description"] == TOY.description and found["toy"]["available"]
    assert found["toy"]["fields"] == [{"name": "keep", "type": "integer", "nullable": False, "default": 2,
                                       "help": "commit only the first KEEP tokens of greedy AR's output"}]
    # and a built-in decoder's fields, with its own defaults (mdm-threshold's threshold)
    assert [(f["name"], f["default"]) for f in found["mdm-threshold"]["fields"]] == [
        ("block_length", 32), ("threshold", 0.9)]  # (prefix_cache is Python-only)


def test_lm_eval_runs_it():
    lm = ReFusionLM(decoder="toy", keep=3)
    assert lm._params(10, 0.0, {}) == {"keep": 3, "gen_length": 12}  # max_gen_toks 10 rounded up to 4s
    _, tok = bundled()
    context = tok.apply_chat_template([{"role": "user", "content": task_prompts(1)[0]}])
    (text,) = lm.generate_until([Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 10}), 0)])
    assert text == tok.decode(greedy(tok.encode(context), 12, lm.eos_ids)[:3])
    with pytest.raises(ValueError, match="decoder 'toy' does not take slot_size"):
        ReFusionLM(decoder="toy", slot_size=8)
