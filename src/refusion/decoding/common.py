"""What every decoder returns, and the pieces of batching they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from refusion.decoding.controls import Logprobs


@dataclass
class DecodeResult:
    """One sequence's output and honest counters.

    tokens: the generated response in position order, up to and including the first EOS.
    positions / steps: for each token, its position id and the decoding step that committed it.
    forwards: model forward passes this sequence took part in; tokens_fed: tokens it fed.
    """

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    forwards: int = 0
    tokens_fed: int = 0
    seconds: float = 0.0
    finished: bool = False  # ended with EOS (else it hit gen_length)
    logprobs: Logprobs | None = None  # each token's, where its Controls asked (controls.py)

    @property
    def tpf(self) -> float:
        return len(self.tokens) / max(self.forwards, 1)

    @property
    def tps(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(prompt=self.prompt, tokens=self.tokens, positions=self.positions, steps=self.steps,
                    forwards=self.forwards, tokens_fed=self.tokens_fed, seconds=self.seconds,
                    finished=self.finished, tpf=self.tpf, tps=self.tps,
                    **({} if self.logprobs is None else {"logprobs": self.logprobs.to_dict()}))


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Left-pad prompts to one length: (ids [B, P], positions [B, P], valid [B, P])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), positions.to(device), valid.to(device)


def packed_index(widths: Sequence[int] | np.ndarray, T: int, device: torch.device) -> Tensor | None:
    """model.forward's `real`: the flat indices of each row's last widths[b] columns of a [B, T]
    feed (rows padded on the left), or None when no row is padded. On a CPU a forward costs in
    proportion to the tokens it computes, so a ragged batch computes only its real tokens; on an
    accelerator the padding is nearly free and finding the tokens would cost host syncs, so None."""
    if device.type != "cpu" or all(w == T for w in widths):
        return None
    w = np.asarray(widths)
    return torch.from_numpy(np.flatnonzero(np.arange(T)[None, :] >= T - w[:, None]))
