"""Drafts from a corpus of the model's own answers: what the model usually writes after the last
few tokens of a sequence, found in text it wrote before (retrieval drafting, with no forward).

A model's greedy answers repeat its habits ("Let's break this down step by step", the shape of a
docstring it fills), so a phrase it wrote once in answer to other prompts is a draft of what it
writes now. The corpus is the recipe's self-generated answers to training prompts (never a test
split), kept next to the model as LOOKUP_CORPUS (token ids, answers separated by -1). It is indexed
when loaded: for each suffix length n in CORPUS_NGRAMS, every n-gram of the corpus maps to the
occurrence whose next token is the one that most often follows it (the latest such occurrence),
and a draft is the tokens from there to its answer's end. Like every draft it is verified, so it
never changes an output; the speculative decoder offers it beside the prompt-lookup copy and the
masks' draft, counted under its own kind per match length (widths.corpus_kind), when `lookup` is on.

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
_P = np.uint64(1_000_003)  # the n-gram hash's multiplier (arithmetic modulo 2**64)
_MASK = (1 << 64) - 1


def _hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & _MASK
    return h


class LookupCorpus:
    """The n-gram index of a token corpus (one array: answers separated by -1)."""

    def __init__(self, tokens: np.ndarray, ngrams: tuple[int, ...] = CORPUS_NGRAMS) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.keys: dict[int, np.ndarray] = {}  # n -> sorted n-gram hashes
        self.starts: dict[int, np.ndarray] = {}  # n -> where the chosen continuation of each begins
        for n in self.ngrams:
            self.keys[n], self.starts[n] = self._index(n)

    def _index(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.tokens
        m = len(t) - n  # n-grams starting at 0..m-1, each followed by a token
        if m <= 0:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        h = np.zeros(m, np.uint64)
        bad = np.zeros(m, bool)
        for j in range(n):  # (uint64 arithmetic wraps: the hash is modulo 2**64)
            seg = t[j:j + m]
            h = h * _P + (seg + 1).astype(np.uint64)
            bad |= seg < 0
        nxt = t[n:n + m]
        ok = np.flatnonzero(~bad & (nxt >= 0))
        if not len(ok):
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        keys, nexts, starts = h[ok], nxt[ok], ok + n
        # runs of equal (key, next token), each run's occurrences in order: the latest one ends it
        order = np.lexsort((starts, nexts, keys))
        keys, nexts, starts = keys[order], nexts[order], starts[order]
        ends = np.flatnonzero(np.r_[(keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1]), True])
        counts = np.diff(np.r_[-1, ends])
        # per key, the run with the most occurrences (a tie: the larger next token id, to be deterministic)
        by = np.lexsort((counts, keys[ends]))
        last = np.r_[keys[ends][by][1:] != keys[ends][by][:-1], True]
        chosen = ends[by[last]]
        return keys[chosen], starts[chosen]

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens the corpus continues the longest suffix of `history` it holds with, that
        suffix's length), or ([], 0). A continuation stops at its answer's end."""
        t = self.tokens
        for n in self.ngrams:
            if len(history) < n or not len(self.keys[n]):
                continue
            suffix = history[-n:]
            h = np.uint64(_hash(suffix))
            keys = self.keys[n]
            i = int(np.searchsorted(keys, h))
            if i == len(keys) or keys[i] != h:
                continue
            s = int(self.starts[n][i])
            if t[s - n:s].tolist() != list(suffix):  # (a hash collision: not this n-gram)
                continue
            draft = t[s:s + k].tolist()
            if -1 in draft:
                draft = draft[:draft.index(-1)]
            return draft, n
        return [], 0


def write_corpus(directory: str | Path, answers: Sequence[Sequence[int]]) -> Path:
    """Keep `answers` (token ids) as the lookup corpus of the model or adapter in `directory`."""
    import torch
    from safetensors.torch import save_file

    from refusion.model.checkpoint import LOOKUP_CORPUS

    flat = [t for a in answers for t in (*a, -1)]
    if any(t < -1 for t in flat):
        raise ValueError("corpus token ids must be >= 0")
    path = Path(directory) / LOOKUP_CORPUS
    tmp = path.with_suffix(".tmp")
    save_file({"tokens": torch.tensor(flat, dtype=torch.int32)}, str(tmp), metadata={"answers": str(len(answers))})
    tmp.chmod(0o644)  # (the file ships with a model: readable like its weights)
    tmp.replace(path)
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
