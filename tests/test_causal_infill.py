"""Plan-and-infill's `causal_infill` option (refusion.decoding.refusion, PlanInfillSeq._after_iverify).

Each infill round takes one token per row without a check (the spec's rule: at least one new token per
row per round). By default that token is the mask's draft; with `causal_infill` it is the causal
prediction from the accepted token before it, so that, when nothing else is accepted (token_threshold 1)
and each slot starts from a committed token (left to right, join_check), plan-and-infill decodes
exactly what greedy AR decodes. A replaced token was fed as the draft, so its key and value are fed
again before the row is committed: a wrong cache would show up as a later token that differs from AR.
"""

import copy

import pytest

from refusion.decoding import decode
from refusion.decoding.refusion import ReFusionParams, generate_refusion
from test_decoding_refusion import CANDIDATES, PROMPTS, tiny_model

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
    for p, a, r in zip(ps, ar, on):
        assert r.tokens == a.tokens, p
        assert r.positions == list(range(len(p), len(p) + L))
    # without the option the unchecked tokens are the masks' drafts: the test can fail
    assert sum(r.tokens != a.tokens for r, a in zip(off, ar)) >= 3


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
    for p, r in zip(ps, together):
        (alone,) = generate_refusion(model, [p], params, eos_ids=[])
        assert (r.tokens, r.positions, r.forwards) == (alone.tokens, alone.positions, alone.forwards)
        assert r.positions == list(range(len(p), len(p) + 16))


def test_sampling_is_refused():
    with pytest.raises(ValueError, match="causal_infill .* needs temperature 0"):
        ReFusionParams(gen_length=8, slot_size=4, temperature=0.5, causal_infill=True)


def test_on_the_trained_model_left_to_right_with_every_check_is_greedy_ar():
    """The bundled model (causal_first_token, confident drafts that the causal path mostly confirms):
    the same identity, on held-out prompts of its tasks."""
    from bundled import bundled, task_examples

    model, tok = bundled()
    ps = [tok.chat_prompt_ids(ex.prompt) for ex in task_examples(2)]
    ar = decode(model, ps, "ar", max_new_tokens=64)
    on = generate_refusion(model, ps, every_check(64, 8, True), eos_ids=model.config.eos_ids)
    assert [r.tokens for r in on] == [a.tokens for a in ar]
