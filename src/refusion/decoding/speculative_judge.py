"""The verify pass of a speculative step (speculative.py): which fed draft tokens the causal
predictions accept, the token each row commits after them, the masks' next draft, and how far each
fed branch went. Everything here runs on the device, batched over rows and columns; the host sees
its results in the step's one transfer."""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.decoding.sampling import RowSampling, draw, greedy, position_uniforms
from refusion.decoding.speculative_seq import SpeculativeSeq


def judge(seqs: list[SpeculativeSeq], logits: Tensor, ids: Tensor, own: Tensor, anchor: Tensor, k: Tensor,
          seed: Tensor, g: Tensor, branches: Tensor | None = None, L: int = 0
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row: j (accepted draft tokens), the extra token, every column's draft token (the
    masks' ones are the next draft): its argmax, or with sampled_drafts its position-keyed draw;
    and per branch [B, S] how many of its tokens were accepted after the draft's first j (0 unless
    it was tested, j being its fork); the extra token follows the one that went furthest (the
    first of them). logits/ids: the last N fed columns; own: each column's response position; the
    anchor column predicts response position g, each draft column after it the next one, each
    mask its own. branches [3, B, S]: each row's branches' first column, fork and length (0: none;
    L the longest); a branch's first token is predicted by the column of the draft's token at the
    fork and each other by the column before it."""
    B, N, _ = logits.shape
    want, drafts, probs = _wanted(seqs, logits, own, anchor, k, seed, g, branches)
    taus = [q.p.accept_prob for q in seqs]
    tau = (torch.tensor([t if t is not None else 2.0 for t in taus], device=logits.device)[:, None]
           if any(t is not None for t in taus) else None)  # (accept_prob: a lossy opt-in)
    col = torch.arange(N, device=logits.device)[None, :]
    nxt = ids[:, 1:]  # the token fed after column t, which column t's logits predict
    ok = nxt == want[:, :-1]
    if tau is not None:
        ok |= _prob(logits, probs, col[:, :-1].expand(B, N - 1), nxt) >= tau
    a = anchor[:, None]
    c = col[:, :-1]
    run = torch.where(c < a, True, torch.where(c < a + k[:, None], ok, False))
    j = run.long().cumprod(1).sum(1) - anchor
    extra = want.gather(1, (anchor + j)[:, None]).squeeze(1)  # the column after the accepted drafts
    if branches is None:
        return j, extra, drafts, j.new_zeros(B, 0)
    first, fork, n = branches  # [B, S] each
    S = first.shape[1]
    i = torch.arange(L, device=logits.device)[None, None, :]
    slot = (first[:, :, None] + i).clamp(max=N - 1)  # [B, S, L]
    parent = torch.where(i == 0, (anchor[:, None] + fork)[:, :, None], slot - 1).reshape(B, S * L)
    tok = ids.gather(1, slot.reshape(B, S * L))
    ok2 = tok == want.gather(1, parent)
    if tau is not None:
        ok2 |= _prob(logits, probs, parent, tok) >= tau
    went = (ok2.view(B, S, L) & (i < n[:, :, None])).long().cumprod(2).sum(2) * ((n > 0) & (j[:, None] == fork))
    best, which = went.max(1)
    last = (first.gather(1, which[:, None]).squeeze(1) + best - 1).clamp(min=0)
    extra = torch.where(best > 0, want.gather(1, last[:, None]).squeeze(1), extra)
    return j, extra, drafts, went


def _wanted(seqs: list[SpeculativeSeq], logits: Tensor, own: Tensor, anchor: Tensor, k: Tensor, seed: Tensor,
            g: Tensor, branches: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The token each column's prediction commits [B, N] (the argmax, or a sampled row's position-keyed
    draw), each column's draft token [B, N], and the sampled rows' filtered distributions (None when
    no row samples)."""
    amax = greedy(logits)
    sampling = [q.p.temperature > 0 for q in seqs]
    if not any(sampling):
        return amax, amax, None
    dev = logits.device
    probs = RowSampling.of([q.p for q in seqs], dev).probs(logits)
    # the position each column's draw is for: the next one up to the last draft token, then
    # the masks' own (the uniforms the output at those positions will be drawn with)
    col = torch.arange(logits.shape[1], device=dev)[None, :]
    a = anchor[:, None]
    target = own  # a mask's own position; the anchor's is g, a draft's or a branch's the next
    if branches is not None:
        c3, first, n = col[:, :, None], branches[0][:, None, :], branches[2][:, None, :]
        target = torch.where(((c3 >= first) & (c3 < first + n)).any(-1), own + 1, own)
    target = torch.where(col <= a + k[:, None], g[:, None] + col - a, target)
    tok = draw(probs, position_uniforms(seed, target.clamp(min=0)))
    want = torch.where(torch.tensor(sampling, device=dev)[:, None], tok, amax)
    sampled = [s and q.p.sampled_drafts for q, s in zip(seqs, sampling, strict=True)]
    drafts = torch.where(torch.tensor(sampled, device=dev)[:, None], tok, amax) if any(sampled) else amax
    return want, drafts, probs


def _prob(logits: Tensor, probs: Tensor | None, parent: Tensor, tok: Tensor) -> Tensor:
    """The probability [B, M] that column parent[b, m]'s prediction gives token tok[b, m]: under the
    sampled distribution where rows sample, else the softmax of the logits."""
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    if probs is None:
        return (logits[rows, parent, tok] - logits.logsumexp(-1).gather(1, parent)).exp()
    return probs[rows, parent, tok]
