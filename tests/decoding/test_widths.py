"""The cost width policy (decoding/widths.py): its cost table, its acceptance counts, its choice
against a brute-force search, and the measured policy end to end (AR's tokens whatever it picks)."""

import copy
import itertools

import numpy as np
import pytest

from refusion.decoding import ARParams, costs, widths
from refusion.decoding.params import COST_DRAFT_LENGTH, MAX_DRAFT
from refusion.decoding import speculative as spec
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.decoding.costs import CostModel
from refusion.decoding.widths import Acceptance, best_widths
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer
from tests.helpers import reference_widths as reference
from tests.helpers.reference_ar import generate_ar

pytestmark = pytest.mark.usefixtures("one_thread")
MEASURED = costs.cost_model  # (conftest.py gives every test a fixed table instead)

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 2, 3]]


def tiny(seed: int = 0, **over) -> Transformer:
    cfg = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
               mask_token_id=23, eos_token_id=1)
    return Transformer(ModelConfig(**{**cfg, **over})).init_weights(seed=seed, std=0.5).eval()


def linear(c0=1e-3, per_row=2e-4, per_token=4e-5):
    return lambda rows, tokens: c0 + per_row * rows + per_token * tokens


# ---- the cost table -------------------------------------------------------------------------------


def test_a_linear_cost_is_interpolated_and_extrapolated_exactly():
    f = linear()
    cost = CostModel.of(f)
    for rows, tokens in [(1, 2), (1, 1), (1, 37), (1, 300), (3, 5), (8, 512), (8, 2000), (16, 40), (64, 900)]:
        assert cost(rows, [tokens])[0] == pytest.approx(f(rows, tokens), rel=1e-9), (rows, tokens)


def test_timings_are_smoothed_into_a_nondecreasing_convex_curve():
    xs = np.array([1.0, 2, 4, 8, 16, 32, 64])
    flat_then_linear = np.array([1.0, 1, 1, 1, 1, 2, 4])  # an accelerator: room, then full
    assert costs._smooth(xs, flat_then_linear).tolist() == flat_then_linear.tolist()
    spiked = np.array([1.0, 1.1, 5.0, 1.4, 2.2, 3.8, 7.0])  # a busy machine's spike at 4, and a noisy 2
    got = costs._smooth(xs, spiked)
    assert got[2] < 1.4 and got[0] == 1.0 and got[-1] == 7.0
    assert (np.diff(got) >= 0).all() and (np.diff(np.diff(got) / np.diff(xs)) >= -1e-12).all()
    assert (got <= spiked + 1e-12).all()


def test_observed_step_times_move_the_table_and_a_frozen_one_stays():
    f = linear()
    frozen = CostModel.of(f)
    live = CostModel(frozen.rows, frozen.tokens, frozen.seconds, packed=True)
    before = float(live(4, [100])[0])
    seen = []
    for _ in range(60):  # the steps take twice what the table says
        live.observe(4, 100, 2 * before)
        frozen.observe(4, 100, 2 * before)
        seen.append(float(live(4, [100])[0]))
    assert all(b >= a for a, b in itertools.pairwise(seen)) and before < seen[0] < seen[-1] <= 2 * before * 1.001
    assert seen[-1] > 1.8 * before
    assert float(frozen(4, [100])[0]) == pytest.approx(before)
    for s in live.seconds:  # still more seconds for more tokens
        assert (np.diff(s) >= 0).all()



def test_a_slower_machine_moves_every_width_alike_and_the_calibrated_shape_stays():
    """Steps of one width only, on a machine 1.3x slower than the table: the estimate there follows,
    and so does every other width of that row count, narrower or wider, by the same factor (the
    calibration's shape kept: moving cells by the width seen flattened the curve past it, or bent it
    up); the table of a row count never seen stays. A faster machine's steps lower it all alike."""
    f = lambda rows, t: 0.047 * max(1.0, t / (6.0 * rows))  # flat to 6 tokens a row, then linear
    live = CostModel.of(f)
    live.frozen = False
    eight = live.seconds[1].copy()
    for _ in range(200):
        live.observe(1, 8, 1.3 * f(1, 8))
    for t in (1, 4, 8, 12, 16, 24, 100):
        assert float(live(1, [t])[0]) == pytest.approx(1.3 * f(1, t), rel=1e-3), t
    assert np.array_equal(live.seconds[1], eight)  # (8 rows' table: no step of 8 rows seen)
    for _ in range(400):
        live.observe(1, 16, 0.5 * f(1, 16))
    for t in (1, 4, 12, 16, 64):
        assert float(live(1, [t])[0]) == pytest.approx(0.5 * f(1, t), rel=1e-3), t
    assert (np.diff(live.seconds[0]) >= 0).all()


def test_noisy_steps_of_a_few_widths_leave_the_widths_never_fed_in_proportion():
    """A long decode feeds a few narrow widths whose timings scatter around the table (noise, a
    context that grows and starts over): the cells of the widths it never feeds keep their ratio to
    the ones it feeds, however many steps. (When every cell past a step's width took its full
    ratio, the cells past the widths fed random-walked upwards, nothing ever brought them back, and
    after a few thousand SmolLM2 steps the 12- and 16-token cells priced twice their cost.)"""
    rng = np.random.default_rng(11)
    live = CostModel.of(linear())
    live.frozen = False
    before = [s.copy() for s in live.seconds]
    for _ in range(5000):
        t = int(rng.integers(1, 9))
        live.observe(1, t, float(live(1, [t])[0]) * float(rng.lognormal(0.05, 0.15)))
    for s, b in zip(live.seconds, before, strict=True):
        assert np.allclose(s / b, (s / b)[0], rtol=1e-9)
    assert not np.allclose(live.seconds[0], before[0])  # (it moved)


def test_noted_step_times_are_observed_in_batches_in_order():
    """A decode notes every step's time; the table moves REFRESH_EVERY notes at a time, exactly as
    observing each in turn would have moved it, and not before."""
    rng = np.random.default_rng(7)
    frozen = CostModel.of(linear())
    noted = CostModel(frozen.rows, frozen.tokens, frozen.seconds, packed=True, pad=1e-5)
    observed = copy.deepcopy(noted)
    timings = [(int(rng.integers(1, 9)), int(rng.integers(1, 200)), float(rng.uniform(1e-3, 1e-2)),
                int(rng.integers(0, 20))) for _ in range(2 * costs.REFRESH_EVERY + 3)]
    for n, timing in enumerate(timings, 1):
        noted.note(*timing)
        if n % costs.REFRESH_EVERY == 0:
            for t in timings[n - costs.REFRESH_EVERY: n]:
                observed.observe(*t)
        assert all(np.array_equal(a, b) for a, b in zip(noted.seconds, observed.seconds, strict=True)), n
        assert len(noted.noted) == n % costs.REFRESH_EVERY
    assert not all(np.array_equal(a, b) for a, b in zip(noted.seconds, frozen.seconds, strict=True))  # (it did move)
    frozen.note(*timings[0])
    assert frozen.noted == []

def test_calibration_measures_the_grid_and_fits_a_short_context():
    model = tiny()
    cost = costs.measure_cost(model)
    assert cost.packed and not cost.frozen and list(cost.rows) == list(costs.CALIBRATION_ROWS)
    for rows, tokens, seconds in zip(cost.rows, cost.tokens, cost.seconds, strict=True):
        assert len(tokens) >= 2 and list(tokens) == [rows * w for w in costs.CALIBRATION_WIDTHS[: len(tokens)]]
        assert tokens[0] == rows  # a plain AR step's cost is measured, not extrapolated
        assert (seconds > 0).all() and (np.diff(seconds) >= 0).all()
    assert cost.pad > 0  # a CPU's ragged batch: its padding's cost was measured
    short = costs.measure_cost(tiny(max_position_embeddings=40))  # 20 cached columns, widths up to 16
    assert max(short.tokens[0]) <= 16


def test_calibration_measures_up_to_its_least_tokens_however_long_forwards_take(monkeypatch):
    """Out of time at once, a row count is still measured to CALIBRATION_TOKENS (two widths at
    least): a table of 1-3 tokens priced every wider step from its last two cells, which a wide step's
    timing then scaled, pricing 2 tokens as 33."""
    monkeypatch.setattr(costs, "CALIBRATION_SECONDS", 0.0)
    cost = costs.measure_cost(tiny())
    assert list(cost.tokens[0]) == [w for w in costs.CALIBRATION_WIDTHS if w <= costs.CALIBRATION_TOKENS]
    assert list(cost.tokens[1]) == [8, 16]


def test_a_measured_table_is_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    """The first process measures and writes the table; the next reads the same numbers without
    measuring; another thread count or model shape is another file; a torn file is measured anew; a
    cache that cannot be written only costs the measuring."""
    import json

    import torch

    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    measured = []
    table = CostModel.of(lambda rows, tokens: 1e-3 * (1 + rows + tokens))

    def measure(model):
        measured.append(model)
        return copy.deepcopy(table)

    monkeypatch.setattr(costs, "measure_cost", measure)
    model = tiny()
    first = costs.stored_cost(model)
    path = costs.cost_path(model)
    assert len(measured) == 1 and path.is_file() and json.loads(path.read_text())["machine"] == costs.machine()
    again = costs.stored_cost(model)
    assert len(measured) == 1 and not again.frozen  # read back, and kept current by the decode as measured ones
    assert again.table() == first.table() == table.table()
    assert np.array_equal(again(8, np.arange(40)), table(8, np.arange(40)))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        assert costs.cost_path(model) != path
    finally:
        torch.set_num_threads(n)
    assert costs.cost_path(tiny(hidden_size=16)) != path
    path.write_text('{"rows": [1, 8], "tok')  # torn
    assert costs.stored_cost(model).table() == table.table() and len(measured) == 2
    assert json.loads(path.read_text())["rows"] == [1.0, 8.0]  # written whole again
    monkeypatch.setenv("REFUSION_CACHE", str(path))  # a file where the folder should be: nothing is written
    assert costs.stored_cost(model).table() == table.table() and len(measured) == 3
    assert not list(tmp_path.glob("**/*.tmp"))


def test_a_streamed_model_has_a_table_per_set_of_product_paths(monkeypatch):
    """A model whose weights stream on a CPU keys its table by the path each row count's product takes
    (model/packed.py's probe): a forward of 8 tokens on the few-row kernel costs otherwise than on
    oneDNN's product. A model that does not stream does not ask."""
    from refusion.model import packed

    choices = [packed.Choices((4, 4, 4), True, range(1, 17))]
    monkeypatch.setattr(packed, "_probe", lambda threads, dtype: choices[0])
    model = tiny()
    small = costs.cost_path(model)
    model.set_streamed(True)
    kernel = costs.cost_path(model)
    choices[0] = packed.Choices((4, 4, 4), True, range(2, 9))
    assert len({small, kernel, costs.cost_path(model)}) == 3
    with packed.without_kernel():
        off = costs.cost_path(model)
    choices[0] = packed.Choices((4, 4, 4), True, range(0))
    assert costs.cost_path(model) == off != kernel
    model.set_streamed(False)
    monkeypatch.setattr(packed, "_probe", lambda threads, dtype: pytest.fail("a model that does not stream asked"))
    assert costs.cost_path(model) == small


# ---- acceptance -----------------------------------------------------------------------------------


def test_acceptance_counts_by_hand():
    F, M = widths.FRESH, widths.AFTER_MISS
    a = Acceptance(6)
    a.record(F, 2, 4)  # positions 0, 1 accepted, 2 rejected, 3 never reached
    a.record(F, 3, 3)  # all accepted
    a.record(F, 0, 0)  # no draft
    a.record(M, 0, 5)  # after a miss: rejected at once
    assert a.reached[F].tolist() == [2, 2, 2, 0, 0, 0] and a.accepted[F].tolist() == [2, 2, 1, 0, 0, 0]
    assert a.reached[M].tolist() == [1, 0, 0, 0, 0, 0] and a.accepted[M].tolist() == [0] * 6
    pooled = Acceptance(6)
    pooled.record_many(np.array([F, F, F, M]), np.array([2, 3, 0, 0]), np.array([4, 3, 0, 5]))
    m = widths.PRIOR_MEMORY
    pooled.record_many(np.array([F]), np.array([5]), np.array([5]))
    assert pooled.reached[F].tolist() == pytest.approx([2 * m + 1, 2 * m + 1, 2 * m + 1, 1, 1, 0])
    assert pooled.accepted[F].tolist() == pytest.approx([2 * m + 1, 2 * m + 1, 1 * m + 1, 1, 1, 0])
    assert pooled.reached[M].tolist() == pytest.approx([m, 0, 0, 0, 0, 0]) and not pooled.accepted[M].any()


def test_rates_follow_a_rows_own_counts_its_kind_of_draft_and_its_standing_against_the_pool():
    F, M = widths.FRESH, widths.AFTER_MISS
    pool = Acceptance(8)
    for _ in range(50):
        pool.record(F, 1, 4)  # the model's fresh drafts: the first token accepted, the second not
        pool.record(M, 0, 4)  # after a miss: nothing accepted
    good = Acceptance(8)
    for _ in range(20):
        good.record(F, 3, 3)  # this sequence's: all three accepted, every time
    new = Acceptance(8)
    r = widths.rates(np.stack([good.reached[F], new.reached[F], new.reached[M]]),
                     np.stack([good.accepted[F], new.accepted[F], new.accepted[M]]), np.array([F, F, M]), pool)
    assert (r[0, :3] > 0.9).all()  # its own counts
    # a position no draft reached: a new sequence expects the pool's mean there, this one more
    assert r[1, 3] == pytest.approx(pool.mean()[F]) and r[0, 3] > 0.9
    assert r[1, 0] > 0.9 > 0.1 > r[1, 1]  # a new sequence: the pool's rates
    assert r[2, 0] < 0.05  # and after a miss, the pool's rates after a miss


# ---- the choice -----------------------------------------------------------------------------------


def brute_force(rate, bound, masks, width, free, floor, cost, redraft=None):
    B, K = rate.shape
    value = np.concatenate([np.ones((B, 1)), 1 + np.cumsum(np.cumprod(rate, 1), 1)], 1)
    choices = [range(floor[b], bound[b] + 1) if free[b] else [min(width[b], bound[b])] for b in range(B)]
    best = 0.0
    for ws in itertools.product(*choices):
        best = max(best, sum(value[b, w] for b, w in enumerate(ws)) / seconds(ws, masks, cost, redraft))
    return best


def seconds(ws, masks, cost, redraft=None) -> float:
    """What the forward of these widths costs: its tokens (packed) or rows x its widest row, and
    what its padding costs on top. redraft: rows feeding a block of masks behind x and every draft token."""
    redraft = [False] * len(ws) if redraft is None else redraft
    fed = [1 + w + (masks[b] if masks[b] >= 0 else (w + 1 if w else 0)) * (w + 1 if redraft[b] and w else 1)
           for b, w in enumerate(ws)]
    B, total = len(ws), sum(fed) if cost.packed else len(ws) * max(fed)
    return cost(B, [total])[0] + cost.pad * (B * max(fed) - total)


def ratio(ws, rate, masks, cost, redraft=None):
    B = len(ws)
    value = np.concatenate([np.ones((B, 1)), 1 + np.cumsum(np.cumprod(rate, 1), 1)], 1)
    return sum(value[b, w] for b, w in enumerate(ws)) / seconds(ws, masks, cost, redraft)


def random_choice(rng, max_rows=4, max_k=6):
    """A random case for best_widths: rates, bounds, masks, widths now, free rows and floors."""
    B, K = int(rng.integers(1, max_rows)), int(rng.integers(1, max_k))
    rate = rng.uniform(0.05, 1.0, (B, K)) ** rng.uniform(0.2, 2)
    bound = rng.integers(0, K + 1, B)
    masks = np.where(rng.random(B) < 0.2, rng.integers(0, 4, B), -1)
    return rate, bound, masks, rng.integers(0, K + 1, B), rng.random(B) < 0.8, np.minimum(rng.integers(0, 2, B), bound)


@pytest.mark.parametrize("redrafting", [False, True])
@pytest.mark.parametrize("packed", [True, False])
def test_the_choice_is_the_best_ratio_of_a_brute_force_search(packed, redrafting):
    rng = np.random.default_rng(0)
    # a CPU's cost (a fixed part, a part per token) and a GPU's (nearly flat until the tokens fill it)
    cost = CostModel.of(linear(), packed) if packed else CostModel.of(lambda r, t: 1e-3 * (1 + max(0, t - 96) / 64),
                                                                       packed)
    for trial in range(300):
        rate, bound, masks, width, free, floor = random_choice(rng)
        B = len(bound)
        redraft = rng.random(B) < 0.5 if redrafting else None
        ws = best_widths(rate, bound, masks, width, free, cost, floor, redraft)
        assert all(floor[b] <= ws[b] <= bound[b] if free[b] else ws[b] == min(width[b], bound[b]) for b in range(B))
        best = brute_force(rate, bound, masks, width, free, floor, cost, redraft)
        assert ratio(ws, rate, masks, cost, redraft) >= best * (1 - 1e-9), trial


def test_a_cpu_batch_pays_for_its_padding():
    """Attention sees rows x the widest row, so on a CPU a wide row beside narrow ones costs its
    padding too: the choice weighs it, and is the brute-force optimum or close to it (it searches
    two families of widths, not every combination)."""
    rng = np.random.default_rng(5)
    exact = 0
    for trial in range(300):
        cost = CostModel.of(linear(), pad=float(rng.choice([5e-6, 2e-5, 4e-5])))
        rate, bound, masks, width, free, floor = random_choice(rng, max_rows=5, max_k=7)
        ws = best_widths(rate, bound, masks, width, free, cost, floor)
        assert all(floor[b] <= ws[b] <= bound[b] if free[b] else ws[b] == min(width[b], bound[b])
                   for b in range(len(bound)))
        got, best = ratio(ws, rate, masks, cost), brute_force(rate, bound, masks, width, free, floor, cost)
        assert got >= 0.95 * best, trial
        exact += got >= best * (1 - 1e-9)
    assert exact >= 280
    # one sequence whose drafts are nearly always accepted beside seven whose drafts never are: it
    # drafts all it may while padding is cheap, and not at all once a padding slot costs half a token
    # (each token it feeds leaves seven slots empty)
    rate = np.vstack([np.full((1, 16), 0.99), np.full((7, 16), 0.01)])
    args = np.full(8, 16), np.full(8, -1), np.zeros(8, dtype=int), np.ones(8, bool)
    assert best_widths(rate, *args, CostModel.of(linear(), pad=1e-5)).tolist() == [16] + [0] * 7
    assert best_widths(rate, *args, CostModel.of(linear(), pad=2e-5)).tolist() == [0] * 8


def test_a_flat_cost_drafts_as_far_as_allowed_and_a_dear_token_not_at_all():
    rate = np.full((3, 8), 0.3)
    bound, masks, width, free = np.array([8, 5, 2]), np.full(3, -1), np.zeros(3, dtype=int), np.ones(3, bool)
    for packed in (True, False):
        flat = CostModel.of(lambda r, t: 1e-3, packed)
        assert best_widths(rate, bound, masks, width, free, flat).tolist() == [8, 5, 2]
        dear = CostModel.of(lambda r, t: 1e-3 * t, packed)
        assert best_widths(rate, bound, masks, width, free, dear).tolist() == [0, 0, 0]


def test_more_rows_draft_less_on_a_cpu():
    """A forward's fixed cost is shared by the rows of a batch, so per row a draft token costs more
    of the step at batch 8 than alone: the same acceptance gets narrower widths."""
    cost = CostModel.of(linear())
    rate = np.full((1, 32), 0.8)
    one = best_widths(rate, np.array([32]), np.array([-1]), np.array([4]), np.array([True]), cost)[0]
    eight = best_widths(np.repeat(rate, 8, 0), np.full(8, 32), np.full(8, -1), np.full(8, 4), np.ones(8, bool), cost)
    assert len(set(eight.tolist())) == 1 and 0 < eight[0] < one


# ---- the per-step arithmetic is the arithmetic as first written (tests/helpers/reference_widths.py) --------


def random_table(rng, packed=None, frozen=False) -> CostModel:
    """A cost table with 1 to 3 row counts and 2 to 7 token counts each, seconds increasing."""
    rows = sorted(rng.choice(np.arange(1, 17), size=int(rng.integers(1, 4)), replace=False).tolist())
    tokens = [[r * w for w in costs.CALIBRATION_WIDTHS[: int(rng.integers(2, 8))]] for r in rows]
    seconds = [np.cumsum(rng.uniform(1e-4, 1e-3, len(t))) for t in tokens]
    packed = bool(rng.integers(2)) if packed is None else packed
    return CostModel(rows, tokens, seconds, packed, frozen)


def test_cost_lookups_and_refreshes_are_the_formulas_as_first_written():
    rng = np.random.default_rng(1)
    for trial in range(30):
        live = random_table(rng)
        ref = copy.deepcopy(live)  # moved by reference.observe only
        for _ in range(30):
            rows, n = int(rng.integers(1, 20)), int(rng.integers(1, 300))
            grid = live.grid(rows, n)
            assert len(grid) >= n and np.array_equal(grid, reference.cost(ref, rows, np.arange(len(grid))))
            t = np.r_[rng.integers(0, 400, 5), rng.uniform(0, 400, 5)]
            assert np.array_equal(live(rows, t), reference.cost(ref, rows, t))
            tokens = int(rng.integers(1, 600))
            seconds = rng.uniform(0.2, 3) * float(reference.cost(ref, rows, [tokens])[0])
            live.observe(rows, tokens, seconds)
            reference.observe(ref, rows, tokens, seconds)
            assert all(np.array_equal(a, b) for a, b in zip(live.seconds, ref.seconds, strict=True)), trial


def test_pooled_counts_and_rates_are_the_formulas_as_first_written():
    rng = np.random.default_rng(2)
    pool, ref = Acceptance(), Acceptance()  # ref: moved by reference.record_many, read by reference.*
    for step in range(300):
        B = int(rng.choice([1, 1, 2, 8]))
        kind = rng.integers(0, widths.KINDS, B)
        k = rng.integers(0, 300, B)  # (past the counts' 256 positions too)
        j = rng.integers(0, k + 1)
        pool.record_many(kind, j, k)
        reference.record_many(ref, kind, j, k)
        assert np.array_equal(pool.reached, ref.reached) and np.array_equal(pool.accepted, ref.accepted), step
        n = int(rng.integers(1, 257))
        assert np.array_equal(pool.mean(), reference.mean(ref))
        assert np.array_equal(pool.prior(n), reference.prior(ref, n))
        want = reference.expected_accepted(reference.prior(ref, n), np.full(widths.KINDS, n))
        assert np.array_equal(pool.expected(n), want)
        own = Acceptance()
        for _ in range(int(rng.integers(0, 20))):
            kk = int(rng.integers(0, 40))
            own.record(int(rng.integers(widths.KINDS)), int(rng.integers(0, kk + 1)), kk)
        kinds = rng.integers(0, widths.KINDS, B)
        K = int(rng.integers(0, 65))
        reached, accepted = own.reached[kinds, :K], own.accepted[kinds, :K]
        want = reference.rates(reached, accepted, kinds, ref)
        assert np.array_equal(widths.rates(reached, accepted, kinds, pool), want)


def random_choice_inputs(rng, B: int, K: int):
    """rate, bound, masks, width, free, floor for best_widths; rates from a few values half the time
    (ties in value per token, within and across rows)."""
    if rng.random() < 0.5:
        rate = rng.choice([0.0, 0.3, 0.5, 0.9, 0.99, 1.0], (B, K))
        if rng.random() < 0.3:
            rate[:] = rate[0]
    else:
        rate = rng.uniform(0.0, 1.0, (B, K)) ** rng.uniform(0.1, 3)
    bound = rng.integers(0, K + 1, B)
    masks = np.where(rng.random(B) < 0.2, rng.integers(0, 5, B), -1)
    width = rng.integers(0, K + 4, B)
    free = rng.random(B) < 0.8
    floor = None if rng.random() < 0.2 else np.minimum(rng.integers(0, 2, B), bound)
    return rate, bound, masks, width, free, floor


def test_the_choice_is_the_choice_as_first_written():
    """best_widths (one row: best_width, in plain Python) picks exactly the reference's widths, at
    batch 1 and 8 and in between, on frozen and refreshed tables, packed and padded."""
    rng = np.random.default_rng(3)
    tables = [CostModel.of(linear(), packed) for packed in (True, False)]
    tables += [CostModel.of(lambda r, t: 1e-3 * (1 + max(0, t - 96) / 64), packed=False)]
    for _ in range(6):
        table = random_table(rng)
        for _ in range(20):
            table.observe(int(rng.integers(1, 10)), int(rng.integers(1, 300)), float(rng.uniform(1e-4, 1e-2)))
        tables.append(table)
    for trial in range(1500):
        B = int(rng.choice([1, 1, 8, 8, int(rng.integers(2, 8))]))
        K = int(rng.integers(0, 65))
        rate, bound, masks, width, free, floor = random_choice_inputs(rng, B, K)
        cost = tables[int(rng.integers(len(tables)))]
        want = reference.best_widths(rate, bound, masks, width, free, cost, floor)
        got = best_widths(rate, bound, masks, width, free, cost, floor)
        assert got.tolist() == want.tolist(), trial
        if B == 1:
            one = widths.best_width(rate[0].tolist(), int(bound[0]), int(masks[0]), int(width[0]), bool(free[0]), cost,
                                    0 if floor is None else int(floor[0]))
            assert one == want[0], trial


def decode_checking_every_choice(monkeypatch, cost: CostModel) -> tuple[int, int, int, int]:
    """Decodes rows of every width policy and lookup mixed, joining and leaving, checking each
    choice against reference.choose_widths on the same state: (choices, most rows at once, rows
    fed bare, held drafts dropped for the masks' fresh ones)."""
    model = tiny(5)
    checked, bare, dropped = [], 0, 0
    plain = FeedPolicy.choose_widths

    def choose(self, seqs):
        nonlocal bare, dropped
        want = reference.choose_widths(self, seqs)
        held = [q.kind for q in seqs]
        plain(self, seqs)
        assert [(q.width, q.bare) for q in seqs] == want
        checked.append(len(seqs))
        bare += sum(q.bare for q in seqs)
        dropped += sum(k >= widths.LOOKUP and q.kind == widths.FRESH for k, q in zip(held, seqs, strict=True))

    monkeypatch.setattr(FeedPolicy, "choose_widths", choose)
    widths.PRIORS.pop(model, None)
    batch = SpeculativeBatch(model, eos_ids=[1], cost=cost)
    settings = [dict(), dict(lookup=True), dict(draft_length=5), dict(lookup=True, draft_length=12, temperature=0.8),
                dict(mask_length=3), dict(widths="adaptive", lookup=True), dict(widths="fixed", draft_length=4)]
    prompts = PROMPTS + [[2, 3, 4, 2, 3, 4, 2, 3], [5, 6, 5, 6, 5]]
    for i in range(3):
        batch.add(prompts[i], SpeculativeParams(gen_length=40, **settings[i]))
    added = 3
    while len(batch):
        batch.step()
        if added < 12 and len(checked) % 2 == 0:  # joining while others run
            params = SpeculativeParams(gen_length=40, **settings[added % len(settings)])
            batch.add(prompts[added % len(prompts)], params, seed=added)
            added += 1
    return len(checked), max(checked), bare, dropped


@pytest.mark.parametrize("packed", [True, False])
def test_every_steps_widths_are_the_widths_as_first_written(monkeypatch, packed):
    choices, most, bare, _ = decode_checking_every_choice(monkeypatch, CostModel.of(linear(), packed))
    assert choices > 20 and most >= 4 and bare > 0  # (copies fed without masks too)


def test_every_steps_widths_are_the_widths_as_first_written_as_timings_move_the_table(monkeypatch):
    """As above on a live table refreshed by each step's timing: timings drawn around the table's
    own estimates, seeded (a decode's real ones make the choices, and the paths they take, differ
    from run to run). Some rows drop the draft they hold for the masks' fresh one."""
    dropped = 0
    for seed in range(1, 4):
        frozen = CostModel.of(linear(per_token=1e-5), True)  # (tokens cheap: masks often worth a fresh draft)
        cost = CostModel(frozen.rows, frozen.tokens, frozen.seconds, True)
        rng, note = np.random.default_rng(seed), cost.note
        with monkeypatch.context() as patch:
            patch.setattr(cost, "note", lambda rows, tokens, seconds, padding=0: note(
                rows, tokens, float(cost(rows, [tokens])[0]) * rng.uniform(0.3, 3.0), padding))
            choices, most, bare, dropped_here = decode_checking_every_choice(patch, cost)
        assert choices > 20 and most >= 4 and bare > 0
        dropped += dropped_here
    assert dropped > 0


# ---- the measured policy, end to end ----------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False])
def test_the_cost_policy_keeps_ar_tokens_with_measured_and_injected_costs(monkeypatch, packed):
    model = tiny(3)
    monkeypatch.setattr(costs, "COSTS", {})
    monkeypatch.setattr(costs, "cost_model", MEASURED)
    want = generate_ar(model, PROMPTS, ARParams(gen_length=24), eos_ids=[1])
    fed = []
    plain = spec.SpeculativeSeq.next_feed

    def next_feed(self):
        ids, pos = plain(self)
        fed.append((self.width, self.fed_k, len(ids), self.p.draft_length))
        return ids, pos

    monkeypatch.setattr(spec.SpeculativeSeq, "next_feed", next_feed)
    injected = None if packed else CostModel.of(lambda r, t: 1e-3, packed=False)  # a GPU's flat cost
    for draft_length in (3, None):
        got = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=24, draft_length=draft_length),
                                   eos_ids=[1], cost=injected)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        sampled = SpeculativeParams(gen_length=24, draft_length=draft_length, temperature=0.9, top_p=0.9)
        got = generate_speculative(model, PROMPTS, sampled, eos_ids=[1], seed=11, cost=injected)
        for p, r in zip(PROMPTS, got, strict=True):
            alone = generate_ar(model, [p], ARParams(gen_length=24, temperature=0.9, top_p=0.9), eos_ids=[1], seed=11)
            assert r.tokens == alone[0].tokens
    assert all(k <= w <= d for w, k, _, d in fed)  # within draft_length, and no more drafts than the width
    if packed:  # measured once for this model's shape and threads, then refreshed by the decodes' steps
        (cost,) = costs.COSTS.values()
        assert not cost.frozen and cost.packed
    else:  # a flat cost: every row drafts as far as it may
        assert max(w for w, _, _, d in fed if d == 32) == 23  # (gen_length 24: at most 23 drafts after a token)



def test_a_batch_chooses_every_few_steps_when_rows_join_and_always_alone(monkeypatch):
    """Several rows re-choose their widths every CHOOSE_EVERY steps and hold them in between; a step
    where rows join chooses; a lone row chooses every step. Held or not, the tokens are AR's."""
    model = tiny(6)
    batch = SpeculativeBatch(model, eos_ids=[], cost=CostModel.of(linear()))
    plain, chose = FeedPolicy.choose_widths, []
    monkeypatch.setattr(FeedPolicy, "choose_widths", lambda self, seqs: chose.append(len(seqs)) or plain(self, seqs))
    lengths = [30, 30, 12]
    sids = [batch.add(p, SpeculativeParams(gen_length=n)) for p, n in zip(PROMPTS[:3], lengths, strict=True)]
    pattern, results = [], {}
    while len(batch):
        before, rows = len(chose), len(batch.running) + len(batch.pending)
        if len(pattern) == 4:
            sids.append(batch.add(PROMPTS[3], SpeculativeParams(gen_length=30)))
            rows += 1
        results.update(batch.step())
        pattern.append((rows, len(chose) > before))
    E = widths.CHOOSE_EVERY
    assert E > 1 and pattern[:4] == [(3, True)] + [(3, False)] * (E - 1) + [(3, True)] * (4 - E)
    assert pattern[4] == (4, True)  # a row joined
    assert all(chosen for rows, chosen in pattern if rows == 1) and any(rows == 1 for rows, _ in pattern)
    for rows, chosen in pattern[5:]:
        assert chosen or rows > 1
    several = [chosen for rows, chosen in pattern[5:] if rows > 1]
    assert sum(several) < len(several)  # held between choices
    want = generate_ar(model, PROMPTS, ARParams(gen_length=30), eos_ids=[])
    assert [results[s].tokens for s in sids] == [w.tokens[:n] for w, n in zip(want, lengths + [30], strict=True)]


def test_a_held_step_feeds_masks_again_behind_the_masks_own_draft():
    """A row fed bare (no masks) for a copy holds its width between choices, but once the draft it
    holds is the masks' own again, masks go behind it: else its next draft would be empty."""
    batch = SpeculativeBatch(tiny(), eos_ids=[], cost=CostModel.of(linear()))
    for p in PROMPTS[:2]:
        batch.add(p, SpeculativeParams(gen_length=20, lookup=True))
    batch.step()
    copy_row, mask_row = batch.running
    for q, kind in ((copy_row, widths.lookup_kind(2)), (mask_row, widths.FRESH)):
        q.bare, q.kind, q.width = True, kind, 3
    batch.policy.hold_widths(batch.running)
    assert copy_row.bare and not mask_row.bare and copy_row.width == mask_row.width == 3
    assert mask_row._masks() == 4

def test_rows_joining_and_leaving_are_sized_with_the_batch_they_are_in():
    """The server's continuous batch: the policy sizes every step for the rows running then."""
    model = tiny(4)
    cost = CostModel.of(linear())
    batch = SpeculativeBatch(model, eos_ids=[], cost=cost)
    p = SpeculativeParams(gen_length=30)
    sizes = []
    plain = FeedPolicy.choose_widths

    def choose(self, seqs):
        plain(self, seqs)
        sizes.append(len(seqs))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FeedPolicy, "choose_widths", choose)
        sids = [batch.add(PROMPTS[0], p)]
        step = 0
        results = {}
        while len(batch):
            results.update(batch.step())
            step += 1
            if step in (2, 3):
                sids.append(batch.add(PROMPTS[step - 1], p))
    assert sizes[:4] == [1, 1, 2, 3] and len(results) == 3
    want = generate_ar(model, PROMPTS[:3], ARParams(gen_length=30), eos_ids=[])
    assert [results[s].tokens for s in sids] == [r.tokens for r in want]



@pytest.mark.parametrize("packed", [True, False])
def test_a_cpu_batch_drafts_at_most_the_packed_batch_bound(packed):
    """Where tokens cost nothing the policy drafts as far as it may: draft_length alone, and
    PACKED_BATCH_DRAFT per row beside other rows on a CPU (a padded device keeps draft_length)."""
    free = CostModel.of(lambda rows, tokens: 1e-3, packed=packed)
    batch = SpeculativeBatch(tiny(), eos_ids=[], cost=free)
    batch.add([2, 3, 4], SpeculativeParams(gen_length=60))  # (the cost policy's draft_length: 32)
    batch.step()
    q = batch.running[0]
    q.draft, q.drafts_tried = [5] * 40, widths.EXPLORE
    batch.policy.choose_widths(batch.running)
    assert q.width == COST_DRAFT_LENGTH > widths.PACKED_BATCH_DRAFT
    batch.add([6, 7], SpeculativeParams(gen_length=60))
    batch.step()
    for r in batch.running:
        r.draft, r.drafts_tried = [5] * 40, widths.EXPLORE
    batch.policy.choose_widths(batch.running)
    want = widths.PACKED_BATCH_DRAFT if packed else COST_DRAFT_LENGTH
    assert [r.width for r in batch.running] == [want, want]

def test_a_draft_that_predicts_its_end_bounds_the_width():
    """Draft tokens past the draft's own EOS would be committed after the answer ended: the cost
    policy's bound stops at it (and with no EOS in the draft, only draft_length bounds it)."""
    m = tiny()
    batch = SpeculativeBatch(m, eos_ids=[1], cost=CostModel.of(lambda rows, tokens: 1e-3))  # tokens cost nothing
    batch.add([2, 3, 4], SpeculativeParams(gen_length=40, draft_length=16))
    batch.step()  # the prefill: the sequence now has a draft
    q = batch.running[0]
    q.draft = [5, 6, 1, 7, 8, 9]
    assert q.draft_end() == 3
    q.drafts_tried = widths.EXPLORE
    batch.policy.choose_widths(batch.running)
    assert q.width == 3  # a free cost would take all 16
    q.draft = [5, 6, 7, 8, 9]
    assert q.draft_end() == MAX_DRAFT
    batch.policy.choose_widths(batch.running)
    assert q.width == 16


# ---- calibration --------------------------------------------------------------------------------


def test_calibration_by_hand():
    """Per kind, accepted over predicted draft tokens, shrunk towards all kinds' ratio by
    CALIBRATION_WEIGHT predicted tokens; a row that fed no draft counts for nothing; the sums decay
    by CALIBRATION_MEMORY a step."""
    F, C = widths.FRESH, widths.lookup_kind(2)
    pool = Acceptance(8)
    assert np.array_equal(pool.calibration(), np.ones(widths.KINDS))  # nothing counted: 1
    pool.record_many(np.array([F, F, C, C]), np.array([1, 0, 3, 0]), np.array([4, 4, 3, 0]),
                     np.array([2.0, 2.0, 2.0, 5.0]))
    W = widths.CALIBRATION_WEIGHT
    overall = (4 + W) / (6 + W)
    want = np.full(widths.KINDS, overall)
    want[F], want[C] = (1 + W * overall) / (4 + W), (3 + W * overall) / (2 + W)
    assert np.allclose(pool.calibration(), want)
    pool.record_many(np.array([C]), np.array([0]), np.array([2]), np.array([1.5]))
    d = widths.CALIBRATION_MEMORY
    pred, real = np.array([4 * d, 2 * d + 1.5]), np.array([1 * d, 3 * d])
    overall = (real.sum() + W) / (pred.sum() + W)
    assert np.allclose(pool.calibration()[[F, C]], (real + W * overall) / (pred + W))


def test_calibrated_rates_scale_every_expected_prefix_by_the_kinds_factor():
    rng = np.random.default_rng(0)
    pool = Acceptance(8)
    kinds = rng.integers(0, widths.KINDS, 64)
    pool.record_many(kinds, rng.integers(0, 6, 64), rng.integers(1, 8, 64), rng.uniform(0, 6, 64))
    reached = rng.integers(0, 5, (6, 8)).astype(float)
    accepted = np.minimum(reached, rng.integers(0, 5, (6, 8)))
    kind = np.array([0, 1, 3, 5, 9, widths.KINDS - 1])
    plain = widths.rates(reached, accepted, kind, pool, calibrated=False)
    calibrated = widths.rates(reached, accepted, kind, pool)
    factor = pool.calibration()[kind]
    for n in range(1, 9):
        got = widths.expected_accepted(calibrated, np.full(6, n))
        want = widths.expected_accepted(plain, np.full(6, n))
        low = factor <= 1  # (above 1 the first rate stops at 0.99)
        assert np.allclose(got[low], factor[low] * want[low])
        assert np.all(got[~low] >= want[~low])
    assert np.array_equal(calibrated, reference.rates(reached, accepted, kind, pool))


def test_a_decode_counts_what_the_uncalibrated_rates_predicted(monkeypatch):
    """Each decode step records, for the pool's calibration, the accepted tokens its rows' rates
    (uncalibrated) predicted of the drafts they fed: the reference's rates and expected prefix."""
    model = tiny(5)
    widths.PRIORS.pop(model, None)
    seen = []
    plain = FeedPolicy.predicted

    def predicted(self, seqs, fed):
        got = plain(self, seqs, fed)
        n = int(fed.max(initial=0))
        if n:
            rate = reference.rates(np.stack([q.acceptance.reached[q.kind, :n] for q in seqs]),
                                   np.stack([q.acceptance.accepted[q.kind, :n] for q in seqs]),
                                   np.array([q.kind for q in seqs]), self.prior, calibrated=False)
            assert np.allclose(got, reference.expected_accepted(rate, fed))
            seen.append(got)
        return got

    monkeypatch.setattr(FeedPolicy, "predicted", predicted)
    generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=24, lookup=True), eos_ids=[1],
                         cost=CostModel.of(linear()))
    assert len(seen) > 5 and widths.prior_for(model).predicted.sum() > 0
