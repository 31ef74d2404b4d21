"""Counts what `speculative --fork` did, so that a test of its output can also show the branches were
used: steps that fed a branch, those that fed two or more, and those a branch went further in."""

from __future__ import annotations

import pytest

from refusion.decoding import speculative as spec


def count_forks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Wraps SpeculativeSeq.advance (behaviour unchanged) and returns the counts it keeps up to date."""
    seen = dict(fed=0, several=0, won=0)
    plain = spec.SpeculativeSeq.advance

    def advance(self, j, extra, mask_preds, redrafted=None, branch=None, **kw):
        seen["fed"] += len(self.fed_branches) > 0
        seen["several"] += len(self.fed_branches) > 1
        seen["won"] += branch is not None
        plain(self, j, extra, mask_preds, redrafted, branch, **kw)

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", advance)
    return seen
