"""decode(..., batch_size=N): at most N sequences at once. `ar` and `speculative` run a continuous batch
(a finished row's place goes to the next prompt, as a server runs them) and every output is the one
the prompt gets alone; other decoders run groups of N."""

import functools
from pathlib import Path

import pytest

from refusion.decoding import decode
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.tasks import get_task

FIXTURE = Path(__file__).parents[1] / "fixtures" / "refusion-words"

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def fixture():
    return load_model(FIXTURE)


def prompts(n: int = 6) -> list[list[int]]:
    """A long sort (ar: 30 forwards, speculative: 6), then answers of other lengths: the first two rows
    end at different steps under either decoder."""
    tok = Tokenizer.from_dir(FIXTURE)
    sort, add, repeat = (get_task(name).load("test", n=3, seed=3) for name in ("sort", "add", "repeat"))
    return [tok.chat_prompt_ids(ex.prompt) for ex in (sort[2], repeat[0], add[0], sort[0], add[1], repeat[1])][:n]


class Rows:
    """The rows of every forward (its input's first dimension)."""

    def __init__(self, model) -> None:
        self.rows: list[int] = []
        self.hook = model.register_forward_pre_hook(lambda module, args: self.rows.append(args[0].shape[0]))


@pytest.mark.parametrize("decoder,params", [("speculative", dict(gen_length=40)), ("ar", dict(max_new_tokens=40))])
def test_a_continuous_batch_keeps_every_output_and_at_most_n_rows(decoder, params):
    m, ps = fixture(), prompts()
    alone = [decode(m, [p], decoder, **params)[0].tokens for p in ps]
    order: list[tuple[int, int]] = []  # (row, last position committed), in the order committed
    rows = Rows(m)
    try:
        res = decode(m, ps, decoder, batch_size=2, on_commit=lambda r, pos, tok: order.append((r, max(pos))),
                     **params)
    finally:
        rows.hook.remove()
    assert [r.tokens for r in res] == alone
    assert max(rows.rows) == 2
    # a continuous batch: the third prompt starts while one of the first two is still running
    last_commit = {r: i for i, (r, _) in enumerate(order)}
    first_commit = {}
    for i, (r, _) in enumerate(order):
        first_commit.setdefault(r, i)
    assert first_commit[2] < max(last_commit[0], last_commit[1])


def test_other_decoders_run_groups_of_n_with_rows_numbered_across_them():
    m, ps = fixture(), prompts(5)
    params = dict(gen_length=16, block_length=16, steps=8)
    groups = [r.tokens for lo in range(0, 5, 2) for r in decode(m, ps[lo:lo + 2], "mdm", seed=1, **params)]
    seen: set[int] = set()
    res = decode(m, ps, "mdm", seed=1, batch_size=2, on_commit=lambda r, pos, tok: seen.add(r), **params)
    assert [r.tokens for r in res] == groups
    assert seen == set(range(5))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_bad_batch_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        decode(fixture(), prompts(2), "ar", batch_size=bad, max_new_tokens=4)


@pytest.mark.parametrize("decoder,params", [("speculative", dict(gen_length=24, temperature=3.0)),
                                            ("ar", dict(max_new_tokens=24, temperature=3.0))])
def test_a_seed_per_prompt_gives_each_its_output_alone_with_that_seed(decoder, params):
    m, ps = fixture(), prompts(4)
    seeds = [11, 5, 11, 8]
    alone = [decode(m, [p], decoder, seed=s, **params)[0].tokens for p, s in zip(ps, seeds, strict=True)]
    assert [r.tokens for r in decode(m, ps, decoder, seed=seeds, batch_size=2, **params)] == alone
    assert [r.tokens for r in decode(m, ps, decoder, seed=seeds, **params)] == alone
    # (and the seeds matter: one seed for all gives another output somewhere; a high temperature, for the
    # fixture is sure of its answers)
    assert [r.tokens for r in decode(m, ps, decoder, seed=11, **params)] != alone


def test_a_seed_per_prompt_is_refused_where_it_cannot_be_kept():
    m, ps = fixture(), prompts(2)
    with pytest.raises(ValueError, match="decoder 'mdm' takes one seed for the whole call.*speculative"):
        decode(m, ps, "mdm", seed=[1, 2], gen_length=16, block_length=16, steps=8)
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        decode(m, ps, "ar", seed=[1], max_new_tokens=4)
    with pytest.raises(ValueError, match="got None in the list"):
        decode(m, ps, "ar", seed=[1, None], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\]"):
        decode(m, ps, "ar", seed=[1, -3], max_new_tokens=4)
