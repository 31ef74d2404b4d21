"""What every decoder returns, and the pieces they share (sampling, prompt batching)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


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

    @property
    def tpf(self) -> float:
        return len(self.tokens) / max(self.forwards, 1)

    @property
    def tps(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(prompt=self.prompt, tokens=self.tokens, positions=self.positions, steps=self.steps,
                    forwards=self.forwards, tokens_fed=self.tokens_fed, seconds=self.seconds,
                    finished=self.finished, tpf=self.tpf, tps=self.tps)


def resolve_params(cls, params, overrides: dict):
    """A decoder's parameter dataclass: `params` (or the defaults) with keyword overrides, validated."""
    p = dataclasses.replace(params or cls(), **overrides)
    p.validate()
    return p


# ---- parameter checks shared by the decoders' validate() (and so by the CLI and any server) ------


def check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_probability(name: str, value: float) -> None:
    # written so that NaN fails too (every comparison with NaN is false)
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    """temperature finite and >= 0 (0 = greedy); top_k >= 1; top_p in (0, 1]; and top_k / top_p only
    when sampling, since greedy decoding would ignore them without a word."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        check_positive("top_k", top_k)
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        # top_p = 0 would keep no token at all (every probability -inf, then NaN)
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError("top_k and top_p apply only when sampling: set temperature > 0 (0 = greedy)")


def check_prompts(config, prompts: list[list[int]], gen_length: int) -> None:
    """Every prompt non-empty with ids in the vocabulary, and prompt + gen_length within the model's
    positions. Run before anything is allocated: a huge gen_length must fail here, not in malloc."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    V = config.vocab_size
    for p in prompts:
        bad = next((t for t in p if not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {V})")
    limit = config.max_position_embeddings
    if gen_length >= limit:
        raise ValueError(f"gen_length {gen_length} exceeds what the model can position "
                         f"(max_position_embeddings {limit}, prompt included)")
    longest = max(len(p) for p in prompts)
    if longest + gen_length > limit:
        raise ValueError(f"prompt ({longest} tokens) + gen_length ({gen_length}) = {longest + gen_length} exceeds "
                         f"the model's max_position_embeddings {limit}; shorten the prompt or lower gen_length")


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """Next tokens [B] from logits [B, V]: greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


def packed_index(widths: list[int], T: int, device: torch.device) -> Tensor | None:
    """model.forward's `real`: the flat indices of each row's last widths[b] columns of a [B, T]
    feed (rows padded on the left), or None when no row is padded. On a CPU a forward costs in
    proportion to the tokens it computes, so a ragged batch computes only its real tokens; on an
    accelerator the padding is nearly free and finding the tokens would cost host syncs, so None."""
    if device.type != "cpu" or all(w == T for w in widths):
        return None
    idx = np.concatenate([np.arange(b * T + T - w, (b + 1) * T) for b, w in enumerate(widths)])
    return torch.from_numpy(idx)
