"""Plan-and-infill's infill options `causal_infill` and `recheck_rows` (refusion.decoding.refusion).

causal_infill (PlanInfillSeq._after_iverify):
Each infill round takes one token per row without a check (the spec's rule: at least one new token per
row per round). By default that token is the mask's draft; with `causal_infill` it is the causal
prediction from the accepted token before it, so that, when nothing else is accepted (token_threshold 1)
and each slot starts from a committed token (left to right, join_check), plan-and-infill decodes
exactly what greedy AR decodes. A replaced token was fed as the draft, so its key and value are fed
again before the row is committed: a wrong cache would show up as a later token that differs from AR.

recheck_rows (PlanInfillSeq._rows_rechecked): infill rows are verified side by side, so a row after the
first was never checked after the chosen slots before it. With the option, every committed token but
a slot's first is, in the order tokens were committed, above token_threshold or the causal prediction:
checked against one cache-free causal pass over the whole commit order.
"""

import copy

import pytest

from refusion.decoding import decode
from refusion.decoding.refusion import ReFusionParams, generate_refusion
from tests.decoding.test_decoding_refusion import CANDIDATES, PROMPTS, causal_argmax, run_lib, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def first_token_causal(model):
    """The model with causal_first_token set, so that AR and the join check both take the first
    response token from the prompt's last one."""
    m = copy.deepcopy(model)
    m.config.causal_first_token = True
    return m


def every_check(L: int, s: int, causal_infill: bool) -> ReFusionParams:
    return ReFusionParams(gen_length=L, slot_size=s, token_threshold=1.0, left_to_right=True, join_check=True,
                          causal_infill=causal_infill)


@pytest.mark.parametrize("model_seed", [0, 5])
@pytest.mark.parametrize("L,s", [(16, 4), (24, 8), (12, 3)])
def test_left_to_right_with_every_check_is_greedy_ar(model_seed, L, s):
    model = first_token_causal(tiny_model(model_seed))
    ps = PROMPTS + CANDIDATES[:9]
    ar = decode(model, ps, "ar", max_new_tokens=L, eos_ids=[])
    on = generate_refusion(model, ps, every_check(L, s, True), eos_ids=[])  # the whole batch at once
    off = generate_refusion(model, ps, every_check(L, s, False), eos_ids=[])
    for p, a, r in zip(ps, ar, on, strict=True):
        assert r.tokens == a.tokens, p
        assert r.positions == list(range(len(p), len(p) + L))
    # without the option the unchecked tokens are the masks' drafts: the test can fail
    assert sum(r.tokens != a.tokens for r, a in zip(off, ar, strict=True)) >= 3


def test_an_eos_taken_from_the_causal_prediction_ends_the_answer():
    model = first_token_causal(tiny_model(0))
    p = PROMPTS[1]
    (free,) = decode(model, [p], "ar", max_new_tokens=16, eos_ids=[])
    eos = free.tokens[6]  # a token greedy AR writes inside the second slot (not at its start)
    cut = free.tokens.index(eos)
    (ar,) = decode(model, [p], "ar", max_new_tokens=16, eos_ids=[eos])
    (r,) = generate_refusion(model, [p], every_check(16, 4, True), eos_ids=[eos])
    assert r.tokens == ar.tokens == free.tokens[:cut + 1]


@pytest.mark.parametrize("kw", [dict(slot_threshold=0.9, token_threshold=0.4),
                                dict(slot_threshold=0.1, token_threshold=0.1, serial_blocks=2),
                                dict(slot_threshold=0.0, token_threshold=0.0, join_check=True)])
def test_batched_equals_one_at_a_time_and_no_holes(kw):
    model = tiny_model(3)
    ps = PROMPTS + CANDIDATES[:5]
    params = ReFusionParams(gen_length=16, slot_size=4, causal_infill=True, **kw)
    together = generate_refusion(model, ps, params, eos_ids=[])
    for p, r in zip(ps, together, strict=True):
        (alone,) = generate_refusion(model, [p], params, eos_ids=[])
        assert (r.tokens, r.positions, r.forwards) == (alone.tokens, alone.positions, alone.forwards)
        assert r.positions == list(range(len(p), len(p) + 16))


def test_sampling_is_refused():
    with pytest.raises(ValueError, match="causal_infill .* needs temperature 0"):
        ReFusionParams(gen_length=8, slot_size=4, temperature=0.5, causal_infill=True)


def test_on_the_trained_model_left_to_right_with_every_check_is_greedy_ar():
    """The bundled model (causal_first_token, confident drafts that the causal path mostly confirms):
    the same identity, on held-out prompts of its tasks."""
    from tests.helpers.bundled import bundled, task_examples

    model, tok = bundled()
    ps = [tok.chat_prompt_ids(ex.prompt) for ex in task_examples(2)]
    ar = decode(model, ps, "ar", max_new_tokens=64)
    on = generate_refusion(model, ps, every_check(64, 8, True), eos_ids=model.config.eos_ids)
    assert [r.tokens for r in on] == [a.tokens for a in ar]


def unchecked_tokens(model, prompt, events, s, tau) -> int:
    """Committed tokens, other than a slot's first, that the causal pass over the commit order gives
    token_threshold or less and does not predict (a margin for the cached passes' other rounding)."""
    ids, pos = list(prompt), list(range(len(prompt)))
    for positions, tokens in events:
        ids += tokens
        pos += positions
    amax, probs = causal_argmax(model, ids, pos)
    P = len(prompt)
    return sum(1 for i in range(P, len(ids)) if (pos[i] - P) % s
               and amax[i - 1] != ids[i] and float(probs[i - 1, ids[i]]) < tau - 1e-4)


@pytest.mark.parametrize("model_seed,tau", [(0, 0.3), (3, 0.1), (3, 0.3), (5, 0.2)])
def test_recheck_rows_leaves_no_unchecked_token(model_seed, tau):
    model = tiny_model(model_seed)
    s = 4
    kw = dict(gen_length=16, slot_size=s, slot_threshold=0.0, token_threshold=tau, join_check=True,
              causal_infill=True)
    ps = PROMPTS + CANDIDATES[:9]
    on, ev_on = run_lib(model, ps, kw, set(), recheck_rows=True)
    _, ev_off = run_lib(model, ps, kw, set())
    for p, r, ev in zip(ps, on, ev_on, strict=True):
        assert r.positions == list(range(len(p), len(p) + 16))  # no holes
        assert unchecked_tokens(model, p, ev, s, tau) == 0, p
    # without the recheck, rows after the first keep tokens drafted beside their predecessors
    assert sum(unchecked_tokens(model, p, ev, s, tau) for p, ev in zip(ps, ev_off, strict=True)) > 0


def test_recheck_rows_that_accept_everything_is_recompute_kv():
    """token_threshold 0: every row stands, so the pass is exactly the recompute ablation's."""
    model = tiny_model(3)
    ps = PROMPTS + CANDIDATES[:5]
    kw = dict(gen_length=16, slot_size=4, slot_threshold=0.0, token_threshold=0.0)
    a = generate_refusion(model, ps, ReFusionParams(recompute_kv=True, **kw), eos_ids=[])
    b = generate_refusion(model, ps, ReFusionParams(recheck_rows=True, **kw), eos_ids=[])
    assert [(x.tokens, x.positions, x.forwards) for x in a] == [(y.tokens, y.positions, y.forwards) for y in b]


def test_every_check_on_the_trained_model_keeps_greedy_ar_answers():
    """The bundled model with all three checks: batch equals one at a time, no holes."""
    from tests.helpers.bundled import bundled, task_examples

    model, tok = bundled()
    ps = [tok.chat_prompt_ids(ex.prompt) for ex in task_examples(2)]
    params = ReFusionParams(gen_length=64, slot_size=8, join_check=True, causal_infill=True, recheck_rows=True)
    together = generate_refusion(model, ps, params)
    for p, r in zip(ps, together, strict=True):
        (alone,) = generate_refusion(model, [p], params)
        assert (r.tokens, r.positions, r.forwards) == (alone.tokens, alone.positions, alone.forwards)
