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
ALTERNATIVE_LOOK = 16  # occurrences of a suffix read for alternatives() (a common one may have hundreds)
# how far the text backs a copy (NgramIndex.support): its suffix occurred once before; or several times,
# and their continuations agree on no token (split), on one, on two or three, or on four and more
# (agreed). Counted apart (widths.lookup_kind) because they are accepted very differently: a copy is
# accepted far more often up to where the earlier continuations part than past it (measured on
# SmolLM2's answers; docs/speculative.md, "Draft sources and Python-only options")
COPY_AGREED, COPY_ONCE, COPY_SPLIT, COPY_AGREED_1, COPY_AGREED_2 = 0, 1, 2, 3, 4
COPY_SUPPORTS = 5


def lookup_by_default(config: ModelConfig) -> bool:
    """Whether `speculative` drafts by lookup when not told: for a mask-adapted model. Its masks draft
    from a base that never learned to, so they are accepted less far than copies of earlier text
    (docs/smollm2.md); a model trained with the ReFusion objective drafts further with its masks
    alone, and lookup costs it a little (docs/speculative.md, "Draft sources and Python-only options")."""
    return config.mask_adapter is not None


class NgramIndex:
    """A token history with, for each n-gram of the lengths in `ngrams`, where the tokens after its
    latest occurrence begin. Extended as tokens are committed: each new token completes one
    occurrence per length (the n-gram just before it), so upkeep is a few dict writes per token."""

    def __init__(self, tokens: Iterable[int] = (), ngrams: tuple[int, ...] = LOOKUP_NGRAMS) -> None:
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        # (n, where a continuation begins) -> where the one after the same n-gram's previous occurrence
        # begins: each n-gram's occurrences, latest first, for alternatives()
        self.earlier: dict[tuple[int, int], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        h, after, earlier = self.tokens, self.after, self.earlier
        for t in tokens:
            i = len(h)  # t's index: the n-grams ending just before it now have a continuation
            for n in self.ngrams:
                if i >= n:
                    key = tuple(h[i - n:i])
                    before = after.get(key)
                    if before is not None:
                        earlier[n, i] = before
                    after[key] = i
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
                    return self._copy(start, k), n
        return [], 0

    def agreement(self, n: int, k: int = 4, look: int = ALTERNATIVE_LOOK) -> tuple[int, int]:
        """(how many earlier occurrences of the last n tokens were read, their latest `look`; how many
        leading tokens, up to k, the continuations of those agree on: k where there was one)."""
        h = self.tokens
        start = self.after.get(tuple(h[-n:]))
        if start is None:
            raise ValueError(f"the last {n} tokens occurred nowhere before: no copy to support")
        starts = [start]
        while len(starts) < look and (start := self.earlier.get((n, start))) is not None:
            starts.append(start)
        conts = [self._copy(s, k) for s in starts]
        return len(starts), next((i for i in range(k) if any(c[i] != conts[0][i] for c in conts)), k)

    def support(self, n: int, look: int = ALTERNATIVE_LOOK) -> int:
        """How far the text backs propose()'s copy, found by matching the last n tokens: COPY_ONCE where
        those n tokens occurred once before, else by how many leading tokens the continuations of their
        latest `look` earlier occurrences agree on: COPY_SPLIT none, COPY_AGREED_1 one, COPY_AGREED_2
        two or three, COPY_AGREED four or more."""
        seen, d = self.agreement(n, 4, look)
        if seen == 1:
            return COPY_ONCE
        return COPY_SPLIT if d == 0 else COPY_AGREED_1 if d == 1 else COPY_AGREED_2 if d < 4 else COPY_AGREED

    def _copy(self, start: int, k: int) -> list[int]:
        copy = self.tokens[start:start + k]
        if len(copy) < k:  # the copy runs into the suffix: the text repeats with period len(copy)
            copy = (copy * (k // len(copy) + 1))[:k]
        return copy

    def alternatives(self, k: int, most: int, look: int = ALTERNATIVE_LOOK) -> list[list[int]]:
        """Up to `most` other copies, each of k tokens and each beginning with a token that neither
        propose()'s copy nor an earlier alternative begins with: what followed the earlier occurrences
        of the same longest suffix (latest first), then of the shorter ones (at most `look` of each
        suffix's occurrences are read). Where the text has gone two ways after the same words, the
        way it did not take last time is the next best guess (fed as a branch: SpeculativeParams.fork)."""
        h, out, seen = self.tokens, [], set()
        for n in self.ngrams:
            if len(h) <= n:
                continue
            start = self.after.get(tuple(h[-n:]))
            for _ in range(look):
                if start is None:
                    break
                first = h[start] if start < len(h) else None
                if first not in seen:
                    if seen:  # (the first one met is propose()'s copy)
                        out.append(self._copy(start, k))
                        if len(out) == most:
                            return out
                    seen.add(first)
                start = self.earlier.get((n, start))
        return out
