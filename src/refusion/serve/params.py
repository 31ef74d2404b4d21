"""A request's decoder and its parameters, validated the way the CLI validates them.

Which extra body fields a decoder takes is read from its parameter dataclass, so a field added to
a decoder is accepted by the server without touching this file, and a field the chosen decoder
does not take is a 400 naming the fields it does take (as `decode()` does).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from ..decoding import DECODERS, MDMParams, ReFusionParams, SpeculativeParams
from .schemas import GenerationRequest, RequestError

SERVE_DECODERS = DECODERS
_AR_FIELDS = {"temperature": float, "top_k": int, "top_p": float}
# set from the standard OpenAI fields, never as extra body fields
_STANDARD = {"gen_length", "temperature", "top_p"}


@dataclass
class DecoderChoice:
    """decoder: a name from SERVE_DECODERS. params: the keyword arguments decode() takes for it
    (gen_length included). spec: set when the job runs in the engine's continuous batch (a
    SpeculativeBatch), with the validated SpeculativeParams it is added with."""

    decoder: str
    params: dict[str, Any]
    spec: SpeculativeParams | None = None

    @property
    def temperature(self) -> float:
        return float(self.params.get("temperature") or 0.0)

    @property
    def gen_length(self) -> int:
        return int(self.params["gen_length"])


def default_decoder(has_mask: bool) -> str:
    # speculative is exact AR output at parallel speed, so it is the default wherever it can run
    return "speculative" if has_mask else "ar"


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        out[f.name] = args[0] if args else t
    return out


def decoder_fields(decoder: str) -> dict[str, type]:
    """The parameters `decoder` takes, with their types (gen_length and temperature included)."""
    if decoder == "speculative":
        return _field_types(SpeculativeParams)
    if decoder in ("refusion", "refusion-l2r"):
        return {k: t for k, t in _field_types(ReFusionParams).items() if k != "left_to_right"}
    if decoder in ("mdm", "mdm-threshold"):
        return _field_types(MDMParams)
    return dict(_AR_FIELDS)


def choose(req: GenerationRequest, has_mask: bool, max_tokens: int) -> DecoderChoice:
    """The decoder and validated parameters for a request whose max_tokens is already settled."""
    decoder = req.decoder or default_decoder(has_mask)
    if decoder not in SERVE_DECODERS:
        raise RequestError(400, f"unknown decoder {decoder!r}; choose one of {', '.join(SERVE_DECODERS)}", "decoder")
    if not has_mask and decoder != "ar":
        raise RequestError(400, f"decoder {decoder!r} needs a model with a mask token; this one has none "
                                "(use decoder 'ar')", "decoder")
    allowed = decoder_fields(decoder)
    extra = dict(req.decoder_params)
    bad = sorted(k for k in extra if k not in allowed or k in _STANDARD)
    if bad:
        takes = sorted(set(allowed) - _STANDARD)
        raise RequestError(400, f"decoder {decoder!r} does not take {', '.join(bad)} (it takes: {', '.join(takes)})",
                           bad[0])
    if req.top_p is not None and req.top_p < 1.0 and "top_p" not in allowed:
        raise RequestError(400, f"decoder {decoder!r} does not sample with top_p", "top_p")
    for k, v in extra.items():
        _check_type(k, v, allowed[k])
    params: dict[str, Any] = {"gen_length": max_tokens, **extra}
    if req.temperature is not None:
        params["temperature"] = req.temperature
    if req.top_p is not None and req.top_p < 1.0 and "top_p" in allowed:  # 1.0 is OpenAI's default: a no-op
        params["top_p"] = req.top_p
    try:
        return _validated(decoder, params, has_mask)
    except (ValueError, TypeError) as e:
        raise RequestError(400, str(e)) from None


def _validated(decoder: str, params: dict[str, Any], has_mask: bool) -> DecoderChoice:
    if decoder == "speculative":
        spec = SpeculativeParams(**params)
        spec.validate()
        return DecoderChoice(decoder, params, spec)
    if decoder in ("refusion", "refusion-l2r"):
        ReFusionParams(**params).validate()
        return DecoderChoice(decoder, params)
    if decoder in ("mdm", "mdm-threshold"):
        p = dict(params)
        p.setdefault("steps", p["gen_length"])  # as the CLI: one token per step unless told
        if decoder == "mdm-threshold":
            p.setdefault("threshold", 0.9)
        elif p.get("threshold") is not None:
            raise ValueError("decoder 'mdm' commits a fixed number per step; use 'mdm-threshold' for a threshold")
        MDMParams(**p).validate()
        return DecoderChoice(decoder, p)
    # ar: generate_ar checks max_new_tokens itself; the sampling ranges are checked here
    if params.get("top_k") is not None and params["top_k"] < 1:
        raise ValueError(f"top_k must be >= 1, got {params['top_k']}")
    if has_mask and not params.get("temperature"):
        # Greedy AR is the speculative batch with no drafts: the same tokens and counters as
        # decode(..., "ar") (tests/test_serve_engine.py), and it joins the continuous batch.
        # Sampled AR is not: generate_ar draws from one generator for the whole batch.
        spec = SpeculativeParams(gen_length=params["gen_length"], draft_length=0, mask_length=0, adaptive=False)
        spec.validate()
        return DecoderChoice(decoder, params, spec)
    return DecoderChoice(decoder, params)


def _check_type(name: str, v: Any, typ: type) -> None:
    ok = isinstance(v, bool) if typ is bool else (
        isinstance(v, typ) and not isinstance(v, bool) if typ is int else
        isinstance(v, (int, float)) and not isinstance(v, bool))
    if not ok:
        kind = {bool: "a boolean", int: "an integer", float: "a number"}.get(typ, typ.__name__)
        raise RequestError(400, f"{name} must be {kind}, got {type(v).__name__}", name)
