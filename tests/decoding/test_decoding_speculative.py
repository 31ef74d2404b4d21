"""Self-speculative decoding (spec section 7) against plain AR decoding of the same model.

Greedy: the output must be AR's, token for token, whatever the widths (every width policy), the
batch, the prompt lengths and where EOS falls. On random tiny models the masks' drafts are mostly
wrong, so an "oracle" (AR's own continuation, corrupted at a random place) is also put in as the
draft: that reaches long accepted drafts, partial accepts, and EOS inside an accepted draft. Sampling: the distribution of
whole outputs equals the exact AR sampling law, enumerated on a 6-token vocabulary, with argmax and
with sampled drafts. The cost policy runs on the fixed cost table of conftest.py, so that no test
depends on timings; tests/decoding/test_widths.py covers the measured one.
"""

import collections
import functools
import itertools
import random

import pytest
import torch

from refusion.model.config import ModelConfig
from refusion.decoding import ARParams, decode
from refusion.decoding import speculative as spec, widths
from refusion.decoding.sampling import draw, position_uniforms
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from refusion.model.transformer import Transformer
from tests.helpers.reference_ar import generate_ar
from tests.helpers.reference_cache import ReferenceKVCache

MASK = 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=1)
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 2, 3]]
WIDTHS = [dict(), dict(widths="fixed"), dict(draft_length=3, mask_length=2, widths="fixed"),
          dict(draft_length=0), dict(draft_length=5, mask_length=0, widths="fixed"), dict(draft_length=2),
          dict(widths="adaptive"), dict(widths="adaptive", draft_length=2), dict(widths="cost", mask_length=3),
          dict(widths="cost", draft_length=64), dict(lookup=True), dict(lookup=True, widths="adaptive"),
          dict(lookup=True, draft_length=4, widths="fixed"), dict(fresh_after_miss=True),
          dict(fresh_after_miss=True, draft_length=4, widths="fixed"), dict(fresh_after_miss=True, lookup=True)]

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int, **over) -> Transformer:
    return Transformer(ModelConfig(**{**CFG, **over})).init_weights(seed=seed, std=0.5).eval()


def ar(model, prompts, n, eos):
    return generate_ar(model, prompts, ARParams(gen_length=n), eos_ids=eos)


class Oracle:
    def __init__(self):
        self.truth: dict[tuple, list[int]] = {}  # prompt -> AR's continuation
        self.p_corrupt, self.min_len, self.rng = 0.5, 0, random.Random(0)


@pytest.fixture
def oracle(monkeypatch):
    """After every step, replace a sequence's draft by AR's continuation, cut to a random length and
    (with probability p_corrupt) corrupted at a random place."""
    o = Oracle()
    plain = spec.SpeculativeSeq.advance

    def advance(self, j, extra, mask_preds, **kw):
        plain(self, j, extra, mask_preds, **kw)
        g = len(self.res.tokens)
        draft = list(o.truth[tuple(self.prompt)][g: g + o.rng.randrange(o.min_len, 20)])
        if draft and o.rng.random() < o.p_corrupt:
            i = o.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1) % MASK
        self.draft = draft

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", advance)
    return o


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("widths", WIDTHS, ids=[str(w) for w in WIDTHS])
def test_greedy_equals_ar_batched_and_alone(seed, widths):
    model = tiny_model(seed)
    ref = ar(model, PROMPTS, 24, [1])
    params = SpeculativeParams(gen_length=24, **widths)
    together = generate_speculative(model, PROMPTS, params, eos_ids=[1])
    for p, r, a in zip(PROMPTS, together, ref, strict=True):
        assert r.tokens == a.tokens and r.positions == a.positions and r.finished == a.finished
        (alone,) = generate_speculative(model, [p], params, eos_ids=[1])
        assert (alone.tokens, alone.positions) == (r.tokens, r.positions)
        # per-sequence widths: the same steps alone as in the batch (a copy is chosen over the masks'
        # draft by the model's pooled acceptance, which the batch's other rows move)
        if params.widths != "cost" and not params.lookup:
            assert (alone.steps, alone.forwards, alone.tokens_fed) == (r.steps, r.forwards, r.tokens_fed)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_ar_with_long_accepted_drafts(seed, oracle):
    model = tiny_model(seed)
    free = ar(model, PROMPTS, 40, [])
    for p, f in zip(PROMPTS, free, strict=True):
        oracle.truth[tuple(p)] = f.tokens
    res = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, draft_length=24), eos_ids=[])
    assert [r.tokens for r in res] == [f.tokens for f in free]
    assert sum(len(r.tokens) for r in res) / sum(r.forwards for r in res) > 3  # the drafts were accepted
    # EOS anywhere, inside an accepted draft included: declare the i-th free token to be EOS
    for i in (0, 1, 5, 17, 39):
        eos = [free[0].tokens[i]]
        want = ar(model, PROMPTS, 40, eos)
        got = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, draft_length=24), eos_ids=eos)
        for g, w in zip(got, want, strict=True):
            assert g.tokens == w.tokens and g.finished == w.finished
            assert g.tokens.count(eos[0]) <= 1 and (not g.finished or g.tokens[-1] == eos[0])


def test_cache_after_every_step_equals_a_fresh_causal_pass(oracle):
    model = tiny_model(1)
    for p, f in zip(PROMPTS, ar(model, PROMPTS, 30, []), strict=True):
        oracle.truth[tuple(p)] = f.tokens
    batch = SpeculativeBatch(model, eos_ids=[])
    for p in PROMPTS:
        batch.add(p, SpeculativeParams(gen_length=30, draft_length=12))
    checked = 0
    with torch.inference_mode():
        while len(batch):
            batch.step()
            for r, q in enumerate(batch.running):
                seq = q.prompt + q.res.tokens[:-1]  # every committed token but the newest has its KV kept
                assert q.c == len(seq)
                fresh = ReferenceKVCache(model.config.num_layers)
                model(torch.tensor([seq]), torch.arange(len(seq))[None], cache=fresh)
                ks, vs = batch.cache.row(r, q.c)
                for i in range(model.config.num_layers):
                    k, v = fresh.layer(i)
                    torch.testing.assert_close(ks[i], k[0], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(vs[i], v[0], atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked > 10


@pytest.mark.parametrize("fresh", [False, True])
def test_after_a_rejection_the_next_draft_is_the_rest_or_nothing(fresh):
    """Off (spec section 7, step 3): the rest of the rejected draft, then the masks' tokens, counted as
    drafts after a miss. fresh_after_miss: nothing, so the next step's masks draft from the committed
    tokens alone. A draft accepted whole is followed by the masks' tokens either way."""
    p = SpeculativeParams(gen_length=20, draft_length=4, widths="fixed")
    q = spec.SpeculativeSeq(0, [2, 3], p, MASK, set(), 0, None, causal_first=True, fresh_after_miss=fresh)
    q.x, q.c, q.res.tokens = 9, 2, [9]  # after the prefill: x = 9 is committed, its KV not cached yet
    q.draft, q.fed_k = [5, 6, 7, 8], 4  # this step fed x, 5, 6, 7, 8 and five masks
    q.advance(1, 11, [12, 13, 14, 15, 16])  # 5 accepted, 6 rejected: 11 committed in its place
    assert q.res.tokens == [9, 5, 11] and q.c == 4
    assert (q.draft, q.kind) == (([], widths.FRESH) if fresh else ([7, 8, 12, 13, 14, 15, 16], widths.AFTER_MISS))
    q.draft, q.fed_k = [20, 21], 2
    q.advance(2, 22, [22, 23, 24])  # accepted whole: the first mask drafted 22's own position
    assert q.res.tokens == [9, 5, 11, 20, 21, 22] and (q.draft, q.kind) == ([23, 24], widths.FRESH)


def test_counters_by_hand(oracle):
    """Fixed widths, perfect drafts: the prefill feeds P + 2 (2 masks) and commits 1 token; each
    later step feeds x + 3 drafts + 2 masks and commits 4, the last one x + 3 drafts + 1 mask (only
    one position is left for a mask to draft)."""
    model = tiny_model(2)
    p = PROMPTS[1]
    free = ar(model, [p], 21, [])[0]
    oracle.truth[tuple(p)], oracle.p_corrupt, oracle.min_len = free.tokens, 0.0, 19
    (r,) = generate_speculative(model, [p], SpeculativeParams(gen_length=21, draft_length=3, mask_length=2,
                                                              widths="fixed"), eos_ids=[])
    assert r.tokens == free.tokens
    assert r.forwards == 6 and r.steps == [0] + [s for s in range(1, 6) for _ in range(4)]
    assert r.tokens_fed == (len(p) + 2) + 4 * (1 + 3 + 2) + (1 + 3 + 1)


def test_ar_mode_counts_like_ar():
    model = tiny_model(3)
    for r, a in zip(generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=16, draft_length=0), eos_ids=[1]),
                    ar(model, PROMPTS, 16, [1]), strict=True):
        assert (r.tokens, r.steps, r.forwards, r.tokens_fed) == (a.tokens, a.steps, a.forwards, a.tokens_fed)


def test_streaming_rebuilds_the_result_and_never_passes_eos():
    model = tiny_model(4)
    free = ar(model, PROMPTS, 20, [])
    eos = [free[1].tokens[6]]
    events = [[] for _ in PROMPTS]
    res = decode(model, PROMPTS, "speculative", eos_ids=eos, gen_length=20,
                 on_commit=lambda row, pos, tok: events[row].append((pos, tok)))
    for r, ev in zip(res, events, strict=True):
        assert [q for pos, _ in ev for q in pos] == r.positions
        assert [t for _, tok in ev for t in tok] == r.tokens


@pytest.mark.parametrize("policy", ["cost", "adaptive"])
def test_continuous_batching_join_leave_and_cancel(policy):
    """Sequences that join late, leave early or are cancelled do not change anyone's output (nor,
    with per-sequence widths, its steps: the cost policy sizes every step for the batch it has)."""
    model = tiny_model(5)
    p = SpeculativeParams(gen_length=20, draft_length=4, widths=policy)
    solo = {i: generate_speculative(model, [q], p, eos_ids=[1])[0] for i, q in enumerate(PROMPTS)}
    batch = SpeculativeBatch(model, eos_ids=[1])
    sids = {batch.add(PROMPTS[0], p): 0, batch.add(PROMPTS[1], p): 1}
    done, step = {}, 0
    while len(batch):
        for sid, r in batch.step():
            done[sids[sid]] = r
        step += 1
        if step == 2:
            sids[batch.add(PROMPTS[2], p)] = 2
            victim = batch.add(PROMPTS[3], p)
        if step == 4:
            part = batch.cancel(victim)
            assert part is not None and part.tokens == solo[3].tokens[: len(part.tokens)]
    assert batch.cancel(12345) is None
    for i in (0, 1, 2):
        assert done[i].tokens == solo[i].tokens
        assert done[i].steps == solo[i].steps or policy == "cost"
    assert len(batch.running) == 0 and not batch.pending


def test_accept_prob_is_lossy_when_asked(oracle):
    """With accept_prob tiny every draft token is accepted, wrong ones included (the opt-in knob)."""
    model = tiny_model(0)
    free = ar(model, PROMPTS, 30, [])
    for p, f in zip(PROMPTS, free, strict=True):
        oracle.truth[tuple(p)] = f.tokens
    # (adaptive widths: the same width rule for both, whatever the acceptance pooled so far)
    exact = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=30, widths="adaptive"), eos_ids=[])
    lossy = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=30, widths="adaptive", accept_prob=1e-9),
                                 eos_ids=[])
    assert [r.tokens for r in exact] == [f.tokens for f in free]
    assert [r.tokens for r in lossy] != [f.tokens for f in free]
    assert sum(r.forwards for r in lossy) < sum(r.forwards for r in exact)


def test_needs_a_mask_token_and_valid_params():
    model = Transformer(ModelConfig(**{**CFG, "mask_token_id": None})).init_weights(seed=0)
    with pytest.raises(ValueError, match="mask token"):
        generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=4))
    model = tiny_model(0)
    for bad, msg in [(dict(gen_length=0), "gen_length"), (dict(draft_length=-1), "draft_length"),
                     (dict(temperature=float("nan")), "temperature"), (dict(temperature=1, top_p=0), "top_p"),
                     (dict(temperature=1, top_k=0), "top_k"), (dict(accept_prob=1.5), "accept_prob"),
                     (dict(top_k=3), "temperature > 0")]:
        with pytest.raises(ValueError, match=msg):
            decode(model, PROMPTS, "speculative", **bad)
    with pytest.raises(ValueError, match="does not take"):
        decode(model, PROMPTS, "speculative", slot_size=8)
    with pytest.raises(ValueError, match="token id 99"):
        generate_speculative(model, [[2, 99]], SpeculativeParams(gen_length=4))


# ---- sampling: the exact AR law on a 6-token vocabulary -------------------------------------------

V6 = dict(vocab_size=6, mask_token_id=5, eos_token_id=None)


def exact_law(model, prompt, n, temperature, top_k, top_p) -> dict[tuple, float]:
    """P(t1..tn) of AR sampling, enumerated: t1 from the mask at the first response position,
    then causal next-token predictions; filtered as top-k then top-p (the smallest set whose mass
    reaches top_p), written out independently of the library."""

    def dist(ids):
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1].double() / temperature
        keep = torch.ones_like(logits, dtype=torch.bool)
        order = logits.argsort(descending=True)
        if top_k:
            keep[order[top_k:]] = False
        probs = torch.where(keep, logits, torch.tensor(-float("inf"), dtype=torch.double)).softmax(-1)
        if top_p:
            mass, kept = 0.0, torch.zeros_like(keep)
            for i in probs.argsort(descending=True).tolist():
                if mass >= top_p:
                    break
                kept[i], mass = True, mass + probs[i].item()
            probs = torch.where(kept, probs, 0.0)
            probs = probs / probs.sum()
        return probs.tolist()

    law = {}
    for seq in itertools.product(range(6), repeat=n):
        p = dist(prompt + [5])[seq[0]]
        for i in range(1, n):
            if p == 0:
                break
            p *= dist(prompt + list(seq[:i]))[seq[i]]
        if p > 0:
            law[seq] = p
    return law


def chi2(counts: dict, law: dict, total: int) -> tuple[float, int]:
    """Pearson's statistic over cells with >= 5 expected (the rest pooled) and its degrees of freedom."""
    big = [s for s, p in law.items() if p * total >= 5]
    stat = sum((counts.get(s, 0) - law[s] * total) ** 2 / (law[s] * total) for s in big)
    rest_exp = total - sum(law[s] * total for s in big)
    rest_obs = total - sum(counts.get(s, 0) for s in big)
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        return stat, len(big)
    return stat, len(big) - 1


def spec_samples(model, prompt, n, total, **kw) -> list[tuple]:
    """The outputs of seeds 0..total-1, in one continuous batch."""
    batch = SpeculativeBatch(model, eos_ids=[])
    p = SpeculativeParams(gen_length=n, draft_length=4, widths="fixed", **kw)
    sids = [batch.add(prompt, p, seed=s) for s in range(total)]
    out: dict[int, tuple] = {}
    while len(batch):
        out.update((sid, tuple(r.tokens)) for sid, r in batch.step())
    return [out[sid] for sid in sids]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9),
                                dict(temperature=1.0, sampled_drafts=True),
                                dict(temperature=0.7, top_k=4, top_p=0.9, sampled_drafts=True),
                                dict(temperature=1.0, lookup=True)],
                         ids=["t1", "t0.7-k4-p0.9", "t1-sampled-drafts", "t0.7-k4-p0.9-sampled-drafts", "t1-lookup"])
def test_sampled_outputs_follow_the_ar_law(kw):
    model = Transformer(ModelConfig(**{**CFG, **V6})).init_weights(seed=7, std=0.25).eval()
    prompt, n, total = [1, 2, 3], 3, 12000
    law = exact_law(model, prompt, n, kw["temperature"], kw.get("top_k"), kw.get("top_p"))
    outs = spec_samples(model, prompt, n, total, **kw)
    stat, df = chi2(collections.Counter(outs), law, total)
    threshold = df + 5 * (2 * df) ** 0.5  # about p = 1e-5 for these df; the seeds are fixed
    assert stat < threshold, (stat, df)
    # the same statistic has the power to see a wrong sampler: accepting every draft is one
    bad, _ = chi2(collections.Counter(spec_samples(model, prompt, n, total, accept_prob=1e-9, **kw)), law, total)
    assert bad > 3 * threshold, (bad, threshold)
    # AR sampling draws with the same position-keyed uniforms: the same seed, the same tokens
    ar_p = ARParams(gen_length=n, temperature=kw["temperature"], top_k=kw.get("top_k"), top_p=kw.get("top_p"))
    for s in range(0, total, 97):
        assert tuple(generate_ar(model, [prompt], ar_p, eos_ids=[], seed=s)[0].tokens) == outs[s]
    # and unseeded, every row of a batch of identical prompts draws with a seed of its own
    torch.manual_seed(0)
    counts = collections.Counter(tuple(r.tokens) for r in generate_ar(model, [prompt] * total, ar_p, eos_ids=[]))
    assert chi2(counts, law, total)[0] < threshold


SAMPLED = [dict(temperature=0.9), dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=1.4, top_p=0.6),
           dict(temperature=0.9, sampled_drafts=True), dict(temperature=0.7, top_k=5, top_p=0.9, sampled_drafts=True)]
AR_KEYS = ("temperature", "top_k", "top_p")


def sampled_ar(model, prompt, kw, seed, n, eos):
    kw = {k: v for k, v in kw.items() if k in AR_KEYS}
    return generate_ar(model, [prompt], ARParams(gen_length=n, **kw), eos_ids=eos, seed=seed)[0].tokens


@pytest.mark.parametrize("model_seed", range(3))
def test_seeded_samples_are_ar_samples_whatever_the_widths_and_the_batch(model_seed):
    """A seeded sampled sequence's tokens are a function of its seed and prompt alone: AR sampling's
    with the same seed, alone or batched, for every width setting."""
    model = tiny_model(model_seed)
    for i, kw in enumerate(SAMPLED):
        seed = 10 * model_seed + i
        want = [sampled_ar(model, p, kw, seed, 24, [1]) for p in PROMPTS]
        for setting in WIDTHS:
            params = SpeculativeParams(gen_length=24, **setting, **kw)
            together = generate_speculative(model, PROMPTS, params, eos_ids=[1], seed=seed)
            assert [r.tokens for r in together] == want, setting
            for p, w in zip(PROMPTS, want, strict=True):
                assert generate_speculative(model, [p], params, eos_ids=[1], seed=seed)[0].tokens == w, setting


def test_seeded_samples_do_not_depend_on_who_joins_when():
    """A continuous batch of sequences with different prompts, parameters, widths and seeds, joining
    at different steps, some cancelled: every finished one has the tokens it has alone."""
    model = tiny_model(4)
    rng = random.Random(0)
    jobs = []  # (prompt, params, seed, step it joins)
    for n in range(24):
        kw = rng.choice(SAMPLED + [dict()])
        widths = rng.choice(WIDTHS)
        jobs.append((rng.choice(PROMPTS), SpeculativeParams(gen_length=rng.randrange(5, 30), **widths, **kw),
                     rng.randrange(1000), rng.randrange(12)))
    batch = SpeculativeBatch(model, eos_ids=[1])
    sids, done, victims, step = {}, {}, set(), 0
    while step < 12 or len(batch):
        for i, (p, params, seed, at) in enumerate(jobs):
            if at == step:
                sids[batch.add(p, params, seed=seed)] = i
                if i % 7 == 3:
                    victims.add(i)
        for sid, r in batch.step():
            done[sids[sid]] = r
        for sid, i in sids.items():
            if i in victims and step == jobs[i][3] + 2 and i not in done:
                batch.cancel(sid)
        step += 1
    assert len(done) >= 20
    for i, r in done.items():
        p, params, seed, _ = jobs[i]
        assert r.tokens == generate_speculative(model, [p], params, eos_ids=[1], seed=seed)[0].tokens, i
        if params.temperature:
            ar_kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            assert r.tokens == sampled_ar(model, p, ar_kw, seed, params.gen_length, [1]), i


@pytest.mark.parametrize("model_seed", range(3))
def test_seeded_samples_with_long_accepted_drafts(model_seed, oracle):
    """Drafts that are the sampled continuation itself (corrupted at random places) are accepted at
    length, and the output is still AR sampling's with the same seed."""
    model = tiny_model(model_seed)
    kw = SAMPLED[1]
    for seed in range(3):
        free = [sampled_ar(model, p, kw, seed, 40, []) for p in PROMPTS]
        oracle.truth = {tuple(p): f for p, f in zip(PROMPTS, free, strict=True)}
        res = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, draft_length=24, **kw),
                                   eos_ids=[], seed=seed)
        assert [r.tokens for r in res] == free
        assert sum(len(r.tokens) for r in res) / sum(r.forwards for r in res) > 3


def test_sampling_is_reproducible_and_batch_independent():
    model = tiny_model(6)
    kw = dict(eos_ids=[1], gen_length=16, temperature=0.9, top_p=0.95)
    a = decode(model, PROMPTS, "speculative", seed=3, **kw)
    b = [decode(model, [p], "speculative", seed=3, **kw)[0] for p in PROMPTS]
    assert [r.tokens for r in a] == [r.tokens for r in b]
    c = decode(model, PROMPTS, "speculative", seed=4, **kw)
    assert [r.tokens for r in a] != [r.tokens for r in c]


@pytest.mark.parametrize("causal_first", [False, True])
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_the_masks_draft_their_argmax_or_the_draw_with_their_own_positions_uniform(monkeypatch, sampled_drafts,
                                                                                   causal_first):
    """The prefill feeds the prompt and 4 masks at response positions 0..3; their drafts are their
    argmax, or (sampled_drafts) draw(q_t, u(seed, t)), with the uniform the output at t is drawn
    with. (The first response token comes from the first mask, or with causal_first_token from the
    prompt's last token, the first mask's draft then being a guess at the same position.)
    Recomputed here with a plain causal forward."""
    model = tiny_model(2, causal_first_token=causal_first)
    prompt, seed, temperature = PROMPTS[1], 7, 1.0
    seen = []
    plain = spec.SpeculativeSeq.advance

    def advance(self, j, extra, mask_preds, **kw):
        seen.append(list(mask_preds))
        plain(self, j, extra, mask_preds, **kw)

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", advance)
    params = SpeculativeParams(gen_length=8, widths="fixed", draft_length=3, temperature=temperature,
                               sampled_drafts=sampled_drafts)
    generate_speculative(model, [prompt], params, eos_ids=[], seed=seed)
    ids = prompt + [MASK] * 4
    first = 0 if causal_first else 1  # the masks whose predictions are drafts
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, len(prompt) + first:]
    if sampled_drafts:
        u = position_uniforms(torch.tensor([seed]), torch.arange(first, 4)[None])[0]
        want = draw((logits / temperature).softmax(-1), u)
    else:
        want = logits.argmax(-1)
    assert seen[0] == want.tolist()
