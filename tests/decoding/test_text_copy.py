"""Grammar drafting beyond the tokens a grammar forces: copies of the prompt's bytes (text_copy.py)
and the tokens of forced text whose last token could still merge (grammar.Matcher.forced_text)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HF

from refusion.decoding import Controls, decode, grammar
from refusion.decoding.text_copy import MIN_MATCH, TextCopy
from refusion.model.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def bytewise(prompt: bytes) -> TextCopy:
    """A TextCopy over a tokenizer of one token per byte (id = the byte)."""
    return TextCopy(list(prompt), bytes, list)


class Words:
    """A tokenizer of words with their leading space: ' lives' is one token, and a cut word is a shorter one."""

    def __init__(self) -> None:
        self.vocab: list[bytes] = []

    def tokens(self, text: bytes) -> list[int]:
        out = []
        for w in re.findall(rb" ?[^ ]+| ", text):
            if w not in self.vocab:
                self.vocab.append(w)
            out.append(self.vocab.index(w))
        return out

    def text(self, ids: list[int]) -> bytes:
        return b"".join(self.vocab[i] for i in ids)


def test_a_copy_continues_the_prompt_where_the_answer_quotes_it_without_its_space():
    c = bytewise(b"Maria Lopez lives in Madrid.")
    c.extend(list(b'{"name": "Maria Lopez", "city": "Mad'))
    assert c.match() == 3  # 'Mad': the prompt has ' Madrid', never '"Mad'
    assert c.propose(3) == (list(b"rid"), 3)
    assert c.propose(10) == (list(b"rid."), 3)  # (up to the prompt's end)
    c.extend(list(b"rid"))
    assert c.propose(2) == (list(b"."), 6)  # 'Madrid' matched now


def test_no_copy_without_a_match_and_the_latest_occurrence_with_a_continuation_wins():
    c = bytewise(b"ab1 ab2 ab")
    assert c.propose(4) == ([], 0)  # nothing answered yet
    c.extend(list(b"q"))
    assert c.propose(4) == ([], 0)
    c.extend(list(b"ab"))
    assert c.propose(4) == (list(b"2 ab"), 2)  # (not the one that ends the prompt: nothing follows it)


def test_a_copy_cut_inside_the_text_drops_its_last_token():
    w = Words()
    prompt = w.tokens(b"the wireless mouse costs twenty-four dollars and ships today")
    c = TextCopy(prompt, w.text, w.tokens)
    c.extend(w.tokens(b"wireless"))
    got, n = c.propose(2)  # 16 bytes read: ' mouse costs twe' ends inside a word
    assert n == 8 and w.text(got) == b" mouse costs"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40).map(lambda b: bytes(x % 3 + 97 for x in b)),
       st.binary(max_size=80).map(lambda b: bytes(x % 3 + 97 for x in b)))
def test_the_match_is_the_longest_suffix_found(prompt, answer):
    """The binary search against every suffix length tried in turn."""
    c = bytewise(prompt)
    c.extend(list(answer))
    want = max((n for n in range(MIN_MATCH, len(c.tail) + 1) if c.tail[-n:] in prompt[:-1]), default=0)
    assert c.match() == want
    copy, n = c.propose(4)
    assert n == want and (copy == [] if n == 0 else len(copy) >= 1)


def merging() -> Tokenizer:
    """Bytes of JSON punctuation and a few letters, with merges across a value's start (' "', '"a')."""
    chars = ['{', '}', '"', ':', ',', 'Ġ', 'a', 'b', 'k', 'x']
    merges = [('Ġ', '"'), ('"', 'a'), ('{', '"'), ('"', ':')]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = HF(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<mask>", special=True)])
    return Tokenizer(tok, {"eos_token": "<eos>", "mask_token": "<mask>"})


def test_forced_text_beyond_the_forced_tokens():
    """The grammar forces `{"k": "`, but its tokens only up to `":`: ` "` could still merge with a
    value's first byte ('"a'). The text's tokens are the draft; the matcher's state does not move."""
    tok = merging()
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"],
              "additionalProperties": False}
    m = grammar.json_schema(tok, schema).matcher()
    forced = m.forced()
    assert [tok.decode([t]) for t in forced] == ['{"', "k", '":']
    assert m.forced_text() == forced + [10]  # (all of the forced text: `{"k": "`)
    m.accept_many(forced)
    assert m.forced_text() == tok.encode(' "') == [10]
    assert m.forced_text() == [10] and m.forced() == []
    m.accept_many([10, 6])  # ' "', 'a': inside the string nothing is forced
    assert m.forced_text() == []


@pytest.mark.slow
def test_text_copies_save_forwards_and_keep_the_tokens(monkeypatch):
    """SmolLM2 with its adapter extracting JSON from a text, drafts at a fixed width: the answer
    quotes the text inside quotes (no space before its words), which token copies cannot follow.
    With text copies, fewer forwards, the tokens of constrained `ar`."""
    from refusion.bundled import resolve_model
    from refusion.model.checkpoint import load_model

    path = resolve_model("smollm2-refusion")
    model, tok = load_model(path), Tokenizer.from_dir(path)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "occupation": {"type": "string"}},
              "required": ["name", "city", "occupation"], "additionalProperties": False}
    prompt = tok.chat_prompt_ids("Extract the person from this text as a JSON object with the keys name, city, "
                                 "occupation. Reply with the JSON only.\n\nText: Maria Lopez is a nurse who "
                                 "lives in Madrid.")
    c = Controls(grammar=grammar.json_schema(tok, schema))
    kw = dict(gen_length=64, controls=c, widths="fixed", draft_length=6, width_price=1.0)
    (want,) = decode(model, [prompt], "ar", gen_length=64, controls=c)
    (got,) = decode(model, [prompt], "speculative", **kw)
    assert got.tokens == want.tokens and got.finished
    monkeypatch.setattr(TextCopy, "propose", lambda self, k: ([], 0))
    (without,) = decode(model, [prompt], "speculative", **kw)
    assert without.tokens == want.tokens
    assert got.forwards < without.forwards, (got.forwards, without.forwards)
