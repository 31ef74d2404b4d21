"""Plan-and-infill's join check (`join_check`, refusion.decoding.refusion's docstring has the rule).

Off, the decoder is the reference's, token for token. On, each rule is checked on a case where its
result can be computed by hand without any cache (plan: a slot after a committed token starts with
that token's causal prediction; commit: a slot committed right after another is kept only if it
starts with the causal prediction of the other's last token, in global verification and after an
infill), each on prompts where the default decoder's output differs. Then, on a grid of
settings: batch invariance, no holes, and the invariant the rule guarantees.
"""

import json

import pytest

from refusion.cli import main
from refusion.decoding import decode
from refusion.decoding.refusion import ReFusionParams, generate_refusion
from refusion.model.checkpoint import save_model
from tests.decoding.test_decoding_refusion import (CANDIDATES, PROMPTS, assert_same, causal_argmax, check_output_shape,
                                    first_plan, infill_by_hand, params, pick_eos, run_lib, run_ref, tiny_model)

pytestmark = pytest.mark.usefixtures("one_thread")


def causal_next(model, ids, pos):
    """The greedy causal prediction after the last of ids (one cache-free causal pass)."""
    return causal_argmax(model, ids, pos)[0][-1]


# ---- 1. off: the reference ----------------------------------------------------------------------


@pytest.mark.parametrize("kw", [params(16, 4, 1, 0.9, 0.4), params(16, 4, 2, 0.1, 0.1),
                                params(16, 4, 1, 0.0, 1.0, recompute_kv=True),
                                params(16, 4, 2, 0.0, 0.0, left_to_right=True)])
def test_off_is_the_reference(kw):
    model = tiny_model(0)
    free = [run_ref(model, p, kw, set()) for p in PROMPTS]
    for eos in (set(), {pick_eos(free[0]["tokens"])}):
        res, events = run_lib(model, PROMPTS, kw, eos, join_check=False)
        for i, p in enumerate(PROMPTS):
            assert_same(res[i], events[i], run_ref(model, p, kw, eos), eos, f"{p} {eos}")


# ---- 2. on: each rule on a case computed by hand --------------------------------------------------


@pytest.mark.parametrize("model_seed", [0, 5])
def test_plan_rule_left_to_right(model_seed):
    """refusion-l2r with token_threshold 0: each step plans the leftmost slot and commits it whole
    from one causal verification pass, so the committed tokens are a plain causal sequence. With the
    join check each slot after the first starts with the causal prediction of the token before it
    (the rest is the plan's draft); without it, with the mask's draft."""
    model = tiny_model(model_seed)
    s, L = 4, 16
    differs = 0
    for p in PROMPTS + CANDIDATES[:5]:
        P = len(p)
        expected = {False: [], True: []}
        for join in (False, True):
            out = expected[join]
            for st in range(P, P + L, s):
                ctx_pos = list(range(P + len(out)))
                draft = first_plan(model, p + out, ctx_pos, [st], s)[0][0]
                if join and out:
                    draft[0] = causal_next(model, p + out, ctx_pos)
                out += draft
        for join in (False, True):
            res = generate_refusion(model, [p], ReFusionParams(gen_length=L, slot_size=s, token_threshold=0.0,
                                                               left_to_right=True, join_check=join), eos_ids=[])[0]
            assert res.tokens == expected[join], (p, join)
            assert res.forwards == 2 * (L // s)  # no forward added
        differs += expected[False] != expected[True]
    assert differs >= 3


@pytest.mark.parametrize("model_seed", [0, 5])
def test_plan_rule_scores_by_the_causal_probability(model_seed):
    """slot_threshold 1 (the single best-scored slot per plan) and token_threshold 0: each step
    commits one whole slot from one causal pass on top of the earlier ones, so the committed tokens
    are a causal sequence in commit order. A slot after a committed token starts with that token's
    causal prediction and is scored by its causal probability, which decides the order slots are
    taken in."""
    model = tiny_model(model_seed)
    s, L = 4, 16
    orders, differs = set(), 0
    for p in PROMPTS + CANDIDATES[:5]:
        P = len(p)
        ids, pos = list(p), list(range(P))  # committed, in commit order
        undecoded, order = list(range(P, P + L, s)), []
        while undecoded:
            drafts, scores = first_plan(model, ids, pos, undecoded, s)
            amax, probs = causal_argmax(model, ids, pos)
            for i, st in enumerate(undecoded):
                if st - 1 in pos[P:]:
                    at = pos.index(st - 1)
                    drafts[i][0], scores[i] = amax[at], float(probs[at, amax[at]])
            best = max(range(len(undecoded)), key=lambda i: (scores[i], -i))
            ids += drafts[best]
            pos += list(range(undecoded[best], undecoded[best] + s))
            order.append(undecoded.pop(best))
        expected = [t for _, t in sorted(zip(pos[P:], ids[P:], strict=True))]
        kw = params(L, s, 1, 1.0, 0.0)
        res, events = run_lib(model, [p], kw, set(), join_check=True)
        assert res[0].tokens == expected and [ev[0][0] for ev in events[0]] == order, p
        orders.add(tuple(st - P for st in order))
        differs += run_lib(model, [p], kw, set())[0][0].tokens != expected
    assert len(orders) >= 3 and differs >= 3  # slots are taken out of order, in several orders


@pytest.mark.parametrize("model_seed", [0, 5])
def test_commit_rule_in_global_verification(model_seed):
    """Every slot chosen (slot_threshold 0) and every token accepted (token_threshold 0): without the
    check one plan and one verification commit the whole block as drafted. With it, the verification
    pass's causal prediction at each slot's last token must be the next slot's first token; the
    slots up to the first mismatch are committed and the rest re-planned, where the first one then
    starts with the prediction of the committed token before it."""
    model = tiny_model(model_seed)
    s, L = 4, 16
    replanned = 0
    for p in PROMPTS + CANDIDATES[:5]:
        P = len(p)
        out, forwards = [], 0
        while len(out) < L:
            ctx_pos = list(range(P + len(out)))
            starts = list(range(P + len(out), P + L, s))
            drafts = first_plan(model, p + out, ctx_pos, starts, s)[0]
            if out:
                drafts[0][0] = causal_next(model, p + out, ctx_pos)
            flat = [t for d in drafts for t in d]
            amax = causal_argmax(model, p + out + flat, list(range(P + L)))[0]
            k = 1
            while k < len(drafts) and drafts[k][0] == amax[len(p + out) + k * s - 1]:
                k += 1
            out += flat[: k * s]
            forwards += 2
        kw = dict(gen_length=L, slot_size=s, slot_threshold=0.0, token_threshold=0.0)
        res = generate_refusion(model, [p], ReFusionParams(**kw, join_check=True), eos_ids=[])[0]
        assert (res.tokens, res.forwards) == (out, forwards), p
        if forwards > 2:
            replanned += 1
            default = generate_refusion(model, [p], ReFusionParams(**kw), eos_ids=[])[0]
            assert default.forwards == 2 and default.tokens != out
    assert replanned >= 3


@pytest.mark.parametrize("recompute_kv", [False, True])
@pytest.mark.parametrize("model_seed", [0, 5])
def test_commit_rule_after_infill(model_seed, recompute_kv):
    """Every slot chosen, token_threshold 1: everything goes through infill (s-1 rounds, rows that do
    not see each other). Without the check all rows are committed at once. With it, row i is kept
    only if its first token is the causal prediction at row i-1's last token, in the pass whose KV is
    kept: row i-1's own infill pass (context and row i-1), or the recompute pass (context and every
    row before); the next plan's first slot then starts with that prediction."""
    model = tiny_model(model_seed)
    s = 4
    cut = 0
    for p in PROMPTS + CANDIDATES[:10]:
        P = len(p)
        starts = [P, P + s, P + 2 * s]
        flat = infill_by_hand(model, p, list(range(P)), starts, s)
        rows = [flat[i: i + s] for i in range(0, 3 * s, s)]
        if recompute_kv:
            amax = causal_argmax(model, p + flat, list(range(P + 3 * s)))[0]
            preds = [amax[P + (i + 1) * s - 1] for i in range(2)]
        else:
            preds = [causal_next(model, p + rows[i], list(range(P)) + list(range(starts[i], starts[i] + s)))
                     for i in range(2)]
        k = next((i for i in (1, 2) if rows[i][0] != preds[i - 1]), 3)
        kw = params(3 * s, s, 1, 0.0, 1.0, recompute_kv=recompute_kv)
        _, events = run_lib(model, [p], kw, set(), join_check=True)
        assert events[0][0] == (list(range(P, P + k * s)), flat[: k * s]), p
        _, default = run_lib(model, [p], kw, set())
        assert default[0][0] == (list(range(P, P + 3 * s)), flat)
        if k < 3:
            cut += 1
            assert events[0][1][0][0] == starts[k] and events[0][1][1][0] == preds[k - 1]
    assert cut >= 3


# ---- 3. on: batch invariance and the invariant, on a grid ---------------------------------------------


def join_violations(model, prompt, res, events, s):
    """Slot starts st (after the first slot) whose token differs from the greedy causal prediction at
    st-1, where st-1 was committed no later than st. With recompute_kv every commit's KV comes from
    one causal pass over its tokens on top of the earlier commits, so one cache-free causal pass over
    everything committed, in commit order, gives the prediction each committed token made."""
    P = len(prompt)
    order = [(q, t) for positions, tokens in events for q, t in zip(positions, tokens, strict=True)]
    commit_of = {q: i for i, (positions, _) in enumerate(events) for q in positions}
    amax = causal_argmax(model, prompt + [t for _, t in order], list(range(P)) + [q for q, _ in order])[0]
    pred = {q: amax[P + i] for i, (q, _) in enumerate(order)}
    return [st for st, t in zip(res.positions, res.tokens, strict=True)
            if st > P and (st - P) % s == 0 and commit_of[st - 1] <= commit_of[st] and t != pred[st - 1]]


SETTINGS = [(0.9, 0.4), (0.0, 0.0), (0.0, 1.0), (0.1, 0.1), (0.2, 0.05)]


@pytest.mark.parametrize("slot_size,serial_blocks", [(2, 1), (4, 2)])
@pytest.mark.parametrize("model_seed", [0, 5])
def test_batch_invariance_and_no_bad_join(model_seed, slot_size, serial_blocks):
    model = tiny_model(model_seed)
    s, L = slot_size, 4 * slot_size
    violations_without = 0
    for slot_threshold, token_threshold in SETTINGS:
        for recompute_kv in (False, True):
            for left_to_right in (False, True):
                kw = params(L, s, serial_blocks, slot_threshold, token_threshold, recompute_kv, left_to_right)
                eos = set()
                for _ in range(2):  # no EOS, then one picked from the output without it
                    batch, events = run_lib(model, PROMPTS, kw, eos, join_check=True)
                    if recompute_kv:
                        off, off_events = run_lib(model, PROMPTS, kw, eos)
                    for i, p in enumerate(PROMPTS):
                        ctx = f"{p} {eos} {kw}"
                        one, one_events = run_lib(model, [p], kw, eos, join_check=True)
                        assert (one[0].tokens, one[0].positions, one[0].forwards) == \
                            (batch[i].tokens, batch[i].positions, batch[i].forwards), ctx
                        assert one_events[0] == events[i], ctx
                        check_output_shape(batch[i], p, L, eos)
                        if recompute_kv:
                            assert join_violations(model, p, batch[i], events[i], s) == [], ctx
                            violations_without += len(join_violations(model, p, off[i], off_events[i], s))
                    eos = {pick_eos(batch[1].tokens)}
    assert violations_without > 0  # the invariant does not hold by accident


# ---- 4. the option reaches users ------------------------------------------------------------------


def test_sampling_is_refused():
    with pytest.raises(ValueError, match="join_check .* needs temperature 0"):
        ReFusionParams(gen_length=8, slot_size=4, temperature=0.5, join_check=True)
    with pytest.raises(ValueError, match="join_check .* needs temperature 0"):
        decode(tiny_model(0), [PROMPTS[0]], "refusion-l2r", gen_length=8, slot_size=4, temperature=0.5,
               join_check=True)


def test_the_checks_flag_turns_the_join_check_on(tmp_path, capsys):
    model = tiny_model(0)
    save_model(model, tmp_path / "m")
    out = {}
    for flags in ([], ["--checks"]):
        argv = ["generate", "--model", str(tmp_path / "m"), "--prompt-ids", "2,3,4", "--gen-length", "16",
                "--decoder", "refusion-l2r", "--slot-size", "4", "--token-threshold", "0", "--json", *flags]
        assert main(argv) == 0
        out[bool(flags)] = json.loads(capsys.readouterr().out)["tokens"]
    for checks in (False, True):
        assert out[checks] == decode(model, [[2, 3, 4]], "refusion-l2r", gen_length=16, slot_size=4,
                                     token_threshold=0.0, join_check=checks, causal_infill=checks,
                                     recheck_rows=checks)[0].tokens
    assert out[True] != out[False]


def test_prompt_join_on_a_model_trained_for_it():
    """A model whose prompt end was trained to predict the first token (causal_first_token): with the
    join check its first slot starts with that prediction; without the flag in its config, from the mask."""
    import copy

    plain = tiny_model(0)
    trained = copy.deepcopy(plain)
    trained.config.causal_first_token = True
    kw = params(16, 4, 1, 0.9, 0.4)
    differs = 0
    for p in PROMPTS + CANDIDATES[:5]:
        first = causal_next(plain, p, list(range(len(p))))
        on = generate_refusion(trained, [p], ReFusionParams(**kw, join_check=True), eos_ids=[])[0]
        assert on.tokens[on.positions.index(len(p))] == first
        off = generate_refusion(plain, [p], ReFusionParams(**kw, join_check=True), eos_ids=[])[0]
        differs += off.tokens[off.positions.index(len(p))] != first
    assert differs  # the mask's first token is not the causal one on some prompt: the test can fail
