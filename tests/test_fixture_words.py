"""The trained fixture model tests/fixtures/refusion-words (configs/refusion-words.toml): a sub-megabyte
ReFusion model that knows its tasks (refusion.tasks.words), so decoders can be measured on it."""

import functools
from pathlib import Path

import pytest

from refusion.checkpoint import load_model
from refusion.decoding import decode
from refusion.tasks.words import TASKS
from refusion.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURE = Path(__file__).parent / "fixtures" / "refusion-words"


@functools.lru_cache(maxsize=None)
def fixture():
    assert (FIXTURE / "config.json").exists(), f"the fixture model is missing from {FIXTURE}"
    return load_model(FIXTURE), Tokenizer.from_dir(FIXTURE)


def test_the_fixture_is_a_small_refusion_model():
    model, tok = fixture()
    assert model.config.mask_token_id is not None and model.config.mask_token_id == tok.mask_id
    assert tok.eos_id in model.config.eos_ids
    assert (FIXTURE / "model.safetensors").stat().st_size < 1_000_000
    assert (FIXTURE / "recipe.toml").exists()


def test_ar_solves_most_held_out_queries():
    model, tok = fixture()
    exs = [ex for name in ("sort", "add", "repeat") for ex in TASKS[name].load("test", n=4, seed=7)]
    rs = decode(model, [tok.chat_prompt_ids(ex.prompt) for ex in exs], "ar", max_new_tokens=96)
    outs = [tok.decode([t for t in r.tokens if t not in model.config.eos_ids]) for r in rs]
    right = [TASKS[ex.id.split("/")[0]].score(ex, out).correct for ex, out in zip(exs, outs)]
    assert sum(right) >= 9, list(zip([ex.id for ex in exs], outs, right))  # >= 70% of 12
