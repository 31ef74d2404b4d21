"""Temperatures, top-p and thresholds at the edges of the float range: a temperature too small for
logits / temperature to stay finite in float32 (1e-38 and below, down to the smallest double) gives
the limit, the top token, in every decoder; a huge one gives the other limit, uniform over the
tokens not cut; NaN, infinities, negatives and bools are refused with a message naming the field."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refusion.cli.main import main
from refusion.decoding import decode
from refusion.decoding.sampling import TEMPERATURE_MIN, gumbel_argmax, sampling_probs, scaled
from tests.helpers.bundled import bundled

pytestmark = pytest.mark.usefixtures("one_thread")

DECODERS = ("ar", "speculative", "refusion", "refusion-l2r", "mdm", "mdm-threshold")
TINY = (1e-38, 1e-40, 1e-300, 5e-324)


def run(decoder: str, prompts, **params):
    model, _ = bundled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mdm decoders on a ReFusion model warn that they do not fit it
        return [r.tokens for r in decode(model, prompts, decoder, eos_ids=model.config.eos_ids, gen_length=32,
                                         **params)]


@pytest.fixture(scope="module")
def prompts():
    _, tok = bundled()
    return [tok.chat_prompt_ids("Add: 12 + 30"), tok.chat_prompt_ids("Sort: 42 82 64")]


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_temperature_below_float32s_range_is_greedy(decoder, prompts):
    greedy = run(decoder, prompts, temperature=0)
    assert any(len(t) > 3 for t in greedy)
    for t in TINY:
        assert run(decoder, prompts, temperature=t, seed=3) == greedy, t


def test_tiny_top_p_keeps_the_top_token_and_one_minus_epsilon_is_off(prompts):
    greedy = run("speculative", prompts, temperature=0)
    for decoder in ("ar", "speculative"):
        assert run(decoder, prompts, temperature=1.0, top_p=5e-324, seed=1) == greedy
        assert run(decoder, prompts, temperature=1.0, top_p=1e-45, seed=1) == greedy
        assert run(decoder, prompts, temperature=1.0, top_p=1 - 1e-17, seed=1) == run(decoder, prompts,
                                                                                      temperature=1.0, seed=1)


def test_thresholds_at_their_ends_decode(prompts):
    # a probability threshold of 0 or 1 (or one that underflows) is a limit, not an error: 0 takes
    # everything at once, 1 only what the decoder must take (at least one slot / mask per step)
    for decoder, name in (("refusion", "slot_threshold"), ("refusion", "token_threshold"),
                          ("refusion-l2r", "slot_threshold"), ("mdm-threshold", "threshold")):
        for v in (0, 0.0, 5e-324, 1e-300, 1 - 1e-16, 1.0, 1):
            out = run(decoder, prompts, **{name: v})
            assert len(out) == 2 and all(len(t) <= 32 for t in out), (decoder, name, v)
    assert run("speculative", prompts, temperature=0.5, accept_prob=5e-324, seed=2)  # accepts nearly any draft


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf), ("temperature", -1e-300),
    ("temperature", True), ("temperature", "0.5"), ("top_p", math.nan), ("top_p", 0.0), ("top_p", -5e-324),
    ("top_p", 1 + 2e-16), ("top_p", math.inf), ("top_p", True),
])
def test_non_finite_and_out_of_range_sampling_values_are_refused(field, value, prompts):
    params = {"temperature": 1.0, field: value}
    for decoder in ("ar", "speculative"):
        with pytest.raises(ValueError, match=field):
            run(decoder, prompts, **params)
    if field == "temperature":
        for decoder in ("refusion", "mdm"):
            with pytest.raises(ValueError, match=field):
                run(decoder, prompts, temperature=value)


@pytest.mark.parametrize("decoder, name", [("refusion", "slot_threshold"), ("refusion", "token_threshold"),
                                           ("mdm-threshold", "threshold"), ("speculative", "accept_prob")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -5e-324, 1 + 2e-16, True])
def test_non_finite_and_out_of_range_thresholds_are_refused(decoder, name, value, prompts):
    with pytest.raises(ValueError, match=name):
        run(decoder, prompts, **{name: value})


def test_the_huge_temperature_limit_is_uniform_over_the_tokens_not_cut():
    logits = torch.tensor([[[3.0, -float("inf"), 1.0, 250.0, -7.5]]])
    for t in (1e30, 1e300, 1.7976931348623157e308):
        p = sampling_probs(logits, torch.tensor([t]), torch.tensor([0]), torch.tensor([1.0]))
        assert torch.allclose(p, torch.tensor([[[0.25, 0.0, 0.25, 0.25, 0.25]]]), atol=1e-6), (t, p)
        # top-k 2 keeps the two largest, uniform between them
        p = sampling_probs(logits, torch.tensor([t]), torch.tensor([2]), torch.tensor([1.0]))
        assert torch.allclose(p, torch.tensor([[[0.5, 0.0, 0.0, 0.5, 0.0]]]), atol=1e-6), (t, p)


def test_float16_logits_take_a_tiny_temperature_too():
    logits = torch.tensor([[[3.0, 1.0, 60000.0, -60000.0]]], dtype=torch.float16)
    assert gumbel_argmax(logits, 1e-40, torch.Generator().manual_seed(0)).item() == 2
    p = sampling_probs(logits, torch.tensor([1e-3]), torch.tensor([0]), torch.tensor([1.0]))
    assert p.tolist() == [[[0.0, 0.0, 1.0, 0.0]]]


# Any positive float as a temperature: the probabilities are finite, sum to 1 and put all their mass
# on the row's top tokens below the floor; Gumbel-max takes a top token there.
LOGITS = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=2, max_size=12).map(
    lambda xs: torch.tensor([[xs]]))
TEMPS = st.floats(min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(logits=LOGITS, t=TEMPS, top_p=st.floats(5e-324, 1.0), seed=st.integers(0, 2**32))
def test_any_positive_temperature_gives_a_distribution(logits, t, top_p, seed):
    p = sampling_probs(logits, torch.tensor([t]), torch.tensor([0]), torch.tensor([top_p]))
    assert torch.isfinite(p).all() and abs(p.sum().item() - 1) < 1e-4
    x = scaled(logits, t)
    assert torch.isfinite(x).all()
    assert p[x == x.amax(-1, keepdim=True)].sum() > 0  # the top token (after scaling) is never cut
    top = logits.amax(-1, keepdim=True)
    tok = gumbel_argmax(logits, t, torch.Generator().manual_seed(seed))
    # below the floor: the top token alone, wherever the logits are further apart than the floor
    # can tell (a gap of about 100 x the floor makes exp underflow; float32 logits of size 1e-6 or
    # more are always that far apart)
    below = logits[logits < top]
    if t <= TEMPERATURE_MIN and (below.numel() == 0 or top.item() - below.max().item() > 1e-16):
        assert logits[0, 0, tok.item()] == top.item()
        assert p[logits < top].sum() == 0


def test_the_cli_and_a_tiny_temperature(capsys):
    from refusion.bundled import BUNDLED

    argv = ["generate", "--model", str(BUNDLED), "Add: 12 + 30", "--gen-length", "32", "--json"]
    assert main(argv) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert main([*argv, "--temperature", "1e-40", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == greedy["text"]
    for bad in ("nan", "inf", "-1e-300"):
        assert main([*argv, f"--temperature={bad}"]) != 0
        assert "temperature" in capsys.readouterr().err
