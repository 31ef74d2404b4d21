"""A request's decoder and its parameters, validated the way the CLI validates them.

Which extra body fields a decoder takes is read from its parameter dataclass, so a field added to
a decoder is accepted by the server without touching this file; values are checked by
`decoding.make_params`, the one place every caller (CLI, decode(), this server) validates them, so
a request gets the same one-line message the CLI would print.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass
from typing import Any

from refusion.model.config import ModelConfig
from refusion.decoding import DECODERS, SpeculativeParams, default_decoder, make_params
from refusion.serve.schemas import GenerationRequest, RequestError

SERVE_DECODERS = DECODERS
_PARAMS = {"speculative": ("speculative", "SpeculativeParams"), "refusion": ("refusion", "ReFusionParams"),
           "refusion-l2r": ("refusion", "ReFusionParams"), "mdm": ("mdm", "MDMParams"),
           "mdm-threshold": ("mdm", "MDMParams"), "ar": ("ar", "ARParams")}
# set from the standard OpenAI fields (max_tokens, temperature, top_p), or internal
_NOT_EXTRA = {"gen_length", "temperature", "top_p", "left_to_right"}


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


def decoder_fields(decoder: str) -> dict[str, type]:
    """The parameters `decoder` takes, with their types (gen_length and temperature included)."""
    module, name = _PARAMS[decoder]
    cls = getattr(importlib.import_module(f"refusion.decoding.{module}"), name)
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "left_to_right":  # refusion-l2r's switch, not a request field
            continue
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        out[f.name] = args[0] if args else hints[f.name]
    return out


def choose(req: GenerationRequest, config: ModelConfig, max_tokens: int) -> DecoderChoice:
    """The decoder and validated parameters for a request whose max_tokens is already settled."""
    has_mask = config.mask_token_id is not None
    decoder = req.decoder or default_decoder(config)
    if decoder not in SERVE_DECODERS:
        raise RequestError(400, f"unknown decoder {decoder!r}; choose one of {', '.join(SERVE_DECODERS)}", "decoder")
    if not has_mask and decoder != "ar":
        raise RequestError(400, f"decoder {decoder!r} needs a model with a mask token; this one has none "
                                "(use decoder 'ar')", "decoder")
    allowed = decoder_fields(decoder)
    extra = dict(req.decoder_params)
    bad = sorted(k for k in extra if k not in allowed or k in _NOT_EXTRA)
    if bad:
        takes = sorted(set(allowed) - _NOT_EXTRA)
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
        p = make_params(decoder, **params)
    except (ValueError, TypeError) as e:
        raise RequestError(400, str(e)) from None
    if decoder == "speculative":
        return DecoderChoice(decoder, params, p)
    if decoder == "ar" and has_mask and not p.temperature and p.first_from_mask is not False:
        # Greedy AR is the speculative batch with no drafts: the same tokens and counters as
        # decode(..., "ar") (tests/test_serve_engine.py), and it joins the continuous batch.
        # Sampled AR is not: generate_ar draws from one generator for the whole batch.
        return DecoderChoice(decoder, params, make_params("speculative", gen_length=p.gen_length, draft_length=0,
                                                          mask_length=0, adaptive=False))
    return DecoderChoice(decoder, params)


def _check_type(name: str, v: Any, typ: type) -> None:
    ok = isinstance(v, bool) if typ is bool else (
        isinstance(v, typ) and not isinstance(v, bool) if typ is int else
        isinstance(v, (int, float)) and not isinstance(v, bool))
    if not ok:
        kind = {bool: "a boolean", int: "an integer", float: "a number"}.get(typ, typ.__name__)
        raise RequestError(400, f"{name} must be {kind}, got {type(v).__name__}", name)
