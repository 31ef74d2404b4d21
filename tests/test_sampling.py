"""decoding/sampling.py against the two samplers it replaced (AR's top-k / top-p sampler and the
speculative decoder's per-row probabilities, kept here as references): the same distributions bit
for bit and the same draws from the same generator, so seeded outputs stay token-identical."""

import itertools

import pytest
import torch

from refusion.decoding.sampling import gumbel_argmax, nucleus_cut, sample, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_sample(logits, temperature=0.0, top_k=None, top_p=None, generator=None):
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def reference_probs(logits, temperature, top_k, top_p, filtered=True):
    x = logits / temperature[:, None, None]
    if filtered:
        srt, order = x.sort(-1, descending=True)
        V = x.shape[-1]
        kth = srt.gather(-1, (top_k.clamp(min=1, max=V) - 1)[:, None, None].expand(*srt.shape[:2], 1))
        srt = srt.masked_fill((top_k > 0)[:, None, None] & (srt < kth), float("-inf"))
        sp = srt.softmax(-1)
        cut_p = (sp.cumsum(-1) - sp >= top_p[:, None, None]) & (top_p < 1)[:, None, None]
        x = torch.empty_like(x).scatter_(-1, order, srt.masked_fill(cut_p, float("-inf")))
    return x.softmax(-1)


def logits_with_ties(B: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    x[:, V // 2:] = x[:, : V - V // 2].round()  # repeated values: ties at the top-k and top-p borders
    return x


# (greedy with top_k / top_p is refused by the parameter checks before any sampling)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, None, None)] + list(itertools.product(
    [0.3, 1.0, 1.7], [None, 1, 3, 50], [None, 0.05, 0.5, 0.9, 1.0])))
def test_sample_draws_what_the_ar_sampler_drew(temperature, top_k, top_p):
    for seed in range(2):
        logits = logits_with_ties(5, 40, seed)
        got, want = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(5):
            assert torch.equal(sample(logits, temperature, top_k, top_p, got),
                               reference_sample(logits, temperature, top_k, top_p, want))


def test_sampling_probs_are_the_speculative_decoders_bit_for_bit():
    logits = torch.stack([logits_with_ties(6, 40, s) for s in range(4)], 0)  # [B, N, V]
    temperature = torch.tensor([0.7, 1.0, 1.3, 2.0])
    top_k = torch.tensor([0, 3, 40, 1])
    top_p = torch.tensor([1.0, 0.8, 0.3, 0.95])
    for filtered in (True, False):
        assert torch.equal(sampling_probs(logits, temperature, top_k, top_p, filtered),
                           reference_probs(logits, temperature, top_k, top_p, filtered))


def test_gumbel_argmax_is_a_seeded_draw_from_the_tempered_softmax():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(20000, 3)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(gumbel_argmax(logits, 1.0, g), minlength=3) / 20000
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.015)
    again = gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(again, gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(0)))


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))  # no ties: one most likely token
    srt = logits.sort(-1, descending=True).values
    for top_p in (1e-300, torch.tensor([1e-300] * 5)[:, None]):
        cut = nucleus_cut(srt, top_p)
        assert not cut[:, 0].any() and cut[:, 1:].all()
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, 1.0, None, 1e-300, g), logits.argmax(-1))
    probs = sampling_probs(logits[:, None], torch.ones(5), torch.zeros(5, dtype=torch.long), torch.full((5,), 1e-300))
    assert torch.equal(probs[:, 0], torch.nn.functional.one_hot(logits.argmax(-1), 40).float())
