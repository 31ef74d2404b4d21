"""Prompt-lookup drafts (decoding/lookup.py) and how the speculative decoder uses them: the index
finds the latest earlier occurrence of the longest suffix; a decode with `lookup` is still AR's
output (tests/decoding/test_decoding_speculative.py runs every width setting with it too), feeds copies
where the text repeats, counts their acceptance under their own kind, and feeds masks behind a copy
only where they pay for themselves."""

import numpy as np
import pytest

from refusion.decoding import ARParams, costs, widths
from refusion.decoding import speculative as spec
from refusion.decoding.lookup import (COPY_AGREED, COPY_AGREED_1, COPY_AGREED_2, COPY_ONCE, COPY_SPLIT,
                                      COPY_SUPPORTS, LOOKUP_NGRAMS, NgramIndex)
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer
from tests.helpers.reference_ar import generate_ar

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_force(tokens: list[int], k: int, ngrams=(4, 3, 2, 1)) -> tuple[list[int], int]:
    """The definition: for the longest n whose last-n suffix occurred earlier, what followed its
    latest earlier occurrence, continued periodically past the end of the text."""
    for n in ngrams:
        for start in range(len(tokens) - n - 1, -1, -1):
            if len(tokens) > n and tokens[start:start + n] == tokens[-n:]:
                period = len(tokens) - (start + n)
                return [tokens[start + n + i % period] for i in range(k)], n
    return [], 0


def test_the_index_by_hand():
    idx = NgramIndex([5, 6, 7, 8, 5, 6, 9])
    assert idx.propose(3) == ([], 0)  # 9 never occurred before
    idx.extend([5, 6])
    assert idx.propose(3) == ([9, 5, 6], 2)  # the latest "5 6" is followed by 9, not the first one's 7
    idx.extend([9])
    assert idx.propose(2) == ([5, 6], 3)  # "5 6 9" matched whole (3 tokens), cut to k
    assert idx.propose(4) == ([5, 6, 9, 5], 3)
    assert NgramIndex([1, 1, 1]).propose(3) == ([1, 1, 1], 2)  # the latest "1 1" ends just before the suffix
    assert NgramIndex([7, 1, 2, 3, 1, 2]).propose(5) == ([3, 1, 2, 3, 1], 2)  # and "1 2 3" repeats
    assert NgramIndex([3]).propose(4) == ([], 0)  # a suffix is never its own match
    assert NgramIndex([4, 2, 4], ngrams=(2,)).propose(4) == ([], 0)  # only the lengths asked for


def test_the_index_matches_the_definition_as_it_grows():
    rng = np.random.default_rng(0)
    for vocab in (2, 3, 8, 50):
        seq = rng.integers(0, vocab, 300).tolist()
        idx = NgramIndex(seq[:5])
        for i in range(5, len(seq)):
            for k in (1, 4, 9):
                assert idx.propose(k) == brute_force(seq[:i], k), (vocab, i, k)
            _, n = idx.propose(4)
            if n:  # how far the text backs the copy (brute_support, below)
                for look in (1, 2, 16):
                    assert idx.support(n, look) == brute_support(seq[:i], n, look), (vocab, i, n, look)
            idx.extend(seq[i:i + 1])


def brute_support(tokens: list[int], n: int, look: int = 16) -> int:
    """The definition: how many leading tokens (up to 4) the continuations of the latest `look` earlier
    occurrences of the last n tokens agree on, each continued periodically past the end of the text."""
    conts = []
    for s in range(len(tokens) - n - 1, -1, -1):
        if tokens[s:s + n] == tokens[-n:] and len(conts) < look:
            period = len(tokens) - (s + n)
            conts.append([tokens[s + n + i % period] for i in range(4)])
    if len(conts) == 1:
        return COPY_ONCE
    d = next((i for i in range(4) if len({c[i] for c in conts}) > 1), 4)
    return {0: COPY_SPLIT, 1: COPY_AGREED_1, 2: COPY_AGREED_2, 3: COPY_AGREED_2, 4: COPY_AGREED}[d]


def test_how_far_the_text_backs_a_copy_by_hand():
    assert NgramIndex([5, 1, 2, 3, 1, 2]).support(2) == COPY_ONCE  # "1 2" once before
    assert NgramIndex([1, 2, 3, 1, 2, 3, 1, 2]).support(2) == COPY_AGREED  # twice, on to "3 1 2 3" both times
    assert NgramIndex([1, 2, 3, 1, 2, 4, 1, 2]).support(2) == COPY_SPLIT  # on to 3, then to 4
    assert NgramIndex([1, 2, 3, 1, 2, 4, 1, 2]).support(1) == COPY_SPLIT  # the last token alone, "2", too
    assert NgramIndex([2, 9, 1, 2, 9, 2]).support(1) == COPY_AGREED_1  # "2" went on to "9 1", then to "9 2"
    assert NgramIndex([7, 5, 6, 8, 7, 5, 6, 9, 7]).support(1) == COPY_AGREED_2  # "5 6" both times, then 8 and 9
    assert NgramIndex([2, 9, 2, 9, 2, 3, 2]).support(1, look=1) == COPY_ONCE  # only the latest read
    assert NgramIndex([7, 5, 6, 8, 7, 5, 6, 9, 7]).agreement(1, 8) == (2, 2)  # two occurrences read, agreeing on 2
    assert NgramIndex([4, 1, 2, 4, 1]).agreement(1, 3) == (1, 3)  # one: it agrees with itself all along
    with pytest.raises(ValueError, match="no copy"):
        NgramIndex([1, 2, 3]).support(1)


def brute_force_alternatives(tokens: list[int], k: int, most: int, look: int = 16, ngrams=(4, 3, 2, 1)) -> list[list[int]]:
    """The definition: the continuations after each suffix's earlier occurrences (longest suffix
    first, each suffix's latest `look` occurrences, latest first), periodic past the end of the text,
    each kept where its first token is new; the first one kept is propose()'s copy, not an alternative."""
    kept, seen = [], set()
    for n in ngrams:
        if len(tokens) <= n:
            continue
        starts = [s for s in range(len(tokens) - n - 1, -1, -1) if tokens[s:s + n] == tokens[-n:]][:look]
        for s in starts:
            period = len(tokens) - (s + n)
            copy = [tokens[s + n + i % period] for i in range(k)]
            if copy[0] not in seen:
                seen.add(copy[0])
                kept.append(copy)
    return kept[1:most + 1]


def test_alternatives_by_hand():
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 8, 5, 2])
    # the suffix "2" occurred three times before: going on with "3 8" (latest: the copy), "4 9" and "3 9"
    assert idx.propose(2) == ([3, 8], 1)
    assert idx.alternatives(2, 3) == [[4, 9]]  # ("3 9" starts like the copy)
    idx.extend([6, 1, 2])
    assert idx.propose(1) == ([3], 2)  # "1 2" again: the latest went on with 3
    assert idx.alternatives(2, 3) == [[4, 9], [6, 1]]  # then the "1 2" before with 4; then the shorter "2" with 6
    assert idx.alternatives(2, 1) == [[4, 9]]
    assert idx.alternatives(2, 3, look=1) == [[6, 1]]  # (one occurrence read per suffix: "1 2"'s latest, then "2"'s)
    assert NgramIndex([5, 5]).alternatives(3, 2) == []  # one way on only


def test_alternatives_match_the_definition_as_the_text_grows():
    rng = np.random.default_rng(1)
    for vocab in (3, 8, 30):
        seq = rng.integers(0, vocab, 200).tolist()
        idx = NgramIndex(seq[:3])
        for i in range(3, len(seq)):
            for k, most, look in ((1, 2, 16), (4, 3, 16), (3, 5, 2)):
                assert idx.alternatives(k, most, look) == brute_force_alternatives(seq[:i], k, most, look), (vocab, i)
            idx.extend(seq[i:i + 1])


MASK = 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=1)
PROMPTS = [[2, 3, 4, 5, 6, 7, 2, 3], [8, 9, 10, 11, 8, 9], [12, 13]]


def looping_model() -> Transformer:
    """A random tiny model: its greedy continuations fall into short loops (which a copy drafts)
    while its untrained masks draft badly."""
    return Transformer(ModelConfig(**CFG)).init_weights(seed=3, std=0.5).eval()


def test_copies_are_fed_accepted_and_counted_under_their_own_kind(fed_kinds):
    model = looping_model()
    want = generate_ar(model, PROMPTS, ARParams(gen_length=48), eos_ids=[])
    fed = fed_kinds
    widths.PRIORS.pop(model, None)
    params = dict(gen_length=48, draft_length=8, widths="fixed")
    masks = generate_speculative(model, PROMPTS, SpeculativeParams(**params), eos_ids=[])
    assert all(k < widths.LOOKUP for k in fed)
    fed.clear()
    copies = generate_speculative(model, PROMPTS, SpeculativeParams(lookup=True, **params), eos_ids=[])
    assert [r.tokens for r in copies] == [r.tokens for r in masks] == [r.tokens for r in want]
    assert any(k >= widths.LOOKUP for k in fed)
    assert sum(r.forwards for r in copies) < 0.75 * sum(r.forwards for r in masks)  # loops are copied
    pool = widths.prior_for(model)
    assert pool.accepted[widths.LOOKUP:].sum() > pool.accepted[:widths.LOOKUP].sum()


def test_a_copy_is_counted_by_how_far_the_text_backs_it(monkeypatch):
    """Every copy a row takes is of the kind its match's length and support say, and copies the text
    backs differently (agreed, once, split) are all met and counted apart."""
    model = looping_model()
    widths.PRIORS.pop(model, None)
    plain, seen = FeedPolicy.offer_drafts, set()

    def offer_drafts(self, seqs):
        plain(self, seqs)
        for q in seqs:
            if not q.done and widths.LOOKUP <= q.kind < widths.PLAN:
                copy, n = q.index.propose(q.p.draft_length)
                assert q.kind == widths.lookup_kind(n, q.index.support(n)) and q.draft == copy
                seen.add(q.index.support(n))

    monkeypatch.setattr(FeedPolicy, "offer_drafts", offer_drafts)
    params = SpeculativeParams(lookup=True, gen_length=48, draft_length=8, widths="fixed")
    out = generate_speculative(model, PROMPTS + [[4, 5, 4, 6, 4, 7, 4]], params, eos_ids=[])
    assert [r.tokens for r in out] == [r.tokens for r in generate_ar(model, PROMPTS + [[4, 5, 4, 6, 4, 7, 4]],
                                                                     ARParams(gen_length=48), eos_ids=[])]
    assert seen == set(range(COPY_SUPPORTS))
    kinds = {widths.lookup_kind(n, s) for n in LOOKUP_NGRAMS for s in range(COPY_SUPPORTS)}
    assert len(kinds) == COPY_SUPPORTS * len(LOOKUP_NGRAMS) and kinds == set(range(widths.LOOKUP, widths.PLAN))


def held_copy(per_token: float, fresh: int, copies: int) -> spec.SpeculativeSeq:
    """A row after its prefill holding an 8-token copy, the pool's counts set: `fresh` and `copies`
    of every 1000 fresh mask drafts and copies accepted at each position; a forward costs 1 s plus
    per_token s a fed token. Its widths chosen once."""
    model = looping_model()
    widths.PRIORS.pop(model, None)
    batch = spec.SpeculativeBatch(model, eos_ids=[], cost=costs.CostModel.of(lambda rows, t: 1.0 + per_token * t))
    batch.add(PROMPTS[0], SpeculativeParams(lookup=True, gen_length=32))
    batch.step()  # the prefill
    q = batch.running[0]
    q.drafts_tried = widths.EXPLORE
    pool = batch.policy.prior
    pool.reached[:, :16] = 1000
    pool.accepted[:, :16] = 0
    pool.accepted[widths.FRESH, :16], pool.accepted[widths.LOOKUP:, :16] = fresh, copies
    pool.kept.clear()
    q.draft, q.kind = [5, 6, 7, 2, 5, 6, 7, 2], widths.lookup_kind(4)
    batch.policy.choose_widths(batch.running)
    return q


@pytest.mark.parametrize("per_token, fresh, bare", [(0.01, 990, False), (0.01, 0, True), (0.3, 990, True)])
def test_masks_go_behind_a_copy_only_where_they_pay(per_token, fresh, bare):
    """Masks behind a copy draft the step after it, and count only where the copy is accepted whole.
    Copies accepted 90% a position: with cheap masks whose fresh drafts are accepted 99% a position,
    masks go behind the copy; with masks whose drafts are never accepted, or that cost 30% of a
    forward a token (what they are worth, per second, is below the step's ratio), the copy goes
    bare, no wider than itself."""
    q = held_copy(per_token, fresh, 900)
    assert q.bare == bare and q.width > 0
    ids, _ = q.next_feed()
    assert ids.count(MASK) == (0 if bare else q.width + 1)
    if bare:
        assert ids == [q.x] + [5, 6, 7, 2, 5, 6, 7, 2][: q.width]


def test_masks_pay_by_the_rule_written_out():
    """FeedPolicy.masks_pay's numbers for one row by hand: a copy fed 2 wide (rates 0.5, 0.5; 0.75 expected,
    0.25 accepted whole), fresh drafts at 0.9 (1.71 expected at width 2), so the masks are worth
    0.25 * (1.71 - 0.75) = 0.24 tokens; the step: 1 + 0.75 tokens over a forward of 3 tokens. With
    seconds 1 + c * tokens, 3 masks pay where 0.24 > 1.75 / (1 + 3c) * 3c."""
    model = looping_model()
    widths.PRIORS.pop(model, None)

    def pays(c: float) -> bool:
        batch = spec.SpeculativeBatch(model, eos_ids=[], cost=costs.CostModel.of(lambda rows, t: 1.0 + c * t))
        batch.add(PROMPTS[0], SpeculativeParams(lookup=True, gen_length=32))
        batch.step()
        pool = batch.policy.prior
        pool.reached[:], pool.accepted[:] = 0, 0
        pool.reached[widths.FRESH, :2], pool.accepted[widths.FRESH, :2] = 1e9, 0.9e9  # own counts: none
        pool.kept.clear()
        rate = np.array([[0.5, 0.5]])
        return bool(batch.policy.masks_pay(batch.running, np.array([True]), np.array([2]), np.array([-1]), np.array([False]),
                                    rate, 2)[0])

    # 0.24 (1 + 3c) = 5.25c  ->  c = 0.24 / 4.53
    edge = 0.24 / (5.25 - 0.72)
    assert pays(0.98 * edge) and not pays(1.02 * edge)


@pytest.mark.parametrize("masks_worth_it", [True, False])
def test_a_copy_not_worth_feeding_is_dropped_for_the_masks_fresh_draft(masks_worth_it):
    """A row holding a copy worth no token (its kind never accepted) would feed x alone, no masks
    behind it, and hold the next copy offered: its masks would never draft again. It drops the copy
    where the masks' fresh draft is worth feeding, and keeps it (an AR step) where it is not."""
    model = looping_model()
    widths.PRIORS.pop(model, None)
    batch = spec.SpeculativeBatch(model, eos_ids=[], cost=costs.CostModel.of(lambda rows, tokens: 1.0 + 0.01 * tokens))
    batch.add(PROMPTS[0], SpeculativeParams(lookup=True, gen_length=32))
    batch.step()  # the prefill
    q = batch.running[0]
    q.drafts_tried = widths.EXPLORE  # (past the drafts every sequence feeds whatever they are worth)
    pool = batch.policy.prior
    pool.reached[:, :8], pool.accepted[:, :8] = 1000, 0  # no kind of draft is ever accepted...
    if masks_worth_it:
        pool.accepted[widths.FRESH, :8] = 950  # ...but the masks' fresh ones
    pool.kept.clear()
    copy = [5, 6, 7, 2]
    q.draft, q.kind = list(copy), widths.lookup_kind(1)
    batch.policy.choose_widths(batch.running)
    if masks_worth_it:
        assert (q.draft, q.kind, q.bare) == ([], widths.FRESH, False) and q.width > 0
        ids, _ = q.next_feed()
        assert ids == [q.x] + [MASK] * (q.width + 1)
    else:
        assert (q.draft, q.kind, q.width) == (copy, widths.lookup_kind(1), 0)
        assert q.next_feed()[0] == [q.x]


def test_a_kind_of_draft_not_fed_lately_is_fed_again(monkeypatch):
    """A kind's estimate comes only from drafts fed: a kind judged not worth its cost would never be
    corrected. Where every draft costs more than it can earn (a cost linear in the tokens fed), a
    copy held as the better draft is still fed while its kind has fewer than EXPLORE_POOL recent
    drafts counted, and only then: its count is back above it after a try or two."""
    model = looping_model()
    seen = []
    plain = spec.SpeculativeSeq.next_feed

    def next_feed(self):
        ids, pos = plain(self)
        if self.x is not None:
            seen.append((self.kind, self.fed_k))
        return ids, pos

    monkeypatch.setattr(spec.SpeculativeSeq, "next_feed", next_feed)
    linear = costs.CostModel.of(lambda rows, tokens: float(tokens))  # a token never pays for itself

    def run(lookup_count: float) -> list[tuple[int, int]]:
        widths.PRIORS.pop(model, None)
        pool = widths.prior_for(model)
        pool.reached[:, :8], pool.accepted[:, :8] = 1000, 0  # the masks' drafts known to be rejected
        pool.accepted[widths.LOOKUP:, 1:8] = 500  # copies better (held in their place), not worth a forward...
        pool.reached[widths.LOOKUP:, 0] = lookup_count  # ...from this many recent drafts
        seen.clear()
        out = generate_speculative(model, PROMPTS[:1], SpeculativeParams(lookup=True, gen_length=40), eos_ids=[],
                                   cost=linear)
        assert out[0].tokens == generate_ar(model, PROMPTS[:1], ARParams(gen_length=40), eos_ids=[])[0].tokens
        return seen[widths.EXPLORE:]  # (a sequence's first drafts are fed whatever they are worth)

    assert all(k == 0 for _, k in run(lookup_count=1000.0))  # known: no draft is worth its cost
    tried = [(kind, k) for kind, k in run(lookup_count=0.0) if k > 0]
    assert tried and all(kind >= widths.LOOKUP for kind, _ in tried)  # copies fed again, with a token at least
    # and only now and then: once counted, a kind waits until its count decays below EXPLORE_POOL
    assert len(tried) <= 2 * len(LOOKUP_NGRAMS)


def test_lookup_is_on_by_default_for_a_mask_adapted_model_only(monkeypatch):
    """Unset, `lookup` is the model's choice (lookup.lookup_by_default): on for a model with a mask
    adapter, off otherwise; set, it is what it says."""
    from refusion.model.mask_adapter import add_mask_adapter

    adapted = looping_model()
    add_mask_adapter(adapted, {"rank": 2})
    indexed = []
    plain = spec.SpeculativeSeq.__init__

    def init(self, *a, **k):
        plain(self, *a, **k)
        indexed.append(self.index is not None)

    monkeypatch.setattr(spec.SpeculativeSeq, "__init__", init)
    for model, lookup, want in ((looping_model(), None, False), (adapted, None, True), (adapted, False, False),
                                (looping_model(), True, True)):
        indexed.clear()
        out = generate_speculative(model, PROMPTS[:1], SpeculativeParams(gen_length=8, lookup=lookup), eos_ids=[])
        assert indexed == [want], (lookup, want)
        assert out[0].tokens == generate_ar(model, PROMPTS[:1], ARParams(gen_length=8), eos_ids=[])[0].tokens
    with pytest.raises(ValueError, match="lookup must be"):
        SpeculativeParams(lookup="yes")
    with pytest.raises(ValueError, match="fresh_after_miss must be"):
        SpeculativeParams(fresh_after_miss=1)
