"""Sampling for every decoder: temperature, top-k / top-p filtering, multinomial draws, Gumbel-max,
the position-keyed draws of `ar` and `speculative`, and a greedy argmax fast on a CPU.

Seeded outputs are part of the decoders' contract (benchmarks/check_outputs.py), so every function
here makes exactly the random draws its callers always made: same generator, calls, shapes, dtypes.

Position-keyed draws (`position_uniforms`, `draw`): the token a sampled sequence gets at response
position t is draw(p_t, u(seed, t)), an inverse-CDF draw from its distribution p_t with a uniform
that is a hash of (seed, t) alone: a counter-based stream (splitmix64's mixer, in int64 tensor ops
on the device, for every row and position at once). No generator's state is consumed, so a
sequence's output cannot depend on how many numbers other steps, widths or rows drew. Since the
uniforms of distinct positions are independent, the tokens follow the sampling law exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from refusion.decoding.params import check_seed


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    check_seed(seed)  # (torch's own message for a seed out of range is an overflow)
    return torch.Generator(device=device).manual_seed(seed)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words in which every input bit flips about
    half the output bits (int64 products wrap around, as the 64-bit arithmetic needs)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def position_uniforms(seeds: Tensor, positions: Tensor) -> Tensor:
    """float32 uniforms in [0, 1) (24 bits), one per (seed, response position): seeds [B] int64,
    positions [B, ...] int64 -> [B, ...]. The t-th word of seed s's stream is mix(mix(s) + (t+1) *
    golden), splitmix64's own stream from a mixed seed, so nearby seeds give unrelated streams."""
    base = _mix(seeds.long() + _GOLDEN).view(-1, *([1] * (positions.dim() - 1)))
    h = _mix(base + (positions.long() + 1) * _GOLDEN)
    return _shr(h, 40).float() * 2.0 ** -24


def draw(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws: probs [..., V] (need not sum to exactly 1), u [...] in [0, 1) -> tokens
    [...]. The token is the first whose cumulative mass exceeds u x total; a token of probability 0
    is never drawn (whatever the rounding of a parallel cumsum)."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    x = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = (cdf <= x).sum(-1).clamp(max=probs.shape[-1] - 1)
    return torch.where(probs.gather(-1, tok[..., None]).squeeze(-1) > 0, tok, probs.argmax(-1))


def nucleus_cut(sorted_logits: Tensor, top_p: float | Tensor) -> Tensor:
    """Over logits sorted in descending order: True where a token lies outside the smallest set
    whose probability reaches top_p. The set always keeps the most likely token: a top_p below
    float32's smallest number rounds to 0, which would otherwise cut every token."""
    sp = sorted_logits.softmax(-1)
    cut = sp.cumsum(-1) - sp >= top_p
    cut[..., 0] = False
    return cut


# Temperatures are held in [TEMPERATURE_MIN, TEMPERATURE_MAX] where logits are divided by them. Below
# the floor the distribution is already the limit, its top token (ties shared), for float32 logits
# (their spacing over the floor overflows exp), while a smaller one could make logits / temperature
# overflow to inf (then NaN) or divide by a temperature that rounds to 0 in float32; above the ceiling
# it is uniform over the tokens not cut (-inf stays -inf, where inf / inf would be NaN).
TEMPERATURE_MIN = torch.finfo(torch.float32).tiny ** 0.5
TEMPERATURE_MAX = 1 / TEMPERATURE_MIN


def scaled(logits: Tensor, temperature: Tensor | float) -> Tensor:
    """logits / temperature with the temperature held in its range (a [B] tensor divides [B, ...]
    rows); float16 logits are divided in float32, whose range the floor is for."""
    if logits.dtype == torch.float16:
        logits = logits.float()
    if isinstance(temperature, Tensor):
        t = temperature.clamp(TEMPERATURE_MIN, TEMPERATURE_MAX)
        return logits / t.view(-1, *([1] * (logits.dim() - 1)))
    return logits / min(max(temperature, TEMPERATURE_MIN), TEMPERATURE_MAX)


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool = True
                   ) -> Tensor:
    """The distributions [B, N, V] that `sample` draws from, with per-row settings (temperature
    [B] > 0; top_k [B], 0 = off; top_p [B], 1 = off): what speculative sampling accepts and draws
    with. One sort serves both cuts (tied tokens may fall on either side of a cut in another order
    than in `sample`). filtered=False: no row uses top-k or top-p (known on the host, so the sort
    is skipped without a device sync)."""
    x = scaled(logits, temperature)
    if filtered:
        srt, order = x.sort(-1, descending=True)
        V = x.shape[-1]
        kth = srt.gather(-1, (top_k.clamp(min=1, max=V) - 1)[:, None, None].expand(*srt.shape[:2], 1))
        srt = srt.masked_fill((top_k > 0)[:, None, None] & (srt < kth), float("-inf"))
        cut_p = nucleus_cut(srt, top_p[:, None, None]) & (top_p < 1)[:, None, None]
        x = torch.empty_like(x).scatter_(-1, order, srt.masked_fill(cut_p, float("-inf")))
    return x.softmax(-1)


class RowSampling(NamedTuple):
    """Per-row sampling settings on the device, for `sampling_probs`: read once from each row's
    params (anything with temperature, top_k and top_p; a greedy row gets temperature 1, which its
    caller never draws with)."""
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    filtered: bool  # whether any row cuts by top-k or top-p

    @classmethod
    def of(cls, params: Sequence, device: torch.device | str) -> RowSampling:
        return cls(torch.tensor([p.temperature or 1.0 for p in params], device=device),
                   torch.tensor([p.top_k or 0 for p in params], device=device),
                   torch.tensor([p.top_p or 1.0 for p in params], device=device),
                   any(p.top_k is not None or p.top_p is not None for p in params))

    def probs(self, logits: Tensor) -> Tensor:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p, self.filtered)


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """A draw from softmax(logits / temperature) at every position [..., V] -> [...], by Gumbel-max
    with uniforms from `generator` (one per logit): a sequence with its own generator samples the
    same tokens whatever else is in the batch."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp(1e-20, 1 - 1e-7)
    return (scaled(logits, temperature) - torch.log(-torch.log(u))).argmax(-1)


GREEDY_BLOCK = 1024  # greedy searches the vocabulary in blocks of this many logits
GREEDY_BLOCKED_ROWS = 8  # from this many rows on (below, torch's argmax is as fast)


def greedy(logits: Tensor) -> Tensor:
    """logits.argmax(-1): the same tokens (the first of tied maxima; a NaN counts as the largest).
    On a CPU argmax over the last dimension runs about one element at a time while amax is
    vectorised: for many rows of a large vocabulary (a verifying step's), each block's maximum is
    found by amax and only the first block holding the row's maximum is searched."""
    V = logits.shape[-1]
    n = V // GREEDY_BLOCK
    if not logits.is_cpu or n < 2 or logits.numel() < GREEDY_BLOCKED_ROWS * V:
        return logits.argmax(-1)
    peaks = logits[..., : n * GREEDY_BLOCK].unflatten(-1, (n, GREEDY_BLOCK)).amax(-1)
    if V > n * GREEDY_BLOCK:  # a short last block
        peaks = torch.cat([peaks, logits[..., n * GREEDY_BLOCK:].amax(-1, keepdim=True)], -1)
    # the first block holding the maximum, its columns clamped to the vocabulary: a short last
    # block repeats its last column after that column itself, which a first-of-ties search finds first
    first = peaks.argmax(-1, keepdim=True) * GREEDY_BLOCK
    cols = (first + torch.arange(GREEDY_BLOCK, device=logits.device)).clamp_(max=V - 1)
    return cols.gather(-1, logits.gather(-1, cols).argmax(-1, keepdim=True)).squeeze(-1)
