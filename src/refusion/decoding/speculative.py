"""Self-speculative decoding (spec section 7): the output of AR decoding at a diffusion draft's pace.

A ReFusion model holds a drafter and a verifier in one network: a `<|mask|>` at position q predicts
the token at q from whatever is in the cache (a draft, for free), and a clean token predicts its
successor causally (what AR decoding would commit). Each step feeds, per sequence,

    x, d1..dk, <|mask|> x m        at positions n-1, n, ..., n+k+m-1

on top of that sequence's cache, causal in feed order, where x is the newest committed token (its
KV is not cached yet) and d1..dk the draft. The longest draft prefix that equals the causal
predictions is accepted, plus one token the model supplies, so every step commits at least one
token and the committed tokens are exactly those greedy AR decoding would produce. The cache keeps
the KV of x and the accepted drafts, computed in this very forward, and nothing else (a length
change, no copy, no recomputation); the masks' predictions become the next draft.

Sampling (temperature > 0) verifies the same way with the argmax replaced by a position-keyed
draw (sampling.py): the token at response position t is draw(p_t, u(seed, t)), an inverse-CDF draw
with a uniform that is a hash of the sequence's seed and t, so a draft token is accepted when it
equals that draw and the first one that does not is replaced by it. The output is AR sampling's
with the same uniforms (`ar` draws them so too: the same seed gives the same tokens), so it follows
AR sampling's law exactly, whatever the drafts are. And since nothing depends on how many numbers
were drawn before, a seeded sequence's output is the same whatever the widths, the rest of the
batch, or when it joined. The masks draft their argmax by default, a token d accepted with
probability p_t(d); with `sampled_drafts` a mask's draft for position t is draw(q_t, u(seed, t)),
its own distribution q_t (filtered as p is) drawn with the very uniform the output at t will be
drawn with, a coupling that accepts whenever the two inverse-CDF draws land on the same token. The
masks' distributions are flatter than the causal ones, so on the models measured (the bundled
model and the words fixture, T = 0.7 and 1.0) that accepted fewer tokens than the argmax.
`accept_prob` is the opt-in lossy knob: also accept a draft token whose probability is >= it.

Lookup (`lookup`, lookup.py): a second source of drafts, with no forward: the tokens that followed
the latest earlier occurrence of the sequence's last few tokens in its prompt or answer. After each
step a row feeds whichever of the two drafts, the masks' or the copy, has the longer expected
accepted prefix (acceptance is counted per kind of draft: a copy's by its match length and by
how far the text's earlier occurrences of the words it matched went on the same way; a corpus
draft's by its match length, whether a copy is on offer beside it and whether its first token won
most of the vote). Where this model's masks do not pay for themselves behind a copy, it is fed with
no masks behind it (masks draft the next step, which uses their draft only where this one accepts
the copy whole, and what follows an accepted copy is copied too; speculative_policy.FeedPolicy.masks_pay weighs that against
what they add to the forward's cost): a model whose masks draft poorly still gains where its
answers repeat their context. A copy not worth feeding at all is dropped where the masks' fresh
draft is worth feeding: the row would otherwise step alone, without masks, and hold the next copy.

After a rejection (`fresh_after_miss`): the masks behind a draft see the whole draft, so after a
rejection they have drafted from a token that was not kept. Spec section 7 then feeds the rest of
the old draft and those masks' tokens (the default for a ReFusion-trained model). A mask adapter's
masks rarely get those right, and a rejected stale draft leaves the masks behind it stale again,
so for such a model (fresh_after_miss_by_default) the row drops the rest: the next step feeds its
masks behind whatever it verifies (another draft: a copy; or none), and they draft from the
committed tokens alone.

Redraft (`redraft`): instead of that one step without a mask draft, a step also feeds, behind x
and behind each draft token but the last, a block of masks that sees the draft only up to its own
place (an attention mask, not feed order, says so; clean tokens never see a mask, so the output is
untouched). Whatever prefix is accepted, the block behind it has drafted from exactly the committed
tokens: every step then feeds a fresh draft, at the price of width + 1 blocks of masks, which the
cost policy prices (widths.fed_tokens).

Fork (`fork`): a row holding more than one draft (the masks', a copy, the corpus's) also feeds the
others beside the one it verifies, as branches, each from the token where it parts from the first:
the runner-up offers, and the ways the text and the corpus went otherwise after the same words (a
copy of an earlier occurrence that continues differently, lookup.NgramIndex.alternatives; the
corpus vote's runner-up, corpus.LookupCorpus.runner_up), up to MAX_BRANCHES, one per place and token
they part with. A branch's tokens sit after the masks, at the positions after its fork, and see x,
the shared tokens and their own branch only (an attention mask). Where the first draft is rejected
exactly at a branch's fork, the branch is verified in the same forward; the one that goes furthest
has its accepted tokens committed and their KV moved to the columns after the fork (one copy per
layer, only then). The cost policy feeds as many of each branch's tokens as pay (FeedPolicy.choose_branches):
the chance that it is tested, times how far such branches have gone where they were (their own
kinds of acceptance, widths.SECOND and widths.ALTERNATIVE), against what they add to the forward.

Sampler (`sampler`, model/mask_sampler.py): a model may keep a small head beside its weights that
chooses each mask's draft among its most likely tokens given the token chosen before it, one mask
after another after the forward, starting from the step's extra token (the masks of one block are
computed blind to each other, so their argmaxes need not hold together). It reads the masks'
final states and logits only; the verification is untouched.

Widths (widths.py): how many draft tokens and masks each sequence feeds. By default (`widths`
cost) they are chosen before every step to maximise the batch's expected committed tokens per
second of measured forward cost; `adaptive` grows a sequence's width by 2 after a fully accepted
draft and shrinks it by 1 after a rejection (within [1, draft_length], masks = width + 1); `fixed`
feeds draft_length and mask_length.

Batched and ragged: each sequence accepts its own number of tokens and keeps its own cache length
in a RaggedKVCache; one forward per step for the running sequences (plus one for sequences that
joined and are being prefilled, so narrow decode rows are never padded to a prompt), one host
transfer per forward. Sequences join and leave between steps (SpeculativeBatch): a server's
continuous batching. `generate_speculative` is "add every prompt, step until none is left", so a
sequence's output does not depend on what else is in the batch.

Plain AR: a row with no draft budget (draft_length 0, no masks, no plan) commits one token a step,
the extra one; it needs a mask token only where its first token is read from one (first_from_mask),
so a model without one runs such rows too. The `ar` decoder is such rows (`generate_ar`), and the
server runs its requests in the same batch. While every row that steps is plain, the steps run
without the width policy, the feeds and the acceptance bookkeeping (plain_run.py).

Controls (controls.py: a grammar, logit bias, penalties, logprobs): a controlled row steps
generically, never plainly; before its feed its draft is cut where the grammar refuses it and given
the tokens the grammar forces, and after the forward the logits of its verified columns get the
controls AR decoding would apply at those positions (controlled.py), before the judge.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from refusion.decoding import controlled, costs
from refusion.decoding.common import DecodeResult, packed_index
from refusion.decoding.controls import Controls, Logprobs
from refusion.decoding.lookup import lookup_by_default
from refusion.decoding.params import (ARParams, SpeculativeParams, ar_batch_params, check_max_rows, check_prompts,
                                     check_seed, row_seeds)
from refusion.decoding.plain_run import PlainRun
from refusion.decoding.speculative_judge import judge
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.decoding.speculative_seq import SpeculativeSeq
from refusion.model.cache import RaggedKVCache
from refusion.model.config import ModelConfig
from refusion.model.mask_sampler import sampler_of
from refusion.model.transformer import Transformer


def fresh_after_miss_by_default(config: ModelConfig) -> bool:
    """Whether a rejection drops the rest of the draft when not told: for a mask-adapted model, whose
    masks draft from a frozen base and rarely guess past a token they did not see (docs/smollm2.md);
    a ReFusion-trained model keeps the spec's rest of the draft."""
    return config.mask_adapter is not None


class _Packed(NamedTuple):
    """A generic step's feed (SpeculativeBatch._pack): on the host each row's real width, its slots'
    cache columns [B, W] and the verify pass's numbers per row (meta [5 + 3 S, B]); the same on the
    device."""
    W: int
    need: int  # the columns from each row's anchor on, whose logits the verify pass reads
    S: int  # branch slots
    widths: np.ndarray
    col: np.ndarray
    meta: np.ndarray
    ids_t: Tensor
    pos_t: Tensor
    col_t: Tensor
    anchor_t: Tensor
    k_t: Tensor
    seed_t: Tensor
    g_t: Tensor
    prompt_t: Tensor
    branch_t: Tensor


class SpeculativeBatch:
    """Sequences decoded together, joining and leaving between steps (continuous batching).

        batch = SpeculativeBatch(model)
        sid = batch.add(prompt_ids, SpeculativeParams(gen_length=64), seed=0)
        while len(batch):
            for sid, result in batch.step(): ...

    Not thread-safe: one thread (a server's engine loop) owns the batch and the model. Running
    sequences occupy cache rows 0..N-1 in order; a new one is appended, a finished one is replaced
    by the last row (one copy of that row's kept entries).
    """

    def __init__(self, model: Transformer, eos_ids: list[int] | None = None, max_rows: int | None = None,
                 max_row_tokens: int | None = None, cost: costs.CostModel | None = None,
                 policy: FeedPolicy | None = None) -> None:
        """cost: what a forward costs, for the cost policy (default: measured, costs.cost_model);
        policy: what each row feeds (default: FeedPolicy(model, cost))."""
        cfg = model.config
        # the cache grows geometrically but never past these (a server's limits on rows and columns)
        self.max_rows, self.max_row_tokens = max_rows, max_row_tokens
        self.model, self.mask_id = model, cfg.mask_token_id  # (None: the model runs plain AR rows only)
        self.eos = set(eos_ids if eos_ids is not None else cfg.eos_ids)
        self.device = model.embed_tokens.weight.device
        self.vocab = cfg.vocab_size
        self.is_eos = np.zeros(self.vocab, dtype=bool)  # (a plain step checks its tokens against it on the host)
        self.is_eos[[t for t in self.eos if 0 <= t < self.vocab]] = True
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.cache: RaggedKVCache | None = None
        self.running: list[SpeculativeSeq] = []
        self.pending: list[SpeculativeSeq] = []
        self.next_id = 0
        self.policy = policy if policy is not None else FeedPolicy(model, cost)  # (speculative_policy.py)
        self.sampler = sampler_of(model)  # chains the masks' drafts (model/mask_sampler.py), for rows with sampler
        self.drafting = 0  # running rows that are not plain AR (SpeculativeSeq.plain)
        self.run: PlainRun | None = None  # the plain steps of rows 0..run.B-1 not yet written into them

    def __len__(self) -> int:
        return len(self.running) + len(self.pending)

    def add(self, prompt: list[int], params: SpeculativeParams | None = None, seed: int | None = None,
            on_commit: Callable[..., None] | None = None, plan: list[int] | None = None,
            controls: Controls | None = None) -> int:
        """Queue a sequence; it joins at the next step. on_commit(positions, tokens) streams commits;
        with controls asking for logprobs, on_commit(positions, tokens, logprobs), logprobs a
        controls.Logprobs of exactly those tokens. plan: a draft of the whole answer (response
        positions 0, 1, ...), offered as the draft at the positions each step reaches, verified like
        any draft (the output does not depend on it). controls: a grammar, logit bias, penalties and
        logprobs (controls.py), applied at every verified position, so the output is what `ar`
        with the same controls gives; rows with and without controls share a step."""
        p = params or SpeculativeParams()
        p.check_model(self.model.config)
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab})")
        check_seed(seed)
        if plan is not None and any(not 0 <= t < self.vocab for t in plan):
            raise ValueError(f"plan token ids must lie in [0, {self.vocab})")
        if controls is not None:
            controls.check_vocab(self.vocab)
            if not controls.active:
                controls = None
            elif controls.grammar is not None and not self.is_eos.any():
                raise ValueError("a grammar ends the answer with an end-of-sequence token: give eos_ids (the model's "
                                 "config has none)")
        cfg = self.model.config
        first_from_mask = (p.first_from_mask if p.first_from_mask is not None
                           else self.mask_id is not None and not cfg.causal_first_token)
        if self.mask_id is None:
            if first_from_mask:
                raise ValueError("first_from_mask needs a model with mask_token_id in its config")
            if p.draft_length or p.mask_length or plan is not None:
                raise ValueError("speculative decoding needs a model with a mask token (mask_token_id in "
                                 "config.json): use --decoder ar, or add one with `refusion add-mask-token`")
        # (copies are drafts: a row that drafts nothing keeps no index)
        lookup = p.draft_length > 0 and (p.lookup if p.lookup is not None else lookup_by_default(cfg))
        q = SpeculativeSeq(self.next_id, list(prompt), p, self.mask_id, self.eos, seed or 0, on_commit,
                           causal_first=not first_from_mask, plan=plan, lookup=lookup,
                           fresh_after_miss=(p.fresh_after_miss if p.fresh_after_miss is not None
                                             else fresh_after_miss_by_default(cfg)),
                           fork=p.fork,
                           control=None if controls is None else controlled.RowControl(controls, self.eos, self.vocab))
        self.next_id += 1
        self.pending.append(q)
        return q.sid

    @torch.inference_mode()
    def cancel(self, sid: int) -> DecodeResult | None:
        """Drop a sequence at once (its cache row is freed); returns what it had committed."""
        for i, q in enumerate(self.pending):
            if q.sid == sid:
                return self.pending.pop(i).result()
        for i, q in enumerate(self.running):
            if q.sid == sid:
                self._remove(i)  # (which writes the plain steps into the rows first)
                return q.result()
        return None

    @torch.inference_mode()
    def step(self) -> list[tuple[int, DecodeResult]]:
        """One forward for the running sequences (and one to prefill those that joined); returns
        the sequences that finished in this step with their results."""
        old = len(self.running)
        if self.pending:
            self._admit()
        if not self.running:
            return []
        began = time.perf_counter()  # a step's cost includes choosing its widths
        plain = self.drafting == 0 or not any(not q.plain for q in self.running[:old])  # (rows 0..old-1 step)
        if self.drafting:
            self.policy.choose(self.running, rechoose=len(self.running) == 1 or len(self.running) > old)
        done = []
        for lo, hi, prefill in ((0, old, False), (old, len(self.running), True)):
            if hi > lo:
                if plain and not prefill:
                    done += self._plain_forward(hi, began)
                else:
                    self._forward(lo, hi, prefill, began)
                    done += [i for i in range(lo, hi) if self.running[i].done]
        out = [(self.running[i].sid, self.running[i].result()) for i in done]
        for i in reversed(done):
            self._remove(i)
        return out

    # ---- internals ------------------------------------------------------------------------

    def _admit(self) -> None:
        self.drafting += sum(not q.plain for q in self.pending)
        self.running += self.pending
        self.pending = []
        cfg = self.model.config
        # (a row holding a plan may feed the rest of its answer at once)
        widest = max(q.p.max_width if q.plan is None else max(q.p.max_width, q.p.gen_length + 1) for q in self.running)
        need = max(q.P + q.p.gen_length for q in self.running) + widest + 1
        if self.cache is None:
            self.cache = RaggedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                       self.model.embed_tokens.weight.dtype, self.device,
                                       rows=len(self.running), capacity=need, max_capacity=self.max_row_tokens)
        self.cache.reserve(len(self.running), need, self.max_rows, self.max_row_tokens)

    def _remove(self, i: int) -> None:
        self._flush()  # (rows move: the plain steps go into them first)
        self.drafting -= not self.running[i].plain
        last = len(self.running) - 1
        if i != last:
            self.cache.move_row(last, i, self.running[last].c)
            self.running[i] = self.running[last]
        self.running.pop()

    def _plain_forward(self, B: int, start: float) -> list[int]:
        """The step of rows 0..B-1 where every one is plain AR and past its prefill (plain_run.py).
        Returns the rows that ended."""
        run = self.run
        if run is None or run.B != B:  # (rows join at the end; a removal flushes and drops the run)
            self._flush()
            run = self.run = PlainRun(self.model, self.cache, self.running[:B])
        host = run.step()
        cost = self.policy.cost
        if cost is not None:  # what this step took, its host work included
            cost.note(B, B, time.perf_counter() - start)
        if run.left and not self.is_eos[host].any():
            return []
        self._flush()
        return [i for i in range(B) if self.running[i].done]

    def _flush(self) -> None:
        """Write the plain steps run so far into their rows and drop the run."""
        run, self.run = self.run, None
        if run is not None:
            run.write_back(self.eos)

    def _forward(self, lo: int, hi: int, prefill: bool, start: float) -> None:
        """A generic step of rows lo..hi-1: each feeds its anchor, draft, masks and branches, and
        commits what the verify pass (speculative_judge.py) accepts."""
        if not prefill:
            self._flush()  # (a generic step of rows that stepped plainly before)
        seqs = self.running[lo:hi]
        ruled = [b for b, q in enumerate(seqs) if q.control is not None]  # controlled rows (controlled.py)
        for b in ruled:  # (their drafts: what the grammar forces first, cut where it stops allowing them)
            q = seqs[b]
            q.draft = q.control.prepare(q.draft, jump=q.p.draft_length > 0 and (q.x is not None or q.causal_first),
                                        most=max(q.p.draft_length, len(q.draft)))
            if q.branches:
                q.branches = q.control.prepare_branches(q.draft, q.branches)
        f = self._pack(seqs, [q.next_feed() for q in seqs])
        B, W, need, S, meta = len(seqs), f.W, f.need, f.S, f.meta
        used = max(q.c for q in seqs) + W
        # (one row's columns are one run, c, c + 1, ...: a block copy into the cache, not a scatter)
        cache = self.cache.at(f.col_t, keys=used, row0=lo, first=int(f.col[0, 0]) if B == 1 else None)
        # a query sees every kept column of its row and its own row's fed tokens up to itself
        cols = torch.arange(used, device=self.device)[None, None, :]
        if S or any(q.redraft_len for q in seqs):
            mask = self._branch_mask(seqs, f.col, f.widths, cols, f.col_t)
        else:
            mask = cols <= f.col_t[:, :, None]
        real = packed_index(f.widths, W, self.device)  # ragged rows: only real tokens
        # (the tokens a grammar forced are no evidence of how far drafts go: acceptance counts the rest)
        forced = np.array([min(q.control.forced, q.fed_k) if q.control is not None else 0 for q in seqs])
        predicted = None if prefill else self.policy.predicted(seqs, meta[1] - forced)
        chained = self._chained_masks(seqs, meta[0], need)
        out = self.model(f.ids_t, f.pos_t, attn_mask=mask[:, None], cache=cache, num_logits=need, real=real,
                         states=chained is not None)
        logits, states = (out[0].float(), out[1]) if chained is not None else (out.float(), None)
        if ruled:
            logits = controlled.apply(seqs, ruled, logits, meta[0])
        ids = f.ids_t[:, W - need:]
        j, extra, drafts, went = judge(seqs, logits, ids, f.pos_t[:, W - need:] - f.prompt_t[:, None], f.anchor_t,
                                       f.k_t, f.seed_t, f.g_t, f.branch_t if S else None,
                                       int(meta[5 + 2 * S:].max(initial=0)))
        lps = controlled.logprobs(seqs, ruled, logits, meta[0], ids, extra) if ruled else {}
        if chained is not None:
            drafts = self._chain(drafts, logits, states, j, f.k_t, extra, *chained)
        # the step's one transfer: j, extra, how far each branch went, the drafts (from column 2 + S)
        host = torch.cat([j[:, None], extra[:, None], went, drafts], 1).cpu().numpy()
        kinds = np.array([q.kind for q in seqs])
        self._commit(seqs, lo, f, host, lps)
        self.policy.offer_drafts(seqs)
        if not prefill:
            self.policy.prior.record_many(kinds, np.maximum(host[:, 0] - forced, 0), meta[1] - forced, predicted)
            cost = self.policy.cost
            if cost is not None:  # what this step took, its host work included
                fed = int(f.widths.sum()) if cost.packed else B * W
                cost.note(B, fed, time.perf_counter() - start, B * W - fed)

    def _pack(self, seqs: list[SpeculativeSeq], feeds: list[tuple[list[int], list[int]]]) -> _Packed:
        """The rows' feeds (ids, positions) as one [B, W] batch, right-aligned so that every row's
        anchor..end falls in the last `need` columns, with each row's cache columns and the numbers the
        verify pass needs; one transfer to the device."""
        B = len(seqs)
        W = max(len(ids) for ids, _ in feeds)
        need = max(len(ids) - q.anchor for q, (ids, _) in zip(seqs, feeds, strict=True))  # logits from each anchor on
        packed = np.zeros((3, B, W), dtype=np.int64)  # ids, positions, cache columns
        # anchor's index among the last `need`, draft length, seed, response position the anchor
        # predicts, prompt length; then per branch slot (S of them) its first column among the last
        # `need`, its fork and its length (0: no branch)
        S = max(len(q.fed_branches) for q in seqs)
        meta = np.zeros((5 + 3 * S, B), dtype=np.int64)
        for b, (q, (ids, pos)) in enumerate(zip(seqs, feeds, strict=True)):
            w, off = len(ids), W - len(ids)
            packed[0, b], packed[1, b, off:] = self.pad, pos
            packed[0, b, off:] = ids
            a = need - (w - q.anchor)
            meta[:5, b] = a, q.fed_k, q.seed, len(q.res.tokens), q.P
            for i, (first, at, n, _) in enumerate(q.fed_branches):
                meta[5 + i, b], meta[5 + S + i, b], meta[5 + 2 * S + i, b] = a + first, at, n
        # cache columns: a row's w real tokens take its next w columns and its W - w padding slots the
        # columns after them, where no real query of the row looks (rolled: padding comes first)
        widths = np.array([len(ids) for ids, _ in feeds])
        packed[2] = np.array([q.c for q in seqs])[:, None] + (np.arange(W)[None, :] + widths[:, None]) % W
        dev = torch.from_numpy(np.concatenate([packed.reshape(-1), meta.reshape(-1)])).to(self.device)
        ids_t, pos_t, col_t = dev[: 3 * B * W].view(3, B, W)
        anchor_t, k_t, seed_t, g_t, prompt_t = dev[3 * B * W: 3 * B * W + 5 * B].view(5, B)
        branch_t = dev[3 * B * W + 5 * B:].view(3, S, B).transpose(1, 2).contiguous()  # [3, B, S]
        return _Packed(W, need, S, widths, packed[2], meta, ids_t, pos_t, col_t, anchor_t, k_t, seed_t, g_t,
                       prompt_t, branch_t)

    def _commit(self, seqs: list[SpeculativeSeq], lo: int, f: _Packed, host: np.ndarray,
                lps: dict[int, Logprobs]) -> None:
        """Each row takes what its verify pass accepted (host: j, the extra token, how far each branch
        went, the columns' drafts): the accepted tokens, the branch that went furthest (its KV moved
        after the fork) and the next draft from the masks that drafted from the committed tokens."""
        h = 2 + f.S
        for b, q in enumerate(seqs):
            a, k, j = int(f.meta[0, b]), q.fed_k, int(host[b, 0])
            masks_from = a + 1 + k  # the masks after the anchor and the draft
            won = None  # the branch that went furthest, where one went any way
            for i, (first, at, n, which) in enumerate(q.fed_branches):
                if j == at:  # tested: the first draft was rejected at its fork
                    r, kind = int(host[b, 2 + i]), q.branches[which][2]
                    q.acceptance.record(kind, r, n)
                    self.policy.prior.record(kind, r, n)
                    if r and (won is None or r > won[1]):
                        won = (i, r)
            if won is not None:  # its accepted tokens' KV go to the columns after the fork
                first, at, _, which = q.fed_branches[won[0]]
                self.cache.move_columns(lo + b, q.c + first, q.c + at + 1, won[1])
                q.advance(j, int(host[b, 1]), [], branch=(q.branches[which][1], won[1]))  # (the masks sat behind the first draft)
            elif q.redraft_len:  # (the blocks after the draft's own masks: block j drafts from the accepted tokens)
                r, first = q.redraft_len, a + q.redraft_from
                redrafted = host[b, h + first + j * r + 1: h + first + (j + 1) * r].tolist() if j < k else None
                q.advance(j, int(host[b, 1]), host[b, h + masks_from: h + first].tolist(), redrafted,
                          logprobs=lps[b].cut(j) if b in lps else None)
            else:
                end = a + q.fed_branches[0][0] if q.fed_branches else f.need
                q.advance(j, int(host[b, 1]), host[b, h + masks_from: h + end].tolist(),
                          logprobs=lps[b].cut(j) if b in lps else None)

    def _chained_masks(self, seqs: list[SpeculativeSeq], anchor: np.ndarray, need: int
                       ) -> tuple[Tensor, int] | None:
        """Where this step's masks' drafts may be chained by the sampler, per row (a [4, B] tensor on
        the device): the first column (among the last `need`) of the masks after the draft and how
        many they are, and of the redraft blocks the first column and each block's masks (none of
        either for a row that drafts sampled tokens or asked for no sampler); and the longest block
        of any row. None where no row has a block of two. Every mask of a block is chained, with no
        cap on the chain's length."""
        if self.sampler is None:
            return None
        use = np.array([q.p.sampler and not (q.p.temperature > 0 and q.p.sampled_drafts) for q in seqs])
        first = anchor + 1 + np.array([q.fed_k for q in seqs])
        redraft = np.array([a + q.redraft_from if q.redraft_len else a + q.fed_branches[0][0] if q.fed_branches
                            else need for q, a in zip(seqs, anchor)])
        n = np.where(use, np.maximum(redraft - first, 0), 0)
        r = np.where(use, [q.redraft_len for q in seqs], 0)
        M = int(max(n.max(initial=0), r.max(initial=0)))
        if M < 2:
            return None
        return torch.from_numpy(np.stack([first, n, redraft, r])).to(self.device), M

    def _chain(self, drafts: Tensor, logits: Tensor, states: Tensor, j: Tensor, k: Tensor, extra: Tensor,
               blocks: Tensor, M: int) -> Tensor:
        """drafts [B, N] with the block of masks each row's next draft comes from drafted by the
        sampler (blocks, M: _chained_masks): the masks after the draft where it was accepted whole,
        else the redraft block that saw the accepted tokens, where the row fed them. That block's first
        mask sits where this step's extra token goes, the token its chain starts from. (After a
        rejection without redraft blocks the masks after the draft drafted beside a token that was not
        kept: their chain starts from their own first token.)"""
        B, N = drafts.shape
        first, n, redraft, r = blocks
        again = (j < k) & (r > 0)  # the redraft block j drafts the next step
        first = torch.where(again, redraft + j * r, first)
        n = torch.where(again, r, n)
        i = torch.arange(M, device=drafts.device)[None, :]
        valid = i < n[:, None]
        cols = torch.where(valid, first[:, None] + i, N)  # N: a spare column for the rest
        at = cols.clamp(max=N - 1)
        start = torch.where((j == k) | again, extra, drafts.gather(1, at[:, :1]).squeeze(1))
        rows = torch.arange(B, device=drafts.device)[:, None]
        chain = self.sampler.draft(self.model, states[rows, at], logits[rows, at], start)
        spare = torch.cat([drafts, drafts.new_zeros(B, 1)], 1)
        return spare.scatter(1, cols, torch.where(valid, chain, 0))[:, :N]

    def _branch_mask(self, seqs: list[SpeculativeSeq], col: np.ndarray, fed_w: np.ndarray, cols: Tensor,
                     col_t: Tensor) -> Tensor:
        """The step's attention mask [B, W, used] when rows feed redraft blocks or branches: a query
        sees its row's kept columns and fed tokens up to `upto` (itself, but for block i's masks
        x, d1..di, and for a branch x and the draft up to its fork), and the columns from `own` (its
        block's or branch's first) to itself. col [B, W]: each fed slot's cache column
        (col_t: the same, already on the device)."""
        upto, own = col.copy(), col + 1
        W = col.shape[1]
        for b, q in enumerate(seqs):
            r, x = q.redraft_len, W - fed_w[b]  # x: the row's first slot (right-aligned rows)
            for i in range(q.fed_k if r else 0):
                s = x + q.redraft_from + i * r  # the block's first slot
                upto[b, s:s + r] = col[b, x] + i  # x's column, then d1's, ...
                own[b, s:s + r] = col[b, s]
            for first, at, n, _ in q.fed_branches:
                s = x + first
                upto[b, s:s + n] = col[b, x] + at
                own[b, s:s + n] = col[b, s]
        upto_t, own_t = torch.from_numpy(np.stack([upto, own])).to(self.device)
        at = col_t[:, :, None]
        return (cols <= upto_t[:, :, None]) | ((cols >= own_t[:, :, None]) & (cols <= at))


def _decode(model: Transformer, prompts: list[list[int]], p: SpeculativeParams, seeds: list[int],
            eos_ids: list[int] | None, on_commit: Callable[..., None] | None,
            cost: costs.CostModel | None = None, plans: list[list[int]] | None = None,
            controls: list[Controls | None] | None = None, max_rows: int | None = None) -> list[DecodeResult]:
    """Every prompt in one batch, row r with seeds[r] and controls[r], until none is left; every
    result's seconds the whole decode's (with max_rows: its own, from joining the batch to its end).
    on_commit(row, positions, tokens), with a fourth argument (the tokens' Logprobs, None for a row
    that did not ask) where any row asks for logprobs.
    max_rows: at most this many sequences at once, the next prompt joining as one finishes (a
    server's continuous batch); a row's output does not depend on it."""
    check_max_rows(max_rows)
    batch = SpeculativeBatch(model, eos_ids, cost=cost)
    p.check_model(model.config)
    check_prompts(model.config, prompts, p.gen_length)
    if plans is not None and len(plans) != len(prompts):
        raise ValueError(f"{len(plans)} plans for {len(prompts)} prompts")
    if controls is not None and len(controls) != len(prompts):
        raise ValueError(f"{len(controls)} controls for {len(prompts)} prompts")
    ctl = controls if controls is not None else [None] * len(prompts)
    lp = any(c is not None and c.logprobs is not None for c in ctl)

    def stream(r: int) -> Callable[..., None] | None:
        if on_commit is None:
            return None
        if not lp:
            return lambda pos, tok: on_commit(r, pos, tok)
        return lambda pos, tok, logprobs=None: on_commit(r, pos, tok, logprobs)

    def add(r: int) -> int:
        return batch.add(prompts[r], p, seed=seeds[r], on_commit=stream(r), plan=None if plans is None else plans[r],
                         controls=ctl[r])

    first = len(prompts) if max_rows is None else min(max_rows, len(prompts))
    sids = [add(r) for r in range(first)]
    start = time.perf_counter()
    results: dict[int, DecodeResult] = {}
    while len(batch):
        finished = batch.step()
        results.update(finished)
        for _ in finished:  # (each finished row's place goes to the next prompt, which joins at the next step)
            if len(sids) < len(prompts):
                sids.append(add(len(sids)))
    if max_rows is None:  # (rows that all start together: each is delivered when the call returns)
        seconds = time.perf_counter() - start
        for r in results.values():
            r.seconds = seconds
    return [results[s] for s in sids]


@torch.inference_mode()
def generate_ar(model: Transformer, prompts: list[list[int]], params: ARParams | None = None, *,
                eos_ids: list[int] | None = None, seed: int | list[int] | None = None,
                on_commit: Callable[..., None] | None = None,
                controls: list[Controls | None] | None = None, max_rows: int | None = None) -> list[DecodeResult]:
    """Autoregressive decoding (the `ar` decoder): the batch with no drafts, one token per forward
    (params.ar_batch_params), whose steps are plain (plain_run.py).

    first_from_mask (hidden): take the first response token from a <|mask|> fed at its position (the
    ReFusion objective never trains the prompt's last token to predict it; see the spec, section 5).
    Default: on when the model has a mask token, unless its config says the causal path was trained
    to predict the first token (causal_first_token); a model without a mask token reads it from the
    prompt's last token. A sampled row's token at response position t is drawn with the uniform of
    (seed, t) (sampling.position_uniforms), so a row's output does not depend on the batch and equals
    `speculative`'s with the same seed; every row uses `seed` (a list: one per row), or, when None, a
    seed of its own from torch's global generator. on_commit(row, [position], [token]) for every token
    (streaming). controls: one per prompt (or None), as decode() takes them. max_rows: at most this many
    rows at once (decode()'s batch_size)."""
    p = params or ARParams()
    if isinstance(seed, list):
        seeds = row_seeds(seed, len(prompts))
    elif seed is None and p.temperature > 0:
        seeds = torch.randint(0, 2**63 - 1, (len(prompts),)).tolist()
    else:
        check_seed(seed)
        seeds = [seed or 0] * len(prompts)
    return _decode(model, prompts, ar_batch_params(p, model.config), seeds, eos_ids, on_commit, controls=controls,
                   max_rows=max_rows)


@torch.inference_mode()
def generate_speculative(model: Transformer, prompts: list[list[int]], params: SpeculativeParams | None = None, *,
                         eos_ids: list[int] | None = None, seed: int | list[int] | None = None,
                         on_commit: Callable[..., None] | None = None,
                         cost: costs.CostModel | None = None,
                         plans: list[list[int]] | None = None,
                         controls: list[Controls | None] | None = None,
                         max_rows: int | None = None) -> list[DecodeResult]:
    """Self-speculative decoding of a batch of prompts; on_commit(row, positions, tokens) streams.
    Every sampled sequence draws with the uniforms of `seed` (0 when None; a list: one per prompt), as
    it would alone. cost: what a forward costs, for the cost policy (default: measured). plans: a
    draft answer per prompt (SpeculativeBatch.add). controls: one per prompt (or None), as decode()
    takes them. max_rows: at most this many rows at once (decode()'s batch_size)."""
    p = params or SpeculativeParams()
    seeds = row_seeds(seed, len(prompts)) if isinstance(seed, list) else [seed] * len(prompts)
    return _decode(model, prompts, p, seeds, eos_ids, on_commit, cost, plans, controls, max_rows)
