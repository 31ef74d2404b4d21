"""One row of a speculative decode (decoding/speculative.py): its committed tokens and cache
columns, the draft it holds for the positions after its newest token, the width its next step
feeds, the branches on offer, and how far its drafts were accepted (widths.Acceptance). Host
state only: the batch feeds it (next_feed) and commits what each step verified (advance)."""

from __future__ import annotations

import time
from collections.abc import Callable

from refusion.decoding import widths
from refusion.decoding.common import DecodeResult
from refusion.decoding.controlled import RowControl
from refusion.decoding.controls import Logprobs
from refusion.decoding.lookup import NgramIndex
from refusion.decoding.params import MAX_DRAFT, SpeculativeParams
from refusion.decoding.text_copy import TextCopy


class SpeculativeSeq:
    """One sequence of a SpeculativeBatch: committed tokens (all but the newest, x, have their KV
    in cache columns [0, c)), the draft for the positions after x, its width (the most draft tokens
    its next step feeds) and how far its drafts were accepted. seed: the key of its sampled draws;
    lookup: whether it also drafts copies of earlier text (p.lookup as the batch settled it);
    fresh_after_miss: p.fresh_after_miss, settled the same way; fork: p.fork (off for a row with
    control: its controls' state, controlled.py)."""

    def __init__(self, sid: int, prompt: list[int], p: SpeculativeParams, mask_id: int, eos: set[int],
                 seed: int, on_commit: Callable[[list[int], list[int]], None] | None,
                 causal_first: bool = False, plan: list[int] | None = None, lookup: bool = False,
                 fresh_after_miss: bool = False, fork: bool = False, control: RowControl | None = None) -> None:
        self.sid, self.prompt, self.p, self.mask_id, self.eos = sid, prompt, p, mask_id, eos
        self.seed, self.on_commit, self.fresh_after_miss, self.fork = seed, on_commit, fresh_after_miss, fork
        self.control = control
        self.P = len(prompt)
        # the first token from the prompt's last token (a model trained for it: causal_first_token),
        # else from the first mask; either way the masks fed after the prompt draft from position P on
        self.causal_first = causal_first and self.P > 0
        self.c = 0
        self.x: int | None = None  # None until the prefill has run
        self.draft: list[int] = []
        # (the cost policy sets the width before every step, the first included)
        self.width = p.draft_length if p.widths == "fixed" else min(p.draft_length, 4)
        self.acceptance = widths.Acceptance()
        self.kind = widths.FRESH  # of the draft its next step feeds
        self.drafts_tried = 0  # steps that fed a draft
        self.done = False
        self.res = DecodeResult(prompt=list(prompt))
        if control is not None and control.c.logprobs is not None:
            self.fork = False  # (a branch's logprobs would come from other columns: controlled.py)
            self.res.logprobs = Logprobs()
        self.start = time.perf_counter()
        self.fed_k = 0  # draft tokens fed in the step now running
        self.index = NgramIndex(prompt) if lookup else None  # the text lookup drafts copy from
        g = control.c.grammar if control is not None else None
        self.text = TextCopy(prompt, g.text, g.tokens) if lookup and g is not None else None  # (its bytes)
        self.plan = plan  # a draft answer, by response position (SpeculativeBatch.add)
        if plan and self.causal_first:  # the prefill can verify it: the prompt's last token predicts its first
            self.draft, self.kind = list(plan), widths.PLAN
        self.bare = False  # this step feeds its draft without masks behind it (a copy: FeedPolicy.choose_widths)
        # redraft: this step's blocks of masks behind x and each draft token but the last, each seeing
        # the draft up to its own place only: feed index of the first, and each one's length (0: none)
        self.redraft_from = self.redraft_len = 0
        # fork: other drafts of the same positions (FeedPolicy.offer_drafts, best first), each kept from where it parts
        # from the draft: (that fork, its tokens from there, its kind); this step feeds branch_widths[i]
        # tokens of branch i (FeedPolicy.choose_branches) after the masks: per branch fed, (feed index of its first
        # token, fork, tokens fed, index in branches)
        self.branches: list[tuple[int, list[int], int]] = []
        self.branch_widths: list[int] = []
        self.fed_branches: list[tuple[int, int, int, int]] = []
        self.anchor = 0  # feed index whose logits give the first token of this step
        # plain AR: no draft budget, no masks, no plan; after its prefill each step feeds x alone, which
        # the batch runs without the policy or this row's bookkeeping (plain_run.py)
        # (a controlled row steps generically: its verified column's logits are controlled)
        self.plain = p.draft_length == 0 and not p.mask_length and plan is None and control is None

    def _masks(self) -> int:
        if self.bare:
            return 0
        if self.p.mask_length is not None:
            return self.p.mask_length
        return self.width + 1 if self.width > 0 else 0

    def _fed_draft(self, left: int) -> int:
        """How many draft tokens this step feeds: up to its width, but a plan whole (one forward
        verifies a right one, and the forwards saved are what a plan is asked for)."""
        k = min(len(self.draft), left - 1 if self.kind == widths.PLAN else self.width, left - 1)
        # (the tokens a grammar forces are fed whatever the width: controlled.RowControl.prepare)
        return k if self.control is None else max(k, min(self.control.forced, left - 1))

    def next_feed(self) -> tuple[list[int], list[int]]:
        """(ids, positions) of this step's feed; its cache columns are c, c+1, ..."""
        left = self.p.gen_length - len(self.res.tokens)  # positions still to fill
        if self.x is None:  # prefill: the prompt, then masks; the first token is read from the first mask
            # (or from the prompt's last token, which then verifies a draft fed after it: a plan)
            k = self._fed_draft(left) if self.causal_first else 0
            # (from the prompt's last token, masks are fed only where they draft)
            m = min(self._masks(), left - k) if self.causal_first else max(1, min(self._masks(), left))
            self.draft = self.draft[:k]
            ids = self.prompt + self.draft + [self.mask_id] * m
            self.anchor, self.fed_k = self.P - self.causal_first, k
            start = 0
        else:
            k = self._fed_draft(left)
            m = min(self._masks(), left - k)
            self.draft = self.draft[:k]  # unfed draft tokens would sit where the masks go
            ids = [self.x] + self.draft + [self.mask_id] * m
            self.anchor, self.fed_k = 0, k
            start = self.P + len(self.res.tokens) - 1  # x's position
        pos = list(range(start, start + len(ids)))
        self.redraft_from = self.redraft_len = 0
        self.fed_branches = []
        for i, ((at, tokens, _), w) in enumerate(zip(self.branches, self.branch_widths)):
            # a branch's tokens see x and the draft's first `at` tokens, then their own
            n = min(w, len(tokens), left - 1 - at)
            if self.x is not None and at < k and n > 0:
                self.fed_branches.append((len(ids), at, n, i))
                ids += tokens[:n]
                pos += range(start + at + 1, start + at + 1 + n)
        if self.p.redraft and self.x is not None and k and m:
            # block i drafts from x, d1..di: its masks sit at the positions after d_i's (after x's for i = 0)
            self.redraft_from, self.redraft_len = len(ids), m
            for i in range(k):
                ids += [self.mask_id] * m
                pos += range(start + i + 1, start + i + 1 + m)
        self.res.forwards += 1
        self.res.tokens_fed += len(ids)
        return ids, pos

    def advance(self, j: int, extra: int, mask_preds: list[int], redrafted: list[int] | None = None,
                branch: tuple[list[int], int] | None = None, logprobs: Logprobs | None = None) -> None:
        """Commit the first j draft tokens and `extra`; keep their KV; make the next draft (after a
        rejection, `redrafted` when this step fed redraft blocks: the draft from the accepted tokens).
        branch: (a branch's tokens, r) where that branch went further (j is its fork): its first r
        tokens come after the draft's j (the decoder has moved their KV to the columns after those).
        logprobs: of the j draft tokens and extra, where the row's controls ask for them."""
        prefill = self.x is None
        k = self.fed_k
        run = self.draft[:j] + (branch[0][:branch[1]] if branch is not None else [])
        commit = (run + [extra])[: self.p.gen_length - len(self.res.tokens)]
        eos_at = next((i for i, t in enumerate(commit) if t in self.eos), None)
        if eos_at is not None:
            commit = commit[: eos_at + 1]
        if self.control is not None:  # (it may end the row at once: controlled.RowControl.commit)
            commit, logprobs = self.control.commit(commit, logprobs, self.p.gen_length - len(self.res.tokens))
            eos_at = len(commit) - 1 if commit and commit[-1] in self.eos else None
            if logprobs is not None:
                self.res.logprobs.extend(logprobs)
        g = len(self.res.tokens)
        positions = list(range(self.P + g, self.P + g + len(commit)))
        self.res.tokens += commit
        self.res.positions += positions
        self.res.steps += [self.res.forwards - 1] * len(commit)
        if eos_at is not None or len(self.res.tokens) >= self.p.gen_length:
            self.done = True
            self.res.finished = eos_at is not None
        if prefill and not self.causal_first:
            self.c = self.P
            self.draft = mask_preds  # (the first mask's prediction was `extra`)
        else:
            # the prompt (prefill) or x, and the accepted drafts: their KV was computed by this forward
            self.c = self.P + j if prefill else self.c + len(run) + 1
            # after a mismatch the rest of the old draft still guesses the positions after `extra`;
            # after a full accept `extra` took the first mask's position
            if branch is not None:  # (the masks sat behind the first draft)
                self.draft = [] if self.fresh_after_miss else branch[0][branch[1] + 1:]
            elif redrafted is not None and j < k:
                self.draft = redrafted
            elif j < k and self.fresh_after_miss:
                self.draft = []  # the next step's masks draft from the committed tokens
            else:
                self.draft = self.draft[j + 1:] + mask_preds if j < k else mask_preds[1:]
        f = min(self.control.forced, k) if self.control is not None else 0  # (forced: no evidence for the widths)
        if k > f:
            self.acceptance.record(self.kind, max(j - f, 0), k - f)
        if not prefill or k:
            self.drafts_tried += k > 0
            self.kind = widths.FRESH if j == k or redrafted is not None or self.fresh_after_miss else widths.AFTER_MISS
            if self.p.widths == "adaptive" and self.p.draft_length > 0:
                self._adapt(j, k)
        else:
            self.kind = widths.FRESH  # (a plan not fed with the prompt: the masks drafted)
        self.x = extra
        self.branches, self.branch_widths = [], []
        if self.index is not None:
            self.index.extend(commit)
        if self.text is not None:
            self.text.extend([t for t in commit if t not in self.eos])
        if self.on_commit is not None and commit:
            if logprobs is not None:
                self.on_commit(positions, commit, logprobs)
            else:
                self.on_commit(positions, commit)

    def draft_end(self) -> int:
        """How many draft tokens are worth feeding before the draft's own EOS (every one, with
        none): a draft predicting that the answer ends there makes wider ones a waste."""
        if self.eos.isdisjoint(self.draft):
            return MAX_DRAFT
        return next((i + 1 for i, t in enumerate(self.draft) if t in self.eos), MAX_DRAFT)

    def _adapt(self, j: int, k: int) -> None:
        self.width = min(self.p.draft_length, self.width + 2) if j == k else max(1, self.width - 1)

    def result(self) -> DecodeResult:
        self.res.seconds = time.perf_counter() - self.start
        return self.res
