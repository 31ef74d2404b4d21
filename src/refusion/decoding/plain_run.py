"""Plain AR steps of a speculative batch (speculative.py), run without its per-row bookkeeping.

While every row that steps is plain AR (SpeculativeSeq.plain: no drafts, no masks, no plan) and past
its prefill, a step needs none of the width policy, the feeds or the acceptance counts: each row
feeds its newest token x alone, at the position and cache column after its kept ones, and commits
the token its logits give. A PlainRun keeps those rows' state on the device (x, its column and
position, where the step writes, the attention mask of every step to come as views of one tensor)
and their tokens on the host, one transfer a step, until the batch writes them into the rows
(`write_back`): when one ends (EOS or gen_length), the batch changes or a generic step follows.
The forward, the mask and the draws are those a generic step makes for such rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from refusion.decoding.sampling import RowSampling, draw, greedy, position_uniforms
from refusion.decoding.speculative_seq import SpeculativeSeq
from refusion.model.cache import RaggedKVCache
from refusion.model.transformer import Transformer


class PlainRun:
    """The plain steps of a batch's rows 0..B-1 (`seqs`, in cache-row order) not yet written into them."""

    def __init__(self, model: Transformer, cache: RaggedKVCache, seqs: list[SpeculativeSeq]) -> None:
        dev = model.embed_tokens.weight.device
        self.model, self.cache = model, cache
        self.seqs, self.B = seqs, len(seqs)
        c = np.array([q.c for q in seqs])
        # x [B, 1] as fed; its column, and its position (the same number, kept apart: a compiled graph
        # would take one tensor passed as both for a shape of its own); one transfer for the three
        self.x, self.col, self.pos = torch.from_numpy(np.stack([[q.x for q in seqs], c, c])[:, :, None]).to(dev)
        self.cmax = int(c.max())
        self.capacity = cache.capacity
        self.index = cache.write_index(self.col) if self.B > 1 else None
        self.D = cache.head_dim
        self.g = np.array([len(q.res.tokens) for q in seqs])  # tokens committed before the run
        self.left = self.S = min(q.p.gen_length - len(q.res.tokens) for q in seqs)  # steps until one ends
        # step s's additive mask, 0 where a row sees (its kept columns and x's), is masks[..., S - s:][..., :used]:
        # column j seen at step s where j - s <= c (a view a step, no arithmetic)
        seen = np.arange(-self.S, self.capacity)[None, :] <= c[:, None]
        masks = np.where(seen, np.float32(0), np.float32(-np.inf))[:, None, None, :]
        self.masks = torch.from_numpy(masks).to(dev, model.embed_tokens.weight.dtype)
        self.tokens: list[np.ndarray] = []  # per step, each row's token [B, 1]
        # the rows streamed, in the order they joined (a removal moves the last row into its place)
        self.streamed = sorted((b for b, q in enumerate(seqs) if q.on_commit is not None), key=lambda b: seqs[b].sid)
        sampling = [q.p.temperature > 0 for q in seqs]
        self.sampling = any(sampling)
        if self.sampling:  # as speculative_judge's: the draw for response position t with the uniform of (seed, t)
            self.settings = RowSampling.of([q.p for q in seqs], dev)
            self.seed = torch.tensor([q.seed for q in seqs], device=dev)
            self.target = torch.tensor(self.g, device=dev)[:, None]  # the response position each row's token takes
            self.mixed = None if all(sampling) else torch.tensor(sampling, device=dev)[:, None]

    def step(self) -> np.ndarray:
        """One forward of every row; returns the tokens committed [B, 1] (on the host). Streamed rows
        hear of their token at once."""
        if self.B > 1 and self.capacity != self.cache.capacity:  # (rows joined, the cache grew: its layout moved)
            self.index = self.cache.write_index(self.col)
            self.capacity = self.cache.capacity
        s, used = len(self.tokens), self.cmax + 1
        # one row's column is a block copy; several rows' a scatter at the run's indices
        cache = self.cache.at(self.col, keys=used, first=self.cmax if self.B == 1 else None, index=self.index)
        out = self.model(self.x, self.pos, attn_mask=self.masks[:, :, :, self.S - s: self.S - s + used], cache=cache)
        tok = self._judge(out.float())
        host = tok.cpu().numpy()  # the step's one transfer
        self._advance(tok)
        self.tokens.append(host)
        for b in self.streamed:
            q = self.seqs[b]
            q.on_commit([q.P + int(self.g[b]) + s], [int(host[b, 0])])
        return host

    def write_back(self, eos: set[int]) -> None:
        """Write the steps run so far into their rows (tokens, positions, steps, counters, cache length,
        newest token; a row that ended is done)."""
        if not self.tokens:
            return
        n = len(self.tokens)
        tokens = np.concatenate(self.tokens, 1).tolist()
        self.tokens = []
        for q, t in zip(self.seqs, tokens, strict=True):
            res, g = q.res, len(q.res.tokens)
            res.tokens += t
            res.positions += range(q.P + g, q.P + g + n)
            res.steps += range(res.forwards, res.forwards + n)
            res.forwards += n
            res.tokens_fed += n
            q.c += n
            q.x = t[-1]
            if t[-1] in eos or len(res.tokens) >= q.p.gen_length:  # (an EOS ends a run: only the last)
                q.done, res.finished = True, t[-1] in eos

    def _advance(self, tok: Tensor) -> None:
        """After a step: each row's x is `tok`, one column on."""
        self.x, self.cmax, self.left = tok, self.cmax + 1, self.left - 1
        self.col += 1
        self.pos += 1
        if self.index is not None:
            self.index += self.D  # (the next column's elements)

    def _judge(self, logits: Tensor) -> Tensor:
        """Each row's token [B, 1] from its logits [B, 1, V]: the argmax, or a sampled row's position-keyed
        draw."""
        if not self.sampling:
            return greedy(logits)
        tok = draw(self.settings.probs(logits), position_uniforms(self.seed, self.target))
        self.target += 1
        return tok if self.mixed is None else torch.where(self.mixed, tok, greedy(logits))
