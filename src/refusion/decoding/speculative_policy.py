"""What each row of a self-speculative batch feeds in a step (speculative.py): which draft it holds (the
masks', a copy, the lookup corpus's, a plan), how many of its tokens, with masks behind them or bare,
and which branches beside them (fork).

`FeedPolicy` holds what those choices read beyond the rows themselves: the forward's cost table
(costs.py, measured at first need), the acceptance pooled over the model's recent sequences
(widths.Acceptance) and the model's lookup corpus (corpus.py). The arithmetic of a choice is in
widths.py; this module applies it to a batch's rows. None of it changes an output: greedy output is
AR's whatever is fed, and sampled tokens are position-keyed draws.
"""

from __future__ import annotations

import numpy as np

from refusion.decoding import costs, widths
from refusion.decoding.corpus import corpus_of
from refusion.decoding.params import MAX_BRANCHES, REDRAFT_COST_DRAFT
from refusion.decoding.speculative_seq import SpeculativeSeq
from refusion.model.transformer import Transformer


CPU_BATCH = {"width_price": 1.0, "fork": False}  # what a CPU batch of several rows takes (FeedPolicy.cpu_batch)


def as_cpu_batch(options: dict) -> dict:
    """Speculative options as a CPU batch takes them while several of its rows run (FeedPolicy.cpu_batch):
    two settings whose `as_cpu_batch` agree decode such a batch alike until one row is left, which then
    takes its own."""
    return {**options, **CPU_BATCH}


class FeedPolicy:
    """The choices of what a batch's rows feed each step, and the state they read:

        policy = FeedPolicy(model)
        policy.choose(batch.running, rechoose=True)   # before a step: widths, masks, branches
        policy.offer_drafts(seqs)                      # after it: the draft each row holds next
    """

    def __init__(self, model: Transformer, cost: costs.CostModel | None = None) -> None:
        """cost: what a forward costs (default: measured, costs.cost_model, at the first choice that
        needs it)."""
        self.model = model
        self.cost = cost
        self.prior = widths.prior_for(model)  # acceptance pooled over the model's recent sequences
        self.corpus = corpus_of(model)  # drafts from the model's own earlier answers, for rows with lookup
        self.held = 0  # steps since the widths were last chosen (widths.CHOOSE_EVERY)
        self.priced: dict[float, costs.WidthPriced] = {}  # share -> the cost table so priced (width_price)

    def cost_table(self, seqs: list[SpeculativeSeq] = ()) -> costs.CostModel | costs.WidthPriced:
        """The cost table (measured on first use), as these rows price width: at the lowest share of
        its measured cost any of them asks (SpeculativeParams.width_price), in full in a CPU batch."""
        share = CPU_BATCH["width_price"] if self.cpu_batch(len(seqs)) else min((q.p.width_price for q in seqs),
                                                                                default=1.0)
        if share == 1:
            return self.cost
        if share not in self.priced:  # (kept: its grids are read every step; self.cost is set once)
            self.priced[share] = costs.WidthPriced(self.cost, share)
        return self.priced[share]

    def cpu_batch(self, rows: int) -> bool:
        """Whether a step of `rows` rows is a CPU batch (several rows, a packed cost table). Its forward
        is bound by arithmetic, and there `width_price` below 1 and `fork` fed SmolLM2's chat requests
        slower than AR at batch 8 (docs/adapt.md, "The candidates"): such a step prices width in full,
        and its rows are offered no branches and feed none. A row alone, or a batch on an accelerator, takes them as asked."""
        if self.cost is None:
            self.cost = costs.cost_model(self.model)
        return self.cost.packed and rows > 1

    def choose(self, running: list[SpeculativeSeq], rechoose: bool) -> None:
        """Before a step: each row's width and masks (chosen afresh where `rechoose` or every
        widths.CHOOSE_EVERY steps, else held), then its branches."""
        if rechoose or self.held >= widths.CHOOSE_EVERY - 1:
            self.choose_widths(running)
            self.held = 0
        else:
            self.hold_widths(running)
            self.held += 1
        self.choose_branches(running)

    def choose_widths(self, seqs: list[SpeculativeSeq]) -> None:
        """The cost policy's widths for these rows (widths.best_widths); the others keep theirs."""
        free = [q.p.widths == "cost" for q in seqs]
        if not any(free):
            return
        cost = self.cost_table(seqs)
        # a row drafts at most draft_length tokens (PACKED_BATCH_DRAFT beside others on a CPU), and one
        # fewer than the positions it has left
        most = widths.PACKED_BATCH_DRAFT if cost.packed and len(seqs) > 1 else widths.MAX_DRAFT
        room = [max(0, min(q.p.draft_length, (min(most, REDRAFT_COST_DRAFT) if q.p.redraft else most) if f
                           else q.p.draft_length, q.p.gen_length - len(q.res.tokens) - 1))
                for q, f in zip(seqs, free)]
        bound = [min(r, q.draft_end()) for q, r in zip(seqs, room)]
        K = max(room)
        kind = [q.kind for q in seqs]
        rate = self.rates(seqs, kind, K)
        masks = np.array([-1 if q.p.mask_length is None else q.p.mask_length for q in seqs])
        redraft = np.array([q.p.redraft for q in seqs])
        # a sequence tries a few drafts of its own before the policy may stop it drafting, and a draft
        # of a kind the model has not fed lately is tried (its estimate is only ever corrected by
        # drafts fed; which draft a row holds is still chosen by value: offer_drafts)
        unexplored = self.prior.unexplored()
        bound = np.array(bound)
        floor = np.array([min(int(q.drafts_tried < widths.EXPLORE or unexplored[q.kind]), b) for q, b in zip(seqs, bound)])
        free_a, width = np.array(free), np.array([q.width for q in seqs])
        # a row holding a draft of other text (a copy, the corpus's, a plan) feeds it without masks behind
        # it, unless the masks pay for themselves (masks_pay)
        bare = free_a & (masks < 0) & (np.array(kind) >= widths.LOOKUP)
        lengths = np.array([len(q.draft) for q in seqs])

        def choose(bare: np.ndarray) -> np.ndarray:  # a bare row feeds no masks, and no more than its draft
            short = np.where(bare, np.minimum(bound, lengths), bound)
            return widths.best_widths(rate, short, np.where(bare, 0, masks), width, free_a, cost,
                                      np.minimum(floor, short), redraft & ~bare)

        chosen = choose(bare)
        if bare.any():
            paid = self.masks_pay(seqs, bare, chosen, masks, redraft, rate, K)
            if paid.any():
                bare &= ~paid
                chosen = choose(bare)
        masks = np.where(bare, 0, masks)
        bare = bare.tolist()
        # a row whose draft of other text (a copy, the corpus's, a plan) is not worth feeding at all
        # drops it where the masks' fresh draft is worth feeding: else the next step holds another
        # such draft, and the masks never draft again while the offers keep coming
        stale = np.array([f and w == 0 and k >= widths.LOOKUP and q.p.mask_length is None and r > 0
                          for q, f, w, k, r in zip(seqs, free, chosen.tolist(), kind, room)])
        if stale.any():
            fresh = np.where(stale, widths.FRESH, kind)
            again = widths.best_widths(self.rates(seqs, fresh.tolist(), K), np.where(stale, room, bound),
                                       np.where(stale, -1, masks), chosen, stale, cost, redraft=redraft & stale)
            for i in np.flatnonzero(stale & (again > 0)):
                seqs[i].draft, seqs[i].kind, bare[i], chosen[i] = [], widths.FRESH, False, again[i]
        for q, f, b, w in zip(seqs, free, bare, chosen.tolist()):
            if f:
                q.width, q.bare = w, b

    def rates(self, seqs: list[SpeculativeSeq], kind: list[int], n: int, calibrated: bool = True) -> np.ndarray:
        """[B, n]: each row's acceptance rate per draft position for a draft of the kind given."""
        reached = np.array([q.acceptance.reached[k, :n] for q, k in zip(seqs, kind)])
        accepted = np.array([q.acceptance.accepted[k, :n] for q, k in zip(seqs, kind)])
        return widths.rates(reached, accepted, np.array(kind), self.prior, calibrated)

    def predicted(self, seqs: list[SpeculativeSeq], fed: np.ndarray) -> np.ndarray:
        """[B]: the accepted draft tokens each row's uncalibrated rates predict of the draft it feeds
        now (fed [B] tokens long), for the calibration of the rates (widths.Acceptance.calibration)."""
        n = int(fed.max(initial=0))
        if n == 0:
            return np.zeros(len(seqs))
        return widths.expected_accepted(self.rates(seqs, [q.kind for q in seqs], n, calibrated=False), fed)

    def hold_widths(self, seqs: list[SpeculativeSeq]) -> None:
        """A step between choices keeps every row's width; a row fed bare for a copy feeds masks again
        once the draft it holds is the masks' own."""
        for q in seqs:
            if q.bare and q.kind < widths.LOOKUP:
                q.bare = False

    def choose_branches(self, running: list[SpeculativeSeq]) -> None:
        """How many tokens of each of its branches each forking row feeds this step (fork), branch by
        branch in the row's order: the most expected tokens beyond the first draft's, less what they
        add to the forward's cost at the step's tokens per second, where that is positive. A branch is
        tested only where the first draft is accepted up to its fork and rejected there (the chance of
        that, by the first draft's rates) and no branch fed before it from the same fork was right on
        its first token; it is then accepted as far as this row's and model's branches of its kind
        were lately where they were tested (widths.SECOND, widths.ALTERNATIVE)."""
        for q in running:
            q.branch_widths = [0] * len(q.branches)
        # only a row that forks holds branches, and none is fed in a CPU batch (cpu_batch)
        if not any(q.branches for q in running) or self.cpu_batch(len(running)):
            return
        seqs = [q for q in running if q.x is not None]  # (a prefill never forks)
        left = [q.p.gen_length - len(q.res.tokens) for q in seqs]
        k = np.array([q._fed_draft(n) for q, n in zip(seqs, left)])
        R = max(len(q.branches) if q.fork else 0 for q in seqs)
        if R == 0 or not k.any():
            return
        cost = self.cost_table(seqs)
        B, K = len(seqs), int(k.max())
        L = max(min(len(t), q.p.draft_length) for q in seqs for _, t, _ in q.branches)
        rate = self.rates(seqs, [q.kind for q in seqs], K)
        value = widths.expected_accepted(rate, k)
        upto = np.concatenate([np.ones((B, 1)), np.cumprod(rate, axis=1)], 1)  # [B, K + 1]: reaches position i
        rows = np.arange(B)
        went = {kind: self.rates(seqs, [kind] * B, L) for kind in (widths.SECOND, widths.ALTERNATIVE)}
        gone = {kind: np.cumsum(np.cumprod(r, axis=1), axis=1) for kind, r in went.items()}  # [B, L]
        untested = np.ones((B, K + 1))  # per fork: no branch fed from it so far was right on its first token
        fed = np.array([1 + kk + min(q._masks(), n - kk) for q, kk, n in zip(seqs, k.tolist(), left)])
        n = np.arange(1, L + 1)[None, :]
        seconds = None
        for r in range(R):
            branch = [q.branches[r] if q.fork and r < len(q.branches) else (K, [], widths.SECOND) for q in seqs]
            at = np.array([min(b[0], K) for b in branch])
            room = np.array([min(len(t), q.p.draft_length, m - 1 - f) for (f, t, _), q, m in zip(branch, seqs, left)])
            ask = (room > 0) & (at < k)
            if not ask.any():
                continue
            kinds = [b[2] for b in branch]
            cum = np.stack([gone[kind][i] for i, kind in enumerate(kinds)])
            # accepted up to the fork and rejected there, and no branch before it right there
            tested = upto[rows, at] * (1 - rate[rows, np.minimum(at, K - 1)]) * untested[rows, at]
            gain = np.where(n <= room[:, None], tested[:, None] * cum, -np.inf)
            total = int(fed.sum())
            if cost.packed:
                grid = cost.grid(B, total + L + 1)
                more = grid[total + n] - grid[total]  # [1, L]
                base = float(grid[total])
            else:  # padded to the widest row
                base = float(cost(B, [B * int(fed.max())])[0])
                more = cost(B, (B * np.maximum(fed[:, None] + n, fed.max())).ravel()).reshape(B, L) - base
            if seconds is None:  # the step's tokens per second without branches: what a token added must beat
                seconds = base
                ratio = (B + float(value.sum())) / seconds
            net = np.where(ask[:, None], gain - ratio * more, -np.inf)
            best = net.argmax(1)
            for i in np.flatnonzero(net[rows, best] > 0):
                w = int(best[i]) + 1
                seqs[i].branch_widths[r] = w
                fed[i] += w
                untested[i, at[i]] *= 1 - went[kinds[i]][i, 0]

    def masks_pay(self, seqs: list[SpeculativeSeq], bare: np.ndarray, chosen: np.ndarray, masks: np.ndarray,
                   redraft: np.ndarray, rate: np.ndarray, n: int) -> np.ndarray:
        """[B]: the rows to feed bare (a draft of other text, no masks behind it) at the widths chosen
        whose masks would pay for themselves. Masks draft the next step, and their draft counts only
        where this step accepts the draft it feeds whole: they are worth that chance times what their
        fresh draft (as wide) is expected to commit beyond another draft of the same text (what
        follows an accepted copy is copied too). They pay where that, per second they add to the
        forward, beats the step's expected tokens per second. (The width policy values a row as if
        its draft filled its width, masks fed now drafting the next step, which they do behind a
        draft accepted whole only.)"""
        B = len(seqs)
        ask = bare & (chosen > 0)
        if not ask.any() or n == 0:
            return np.zeros(B, dtype=bool)
        cost = self.cost_table(seqs)
        value = widths.expected_accepted(rate, chosen)  # (a bare row's width is within its draft)
        whole = np.where(chosen > 0, np.cumprod(rate, axis=1)[np.arange(B), np.maximum(chosen - 1, 0)], 1.0)
        fresh = widths.expected_accepted(self.rates(seqs, [widths.FRESH] * B, n), chosen)
        worth = whole * np.maximum(fresh - value, 0.0)
        fed = widths.fed_tokens_of(chosen, np.where(bare, 0, masks), redraft & ~bare)
        m = np.where(ask, widths.fed_tokens_of(chosen, masks, redraft) - fed, 0)  # what the masks would add
        total = int(fed.sum())
        if cost.packed:
            grid = cost.grid(B, total + int(m.max()) + 1)
            seconds, more = float(grid[total]), grid[total + m] - grid[total]
        else:  # padded to the widest row: masks cost what they widen the forward by
            seconds = float(cost(B, [B * int(fed.max())])[0])
            more = cost(B, B * np.maximum(fed + m, fed.max())) - seconds
        ratio = (B + float(value.sum())) / seconds
        return ask & (worth > ratio * more)

    def offer_drafts(self, seqs: list[SpeculativeSeq]) -> None:
        """Offer each row the drafts it has besides the masks': with lookup (SpeculativeParams.lookup),
        a copy of its earlier text (lookup.py) and a continuation from the model's lookup corpus
        (corpus.py); with a plan (add(plan=...)), the plan's tokens from here. A row's next draft is
        whichever of the masks' draft and these has the longest expected accepted prefix (the row's
        own acceptance of each kind, shrunk towards the model's pooled one). A forking row keeps the
        others, and the copy's and the corpus's other ways on, as its branches (branches)."""
        offers = []
        others: dict[int, list[list[int]]] = {}  # a forking row's alternatives (ALTERNATIVE branches)
        # a CPU batch feeds no branches (cpu_batch), so its rows are offered none
        alone = not self.cpu_batch(sum(not q.done for q in seqs))
        for q in seqs:
            if q.done:
                continue
            if q.fork and not alone:
                q.branches = []
            if q.index is not None:
                copy, n = q.index.propose(q.p.draft_length)
                if copy:
                    offers.append((q, copy, widths.lookup_kind(n, q.index.support(n))))
                    if q.fork and alone:
                        others[id(q)] = q.index.alternatives(q.p.draft_length, MAX_BRANCHES)
                if self.corpus is not None:
                    draft, n, contested = self.corpus.offer(q.index.tokens, q.p.draft_length)
                    if draft:
                        offers.append((q, draft, widths.corpus_kind(n, bool(copy), contested)))
                        if q.fork and alone:
                            runner_up = self.corpus.runner_up(q.index.tokens, draft, q.p.draft_length)
                            others.setdefault(id(q), []).extend([runner_up] if runner_up else [])
            if q.text is not None:
                copy, n = q.text.propose(q.p.draft_length)
                if copy:
                    offers.append((q, copy, widths.text_copy_kind(n)))
            if q.plan is not None:
                g = len(q.res.tokens)  # the response position the draft starts at
                if g < len(q.plan):
                    offers.append((q, q.plan[g:], widths.PLAN))
        if not offers:
            return
        n = max(q.p.draft_length for q, _, _ in offers)
        pick = [[q.kind, kind] for q, _, kind in offers]
        reached = np.concatenate([q.acceptance.reached[p, :n] for (q, _, _), p in zip(offers, pick)])
        accepted = np.concatenate([q.acceptance.accepted[p, :n] for (q, _, _), p in zip(offers, pick)])
        lengths = np.array([(min(len(q.draft), q.draft_end()), min(len(draft), q.p.draft_length))
                            for q, draft, _ in offers]).ravel()
        rate = widths.rates(reached, accepted, np.array(pick).ravel(), self.prior)
        value = widths.expected_accepted(rate, lengths).reshape(-1, 2)
        # per row, its drafts by expected value: the one it holds first, then the offers in order
        held: dict[int, list] = {}
        for (q, draft, kind), (masks, offered) in zip(offers, value):
            held.setdefault(id(q), [q, (masks, False, q.draft, q.kind)]).append((offered, kind == widths.PLAN, draft, kind))
        for q, *drafts in held.values():
            drafts.sort(key=lambda d: d[:2], reverse=True)  # (stable; a plan wins a tie: it was asked for)
            _, _, q.draft, q.kind = drafts[0]
            if q.fork and alone:
                q.branches = branches(q.draft, [(d[2], widths.SECOND) for d in drafts[1:]]
                                       + [(d, widths.ALTERNATIVE) for d in others.get(id(q), [])])


def branches(draft: list[int], others: list[tuple[list[int], int]], most: int = MAX_BRANCHES
              ) -> list[tuple[int, list[int], int]]:
    """The branches a row feeds beside `draft`: each of `others` (a draft and its kind, the better
    ones first) that parts from it within both, as (how many tokens the two share, its tokens after
    those, its kind), one per place and token they part with (the first met), up to `most`."""
    out, seen = [], set()
    for other, kind in others:
        s = 0
        for a, b in zip(draft, other):
            if a != b:
                break
            s += 1
        if s < min(len(draft), len(other)) and (s, other[s]) not in seen:
            seen.add((s, other[s]))
            out.append((s, other[s:], kind))
            if len(out) == most:
                break
    return out
