"""Autoregressive decoding: equals transformers' greedy search, batched; sampling; EOS; counters. Every test
runs both the `ar` decoder (decode(..., "ar"): the speculative batch with no drafts) and the reference
loop the other decoders' tests compare with (tests/helpers/reference_ar.py)."""

import dataclasses

import pytest
import torch
import transformers

from refusion.model.checkpoint import load_model
from refusion.decoding import ARParams, decode
from refusion.decoding.sampling import draw, position_uniforms, sampling_probs
from tests.helpers.reference_ar import generate_ar

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("ar")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, eos_token_id=5)
    cfg.mask_token_id = 96
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf, load_model(path)


@pytest.fixture(params=["decode", "reference"])
def ar(request):
    """generate_ar's signature, run by the `ar` decoder or by the reference loop."""
    if request.param == "reference":
        return generate_ar
    return lambda model, prompts, p, **kw: decode(model, prompts, "ar", **dataclasses.asdict(p), **kw)


def test_batched_greedy_equals_transformers_per_prompt(pair, ar):
    hf, model = pair
    res = ar(model, PROMPTS, ARParams(gen_length=12, first_from_mask=False), eos_ids=[])
    for p, r in zip(PROMPTS, res, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert r.tokens == ref
        assert r.positions == list(range(len(p), len(p) + 12)) and r.steps == list(range(12))
        assert r.forwards == 12 and r.tokens_fed == len(p) + 11 and not r.finished


def test_stops_at_eos_and_counts_up_to_it(pair, ar):
    _, model = pair
    free = ar(model, PROMPTS, ARParams(gen_length=12, first_from_mask=False), eos_ids=[])
    # declare the 4th greedy token of prompt 0 to be EOS: decoding of that row ends there
    eos = free[0].tokens[3]
    res = ar(model, PROMPTS, ARParams(gen_length=12, first_from_mask=False), eos_ids=[eos])
    assert res[0].tokens == free[0].tokens[:4] and res[0].finished and res[0].forwards == 4
    for f, r in zip(free[1:], res[1:], strict=True):
        cut = next((i + 1 for i, t in enumerate(f.tokens) if t == eos), 12)
        assert r.tokens == f.tokens[:cut]


def test_first_token_from_a_mask_at_its_position(pair, ar):
    _, model = pair
    p = PROMPTS[0]
    with torch.no_grad():
        x = torch.tensor([p + [96]])
        first = model(x, torch.arange(len(p) + 1)[None])[0, -1].argmax().item()
        # then plain AR from prompt + first token
        rest = model(torch.tensor([p + [first]]), torch.arange(len(p) + 1)[None])[0, -1].argmax().item()
    r = ar(model, [p], ARParams(gen_length=2), eos_ids=[])[0]  # default: on, the model has a mask token
    assert r.tokens == [first, rest] and r.tokens_fed == len(p) + 1 + 1


def test_sampling_is_seeded_and_top_k_1_is_greedy(pair, ar):
    _, model = pair
    a = ar(model, PROMPTS, ARParams(gen_length=8, temperature=1.0), seed=7, eos_ids=[])
    b = ar(model, PROMPTS, ARParams(gen_length=8, temperature=1.0), seed=7, eos_ids=[])
    c = ar(model, PROMPTS, ARParams(gen_length=8, temperature=1.0), seed=8, eos_ids=[])
    assert [r.tokens for r in a] == [r.tokens for r in b] != [r.tokens for r in c]
    g = ar(model, PROMPTS, ARParams(gen_length=8), eos_ids=[])
    k1 = ar(model, PROMPTS, ARParams(gen_length=8, temperature=0.7, top_k=1), seed=3, eos_ids=[])
    assert [r.tokens for r in g] == [r.tokens for r in k1]


def test_streaming_callback_sees_every_commit(pair, ar):
    _, model = pair
    seen = []
    res = ar(model, PROMPTS, ARParams(gen_length=5), eos_ids=[], on_commit=lambda *a: seen.append(a))
    for row, r in enumerate(res):
        assert [(p, t) for (rw, p, t) in seen if rw == row] == [([q], [t]) for q, t in zip(r.positions, r.tokens, strict=True)]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).expand(300, 1, 4)
    u = position_uniforms(torch.arange(300), torch.zeros(300, dtype=torch.long))
    one, none = torch.ones(300), torch.zeros(300, dtype=torch.long)
    for top_p, kept in ((0.8, {0, 1}), (0.81, {0, 1, 2})):
        probs = sampling_probs(logits, one, none, torch.full((300,), top_p))[:, 0]
        assert set(draw(probs, u).tolist()) == kept


def test_bad_arguments(pair, ar):
    _, model = pair
    with pytest.raises(ValueError, match="gen_length must be an integer >= 1, got 0"):
        ar(model, PROMPTS, ARParams(gen_length=0))
    with pytest.raises(ValueError, match="at least one token"):
        ar(model, [[]], ARParams(gen_length=3))
    # decode() keeps generate_ar's old keyword: max_new_tokens is gen_length
    assert [r.tokens for r in decode(model, PROMPTS, "ar", max_new_tokens=4, eos_ids=[])] == \
        [r.tokens for r in generate_ar(model, PROMPTS, ARParams(gen_length=4), eos_ids=[])]
