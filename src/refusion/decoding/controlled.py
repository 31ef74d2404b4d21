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
the verification checks them like any draft). Where the forced text's last token could still merge
with what follows, no token is forced, but that text's tokens are drafted the same way
(grammar.Matcher.forced_text). A draft that runs out where the grammar forces more is extended by
it. (A grammar row also drafts copies of its prompt's bytes: text_copy.py.)

Branches (fork): a branch token's column gets the controls of its own prefix (the draft up to the
fork, then the branch), so a branch that goes further commits AR's tokens too; branches are cut
where the grammar refuses them. A row that asks for logprobs does not fork (a branch's would come
from other columns). The work here is host-side per verified position of a controlled row only; a
step with no controlled row never enters this module.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from refusion.decoding.controls import Controls, Logprobs
from refusion.decoding.sampling import RowSampling
from refusion.runtime import to_device


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
            if not forced and jump and self.forced < 0:
                forced = m.forced_text()  # (drafted whatever the width too: the model rarely refuses it)
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

    def prepare_branches(self, draft: list[int], branches: list[tuple[int, list[int], int]]
                         ) -> list[tuple[int, list[int], int]]:
        """Each branch (fork, tokens, kind) cut before its first token the grammar refuses after the
        draft's first `fork` tokens (to none where the draft no longer reaches its fork)."""
        m = self.matcher
        if m is None:
            return branches
        out = []
        for at, tokens, kind in branches:
            n = 0
            reach = at <= len(draft) and self.eos.isdisjoint(draft[:at])
            got = m.accept_many(draft[:at]) if reach else -1
            if got == at:  # (not where the draft no longer reaches the fork, or holds an EOS before it)
                e = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
                n = m.valid_prefix(tokens[:e])
            m.rollback(max(got, 0))
            out.append((at, tokens[:n], kind))
        return out

    def fill(self, prefixes: list[list[int]], rows: np.ndarray) -> None:
        """rows [len(prefixes), words]: the allowed tokens after the committed ones and each prefix
        (every token of it allowed in turn: prepare cut the drafts; an EOS only last)."""
        m = self.matcher
        have: list[int] = []  # what the matcher holds beyond the committed tokens
        for i, p in enumerate(prefixes):
            p = [t for t in p if t not in self.eos]
            common = next((n for n, (a, b) in enumerate(zip(have, p)) if a != b), min(len(have), len(p)))
            m.rollback(len(have) - common)
            if m.accept_many(p[common:]) != len(p) - common:
                raise RuntimeError("a fed draft holds a token the grammar refuses")
            have = p
            m.fill(rows[i], self.eos_ids)
        m.rollback(len(have))

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


def columns(q, a: int) -> list[tuple[int, list[int]]]:
    """A row's verified columns (among the last N fed; a: its anchor's) with the response tokens
    beyond the committed ones before the position each predicts: the anchor and each draft token's
    column (the draft before it), and each fed branch token's (the draft up to the fork, the branch
    up to that token)."""
    draft = q.draft[: q.fed_k]
    out = [(a + i, draft[:i]) for i in range(q.fed_k + 1)]
    for first, at, n, which in q.fed_branches:
        tokens = q.branches[which][1]
        out += [(a + first + i, draft[:at] + tokens[: i + 1]) for i in range(n)]
    return out


def apply(seqs: list, rows: list[int], logits: Tensor, anchor: np.ndarray) -> Tensor:
    """Apply the controls of seqs[b] for b in rows (each with q.control) to logits [B, N, V] at their
    verified columns (`columns`), in place. (Copies to the device through to_device: the host does
    not wait for the forward.)"""
    B, N, V = logits.shape
    dev = logits.device
    rows = [b for b in rows if seqs[b].control.c.shapes_logits]
    if not rows:
        return logits
    cols = {b: columns(seqs[b], int(anchor[b])) for b in rows}
    b_t, c_t = to_device(np.array([[b, c] for b in rows for c, _ in cols[b]], dtype=np.int64).T.copy(), dev)
    R = len(b_t)
    sub = logits[b_t, c_t]  # [R, V] (a copy)
    bits = np.full((R, (V + 31) // 32), -1, dtype=np.int32)
    bias_r, bias_t, bias_v = [], [], []
    # the response before each column's position: the committed tokens, counted once per row (in its
    # first column, which every column of the row then copies), then the column's own prefix
    done_r, done_t, count_r, count_t = [], [], [], []
    first = np.arange(R)  # each column's row's first column
    pres, freq = np.zeros(R, dtype=np.float32), np.zeros(R, dtype=np.float32)
    r0 = 0
    for b in rows:
        q, n = seqs[b], len(cols[b])
        ctl = q.control
        prefixes = [p for _, p in cols[b]]
        if ctl.matcher is not None:
            ctl.fill(prefixes, bits[r0: r0 + n])
        if ctl.c.logit_bias:
            toks, vals = list(ctl.c.logit_bias), list(ctl.c.logit_bias.values())
            for i in range(n):
                bias_r += [r0 + i] * len(toks)
                bias_t += toks
                bias_v += vals
        if ctl.c.penalised:
            pres[r0: r0 + n], freq[r0: r0 + n] = ctl.c.presence_penalty, ctl.c.frequency_penalty
            first[r0: r0 + n] = r0
            done_r += [r0] * len(q.res.tokens)
            done_t += q.res.tokens
            for i, p in enumerate(prefixes):
                count_r += [r0 + i] * len(p)
                count_t += p
        r0 += n
    if bias_r:
        bias_i = to_device(np.array([bias_r, bias_t], dtype=np.int64), dev)
        sub.index_put_((bias_i[0], bias_i[1]), to_device(np.array(bias_v, dtype=np.float32), dev, sub.dtype),
                       accumulate=True)
    if done_r or count_r:
        d, c = len(done_r), len(count_r)
        idx = to_device(np.concatenate([done_r, done_t, count_r, count_t, first]).astype(np.int64), dev)
        counts = torch.zeros_like(sub)
        counts.index_put_((idx[:d], idx[d: 2 * d]), torch.ones(d, device=dev, dtype=sub.dtype), accumulate=True)
        counts = counts[idx[2 * d + 2 * c:]]
        counts.index_put_((idx[2 * d: 2 * d + c], idx[2 * d + c: 2 * d + 2 * c]),
                          torch.ones(c, device=dev, dtype=sub.dtype), accumulate=True)
        p_t, f_t = to_device(np.stack([pres, freq]), dev, sub.dtype)[:, :, None]
        sub -= p_t * (counts > 0) + f_t * counts
    if any(seqs[b].control.matcher is not None for b in rows):
        sub.masked_fill_(~unpack(to_device(bits, dev), V), float("-inf"))
    logits[b_t, c_t] = sub
    return logits


def unpack(bits: Tensor, V: int) -> Tensor:
    """int32 bitmask words [R, W] -> bool [R, V] (bit t % 32 of word t // 32)."""
    shift = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[:, :, None] >> shift) & 1).bool().flatten(1)[:, :V]


def logprobs(seqs: list, rows: list[int], logits: Tensor, anchor: np.ndarray, ids: Tensor, extra: Tensor
             ) -> dict[int, _Pending]:
    """Per row that asks for logprobs (such a row never forks): the logprobs of the tokens its
    verified columns may commit, from the distribution each is chosen from (controls.py), with the
    top alternatives; entry i is for the token column anchor + i commits (the draft's (i+1)-th where
    accepted, else the extra token). One transfer."""
    rows = [b for b in rows if seqs[b].control.c.logprobs is not None]
    if not rows:
        return {}
    dev = logits.device
    bi = [b for b in rows for _ in range(seqs[b].fed_k + 1)]
    ci = [int(anchor[b]) + i for b in rows for i in range(seqs[b].fed_k + 1)]
    b_t, c_t = torch.tensor(bi, device=dev), torch.tensor(ci, device=dev)
    sub = logits[b_t, c_t]  # [R, V], the controlled logits
    qs = [seqs[b] for b in bi]
    if any(q.p.temperature > 0 for q in qs):
        probs = RowSampling.of([q.p for q in qs], dev).probs(sub[:, None])[:, 0]
        sampled = torch.tensor([q.p.temperature > 0 for q in qs], device=dev)[:, None]
        logp = torch.where(sampled, probs.log(), sub.log_softmax(-1))
    else:
        logp = sub.log_softmax(-1)
    N = ids.shape[1]
    nxt = ids[b_t, (c_t + 1).clamp(max=N - 1)]  # the draft token after each column
    chosen = torch.stack([logp.gather(1, nxt[:, None])[:, 0], logp.gather(1, extra[b_t][:, None])[:, 0]], 1)
    K = max(seqs[b].control.c.logprobs for b in rows)
    top_v, top_i = logp.topk(K, -1) if K else (logp[:, :0], logp[:, :0].long())
    # one transfer (token ids are exact in float32: vocabularies are below 2^24)
    host = torch.cat([chosen, top_v, top_i.to(top_v.dtype)], 1).cpu().numpy()
    chosen, top_v, top_i = host[:, :2], host[:, 2: 2 + K].tolist(), host[:, 2 + K:].astype(np.int64).tolist()
    out: dict[int, _Pending] = {}
    r = 0
    for b in rows:
        n, w = seqs[b].fed_k + 1, seqs[b].control.c.logprobs
        top = [[(t, v) for t, v in zip(top_i[r + i][:w], top_v[r + i][:w], strict=True) if v > -math.inf]
               for i in range(n)]
        out[b] = _Pending(chosen[r: r + n], top)  # (which chosen value applies is known once j is: cut)
        r += n
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
