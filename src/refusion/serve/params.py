"""A request's decoder and its parameters, validated the way the CLI validates them.

Which extra body fields a decoder takes, and their types, are read from the decoder registry, so a
field added to a decoder (or a decoder registered) is accepted by the server without touching this
file; values are checked by `decoding.make_params`, the one place every caller (CLI, decode(),
lm-eval, this server) validates them, so a request gets the same one-line message the CLI would
print. Whether a job joins the engine's continuous batch is the decoder record's `batch`.

max_tokens is the API's word for gen_length. A decoder that decodes in whole blocks or slots
(`Decoder.gen_unit`: mdm's block_length, refusion's slot_size x serial_blocks) gets gen_length
rounded up to a whole number of them, and the answer is cut at max_tokens (app.py), as lm-eval's
adapter does with max_gen_toks; so any max_tokens works with any block size, and the answer is
exactly the first max_tokens tokens of that decode.

Controls (a grammar from response_format / structured_outputs, logit_bias, penalties, logprobs)
apply only in the decoders whose record says `controls` (ar and speculative: their verify pass sees
the causal logits AR decoding sees, so a control there is exact). A request that asks for one and
names no decoder runs speculative (its answers are AR's) when the model's default cannot apply it;
one that names such a decoder is refused, naming the decoders that can.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from refusion.decoding import SpeculativeParams, make_params, model_settings, registry
from refusion.decoding.controls import Controls
from refusion.model.config import ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.serve.schemas import OPENAI_SET, Constraint, GenerationRequest, RequestError


@dataclass
class DecoderChoice:
    """decoder: a registered name. params: the keyword arguments decode() takes for it
    (gen_length included: max_tokens rounded up to the decoder's unit). spec: set when the job runs
    in the engine's continuous batch (a SpeculativeBatch), with the validated SpeculativeParams it
    is added with. max_tokens: where the answer is cut (gen_length when None); 0 asks for no
    answer (the prompt's logprobs alone). controls: what applies to each verified position
    (set by `with_controls` once the tokenizer is at hand)."""

    decoder: str
    params: dict[str, Any]
    spec: SpeculativeParams | None = None
    max_tokens: int | None = None
    controls: Controls | None = None

    @property
    def temperature(self) -> float:
        return float(self.params.get("temperature") or 0.0)

    @property
    def gen_length(self) -> int:
        return int(self.params["gen_length"])

    @property
    def cut(self) -> int:
        """The most answer tokens the client gets."""
        return self.max_tokens if self.max_tokens is not None else self.gen_length


def choose(req: GenerationRequest, config: ModelConfig, max_tokens: int,
           settings: model_settings.ModelSettings | None = None) -> DecoderChoice:
    """The decoder and validated parameters for a request whose max_tokens is already settled: the
    request's fields over the model's decoding.json (`settings`) over the decoder's defaults."""
    decoder = model_settings.choose(settings, config, req.decoder)
    if decoder not in registry.names():
        raise RequestError(400, f"unknown decoder {decoder!r}; choose one of {', '.join(registry.names())}",
                           "decoder")
    if max_tokens == 0:  # no answer: nothing is decoded (the engine scores the prompt)
        return DecoderChoice(decoder, {"gen_length": 0}, None, 0)
    asked = req.control_fields()
    if asked and not registry.get(decoder).controls:
        able = registry.with_controls(registry.available(config))
        if req.decoder is not None or not able:
            raise RequestError(400, f"decoder {decoder!r} cannot apply {asked[0]}; the decoders that can: "
                                    f"{', '.join(able)} (their verify pass sees the causal distribution)", asked[0])
        decoder = "speculative" if "speculative" in able else able[0]
    record = registry.get(decoder)
    if record.needs_mask and config.mask_token_id is None:
        raise RequestError(400, f"decoder {decoder!r} needs a model with a mask token; this one has none "
                                "(use decoder 'ar')", "decoder")
    allowed = {o.name: o for o in registry.options(decoder)}
    extra = dict(req.decoder_params)
    bad = sorted(k for k in extra if k not in allowed or k in OPENAI_SET)
    if bad:
        takes = sorted(set(allowed) - set(OPENAI_SET))
        raise RequestError(400, registry.refusal(decoder, bad, takes), bad[0])
    if req.top_p is not None and req.top_p < 1.0 and "top_p" not in allowed:
        raise RequestError(400, f"decoder {decoder!r} does not sample with top_p", "top_p")
    for k, v in extra.items():
        _check_type(k, v, allowed[k].type)
    _, params = model_settings.resolve(settings, config, decoder, {"gen_length": max_tokens, **extra})
    if req.temperature is not None:
        params["temperature"] = req.temperature
    if req.top_p is not None and req.top_p < 1.0 and "top_p" in allowed:  # 1.0 is OpenAI's default: a no-op
        params["top_p"] = req.top_p
    unit = record.gen_unit(registry.settings(decoder, **params))
    if unit >= 1:  # (a unit < 1 comes from a bad parameter, which make_params names)
        params["gen_length"] = -(-max_tokens // unit) * unit
    try:
        p = make_params(decoder, **params)
    except (ValueError, TypeError) as e:
        raise _refusal(str(e), params, max_tokens) from None
    spec = record.batch(p, config) if record.batch is not None else None
    return DecoderChoice(decoder, params, spec, max_tokens)


def with_controls(choice: DecoderChoice, req: GenerationRequest, tok: Tokenizer, vocab_size: int) -> DecoderChoice:
    """The choice with the request's Controls (None when it asks for none); the grammar is compiled
    here, off the engine's thread, and an invalid schema or pattern is a 400 naming its field."""
    if not req.control_fields():
        return choice
    try:
        grammar = _grammar(req.constraint, tok) if req.constraint is not None else None
    except ValueError as e:
        raise RequestError(400, f"{req.constraint.param}: {e}", req.constraint.param) from None
    try:
        controls = Controls(grammar=grammar, logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                            frequency_penalty=req.frequency_penalty, logprobs=req.logprobs)
        controls.check_vocab(vocab_size)
    except ValueError as e:
        field = next((k for k in ("logit_bias", "presence_penalty", "frequency_penalty", "logprobs")
                      if k in str(e)), None)
        raise RequestError(400, str(e), field) from None
    choice.controls = controls
    return choice


def _grammar(c: Constraint, tok: Tokenizer):
    from refusion.decoding import grammar

    if c.kind == "json_object":
        return grammar.json_object(tok)
    if c.kind == "json_schema":
        return grammar.json_schema(tok, c.value)
    return grammar.regex(tok, c.value) if c.kind == "regex" else grammar.choice(tok, c.value)


def _refusal(message: str, params: dict[str, Any], max_tokens: int) -> RequestError:
    """A decoder's validation message in the API's words (max_tokens, not gen_length), with the
    request field it names as the error's param."""
    rounded = params["gen_length"]
    said = "max_tokens" if rounded == max_tokens else f"max_tokens {max_tokens}, rounded up to whole blocks,"
    message = re.sub(r"\bgen_length\b", said, message)
    named = [k for k in params if k != "gen_length" and re.search(rf"\b{k}\b", message)]
    param = min(named, key=lambda k: message.index(k)) if named else (
        "max_tokens" if "max_tokens" in message else None)
    return RequestError(400, message, param)


def _check_type(name: str, v: Any, typ: type) -> None:
    ok = isinstance(v, bool) if typ is bool else (
        isinstance(v, typ) and not isinstance(v, bool) if typ is int else
        isinstance(v, (int, float)) and not isinstance(v, bool) if typ is float else isinstance(v, typ))
    if not ok:
        kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(typ, typ.__name__)
        raise RequestError(400, f"{name} must be {kind}, got {type(v).__name__}", name)
