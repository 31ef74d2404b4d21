"""TEMPORARY stand-in for refusion.decoding.speculative (removed when the real module lands).

Same interface as SpeculativeBatch: sequences join with add(), every step() advances each running
sequence by one forward, cancel() drops one at once. Decoding is plain greedy/sampled AR, one
forward per sequence (not batched): correct, not fast; it exists only to build the server on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..decoding.common import DecodeResult, sample
from ..model import Transformer


@dataclass
class SpeculativeParams:
    gen_length: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    accept_prob: float | None = None
    draft_length: int = 4
    mask_length: int = 4
    adaptive: bool = True

    def validate(self) -> None:
        if self.gen_length < 1:
            raise ValueError(f"gen_length must be >= 1, got {self.gen_length}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class _Seq:
    def __init__(self, prompt: list[int], p: SpeculativeParams, seed: int | None, on_commit) -> None:
        self.prompt, self.p, self.on_commit = list(prompt), p, on_commit
        self.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.cache = None
        self.logits = None
        self.res = DecodeResult(prompt=list(prompt))
        self.start = time.perf_counter()


class SpeculativeBatch:
    def __init__(self, model: Transformer, eos_ids: list[int] | None = None) -> None:
        self.model = model
        self.eos = set(eos_ids if eos_ids is not None else model.config.eos_ids)
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, prompt_ids: list[int], p: SpeculativeParams, seed: int | None = None,
            on_commit: Callable[[list[int], list[int]], None] | None = None) -> int:
        p.validate()
        if not prompt_ids:
            raise ValueError("every prompt needs at least one token")
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = _Seq(prompt_ids, p, seed, on_commit)
        return sid

    def cancel(self, sid: int) -> DecodeResult:
        q = self.seqs.pop(sid)
        q.res.seconds = time.perf_counter() - q.start
        return q.res

    @torch.inference_mode()
    def step(self) -> list[tuple[int, DecodeResult]]:
        done = []
        mask_id = self.model.config.mask_token_id
        for sid, q in list(self.seqs.items()):
            P = len(q.prompt)
            if q.cache is None:  # prefill, the first token read from a mask at its position
                q.cache = self.model.new_cache()
                ids = q.prompt + ([mask_id] if mask_id is not None else [])
                pos = list(range(P)) + ([P] if mask_id is not None else [])
                logits = self.model(torch.tensor([ids]), torch.tensor([pos]), cache=q.cache)[:, -1]
                if mask_id is not None:
                    q.cache.crop(P)
                q.res.tokens_fed += len(ids)
            else:
                t = q.res.tokens[-1]
                logits = self.model(torch.tensor([[t]]), torch.tensor([[P + len(q.res.tokens) - 1]]),
                                    cache=q.cache)[:, -1]
                q.res.tokens_fed += 1
            tok = int(sample(logits, q.p.temperature, q.p.top_k, q.p.top_p, q.gen)[0])
            q.res.forwards += 1
            pos_t = P + len(q.res.tokens)
            q.res.tokens.append(tok)
            q.res.positions.append(pos_t)
            q.res.steps.append(q.res.forwards - 1)
            if q.on_commit is not None:
                q.on_commit([pos_t], [tok])
            if tok in self.eos or len(q.res.tokens) >= q.p.gen_length:
                q.res.finished = tok in self.eos
                done.append((sid, self.cancel(sid)))
        return done
