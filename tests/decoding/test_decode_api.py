"""decode() as every caller meets it (CLI, eval, a server): one contract for streamed commits, and the
parameter checks shared by all decoders (make_params), which need no model."""

import math

import pytest

from refusion.model.config import ModelConfig
from refusion.decoding import DECODERS, decode, default_decoder, make_params
from refusion.model.transformer import Transformer

PARAMS = {"refusion": dict(gen_length=16, slot_size=4, slot_threshold=0.1, token_threshold=0.1),
          "refusion-l2r": dict(gen_length=16, slot_size=4),
          "ar": dict(gen_length=16),
          "speculative": dict(gen_length=16, draft_length=4),
          "mdm": dict(gen_length=16, block_length=8),
          "mdm-threshold": dict(gen_length=16, block_length=8, threshold=0.3)}
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10]]

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0) -> Transformer:
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, mask_token_id=23, eos_token_id=1, max_position_embeddings=64)
    return Transformer(cfg).init_weights(seed=seed, std=0.5).eval()


def streamed(events: list, row: int, eos: set[int]) -> tuple[list[int], list[int]]:
    """What a streaming client rebuilds, as decode()'s docstring tells it to: the commits of a row
    sorted by position, cut after the first EOS."""
    got = sorted((q, t) for r, positions, tokens in events if r == row for q, t in zip(positions, tokens, strict=True))
    cut = next((i + 1 for i, (_, t) in enumerate(got) if t in eos), len(got))
    return [q for q, _ in got[:cut]], [t for _, t in got[:cut]]


@pytest.mark.parametrize("decoder", DECODERS)
def test_streamed_commits_cut_at_the_first_eos_are_the_result(decoder):
    model = tiny()
    free = decode(model, PROMPTS, decoder, eos_ids=[], **PARAMS[decoder])
    # an EOS the model really produces, early in the first row's output
    eos = free[0].tokens[len(free[0].tokens) // 3]
    events = []
    res = decode(model, PROMPTS, decoder, eos_ids=[eos], on_commit=lambda *e: events.append(e), **PARAMS[decoder])
    for row, r in enumerate(res):
        assert streamed(events, row, {eos}) == (r.positions, r.tokens)
        assert r.finished == (eos in r.tokens)


def test_commits_after_an_eos_are_reported_but_not_in_the_result():
    # masked diffusion fills a whole block before it looks for EOS: the block's tail is streamed
    model = tiny()
    free = decode(model, [PROMPTS[0]], "mdm", eos_ids=[], **PARAMS["mdm"])[0]
    eos = free.tokens[2]
    events = []
    r = decode(model, [PROMPTS[0]], "mdm", eos_ids=[eos], on_commit=lambda *e: events.append(e),
               **PARAMS["mdm"])[0]
    reported = {q for _, positions, _ in events for q in positions}
    assert r.tokens[-1] == eos and len(r.tokens) <= 3
    assert max(reported) >= r.positions[-1] + 1  # reported, yet after the EOS: not part of the result


@pytest.mark.parametrize("decoder, params, message", [
    ("ar", dict(temperature=1.0, top_p=0.0), "top_p must lie in (0, 1], got 0.0"),
    ("ar", dict(temperature=math.nan), "temperature must be a finite number"),
    ("ar", dict(top_k=3), "top_k applies only when sampling"),
    ("ar", dict(gen_length=4, max_new_tokens=4), "not both"),
    ("refusion", dict(gen_length=16, slot_size=32), "slot_size x serial_blocks = 32 x 1 = 32 exceeds gen_length 16"),
    ("refusion", dict(temperature=math.inf), "temperature must be a finite number"),
    ("mdm", dict(gen_length=16, block_length=8, steps=0), "steps must be an integer >= 1, got 0"),
    ("mdm-threshold", dict(gen_length=16, block_length=8, steps=16), "does not take steps"),
    ("mdm", dict(gen_length=16, block_length=8, threshold=0.5), "use 'mdm-threshold' for threshold"),
    ("refusion", dict(top_k=3), "does not take top_k"),
])
def test_bad_parameters_are_refused_without_a_model(decoder, params, message):
    with pytest.raises(ValueError) as e:
        make_params(decoder, **params)
    assert message in str(e.value)


def test_sizes_beyond_the_model_are_refused_before_any_allocation():
    model = tiny()  # 64 positions
    for decoder in DECODERS:
        with pytest.raises(ValueError, match="gen_length 1073741824 exceeds"):
            decode(model, PROMPTS, decoder, gen_length=2**30)
        with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ gen_length \(16\) = 76 exceeds"):
            decode(model, [[5] * 60], decoder, **PARAMS[decoder])


def test_widths_are_bounded_by_a_cap_and_by_the_model_context():
    from refusion.decoding.params import MAX_DRAFT, MAX_GEN_LENGTH

    for name in ("draft_length", "mask_length"):
        with pytest.raises(ValueError, match=f"{name} 1000000000 exceeds {MAX_DRAFT}"):
            make_params("speculative", **{name: 10**9})
    for decoder in DECODERS:
        with pytest.raises(ValueError, match=f"gen_length {MAX_GEN_LENGTH + 1} exceeds {MAX_GEN_LENGTH}"):
            make_params(decoder, gen_length=MAX_GEN_LENGTH + 1)
    model = tiny()  # 64 positions: a width within the cap but past the model's context
    with pytest.raises(ValueError, match=r"draft_length 100 exceeds the model's context \(max_position_embeddings 64\)"):
        decode(model, PROMPTS, "speculative", gen_length=16, draft_length=100)
    with pytest.raises(ValueError, match="mask_length 65 exceeds the model's context"):
        make_params("speculative", model.config, mask_length=65)
    from refusion.decoding import SpeculativeBatch, SpeculativeParams, generate_speculative

    with pytest.raises(ValueError, match="draft_length 100 exceeds the model's context"):
        generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=16, draft_length=100))
    with pytest.raises(ValueError, match="draft_length 100 exceeds the model's context"):
        SpeculativeBatch(model).add(PROMPTS[0], SpeculativeParams(gen_length=16, draft_length=100))
    make_params("speculative", model.config, draft_length=64, mask_length=64)  # up to the context: fine


@pytest.mark.parametrize("decoder", ["ar", "speculative"])
def test_a_tiny_top_p_keeps_the_most_likely_token_so_it_samples_greedily(decoder):
    model = tiny()
    greedy = [r.tokens for r in decode(model, PROMPTS, decoder, eos_ids=[], **PARAMS[decoder])]
    for top_p in (1e-300, 1e-50, 1e-9):  # the first two round to 0 in float32
        got = decode(model, PROMPTS, decoder, eos_ids=[], temperature=1.0, top_p=top_p, seed=3, **PARAMS[decoder])
        assert [r.tokens for r in got] == greedy


def test_seeds_out_of_range_are_refused():
    model = tiny()
    for seed in (2**63, 2**70, -1, True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\]"):
            decode(model, PROMPTS, "ar", seed=seed, **PARAMS["ar"])
    from refusion.decoding.sampling import generator

    with pytest.raises(ValueError, match="seed must be an integer"):
        generator(2**64)
    decode(model, PROMPTS, "ar", seed=2**63 - 1, temperature=1.0, **PARAMS["ar"])  # the largest is fine


def test_default_decoder():
    base = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    assert default_decoder(ModelConfig(**base)) == "ar"
    assert default_decoder(ModelConfig(mask_token_id=23, **base)) == "speculative"
    assert default_decoder(ModelConfig(mask_token_id=23, training_objective="ar", **base)) == "ar"
    assert default_decoder(ModelConfig(mask_token_id=23, training_objective="mdm", **base)) == "mdm-threshold"
    assert default_decoder(ModelConfig(mask_token_id=23, bidirectional=True, **base)) == "mdm-threshold"
