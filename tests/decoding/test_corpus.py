"""The lookup corpus (decoding/corpus.py): its index gives, for the longest suffix the corpus holds,
the continuation its occurrences vote for token by token (the most frequent next token among the
occurrences that agree so far, until most of them end); it travels with a model directory and a
mask adapter; and the speculative decoder drafts from it (under its own kinds) with AR's output
unchanged."""

import json

import numpy as np
import pytest

from refusion import bundled
from refusion.cli import main
from refusion.decoding import ARParams, decode, widths
from refusion.decoding import corpus as corpus_module, speculative as spec
from refusion.decoding.corpus import LookupCorpus, corpus_of, read_corpus, write_corpus
from refusion.decoding.lookup import NgramIndex
from refusion.model.checkpoint import LOOKUP_CORPUS
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.model.checkpoint import load_model, save_model
from refusion.model.config import ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from tests.helpers.reference_ar import generate_ar
from tests.helpers.tiny_causal_lm import make_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def flat(answers):
    return np.array([t for a in answers for t in (*a, -1)])


def brute_occurrences(t, history, ngrams, votes):
    """Where the continuations of the longest suffix of `history` held in t begin (its latest `votes`), and n."""
    for n in ngrams:
        if len(history) < n:
            continue
        suf = list(history[-n:])
        occ = [s + n for s in range(len(t) - n) if t[s:s + n] == suf and t[s + n] >= 0][-votes:]
        if occ:
            return occ, n
    return [], 0


def brute_vote(t, occ, k, min_share):
    """Token by token, the most frequent next token among the occurrences that agree so far (a tie: the
    larger id), while past the first token at least min_share of them agree, until an answer's end."""
    draft = []
    while len(draft) < k:
        j = len(draft)
        counts = {}
        for s in occ:
            counts[t[s + j]] = counts.get(t[s + j], 0) + 1
        best = max(counts.values())
        win = max(x for x, c in counts.items() if c == best)
        if j and best < min_share * len(occ):  # (past the first token, too few agree: the draft ends)
            break
        if win == -1:
            break
        draft.append(win)
        occ = [s for s in occ if t[s + j] == win]
    return draft


def brute_force(answers, history, k, ngrams=(6, 5, 4, 3, 2, 1), votes=512, min_share=0.5):
    """The definition, by scanning every occurrence."""
    t = flat(answers).tolist()
    occ, n = brute_occurrences(t, history, ngrams, votes)
    return (brute_vote(t, occ, k, min_share), n) if occ else ([], 0)


def test_the_index_by_hand():
    c = LookupCorpus(flat([[5, 6, 7, 1], [5, 6, 8, 2], [9, 5, 6, 7, 3], [5, 6, 8], [4, 5, 6, 7, 4]]))
    # "5 6" is followed by 7 three times and 8 twice: 7; the three go on with 1, 3 and 4, none of them
    # by half of the votes: the draft ends there (without that rule, the larger id of a tie: 4)
    assert c.propose([3, 5, 6], 8) == ([7], 2)
    assert LookupCorpus(c.tokens, min_share=0).propose([3, 5, 6], 8) == ([7, 4], 2)
    # the first token is drafted however split its vote: 3 has 2 of the 5 votes after "1"
    assert LookupCorpus(flat([[1, 2], [1, 3], [1, 4], [1, 5], [1, 3]])).propose([1], 8) == ([3], 1)
    assert c.propose([9, 5, 6], 8) == ([7, 3], 3)  # the longer suffix "9 5 6" is held: its own continuation
    assert c.propose([5, 6, 8], 1) == ([2], 3)  # "5 6 8" ends an answer once, and goes on to 2 once
    assert c.propose([11], 4) == ([], 0)  # never seen
    assert c.propose([4], 4) == ([5, 6, 7, 4], 1)  # (the answer-ending 4s are followed by nothing)
    assert LookupCorpus(flat([[1]])).propose([1], 3) == ([], 0)  # a token that only ends answers continues nothing
    # a vote at every position, not one occurrence followed: "1 2" goes on with 3 twice and 4 once
    c = LookupCorpus(flat([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 8]]))
    assert c.propose([1], 8) == ([2, 3, 9], 1)  # (9 and 8 tie among the two that agree: the larger id)
    # most of the occurrences that agree so far end there: the draft ends too
    assert LookupCorpus(flat([[7, 1], [7, 1], [7, 1, 5]])).propose([7], 8) == ([1], 1)
    # a corpus not ending with an answer's end is read as if it did
    assert LookupCorpus(np.array([2, 3, 4])).propose([2], 8) == ([3, 4], 1)


def brute_force_runner_up(answers, history, draft, k, ngrams=(6, 5, 4, 3, 2, 1), votes=512, min_share=0.5):
    """The definition: among the occurrences of the longest suffix held (its latest `votes`), at the first
    place within `draft` where any goes on otherwise, the most frequent other next token (not an
    answer's end; a tie: the larger id), then the vote of the occurrences going on with it."""
    t = flat(answers).tolist()
    occ, _ = brute_occurrences(t, history, ngrams, votes)
    for j, d in enumerate(draft):
        if len(occ) < 2:
            return []
        if any(t[s + j] != d for s in occ):
            others = {}
            for s in occ:
                if t[s + j] != d and t[s + j] >= 0:
                    others[t[s + j]] = others.get(t[s + j], 0) + 1
            if not others:
                return []
            best = max(others.values())
            v = max(x for x, c in others.items() if c == best)
            rest = [s + j + 1 for s in occ if t[s + j] == v]
            return list(draft[:j]) + [v] + brute_vote(t, rest, k - j - 1, min_share)
        occ = [s for s in occ if t[s + j] == d]
    return []


def test_the_runner_up_by_hand():
    c = LookupCorpus(flat([[5, 6, 7, 1], [5, 6, 8, 2], [9, 5, 6, 7, 3], [5, 6, 8], [4, 5, 6, 7, 4]]))
    # after "5 6": 7 three times (the draft), 8 twice: the runner-up is 8, then what the two 8s go on
    # with (2, and an answer's end: a tie, the larger id)
    assert c.propose([3, 5, 6], 8) == ([7], 2)
    assert c.runner_up([3, 5, 6], [7], 8) == [8, 2]
    assert c.runner_up([3, 5, 6], [7], 1) == [8]
    # the occurrences agree on the first token and part on the second: the runner-up parts there
    c = LookupCorpus(flat([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 8]]))
    assert c.propose([1], 8) == ([2, 3, 9], 1)
    assert c.runner_up([1], [2, 3, 9], 8) == [2, 4, 8]
    assert c.runner_up([1], [2, 3, 9, 7], 8) == [2, 4, 8]
    assert LookupCorpus(flat([[1, 2], [1, 2]])).runner_up([1], [2], 4) == []  # they never part
    assert LookupCorpus(flat([[1, 2], [1]])).runner_up([1], [2], 4) == []  # only an answer's end beside it
    assert c.runner_up([11], [2], 4) == []  # never seen


@pytest.mark.parametrize("votes", [512, 3])
def test_the_runner_up_matches_the_definition(monkeypatch, votes):
    monkeypatch.setattr(corpus_module, "MAX_VOTES", votes)
    rng = np.random.default_rng(2)
    for vocab in (3, 6, 40):
        answers = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(40)]
        c = LookupCorpus(flat(answers))
        for _ in range(200):
            history = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
            for k in (2, 6):
                draft, _ = c.propose(history, k)
                want = brute_force_runner_up(answers, history, draft, k, votes=votes)
                assert c.runner_up(history, draft, k) == want, (vocab, history, k)


@pytest.mark.parametrize("votes", [512, 3])
def test_the_index_matches_the_definition(monkeypatch, votes):
    monkeypatch.setattr(corpus_module, "MAX_VOTES", votes)  # (3: only an n-gram's latest 3 occurrences vote)
    rng = np.random.default_rng(0)
    for vocab in (3, 6, 40):
        answers = [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(40)]
        c = LookupCorpus(flat(answers))
        t = flat(answers).tolist()
        for _ in range(200):
            history = rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
            for k in (1, 5):
                assert c.propose(history, k) == brute_force(answers, history, k, votes=votes), (vocab, history, k)
            # offer()'s flag: the first token drafted won under half of the voting occurrences
            draft, n, contested = c.offer(history, 4)
            assert (draft, n) == c.propose(history, 4)
            voters = [t[s] for s in brute_occurrences(t, history, (6, 5, 4, 3, 2, 1), votes)[0]]
            want = bool(draft) and len(voters) > 1 and voters.count(draft[0]) < 0.5 * len(voters)
            assert contested == want, (vocab, history)


def test_hash_collisions_are_told_apart(monkeypatch):
    # the index keeps a hash's top bits only: with no spreading every n-gram lands in one bucket, and
    # the occurrences must still be told apart by their tokens
    monkeypatch.setattr(corpus_module, "_SPREAD", np.uint64(0))
    monkeypatch.setattr(corpus_module, "MAX_VOTES", 10**6)  # (the window is taken before the tokens are compared)
    rng = np.random.default_rng(3)
    answers = [rng.integers(0, 5, int(rng.integers(1, 20))).tolist() for _ in range(30)]
    c = LookupCorpus(flat(answers))
    assert len(np.unique(c.keys[2] >> np.uint64(c.place_bits))) == 1  # (every 2-gram collides)
    for _ in range(100):
        history = rng.integers(0, 6, int(rng.integers(1, 8))).tolist()
        assert c.propose(history, 4) == brute_force(answers, history, 4, votes=10**6), history


def test_a_contested_first_token_is_said_so():
    # after "1": 3 has 2 of the 5 votes (drafted all the same), 2 has 3 of 4, and one voter is never contested
    assert LookupCorpus(flat([[1, 2], [1, 3], [1, 4], [1, 5], [1, 3]])).offer([1], 8) == ([3], 1, True)
    assert LookupCorpus(flat([[1, 2], [1, 2], [1, 4], [1, 2]])).offer([1], 8) == ([2], 1, False)
    assert LookupCorpus(flat([[1, 7, 8]])).offer([1], 8) == ([7, 8], 1, False)
    assert LookupCorpus(flat([[1, 7, 8]])).offer([6], 8) == ([], 0, False)
    # an occurrence that ends its answer continues nothing, so it has no vote on the first token
    assert LookupCorpus(flat([[1], [1], [1], [1, 5], [1, 6], [1, 5]])).offer([1], 8) == ([5], 1, False)


def test_the_corpus_file_round_trips_and_bad_files_are_named(tmp_path):
    answers = [[3, 4, 5], [], [0, 7]]
    path = write_corpus(tmp_path, answers)
    assert path.name == LOOKUP_CORPUS and not list(tmp_path.glob("*.tmp"))
    assert read_corpus(path).tokens.tolist() == [3, 4, 5, -1, -1, 0, 7, -1]
    with pytest.raises(ValueError, match=">= 0"):
        write_corpus(tmp_path, [[1, -3]])
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable lookup corpus"):
        read_corpus(tmp_path / "bad.safetensors")


MASK = 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=1)


def test_speculative_drafts_from_the_models_corpus_and_keeps_ar_output(tmp_path, fed_kinds):
    """A model whose corpus holds its own earlier answers drafts them (corpus kinds, accepted far) and
    needs fewer forwards for the same tokens; without the file it has no corpus."""
    save_model(Transformer(ModelConfig(**CFG)).init_weights(seed=7, std=0.5), tmp_path / "m")
    model = load_model(tmp_path / "m")
    assert corpus_of(model) is None
    prompts = [[2, 3, 4], [9, 8, 7, 6], [12, 5]]
    want = generate_ar(model, prompts, ARParams(gen_length=40), eos_ids=[])
    write_corpus(tmp_path / "m", [r.tokens for r in want])
    model = load_model(tmp_path / "m")
    assert corpus_of(model) is not None
    kinds = fed_kinds
    params = dict(gen_length=40, draft_length=8, widths="fixed")
    off = generate_speculative(model, prompts, SpeculativeParams(lookup=False, **params), eos_ids=[])
    assert all(k < widths.CORPUS for k in kinds)
    kinds.clear()
    on = generate_speculative(model, prompts, SpeculativeParams(lookup=True, **params), eos_ids=[])
    assert [r.tokens for r in on] == [r.tokens for r in off] == [r.tokens for r in want]
    assert any(k >= widths.CORPUS for k in kinds)
    assert sum(r.forwards for r in on) < 0.5 * sum(r.forwards for r in off)
    pool = widths.prior_for(model)
    assert pool.accepted[widths.CORPUS:].sum() > 0


def test_a_corpus_draft_is_counted_by_its_vote(tmp_path, monkeypatch):
    """Every corpus draft a row takes is of the kind its match's length, the copy beside it and its
    contested first token say; contested and uncontested drafts are both met."""
    save_model(Transformer(ModelConfig(**CFG)).init_weights(seed=7, std=0.5), tmp_path / "m")
    model = load_model(tmp_path / "m")
    prompts = [[2, 3, 4], [9, 8, 7, 6], [12, 5], [3, 3, 9]]
    answers = generate_ar(model, prompts, ARParams(gen_length=40), eos_ids=[])
    rng = np.random.default_rng(0)  # the answers, and noisy copies of them: votes that split
    noisy = [[t if rng.random() > 0.6 else int(rng.integers(2, 20)) for t in r.tokens] for r in answers for _ in range(4)]
    write_corpus(tmp_path / "m", [r.tokens for r in answers] + noisy)
    model = load_model(tmp_path / "m")
    corpus, plain, seen = corpus_of(model), FeedPolicy.offer_drafts, set()

    def offer_drafts(self, seqs):
        plain(self, seqs)
        for q in seqs:
            if not q.done and widths.CORPUS <= q.kind < widths.SECOND:
                draft, n, contested = corpus.offer(q.index.tokens, q.p.draft_length)
                copy, _ = q.index.propose(q.p.draft_length)
                assert q.kind == widths.corpus_kind(n, bool(copy), contested) and q.draft == draft
                seen.add(contested)

    monkeypatch.setattr(FeedPolicy, "offer_drafts", offer_drafts)
    params = SpeculativeParams(lookup=True, gen_length=40, draft_length=8, widths="fixed")
    out = generate_speculative(model, prompts, params, eos_ids=[])
    assert [r.tokens for r in out] == [r.tokens for r in answers]
    # these answers repeat themselves, so copies win most steps: without them, contested drafts are held too
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: ([], 0))
    out = generate_speculative(model, prompts, params, eos_ids=[])
    assert [r.tokens for r in out] == [r.tokens for r in answers]
    assert seen == {False, True}


def test_lookup_corpus_command_and_an_adapter_carries_its_corpus(tmp_path, monkeypatch, capsys):
    from tests.model.test_model_names import write_adapter

    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    base = make_causal_lm(tmp_path / "base", std=0.3)
    tok = Tokenizer.from_dir(base)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join([json.dumps({"query": "q", "response": "abc abd", "finished": True}),
                               json.dumps({"query": "q", "response": "xyz", "finished": False}), "not json", ""]))
    adapter = tmp_path / "adapter"
    write_adapter(base, adapter, str(base))
    assert main(["lookup-corpus", str(data), "--model", str(base), "--out", str(adapter)]) == 0
    err = capsys.readouterr().err
    assert "2 answers" in err and "(1 lines without a response skipped)" in err
    eos = [tok.eos_id] if tok.eos_id is not None else []
    assert read_corpus(adapter / LOOKUP_CORPUS).tokens.tolist() == [*tok.encode("abc abd"), *eos, -1,
                                                                     *tok.encode("xyz"), -1]
    built = bundled.resolve_model(adapter)
    assert (built / LOOKUP_CORPUS).read_bytes() == (adapter / LOOKUP_CORPUS).read_bytes()
    out = decode(load_model(built), [tok.encode("abc")], "speculative", gen_length=12, eos_ids=[])
    assert out[0].tokens == decode(load_model(base), [tok.encode("abc")], "ar", gen_length=12, eos_ids=[])[0].tokens
    assert main(["lookup-corpus", str(tmp_path / "none.jsonl"), "--model", str(base), "--out", str(adapter)]) == 2
    assert "cannot read it" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("{}\n")
    assert main(["lookup-corpus", str(tmp_path / "empty.jsonl"), "--model", str(base), "--out", str(adapter)]) == 2
    assert "no line holds" in capsys.readouterr().err


def test_a_corpus_draft_beside_a_copy_is_counted_apart(tmp_path):
    """The corpus's drafts are their own kind per match length, and another where the row also has a
    copy of its own text on offer (the offers after a step say which)."""
    assert len({widths.corpus_kind(n, b) for n in (1, 2, 6) for b in (False, True)}) == 6
    assert widths.corpus_kind(6, True) < widths.SECOND < widths.KINDS
    save_model(Transformer(ModelConfig(**CFG)).init_weights(seed=7, std=0.5), tmp_path / "m")
    write_corpus(tmp_path / "m", [[5, 6, 7, 8, 9, 10]])
    model = load_model(tmp_path / "m")
    batch = spec.SpeculativeBatch(model, eos_ids=[])
    offered = []

    for prompt, has_copy in (([5, 6, 7, 2, 5, 6, 7], True), ([2, 3, 5, 6, 7], False)):
        q = spec.SpeculativeSeq(0, prompt, SpeculativeParams(gen_length=8, lookup=True), MASK, set(), 0, None,
                                lookup=True)
        q.draft, q.kind = [], widths.FRESH  # (nothing of the masks': the best offer is held)
        q.acceptance.record(widths.corpus_kind(3, has_copy), 4, 4)  # (the corpus's kind goes far for this row)
        batch.policy.offer_drafts([q])
        offered.append(q.kind)
    assert offered == [widths.corpus_kind(3, True), widths.corpus_kind(3, False)]
