"""Controls (decoding/controls.py, controlled.py): a grammar, logit bias, penalties and logprobs,
exact under speculative decoding.

Greedy `ar` and `speculative` must give the tokens of the simple reference (tests/helpers/
reference_controls.py: a full forward per token, the controls applied densely), whatever the
widths and drafts: on tiny random models (with a letter tokenizer the grammar library reads) with
the drafts forced to long runs of the reference's own continuation, corrupted at random places
(tokens the grammar refuses included); sampled, the distribution of whole outputs is the exact
controlled AR law. Logprobs equal the reference's, and a direct forward's on a hand case.
"""

import collections
import functools
import itertools
import random

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HF

from refusion.decoding import Controls, decode, grammar
from refusion.decoding import speculative as spec
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams
from refusion.model.config import ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from tests.decoding.test_decoding_speculative import chi2
from tests.helpers.fork_counter import count_forks
from tests.helpers.reference_controls import next_distribution, reference

pytestmark = pytest.mark.usefixtures("one_thread")

LETTERS = "abcdefghijklmnopqrstuv"  # ids 0..21; then <eos> 22, <mask> 23
EOS, MASK = 22, 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=EOS)
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 2, 3]]


@functools.lru_cache(maxsize=None)
def letters(chars: str = LETTERS) -> Tokenizer:
    """One token per letter, then <eos> and <mask> (special): a vocabulary a tiny model can have."""
    tok = HF(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<mask>", special=True)])
    return Tokenizer(tok, {"eos_token": "<eos>", "mask_token": "<mask>"})


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int, **over) -> Transformer:
    return Transformer(ModelConfig(**{**CFG, **over})).init_weights(seed=seed, std=0.5).eval()


def controls_cases() -> dict[str, Controls]:
    tok = letters()
    return {
        "regex": Controls(grammar=grammar.regex(tok, "[a-f]+(g[h-k]+)*v"), logprobs=3),
        "forced": Controls(grammar=grammar.regex(tok, "(abcdefgh|ijklmnop)(qrs|t)+u"), logprobs=0),
        "choice": Controls(grammar=grammar.choice(tok, ["abc", "abd", "mnopqrstuv"])),
        "bias": Controls(logit_bias={3: 4.0, 7: -100, 9: 2.5}, logprobs=2),
        "penalties": Controls(presence_penalty=1.5, frequency_penalty=0.7, logprobs=1),
        "all": Controls(grammar=grammar.regex(tok, "[a-m]+n[o-v]*"), logit_bias={4: 3.0, 12: -2.0},
                        presence_penalty=-0.5, frequency_penalty=1.2, logprobs=4),
    }


CASES = list(controls_cases())
WIDTHS = [dict(), dict(widths="fixed", draft_length=6), dict(draft_length=3, mask_length=2, widths="fixed"),
          dict(widths="adaptive"), dict(lookup=True), dict(fresh_after_miss=True), dict(redraft=True),
          dict(fork=True, lookup=True)]


def check_logprobs(res, want_lps, want_tops):
    assert res.logprobs is not None and len(res.logprobs.chosen) == len(res.tokens)
    np.testing.assert_allclose(res.logprobs.chosen, want_lps, rtol=1e-4, atol=1e-4)
    for got, want in zip(res.logprobs.top, want_tops, strict=True):
        assert len(got) == len(want)
        # (ids of tied values may come in either order)
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_ar_and_speculative_equal_the_reference(case, seed):
    model = tiny_model(seed)
    c = controls_cases()[case]
    refs = [reference(model, p, c, 24, [EOS]) for p in PROMPTS]
    for dec, kws in (("ar", [{}]), ("speculative", WIDTHS)):
        for kw in kws:
            got = decode(model, PROMPTS, dec, eos_ids=[EOS], gen_length=24, controls=c, **kw)
            for r, (toks, lps, tops) in zip(got, refs, strict=True):
                assert r.tokens == toks, (dec, kw)
                assert r.finished == (toks[-1] == EOS)
                if c.logprobs is not None:
                    check_logprobs(r, lps, tops)
                else:
                    assert r.logprobs is None
            if c.grammar is not None:  # every finished output matches the grammar whole
                for r in got:
                    if r.finished:
                        m = c.grammar.matcher()
                        assert m.accept_many(r.tokens[:-1]) == len(r.tokens) - 1 and m.is_complete()


@pytest.fixture
def oracle(monkeypatch):
    """After every step, a controlled row's draft becomes the reference's continuation, cut to a
    random length and (half the time) corrupted at a random place: long accepted drafts, partial
    accepts, tokens the grammar refuses."""
    truth: dict[tuple, list[int]] = {}
    rng = random.Random(0)
    plain = spec.SpeculativeSeq.advance

    def advance(self, j, extra, mask_preds, **kw):
        plain(self, j, extra, mask_preds, **kw)
        g = len(self.res.tokens)
        draft = list(truth[tuple(self.prompt)][g: g + rng.randrange(0, 20)])
        if draft and rng.random() < 0.5:
            i = rng.randrange(len(draft))
            draft[i] = (draft[i] + rng.randrange(1, 22)) % 22
        self.draft = draft

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", advance)
    return truth


@pytest.mark.parametrize("case", CASES)
def test_greedy_speculative_equals_the_reference_with_long_forced_drafts(case, oracle):
    model = tiny_model(4)
    c = controls_cases()[case]
    refs = {tuple(p): reference(model, p, c, 40, [EOS]) for p in PROMPTS}
    oracle.update({p: r[0] for p, r in refs.items()})
    got = decode(model, PROMPTS, "speculative", eos_ids=[EOS], gen_length=40, draft_length=24, controls=c)
    for p, r in zip(PROMPTS, got, strict=True):
        toks, lps, tops = refs[tuple(p)]
        assert r.tokens == toks
        if c.logprobs is not None:
            check_logprobs(r, lps, tops)
    assert sum(len(r.tokens) for r in got) / sum(r.forwards for r in got) > 2  # the drafts were accepted


def test_controlled_rows_fork_exactly(monkeypatch):
    """Branches of a controlled row (no logprobs asked) get the controls of their own prefix: the
    output is still the reference's, with branches fed, several at once, and going further."""
    from refusion.decoding import costs

    seen = count_forks(monkeypatch)
    # wide forwards cost next to nothing, as on an accelerator (a CPU batch feeds no branches)
    cheap = costs.CostModel.of(lambda rows, tokens: 1e-3 + 1e-7 * tokens, packed=False)
    c = Controls(grammar=grammar.regex(letters(), "([a-m]+n)*[o-v]+"), logit_bias={4: 3.0, 12: -2.0},
                 presence_penalty=-0.5, frequency_penalty=0.4)
    for seed in range(4):
        model = tiny_model(seed)
        want = [reference(model, p, c, 40, [EOS])[0] for p in PROMPTS]
        got = spec.generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, fork=True, lookup=True),
                                        eos_ids=[EOS], cost=cheap, controls=[c] * len(PROMPTS))
        assert [r.tokens for r in got] == want
        # sampled: the reference's draws with the same seed
        want = [reference(model, p, c, 24, [EOS], temperature=0.9, seed=seed)[0] for p in PROMPTS]
        got = spec.generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=24, fork=True, lookup=True,
                                                                          temperature=0.9),
                                        eos_ids=[EOS], seed=seed, cost=cheap, controls=[c] * len(PROMPTS))
        assert [r.tokens for r in got] == want
    assert seen["fed"] > 20 and seen["several"] > 5 and seen["won"] > 5, seen


def test_forced_tokens_join_the_draft():
    """A grammar that leaves one way on drafts that way: more tokens per forward than the masks'
    drafts alone, the same tokens as AR."""
    tok = letters()
    c = Controls(grammar=grammar.regex(tok, "(abcdefghijklmnop|qrstuvabcdefghij)(klm|nop)qrstuvabcdefg"))
    model = tiny_model(1)
    want = [reference(model, p, c, 40, [EOS])[0] for p in PROMPTS]
    got = decode(model, PROMPTS, "speculative", eos_ids=[EOS], gen_length=40, controls=c)
    assert [r.tokens for r in got] == want and all(r.finished for r in got)
    # each answer is 31 tokens, two of them choices: the forced runs after them go in one forward each
    assert all(r.forwards <= 6 for r in got), [r.forwards for r in got]
    # `ar` drafts nothing: a forward per token, but the end, which the grammar forces after the last
    ar = decode(model, PROMPTS, "ar", eos_ids=[EOS], gen_length=40, controls=c)
    assert [r.tokens for r in ar] == want and all(r.forwards == len(r.tokens) - 1 for r in ar)


def test_rows_with_and_without_controls_share_a_batch():
    model = tiny_model(2)
    c = controls_cases()["all"]
    alone = decode(model, PROMPTS, "speculative", eos_ids=[EOS], gen_length=20)
    batch = SpeculativeBatch(model, eos_ids=[EOS])
    p = SpeculativeParams(gen_length=20)
    streamed = collections.defaultdict(list)
    sids = []
    for i, prompt in enumerate(PROMPTS):
        sids.append(batch.add(prompt, p, on_commit=lambda pos, tok, i=i: streamed[i].extend(tok)))
        sids.append(batch.add(prompt, p, controls=c,
                              on_commit=lambda pos, tok, lp, i=i: streamed[i, "c"].append((tok, lp))))
    out = {}
    while len(batch):
        out.update(batch.step())
    for i, prompt in enumerate(PROMPTS):
        free, ruled = out[sids[2 * i]], out[sids[2 * i + 1]]
        assert free.tokens == alone[i].tokens == streamed[i]
        toks, lps, tops = reference(model, prompt, c, 20, [EOS])
        assert ruled.tokens == toks == [t for tok, _ in streamed[i, "c"] for t in tok]
        check_logprobs(ruled, lps, tops)
        assert [v for _, lp in streamed[i, "c"] for v in lp.chosen] == ruled.logprobs.chosen


@pytest.mark.parametrize("decoder", ["ar", "speculative"])
def test_decode_streams_logprobs_as_a_fourth_argument(decoder):
    model = tiny_model(1)
    c = controls_cases()["all"]
    got = collections.defaultdict(list)
    res = decode(model, PROMPTS[:2], decoder, eos_ids=[EOS], gen_length=16, controls=[c, None],
                 on_commit=lambda row, pos, tok, lp: got[row].append((pos, tok, lp)))
    assert [t for _, tok, _ in got[0] for t in tok] == res[0].tokens
    assert [v for _, _, lp in got[0] for v in lp.chosen] == res[0].logprobs.chosen
    assert [t for _, tok, _ in got[1] for t in tok] == res[1].tokens and res[1].logprobs is None
    assert all(lp is None for _, _, lp in got[1])
    # without logprobs anywhere, the callback keeps its three arguments
    three = []
    res = decode(model, PROMPTS[:1], decoder, eos_ids=[EOS], gen_length=8, controls=controls_cases()["choice"],
                 on_commit=lambda row, pos, tok: three.extend(tok))
    assert three == res[0].tokens and three


# ---- sampling: the exact controlled AR law on a 6-token vocabulary --------------------------------


def law(model, prompt, n, c, temperature, top_k=None, top_p=None) -> dict[tuple, float]:
    """P(answer) under controlled AR sampling, up to n tokens or an EOS (4), enumerated with the
    reference's distributions."""
    out = {}
    m = c.grammar.matcher()

    def walk(seq: list[int], p: float) -> None:
        if len(seq) == n or (seq and seq[-1] == 4):
            out[tuple(seq)] = p
            return
        _, probs = next_distribution(model, prompt, seq, c, m, [4], True, temperature, top_k, top_p)
        for t in range(5):
            if probs[t] > 0:
                if t != 4:
                    m.accept(t)
                walk(seq + [t], p * float(probs[t]))
                if t != 4:
                    m.rollback(1)

    walk([], 1.0)
    return out


def samples(model, prompt, n, total, c, **kw) -> list[tuple]:
    batch = SpeculativeBatch(model, eos_ids=[4])
    p = SpeculativeParams(gen_length=n, draft_length=4, widths="fixed", **kw)
    sids = [batch.add(prompt, p, seed=s, controls=c) for s in range(total)]
    out = {}
    while len(batch):
        out.update((sid, tuple(r.tokens)) for sid, r in batch.step())
    return [out[s] for s in sids]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)], ids=["t1", "k3p0.9"])
def test_sampled_outputs_follow_the_controlled_ar_law(kw):
    tok = letters("abcd")  # a b c d, <eos> 4, <mask> 5
    model = Transformer(ModelConfig(**{**CFG, "vocab_size": 6, "mask_token_id": 5, "eos_token_id": 4})
                        ).init_weights(seed=7, std=0.25).eval()
    # after b only c: a forced token; the end only after a or d; bias and penalties move the rest
    c = Controls(grammar=grammar.regex(tok, "(a|bc|d)+"), logit_bias={0: 1.5}, presence_penalty=0.5,
                 frequency_penalty=0.3)
    prompt, n, total = [1, 2, 3], 3, 2500
    want = law(model, prompt, n, c, kw["temperature"], kw.get("top_k"), kw.get("top_p"))
    outs = samples(model, prompt, n, total, c, **kw)
    stat, df = chi2(collections.Counter(outs), want, total)
    threshold = df + 5 * (2 * df) ** 0.5
    assert stat < threshold, (stat, df)
    # the statistic sees a wrong sampler: the same draws without the controls
    free = samples(model, prompt, n, total, None, **kw)
    assert chi2(collections.Counter(free), want, total)[0] > 3 * threshold
    # `ar` draws the same tokens with the same seed
    for s in range(0, total, 397):
        (r,) = decode(model, [prompt], "ar", eos_ids=[4], seed=s, gen_length=n, controls=c, **kw)
        assert tuple(r.tokens) == outs[s]


def test_sampled_logprobs_are_of_the_distribution_drawn_from():
    model = tiny_model(3)
    c = Controls(grammar=grammar.regex(letters(), "[a-m]+n[o-v]*"), logit_bias={2: 2.0}, logprobs=3)
    for s in range(3):
        want = reference(model, PROMPTS[1], c, 16, [EOS], temperature=0.8, top_p=0.95, seed=s)
        for dec in ("ar", "speculative"):
            (r,) = decode(model, [PROMPTS[1]], dec, eos_ids=[EOS], seed=s, gen_length=16, temperature=0.8,
                          top_p=0.95, controls=c)
            assert r.tokens == want[0]
            check_logprobs(r, want[1], want[2])


# ---- hand cases on the bundled model -------------------------------------------------------------


def test_a_bias_of_minus_100_on_the_argmax_gives_the_second_best(bundled_model):
    model, tok = bundled_model
    prompt = tok.chat_prompt_ids("Sort: 99 18 76 22 64")
    with torch.inference_mode():  # the bundled model reads its first token from the prompt's last
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0, -1]
    first, second = logits.topk(2).indices.tolist()
    for dec in ("ar", "speculative"):
        (plain,) = decode(model, [prompt], dec, gen_length=4, controls=Controls(logprobs=5))
        assert plain.tokens[0] == first
        logp = logits.float().log_softmax(-1)
        assert plain.logprobs.chosen[0] == pytest.approx(float(logp[first]), abs=1e-5)
        top = logp.topk(5)
        assert [t for t, _ in plain.logprobs.top[0]] == top.indices.tolist()
        np.testing.assert_allclose([v for _, v in plain.logprobs.top[0]], top.values.tolist(), atol=1e-5)
        (banned,) = decode(model, [prompt], dec, gen_length=4, controls=Controls(logit_bias={first: -100}))
        assert banned.tokens[0] == second


def test_json_schemas_validate(bundled_model):
    import jsonschema  # (a test dependency: no skip)
    model, tok = bundled_model
    schemas = [
        {"type": "object", "properties": {"kind": {"enum": ["sort", "add", "repeat"]},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["kind", "count"], "additionalProperties": False},
        {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                                    "minItems": 2, "maxItems": 3}},
         "required": ["words"], "additionalProperties": False},
        {"type": "object", "properties": {"outer": {"type": "object", "properties": {
            "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["ok", "n"], "additionalProperties": False}}, "required": ["outer"],
         "additionalProperties": False},
    ]
    prompts = [tok.chat_prompt_ids(t) for t in ("Sort: 99 18 76 22 64", "Repeat 2 times: door ship", "Add: 3 + 4")]
    import json

    for schema in schemas:
        c = Controls(grammar=grammar.json_schema(tok, schema))
        outs = {dec: decode(model, prompts, dec, gen_length=96, controls=c) for dec in ("ar", "speculative")}
        assert [r.tokens for r in outs["ar"]] == [r.tokens for r in outs["speculative"]]
        for r in outs["speculative"]:
            assert r.finished
            jsonschema.validate(json.loads(tok.decode(r.tokens)), schema)


@pytest.fixture(scope="module")
def bundled_model():
    from tests.helpers.bundled import bundled

    return bundled()


# ---- the grammar and the checks ----------------------------------------------------------------


def allowed(m, eos=(EOS,)) -> list[int]:
    words = np.zeros(1, dtype=np.int32)
    m.fill(words, np.array(eos))
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


def test_eos_exactly_when_complete_and_never_a_special_token():
    tok = letters()
    m = grammar.regex(tok, "ab(c)?").matcher()
    assert allowed(m) == [0]
    m.accept(0)
    assert allowed(m) == [1] and m.forced() == [1]
    m.accept(1)
    assert allowed(m) == [2, EOS] and m.is_complete()
    m.accept(2)
    assert allowed(m) == [EOS]
    m.rollback(2)
    assert allowed(m) == [1] and not m.accept(2)
    # the batch's EOS ids are the ones allowed, whatever the tokenizer's own
    m2 = grammar.choice(tok, ["a"]).matcher()
    m2.accept(0)
    assert allowed(m2, eos=(1, 5)) == [1, 5]
    assert MASK not in allowed(grammar.regex(tok, "[^a]").matcher())  # a mask is no text, nor EOS


def test_grammars_are_cached_and_bad_ones_refused():
    tok = letters()
    assert grammar.json_schema(tok, {"type": "object"}) is grammar.json_object(tok)
    assert grammar.regex(tok, "a+") is grammar.regex(tok, "a+")
    for make, bad, msg in ((grammar.regex, "a(b", "invalid regex"),
                           (grammar.json_schema, {"type": "nonsense"}, "invalid json schema"),
                           (grammar.json_schema, "{not json", "invalid JSON schema: not JSON"),
                           (grammar.json_schema, [1], "invalid JSON schema: a schema is a JSON object"),
                           (grammar.choice, [], "invalid choice"), (grammar.regex, "", "invalid regex")):
        with pytest.raises(ValueError, match=msg):
            make(tok, bad)


@pytest.mark.parametrize("kw, msg", [(dict(logit_bias={1: 101}), "in \\[-100, 100\\]"),
                                     (dict(logit_bias={-1: 1}), "token ids"),
                                     (dict(logit_bias={"x": 1}), "token ids"),
                                     (dict(presence_penalty=2.5), "presence_penalty"),
                                     (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                     (dict(logprobs=21), "logprobs"), (dict(logprobs=True), "logprobs"),
                                     (dict(grammar="a+"), "grammar must be a Grammar")])
def test_bad_controls_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Controls(**kw)


def test_controls_are_refused_where_they_cannot_be_exact():
    model = tiny_model(0)
    assert Controls(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # (OpenAI's keys are strings)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode(model, PROMPTS, "ar", controls=Controls(logit_bias={24: 1.0}))
    with pytest.raises(ValueError, match="tokenizer of 28 tokens"):
        decode(model, PROMPTS, "ar", controls=Controls(grammar=grammar.regex(letters(LETTERS + "wxyz"), "a+")))
    with pytest.raises(ValueError, match="give eos_ids"):
        decode(model, PROMPTS, "ar", eos_ids=[], controls=Controls(grammar=grammar.regex(letters(), "a+")))
    with pytest.raises(ValueError, match="2 controls for 4 prompts"):
        decode(model, PROMPTS, "ar", controls=[Controls(), Controls()])
    for dec in ("refusion", "refusion-l2r"):
        with pytest.raises(ValueError, match="use one that does: speculative, ar"):
            decode(model, PROMPTS, dec, gen_length=8, slot_size=8, controls=Controls(logprobs=0))
    # controls that change nothing are no controls
    plain = decode(model, PROMPTS, "refusion", gen_length=8, slot_size=8)
    got = decode(model, PROMPTS, "refusion", gen_length=8, slot_size=8, controls=Controls())
    assert [r.tokens for r in got] == [r.tokens for r in plain] and all(r.tokens for r in got)


# ---- SmolLM2 with its mask adapter (the shipped settings: lookup, fork, the sampler) -------------


@pytest.mark.slow
def test_smollm2_constrained_speculative_equals_constrained_ar():
    import jsonschema  # (a test dependency: no skip)
    import json

    from refusion.bundled import resolve_model
    from refusion.model.checkpoint import load_model

    path = resolve_model("smollm2-refusion")
    model, tok = load_model(path), Tokenizer.from_dir(path)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32}, "role": {"enum": ["nurse", "teacher", "engineer", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "city", "role", "skills"], "additionalProperties": False}
    texts = ["Maria Lopez is a 34-year-old nurse from Madrid who speaks Spanish and English.",
             "Tom Becker, 51, teaches physics and chemistry in Hamburg.",
             "Aiko Tanaka (27) is a software engineer in Osaka; she writes Rust and Python."]
    prompts = [tok.chat_prompt_ids(f"Extract the person as JSON with the keys name, age, city, role, skills.\n\n{t}")
               for t in texts]
    for kw, c in ((dict(), Controls(grammar=grammar.json_schema(tok, schema), logprobs=2)),
                  (dict(temperature=0.8, seed=3), Controls(grammar=grammar.json_schema(tok, schema),
                                                           logit_bias={11: 2.0}, presence_penalty=0.5))):
        want = decode(model, prompts, "ar", gen_length=96, controls=c, **kw)
        got = decode(model, prompts, "speculative", gen_length=96, controls=c, **kw)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for r, w in zip(got, want, strict=True):
            assert r.finished
            jsonschema.validate(json.loads(tok.decode(r.tokens)), schema)
            if c.logprobs is not None:
                np.testing.assert_allclose(r.logprobs.chosen, w.logprobs.chosen, atol=1e-4)
        assert sum(len(r.tokens) for r in got) > 1.5 * sum(r.forwards for r in got)
