"""The cost width policy's arithmetic as first written (decoding/widths.py before its per-step host
work was made cheap): numpy over whole arrays, nothing kept between calls. tests/decoding/test_widths.py
checks that the package's versions give exactly these numbers and widths."""

from __future__ import annotations

import numpy as np

# (_bracket, _line and _shares were not rewritten: the reference shares them)
from refusion.decoding.costs import REFRESH_RATE, CostModel, _bracket, _line, _shares
from refusion.decoding.widths import CALIBRATION_WEIGHT, KINDS, PRIOR_MEMORY, PRIOR_WEIGHT, Acceptance


def cost(model: CostModel, rows: int, tokens) -> np.ndarray:
    """CostModel.__call__: both row tables' lines blended, at every token count asked."""
    t = np.asarray(tokens, dtype=float)
    i, f = _bracket(model.rows, rows)
    y = _line(t, model.tokens[i], model.seconds[i])
    if len(model.rows) > 1:
        y = y + f * (np.maximum(_line(t, model.tokens[i + 1], model.seconds[i + 1]), y) - y)
    return np.maximum(y, model.floor)


def observe(model: CostModel, rows: int, tokens: int, seconds: float) -> None:
    """CostModel.observe, with the estimate from cost() above, cell by cell: every cell of the two
    row tables around `rows` by that table's share (not as first written: that moved the two cells
    around `tokens` only and raised the cells past them to no less; then, for a while, the cell at
    or below `tokens` by its share and every cell past it fully)."""
    if model.frozen or not seconds > 0:
        return
    ratio = float(np.clip(seconds / float(cost(model, rows, tokens)), 0.5, 2.0))
    i, f = _bracket(model.rows, rows)
    for r, wr in zip((i, i + 1), _shares(f), strict=True) if len(model.rows) > 1 else ((0, 1.0),):
        for c in range(len(model.seconds[r])):
            model.seconds[r][c] *= ratio ** (REFRESH_RATE * wr)


def _at_least(counts: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(counts, minlength=n + 1)[::-1].cumsum()[::-1][1:]


def record_many(acc: Acceptance, kind: np.ndarray, j: np.ndarray, k: np.ndarray) -> None:
    """Acceptance.record_many: each kind's counts in turn (the Acceptance's counts, nothing else)."""
    n = acc.reached.shape[1]
    acc.reached *= PRIOR_MEMORY
    acc.accepted *= PRIOR_MEMORY
    for s in range(KINDS):
        mine = kind == s
        acc.reached[s] += _at_least(np.minimum(np.minimum(j + 1, k), n)[mine], n)
        acc.accepted[s] += _at_least(np.minimum(j, n)[mine], n)


def mean(acc: Acceptance) -> np.ndarray:
    return (acc.accepted.sum(1) + 1) / (acc.reached.sum(1) + 2)


def prior(acc: Acceptance, n: int) -> np.ndarray:
    return (acc.accepted[:, :n] + PRIOR_WEIGHT * mean(acc)[:, None]) / (acc.reached[:, :n] + PRIOR_WEIGHT)


def best_widths(rate: np.ndarray, bound: np.ndarray, masks: np.ndarray, width: np.ndarray, free: np.ndarray,
                model: CostModel, floor: np.ndarray | None = None) -> np.ndarray:
    """widths.best_widths, with its costs from cost() above."""
    B, K = rate.shape
    w = np.arange(K + 1)
    value = np.concatenate([np.ones((B, 1)), 1 + np.cumsum(np.cumprod(rate, axis=1), axis=1)], axis=1)
    fed = 1 + w + np.where(masks[:, None] >= 0, masks[:, None], np.where(w > 0, w + 1, 0))  # [B, K+1]
    pinned = np.minimum(width, bound)
    floor = np.zeros(B, dtype=np.int64) if floor is None else floor
    rows = np.arange(B)
    if not model.packed:
        common = np.maximum(np.minimum(w[:, None], bound[None, :]), floor[None, :])
        idx = np.where(free[None, :], common, pinned[None, :])  # [K+1, B]
        ratio = value[rows, idx].sum(1) / cost(model, B, B * fed[rows, idx].max(1))
        return idx[int(ratio.argmax())]
    start = np.where(free, floor, pinned)
    gain, cost_in_tokens = np.diff(value, axis=1), np.diff(fed, axis=1)
    valid = free[:, None] & (w[None, 1:] > start[:, None]) & (w[None, 1:] <= bound[:, None])
    key = np.minimum.accumulate(np.where(valid, gain / cost_in_tokens, np.inf), axis=1)
    order = np.argsort(-key.ravel(), kind="stable")
    order = order[valid.ravel()[order]]
    gains, tokens = gain.ravel()[order], cost_in_tokens.ravel()[order]
    v = value[rows, start].sum() + np.r_[0.0, np.cumsum(gains)]
    t = fed[rows, start].sum() + np.r_[0, np.cumsum(tokens)]
    n = int((v / cost(model, B, t)).argmax())
    return start + np.bincount(order[:n] // K, minlength=B)


def calibration(pool: Acceptance) -> np.ndarray:
    """Acceptance.calibration: accepted over predicted per kind, shrunk towards all kinds' ratio."""
    overall = (pool.realized.sum() + CALIBRATION_WEIGHT) / (pool.predicted.sum() + CALIBRATION_WEIGHT)
    return (pool.realized + CALIBRATION_WEIGHT * overall) / (pool.predicted + CALIBRATION_WEIGHT)


def rates(reached: np.ndarray, accepted: np.ndarray, kind: np.ndarray, pool: Acceptance,
          calibrated: bool = True) -> np.ndarray:
    """widths.rates, with the pool's rates from mean() and prior() above."""
    m = mean(pool)[kind]
    own = (accepted.sum(1) + PRIOR_WEIGHT * m) / (reached.sum(1) + PRIOR_WEIGHT)
    base = np.minimum(prior(pool, reached.shape[1])[kind] * (own / m)[:, None], 0.99)
    rate = (accepted + PRIOR_WEIGHT * base) / (reached + PRIOR_WEIGHT)
    if rate.shape[1] == 0 or not calibrated:
        return rate
    first = rate[:, 0] * calibration(pool)[kind]
    rate[:, 0] = np.where(first > rate[:, 0], np.minimum(first, np.maximum(rate[:, 0], 0.99)), first)
    return rate


def expected_accepted(rate: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    run = np.cumprod(rate, axis=1)
    return np.where(np.arange(rate.shape[1])[None, :] < lengths[:, None], run, 0.0).sum(1)


def choose_widths(policy, seqs) -> list[tuple[int, bool]]:
    """FeedPolicy.choose_widths: the (width, bare) it gives each row, without setting them."""
    from refusion.decoding import widths

    free = np.array([q.p.widths == "cost" for q in seqs])
    most = widths.PACKED_BATCH_DRAFT if policy.cost.packed and len(seqs) > 1 else widths.MAX_DRAFT
    room = np.array([max(0, min(q.p.draft_length, most if f else q.p.draft_length, q.p.gen_length - len(q.res.tokens) - 1))
                     for q, f in zip(seqs, free, strict=True)])
    bound = np.minimum(room, [q.draft_end() for q in seqs])
    K = int(room.max())  # (rates are read as far as any row could draft, its draft or not)
    kind = np.array([q.kind for q in seqs])
    reached = np.stack([q.acceptance.reached[q.kind, :K] for q in seqs])
    rate = rates(reached, np.stack([q.acceptance.accepted[q.kind, :K] for q in seqs]), kind, policy.prior)
    masks = np.array([-1 if q.p.mask_length is None else q.p.mask_length for q in seqs])
    width = np.array([q.width for q in seqs])
    unexplored = policy.prior.reached[:, 0] < widths.EXPLORE_POOL
    floor = np.minimum(np.array([q.drafts_tried < widths.EXPLORE or unexplored[q.kind] for q in seqs],
                                dtype=np.int64), bound)
    lengths = np.array([len(q.draft) for q in seqs])

    def choose(bare):  # a bare row: no masks, and no wider than its draft
        short = np.where(bare, np.minimum(bound, lengths), bound)
        return best_widths(rate, short, np.where(bare, 0, masks), width, free, policy.cost, np.minimum(floor, short))

    # a draft of other text goes without masks, unless they pay: their fresh draft (as wide), beyond
    # the held draft's value, times the chance the held draft is accepted whole, per second they add,
    # against the step's expected tokens per second
    bare = free & (kind >= widths.LOOKUP) & (masks < 0)
    chosen = choose(bare)
    fresh_rate = rates(np.stack([q.acceptance.reached[widths.FRESH, :K] for q in seqs]),
                       np.stack([q.acceptance.accepted[widths.FRESH, :K] for q in seqs]),
                       np.full(len(seqs), widths.FRESH), policy.prior)
    held = [float(np.cumprod(rate[i, :w]).sum()) for i, w in enumerate(chosen)]
    fed = [1 + w + (0 if bare[i] else (masks[i] if masks[i] >= 0 else (w + 1 if w else 0))) for i, w in enumerate(chosen)]
    B, total = len(seqs), sum(fed)
    seconds = float(cost(policy.cost, B, total if policy.cost.packed else B * max(fed)))
    ratio = (B + sum(held)) / seconds
    paid = np.zeros(B, dtype=bool)
    for i, w in enumerate(chosen):
        if bare[i] and w > 0:
            worth = float(np.prod(rate[i, :w])) * max(float(np.cumprod(fresh_rate[i, :w]).sum()) - held[i], 0.0)
            wider = total + w + 1 if policy.cost.packed else B * max(max(fed), fed[i] + w + 1)
            paid[i] = worth > ratio * (float(cost(policy.cost, B, wider)) - seconds)
    if paid.any():
        bare = bare & ~paid
        chosen = choose(bare)
    # a row whose draft of other text is worth no token at all drops it for the masks' fresh draft,
    # where that draft, as wide as the row's room, is worth feeding beside the others as chosen
    stale = free & (chosen == 0) & (kind >= widths.LOOKUP) & (masks < 0) & (room > 0)
    if stale.any():
        drafting = np.where(stale, widths.FRESH, kind)
        again = best_widths(rates(np.stack([q.acceptance.reached[k, :K] for q, k in zip(seqs, drafting, strict=True)]),
                                  np.stack([q.acceptance.accepted[k, :K] for q, k in zip(seqs, drafting, strict=True)]),
                                  drafting, policy.prior),
                            np.where(stale, room, bound), np.where(stale, -1, np.where(bare, 0, masks)), chosen,
                            stale, policy.cost)
        for i in np.flatnonzero(stale & (again > 0)):
            bare[i], chosen[i] = False, again[i]
    return [(int(w), bool(b)) if f else (q.width, q.bare) for q, f, b, w in zip(seqs, free, bare, chosen, strict=True)]
