"""Decoders on one interface: decode(model, prompts, decoder=..., **params) -> list[DecodeResult].

refusion       plan-and-infill (spec section 4)
refusion-l2r   plan-and-infill that always takes the leftmost undecoded slot
ar             autoregressive with the KV cache
speculative    self-speculative: the masks draft, causal predictions verify; greedy AR's exact output
mdm            LLaDA-style masked diffusion (fixed tokens per step, semi-autoregressive blocks)
mdm-threshold  Fast-dLLM-style: every mask above a confidence, at least one per step

The decoder modules import torch; they are loaded on first use, so that `refusion --help` (which
only needs DECODERS) starts without it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refusion.model.config import ModelConfig
    from refusion.model.transformer import Transformer
    from refusion.decoding.common import DecodeResult

DECODERS = ("speculative", "refusion", "refusion-l2r", "ar", "mdm", "mdm-threshold")

# which decoders fit a model trained with each objective (config.json "training_objective")
FITTING = {
    "refusion": ("speculative", "refusion", "refusion-l2r", "ar"),
    "mdm": ("mdm", "mdm-threshold"),
    "ar": ("ar",),
}


def default_decoder(config: ModelConfig) -> str:
    """The decoder a model gets when none is named: the one its training objective fits.

    No mask token, or trained with the AR objective: ar. Trained with the MDM objective (or
    bidirectional attention): mdm-threshold. Otherwise (ReFusion, or an unrecorded objective with a
    mask token): speculative, which gives AR decoding's output at several tokens per forward
    (benchmarks/decode.py).
    """
    objective = config.training_objective
    if config.mask_token_id is None or objective == "ar":
        return "ar"
    if objective == "mdm" or config.bidirectional:
        return "mdm-threshold"
    return "speculative"


def mismatch(config: ModelConfig, decoder: str) -> str | None:
    """A warning when `decoder` does not fit how the model was trained (None when it does, or when
    the objective was not recorded)."""
    objective = config.training_objective or ("mdm" if config.bidirectional else None)
    fitting = FITTING.get(objective or "")
    if fitting is None or decoder in fitting:
        return None
    return (f"this model was trained with the {objective} objective, which decoder {decoder!r} does not fit "
            f"(fitting: {', '.join(fitting)}); expect poor output")


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def make_params(decoder: str, **params) -> Any:
    """`decoder`'s validated parameter dataclass (ReFusionParams, MDMParams, ARParams) from keyword
    arguments: what decode() checks before it touches the model, usable without a model."""
    if decoder in ("refusion", "refusion-l2r"):
        from refusion.decoding.refusion import ReFusionParams

        _check(decoder, params, _fields(ReFusionParams))
        p = ReFusionParams(**params)
        p.left_to_right = p.left_to_right or decoder == "refusion-l2r"
    elif decoder == "speculative":
        from refusion.decoding.speculative import SpeculativeParams

        _check(decoder, params, _fields(SpeculativeParams))
        p = SpeculativeParams(**params)
    elif decoder in ("mdm", "mdm-threshold"):
        from refusion.decoding.mdm import MDMParams

        _check(decoder, params, _fields(MDMParams))
        p = MDMParams(**params)
        if decoder == "mdm-threshold" and p.threshold is None:
            p.threshold = 0.9
        if decoder == "mdm" and p.threshold is not None:
            raise ValueError("decoder 'mdm' commits a fixed number per step; use 'mdm-threshold' for a threshold")
    elif decoder == "ar":
        from refusion.decoding.ar import ARParams

        _check(decoder, params, _fields(ARParams) | {"max_new_tokens"})
        if "max_new_tokens" in params:  # generate_ar's name for gen_length
            if "gen_length" in params:
                raise ValueError("give gen_length or max_new_tokens, not both")
            params["gen_length"] = params.pop("max_new_tokens")
        p = ARParams(**params)
    else:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
    p.validate()
    return p


def decode(model: Transformer, prompts: list[list[int]], decoder: str = "speculative",
           eos_ids: list[int] | None = None, seed: int | None = None,
           on_commit: Callable[[int, list[int], list[int]], None] | None = None,
           **params) -> list[DecodeResult]:
    """Run one of DECODERS. Parameters a decoder does not take are an error, not silently ignored;
    so are bad values, and a prompt + gen_length beyond the model's positions (checked before
    anything is allocated).

    on_commit(row, positions, tokens) is called for every commit, as it happens (streaming). A
    decoder can commit tokens at positions after the sequence's first EOS before it knows where
    that EOS is (plan-and-infill drafts later slots first; masked diffusion fills a whole block):
    those commits are reported too, and are not part of the result. The result is always what
    the commits give when sorted by position and cut after the first EOS, so a streaming client
    should do the same.
    """
    from refusion.decoding.common import check_prompts

    p = make_params(decoder, **params)
    check_prompts(model.config, prompts, p.gen_length)  # every decoder, before it allocates anything
    if decoder in ("refusion", "refusion-l2r"):
        from refusion.decoding.refusion import generate_refusion

        return generate_refusion(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    if decoder == "speculative":
        from refusion.decoding.speculative import generate_speculative

        return generate_speculative(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    if decoder in ("mdm", "mdm-threshold"):
        from refusion.decoding.mdm import generate_mdm

        return generate_mdm(model, prompts, p, eos_ids=eos_ids, seed=seed, on_commit=on_commit)
    if decoder == "ar":
        from refusion.decoding.ar import generate_ar

        on_token = None if on_commit is None else (lambda r, q, t: on_commit(r, [q], [t]))
        return generate_ar(model, prompts, max_new_tokens=p.gen_length, temperature=p.temperature, top_k=p.top_k,
                           top_p=p.top_p, first_from_mask=p.first_from_mask, eos_ids=eos_ids, seed=seed,
                           on_token=on_token)
    raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")


def _check(decoder: str, params: dict, allowed: set[str]) -> None:
    bad = sorted(set(params) - allowed)
    if bad:
        raise ValueError(f"decoder {decoder!r} does not take {', '.join(bad)} (it takes: {', '.join(sorted(allowed))})")


_LAZY = {"DecodeResult": "common", "ARParams": "ar", "generate_ar": "ar", "MDMParams": "mdm",
         "generate_mdm": "mdm", "ReFusionParams": "refusion", "generate_refusion": "refusion",
         "SpeculativeBatch": "speculative", "SpeculativeParams": "speculative",
         "generate_speculative": "speculative"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DECODERS", "ARParams", "DecodeResult", "MDMParams", "ReFusionParams", "SpeculativeBatch",
           "SpeculativeParams", "decode", "default_decoder", "generate_ar", "generate_mdm", "generate_refusion",
           "generate_speculative", "make_params", "mismatch"]
