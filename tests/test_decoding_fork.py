"""`speculative --fork`: a second draft fed beside the first from where they part, seeing only its own
branch; a step accepts whichever goes further, and its KV is kept where the first draft's would be."""

from __future__ import annotations

import pytest
import torch

from refusion.decoding import speculative as spec, widths
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from refusion.model.cache import KVCache
from test_decoding_speculative import MASK, PROMPTS, ar, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CHEAP = widths.CostModel.of(lambda rows, tokens: 1e-3 + 1e-7 * tokens)  # wide forwards cost next to nothing
DEAR = widths.CostModel.of(lambda rows, tokens: 1e-3 * tokens)  # every token as dear as a forward of one

FORK = [dict(lookup=True), dict(lookup=True, widths="fixed", draft_length=3), dict(lookup=True, widths="adaptive"),
        dict(lookup=True, fresh_after_miss=False), dict(lookup=True, mask_length=0, widths="fixed", draft_length=4),
        dict(lookup=True, accept_prob=0.9)]  # (greedy: a token this probable is the argmax, so still AR's output)


@pytest.fixture
def forks(monkeypatch):
    """Counts the steps that fed a second draft and those it went further in."""
    seen = dict(fed=0, won=0)
    plain = spec.SpeculativeSeq.advance

    def advance(self, j, extra, mask_preds, redrafted=None, second_run=None):
        seen["fed"] += self.fed_second > 0
        seen["won"] += bool(second_run)
        plain(self, j, extra, mask_preds, redrafted, second_run)

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", advance)
    return seen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", FORK, ids=[str(k) for k in FORK])
def test_greedy_equals_ar_batched_and_alone(seed, kw, forks):
    model = tiny_model(seed)
    ref = ar(model, PROMPTS, 40, [])
    params = SpeculativeParams(gen_length=40, fork=True, **kw)
    together = generate_speculative(model, PROMPTS, params, eos_ids=[], cost=CHEAP)
    for p, r, a in zip(PROMPTS, together, ref):
        assert r.tokens == a.tokens and r.positions == a.positions
        (alone,) = generate_speculative(model, [p], params, eos_ids=[], cost=CHEAP)
        assert alone.tokens == r.tokens


def test_second_drafts_are_fed_and_go_further(forks):
    """(The equality above is only worth something where second drafts were fed and won.)"""
    for seed in range(4):
        generate_speculative(tiny_model(seed), PROMPTS, SpeculativeParams(gen_length=40, fork=True, lookup=True),
                             eos_ids=[], cost=CHEAP)
    assert forks["fed"] > 20 and forks["won"] > 5


def plain_kv(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cache = KVCache(model.config.num_layers)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(len(ids))[None], cache=cache)
    return [k[0, :, :len(ids)] for k in cache.k], [v[0, :, :len(ids)] for v in cache.v]


def forked_step(model, prompts, k, forks_at, second_len, wrong_at=None, mask_length=2):
    """Each row: prefill, then a step whose draft is AR's next k tokens wrong at index forks_at[row]
    and whose second draft is AR's continuation from there (second_len tokens, wrong at wrong_at)."""
    free = ar(model, prompts, 40, [])
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    for p in prompts:
        batch.add(p, SpeculativeParams(gen_length=40, draft_length=k, mask_length=mask_length, widths="fixed",
                                       fork=True, lookup=False))
    batch.step()
    for q, f, s in zip(batch.running, free, forks_at):
        truth = f.tokens[1:]
        draft = list(truth[:k])
        if s is not None:
            draft[s] = (draft[s] + 1) % MASK
            q.second, q.second_at = list(truth[s: s + second_len]), s
            if wrong_at is not None:
                q.second[wrong_at] = (q.second[wrong_at] + 1) % MASK
        q.draft = draft
    batch.step()
    return batch, free


@pytest.mark.parametrize("forks_at", [(0,), (2,), (3,), (1, None), (None, 0), (2, 0, 1)])
def test_a_second_draft_that_goes_further_is_committed_with_its_kv(forks_at, forks):
    """Rows whose first draft is wrong at the fork and whose second is right 4 tokens on commit the
    first's tokens up to the fork, the second's 4, and the causal token after them; every kept
    cache column holds what a plain causal forward of the committed tokens computes (the second
    draft's KV moved to the columns after the fork); ragged rows do not disturb each other."""
    model = tiny_model(2)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]][:len(forks_at)]
    batch, free = forked_step(model, prompts, 4, forks_at, 6)  # (it feeds draft_length of them)
    for q, p, f, s in zip(batch.running, prompts, free, forks_at):
        n = 1 + (s + 4 if s is not None else 4) + 1  # the prefill's token, the accepted run, the causal token
        assert q.res.tokens == f.tokens[:n]
        assert q.c == len(p) + n - 1  # all but the newest token are cached
        want_k, want_v = plain_kv(model, p + q.res.tokens[:-1])
        got_k, got_v = batch.cache.row(batch.running.index(q), q.c)
        for a, b in zip(want_k + want_v, got_k + got_v):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert forks["won"] == sum(s is not None for s in forks_at)
    while len(batch):  # and the decode goes on to AR's output
        for sid, r in batch.step():
            assert r.tokens == free[sid].tokens


def test_a_second_draft_wrong_on_its_third_token_commits_two():
    model = tiny_model(1)
    batch, free = forked_step(model, [PROMPTS[1]], 4, (1,), 5, wrong_at=2)
    (q,) = batch.running
    assert q.res.tokens == free[0].tokens[:1 + 1 + 2 + 1]
    assert q.acceptance.reached[widths.SECOND, :3].tolist() == [1, 1, 1]
    assert q.acceptance.accepted[widths.SECOND, :3].tolist() == [1, 1, 0]
    # (a model without a mask adapter keeps the rest of a rejected draft: the second's, after the miss)
    assert q.draft == free[0].tokens[1 + 1 + 3: 1 + 1 + 5] and q.kind == widths.AFTER_MISS


def test_a_second_draft_is_counted_only_where_it_was_tested():
    """A first draft accepted past the fork leaves its second untested: no SECOND count; the step
    is an ordinary one (the masks behind the whole draft draft the next)."""
    model = tiny_model(1)
    free = ar(model, [PROMPTS[1]], 40, [])
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    batch.add(PROMPTS[1], SpeculativeParams(gen_length=40, draft_length=4, mask_length=3, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    q.draft = list(free[0].tokens[1:5])
    q.second, q.second_at = [(free[0].tokens[2] + 1) % MASK, 5, 6], 1
    batch.step()
    assert q.res.tokens == free[0].tokens[:6]
    assert q.acceptance.reached[widths.SECOND].sum() == 0
    assert len(q.draft) == 2 and q.kind == widths.FRESH


def test_the_feed_puts_the_second_draft_after_the_masks_at_the_fork_positions():
    model = tiny_model(0)
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, draft_length=3, mask_length=2, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    q.draft, q.second, q.second_at, q.second_width = [5, 6, 7], [8, 9, 10, 11], 1, 3
    ids, pos = q.next_feed()
    n = len(PROMPTS[0]) + len(q.res.tokens) - 1  # x's position
    assert ids == [q.x, 5, 6, 7, MASK, MASK, 8, 9, 10]
    assert pos == list(range(n, n + 6)) + [n + 2, n + 3, n + 4]
    assert (q.second_from, q.fed_second) == (6, 3)
    q.second_at = 3  # a fork at the draft's end is no second draft: the first goes on
    ids, _ = q.next_feed()
    assert q.fed_second == 0 and len(ids) == 6


def test_the_second_draft_sees_x_the_shared_tokens_and_its_own_branch_only():
    """The attention mask: the second draft's tokens see the cache, x and the draft up to the fork,
    then their own earlier tokens; the first draft and its masks never see the second."""
    model = tiny_model(0)
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, draft_length=3, mask_length=2, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    q.draft, q.second, q.second_at, q.second_width = [5, 6, 7], [8, 9], 1, 2
    ids, _ = q.next_feed()
    W, c = len(ids), q.c
    col = c + torch.arange(W)[None].numpy()
    used = c + W
    mask = batch._branch_mask([q], col, torch.tensor([W]).numpy(), torch.arange(used)[None, None, :],
                              torch.from_numpy(col))[0]
    sees = [[int(i) - c for i in torch.nonzero(row).flatten() if i >= c] for row in mask]
    assert all(bool(row[:c].all()) for row in mask)  # every fed token sees the kept columns
    assert sees == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                    [0, 1, 6], [0, 1, 6, 7]]


def test_second_draft_is_where_the_runner_up_parts():
    assert spec._second_draft([1, 2, 3], [[1, 2, 3, 4], [1, 5, 6], [7]]) == ([5, 6], 1)  # (a longer same draft: none)
    assert spec._second_draft([1, 2, 3], [[7, 8]]) == ([7, 8], 0)
    assert spec._second_draft([1, 2], [[1, 2], [1]]) == ([], 0)
    assert spec._second_draft([], [[1, 2]]) == ([], 0)


@pytest.mark.parametrize("temperature,top_p", [(0.8, None), (1.0, 0.9)])
def test_sampled_output_is_the_same_with_and_without_fork(temperature, top_p, forks):
    """Sampled tokens are position-keyed draws: a second draft changes how many a step commits, never
    which."""
    for seed in range(3):
        model = tiny_model(seed)
        kw = dict(gen_length=40, temperature=temperature, top_p=top_p, lookup=True)
        plain = generate_speculative(model, PROMPTS, SpeculativeParams(**kw), eos_ids=[], seed=7, cost=CHEAP)
        forked = generate_speculative(model, PROMPTS, SpeculativeParams(fork=True, **kw), eos_ids=[], seed=7,
                                      cost=CHEAP)
        assert [r.tokens for r in forked] == [r.tokens for r in plain]
    assert forks["won"] > 0


def test_the_policy_feeds_a_second_draft_only_where_it_pays():
    def widths_fed(cost):
        batch = SpeculativeBatch(tiny_model(0), eos_ids=[], cost=cost)
        batch.add(PROMPTS[1], SpeculativeParams(gen_length=30, draft_length=4, mask_length=2, widths="fixed",
                                                fork=True))
        batch.step()
        (q,) = batch.running
        q.draft, q.second, q.second_at = [5, 6, 7, 8], [9, 10, 11, 12, 13], 1
        batch._choose_seconds()
        return q.second_width

    assert widths_fed(CHEAP) == 4  # (no more than draft_length)
    assert widths_fed(DEAR) == 0


def test_fork_is_refused_with_redraft_and_counts_in_the_widest_step():
    with pytest.raises(ValueError, match="fork and redraft"):
        SpeculativeParams(fork=True, redraft=True)
    assert SpeculativeParams(fork=True, widths="fixed", draft_length=3, mask_length=2).max_width == 1 + 3 + 2 + 3
