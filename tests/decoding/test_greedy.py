"""decoding/sampling.py's greedy: the blocked search gives torch's argmax's tokens."""

import pytest
import torch

from refusion.decoding.sampling import GREEDY_BLOCK as BLOCK, greedy


@pytest.mark.parametrize("V", [3 * BLOCK, 3 * BLOCK + 1, 5 * BLOCK - 7, 2 * BLOCK + 10])
def test_greedy_is_argmax_ties_nans_and_a_short_last_block_included(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(2, 9, V, generator=g)
    # ties: a row whose maximum appears in two blocks, one whose maximum appears twice in one block,
    # one whose maximum is the vocabulary's last token, a NaN (argmax takes it as the largest), all -inf
    x[0, 0, [5, V - 1]] = 9.0
    x[0, 1, [BLOCK + 3, BLOCK + 9]] = 9.0
    x[0, 2, V - 1] = 9.0
    x[0, 3, [7, V - 2]] = float("nan")
    x[0, 4] = float("-inf")
    x[1, 0, [V - 2, V - 1]] = 9.0
    x[1, 1, :] = 1.0
    want = x.argmax(-1)
    assert want[0, 0] == 5 and want[0, 3] == 7 and want[0, 4] == 0  # (what torch's argmax does, which greedy keeps)
    assert torch.equal(greedy(x), want)
    assert torch.equal(greedy(x[1]), want[1])  # [N, V]
    assert torch.equal(greedy(x[:, :2]), want[:, :2])  # few rows: torch's own argmax
