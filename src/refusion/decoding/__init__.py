"""Decoders on one interface: decode(model, prompts, decoder=..., **params) -> list[DecodeResult].

refusion       plan-and-infill (spec section 4)
refusion-l2r   plan-and-infill that always takes the leftmost undecoded slot
ar             autoregressive with the KV cache
speculative    self-speculative: the masks draft, causal predictions verify; greedy AR's exact output
mdm            LLaDA-style masked diffusion (fixed tokens per step, semi-autoregressive blocks)
mdm-threshold  Fast-dLLM-style: every mask above a confidence, at least one per step
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..model import Transformer
from .ar import generate_ar
from .common import DecodeResult
from .mdm import MDMParams, generate_mdm
from .refusion import ReFusionParams, generate_refusion
from .speculative import SpeculativeBatch, SpeculativeParams, generate_speculative

DECODERS = ("speculative", "refusion", "refusion-l2r", "ar", "mdm", "mdm-threshold")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def decode(model: Transformer, prompts: list[list[int]], decoder: str = "refusion",
           eos_ids: list[int] | None = None, seed: int | None = None,
           on_commit: Callable[[int, list[int], list[int]], None] | None = None,
           **params) -> list[DecodeResult]:
    """Run one of DECODERS. Parameters a decoder does not take are an error, not silently ignored.

    on_commit(row, positions, tokens) is called for every commit, as it happens (streaming).
    """
    if decoder in ("refusion", "refusion-l2r"):
        _check(decoder, params, _fields(ReFusionParams))
        p = ReFusionParams(**params)
        p.left_to_right = p.left_to_right or decoder == "refusion-l2r"
        return generate_refusion(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    if decoder == "speculative":
        _check(decoder, params, _fields(SpeculativeParams))
        return generate_speculative(model, prompts, SpeculativeParams(**params), eos_ids=eos_ids, seed=seed,
                                    on_commit=on_commit)
    if decoder in ("mdm", "mdm-threshold"):
        _check(decoder, params, _fields(MDMParams))
        p = MDMParams(**params)
        if decoder == "mdm-threshold" and p.threshold is None:
            p.threshold = 0.9
        if decoder == "mdm" and p.threshold is not None:
            raise ValueError("decoder 'mdm' commits a fixed number per step; use 'mdm-threshold' for a threshold")
        return generate_mdm(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    if decoder == "ar":
        allowed = {"max_new_tokens", "gen_length", "temperature", "top_k", "top_p", "first_from_mask"}
        _check(decoder, params, allowed)
        if "gen_length" in params:
            params["max_new_tokens"] = params.pop("gen_length")
        on_token = None if on_commit is None else (lambda r, q, t: on_commit(r, [q], [t]))
        return generate_ar(model, prompts, eos_ids=eos_ids, seed=seed, on_token=on_token, **params)
    raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")


def _check(decoder: str, params: dict, allowed: set[str]) -> None:
    bad = sorted(set(params) - allowed)
    if bad:
        raise ValueError(f"decoder {decoder!r} does not take {', '.join(bad)} (it takes: {', '.join(sorted(allowed))})")


__all__ = ["DECODERS", "DecodeResult", "MDMParams", "ReFusionParams", "SpeculativeBatch", "SpeculativeParams",
           "decode", "generate_ar", "generate_mdm", "generate_refusion", "generate_speculative"]
