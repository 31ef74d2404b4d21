"""decode()'s prompts: NumPy arrays, tensors and NumPy integers are converted (the same tokens as the
plain lists give), and what is not a batch of token ids is refused with a ValueError that says
what to pass: a single flat prompt (wrap it), text, bools, floats, the wrong shape or dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refusion.decoding import decode
from tests.helpers.bundled import bundled

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, tok = bundled()
    prompts = [tok.chat_prompt_ids("Add: 1 + 2"), tok.chat_prompt_ids("Sort: 9 3 5")]
    n = min(map(len, prompts))
    prompts = [p[-n:] for p in prompts]  # one length, so that they stack into a 2-D array
    expected = [r.tokens for r in decode(model, prompts, "ar", gen_length=8)]
    return model, prompts, expected


@pytest.mark.parametrize("convert", [
    np.array, torch.tensor, lambda ps: [np.array(p) for p in ps], lambda ps: [torch.tensor(p) for p in ps],
    lambda ps: [[np.int64(t) for t in p] for p in ps], lambda ps: [[np.int32(t) for t in p] for p in ps],
    lambda ps: [[torch.tensor(t) for t in p] for p in ps], lambda ps: tuple(tuple(p) for p in ps),
    lambda ps: np.array(ps, dtype=np.uint16),
], ids=["ndarray", "tensor", "list of ndarrays", "list of tensors", "np.int64", "np.int32", "0-d tensors", "tuples",
        "uint16"])
def test_arrays_tensors_and_numpy_ints_give_the_same_tokens(setup, convert):
    model, prompts, expected = setup
    assert [r.tokens for r in decode(model, convert(prompts), "ar", gen_length=8)] == expected


@pytest.mark.parametrize("bad, message", [
    (lambda p: p, r"wrap a single prompt in a list, \[ids\]"),
    (lambda p: np.array(p), r"must be 2-D \(prompts x tokens\), got shape \(\d+,\); a single prompt is \[ids\]"),
    (lambda p: torch.tensor(p), r"must be 2-D"),
    (lambda p: [[True] + p], "token id True is a bool, not a token id"),
    (lambda p: [[np.bool_(False)] + p], "is a bool, not a token id"),
    (lambda p: [torch.tensor(p).bool()], "integer dtype, got torch.bool"),
    (lambda p: [[1.0] + p], "token id 1.0 is not an integer"),
    (lambda p: [np.array(p, dtype=np.float32)], "integer dtype, got float32"),
    (lambda p: "Add: 1 + 2", "got str"),
    (lambda p: ["Add: 1 + 2"], "not text: encode it first"),
    (lambda p: [None], "each prompt must be a list of token ids, got NoneType"),
    (lambda p: [[None]], "token id None is not an integer"),
    (lambda p: [], "every prompt needs at least one token"),
    (lambda p: [[]], "every prompt needs at least one token"),
    (lambda p: [[-1]], r"prompt token id -1 is outside the vocabulary"),
    (lambda p: [[2**70]], r"outside the vocabulary"),
    (lambda p: {"a": 1}, "got dict"),
])
def test_what_is_not_a_batch_of_ids_is_a_clear_value_error(setup, bad, message):
    model, prompts, _ = setup
    with pytest.raises(ValueError, match=message):
        decode(model, bad(prompts[0]), "ar", gen_length=8)
