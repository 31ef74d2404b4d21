"""benchmarks/draft_sources.py's bookkeeping on a tiny looping model: every step is counted under
the draft it fed, the counts add up to the tokens and forwards decoded, the output is AR's, and the
best draft on offer is accepted at least as far as the one fed."""

import sys
from pathlib import Path

import numpy as np
import pytest

from refusion.decoding import ARParams, costs, generate_ar, widths

from tests.decoding.test_lookup import PROMPTS, looping_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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
    alts = r["alternatives"]
    assert sum(a["steps"] for a in alts.values()) == steps
    assert all(0 <= v <= 64 for a in alts.values() for k, v in a.items() if k != "steps")
    b = r["branches"]["accepted_per_step"]
    assert set(b) == {"alone"} | {f"first cut at {a}" for a in range(1, 7)}
    assert all(v <= per["best of all"] + 1e-9 for v in b.values())  # (no more than the best offer cut at 64)


def test_two_branches_by_hand():
    out = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # the first branch is right for 2 of its 3, the other shares those 2 and goes on right, 4 tokens left for it
    assert draft_sources.two_branches([1, 2, 9, 9], [[1, 2, 3, 4, 5]], out, 0, 8, 3) == 5
    assert draft_sources.two_branches([1, 2, 9, 9], [[1, 2, 3, 4, 5, 6, 7, 8]], out, 0, 8, 3) == 6  # (cut at 2 + 4)
    assert draft_sources.two_branches([7], [[1, 2, 3]], out, 0, 8, 1) == 3  # (wrong at once: the other from x)
    assert draft_sources.two_branches([1, 2], [[1, 2, 3, 4]], out, 0, 8, 2) == 4  # (goes on after a right first)
    assert draft_sources.two_branches([1, 9, 9], [[2, 3]], out, 0, 8, 3) == 1  # (leaves x: wrong; the first's 1 stays)
    assert draft_sources.two_branches([1, 2, 3], [[1, 9]], out, 0, 8, 3) == 3
    assert draft_sources.two_branches([1, 2, 3, 4], [], out, 2, 8, 4) == 0  # (at 2 the output goes on 3, 4)
    assert draft_sources.two_branches([3, 4, 5], [], out, 2, 8, 2) == 2


def test_a_corpus_sample_keeps_whole_answers_in_order():
    from refusion.decoding.corpus import LookupCorpus

    answers = [[1, 2], [3], [4, 5, 6], [7, 8], [9], [10, 11, 12]]
    corpus = LookupCorpus(np.array([t for a in answers for t in (*a, -1)]))
    assert draft_sources.corpus_sample(corpus, 1.0) is corpus and draft_sources.corpus_sample(None, 0.5) is None
    keep = np.random.default_rng(3).random(len(answers)) < 0.5
    sample = draft_sources.corpus_sample(corpus, 0.5, seed=3)
    want = [t for a, k in zip(answers, keep) if k for t in (*a, -1)]
    assert 0 < keep.sum() < len(answers) and sample.tokens.tolist() == want
    assert draft_sources.corpus_sample(corpus, 1e-9) is None


def test_the_corpus_proposes_nothing_where_a_copy_is_on_offer():
    from refusion.decoding.corpus import LookupCorpus

    corpus = draft_sources.CorpusWhereNoCopy(LookupCorpus(np.array([5, 6, 7, 8, -1])))
    assert corpus.propose([5, 6], 2) == ([7, 8], 2)
    corpus.copy_on_offer = True
    assert corpus.propose([5, 6], 2) == ([], 0)


def test_frozen_costs_are_written_once_and_read_back(tmp_path, monkeypatch):
    from refusion.decoding.costs import CostModel

    table = CostModel([1, 4], [[1, 8], [4, 32]], [[1e-3, 2e-3], [2e-3, 5e-3]], packed=True, pad=1e-5)
    monkeypatch.setattr(costs, "cost_model", lambda model: table)
    path = tmp_path / "costs.json"
    first = draft_sources.frozen_costs(None, path)
    monkeypatch.setattr(costs, "cost_model", lambda model: pytest.fail("measured again"))
    again = draft_sources.frozen_costs(None, path)
    for c in (first, again):
        assert c.frozen and c.packed and c.pad == 1e-5
        assert [x.tolist() for x in c.seconds] == [x.tolist() for x in table.seconds]
        assert float(c(2, [10])[0]) == float(table(2, [10])[0])


def test_modelled_seconds_price_every_forward_by_the_frozen_table(monkeypatch):
    """With the frozen table the decode read, each forward (prefills too) is priced at its width: one
    second a forward makes the modelled seconds the forwards and the modelled speed the TPF; a
    second a token, the tokens the forwards were fed. Without one there is no modelled speed."""
    model = looping_model()
    for per_token in (False, True):
        widths.PRIORS.pop(model, None)
        table = costs.CostModel.of(lambda rows, tokens: float(tokens) if per_token else 1.0)
        monkeypatch.setattr(costs, "cost_model", lambda m: table)
        fed = []
        hook = model.register_forward_pre_hook(lambda m, args, kw: fed.append(args[0].numel()), with_kwargs=True)
        r = draft_sources.measure(model, PROMPTS, 40, cap=8, cost=table)
        hook.remove()
        assert len(fed) == r["forwards"]
        if per_token:
            assert r["modelled_seconds"] == sum(fed) > r["forwards"] + sum(map(len, PROMPTS))
        else:
            assert r["modelled_seconds"] == r["forwards"] and r["modelled_tps"] == pytest.approx(r["tpf"])
    assert draft_sources.measure(model, PROMPTS[:1], 8, cap=8)["modelled_seconds"] is None


def test_a_price_table_prices_what_the_frozen_table_chose(monkeypatch):
    """--price-costs: the widths follow the table the decode reads (one second a forward, so wide
    forwards look free), and the modelled seconds are the other table's (a second a token fed)."""
    model = looping_model()
    flat = costs.CostModel.of(lambda rows, tokens: 1.0)
    per_token = costs.CostModel.of(lambda rows, tokens: float(tokens))
    monkeypatch.setattr(costs, "cost_model", lambda m: flat)
    runs = []
    for price in (None, per_token):
        widths.PRIORS.pop(model, None)
        fed = []
        hook = model.register_forward_pre_hook(lambda m, args, kw: fed.append(args[0].numel()), with_kwargs=True)
        runs.append((draft_sources.measure(model, PROMPTS, 40, cap=8, cost=flat, price=price), fed))
        hook.remove()
    (plain, fed_plain), (priced, fed_priced) = runs
    assert fed_priced == fed_plain and priced["outputs"] == plain["outputs"]  # the same choices
    assert plain["modelled_seconds"] == plain["forwards"]
    assert priced["modelled_seconds"] == sum(fed_priced) > priced["forwards"]
