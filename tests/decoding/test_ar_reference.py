"""The `ar` decoder (decode(..., "ar"): the speculative batch with no drafts) against the reference loop
(tests/helpers/reference_ar.py): the same tokens and every counter, on random tiny models with and
without a mask token, rows of different lengths, greedy and sampled, the first token from a mask or
from the prompt's last token, EOS in the middle of the batch, streaming and unseeded sampling."""

import functools
import itertools

import pytest
import torch

from refusion.decoding import ARParams, SpeculativeParams, decode, generate_speculative
from refusion.decoding.speculative import SpeculativeBatch
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer
from tests.helpers.reference_ar import generate_ar

MASK = 23
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 2, 3], [4, 4]]
SAMPLING = [dict(), dict(temperature=0.9), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.7)]
FIELDS = ("tokens", "positions", "steps", "forwards", "tokens_fed", "finished")

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def tiny(seed: int, mask: bool, causal_first: bool = False) -> Transformer:
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      mask_token_id=MASK if mask else None, eos_token_id=1, causal_first_token=causal_first)
    return Transformer(cfg).init_weights(seed=seed, std=0.5).eval()


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert [getattr(g, f) for f in FIELDS] == [getattr(w, f) for f in FIELDS]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mask,causal_first,first_from_mask", [
    (True, False, None), (True, False, True), (True, False, False), (True, True, None), (True, True, True),
    (False, False, None), (False, False, False), (False, True, None)])
def test_decode_ar_is_the_reference_token_for_token_and_counter_for_counter(seed, mask, causal_first,
                                                                             first_from_mask):
    model = tiny(seed, mask, causal_first)
    for kw, eos in itertools.product(SAMPLING, ([1], [], None, [5, 7])):
        s = 11 if eos else 0
        p = ARParams(gen_length=16, first_from_mask=first_from_mask, **kw)
        want = generate_ar(model, PROMPTS, p, eos_ids=eos, seed=s)
        same(decode(model, PROMPTS, "ar", gen_length=16, first_from_mask=first_from_mask, eos_ids=eos, seed=s, **kw),
             want)
        if eos == [1]:  # batch 1: each row alone, the same
            for prompt, w in zip(PROMPTS, want, strict=True):
                same(decode(model, [prompt], "ar", gen_length=16, first_from_mask=first_from_mask, eos_ids=eos, seed=s,
                            **kw), [w])


def test_eos_mid_batch_and_streaming_in_the_references_order():
    model = tiny(1, True)
    free = generate_ar(model, PROMPTS, ARParams(gen_length=20), eos_ids=[])
    # a token of row 0's that some row never says: rows end at different steps, some run to the end
    eos = [next(t for t in free[0].tokens[2:] if any(t not in f.tokens for f in free))]
    for kw in SAMPLING[:2]:
        seen_ref, seen = [], []
        want = generate_ar(model, PROMPTS, ARParams(gen_length=20, **kw), eos_ids=eos, seed=4,
                           on_commit=lambda *a: seen_ref.append(a))
        got = decode(model, PROMPTS, "ar", gen_length=20, eos_ids=eos, seed=4, on_commit=lambda *a: seen.append(a),
                     **kw)
        same(got, want)
        assert seen == seen_ref  # every commit, in the same order
        if not kw:
            assert got[0].finished and not all(r.finished for r in got)


@pytest.mark.parametrize("mask", [True, False])
def test_unseeded_sampling_draws_the_references_seeds(mask):
    model = tiny(2, mask)
    p = ARParams(gen_length=12, temperature=1.0)
    torch.manual_seed(5)
    want = generate_ar(model, PROMPTS, p, eos_ids=[1])
    torch.manual_seed(5)
    same(decode(model, PROMPTS, "ar", gen_length=12, temperature=1.0, eos_ids=[1]), want)


def test_gen_length_one_and_a_batch_whose_rows_all_end_at_once():
    model = tiny(0, False)
    same(decode(model, PROMPTS, "ar", gen_length=1, eos_ids=[]), generate_ar(model, PROMPTS, ARParams(gen_length=1),
                                                                             eos_ids=[]))
    same(decode(model, PROMPTS, "ar", gen_length=7, eos_ids=[]), generate_ar(model, PROMPTS, ARParams(gen_length=7),
                                                                             eos_ids=[]))


def test_a_model_without_a_mask_token_runs_no_drafts():
    model = tiny(0, False)
    with pytest.raises(ValueError, match="first_from_mask needs a model with mask_token_id"):
        decode(model, PROMPTS, "ar", gen_length=4, first_from_mask=True)
    with pytest.raises(ValueError, match="speculative decoding needs a model with a mask token"):
        decode(model, PROMPTS, "speculative", gen_length=4)
    # the speculative decoder with no draft budget is plain AR there too
    want = generate_ar(model, PROMPTS, ARParams(gen_length=10), eos_ids=[1])
    same(generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=10, draft_length=0), eos_ids=[1]), want)


def test_plain_rows_beside_drafting_rows_keep_their_output():
    """A batch holding rows with drafts and rows without (the server's): each row's output is what it
    gets alone, the plain rows' counters the reference's, whoever joins or leaves when."""
    model = tiny(3, True)
    ar_p = SpeculativeParams(gen_length=18, draft_length=0, mask_length=0, widths="fixed")
    spec_p = SpeculativeParams(gen_length=18, draft_length=3, widths="fixed")
    batch = SpeculativeBatch(model, eos_ids=[1])
    sids, results, order = {}, {}, [(0, ar_p), (1, spec_p), (2, ar_p), (3, spec_p), (4, ar_p)]
    for step in itertools.count():
        if order and step % 3 == 0:  # one joins every third step
            r, p = order.pop(0)
            sids[batch.add(PROMPTS[r], p, seed=0)] = (r, p)
        results.update(batch.step())
        if not len(batch) and not order:
            break
    for sid, (r, p) in sids.items():
        want = generate_ar(model, [PROMPTS[r]], ARParams(gen_length=18), eos_ids=[1])
        if p is ar_p:
            same([results[sid]], want)
        else:
            assert results[sid].tokens == want[0].tokens


def test_a_plain_run_goes_on_while_a_long_row_joins_and_the_cache_grows():
    """Rows joining a batch whose plain rows are stepping: the cache grows (rows and columns) under the
    running rows, whose writes follow it; greedy and sampled rows side by side, each row its reference."""
    model = tiny(4, True)
    greedy, sampled = ARParams(gen_length=30), ARParams(gen_length=30, temperature=0.9, top_k=8)
    long = [2 + i % 21 for i in range(300)]  # past the cache's first capacity (cache.CAPACITY_STEP)
    rows = [(PROMPTS[1], greedy), (PROMPTS[3], sampled), (long, sampled), (PROMPTS[0], greedy)]
    batch = SpeculativeBatch(model, eos_ids=[])  # (every row runs to its end)
    sids, results = {}, {}
    for step in itertools.count():
        if rows and step % 4 == 0:
            prompt, p = rows.pop(0)
            spec = SpeculativeParams(gen_length=30, draft_length=0, mask_length=0, widths="fixed",
                                     temperature=p.temperature, top_k=p.top_k)
            if prompt is long:
                capacity = batch.cache.capacity
            sids[batch.add(prompt, spec, seed=9)] = (prompt, p)
        results.update(batch.step())
        if not len(batch) and not rows:
            break
    assert batch.cache.capacity > capacity  # (it grew while rows were running)
    for sid, (prompt, p) in sids.items():
        same([results[sid]], generate_ar(model, [prompt], p, eos_ids=[], seed=9))
