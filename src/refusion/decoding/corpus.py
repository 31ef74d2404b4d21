"""Drafts from a corpus of the model's own answers: what the model usually writes after the last
few tokens of a sequence, found in text it wrote before (retrieval drafting, with no forward).

A model's greedy answers repeat its habits ("Let's break this down step by step", the shape of a
docstring it fills), so a phrase it wrote once in answer to other prompts is a draft of what it
writes now. The corpus is the recipe's self-generated answers to training prompts (never a test
split), kept next to the model as LOOKUP_CORPUS (token ids, answers separated by -1). It is indexed
when loaded: for each suffix length n in CORPUS_NGRAMS, every occurrence of every n-gram (sorted by
hash, found with searchsorted). A draft follows the longest suffix of the sequence the corpus
holds, by vote, token by token: among that n-gram's occurrences (its latest MAX_VOTES), the token
that most of them continue with (a tie: the larger id), then among the occurrences that agree so
far the most frequent next one, until most of them reach their answer's end or fewer than
MIN_SHARE of them agree on the next token (a suffix-tree draft,
as in SuffixDecoding, arXiv 2411.04975, without the tree: the occurrences are the tree's paths).
Following one occurrence instead drafts its quirks too; the vote keeps what the model usually
writes. Like every draft it is verified, so it never changes an output; the speculative decoder
offers it beside the prompt-lookup copy and the masks' draft, counted under its own kind per match
length (widths.corpus_kind), when `lookup` is on.

    write_corpus(model_dir, [tokenizer.encode(answer) for answer in answers])
    corpus = corpus_of(model)          # the model's directory's corpus, indexed once (None: none there)
    draft, n = corpus.propose(history, 8)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

CORPUS_NGRAMS = (6, 5, 4, 3, 2, 1)  # suffix lengths tried, longest first
MAX_VOTES = 512  # occurrences of an n-gram that vote on its continuation: its latest ones (a common one has thousands)
# a draft stops before a token fewer than this share of the occurrences still voting continue with: the
# model writes such a token far less often than one most of them agree on (SmolLM2: under a quarter of the
# time below half of them, against two thirds and more above 0.7)
MIN_SHARE = 0.5
_P = np.uint64(1_000_003)  # the n-gram hash's multiplier (arithmetic modulo 2**64)
_MASK = (1 << 64) - 1
# the index keeps a hash's top bits only, so it is first multiplied by this odd constant (2**64 over the
# golden ratio), which spreads every bit of a short n-gram's small hash into them and maps no two apart
_SPREAD = np.uint64(0x9E3779B97F4A7C15)


def _hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & _MASK
    return h


class LookupCorpus:
    """The n-gram index of a token corpus (one array: answers separated by -1)."""

    def __init__(self, tokens: np.ndarray, ngrams: tuple[int, ...] = CORPUS_NGRAMS, min_share: float = MIN_SHARE) -> None:
        self.min_share = min_share
        self.tokens = np.asarray(tokens, dtype=np.int64)
        if not len(self.tokens) or self.tokens[-1] != -1:  # (every continuation stops at a -1: _vote)
            self.tokens = np.append(self.tokens, -1)
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        # each n-gram occurrence is one uint64: its hash's top bits, then where it starts. One plain sort
        # then orders them by hash and, within a hash, by place in the corpus, several times faster than
        # a stable argsort of the hashes (the index is built whenever a model with a corpus is loaded)
        self.place_bits = max(1, int(len(self.tokens)).bit_length())
        self.keys: dict[int, np.ndarray] = {}  # n -> sorted (hash high bits | start) of every n-gram followed by a token
        self._build()

    def _build(self) -> None:
        t, b = self.tokens, np.uint64(self.place_bits)
        h = np.zeros(len(t), np.uint64)  # h[i]: the hash of the n tokens from i, for n = 1, 2, ... in turn
        bad = np.zeros(len(t), bool)
        for n in range(1, max(self.ngrams) + 1):
            m = len(t) - n  # n-grams starting at 0..m-1, each followed by a token
            if m <= 0:
                break
            seg = t[n - 1:n - 1 + m]
            h, bad = h[:m] * _P + (seg + 1).astype(np.uint64), bad[:m] | (seg < 0)
            if n in self.ngrams:
                ok = np.flatnonzero(~bad & (t[n:n + m] >= 0)).astype(np.uint64)
                self.keys[n] = np.sort((h[ok] * _SPREAD) >> b << b | ok)
        for n in self.ngrams:
            self.keys.setdefault(n, np.zeros(0, np.uint64))

    def occurrences(self, history: Sequence[int]) -> tuple[np.ndarray, int]:
        """Where the continuations of the longest suffix of `history` the corpus holds begin (its
        latest MAX_VOTES occurrences), and that suffix's length; (empty, 0) where none is held."""
        t = self.tokens
        low = np.uint64((1 << self.place_bits) - 1)
        for n in self.ngrams:
            keys = self.keys[n]
            if len(history) < n or not len(keys):
                continue
            suffix = np.asarray(history[-n:], dtype=np.int64)
            h = np.uint64((_hash(suffix.tolist()) * int(_SPREAD) & _MASK) >> self.place_bits << self.place_bits)
            lo, hi = int(np.searchsorted(keys, h, "left")), int(np.searchsorted(keys, h | low, "right"))
            at = (keys[max(lo, hi - MAX_VOTES):hi] & low).astype(np.int64)  # (its latest occurrences)
            at = at[(t[at[:, None] + np.arange(n)] == suffix).all(1)] + n  # (a hash collision: not this n-gram)
            if len(at):
                return at, n
        return np.zeros(0, np.int64), 0

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens the corpus most often continues the longest suffix of `history` it holds
        with, voted token by token, that suffix's length), or ([], 0)."""
        return self.offer(history, k)[:2]

    def offer(self, history: Sequence[int], k: int) -> tuple[list[int], int, bool]:
        """propose()'s draft and suffix length, and whether its first token was contested: fewer than
        min_share of the occurrences voting continue with it (it is kept whatever its share, _vote;
        such a draft goes a quarter as far as one most of them agree on, or less, on SmolLM2's answers:
        widths.corpus_kind counts it apart)."""
        at, n = self.occurrences(history)
        if not n:
            return [], 0, False
        draft = self._vote(at, k)
        contested = bool(draft) and len(at) > 1 and int((self.tokens[at] == draft[0]).sum()) < self.min_share * len(at)
        return draft, n, contested

    def runner_up(self, history: Sequence[int], draft: Sequence[int], k: int) -> list[int]:
        """Another draft of up to k tokens for the same place as `draft` (propose()'s): where the voting
        occurrences first part within the draft, the next most frequent token instead of the draft's,
        and then the vote of the occurrences that continue with it; [] where they never part there."""
        at, n = self.occurrences(history)
        t = self.tokens
        for j, d in enumerate(draft):
            if len(at) < 2:
                return []
            nxt = t[at + j]
            if not (nxt == d).all():
                values, counts = np.unique(nxt[(nxt != d) & (nxt >= 0)], return_counts=True)
                if not len(values):
                    return []
                v = int(values[len(counts) - 1 - int(counts[::-1].argmax())])  # (a tie: the larger value)
                return list(draft[:j]) + [v] + self._vote(at[nxt == v] + j + 1, k - j - 1)
            at = at[nxt == d]
        return []

    def _vote(self, at: np.ndarray, k: int) -> list[int]:
        """The draft from occurrences whose continuations begin at `at`: at each position the most
        frequent next token among those that agree so far (-1, an answer's end, counts as a vote to
        stop), while at least min_share of them agree on it (the first token whatever its share)."""
        t, draft = self.tokens, []
        for j in range(k):
            if len(at) == 1:  # one occurrence left: the rest of its answer
                rest = t[at[0] + j: at[0] + k].tolist()
                return draft + (rest[:rest.index(-1)] if -1 in rest else rest)
            nxt = t[at + j]  # (never past the end: the corpus ends with -1, where every continuation stops)
            if (nxt == nxt[0]).all():  # (unanimous, the usual case: no count needed)
                win = int(nxt[0])
            else:
                values, counts = np.unique(nxt, return_counts=True)
                i = len(counts) - 1 - int(counts[::-1].argmax())  # (a tie: the larger value)
                if j and counts[i] < self.min_share * len(nxt):  # (the first token is worth a try: it costs
                    break  # next to nothing, and without it a step may feed no draft at all)
                win = int(values[i])
            if win < 0:
                break
            draft.append(win)
            at = at[nxt == win]
        return draft


def write_corpus(directory: str | Path, answers: Sequence[Sequence[int]]) -> Path:
    """Keep `answers` (token ids) as the lookup corpus of the model or adapter in `directory`."""
    import torch
    from safetensors.torch import save_file

    from refusion.files import atomic
    from refusion.model.checkpoint import LOOKUP_CORPUS

    flat = [t for a in answers for t in (*a, -1)]
    if any(t < -1 for t in flat):
        raise ValueError("corpus token ids must be >= 0")
    path = Path(directory) / LOOKUP_CORPUS
    with atomic(path) as tmp:  # a full disk: one line, and no half-written corpus
        save_file({"tokens": torch.tensor(flat, dtype=torch.int32)}, str(tmp), metadata={"answers": str(len(answers))})
        tmp.chmod(0o644)  # (the file ships with a model: readable like its weights)
    return path


def read_corpus(path: str | Path) -> LookupCorpus:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tokens = load_file(str(path))["tokens"]
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise ValueError(f"{path} is not a readable lookup corpus (a safetensors file with 'tokens'): {e}") from None
    return LookupCorpus(tokens)


_CORPORA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LookupCorpus or None


def corpus_of(model) -> LookupCorpus | None:
    """The lookup corpus kept in the directory `model` was loaded from (load_model sets
    model.directory), indexed on first use; None where there is none."""
    if model not in _CORPORA:
        from refusion.model.checkpoint import LOOKUP_CORPUS  # (here: `refusion --help` must not import torch)

        d = getattr(model, "directory", None)
        path = Path(d) / LOOKUP_CORPUS if d is not None else None
        _CORPORA[model] = read_corpus(path) if path is not None and path.is_file() else None
    return _CORPORA[model]
