"""decoding/sampling.py: the speculative decoder's per-row probabilities against the code they
replaced (kept here as a reference), bit for bit; the position-keyed uniforms against splitmix64
written out in Python integers; inverse-CDF draws and their law."""


import pytest
import torch

from refusion.decoding.sampling import draw, gumbel_argmax, nucleus_cut, position_uniforms, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")


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


def splitmix64_reference(seed: int, t: int) -> float:
    M = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    return (mix((mix((seed + golden) & M) + (t + 1) * golden) & M) >> 40) / 2**24


def test_position_uniforms_are_splitmix64_of_seed_and_position():
    seeds = [0, 1, 2, 12345, 2**31, 2**62 + 7, 2**63 - 1]
    ts = [0, 1, 2, 3, 100, 4095, 2**17]
    got = position_uniforms(torch.tensor(seeds), torch.tensor([ts] * len(seeds)))
    assert got.dtype == torch.float32
    assert got.tolist() == [[splitmix64_reference(s, t) for t in ts] for s in seeds]


def test_position_uniforms_look_independent_and_uniform():
    u = position_uniforms(torch.arange(200), torch.arange(500).expand(200, 500)).double()
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1])):  # neighbouring positions, neighbouring seeds
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.01
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert ((counts - 5000) ** 2 / 5000).sum() < 19 + 5 * 38 ** 0.5  # chi-square, 19 df


def test_draw_follows_the_law_and_never_draws_a_zero():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2, 0.0])
    u = position_uniforms(torch.tensor([3]), torch.arange(60000)[None])[0]
    got = torch.bincount(draw(probs.expand(60000, 6), u), minlength=6) / 60000
    assert got[[1, 3, 5]].sum() == 0 and torch.allclose(got, probs, atol=0.01)
    # the edges: u = 0 takes the first possible token, the largest u the last, unnormalised or not
    edge = torch.tensor([0.0, 1 - 2**-24])
    for scale in (1.0, 0.999, 1.001):
        assert draw((probs * scale).expand(2, 6), edge).tolist() == [0, 4]


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
    probs = sampling_probs(logits[:, None], torch.ones(5), torch.zeros(5, dtype=torch.long), torch.full((5,), 1e-300))
    assert torch.equal(probs[:, 0], torch.nn.functional.one_hot(logits.argmax(-1), 40).float())
    assert torch.equal(draw(probs[:, 0], position_uniforms(torch.arange(5), torch.zeros(5, dtype=torch.long))),
                       logits.argmax(-1))
