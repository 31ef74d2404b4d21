"""Grammar constraints: which tokens may come next, for one tokenizer, through llguidance.

    g = grammar.json_schema(tokenizer, {"type": "object", ...})   # or json_object, regex, choice
    m = g.matcher()                  # one sequence's state
    m.fill(row, eos_ids)             # the allowed next tokens, one bit each (int32 words)
    m.accept(token); m.rollback(n); m.forced()

Why llguidance (`python benchmarks/structured.py --grammar-cost` measures both on SmolLM2's
49,152-token vocabulary): xgrammar fills a mask faster once a grammar is compiled (about ten times
on a JSON schema, more on a regex of free words), but first compiles each new grammar against the
whole vocabulary, tens of milliseconds paid by the request that brings a new schema, and it pulls in
triton; llguidance compiles lazily (well under a millisecond), is one wheel with no dependencies, and
its mask work is a few percent of a constrained speculative decode's time (the benchmark's controls'
share), since a step fills one mask per verified position.

Special tokens: a grammar allows text only. Every special token (the tokenizer's added ones:
<|mask|>, chat markers, padding) and every id past the tokenizer's vocabulary (a model's padded
embedding rows) is never allowed; the end-of-sequence ids the decoder stops at are allowed exactly
when the grammar is complete (`fill(..., eos=...)`).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from refusion.model.tokenizer import Tokenizer

KINDS = ("json_object", "json_schema", "regex", "choice")
# JSON in one layout, `{"a": 1, "b": [2, 3]}`: with free whitespace a small model can pad forever
# (newlines and spaces are always allowed between tokens), and one layout forces the punctuation,
# which is then drafted for free (controlled.py)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_PER_TOKENIZER = 256  # compiled grammars kept per tokenizer (a server sees the same schemas again)


def _llg():
    import llguidance  # (imported on first use: `refusion --help` and unconstrained decoding never need it)

    return llguidance


class GrammarError(ValueError):
    """A grammar the library compiled but could not follow while decoding (it compiles lazily: a
    pattern like `a{1000000}` fails at its first token). The request's fault, not the decoder's."""


class _Vocab:
    """llguidance's view of one tokenizer, and which ids a grammar may never allow (built once per
    tokenizer: about a second)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        llg = _llg()
        n = len(tokenizer)
        eos = tokenizer.eos_id
        self.ll = llg.LLTokenizer(tokenizer.tok.to_str(), n_vocab=n, eos_token=eos if eos is not None else 0)
        self.size = n
        self.eos = self.ll.eos_token
        # the ids a grammar may allow at all: text tokens (the EOS the decoder stops at is set apart)
        keep = np.ones(32 * ((n + 31) // 32), dtype=bool)
        keep[n:] = False
        keep[[t for t in tokenizer.special_roles() if t < n]] = False
        keep[self.eos] = False
        self.keep = np.packbits(keep, bitorder="little").view(np.int32)


_VOCABS: weakref.WeakKeyDictionary[Tokenizer, _Vocab] = weakref.WeakKeyDictionary()
_GRAMMARS: weakref.WeakKeyDictionary[Tokenizer, OrderedDict[tuple[str, str], Grammar]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # (a server's request threads compile while the engine thread decodes)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint for one tokenizer (made by json_object, json_schema, regex or choice;
    cached per tokenizer and spec, so make them freely). Immutable: each sequence takes a matcher."""

    kind: str
    source: str  # the spec as given (a schema as JSON text)
    _vocab: _Vocab
    _compiled: str  # llguidance's grammar

    @property
    def vocab_size(self) -> int:
        return self._vocab.size

    def matcher(self) -> Matcher:
        return Matcher(self)

    def text(self, tokens: list[int]) -> bytes:
        """The tokenizer's bytes of tokens (the grammar's view of the vocabulary)."""
        return bytes(self._vocab.ll.decode_bytes(tokens))

    def tokens(self, text: bytes) -> list[int]:
        """The tokenizer's tokens of text."""
        return list(self._vocab.ll.tokenize_bytes(text))

    def __repr__(self) -> str:
        s = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar({self.kind}: {s})"


class Matcher:
    """One sequence's place in a grammar: the tokens accepted so far (rolled back on demand)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._m = _llg().LLMatcher(grammar._vocab.ll, grammar._compiled, log_level=0)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"the grammar failed while decoding ({_one_line(self._m.get_error())}): "
                               "a simpler schema or pattern (smaller repetition counts, fewer alternatives) may do")

    def fill(self, row: np.ndarray, eos: np.ndarray) -> None:
        """Write the allowed next tokens into row (int32 words, bit t % 32 of word t // 32; at least
        the tokenizer's vocabulary wide; bits past it are cleared): text tokens the grammar allows,
        and the ids `eos` exactly when the grammar may end here."""
        keep = self.grammar._vocab.keep
        words = keep.shape[0]
        row[words:] = 0
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, words * 4)
        row[:words] &= keep
        if self.is_complete():
            _set(row, eos)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar allows in turn; the state does not change."""
        return self._m.validate_tokens(tokens) if tokens else 0

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (and no change) where the grammar does not allow it."""
        return self.accept_many([token]) == 1

    def accept_many(self, tokens: list[int]) -> int:
        """Advance over the longest allowed prefix of tokens; returns its length."""
        n = self._m.validate_tokens(tokens) if tokens else 0
        if n:
            self._m.consume_tokens(tokens[:n])
            self._check()
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if n:
            self._m.rollback(n)
            self._check()

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here, in order (empty where it offers a choice)."""
        return list(self._m.compute_ff_tokens())

    def forced_text(self) -> list[int]:
        """The tokens of the text the grammar forces from here: `forced()` and beyond it, where the
        forced text's last token could still merge with what follows (` "` before a string value:
        no token is forced, but the text's tokens are a draft a model rarely rejects)."""
        text = bytes(self._m.compute_ff_bytes())
        if not text:
            return []
        tokens = self.grammar.tokens(text)
        return tokens[: self.valid_prefix(tokens)]

    def is_complete(self) -> bool:
        """Whether the text so far is a whole match (an end of sequence is allowed now)."""
        return self._m.is_accepting() or self._m.is_stopped()


def _set(row: np.ndarray, ids: np.ndarray) -> None:
    ids = ids[ids < 32 * row.shape[0]]
    np.bitwise_or.at(row.view(np.uint32), ids >> 5, np.uint32(1) << (ids & 31).astype(np.uint32))


def _vocab(tokenizer: Tokenizer) -> _Vocab:
    with _LOCK:
        v = _VOCABS.get(tokenizer)
    if v is None:
        v = _Vocab(tokenizer)
        with _LOCK:
            v = _VOCABS.setdefault(tokenizer, v)
    return v


def _compile(tokenizer: Tokenizer, kind: str, source: str, make: Any) -> Grammar:
    key = (kind, source)
    with _LOCK:
        cache = _GRAMMARS.setdefault(tokenizer, OrderedDict())
        g = cache.get(key)
        if g is not None:
            cache.move_to_end(key)
            return g
    vocab = _vocab(tokenizer)
    llg = _llg()
    try:
        compiled = make(llg)
    except ValueError as e:
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {e}") from None
    err = llg.LLMatcher.validate_grammar(compiled, vocab.ll)
    if err:
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {_one_line(err)}")
    g = Grammar(kind, source, vocab, compiled)
    with _LOCK:
        cache[key] = g
        while len(cache) > CACHE_PER_TOKENIZER:
            cache.popitem(last=False)
    return g


def _one_line(err: str) -> str:
    """llguidance's message on one line: where, and the parser's `error:` line (it draws carets
    under the spec on the lines between)."""
    lines = err.splitlines()
    why = next((x.strip().removeprefix("error:").strip() for x in lines if x.strip().startswith("error:")), None)
    head = lines[0].removesuffix(":").removesuffix(" regex parse error").rstrip(": ") if lines else err
    return f"{head}: {why}" if why else head


def json_object(tokenizer: Tokenizer) -> Grammar:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema(tokenizer, {"type": "object"})


def json_schema(tokenizer: Tokenizer, schema: dict | str) -> Grammar:
    """Text that parses as JSON and validates against `schema` (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"invalid JSON schema: a schema is a JSON object, got {type(schema).__name__}")
    source = json.dumps(schema, ensure_ascii=False)  # (key order kept: properties come in schema order)
    return _compile(tokenizer, "json_schema", source, lambda llg: llg.LLMatcher.grammar_from_json_schema(
        source, defaults=JSON_STYLE))


def regex(tokenizer: Tokenizer, pattern: str) -> Grammar:
    """Text that matches `pattern` whole (Rust regex syntax: docs.rs/regex)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("invalid regex: give a non-empty pattern")
    return _compile(tokenizer, "regex", pattern, lambda llg: llg.LLMatcher.grammar_from_regex(pattern))


def choice(tokenizer: Tokenizer, choices: list[str]) -> Grammar:
    """Exactly one of `choices` (as vLLM's guided_choice)."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("invalid choice: give a non-empty list of non-empty strings")
    source = json.dumps(list(choices), ensure_ascii=False)
    return _compile(tokenizer, "choice", source, lambda llg: llg.grammar_from("choice", source))
