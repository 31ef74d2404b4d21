"""Committed tokens -> the text an ordinary client sees, in position order, with stop strings.

Decoders commit tokens out of order (plan-and-infill fills slots anywhere in the block). OpenAI's
`content` stream is left to right, so text is released only for the complete prefix: the tokens
from the first response position up to the first position not yet committed. Two things are held
back at the end of that prefix: an incomplete UTF-8 character (a byte-level token can end inside
one, and decodes to U+FFFD until the rest arrives) and anything that could still grow into a stop
string. Everything from a stop string on is dropped, and the request can end there.
"""

from __future__ import annotations

from refusion.model.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tok: Tokenizer, prompt_len: int, eos_ids: list[int], stop: list[str]) -> None:
        self.tok, self.start, self.eos, self.stop = tok, prompt_len, set(eos_ids), list(stop)
        self.committed: dict[int, int] = {}
        self.prefix: list[int] = []  # tokens of the complete prefix, EOS excluded
        self.ended = False  # the prefix reached an EOS
        self.stopped = False  # a stop string was found
        self.sent = ""  # text released so far
        self.tokens_at_stop: int | None = None  # prefix tokens up to the end of the stop string

    def add(self, positions: list[int], tokens: list[int]) -> str:
        """Record commits; return the newly releasable text (may be empty)."""
        for q, t in zip(positions, tokens):
            self.committed[q] = t
        if self.ended or self.stopped:
            return ""
        grown = False
        while (q := self.start + len(self.prefix)) in self.committed:
            t = self.committed[q]
            if t in self.eos:
                self.ended = True
                break
            self.prefix.append(t)
            grown = True
        if not grown and not self.ended:
            return ""
        return self._release(final=self.ended)

    def finish(self) -> str:
        """The decoder is done: release what was held back."""
        if self.stopped:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.tok.decode(self.prefix)
        hit = self._stop_at(text)
        if hit is not None:
            cut, end = hit
            self.stopped = True
            self.tokens_at_stop = self._tokens_covering(end)
            text = text[:cut]
        elif not final:
            text = text.rstrip("\ufffd")  # an incomplete character: wait for its other bytes
            text = text[: len(text) - self._partial_stop(text)]
        if not text.startswith(self.sent):
            # detokenizers can rewrite earlier text when later tokens arrive (rare); never
            # retract what a client already has, only append
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _stop_at(self, text: str) -> tuple[int, int] | None:
        """(where the first stop string starts, where it ends) or None."""
        hits = [(i, i + len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _tokens_covering(self, chars: int) -> int:
        # the fewest prefix tokens whose text reaches `chars` characters (usage counts these)
        for n in range(len(self.prefix) + 1):
            if len(self.tok.decode(self.prefix[:n])) >= chars:
                return n
        return len(self.prefix)
