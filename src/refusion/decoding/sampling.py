"""Sampling for every decoder: temperature, top-k / top-p filtering, multinomial draws, Gumbel-max.

Seeded outputs are part of the decoders' contract (benchmarks/check_outputs.py), so every function
here makes exactly the random draws its callers always made: same generator, calls, shapes, dtypes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.decoding.params import check_seed


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    check_seed(seed)  # (torch's own message for a seed out of range is an overflow)
    return torch.Generator(device=device).manual_seed(seed)


def nucleus_cut(sorted_logits: Tensor, top_p: float | Tensor) -> Tensor:
    """Over logits sorted in descending order: True where a token lies outside the smallest set
    whose probability reaches top_p. The set always keeps the most likely token: a top_p below
    float32's smallest number rounds to 0, which would otherwise cut every token."""
    sp = sorted_logits.softmax(-1)
    cut = sp.cumsum(-1) - sp >= top_p
    cut[..., 0] = False
    return cut


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """Next tokens [B] from logits [B, V], one setting for the whole batch: greedy at temperature 0,
    else a multinomial draw from the tempered distribution cut to the top-k tokens, then to the
    top-p nucleus of those."""
    if temperature <= 0:
        return logits.argmax(-1)
    x = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = x.topk(min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # sorted after the top-k cut: which of two tied tokens the nucleus keeps depends on it
        srt, order = x.sort(-1, descending=True)
        drop = nucleus_cut(srt, top_p)
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator).squeeze(-1)


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool = True
                   ) -> Tensor:
    """The distributions [B, N, V] that `sample` draws from, with per-row settings (temperature
    [B] > 0; top_k [B], 0 = off; top_p [B], 1 = off): what speculative sampling accepts and draws
    with. One sort serves both cuts (tied tokens may fall on either side of a cut in another order
    than in `sample`). filtered=False: no row uses top-k or top-p (known on the host, so the sort
    is skipped without a device sync)."""
    x = logits / temperature[:, None, None]
    if filtered:
        srt, order = x.sort(-1, descending=True)
        V = x.shape[-1]
        kth = srt.gather(-1, (top_k.clamp(min=1, max=V) - 1)[:, None, None].expand(*srt.shape[:2], 1))
        srt = srt.masked_fill((top_k > 0)[:, None, None] & (srt < kth), float("-inf"))
        cut_p = nucleus_cut(srt, top_p[:, None, None]) & (top_p < 1)[:, None, None]
        x = torch.empty_like(x).scatter_(-1, order, srt.masked_fill(cut_p, float("-inf")))
    return x.softmax(-1)


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """A draw from softmax(logits / temperature) at every position [..., V] -> [...], by Gumbel-max
    with uniforms from `generator` (one per logit): a sequence with its own generator samples the
    same tokens whatever else is in the batch."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp(1e-20, 1 - 1e-7)
    return (logits / temperature - torch.log(-torch.log(u))).argmax(-1)
