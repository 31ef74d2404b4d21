"""Drafts copied from the prompt's text where its tokens differ from the answer's: a grammar-controlled
row's second kind of copy (speculative decoding; offered beside lookup.py's token copies).

An answer that quotes its prompt inside a structure does not repeat the prompt's tokens: "Maria Lopez
lives in Madrid" holds ` Madrid`, the JSON value `"Madrid"` starts with `Mad`, `rid` (no space before
it, the quote merged away). lookup.py matches token n-grams and finds nothing there. This matches
bytes instead: the longest suffix of the answer's last bytes that occurs in the prompt (at least
MIN_MATCH), and drafts the prompt's bytes after its latest occurrence, tokenized afresh. The
verification checks these drafts like any other, so they never change an output.

It needs the tokenizer's bytes, which a row has where it holds a grammar (grammar.Grammar.text /
.tokens); rows without one draft by token copies only.
"""

from __future__ import annotations

from collections.abc import Callable

MIN_MATCH = 1  # byte: a short match is counted apart (widths.text_copy_kind), not refused
MAX_MATCH = 64  # bytes of the answer's end kept and matched (binary search over the suffix length)
BYTES_PER_TOKEN = 8  # bytes of continuation tokenized per draft token wanted (tokens average ~4)


class TextCopy:
    """One row's prompt bytes and its answer's last MAX_MATCH bytes; propose() drafts a copy."""

    def __init__(self, prompt: list[int], text: Callable[[list[int]], bytes],
                 tokens: Callable[[bytes], list[int]]) -> None:
        self._text, self._tokens = text, tokens
        self.source = text(prompt)
        self._searched = self.source[:-1]  # (an occurrence that ends the prompt has nothing to copy)
        self.tail = b""

    def extend(self, tokens: list[int]) -> None:
        if tokens:
            self.tail = (self.tail + self._text(tokens))[-MAX_MATCH:]

    def match(self) -> int:
        """The length of the longest suffix of the answer's tail found in the prompt with a byte after
        it (0: none of MIN_MATCH or more). A suffix that occurs has its shorter ones occur too, so a
        binary search finds it."""
        if len(self.tail) < MIN_MATCH or self.tail[-MIN_MATCH:] not in self._searched:
            return 0
        lo, hi = MIN_MATCH, len(self.tail)  # lo: a length known to occur, hi: the longest still possible
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.tail[-mid:] in self._searched:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens of the prompt's text after the latest occurrence of the answer's longest
        matching suffix, that suffix's length in bytes), or ([], 0)."""
        n = self.match()
        if n == 0 or k <= 0:
            return [], 0
        start = self._searched.rfind(self.tail[-n:]) + n
        cont = self.source[start:start + BYTES_PER_TOKEN * k]
        tokens = self._tokens(cont)
        if start + len(cont) < len(self.source) and len(tokens) > 1:
            tokens = tokens[:-1]  # (the cut may have split the last token: a shorter one than the text's)
        return tokens[:k], n
