"""How wide each self-speculative step is: the draft tokens (and masks) each sequence feeds
(SpeculativeParams.widths).

- fixed: draft_length drafts and mask_length (default draft_length + 1) masks every step.
- adaptive: a sequence's width goes +2 after a fully accepted draft and -1 after a rejection,
  within [1, draft_length], with width + 1 masks (speculative.py).
- cost (the default): before every step, the widths that maximise the batch's expected committed
  tokens per second, within [0, draft_length], with width + 1 masks (none at width 0: an AR step).

The cost policy weighs two measurements.

What a forward costs (`CostModel`, costs.py): seconds as a function of the batch's rows and of
the tokens the forward computes, measured at first use and kept up to date from the decode's
own step timings.

What a draft is worth (`Acceptance`): per sequence, kind of draft (the masks' fresh predictions
after a fully accepted draft, or what follows a rejection, which is accepted far less often) and
draft position, how often a draft reached that position (every earlier draft token accepted) and
how often it was accepted there. The rate a(i) is their ratio shrunk towards the same ratio
pooled over the sequences this model decoded lately, so a new sequence starts from what the
model's drafts usually do, and a position no draft has reached yet from the pooled mean. A draft
of width w then commits 1 + sum_{i<=w} prod_{l<=i} a(l) tokens in expectation (its accepted
prefix and one more). Every sequence feeds its first EXPLORE drafts whatever they are expected to
be worth, so that a model whose drafts were poor on other prompts is still tried on this one; and
a row holding a draft of a kind with fewer than EXPLORE_POOL recent drafts in the pooled counts
(they decay with every step) feeds at least one token of it, so that a kind judged poor early is
tried again now and then: an estimate is only ever corrected by drafts that are fed. (Which draft
a row holds, the masks' or a copy, is chosen by expected value alone: forcing copies in place of
good mask drafts cost a third of the bundled model's tokens per forward.)

Those rates run high where drafts are fed: a row feeds the kind of draft, and the width, whose
noisy estimates came out best, so the drafts fed are those their estimates flattered (on SmolLM2,
drafts were accepted a quarter to a third less far than their rates predicted). The pooled counts
also keep, per kind, the accepted draft tokens the uncalibrated rates predicted and those accepted,
and their ratio (`Acceptance.calibration`, shrunk towards all kinds' ratio) scales every expected
accepted prefix of that kind: the first position's rate times it.

The choice. On a CPU the cost grows with the total tokens: the rows are widened one draft token
at a time, the most expected tokens per fed token first, and of all those widenings the one with
the best ratio of expected tokens to measured cost is taken (exact whatever the cost's shape).
Where padding costs, each of those counts also pays for the slots its widest row leaves empty,
and the widths with every row drafting up to one common width are weighed as well (the order
above never reaches them when the rows' acceptance differs): the better of the two, the
brute-force optimum or within a few percent of it. Elsewhere the forward is as wide as its widest
row, so every row drafts up to one common width, the one with the best ratio. Either way a few numpy operations on [rows, draft_length] arrays per
step, on the host (plain Python for a batch of one, where numpy's cost per call would be most of
it), the costs looked up in the table evaluated at every whole token count once per refresh.
Rows whose policy is fixed or adaptive (a server's batch mixes requests) keep their widths and
count in the cost and the rate. The choice is myopic (one step's ratio) and steady-state (a row
is valued as if its draft filled its width: masks fed now draft the next step), and sized for
the rows running now: as rows join and leave, the widths follow. A batch of several rows
re-chooses every CHOOSE_EVERY steps and whenever rows join, holding its widths in between (the
choice's host work is a noticeable share of a small model's batched step), and on a CPU drafts at
most PACKED_BATCH_DRAFT tokens per row (measured; docs/speculative.md, "Draft length and widths").
A row whose draft predicts its own EOS drafts no further than it: tokens past an answer's end
are never committed, and counting them made wide drafts look cheap near every answer's end.

Being myopic, the choice undervalues width: what a wider step feeds beyond its draft (masks,
branches) and the longer runs it accepts keep drafting the steps after it. SpeculativeParams.width_price
counts only a share of what each token beyond one per row adds to a forward (costs.WidthPriced):
below 1 the policy feeds wider steps, for more tokens per forward; whether that is also faster
depends on what width costs on the machine (docs/smollm2.md, "Why the drafts go where they go").

Widths never change an output: greedy output is AR's whatever the widths, and sampled tokens are
position-keyed draws (sampling.py). They do change the counters (forwards, tokens fed), which under
the cost policy follow measured timings: use widths fixed or adaptive where counters must repeat.
"""

from __future__ import annotations

import weakref

import numpy as np

from refusion.decoding.corpus import CORPUS_NGRAMS
from refusion.decoding.costs import CostModel
from refusion.decoding.lookup import COPY_AGREED, COPY_SUPPORTS, LOOKUP_NGRAMS
from refusion.decoding.params import MAX_DRAFT
from refusion.model.transformer import Transformer

# a batch of several rows re-chooses its widths every this many steps (and when rows join): the choice's
# host work is a tenth of a small model's batched step, and widths held for a step lose less than that
CHOOSE_EVERY = 3
# a CPU batch of several rows drafts at most this many tokens per row: its widest row sets the width
# attention and the cache see for every row, and the deepest positions' rates are the least measured
# (measured: a bound of 16 beat 32 at batch 8, and 32 beat 16 alone)
PACKED_BATCH_DRAFT = 16
PRIOR_WEIGHT = 2.0  # the pooled rates' weight in a sequence's own, in draft observations
PRIOR_MEMORY = 0.99  # the pooled counts' decay per step: they follow the sequences of late
EXPLORE = 2  # a sequence drafts at least one token until it has fed this many drafts
# a row holding a draft of a kind the model's pooled counts hold fewer recent drafts of than this feeds
# at least one token of it: the counts decay, so a kind judged poor is tried again now and then
EXPLORE_POOL = 1.0
# the estimated rates run high where drafts are fed (a row feeds the kind and the width whose noisy
# estimates came out best): each kind's accepted draft tokens over those its rates predicted, both
# decayed by CALIBRATION_MEMORY a step (a memory of some 500 steps, longer than the counts': a bias,
# not the drafts of late) and shrunk towards all kinds' ratio by CALIBRATION_WEIGHT predicted tokens,
# scales what its drafts are expected to gain (Acceptance.calibration)
CALIBRATION_MEMORY = 0.998
CALIBRATION_WEIGHT = 8.0


# ---- what a draft is worth ------------------------------------------------------------------------


FRESH, AFTER_MISS, LOOKUP = 0, 1, 2  # the kinds of draft a step feeds (Acceptance)
# a copy's kind is LOOKUP + its match's length - 1 + max(LOOKUP_NGRAMS) * how far the text backs it (lookup_kind)
PLAN = LOOKUP + COPY_SUPPORTS * max(LOOKUP_NGRAMS)
CORPUS = PLAN + 1  # PLAN: a draft answer given with the prompt (plan-and-infill's, ReFusionParams.verify)
# a corpus draft's kind is CORPUS + its match's length - 1, apart where a copy is on offer beside it and
# where its first token was contested (corpus_kind); SECOND: another draft on offer fed beside the first
# as a branch (SpeculativeParams.fork), ALTERNATIVE: a copy's or the corpus's other way on fed so; both
# counted only where tested: where the first draft failed at the branch's fork
SECOND = CORPUS + 4 * max(CORPUS_NGRAMS)
ALTERNATIVE = SECOND + 1
# a copy of the prompt's bytes, tokenized afresh (text_copy.py: grammar rows), apart by the bytes matched
TEXT_COPY = ALTERNATIVE + 1
TEXT_COPY_LENGTHS = 4  # (1, 2, 3, 4 or more bytes)
KINDS = TEXT_COPY + TEXT_COPY_LENGTHS


def text_copy_kind(n: int) -> int:
    """The kind of a copy of the prompt's bytes found by matching the answer's last n bytes: a short
    match occurs by chance far more often, so each length up to TEXT_COPY_LENGTHS is counted apart."""
    return TEXT_COPY + min(n, TEXT_COPY_LENGTHS) - 1


def lookup_kind(n: int, support: int = COPY_AGREED) -> int:
    """The kind of a copy found by matching the text's last n tokens, apart by how far the text backs
    it (lookup.NgramIndex.support: where those tokens went on different ways before, a copy of the
    latest goes far less far, and an agreed copy is accepted up to about where they parted)."""
    return LOOKUP + n - 1 + support * max(LOOKUP_NGRAMS)


def corpus_kind(n: int, beside_copy: bool = False, contested: bool = False) -> int:
    """The kind of a draft from the model's lookup corpus found by matching the last n tokens (corpus.py),
    counted apart where a copy of the sequence's own text is on offer too (where the text repeats
    itself, the model follows it rather than its habits, and the corpus's drafts go far less far
    there than elsewhere: SmolLM2, about half as far), and where the vote's first token was contested
    (LookupCorpus.offer)."""
    return CORPUS + n - 1 + max(CORPUS_NGRAMS) * (int(beside_copy) + 2 * int(contested))


class Acceptance:
    """Per kind of draft and draft position (0 = the first draft token): how often a draft reached
    it (every earlier draft token accepted) and how often it was accepted there. The kinds: FRESH,
    the masks' predictions after a fully accepted draft; AFTER_MISS, after a rejection: the rest of
    the old draft (drafted beside the token that was rejected), then the masks'; lookup_kind(n, support), a
    copy of what followed the same n last tokens earlier in the text (lookup.py), apart by how far
    their earlier occurrences agreed on what came next (NgramIndex.support); PLAN, the
    sequence's draft answer at the positions that follow; corpus_kind(n), what the model's lookup
    corpus continues the same n last tokens with (corpus.py), apart where a copy is on offer too and
    where its first token was contested (LookupCorpus.offer); SECOND, another
    draft of those kinds fed beside the first from where they part (a branch), and ALTERNATIVE, a
    branch from a copy's earlier occurrences or the corpus's runner-up, each counted only where the
    first failed there (the chance it then holds is what a branch is worth). They are counted
    apart because they are accepted very differently. Counts change through record and
    record_many only: what is read from them is kept until they do."""

    def __init__(self, n: int = MAX_DRAFT) -> None:
        self.reached = np.zeros((KINDS, n))
        self.accepted = np.zeros((KINDS, n))
        # per kind: accepted draft tokens the rates predicted, and those accepted (calibration())
        self.predicted = np.zeros(KINDS)
        self.realized = np.zeros(KINDS)
        self.kept: dict = {}  # mean(), prior(), expected(), calibration() as last computed

    def record(self, kind: int, j: int, k: int, predicted: float | None = None) -> None:
        """A draft of k tokens of which the first j were accepted (where its rates, uncalibrated,
        predicted `predicted` of them)."""
        self.reached[kind, : min(j + 1, k)] += 1
        self.accepted[kind, :j] += 1
        if predicted is not None:
            self.predicted[kind] += predicted
            self.realized[kind] += j
        self.kept.clear()

    def record_many(self, kind: np.ndarray, j: np.ndarray, k: np.ndarray, predicted: np.ndarray | None = None) -> None:
        """Several drafts at once (a step's rows), after the counts so far decay by PRIOR_MEMORY (and
        the calibration's by CALIBRATION_MEMORY); predicted [B]: what their rates predicted of j."""
        n = self.reached.shape[1]
        self.reached *= PRIOR_MEMORY
        self.accepted *= PRIOR_MEMORY
        if predicted is not None:
            self.predicted *= CALIBRATION_MEMORY
            self.realized *= CALIBRATION_MEMORY
        if len(kind) == 1:  # (the same sums: one draft adds one to each position it reached)
            return self.record(int(kind[0]), int(j[0]), int(k[0]), None if predicted is None else float(predicted[0]))
        if predicted is not None:
            fed = k > 0
            self.predicted += np.bincount(kind[fed], predicted[fed], minlength=KINDS)
            self.realized += np.bincount(kind[fed], j[fed], minlength=KINDS)
        # position i was reached by the drafts with min(j + 1, k) > i, accepted by those with j > i
        for counts, out in ((np.minimum(np.minimum(j + 1, k), n), self.reached), (np.minimum(j, n), self.accepted)):
            m = int(counts.max(initial=0))  # (no count past it: those positions stay as they are)
            out[:, :m] += _at_least(kind, counts, m)
        self.kept.clear()

    def mean(self) -> np.ndarray:
        """Per kind, the rate over every position (with one acceptance and one rejection as its prior)."""
        if "mean" not in self.kept:
            self.kept["mean"] = (self.accepted.sum(1) + 1) / (self.reached.sum(1) + 2)
        return self.kept["mean"]

    def prior(self, n: int) -> np.ndarray:
        """Per kind, pooled rates of the first n positions [KINDS, n], each shrunk towards its kind's mean
        (so a position no draft has reached gets the mean)."""
        if "prior" not in self.kept:
            self.kept["prior"] = (self.accepted + PRIOR_WEIGHT * self.mean()[:, None]) / (self.reached + PRIOR_WEIGHT)
        return self.kept["prior"][:, :n]

    def calibration(self) -> np.ndarray:
        """[KINDS]: per kind, the accepted draft tokens over those its rates predicted, lately (1 with
        no drafts counted), shrunk towards all kinds' ratio."""
        if "calibration" not in self.kept:
            overall = (self.realized.sum() + CALIBRATION_WEIGHT) / (self.predicted.sum() + CALIBRATION_WEIGHT)
            self.kept["calibration"] = ((self.realized + CALIBRATION_WEIGHT * overall)
                                        / (self.predicted + CALIBRATION_WEIGHT))
        return self.kept["calibration"]

    def unexplored(self) -> np.ndarray:
        """[KINDS]: the kinds of draft with fewer than EXPLORE_POOL recent drafts counted."""
        if "unexplored" not in self.kept:
            self.kept["unexplored"] = self.reached[:, 0] < EXPLORE_POOL
        return self.kept["unexplored"]

    def expected(self, n: int) -> np.ndarray:
        """Per kind, the expected accepted prefix of a draft of n tokens at the pooled rates."""
        if ("expected", n) not in self.kept:
            self.kept["expected", n] = expected_accepted(self.prior(n), np.full(KINDS, n))
        return self.kept["expected", n]


def _at_least(kind: np.ndarray, counts: np.ndarray, m: int) -> np.ndarray:
    """[KINDS, m]: per kind, how many of the drafts of that kind (kind [B]) have counts [B] (<= m)
    exceeding each position 0..m-1."""
    per_kind = np.bincount(kind * (m + 1) + counts, minlength=KINDS * (m + 1)).reshape(KINDS, m + 1)
    return per_kind[:, ::-1].cumsum(1)[:, ::-1][:, 1:]


PRIORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its pooled Acceptance


def prior_for(model: Transformer) -> Acceptance:
    """The acceptance pooled over the sequences this model decoded lately (it outlives a batch, so a
    decode() call starts from what the calls before it saw)."""
    if model not in PRIORS:
        PRIORS[model] = Acceptance()
    return PRIORS[model]


def rates(reached: np.ndarray, accepted: np.ndarray, kind: np.ndarray, pool: Acceptance,
          calibrated: bool = True) -> np.ndarray:
    """Each row's acceptance rate per draft position for the kind of draft it feeds next (kind [B]),
    from its own counts of that kind [B, n] shrunk towards the pooled rates, scaled by how the row
    does against the pool overall: a sequence whose drafts do better than the model's usual ones
    expects that at the positions it has not reached yet too. calibrated: the first position's rate
    times the kind's calibration (pool.calibration()), which scales every expected accepted prefix
    by it (each is a sum of products that all hold the first rate), up to a rate of 0.99."""
    mean = pool.mean()[kind]
    own = (accepted.sum(1) + PRIOR_WEIGHT * mean) / (reached.sum(1) + PRIOR_WEIGHT)
    base = np.minimum(pool.prior(reached.shape[1])[kind] * (own / mean)[:, None], 0.99)
    rate = (accepted + PRIOR_WEIGHT * base) / (reached + PRIOR_WEIGHT)
    if calibrated and rate.shape[1]:
        rate[:, 0] = np.minimum(rate[:, 0] * pool.calibration()[kind], np.maximum(rate[:, 0], 0.99))
    return rate


def expected_accepted(rate: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[B]: the expected accepted prefix of drafts of `lengths` [B] tokens, with per-position
    acceptance rates [B, K] (K >= every length): the sum over positions of the chance that every
    draft token up to it is accepted."""
    run = np.cumprod(rate, axis=1)
    return np.where(np.arange(rate.shape[1])[None, :] < lengths[:, None], run, 0.0).sum(1)


# ---- the choice -------------------------------------------------------------------------------------


def best_widths(rate: np.ndarray, bound: np.ndarray, masks: np.ndarray, width: np.ndarray, free: np.ndarray,
                cost: CostModel, floor: np.ndarray | None = None, redraft: np.ndarray | None = None) -> np.ndarray:
    """The widths [B] with the most expected committed tokens per second of one forward.

    rate [B, K]: each row's acceptance rate per draft position; bound [B]: the most draft tokens
    each row may feed (<= K); masks [B]: a row's fixed number of masks, or -1 for width + 1 (none
    at width 0); width [B]: the widths now; free [B]: the rows whose width is chosen here (the
    others keep theirs); floor [B]: the least width of each free row (<= bound); redraft [B]: the
    rows that feed redraft blocks (fed_tokens). Widths are as if
    the draft were there: a row with a shorter draft feeds fewer draft tokens but its masks, which
    draft that far for the next step.
    """
    B, K = rate.shape
    floor = np.zeros(B, dtype=np.int64) if floor is None else floor
    redraft = np.zeros(B, dtype=bool) if redraft is None else redraft
    if B == 1:  # (numpy's cost per call is most of the work at one row)
        return np.array([best_width(rate[0].tolist(), int(bound[0]), int(masks[0]), int(width[0]), bool(free[0]),
                                    cost, int(floor[0]), bool(redraft[0]))])
    # value[b, w]: the tokens a draft of w commits in expectation (ufuncs' own accumulate and reduce:
    # what np.cumsum and .sum() call, without their cost per call)
    value = np.ones((B, K + 1))
    value[:, 1:] += np.add.accumulate(np.multiply.accumulate(rate, axis=1), axis=1)
    pinned = np.minimum(width, bound)
    rows = np.arange(B)
    if not cost.packed:  # padded to the widest row: every row drafts up to one common width
        w = np.arange(K + 1)
        fed = fed_tokens_of(w[None, :], masks[:, None], redraft[:, None])  # [B, K+1]
        common = np.maximum(np.minimum(w[:, None], bound[None, :]), floor[None, :])
        idx = np.where(free[None, :], common, pinned[None, :])  # [K+1, B]
        # (the cost at these K + 1 token counts only: rows x width would make a long grid)
        ratio = np.add.reduce(value[rows, idx], axis=1) / cost(B, B * fed[rows, idx].max(1))
        return idx[int(ratio.argmax())]
    # a CPU computes the rows' tokens: widen one row by one draft token at a time, the best value
    # per token first, and keep the count with the best ratio. Each row's steps are ordered by the
    # running minimum of their value per token, so that every count widens each row by a prefix
    # (its gains shrink with depth, while what a widening feeds stays or, with redraft, grows)
    start = np.where(free, floor, pinned)
    w = np.arange(1, K + 1)  # [K]: the width each widening reaches
    gain = value[:, 1:] - value[:, :-1]
    tokens = np.diff(fed_tokens_of(np.arange(K + 1)[None, :], masks[:, None], redraft[:, None]), axis=1)
    valid = (w > np.where(free, start, bound)[:, None]) & (w <= bound[:, None])
    key = np.minimum.accumulate(np.where(valid, gain / tokens, np.inf), axis=1)
    order = np.flatnonzero(valid)
    order = order[np.argsort(-key.ravel()[order], kind="stable")]
    v = np.zeros(len(order) + 1)  # the value and the tokens after each widening in turn
    t = np.zeros(len(order) + 1, dtype=np.int64)
    np.add.accumulate(gain.ravel()[order], out=v[1:])
    np.add.accumulate(tokens.ravel()[order], out=t[1:])
    v += np.add.reduce(value[rows, start])
    start_fed = fed_tokens_of(start, masks, redraft)
    t += int(np.add.reduce(start_fed))
    seconds = cost.grid(B, int(t[-1]) + 1)[t]
    if not cost.pad:
        n = int((v / seconds).argmax())
        return start + np.bincount(order[:n] // K, minlength=B)
    # padding: attention sees rows x the widest row, so each count also pays for the slots its widest
    # row leaves empty in the others, and widths closer to one common width (a family the order above
    # does not reach) may do better: the best of both
    row, reach = np.divmod(order, K)
    fed = fed_tokens_of(reach + 1, masks[row], redraft[row])
    widest = np.empty(len(fed) + 1, dtype=np.int64)
    widest[0] = start_fed.max()
    widest[1:] = fed
    np.maximum.accumulate(widest, out=widest)
    ratio = v / (seconds + cost.pad * (B * widest - t))
    n = int(ratio.argmax())
    greedy = start + np.bincount(row[:n], minlength=B)
    common = np.maximum(np.minimum(np.arange(K + 1)[:, None], np.where(free, bound, pinned)[None, :]),
                        start[None, :])  # [K + 1, B]: every free row up to one width
    common_fed = fed_tokens_of(common, masks, redraft[None, :])
    ct = common_fed.sum(1)
    cratio = value[rows, common].sum(1) / (cost.grid(B, int(ct.max()) + 1)[ct] + cost.pad * (B * common_fed.max(1) - ct))
    c = int(cratio.argmax())
    return common[c] if cratio[c] > ratio[n] else greedy


def fed_tokens(width: int, masks: int, redraft: bool = False) -> int:
    """What a row feeds at this width: its newest token, the drafts and the masks (masks < 0: width
    + 1, none at width 0); with redraft, a block of them behind every draft token and the newest."""
    m = masks if masks >= 0 else (width + 1 if width else 0)
    return 1 + width + m * (width + 1 if redraft and width else 1)


def fed_tokens_of(width: np.ndarray, masks: np.ndarray, redraft: np.ndarray | bool = False) -> np.ndarray:
    """fed_tokens elementwise, on broadcast arrays."""
    m = np.where(masks >= 0, masks, (width + 1) * (width > 0))
    return 1 + width + m * np.where(np.asarray(redraft) & (width > 0), width + 1, 1)


def best_width(rate: list[float], bound: int, masks: int, width: int, free: bool, cost: CostModel,
               floor: int = 0, redraft: bool = False) -> int:
    """best_widths for one row, in plain Python: the same width, from the same roundings (its
    rate's running products and sums, each widening's gain, one division per width). One row's
    widenings come in order of depth: their value per token never grows (the running minimum)."""
    if not free:
        return min(width, bound)
    if floor >= bound:
        return floor
    value, run, total = [1.0], 1.0, 0.0  # value[w]: as 1 + np.cumsum(np.cumprod(rate))[w - 1]
    for r in rate[:bound]:
        run *= r
        total += run
        value.append(1 + total)
    fed = [fed_tokens(w, masks, redraft) for w in range(bound + 1)]
    seconds = cost.grid(1, fed[bound] + 1)
    best, best_ratio = floor, value[floor] / seconds[fed[floor]]
    gained = 0.0  # the packed choice sums the widenings' gains onto value[floor]
    for w in range(floor + 1, bound + 1):
        gained += value[w] - value[w - 1]
        ratio = (value[floor] + gained if cost.packed else value[w]) / seconds[fed[w]]
        if ratio > best_ratio:
            best, best_ratio = w, ratio
    return best
