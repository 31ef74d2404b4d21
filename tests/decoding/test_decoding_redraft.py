"""`speculative --redraft`: blocks of masks behind x and each draft token, each seeing the draft only up
to its own place, so that after a rejection the next draft comes from the accepted tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refusion.decoding import costs, widths
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from tests.decoding.test_decoding_speculative import MASK, PROMPTS, ar, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

REDRAFT = [dict(draft_length=3, mask_length=2, widths="fixed"), dict(draft_length=4, widths="fixed"),
           dict(widths="adaptive"), dict(widths="adaptive", lookup=True), dict(draft_length=2, widths="fixed", lookup=True),
           dict(), dict(lookup=True), dict(mask_length=3)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", REDRAFT, ids=[str(k) for k in REDRAFT])
def test_greedy_equals_ar_batched_and_alone(seed, kw):
    model = tiny_model(seed)
    ref = ar(model, PROMPTS, 24, [1])
    params = SpeculativeParams(gen_length=24, redraft=True, **kw)
    together = generate_speculative(model, PROMPTS, params, eos_ids=[1])
    for p, r, a in zip(PROMPTS, together, ref, strict=True):
        assert r.tokens == a.tokens and r.positions == a.positions and r.finished == a.finished
        (alone,) = generate_speculative(model, [p], params, eos_ids=[1])
        assert (alone.tokens, alone.positions) == (r.tokens, r.positions)


@pytest.mark.parametrize("js", [(0,), (1,), (2,), (2, 0), (0, 3), (1, 1, 2)])
def test_after_a_rejection_the_draft_is_the_masks_behind_the_accepted_tokens(js):
    """Each row's draft right up to d_j and wrong at d_{j+1}: its next draft is what masks fed after
    x, d1..dj predict in a plain causal forward of the sequence (their first, at the place of the
    token the causal head supplies, is dropped): neither the step's other masks nor the other rows
    (ragged: other prompt and draft lengths) leak into it."""
    model, m = tiny_model(3), 5
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]][:len(js)]
    ks = [4, 5, 3][:len(js)]
    free = ar(model, prompts, 30, [])
    batch = SpeculativeBatch(model, eos_ids=[])
    for p, k in zip(prompts, ks, strict=True):
        batch.add(p, SpeculativeParams(gen_length=30, draft_length=k, mask_length=m, widths="fixed", redraft=True))
    batch.step()  # the prefill: commits each row's first token
    for q, f, j, k in zip(batch.running, free, js, ks, strict=True):
        assert q.res.tokens == f.tokens[:1]
        draft = list(f.tokens[1:1 + k])
        draft[j] = (draft[j] + 1) % MASK
        q.draft = draft
    batch.step()
    for q, p, f, j in zip(batch.running, prompts, free, js, strict=True):
        assert q.res.tokens == f.tokens[:j + 2]  # d1..dj accepted, then the causal token
        assert q.kind == widths.FRESH
        seq = p + f.tokens[:j + 1]  # up to d_j
        ids = torch.tensor([seq + [MASK] * m])
        with torch.inference_mode():
            logits = model(ids, torch.arange(ids.shape[1])[None])
        assert q.draft == logits[0, len(seq) + 1:].argmax(-1).tolist()


def test_redraft_feeds_a_block_per_draft_token_and_counts_them():
    model, p = tiny_model(2), PROMPTS[0]
    batch = SpeculativeBatch(model, eos_ids=[])
    batch.add(p, SpeculativeParams(gen_length=20, draft_length=3, mask_length=2, widths="fixed", redraft=True))
    batch.step()
    (q,) = batch.running
    q.draft = [5, 6, 7]
    ids, pos = q.next_feed()
    x = q.x
    n = len(p) + len(q.res.tokens) - 1  # x's position
    assert ids == [x, 5, 6, 7, MASK, MASK] + [MASK] * 6
    assert pos == list(range(n, n + 6)) + [n + 1, n + 2, n + 2, n + 3, n + 3, n + 4]


def test_what_redraft_feeds_is_what_the_cost_policy_prices():
    assert SpeculativeParams(redraft=True, widths="fixed", draft_length=3, mask_length=2).max_width == 1 + 3 + 2 * 4
    assert SpeculativeParams(redraft=True).max_width == 1 + 8 + 9 * 9  # (the cost policy drafts at most 8 with it)
    assert [widths.fed_tokens(w, -1, True) for w in range(4)] == [1, 1 + 1 + 2 * 2, 1 + 2 + 3 * 3, 1 + 3 + 4 * 4]
    assert [widths.fed_tokens(w, 2, True) for w in range(3)] == [1 + 2, 1 + 1 + 2 * 2, 1 + 2 + 2 * 3]
    w, m = np.arange(5)[:, None], np.array([-1, 2])[None, :]
    for r in (False, True):
        assert widths.fed_tokens_of(w, m, r).tolist() == [[widths.fed_tokens(a, b, r) for b in (-1, 2)] for a in range(5)]


def test_the_steps_feed_what_the_policy_priced():
    """Every redrafting step of the cost policy feeds fed_tokens(width, masks, redraft) tokens."""
    model = tiny_model(1)
    batch = SpeculativeBatch(model, eos_ids=[], cost=costs.CostModel.of(lambda r, t: 1e-3 + 1e-5 * t))
    batch.add(PROMPTS[3], SpeculativeParams(gen_length=40, redraft=True))
    batch.step()
    (q,) = batch.running
    checked = 0
    while len(batch):
        batch.policy.choose_widths(batch.running)
        k = min(q.width, len(q.draft), q.p.gen_length - len(q.res.tokens) - 1)
        ids, _ = q.next_feed()
        q.res.forwards -= 1
        q.res.tokens_fed -= len(ids)
        left = q.p.gen_length - len(q.res.tokens)
        if k and q.width + 1 <= left - k:  # (near the end the masks are cut to the positions left)
            assert len(ids) == widths.fed_tokens(k, -1, True)
            checked += 1
        batch.step()
    assert checked > 3
