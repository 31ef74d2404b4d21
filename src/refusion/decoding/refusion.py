"""Plan-and-infill decoding (spec section 4), batched.

Each sequence is a small state machine (plan -> verify -> [infill draft <-> infill verify]) that,
at every step, says which tokens it wants fed. Sequences in different phases share one model
forward: each is one batch row with its own tokens, positions, cache columns and attention mask.
After the forward, the few numbers every phase needs (argmax token and its probability at each
fed token, and the shifted probability of each fed token) come to the host in one transfer, and
the state machines decide what to do next. Decisions are taken exactly as the reference takes
them (greedy by default), except for the defects the spec names, which are fixed.

Cache layout per sequence (a SlotKVCache row): columns [0, C) hold the committed tokens in commit
order (prompt first); the columns after C are scratch for the current phase. Infill row r of a
slot of size s lives at C + r*s + j, so the k rows share the committed prefix without copying it,
and once accepted their KV already sits where "appending row after row" would put it.

Join check (`join_check`, off by default; greedy only). Slots drafted in parallel can repeat or
skip a token where they meet, since nothing in the reference checks a slot's first token against
the token before it. With the option, let pred(q) be the greedy causal prediction (argmax of the
logits) at the committed response token at position q, read from the forward whose KV of that token
was kept (a global verification, an infill verification round or the recompute pass; every one of
them already returns logits for every token it feeds, so this costs no forward). Then:
  - plan: a planned slot starting at st whose token st-1 is a committed response token gets
    pred(st-1) as its first token, and the causal probability of it as its score (the rest of its
    draft is verified and infilled as usual);
  - commit: a slot committed in the same step as the slot just before it (global verification over
    adjacent chosen slots, or infill rows of adjacent slots) is committed only if its first token is
    pred of the previous slot's last token, as computed in that commit's pass; the first slot that
    fails, and every chosen slot after it, are not committed but re-planned (where the plan rule
    then applies). In global verification this is part of the longest accepted prefix.
So every slot that starts after a response token committed no later than itself starts with that
token's causal prediction. The prompt's last token counts too where the model was trained to
predict the first response token from it (config causal_first_token: the objective variants);
under the paper's objective it never was, and the first slot starts from its mask, as `ar` does.
Not checked: a slot's last token against a slot already committed after it.

Causal infill (`causal_infill`, off by default; greedy only). Each infill verification round takes
one token per row without a check, the first one not yet accepted (so every round makes progress);
in the reference it is the mask's draft, and on a model whose masks draft worse than its causal
path that is where plan-and-infill's answers part from AR's. With the option that token is the
causal prediction from the accepted token before it (fed in the same pass, so it costs no forward),
as `speculative` takes the token after its accepted draft; where it replaces the draft, the tokens
after it are drafted again and the row's cache from it on is fed again before the row is committed
(its key and value were computed from the draft). With join_check, left to right and token_threshold
1 the output is greedy AR's; otherwise the tokens accepted above token_threshold, and rows verified
without the chosen slots before them, still decide.

Row recheck (`recheck_rows`, off by default). Infill rows are verified side by side, each seeing
the committed tokens and itself, so a row's tokens were never checked after the chosen slots before
it (a carry drafted in another row, say). With the option the finished rows are fed again in one
causal pass in slot order (the pass `recompute_kv` makes, whose keys and values are then kept), and
rows are committed up to the first row after the first with a token that this pass gives
token_threshold or less and does not predict; the rows from it on are re-planned. One forward per
infill, none per global verification.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from refusion.decoding.common import DecodeResult, packed_index
from refusion.decoding.params import ReFusionParams, check_prompts
from refusion.decoding.sampling import generator, gumbel_argmax
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.model.cache import SlotKVCache
from refusion.model.transformer import Transformer
from refusion.runtime import to_device

PLAN, VERIFY, DRAFT, IVERIFY, RECOMPUTE, DONE = "plan", "verify", "draft", "iverify", "recompute", "done"


class Feed(NamedTuple):
    """What a sequence feeds to one forward: token ids, their positions, the cache columns they
    write, their attention groups (0 committed, g > 0 infill row g), and how many trailing tokens
    need logits."""

    ids: list[int]
    positions: list[int]
    columns: list[int]
    groups: list[int]
    need: int


class PlanInfillSeq:
    """One sequence's plan-and-infill state machine. Positions are absolute (prompt 0..P-1,
    response P..P+L-1)."""

    def __init__(self, row: int, prompt: list[int], p: ReFusionParams, mask_id: int, eos: set[int],
                 on_commit: Callable | None, gen: torch.Generator | None, causal_first: bool = False) -> None:
        self.row, self.prompt, self.p, self.mask_id, self.eos = row, prompt, p, mask_id, eos
        self.on_commit, self.gen = on_commit, gen
        # join_check on a model whose prompt end predicts the first token (causal_first_token): the
        # prompt's last token counts as a committed token before the first slot
        self.prompt_join = p.join_check and causal_first and len(prompt) > 0
        self.P = len(prompt)
        s = p.slot_size
        per_block = p.gen_length // p.serial_blocks
        self.blocks = [list(range(self.P + b * per_block, self.P + (b + 1) * per_block, s))
                       for b in range(p.serial_blocks)]
        self.block = 0
        self.undecoded = list(self.blocks[0])  # slot start positions, ascending
        self.C = 0  # committed cache columns
        self.grp = np.full(self.P + p.gen_length + 1, -1, dtype=np.int64)  # -1 free, 0 committed, g>0 group
        self.committed: dict[int, int] = {}  # position -> token
        self.step_of: dict[int, int] = {}
        self.eos_pos: int | None = None
        self.stop_after_block = False
        self.phase = PLAN
        self.eos_row: tuple[int, int] | None = None  # (infill row, offset) of an EOS accepted in infill
        # join_check: the greedy causal prediction (and its probability) at each position, from the
        # latest causal pass that fed it; read only at committed positions, whose KV that pass made
        self.pred_tok = np.full(self.P + p.gen_length + 1, -1, dtype=np.int64)
        self.pred_prob = np.zeros(self.P + p.gen_length + 1)
        self.res = DecodeResult(prompt=list(prompt))

    # ---- what to feed -------------------------------------------------------------

    def next_feed(self) -> Feed:
        s, C = self.p.slot_size, self.C
        self.grp[C:] = -1
        if self.phase == PLAN:
            slots = self.undecoded[:1] if self.p.left_to_right else self.undecoded
            ids, pos, grp = [], [], []
            if C == 0:  # the first pass carries the prompt, committed at once
                ids, pos, grp = list(self.prompt), list(range(self.P)), [0] * self.P
            for st in slots:
                ids += [self.mask_id] * s
                pos += list(range(st, st + s))
                grp += [1] * s
            self.plan_slots = slots
            need = len(slots) * s + (C == 0 and self.prompt_join)  # (the prompt's last token's prediction too)
            cols = list(range(len(ids))) if C == 0 else list(range(C, C + len(ids)))
        elif self.phase in (VERIFY, RECOMPUTE):
            if self.phase == VERIFY:
                ids = [t for row in self.drafts for t in row]
                pos = [st + j for st in self.chosen for j in range(s)]
            else:
                ids, pos = self.pending
            cols = list(range(C, C + len(ids)))
            grp = [1] * len(ids)
            need = len(ids)
        else:  # DRAFT or IVERIFY: every infill row from offset a on
            a = self.a
            ids, pos, cols, grp = [], [], [], []
            for r, (st, row) in enumerate(zip(self.chosen, self.drafts)):
                self.grp[C + r * s: C + r * s + a] = r + 1  # the row's kept KV from earlier rounds
                for j in range(a, s):
                    masked = self.phase == DRAFT and j >= self.nacc[r]
                    ids.append(self.mask_id if masked else row[j])
                    pos.append(st + j)
                    cols.append(C + r * s + j)
                    grp.append(r + 1)
            need = len(ids)
        self.grp[cols] = grp
        self.fed_positions = pos
        self.res.forwards += 1
        self.res.tokens_fed += len(ids)
        return Feed(ids, pos, cols, grp, need)

    # ---- what to do with the model's answer ------------------------------------------

    def consume(self, amax: np.ndarray, pmax: np.ndarray, pnext: np.ndarray, sampled: np.ndarray | None,
                psampled: np.ndarray | None) -> None:
        """amax/pmax/pnext: per fed token (aligned with the feed); pnext[i] = P(token i | token i-1).
        sampled/psampled: the plan's sampled tokens and their probabilities (None when greedy)."""
        if self.p.join_check and self.phase in (VERIFY, IVERIFY, RECOMPUTE):  # causal passes: logits at every token fed
            self.pred_tok[self.fed_positions] = amax
            self.pred_prob[self.fed_positions] = pmax
        if self.phase == PLAN and self.C == 0 and self.prompt_join:
            n = len(self.plan_slots) * self.p.slot_size
            self.pred_tok[self.P - 1], self.pred_prob[self.P - 1] = amax[-n - 1], pmax[-n - 1]
        if self.phase == PLAN:
            self._after_plan(amax, pmax, pnext, sampled, psampled)
        elif self.phase == VERIFY:
            self._after_verify(amax, pmax, pnext, sampled, psampled)
        elif self.phase == DRAFT:
            self._after_draft(amax, pmax, pnext, sampled, psampled)
        elif self.phase == IVERIFY:
            self._after_iverify(amax, pmax, pnext, sampled, psampled)
        elif self.phase == RECOMPUTE:
            self._after_recompute(amax, pmax, pnext, sampled, psampled)
        else:
            raise RuntimeError(f"a sequence in phase {self.phase!r} was fed")

    def _after_plan(self, amax, pmax, pnext, sampled, psampled):
        s = self.p.slot_size
        n = len(self.plan_slots) * s
        tok = (sampled if sampled is not None else amax)[-n:].reshape(-1, s)
        prob = (psampled if psampled is not None else pmax)[-n:].reshape(-1, s)
        if self.p.join_check:
            # a slot right after a committed response token starts with that token's causal prediction
            after = [i for i, st in enumerate(self.plan_slots)
                     if st - 1 in self.committed or (st == self.P and self.prompt_join)]
            before = np.asarray([self.plan_slots[i] - 1 for i in after], dtype=np.int64)
            tok, prob = tok.copy(), prob.copy()
            tok[after, 0] = self.pred_tok[before]
            prob[after, 0] = self.pred_prob[before]
        if self.C == 0:
            self.C = self.P  # the prompt's KV stays
        score = prob[:, 0]
        if self.p.left_to_right:
            pick = [0]
        else:
            pick = np.nonzero(score > self.p.slot_threshold)[0].tolist() or [int(np.argmax(score))]
        self.chosen = [self.plan_slots[i] for i in pick]  # already in position order
        self.drafts = [tok[i].tolist() for i in pick]
        self.first_prob = [float(prob[i, 0]) for i in pick]
        self.phase = VERIFY

    def _after_verify(self, amax, pmax, pnext, sampled, psampled):
        s, k = self.p.slot_size, len(self.chosen)
        flat = [t for row in self.drafts for t in row]
        ok = pnext > self.p.token_threshold
        ok[::s] = True  # token 0 of every slot keeps its draft and counts as accepted
        rows_ok = ok
        if self.p.join_check:  # ...unless it follows the previous chosen slot and is not its causal prediction
            ok = ok.copy()
            ok[::s] = ~self._bad_joins()
        n_acc = int(np.argmin(ok)) if not ok.all() else len(ok)
        eos_at = next((i for i in range(n_acc) if flat[i] in self.eos), None)
        if eos_at is not None:
            c = eos_at // s
            self.undecoded = [st for st in self.undecoded if st not in self.chosen[:c + 1]]
            self._commit_cols(flat[: eos_at + 1], [self.chosen[i // s] + i % s for i in range(eos_at + 1)])
            self._next_plan()
        elif n_acc >= s:
            w = n_acc // s
            self._commit_cols(flat[: w * s], [self.chosen[i // s] + i % s for i in range(w * s)])
            self.undecoded = [st for st in self.undecoded if st not in self.chosen[:w]]
            self._next_plan()
        else:
            per = rows_ok.reshape(k, s)  # infill rows do not see each other: joins are checked at the commit
            self.nacc = [int(np.argmin(r)) if not r.all() else s for r in per]
            self.a = 0
            self.phase = DRAFT

    def _after_draft(self, amax, pmax, pnext, sampled, psampled):
        s, a = self.p.slot_size, self.a
        w = s - a
        for r in range(len(self.chosen)):
            for j in range(self.nacc[r], s):  # infill drafts are always greedy, at their own position
                self.drafts[r][j] = int(amax[r * w + j - a])
        self.phase = IVERIFY

    def _after_iverify(self, amax, pmax, pnext, sampled, psampled):
        s, a, tau = self.p.slot_size, self.a, self.p.token_threshold
        w = s - a
        eos_row = None
        stale = []  # causal_infill: rows with a token replaced after this pass fed it (its KV is not its own)
        for r in range(len(self.chosen)):
            old = self.nacc[r]
            n = old
            if self.p.causal_infill and old < s:
                # the token that passes anyway is the causal prediction from the accepted token before it
                # (fed in this pass: a <= old - 1); the mask's draft stands only where the two agree
                want = int(amax[r * w + old - 1 - a])
                if self.drafts[r][old] != want:
                    self.drafts[r][old] = want
                    self.nacc[r] = old + 1  # what follows was drafted after the wrong token: drafted again
                    stale.append(r)
                    if eos_row is None and any(t in self.eos for t in self.drafts[r][:old + 1]):
                        eos_row = r
                    continue
            # the first token fed, and the one right after the previously accepted prefix, pass anyway
            while n < s and (n <= old or pnext[r * w + n - a] > tau):
                n += 1
            self.nacc[r] = n
            # (the whole accepted prefix is checked, so an EOS accepted by global verification
            # inside a later slot is caught too)
            if eos_row is None and any(t in self.eos for t in self.drafts[r][:n]):
                eos_row = r
        if eos_row is not None:
            r = eos_row
            j = next(j for j in range(s) if self.drafts[r][j] in self.eos)
            self.chosen, self.drafts, self.nacc = self.chosen[:r + 1], self.drafts[:r + 1], self.nacc[:r + 1]
            self.nacc[r] = s
            self.eos_row = (r, j)
        m = min(n - a for n in self.nacc)
        done = all(n == s for n in self.nacc) and not any(r < len(self.chosen) for r in stale)
        self.a = a + (m if done else m - 1)
        if not done:
            # a replaced token is fed again from offset a on; with nothing left to draft, verify at once
            self.phase = IVERIFY if all(n == s for n in self.nacc) else DRAFT
            return
        # every row accepted: their KV is already in place after the committed prefix
        cut = self.eos_row
        toks, poss = [], []
        for r, (st, row) in enumerate(zip(self.chosen, self.drafts)):
            n = cut[1] + 1 if cut is not None and r == cut[0] else s
            toks += row[:n]
            poss += list(range(st, st + n))
        self.eos_row = None
        self.pending = (toks, poss)
        self.rows_ok = len(self.chosen)
        if self.p.recompute_kv or self.p.recheck_rows:
            self.phase = RECOMPUTE
            return
        self._commit_infill()

    def _after_recompute(self, amax, pmax, pnext, sampled, psampled):
        if self.p.recheck_rows:
            self.rows_ok = self._rows_rechecked(amax, pnext)
        self._commit_infill()

    def _rows_rechecked(self, amax: np.ndarray, pnext: np.ndarray) -> int:
        """recheck_rows: how many infilled rows the recompute pass accepts, in order. Each row was
        verified beside, not after, the chosen slots before it; in this pass every token follows them
        (the first row's context is unchanged, so it stands). A token stands if the pass gives it more
        than token_threshold or predicts it; a row's first token is checked only where it directly
        follows the row before (else its predecessor is not the token fed before it)."""
        s, tau = self.p.slot_size, self.p.token_threshold
        toks = self.pending[0]
        ok = pnext > tau
        ok[1:] |= amax[:-1] == np.asarray(toks[1:])
        for r in range(1, len(self.chosen)):
            i = r * s
            if i >= len(toks):
                break
            if self.chosen[r] != self.chosen[r - 1] + s:
                ok[i] = True
            if not ok[i: i + s].all():
                return r
        return len(self.chosen)

    def _commit_infill(self) -> None:
        """Commit the infilled rows (self.pending, their KV in place after the committed prefix);
        with recheck_rows only those the recompute pass accepts, with join_check only those before
        the first bad join; the others are re-planned."""
        toks, poss = self.pending
        k = self.rows_ok
        if k < len(self.chosen):
            toks, poss = toks[: k * self.p.slot_size], poss[: k * self.p.slot_size]
        if self.p.join_check:
            bad = self._bad_joins()
            if bad[:k].any():
                k = int(np.argmax(bad))  # >= 1; the rows before it are whole (only the last row is cut at an EOS)
                toks, poss = toks[: k * self.p.slot_size], poss[: k * self.p.slot_size]
        self.undecoded = [st for st in self.undecoded if st not in self.chosen[:k]]
        self._commit_cols(toks, poss)
        self._next_plan()

    # ---- bookkeeping ----------------------------------------------------------------

    def _bad_joins(self) -> np.ndarray:
        """Per chosen slot: True where it directly follows the previous chosen slot and its first
        token is not the causal prediction at that slot's last token (from this step's pass)."""
        st = np.asarray(self.chosen, dtype=np.int64)
        first = np.asarray([row[0] for row in self.drafts], dtype=np.int64)
        bad = np.zeros(len(st), dtype=bool)
        bad[1:] = (st[1:] == st[:-1] + self.p.slot_size) & (first[1:] != self.pred_tok[st[1:] - 1])
        return bad

    def _commit_cols(self, toks: list[int], poss: list[int]) -> None:
        """The first len(toks) scratch columns become committed (their KV is kept as computed)."""
        n = len(toks)
        self.grp[self.C: self.C + n] = 0
        self.C += n
        step = self.res.forwards - 1
        for t, q in zip(toks, poss):
            self.committed[q] = t
            self.step_of[q] = step
            if t in self.eos and (self.eos_pos is None or q < self.eos_pos):
                self.eos_pos = q
                self.stop_after_block = True
        if self.on_commit is not None:
            self.on_commit(self.row, poss, toks)

    def _next_plan(self) -> None:
        # The fixed EOS behaviour: drop the undecoded slots after the first EOS (by position), never
        # earlier ones; those are still decoded, so the output has no holes.
        self.undecoded = [st for st in self.undecoded if self.eos_pos is None or st < self.eos_pos]
        while not self.undecoded:
            self.block += 1
            if self.stop_after_block or self.block >= len(self.blocks):
                self.phase = DONE
                return
            self.undecoded = list(self.blocks[self.block])
        self.phase = PLAN

    def finish(self, seconds: float) -> DecodeResult:
        pos = sorted(self.committed)
        if self.eos_pos is not None:
            pos = [q for q in pos if q <= self.eos_pos]
        expected = list(range(self.P, self.P + len(pos)))
        if pos != expected:  # a hole would be a bug in this file, never a property of the model
            raise RuntimeError(f"plan-and-infill left holes in the output: {sorted(set(expected) - set(pos))}")
        r = self.res
        r.tokens = [self.committed[q] for q in pos]
        r.positions = pos
        r.steps = [self.step_of[q] for q in pos]
        r.finished = self.eos_pos is not None
        r.seconds = seconds
        return r


@torch.inference_mode()
def generate_refusion(model: Transformer, prompts: list[list[int]], params: ReFusionParams | None = None, *,
                      eos_ids: list[int] | None = None, seed: int | None = None,
                      on_commit: Callable[[int, list[int], list[int]], None] | None = None) -> list[DecodeResult]:
    """Plan-and-infill for a batch of prompts; on_commit(row, positions, tokens) streams commits.
    Sampled rows draw from generators of their own, each seeded with `seed` (0 when None). With
    `verify`, see generate_verified."""
    p = params or ReFusionParams()
    if p.verify:
        return generate_verified(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ValueError("plan-and-infill needs a model with mask_token_id in its config (a ReFusion model)")
    check_prompts(cfg, prompts, p.gen_length)
    eos = set(eos_ids if eos_ids is not None else cfg.eos_ids)
    device = model.embed_tokens.weight.device
    gens = [generator(seed if seed is not None else 0, device) for _ in prompts]
    seqs = [PlanInfillSeq(i, list(q), p, cfg.mask_token_id, eos, on_commit, gens[i] if p.temperature > 0 else None,
                          causal_first=cfg.causal_first_token) for i, q in enumerate(prompts)]
    cap = max(len(q) for q in prompts) + p.gen_length + 1
    cache = SlotKVCache(cfg.num_layers, len(prompts), cap, cfg.num_kv_heads, cfg.head_dim,
                        model.embed_tokens.weight.dtype, device)
    # On a CPU a forward costs in proportion to the tokens fed, and every row is padded to the widest:
    # planning rows (a whole block of masks) get their own forward so narrow infill rows do not pay
    # for them. On a GPU one wider forward is cheaper than two.
    split_plans = device.type == "cpu"
    start = time.perf_counter()
    while True:
        active = [q for q in seqs if q.phase != DONE]
        if not active:
            break
        groups = [active]
        if split_plans:
            groups = [g for g in ([q for q in active if q.phase == PLAN], [q for q in active if q.phase != PLAN]) if g]
        for group in groups:
            _step(model, cache, group, len(seqs), p.temperature, device)
    seconds = time.perf_counter() - start
    return [q.finish(seconds) for q in seqs]


def _step(model: Transformer, cache: SlotKVCache, active: list[PlanInfillSeq], n_rows: int, temperature: float,
          device: torch.device) -> None:
    """One shared forward for every active sequence, left-padded so trailing tokens line up."""
    feeds = [q.next_feed() for q in active]
    T = max(len(f.ids) for f in feeds)
    need = max(f.need for f in feeds)
    hi = max(max(max(f.columns), q.C) for q, f in zip(active, feeds)) + 1  # the pad column, seen by nobody
    B = len(active)
    ids = np.zeros((B, T), dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    col = np.full((B, T), hi, dtype=np.int64)
    qgrp = np.zeros((B, T), dtype=np.int64)
    kgrp = np.full((B, hi + 1), -1, dtype=np.int64)
    for b, (q, f) in enumerate(zip(active, feeds)):
        n = len(f.ids)
        ids[b, T - n:], pos[b, T - n:], col[b, T - n:], qgrp[b, T - n:] = f.ids, f.positions, f.columns, f.groups
        m = min(hi, len(q.grp))
        kgrp[b, :m] = q.grp[:m]
    # one copy to the device (a copy per array would make the host wait for the device each time)
    flat = to_device(np.concatenate([ids.ravel(), pos.ravel(), col.ravel(), qgrp.ravel(), kgrp.ravel()]), device)
    ids_t, pos_t, col_t, qg = flat[: 4 * B * T].view(4, B, T).unbind(0)
    kg = flat[4 * B * T:].view(B, hi + 1)
    key = torch.arange(hi + 1, device=device)
    # a query sees a column at or before its own that is committed or in its own group
    mask = (key[None, None, :] <= col_t[:, :, None]) & ((kg[:, None, :] == 0) | (kg[:, None, :] == qg[:, :, None]))
    rows = None if B == n_rows else torch.tensor([q.row for q in active], device=device)
    real = packed_index([len(f.ids) for f in feeds], T, device)  # rows of different widths: only real tokens
    logits = model(ids_t, pos_t, attn_mask=mask[:, None], cache=cache.at(col_t, keys=hi + 1, rows=rows),
                   num_logits=need, real=real).float()
    lse = logits.logsumexp(-1)
    top, amax = logits.max(-1)
    pmax = (top - lse).exp()
    nxt = ids_t[:, T - need + 1:]
    pnext = torch.ones_like(pmax)
    pnext[:, 1:] = (logits[:, :-1].gather(-1, nxt[..., None]).squeeze(-1) - lse[:, :-1]).exp()
    sampled = psampled = None
    if temperature > 0 and any(q.phase == PLAN for q in active):
        # Gumbel-max, with noise drawn per sequence from its own generator for its own masks only,
        # so a sequence samples the same tokens whatever else is in the batch.
        sampled, psampled = amax.clone(), pmax.clone()
        for b, (q, f) in enumerate(zip(active, feeds)):
            if q.phase == PLAN:
                n = f.need
                lg = logits[b, need - n:]
                tok = gumbel_argmax(lg, temperature, q.gen)
                sampled[b, need - n:] = tok
                psampled[b, need - n:] = (lg.gather(-1, tok[:, None]).squeeze(-1) - lse[b, need - n:]).exp()
    # the one host transfer of the step (token ids are exact in float32: vocabularies are below 2^24)
    out = [amax, pmax, pnext] + ([sampled, psampled] if sampled is not None else [])
    host = list(torch.stack([x.float() for x in out]).cpu().numpy())
    host[0] = host[0].astype(np.int64)
    if sampled is not None:
        host[3] = host[3].astype(np.int64)
    for b, (q, f) in enumerate(zip(active, feeds)):
        sl = slice(need - min(len(f.ids), f.need), need)
        plan_sampled = sampled is not None and q.phase == PLAN
        q.consume(host[0][b, sl], host[1][b, sl], host[2][b, sl],
                  host[3][b, sl] if plan_sampled else None, host[4][b, sl] if plan_sampled else None)


def generate_verified(model: Transformer, prompts: list[list[int]], params: ReFusionParams, *,
                      eos_ids: list[int] | None = None, seed: int | None = None,
                      on_commit: Callable[[int, list[int], list[int]], None] | None = None) -> list[DecodeResult]:
    """Plan-and-infill's answers as drafts (ReFusionParams.verify): each prompt is decoded by
    plan-and-infill, then by the speculative decoder with that answer offered as the draft at every
    position it reaches (beside the masks' own drafts; whichever is expected to be accepted further
    is fed). Every token is therefore the causal prediction AR decoding would make (greedy; the
    position-keyed draw when sampling), so the output is `ar`'s with the same seed, and the
    counters add up both passes: a plan-and-infill answer that is right is verified in a forward or
    two, a wrong one costs what the speculative decoder needs to get past its errors. Only the
    verified commits are streamed."""
    drafts = generate_refusion(model, prompts, dataclasses.replace(params, verify=False), eos_ids=eos_ids, seed=seed)
    sp = SpeculativeParams(gen_length=params.gen_length, temperature=params.temperature)
    out = generate_speculative(model, prompts, sp, eos_ids=eos_ids, seed=seed, on_commit=on_commit,
                               plans=[d.tokens for d in drafts])
    for o, d in zip(out, drafts):
        o.steps = [s + d.forwards for s in o.steps]
        o.forwards += d.forwards
        o.tokens_fed += d.tokens_fed
        o.seconds += d.seconds
    return out
