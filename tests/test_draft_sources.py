"""benchmarks/draft_sources.py's bookkeeping on a tiny looping model: every step is counted under
the draft it fed, the counts add up to the tokens and forwards decoded, the output is AR's, and the
best draft on offer is accepted at least as far as the one fed."""

import sys
from pathlib import Path

import pytest

from refusion.decoding import ARParams, generate_ar, widths

from test_lookup import PROMPTS, looping_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import draft_sources  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_steps_are_counted_by_the_draft_fed_and_add_up():
    model = looping_model()
    widths.PRIORS.pop(model, None)
    r = draft_sources.measure(model, PROMPTS, 40, cap=64)
    assert r["outputs"] == [x.tokens for x in generate_ar(model, PROMPTS, ARParams(gen_length=40), eos_ids=[1])]
    kinds = r["kinds"]
    steps = sum(v["steps"] for v in kinds.values())
    assert r["forwards"] == steps + len(PROMPTS)  # and a prefill each
    # each step commits its accepted draft tokens and one more; each prefill one token
    assert r["tokens"] == sum(v["accepted"] + v["steps"] for v in kinds.values()) + len(PROMPTS)
    assert kinds["copy"]["accepted"] > 0 and set(kinds) <= {"masks", "copy", "corpus", "no draft"}
    assert kinds.get("no draft", {}).get("accepted", 0) == 0
    assert r["steps"] == steps
    per = r["accepted_per_step"]
    assert per["the draft fed"] * steps == pytest.approx(sum(v["accepted"] for v in kinds.values()))
    assert per["best of all"] >= per["the draft fed"]
