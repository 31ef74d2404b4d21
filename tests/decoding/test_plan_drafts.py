"""A draft answer given with the prompt (SpeculativeBatch.add(plan=...)), and plan-and-infill with
`verify`, which drafts with plan-and-infill's own answer: the output is AR's whatever the plan; a
right plan is verified in one forward where the prompt's last token predicts the first response
token (causal_first_token), and in two otherwise; a wrong one costs only forwards."""

import numpy as np
import pytest

from refusion.decoding import ARParams, decode
from refusion.decoding.params import ReFusionParams
from refusion.decoding.refusion import generate_refusion
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer
from tests.helpers.reference_ar import generate_ar

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=23, eos_token_id=1)
PROMPTS = [[2, 3, 4, 5, 6, 7, 2, 3], [8, 9, 10, 11, 8, 9], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 2]]


def model(causal_first: bool, seed: int = 4) -> Transformer:
    return Transformer(ModelConfig(**CFG, causal_first_token=causal_first)).init_weights(seed=seed, std=0.5).eval()


@pytest.mark.parametrize("causal_first", [True, False])
@pytest.mark.parametrize("policy", ["cost", "adaptive", "fixed"])
def test_a_right_plan_is_verified_in_one_forward_after_the_prompt(causal_first, policy):
    m = model(causal_first)
    want = generate_ar(m, PROMPTS, ARParams(gen_length=24), eos_ids=[])
    # a plan is fed whole, however narrow the drafts of the width policy (here 3 tokens)
    p = SpeculativeParams(gen_length=24, widths=policy, draft_length=3)
    got = generate_speculative(m, PROMPTS, p, eos_ids=[], plans=[r.tokens for r in want])
    assert [r.tokens for r in got] == [r.tokens for r in want]
    # the prefill verifies the whole plan where the prompt's last token predicts its first token;
    # otherwise the prefill reads the first token from a mask and the next forward verifies the rest
    assert [r.forwards for r in got] == [1 if causal_first else 2] * len(PROMPTS)


@pytest.mark.parametrize("causal_first", [True, False])
@pytest.mark.parametrize("policy", ["cost", "adaptive", "fixed"])
def test_any_plan_gives_ar_tokens(causal_first, policy):
    m = model(causal_first)
    rng = np.random.default_rng(0)
    want = generate_ar(m, PROMPTS, ARParams(gen_length=24), eos_ids=[1])
    plans = [rng.integers(0, 23, int(rng.integers(0, 30))).tolist() for _ in PROMPTS]  # wrong, short, long, empty
    plans[0] = want[0].tokens[:5] + [9] + want[0].tokens[6:]  # right but for one token
    got = generate_speculative(m, PROMPTS, SpeculativeParams(gen_length=24, widths=policy), eos_ids=[1], plans=plans)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_plan_with_a_bad_token_is_refused():
    with pytest.raises(ValueError, match=r"plan token ids must lie in \[0, 24\)"):
        generate_speculative(model(True), PROMPTS[:1], SpeculativeParams(gen_length=8), plans=[[3, 24]])
    with pytest.raises(ValueError, match="2 plans for 1 prompts"):
        generate_speculative(model(True), PROMPTS[:1], SpeculativeParams(gen_length=8), plans=[[3], [4]])


@pytest.mark.parametrize("causal_first", [True, False])
def test_verified_plan_and_infill_is_ar_and_counts_both_passes(causal_first):
    m = model(causal_first, seed=7)
    eos = [1]
    want = generate_ar(m, PROMPTS, ARParams(gen_length=32), eos_ids=eos)
    rp = dict(gen_length=32, slot_size=8, slot_threshold=0.5, token_threshold=0.2)
    plain = generate_refusion(m, PROMPTS, ReFusionParams(**rp), eos_ids=eos)
    got = decode(m, PROMPTS, "refusion", eos_ids=eos, verify=True, **rp)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    # the plan-and-infill pass's forwards are counted first, then at least one that verifies
    assert all(g.forwards > p.forwards and min(g.steps) >= p.forwards for g, p in zip(got, plain, strict=True))
    # batched as alone
    alone = [decode(m, [q], "refusion", eos_ids=eos, verify=True, **rp)[0].tokens for q in PROMPTS]
    assert alone == [r.tokens for r in got]
