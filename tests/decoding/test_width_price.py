"""SpeculativeParams.width_price: the cost policy reads its table with only that share of what tokens
beyond one per row add (costs.WidthPriced). The decode is then exactly the decode on a table built
that way, feeds wider forwards than at full price, and keeps AR's output."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.decoding import costs, widths
from refusion.decoding.speculative import SpeculativeBatch, SpeculativeParams, generate_speculative
from refusion.decoding.speculative_policy import FeedPolicy
from tests.decoding.test_decoding_speculative import PROMPTS, ar, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def cpu_like(rows: int, tokens: int) -> float:
    """A CPU's shape: a forward of one token per row dear, each token more a fifth of it."""
    return 1e-3 * (1 + 0.1 * rows + 0.2 * tokens)


def test_the_price_counts_that_share_of_every_token_beyond_one_per_row_by_hand():
    table = costs.CostModel.of(cpu_like, pad=1e-5)
    half = costs.WidthPriced(table, 0.5)
    # one row: a token costs 1.3e-3; 11 tokens 3.3e-3, of which half the 2e-3 beyond the first counts
    assert half(1, [1, 11]).tolist() == pytest.approx([1.3e-3, 1.3e-3 + 0.5 * 2e-3])
    # eight rows: eight tokens (one each) 3.4e-3; 18 tokens 5.4e-3
    assert half(8, [18]).tolist() == pytest.approx([3.4e-3 + 0.5 * 2e-3])
    g, h = table.grid(1, 40), half.grid(1, 40)
    assert len(h) >= 40 and h[1] == pytest.approx(g[1]) and h[30] == pytest.approx(g[1] + 0.5 * (g[30] - g[1]))
    assert half.pad == 0.5e-5 and half.packed and half.floor == table.floor
    assert costs.WidthPriced(table, 1.0)(1, [7]).tolist() == pytest.approx(table(1, [7]).tolist())


def test_a_priced_grid_is_kept_until_its_table_moves():
    table = costs.CostModel.from_table(costs.CostModel.of(cpu_like).table())  # (live: observe() moves it)
    half = costs.WidthPriced(table, 0.5)
    g = half.grid(1, 20)
    assert half.grid(1, 20) is g and half.grid(1, 5) is g
    table.observe(1, 10, 2 * float(table(1, [10])[0]))  # a step took twice its estimate: the table rises
    moved = half.grid(1, 20)
    assert moved is not g and moved[12] > g[12]
    t = table.grid(1, 20)
    assert moved.tolist() == pytest.approx((t[1] + 0.5 * (t - t[1])).tolist())


def test_the_policy_keeps_its_priced_table_per_share():
    model = tiny_model(0)
    batch = SpeculativeBatch(model, eos_ids=[], cost=costs.CostModel.of(cpu_like, packed=False))  # (batches priced)
    batch.add(PROMPTS[0], SpeculativeParams(gen_length=8, width_price=0.5))
    batch.add(PROMPTS[1], SpeculativeParams(gen_length=8, width_price=0.25))
    batch.step()
    policy: FeedPolicy = batch.policy
    first = policy.cost_table(batch.running)
    assert first.share == 0.25 and policy.cost_table(batch.running) is first
    assert policy.cost_table(batch.running[:1]).share == 0.5 and policy.cost_table(batch.running) is first


def discounted(share: float):
    def seconds(rows: int, tokens: int) -> float:
        base = cpu_like(rows, rows)
        return base + share * (cpu_like(rows, tokens) - base)
    return seconds


def decode(model, params: SpeculativeParams, cost: costs.CostModel) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone: the outputs and every forward's tokens."""
    fed = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: fed.append(args[0].numel()), with_kwargs=True)
    try:
        out = []
        for p in PROMPTS:
            widths.PRIORS.pop(model, None)
            out += [r.tokens for r in generate_speculative(model, [p], params, eos_ids=[], cost=cost)]
    finally:
        hook.remove()
    return out, fed


@pytest.mark.parametrize("fork", [False, True])
def test_a_share_is_the_decode_on_a_table_priced_so_and_feeds_wider(fork):
    model = tiny_model(1)
    want = [r.tokens for r in ar(model, PROMPTS, 40, [])]
    priced = SpeculativeParams(gen_length=40, lookup=True, fork=fork, width_price=0.25)
    plain = SpeculativeParams(gen_length=40, lookup=True, fork=fork)
    out, fed = decode(model, priced, costs.CostModel.of(cpu_like))
    assert out == want
    assert decode(model, plain, costs.CostModel.of(discounted(0.25))) == (out, fed)
    full_out, full_fed = decode(model, plain, costs.CostModel.of(cpu_like))
    assert full_out == want
    assert sum(fed) / len(fed) > sum(full_fed) / len(full_fed)  # wider forwards, on average


@pytest.mark.parametrize("packed", [False, True])
def test_a_batch_prices_width_at_the_lowest_share_its_rows_ask_but_on_a_cpu(packed):
    """On an accelerator's table a batch counts the lowest share its rows ask; a CPU batch (a packed
    table, several rows) counts width in full, and a row alone its own share (FeedPolicy.cpu_batch)."""
    model = tiny_model(0)
    table = costs.CostModel.of(cpu_like, packed=packed)
    batch = SpeculativeBatch(model, eos_ids=[], cost=table)
    for share in (1.0, 0.5, 0.75):
        batch.add(PROMPTS[0], SpeculativeParams(gen_length=20, width_price=share))
    batch.step()
    policy: FeedPolicy = batch.policy
    if packed:
        assert policy.cost_table(batch.running) is table
    else:
        assert policy.cost_table(batch.running).share == 0.5
    assert policy.cost_table(batch.running[1:2]).share == 0.5
    assert policy.cost_table(batch.running[:1]) is table and policy.cost_table() is table


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, True, "half", float("nan")])
def test_a_price_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="width_price must be a number in \\(0, 1\\]"):
        SpeculativeParams(width_price=bad)


def test_a_price_needs_the_cost_policy():
    with pytest.raises(ValueError, match="width_price prices the cost policy's widths"):
        SpeculativeParams(widths="fixed", width_price=0.5)
    assert SpeculativeParams(widths="fixed", width_price=1.0).width_price == 1.0
    assert np.isclose(SpeculativeParams(width_price=0.3).width_price, 0.3)
