"""`speculative --fork`: other drafts fed beside the first as branches from where each parts from it,
each seeing only its own branch; a step accepts whichever goes furthest, and its KV is kept where the
first draft's would be."""

from __future__ import annotations

import pytest
import torch

from refusion.decoding import costs, speculative as spec, widths
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from refusion.decoding.speculative_policy import as_cpu_batch, branches
from refusion.decoding.params import MAX_BRANCHES
from refusion.model.cache import KVCache
from tests.decoding.test_decoding_speculative import MASK, PROMPTS, ar, tiny_model
from tests.helpers.fork_counter import count_forks

pytestmark = pytest.mark.usefixtures("one_thread")

# wide forwards cost next to nothing, as on an accelerator (not packed: a CPU batch feeds no branches,
# FeedPolicy.cpu_batch)
CHEAP = costs.CostModel.of(lambda rows, tokens: 1e-3 + 1e-7 * tokens, packed=False)
DEAR = costs.CostModel.of(lambda rows, tokens: 1e-3 * tokens)  # every token as dear as a forward of one

FORK = [dict(lookup=True), dict(lookup=True, widths="fixed", draft_length=3), dict(lookup=True, widths="adaptive"),
        dict(lookup=True, fresh_after_miss=False), dict(lookup=True, mask_length=0, widths="fixed", draft_length=4),
        dict(lookup=True, accept_prob=0.9)]  # (greedy: a token this probable is the argmax, so still AR's output)


@pytest.fixture
def forks(monkeypatch):
    """Counts the steps that fed a branch, those that fed two or more, and those a branch went further in."""
    return count_forks(monkeypatch)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kw", FORK, ids=[str(k) for k in FORK])
def test_greedy_equals_ar_batched_and_alone(seed, kw, forks):
    model = tiny_model(seed)
    ref = ar(model, PROMPTS, 40, [])
    params = SpeculativeParams(gen_length=40, fork=True, **kw)
    together = generate_speculative(model, PROMPTS, params, eos_ids=[], cost=CHEAP)
    for p, r, a in zip(PROMPTS, together, ref, strict=True):
        assert r.tokens == a.tokens and r.positions == a.positions
        (alone,) = generate_speculative(model, [p], params, eos_ids=[], cost=CHEAP)
        assert alone.tokens == r.tokens


def test_branches_are_fed_and_go_further(forks):
    """(The equality above is only worth something where branches were fed, several at once, and won.)"""
    for seed in range(4):
        generate_speculative(tiny_model(seed), PROMPTS, SpeculativeParams(gen_length=40, fork=True, lookup=True),
                             eos_ids=[], cost=CHEAP)
    assert forks["fed"] > 20 and forks["several"] > 5 and forks["won"] > 5


def plain_kv(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    cache = KVCache(model.config.num_layers)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(len(ids))[None], cache=cache)
    return [k[0, :, :len(ids)] for k in cache.k], [v[0, :, :len(ids)] for v in cache.v]


def forked_step(model, prompts, k, forks_at, second_len, wrong_at=None, mask_length=2, decoy=False):
    """Each row: prefill, then a step whose draft is AR's next k tokens wrong at index forks_at[row]
    and whose branch is AR's continuation from there (second_len tokens, wrong at wrong_at); with
    decoy, a branch from the same fork wrong on its first token comes before it."""
    free = ar(model, prompts, 40, [])
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    for p in prompts:
        batch.add(p, SpeculativeParams(gen_length=40, draft_length=k, mask_length=mask_length, widths="fixed",
                                       fork=True, lookup=False))
    batch.step()
    for q, f, s in zip(batch.running, free, forks_at, strict=True):
        truth = f.tokens[1:]
        draft = list(truth[:k])
        if s is not None:
            draft[s] = (draft[s] + 1) % MASK
            branch = list(truth[s: s + second_len])
            if wrong_at is not None:
                branch[wrong_at] = (branch[wrong_at] + 1) % MASK
            q.branches = [(s, branch, widths.SECOND)]
            if decoy:
                q.branches.insert(0, (s, [(truth[s] + 2) % MASK] + branch[1:], widths.ALTERNATIVE))
        q.draft = draft
    batch.step()
    return batch, free


@pytest.mark.parametrize("decoy", [False, True])
@pytest.mark.parametrize("forks_at", [(0,), (2,), (3,), (1, None), (None, 0), (2, 0, 1)])
def test_a_branch_that_goes_further_is_committed_with_its_kv(forks_at, decoy, forks):
    """Rows whose first draft is wrong at the fork and whose branch is right 4 tokens on commit the
    first's tokens up to the fork, the branch's 4, and the causal token after them; every kept
    cache column holds what a plain causal forward of the committed tokens computes (the branch's
    KV moved to the columns after the fork); ragged rows do not disturb each other. With a decoy
    branch fed before it from the same fork, the right one is still found and its KV kept."""
    model = tiny_model(2)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]][:len(forks_at)]
    batch, free = forked_step(model, prompts, 4, forks_at, 6, decoy=decoy)  # (it feeds draft_length of them)
    for q, p, f, s in zip(batch.running, prompts, free, forks_at, strict=True):
        n = 1 + (s + 4 if s is not None else 4) + 1  # the prefill's token, the accepted run, the causal token
        assert q.res.tokens == f.tokens[:n]
        assert q.c == len(p) + n - 1  # all but the newest token are cached
        want_k, want_v = plain_kv(model, p + q.res.tokens[:-1])
        got_k, got_v = batch.cache.row(batch.running.index(q), q.c)
        for a, b in zip(want_k + want_v, got_k + got_v, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert forks["won"] == sum(s is not None for s in forks_at)
    while len(batch):  # and the decode goes on to AR's output
        for sid, r in batch.step():
            assert r.tokens == free[sid].tokens


def test_a_branch_wrong_on_its_third_token_commits_two():
    model = tiny_model(1)
    batch, free = forked_step(model, [PROMPTS[1]], 4, (1,), 5, wrong_at=2, decoy=True)
    (q,) = batch.running
    assert q.res.tokens == free[0].tokens[:1 + 1 + 2 + 1]
    assert q.acceptance.reached[widths.SECOND, :3].tolist() == [1, 1, 1]
    assert q.acceptance.accepted[widths.SECOND, :3].tolist() == [1, 1, 0]
    # the decoy was tested too, under its own kind: wrong on its first token
    assert q.acceptance.reached[widths.ALTERNATIVE, :2].tolist() == [1, 0]
    assert q.acceptance.accepted[widths.ALTERNATIVE].sum() == 0
    # (a model without a mask adapter keeps the rest of a rejected draft: the branch's, after the miss)
    assert q.draft == free[0].tokens[1 + 1 + 3: 1 + 1 + 5] and q.kind == widths.AFTER_MISS


def test_of_two_branches_right_from_the_same_fork_the_longer_wins():
    """Two branches from the same fork, both right on their first tokens, the second one longer: the
    step commits the longer run (and the causal token after it), whichever comes first."""
    model = tiny_model(2)
    for order in (0, 1):
        free = ar(model, [PROMPTS[1]], 40, [])
        batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
        batch.add(PROMPTS[1], SpeculativeParams(gen_length=40, draft_length=4, mask_length=2, widths="fixed",
                                                fork=True, lookup=False))
        batch.step()
        (q,) = batch.running
        truth = free[0].tokens[1:]
        q.draft = [truth[0], (truth[1] + 1) % MASK, 5, 6]
        short = list(truth[1:3]) + [(truth[3] + 1) % MASK]  # right for 2
        long = list(truth[1:5])  # right for 4
        q.branches = [(1, short, widths.SECOND), (1, long, widths.ALTERNATIVE)][::1 if order == 0 else -1]
        batch.step()
        assert q.res.tokens == free[0].tokens[:1 + 1 + 4 + 1]
        k, _ = batch.cache.row(0, q.c)
        want_k, _ = plain_kv(model, PROMPTS[1] + q.res.tokens[:-1])
        for a, b in zip(want_k, k, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


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
    q.branches = [(1, [(free[0].tokens[2] + 1) % MASK, 5, 6], widths.SECOND),
                  (0, [(free[0].tokens[1] + 1) % MASK, 7], widths.ALTERNATIVE)]
    batch.step()
    assert q.res.tokens == free[0].tokens[:6]
    assert q.acceptance.reached[widths.SECOND].sum() == q.acceptance.reached[widths.ALTERNATIVE].sum() == 0
    assert len(q.draft) == 2 and q.kind == widths.FRESH


def test_the_feed_puts_the_branches_after_the_masks_at_their_fork_positions():
    model = tiny_model(0)
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, draft_length=3, mask_length=2, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    q.draft = [5, 6, 7]
    q.branches = [(1, [8, 9, 10, 11], widths.SECOND), (3, [1, 2], widths.SECOND), (0, [12, 13], widths.ALTERNATIVE)]
    q.branch_widths = [3, 2, 1]
    ids, pos = q.next_feed()
    n = len(PROMPTS[0]) + len(q.res.tokens) - 1  # x's position
    # (a fork at the draft's end is no branch: the first goes on)
    assert ids == [q.x, 5, 6, 7, MASK, MASK, 8, 9, 10, 12]
    assert pos == list(range(n, n + 6)) + [n + 2, n + 3, n + 4] + [n + 1]
    assert q.fed_branches == [(6, 1, 3, 0), (9, 0, 1, 2)]
    q.branch_widths = [0, 0, 0]
    ids, _ = q.next_feed()
    assert q.fed_branches == [] and len(ids) == 6


def test_a_branch_sees_x_the_shared_tokens_and_its_own_tokens_only():
    """The attention mask: a branch's tokens see the cache, x and the draft up to its fork, then their
    own earlier tokens; the first draft, its masks and the other branches never see a branch."""
    model = tiny_model(0)
    batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
    batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, draft_length=3, mask_length=2, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    q.draft, q.branches, q.branch_widths = [5, 6, 7], [(1, [8, 9], widths.SECOND), (0, [3, 4], widths.SECOND)], [2, 2]
    ids, _ = q.next_feed()
    W, c = len(ids), q.c
    col = c + torch.arange(W)[None].numpy()
    used = c + W
    mask = batch._branch_mask([q], col, torch.tensor([W]).numpy(), torch.arange(used)[None, None, :],
                              torch.from_numpy(col))[0]
    sees = [[int(i) - c for i in torch.nonzero(row).flatten() if i >= c] for row in mask]
    assert all(bool(row[:c].all()) for row in mask)  # every fed token sees the kept columns
    assert sees == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                    [0, 1, 6], [0, 1, 6, 7], [0, 8], [0, 8, 9]]


def test_branches_are_where_the_others_part_one_per_place_and_token():
    S, A = widths.SECOND, widths.ALTERNATIVE
    # (a longer same draft is no branch; a second branch parting at the same place with the same token is dropped)
    assert branches([1, 2, 3], [([1, 2, 3, 4], S), ([1, 5, 6], S), ([7], A), ([1, 5, 9], A), ([1, 2, 8], A)]) == [
        (1, [5, 6], S), (0, [7], A), (2, [8], A)]
    assert branches([1, 2, 3], [([7, 8], S), ([6], A), ([5], A), ([4], A)], most=3) == [
        (0, [7, 8], S), (0, [6], A), (0, [5], A)]
    assert branches([1, 2], [([1, 2], S), ([1], S)]) == []
    assert branches([], [([1, 2], S)]) == []


@pytest.mark.parametrize("temperature,top_p", [(0.8, None), (1.0, 0.9)])
def test_sampled_output_is_the_same_with_and_without_fork(temperature, top_p, forks):
    """Sampled tokens are position-keyed draws: a branch changes how many a step commits, never which."""
    for seed in range(3):
        model = tiny_model(seed)
        kw = dict(gen_length=40, temperature=temperature, top_p=top_p, lookup=True)
        plain = generate_speculative(model, PROMPTS, SpeculativeParams(fork=False, **kw), eos_ids=[], seed=7,
                                     cost=CHEAP)
        forked = generate_speculative(model, PROMPTS, SpeculativeParams(fork=True, **kw), eos_ids=[], seed=7,
                                      cost=CHEAP)
        assert [r.tokens for r in forked] == [r.tokens for r in plain]
    assert forks["won"] > 0


def test_the_policy_feeds_a_branch_only_where_it_pays():
    def widths_fed(cost):
        batch = SpeculativeBatch(tiny_model(0), eos_ids=[], cost=cost)
        batch.add(PROMPTS[1], SpeculativeParams(gen_length=30, draft_length=4, mask_length=2, widths="fixed",
                                                fork=True))
        batch.step()
        (q,) = batch.running
        q.draft = [5, 6, 7, 8]
        q.branches = [(1, [9, 10, 11, 12, 13], widths.SECOND), (1, [2, 3], widths.ALTERNATIVE),
                      (4, [1], widths.SECOND)]
        batch.policy.choose_branches(batch.running)
        return q.branch_widths

    assert widths_fed(CHEAP) == [4, 2, 0]  # (no more than draft_length; none at the draft's end)
    assert widths_fed(DEAR) == [0, 0, 0]


def test_a_branch_from_a_fork_already_fed_is_worth_less():
    """A second branch from the same fork is tested only where the first was wrong on its first token:
    where branches of its kind are always right there, it is worth nothing and is not fed."""
    widths.PRIORS.pop(tiny_model(0), None)  # (the model is shared: no other test's drafts in its pooled counts)
    batch = SpeculativeBatch(tiny_model(0), eos_ids=[], cost=costs.CostModel.of(lambda rows, tokens: 1e-3 + 1e-5 * tokens))
    batch.add(PROMPTS[1], SpeculativeParams(gen_length=30, draft_length=4, mask_length=2, widths="fixed", fork=True))
    batch.step()
    (q,) = batch.running
    for _ in range(200):  # branches have always gone 4 tokens where tested
        q.acceptance.record(widths.SECOND, 4, 4)
    q.draft = [5, 6, 7, 8]
    q.branches = [(1, [9, 10, 11], widths.SECOND), (1, [2, 3, 4], widths.SECOND), (2, [1, 2], widths.SECOND)]
    batch.policy.choose_branches(batch.running)
    assert q.branch_widths[0] > 0 and q.branch_widths[1] == 0 and q.branch_widths[2] > 0


def test_fork_is_off_unless_asked_for(forks):
    model = tiny_model(0)
    for kw, on in ((dict(lookup=True), False), (dict(lookup=False), False), (dict(lookup=True, fork=True), True),
                   (dict(lookup=False, fork=True), True)):
        batch = SpeculativeBatch(model, eos_ids=[], cost=CHEAP)
        batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, **kw))
        batch.step()
        assert batch.running[0].fork is on, kw
    generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, lookup=True), eos_ids=[], cost=CHEAP)
    assert forks["fed"] == 0  # (the default feeds no branch)
    generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, lookup=True, fork=True), eos_ids=[],
                         cost=CHEAP)
    assert forks["fed"] > 0


def test_fork_is_refused_with_redraft_and_counts_in_the_widest_step_only_when_on():
    with pytest.raises(ValueError, match="fork and redraft"):
        SpeculativeParams(fork=True, redraft=True)
    assert SpeculativeParams(widths="fixed", draft_length=3, mask_length=2).max_width == 1 + 3 + 2
    assert SpeculativeParams(redraft=True).max_width == SpeculativeParams(redraft=True, fork=False).max_width
    assert SpeculativeParams(fork=True, widths="fixed", draft_length=3, mask_length=2).max_width == (
        1 + 3 + 2 + MAX_BRANCHES * 3)


def test_a_cpu_batch_feeds_no_branches_and_prices_width_in_full(forks):
    """On a CPU's (packed) cost table, rows stepping together feed no branches and price width in full;
    a row alone forks and takes its width_price (FeedPolicy.cpu_batch). The output is AR's either way."""
    packed = costs.CostModel.of(lambda rows, tokens: 1e-3 + 1e-7 * tokens)
    params = SpeculativeParams(gen_length=40, lookup=True, fork=True, width_price=0.25)
    for seed in range(4):
        model = tiny_model(seed)
        want = [r.tokens for r in ar(model, PROMPTS, 40, [])]
        batch = SpeculativeBatch(model, eos_ids=[], cost=packed)
        sids = [batch.add(p, params) for p in PROMPTS]
        got, together = {}, 0
        while len(batch):
            several, fed = len(batch.running) > 1, forks["fed"]
            if several:
                assert batch.policy.cost_table(batch.running) is packed
            got.update((sid, r.tokens) for sid, r in batch.step())
            if several:
                together += 1
                assert forks["fed"] == fed
            if len(batch.running) > 1:  # (and the rows still together are offered none)
                assert not any(q.branches for q in batch.running)
        assert [got[sid] for sid in sids] == want and together > 5
    alone = forks["fed"]
    for seed in range(4):
        for p in PROMPTS:
            batch = SpeculativeBatch(tiny_model(seed), eos_ids=[], cost=packed)
            batch.add(p, params)
            batch.step()
            assert batch.policy.cost_table(batch.running).share == 0.25
            while len(batch):
                batch.step()
    assert forks["fed"] - alone > 5


def test_settings_alike_as_a_cpu_batch_decode_it_alike_until_one_row_is_left(forks):
    """What the adapter's measurement relies on (measure.choose_at_batch): settings that differ only in
    forks and width prices (as_cpu_batch) step a CPU batch of several rows the same way, step by step."""
    packed = costs.CostModel.of(lambda rows, tokens: 1e-3 + 1e-7 * tokens)
    asked = dict(lookup=True, fork=True, width_price=0.25)
    assert as_cpu_batch(asked) == dict(lookup=True, fork=False, width_price=1.0)
    for seed in range(4):
        batches = []
        for options in (asked, as_cpu_batch(asked)):  # (a fresh model each: a model pools its acceptance)
            batch = SpeculativeBatch(tiny_model.__wrapped__(seed), eos_ids=[], cost=packed)
            for p in PROMPTS:
                batch.add(p, SpeculativeParams(gen_length=40, **options))
            batches.append(batch)
        for b in batches:
            b.step()  # (the prefill: the rows start running)
        steps = 0
        while all(len(b.running) > 1 for b in batches):  # a step that starts with several rows running
            for b in batches:
                b.step()
            asked_rows, alike_rows = ([(q.sid, len(q.res.tokens), q.res.forwards, q.width) for q in b.running]
                                      for b in batches)
            assert asked_rows == alike_rows
            steps += 1
        assert steps > 5 and forks["fed"] == 0
