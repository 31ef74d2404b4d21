"""Drafts from earlier text (prompt lookup): the tokens that followed the latest earlier occurrence
of a sequence's last few tokens, in its prompt or its own answer so far.

Answers copy from their context (a number from the question, a name from the code they complete,
a line they wrote before), and a copied span is drafted here for free, with no forward, right after
a rejection too, where the masks' draft was made beside a token that was not committed. The
speculative decoder verifies these drafts like the masks' ones, so they never change an output;
SpeculativeSeq feeds whichever of the two drafts it expects to be accepted further.
"""

from __future__ import annotations

from collections.abc import Iterable

from refusion.model.config import ModelConfig

LOOKUP_NGRAMS = (4, 3, 2, 1)  # suffix lengths tried, longest first (longer matches are accepted further)


def lookup_by_default(config: ModelConfig) -> bool:
    """Whether `speculative` drafts by lookup when not told: for a mask-adapted model. Its masks draft
    from a base that never learned to, so they are accepted less far than copies of earlier text
    (README "SmolLM2 with drafts"); a model trained with the ReFusion objective drafts further with
    its masks alone, and lookup costs it a little (README "Width policies")."""
    return config.mask_adapter is not None


class NgramIndex:
    """A token history with, for each n-gram of the lengths in `ngrams`, where the tokens after its
    latest occurrence begin. Extended as tokens are committed: each new token completes one
    occurrence per length (the n-gram just before it), so upkeep is a few dict writes per token."""

    def __init__(self, tokens: Iterable[int] = (), ngrams: tuple[int, ...] = LOOKUP_NGRAMS) -> None:
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        h, after = self.tokens, self.after
        for t in tokens:
            i = len(h)  # t's index: the n-grams ending just before it now have a continuation
            for n in self.ngrams:
                if i >= n:
                    after[tuple(h[i - n:i])] = i
            h.append(t)

    def propose(self, k: int) -> tuple[list[int], int]:
        """(k tokens that followed the latest earlier occurrence of the longest suffix that occurred
        before, that suffix's length), or ([], 0) when none did. The suffix itself is never its own
        match: its continuation is not written yet. A continuation that reaches the end of the text
        goes on as the repetition it is part of (after "a b c a b", "a b" continues "c a b c ...")."""
        h = self.tokens
        for n in self.ngrams:
            if len(h) > n:
                start = self.after.get(tuple(h[-n:]))
                if start is not None:
                    copy = h[start:start + k]
                    if len(copy) < k:  # the copy runs into the suffix: the text repeats with period len(copy)
                        copy = (copy * (k // len(copy) + 1))[:k]
                    return copy, n
        return [], 0
