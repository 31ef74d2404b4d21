"""Token log-probabilities in OpenAI's two shapes.

Chat: `choices[].logprobs.content[]`, one entry per token: `token` (its text), `logprob`, `bytes`
(its UTF-8 bytes: a byte-level token can hold part of a character, whose text is then U+FFFD) and
`top_logprobs` (the k most likely tokens there, each with token, logprob and bytes).

Completions: `choices[].logprobs` with parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(per token a {text: logprob} object of the k most likely tokens and the chosen one, so up to k + 1
entries, as OpenAI documents) and `text_offset` (where each token's text starts in the choice's
text). With echo the prompt's tokens come first, the very first with null logprob and alternatives.

Token texts keep special tokens (an alternative may be <|im_end|>), unlike the answer's text. A
token the distribution excludes (a grammar's mask, a top-p cut) has logprob -inf, which JSON cannot
hold: it is sent as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from refusion.model.tokenizer import Tokenizer

Top = Sequence[tuple[int, float]]
FLOOR = -9999.0  # a logprob of -inf in JSON (OpenAI's value)


def _num(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR


@functools.cache
def _byte_decoder() -> dict[str, int]:
    # the printable stand-ins byte-level BPE vocabularies spell bytes with (GPT-2's table)
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Each token id's text and bytes for one tokenizer (cached: the same tokens come back often)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        decoder = tok.tok.decoder
        self.byte_level = decoder is not None and type(decoder).__name__ == "ByteLevel"
        self.special = set(tok.special_roles()) | {i for i, t in tok.tok.get_added_tokens_decoder().items()
                                                   if t.special}
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = functools.lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def _bytes(self, t: int) -> list[int]:
        piece = self.tok.tok.id_to_token(t)
        if piece is not None and self.byte_level and t not in self.special:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
        return list(self._text(t).encode("utf-8"))

    # ---- the two shapes -------------------------------------------------------------------

    def chat(self, tokens: Sequence[int], chosen: Sequence[float], top: Sequence[Top]) -> list[dict]:
        """Chat's `content` entries for answer tokens."""
        return [{"token": self.text(t), "logprob": _num(lp), "bytes": self.bytes(t),
                 "top_logprobs": [{"token": self.text(a), "logprob": _num(alp), "bytes": self.bytes(a)}
                                  for a, alp in alts]}
                for t, lp, alts in zip(tokens, chosen, top, strict=True)]

    def completion(self, tokens: Sequence[int], chosen: Sequence[float | None], top: Sequence[Top | None],
                   offset: int) -> tuple[dict, int]:
        """Completions' parallel lists for these tokens, their text starting at `offset` in the
        choice's text; and the offset after them. A None logprob (the prompt's first token) has
        null alternatives."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, alts in zip(tokens, chosen, top, strict=True):
            text = self.text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _num(lp))
            if lp is None:
                out["top_logprobs"].append(None)
            else:
                d: dict[str, float] = {}
                for a, alp in [*alts, (t, lp)]:
                    d[self.text(a)] = max(_num(alp), d.get(self.text(a), FLOOR))
                out["top_logprobs"].append(d)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset


def merge_completion(a: dict | None, b: dict) -> dict:
    """Two completions logprob objects one after the other (echo's prompt part, then the answer)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
