"""Masked-diffusion baselines: exact commits per step, thresholds, prefix cache, batching, EOS."""

import pytest
import torch

from refusion.model.config import ModelConfig
from refusion.decoding import decode
from refusion.model.transformer import Transformer

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


def tiny(bidirectional=False, seed=0, std=0.5):
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, mask_token_id=23, eos_token_id=1, bidirectional=bidirectional)
    return Transformer(cfg).init_weights(seed=seed, std=std).eval()


def slow_llada_step_by_step(model, prompt, gen_length, block_length, steps, with_steps=False):
    """Obviously-correct LLaDA (greedy, low-confidence remasking): a full forward per step. Ties in
    confidence go to the leftmost position. with_steps: also the step each token was committed at."""
    L, M = gen_length, model.config.mask_token_id
    x = torch.tensor(prompt + [M] * L)
    pos = torch.arange(len(x))
    T = len(x)
    mask = torch.ones(T, T, dtype=torch.bool) if model.config.bidirectional else torch.ones(T, T, dtype=torch.bool).tril()
    per_block = steps // (L // block_length)
    step_of = [-1] * T
    step = 0
    for b in range(L // block_length):
        lo = len(prompt) + b * block_length
        n = block_length
        counts = [n // per_block + (1 if i < n % per_block else 0) for i in range(per_block)]
        for k in counts:
            with torch.no_grad():
                logits = model(x[None], pos[None], attn_mask=mask)[0].float()
            logits[:, M] = float("-inf")
            x0 = logits.argmax(-1)
            conf = logits.softmax(-1).gather(-1, x0[:, None]).squeeze(-1)
            for j in range(T):
                if not (lo <= j < lo + block_length) or x[j] != M:
                    conf[j] = -1.0
            for j in sorted(range(T), key=lambda j: (-conf[j].item(), j))[:k]:  # ties: the leftmost
                x[j], step_of[j] = x0[j], step
            step += 1
    if with_steps:
        return x[len(prompt):].tolist(), step_of[len(prompt):]
    return x[len(prompt):].tolist()


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("steps", [4, 8, 16])
def test_llada_equals_slow_reference_and_batch_equals_single(bidirectional, steps):
    model = tiny(bidirectional)
    kw = dict(gen_length=16, block_length=8, steps=steps)
    batch = decode(model, PROMPTS, "mdm", eos_ids=[], **kw)
    for q, r in zip(PROMPTS, batch, strict=True):
        assert r.tokens == slow_llada_step_by_step(model, q, 16, 8, steps)
        assert r.tokens == decode(model, [q], "mdm", eos_ids=[], **kw)[0].tokens
        assert r.forwards == steps
        # 16 tokens over `steps` steps: the same number committed at every step
        per_step = [r.steps.count(s) for s in range(steps)]
        assert per_step == [16 // steps] * steps


def test_threshold_commits_every_confident_mask_and_at_least_one():
    model = tiny()
    for thr in (0.0, 0.3, 1.0):
        res = decode(model, PROMPTS, "mdm-threshold", eos_ids=[], gen_length=16, block_length=8, threshold=thr)
        for r in res:
            assert len(r.tokens) == 16 and 23 not in r.tokens
            if thr == 0.0:
                assert r.forwards == 2  # one step per block: everything clears a zero threshold
            if thr == 1.0:
                assert r.forwards == 16  # nothing clears it: exactly one token per step
        single = [decode(model, [q], "mdm-threshold", eos_ids=[], gen_length=16, block_length=8,
                         threshold=thr)[0].tokens for q in PROMPTS]
        assert [r.tokens for r in res] == single


def test_prefix_cache_is_exact_for_a_causal_model_and_feeds_fewer_tokens():
    model = tiny()
    kw = dict(eos_ids=[], gen_length=16, block_length=4, threshold=0.3)
    a = decode(model, PROMPTS, "mdm-threshold", prefix_cache=False, **kw)
    b = decode(model, PROMPTS, "mdm-threshold", prefix_cache=True, **kw)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert all(rb.tokens_fed < ra.tokens_fed for ra, rb in zip(a, b, strict=True))
    # the default: on for a causal model, where it is exact; off for a bidirectional one
    assert [r.tokens_fed for r in decode(model, PROMPTS, "mdm-threshold", **kw)] == [r.tokens_fed for r in b]
    bi = tiny(bidirectional=True)
    assert [r.tokens_fed for r in decode(bi, PROMPTS, "mdm-threshold", **kw)] == [
        r.tokens_fed for r in decode(bi, PROMPTS, "mdm-threshold", prefix_cache=False, **kw)]


def test_ties_in_confidence_go_to_the_leftmost_position():
    # weights this large saturate most softmaxes at 1, so masks tie; the leftmost of them is
    # committed first, on every CPU (torch's topk orders ties differently on different ones)
    model = tiny(std=50.0)
    for q in PROMPTS:
        r = decode(model, [q], "mdm", eos_ids=[], gen_length=16, block_length=8, steps=8)[0]
        assert (r.tokens, r.steps) == slow_llada_step_by_step(model, q, 16, 8, 8, with_steps=True)


def test_stops_after_the_block_with_eos_and_cuts_there():
    model = tiny()
    free = decode(model, [PROMPTS[0]], "mdm", eos_ids=[], gen_length=16, block_length=4, steps=16)[0]
    eos = free.tokens[5]  # lies in the second block
    r = decode(model, [PROMPTS[0]], "mdm", eos_ids=[eos], gen_length=16, block_length=4, steps=16)[0]
    first = free.tokens.index(eos)
    assert r.finished and r.tokens == free.tokens[: first + 1]
    assert r.forwards == 4 * (first // 4 + 1)  # no step is spent on the blocks after it


def test_bad_parameters():
    model = tiny()
    with pytest.raises(ValueError, match="multiple of block_length"):
        decode(model, PROMPTS, "mdm", gen_length=10, block_length=4)
    with pytest.raises(ValueError, match="steps"):
        decode(model, PROMPTS, "mdm", gen_length=16, block_length=4, steps=6)
    with pytest.raises(ValueError, match="exceeds gen_length"):
        decode(model, PROMPTS, "mdm", gen_length=16, block_length=4, steps=32)
    with pytest.raises(ValueError, match="does not take"):
        decode(model, PROMPTS, "mdm", slot_size=4)
    with pytest.raises(ValueError, match="unknown decoder"):
        decode(model, PROMPTS, "beam")
