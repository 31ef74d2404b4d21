"""Controls (controls.py) inside a speculative step: what a controlled row keeps between steps, and
what a step does to the causal logits of the positions it verifies and with the logprobs they give.

A step verifies, per row, the columns anchor, anchor + 1, ..., anchor + k (k draft tokens fed): column
anchor + i predicts the position after the committed tokens and the draft's first i. Its logits get
the row's bias, its penalties with the counts of the response so far and the draft's first i tokens,
and the grammar's mask in the state after those i tokens (the matcher advances over the draft to fill
one bitmask per column, then rolls back; it keeps only what is committed). So every column sees
exactly what AR decoding would at that position, and the verification's tokens are AR's.

Before the feed, a row's draft is cut where the grammar stops allowing it (a token the grammar
refuses could never be accepted), and wherever along it the grammar forces text (one way on: a
property's name, punctuation), that text's tokens take those positions in the draft (jump-forward;
the verification checks them like any draft). A draft that runs out where the grammar forces more
is extended by it.

Branches (fork) are off for controlled rows: a branch's tokens have a prefix of their own, which
the matcher and the counts would need a state for each. The work here is host-side per verified
position of a controlled row only; a step with no controlled row never enters this module.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from refusion.decoding.controls import Controls, Logprobs
from refusion.decoding.sampling import sampling_probs


class RowControl:
    """A controlled row's state: its grammar matcher (at the committed tokens) and its settings."""

    def __init__(self, controls: Controls, eos: set[int], vocab: int) -> None:
        self.c = controls
        self.matcher = controls.grammar.matcher() if controls.grammar is not None else None
        self.eos = eos
        self.eos_ids = np.array(sorted(t for t in eos if 0 <= t < vocab), dtype=np.int64)
        self.forced = 0  # tokens at the head of the draft the grammar forced (always fed)

    def prepare(self, draft: list[int], jump: bool, most: int) -> list[int]:
        """The draft to feed, at most `most` tokens: the draft's tokens while the grammar allows them,
        up to the first it refuses; and wherever the grammar forces text (jump), its tokens in the
        positions they take, in place of the draft's there."""
        m = self.matcher
        if m is None:
            self.forced = 0
            return draft
        out: list[int] = []
        self.forced = -1  # (until the first draft token: the forced tokens at the head)
        i = 0
        while len(out) < most:
            forced = m.forced() if jump else []
            if forced:
                forced = forced[: most - len(out)]
                m.accept_many(forced)
                out += forced
                i += len(forced)
                continue
            if self.forced < 0:
                self.forced = len(out)
            if i >= len(draft):
                break
            t = draft[i]
            if t in self.eos:
                if m.is_complete():
                    out.append(t)
                break
            if not m.accept(t):
                break
            out.append(t)
            i += 1
        if self.forced < 0:
            self.forced = len(out)
        m.rollback(sum(t not in self.eos for t in out))
        return out

    def ends_only(self) -> bool:
        """Whether the grammar allows nothing but the end here."""
        row = np.zeros((self.matcher.grammar.vocab_size + 31) // 32, dtype=np.int32)
        self.matcher.fill(row, np.zeros(0, dtype=np.int64))
        return not row.any()

    def fill(self, draft: list[int], rows: np.ndarray) -> None:
        """rows [k + 1, words]: the allowed tokens after the committed ones and each prefix of the
        fed draft (k = len(draft), every one allowed: prepare cut it)."""
        m = self.matcher
        for i in range(len(draft) + 1):
            m.fill(rows[i], self.eos_ids)
            if i < len(draft) and draft[i] not in self.eos:
                m.accept(draft[i])
        m.rollback(sum(t not in self.eos for t in draft))

    def commit(self, tokens: list[int], logprobs: Logprobs | None, room: int) -> tuple[list[int], Logprobs | None]:
        """Advance the matcher over committed tokens (an EOS ends the row: nothing follows it); their
        logprobs cut to them. Where the grammar then allows the end alone and the row ends at one EOS
        id, that EOS is committed too (room permitting): AR decoding would draw it with probability 1
        from its next forward, which this saves."""
        if logprobs is not None:
            logprobs = Logprobs(logprobs.chosen[: len(tokens)], logprobs.top[: len(tokens)])
        if self.matcher is None:
            return tokens, logprobs
        for t in tokens:
            if t in self.eos:
                return tokens, logprobs
            if not self.matcher.accept(t):  # (the verify pass masked every other token)
                raise RuntimeError(f"token {t} was committed where the grammar does not allow it")
        if len(self.eos_ids) == 1 and len(tokens) < room and self.matcher.is_complete() and self.ends_only():
            end = int(self.eos_ids[0])
            tokens = tokens + [end]
            if logprobs is not None:
                logprobs.chosen.append(0.0)
                logprobs.top.append([(end, 0.0)] if self.c.logprobs else [])
        return tokens, logprobs


def apply(seqs: list, rows: list[int], logits: Tensor, anchor: np.ndarray) -> tuple[Tensor, tuple | None]:
    """Apply the controls of seqs[b] for b in rows (each with q.control) to logits [B, N, V] at their
    verified columns (anchor[b] .. anchor[b] + q.fed_k, among the last N fed), in place. Returns the
    logits and, where a row asks for logprobs, what `logprobs` needs."""
    B, N, V = logits.shape
    dev = logits.device
    bi, ci, fed = [], [], []  # per verified column: its row and column; per row its draft tokens fed
    for b in rows:
        q = seqs[b]
        k = q.fed_k
        bi += [b] * (k + 1)
        ci += range(int(anchor[b]), int(anchor[b]) + k + 1)
        fed.append(k)
    R = len(bi)
    b_t, c_t = torch.tensor(bi, device=dev), torch.tensor(ci, device=dev)
    shaping = [seqs[b].control.c.shapes_logits for b in rows]
    if any(shaping):
        sub = logits[b_t, c_t]  # [R, V] (a copy)
        words = (V + 31) // 32
        bits = np.full((R, words), -1, dtype=np.int32)
        bias_r, bias_t, bias_v = [], [], []
        count_r, count_t = [], []
        pres, freq = np.zeros(R, dtype=np.float32), np.zeros(R, dtype=np.float32)
        r0 = 0
        for b, k in zip(rows, fed, strict=True):
            q = seqs[b]
            ctl = q.control
            draft = q.draft[:k]
            if ctl.matcher is not None:
                ctl.fill(draft, bits[r0: r0 + k + 1])
            if ctl.c.logit_bias:
                toks, vals = list(ctl.c.logit_bias), list(ctl.c.logit_bias.values())
                for i in range(k + 1):
                    bias_r += [r0 + i] * len(toks)
                    bias_t += toks
                    bias_v += vals
            if ctl.c.penalised:
                pres[r0: r0 + k + 1], freq[r0: r0 + k + 1] = ctl.c.presence_penalty, ctl.c.frequency_penalty
                for i in range(k + 1):  # the response before column i's position: committed, then draft[:i]
                    told = q.res.tokens + draft[:i]
                    count_r += [r0 + i] * len(told)
                    count_t += told
            r0 += k + 1
        if bias_r:
            sub.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                           torch.tensor(bias_v, device=dev, dtype=sub.dtype), accumulate=True)
        if count_r:
            counts = torch.zeros_like(sub)
            counts.index_put_((torch.tensor(count_r, device=dev), torch.tensor(count_t, device=dev)),
                              torch.ones(len(count_r), device=dev, dtype=sub.dtype), accumulate=True)
            p_t, f_t = torch.from_numpy(pres).to(dev)[:, None], torch.from_numpy(freq).to(dev)[:, None]
            sub -= p_t * (counts > 0) + f_t * counts
        if any(seqs[b].control.matcher is not None for b in rows):
            sub.masked_fill_(~unpack(torch.from_numpy(bits).to(dev), V), float("-inf"))
        logits[b_t, c_t] = sub
    wants = [seqs[b].control.c.logprobs for b in rows]
    if all(w is None for w in wants):
        return logits, None
    return logits, (b_t, c_t, wants)


def unpack(bits: Tensor, V: int) -> Tensor:
    """int32 bitmask words [R, W] -> bool [R, V] (bit t % 32 of word t // 32)."""
    shift = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[:, :, None] >> shift) & 1).bool().flatten(1)[:, :V]


def logprobs(seqs: list, rows: list[int], logits: Tensor, ids: Tensor, extra: Tensor, plan: tuple
             ) -> dict[int, Logprobs]:
    """Per row that asked: the logprobs of the tokens at its verified columns, from the distribution
    each was chosen from (controls.py), with the top alternatives; entry i is for the token column
    anchor + i commits (the draft's (i+1)-th where accepted, else the extra token). One transfer."""
    b_t, c_t, wants = plan
    sub = logits[b_t, c_t]  # [R, V], the controlled logits
    temps = [seqs[b].p.temperature for b in b_t.tolist()]
    if any(t > 0 for t in temps):
        qs = [seqs[b] for b in b_t.tolist()]
        dev = logits.device
        probs = sampling_probs(sub[:, None], torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev),
                               torch.tensor([q.p.top_k or 0 for q in qs], device=dev),
                               torch.tensor([q.p.top_p or 1.0 for q in qs], device=dev),
                               any(q.p.top_k is not None or q.p.top_p is not None for q in qs))[:, 0]
        sampled = torch.tensor([t > 0 for t in temps], device=dev)[:, None]
        logp = torch.where(sampled, probs.log(), sub.log_softmax(-1))
    else:
        logp = sub.log_softmax(-1)
    N = ids.shape[1]
    nxt = ids[b_t, (c_t + 1).clamp(max=N - 1)]  # the draft token after each column
    chosen = torch.stack([logp.gather(1, nxt[:, None])[:, 0], logp.gather(1, extra[b_t][:, None])[:, 0]], 1)
    K = max(w for w in wants if w is not None)
    top_v, top_i = logp.topk(K, -1) if K else (logp[:, :0], logp[:, :0].long())
    chosen, top_v, top_i = chosen.cpu().numpy(), top_v.cpu().tolist(), top_i.cpu().tolist()
    out: dict[int, Logprobs] = {}
    r = 0
    for n, b in enumerate(rows):
        k = seqs[b].fed_k
        w = wants[n]
        if w is not None:  # (which of the two chosen values applies is known once j is: Logprobs.cut)
            out[b] = _Pending(chosen[r: r + k + 1], [[(t, v) for t, v in zip(top_i[r + i][:w], top_v[r + i][:w],
                                                                              strict=True) if v > -math.inf]
                                                     for i in range(k + 1)])
        r += k + 1
    return out


class _Pending:
    """A row's logprobs before the step's j is known: both candidates per column (the draft's next
    token, the extra token)."""

    def __init__(self, chosen: np.ndarray, top: list[list[tuple[int, float]]]) -> None:
        self.chosen, self.top = chosen, top

    def cut(self, j: int) -> Logprobs:
        """The logprobs of the j accepted draft tokens and the extra one."""
        vals = [float(v) for v in self.chosen[:j, 0]] + [float(self.chosen[j, 1])]
        return Logprobs(chosen=vals, top=self.top[: j + 1])
