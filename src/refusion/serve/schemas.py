"""OpenAI request bodies -> plain dataclasses, checked by hand.

Hand-written rather than a pydantic model so that every malformed body gets one precise message
naming the offending field, in OpenAI's error shape, and so that type checks are strict: JSON
`true` is not an integer, `"5"` is not a number, NaN and Infinity are not numbers at all. Fields
that OpenAI defines but this server cannot honour (best_of, suffix, tools) are refused rather than
silently ignored; unknown fields are refused too, because a misspelt decoder parameter would
otherwise change nothing and look like it worked.

Structured outputs come as OpenAI's `response_format` or as vLLM's `structured_outputs` object
(`json`, `regex`, `choice`, `json_object`); vLLM's older `guided_*` fields get a 400 naming their
replacement, as vLLM's own server does since it removed them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from refusion.decoding import registry
from refusion.decoding.params import GUARDS

# Decoder parameters set from the OpenAI fields (max_tokens, temperature, top_p), not extra fields.
OPENAI_SET = ("gen_length", "temperature", "top_p")
# OpenAI fields that change nothing here at their default and are refused otherwise.
_UNSUPPORTED_UNLESS_DEFAULT = {"best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
                               "functions": (None, []), "tool_choice": (None, "none", "auto")}
# Accepted and ignored: bookkeeping fields that do not affect the output.
_IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "structured_outputs")
# vLLM's structured-output fields before 0.12, and what replaced them
_RENAMED = {f"guided_{k}": f"structured_outputs.{k}" for k in ("json", "regex", "choice", "grammar")}
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_SEED = 2**63 - 1
MAX_N = 128  # OpenAI's limit on choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit, here for completions too (OpenAI's legacy limit there is 5)
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100]
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]


@dataclass(frozen=True)
class Constraint:
    """What the answer must match: kind json_object (any JSON object), json_schema (value: the schema,
    a dict), regex (value: the pattern) or choice (value: the list of allowed answers). param: the
    request field it came from, named in any error about it."""

    kind: str
    value: Any
    param: str


class RequestError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """What both endpoints share once parsed. prompt is text or token ids (completions only)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    decoder: str | None = None
    decoder_params: dict[str, Any] = field(default_factory=dict)  # the extra body fields, by name
    n: int = 1
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: Constraint | None = None

    def control_fields(self) -> list[str]:
        """The request fields that ask for per-token controls (what only some decoders apply)."""
        named = [("logprobs", self.logprobs is not None), ("logit_bias", bool(self.logit_bias)),
                 ("presence_penalty", self.presence_penalty != 0), ("frequency_penalty", self.frequency_penalty != 0)]
        out = [self.constraint.param.split(".")[0]] if self.constraint is not None else []
        return out + [k for k, on in named if on]


@dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""  # the first prompt
    prompts: list[str | list[int]] = field(default_factory=list)  # every prompt: a choice per prompt and n
    echo: bool = False  # the prompt comes back before the answer (with its tokens' logprobs if asked)


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict[str, str]] = field(default_factory=list)


def loads(body: bytes) -> Any:
    """JSON from bytes: UTF-8 only, standard JSON only (no NaN/Infinity), any nesting bomb a 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and our NaN refusal
        raise RequestError(400, f"request body is not valid JSON: {e}") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_completion(body: Any) -> CompletionRequest:
    d = object_of(body)
    _known(d, _COMMON + ("prompt", "logprobs", "echo"))
    req = CompletionRequest()
    req.echo = _opt(d, "echo", bool) or False
    # max_tokens 0 asks for no answer: with echo, the prompt's logprobs alone (how lm-eval scores)
    _common(d, req, min_tokens=0 if req.echo else 1)
    if "prompt" not in d:
        raise RequestError(400, "missing required field: prompt", "prompt")
    req.prompts = _prompts(d["prompt"])
    req.prompt = req.prompts[0]
    if len(req.prompts) * req.n > MAX_N:
        raise RequestError(400, f"at most {MAX_N} choices per request: {len(req.prompts)} prompts x n {req.n}",
                           "prompt")
    req.logprobs = _opt_int(d, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    return req


def parse_chat(body: Any) -> ChatRequest:
    d = object_of(body)
    _known(d, _COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs"))
    if d.get("max_completion_tokens") is not None:  # the newer name of max_tokens in chat (null: not set)
        if d.get("max_tokens") is not None:
            raise RequestError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        d = {**d, "max_tokens": d["max_completion_tokens"]}
    req = ChatRequest()
    _common(d, req)
    if "messages" not in d:
        raise RequestError(400, "missing required field: messages", "messages")
    req.messages = messages_of(d["messages"])
    top = _opt_int(d, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if _opt(d, "logprobs", bool):
        req.logprobs = top or 0
    elif top is not None:
        raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return req


def decoder_fields() -> tuple[str, ...]:
    """The extra body fields a request may carry next to the OpenAI ones: "decoder" and every
    registered decoder's parameters (params.py checks which decoder takes which), so that an
    unknown name is caught before decoding starts."""
    out = {"decoder": None}
    for name in registry.names():
        out.update((o.name, None) for o in registry.options(name) if o.name not in OPENAI_SET)
    return tuple(out)


def _python_only(name: str) -> str | None:
    """What a request field that was public before 0.2 is now (None for any other name)."""
    if name in GUARDS:
        return f"{name} is now part of checks (true: join check, causal infill and row recheck together)"
    hidden = {o.name for d in registry.names() for o in registry.options(d, hidden=True) if o.hidden}
    if name in hidden or name == "adaptive":
        return (f"{name} is not a request field: it is a Python-only setting of the decoder, and the model's "
                "decoding.json sets what was measured best for it (GET /v1/decoders lists the fields)")
    return None


# ---- pieces ---------------------------------------------------------------------------------


def object_of(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {_kind(body)}")
    return body


def _known(d: dict, fields: tuple[str, ...]) -> None:
    allowed = set(fields) | set(decoder_fields()) | set(_IGNORED) | set(_UNSUPPORTED_UNLESS_DEFAULT)
    for k in d:
        if k in _RENAMED:
            raise RequestError(400, f"{k} is now {_RENAMED[k]} (vLLM's name since its 0.12)", k)
        if k not in allowed:
            raise RequestError(400, _python_only(k) or f"unrecognized request argument: {k!r}", k)
    for k, defaults in _UNSUPPORTED_UNLESS_DEFAULT.items():
        if k in d and not any(d[k] == v and type(d[k]) is type(v) for v in defaults) and d[k] is not None:
            raise RequestError(400, f"{k} is not supported by this server (leave it out)", k)


def _common(d: dict, req: GenerationRequest, min_tokens: int = 1) -> None:
    req.model = _opt(d, "model", str)
    req.max_tokens = _opt_int(d, "max_tokens", lo=min_tokens)
    req.temperature = _opt_number(d, "temperature", 0.0, 2.0)
    req.top_p = _opt_number(d, "top_p", 0.0, 1.0)
    if req.top_p is not None and req.top_p == 0.0:
        raise RequestError(400, "top_p must be greater than 0", "top_p")
    req.n = _opt_int(d, "n", lo=1, hi=MAX_N) or 1
    req.stream = _opt(d, "stream", bool) or False
    so = d.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
            raise RequestError(400, "stream_options must be an object with include_usage", "stream_options")
        if not req.stream:
            raise RequestError(400, "stream_options needs stream: true", "stream_options")
        req.include_usage = _opt(so, "include_usage", bool, "stream_options.include_usage") or False
    req.stop = _stop(d.get("stop"))
    req.seed = _opt_int(d, "seed", lo=-MAX_SEED - 1, hi=MAX_SEED)
    req.decoder = _opt(d, "decoder", str)
    req.decoder_params = {k: d[k] for k in decoder_fields() if k != "decoder" and k in d and d[k] is not None}
    req.logit_bias = _logit_bias(d.get("logit_bias"))
    req.presence_penalty = _opt_number(d, "presence_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0
    req.frequency_penalty = _opt_number(d, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY) or 0.0
    formats = [c for c in (_response_format(d.get("response_format")), _structured(d.get("structured_outputs")))
               if c is not None]
    if len(formats) > 1:
        raise RequestError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    req.constraint = formats[0] if formats else None


def _logit_bias(v: Any) -> dict[int, float]:
    """{token id: bias}; JSON object keys are strings, so ids come as "123" (OpenAI's shape)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise RequestError(400, f"logit_bias must be an object mapping token ids to numbers, got {_kind(v)}",
                           "logit_bias")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise RequestError(400, f"logit_bias keys must be token ids (strings of digits), got {k!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise RequestError(400, f"logit_bias[{k!r}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[int(k)] = float(b)
    return out


def _response_format(v: Any) -> Constraint | None:
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise RequestError(400, "response_format must be an object with a type", "response_format")
    kind = v["type"]
    extra = set(v) - {"type", "json_schema"}
    if kind not in ("text", "json_object", "json_schema"):
        raise RequestError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           "response_format")
    if extra or ("json_schema" in v and kind != "json_schema"):
        field_name = sorted(extra or {"json_schema"})[0]
        raise RequestError(400, f"response_format of type {kind} takes no field {field_name!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", None, "response_format")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise RequestError(400, "response_format.json_schema must be an object with the schema", "response_format")
    bad = sorted(set(js) - {"name", "description", "schema", "strict"})
    if bad:
        raise RequestError(400, f"response_format.json_schema takes no field {bad[0]!r}", "response_format")
    for k, typ in (("name", str), ("description", str), ("strict", bool), ("schema", dict)):
        _opt(js, k, typ, f"response_format.json_schema.{k}")
    if "schema" not in js:
        raise RequestError(400, "response_format.json_schema.schema is missing", "response_format")
    return Constraint("json_schema", js["schema"], "response_format")


def _structured(v: Any) -> Constraint | None:
    """vLLM's structured_outputs: exactly one of json (a schema, or its JSON text), regex, choice,
    json_object."""
    if v is None:
        return None
    where = "structured_outputs"
    if not isinstance(v, dict):
        raise RequestError(400, f"{where} must be an object, got {_kind(v)}", where)
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    unknown = sorted(set(given) - {"json", "regex", "choice", "json_object"})
    if unknown:
        raise RequestError(400, f"{where}.{unknown[0]} is not supported here (use json, regex, choice or "
                                "json_object)", where)
    if len(given) != 1:
        raise RequestError(400, f"{where} must set exactly one of json, regex, choice, json_object", where)
    (k, x), = given.items()
    param = f"{where}.{k}"
    if k == "json_object":
        if x is not True:
            raise RequestError(400, f"{param} must be true", param)
        return Constraint("json_object", None, param)
    if k == "json":
        if isinstance(x, str):
            try:
                x = json.loads(x)
            except ValueError as e:
                raise RequestError(400, f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(x, dict):
            raise RequestError(400, f"{param} must be a JSON schema (an object), got {_kind(x)}", param)
        return Constraint("json_schema", x, param)
    if k == "regex":
        if not isinstance(x, str) or not x:
            raise RequestError(400, f"{param} must be a non-empty string", param)
        _no_surrogates(x, param)
        return Constraint("regex", x, param)
    if not (isinstance(x, list) and x and all(isinstance(c, str) and c for c in x)):
        raise RequestError(400, f"{param} must be a non-empty list of non-empty strings", param)
    for c in x:
        _no_surrogates(c, param)
    return Constraint("choice", list(x), param)


def _prompts(v: Any) -> list[str | list[int]]:
    """A string, a list of token ids, or a list of either (OpenAI's batch of prompts)."""
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                                                  for t in v)):
        v = [v]
    if not isinstance(v, list) or not v:
        raise RequestError(400, "prompt is empty" if v == [] else
                           f"prompt must be a string or a list of token ids, got {_kind(v)}", "prompt")
    out: list[str | list[int]] = []
    for p in v:
        if isinstance(p, str) and p:
            _no_surrogates(p, "prompt")
        elif not (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise RequestError(400, "prompt is empty" if p in ("", []) else
                               "prompt must be a string, a list of token ids, or a list of either", "prompt")
        out.append(list(p) if isinstance(p, list) else p)
    return out


def messages_of(v: Any) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise RequestError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object, got {_kind(m)}", where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(400, f"{where}.role must be system, developer, user or assistant, got {role!r}",
                               f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text can be fed to this model
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(400, f"{where}.content[{j}] must be a text part", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError(400, f"{where}.content must be a string, got {_kind(content)}", f"{where}.content")
        _no_surrogates(content, f"{where}.content")
        # developer is OpenAI's newer name for system; chat templates know system
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"] for m in out):
        raise RequestError(400, "messages are empty (no content)", "messages")
    return out


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, f"stop must be a string or a list of strings, got {_kind(v)}", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(400, f"at most {MAX_STOP} stop sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise RequestError(400, "stop sequences must not be empty", "stop")
    for s in stops:
        _no_surrogates(s, "stop")
    return stops


def _no_surrogates(s: str, param: str) -> None:
    # JSON escapes can spell lone surrogates ("\ud800"), which are not text and cannot be tokenized
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"{param} contains an invalid Unicode code point (a lone surrogate)", param) from None


def _opt(d: dict, key: str, typ: type, param: str | None = None) -> Any:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
        raise RequestError(400, f"{param or key} must be {_name(typ)}, got {_kind(v)}", param or key)
    return v


def _opt_int(d: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = _opt(d, key, int)
    if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(400, f"{key} must be {rng}, got {v}", key)
    return v


def _opt_number(d: dict, key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(400, f"{key} must be a number, got {_kind(v)}", key)
    v = float(v) if abs(v) < 1e300 else math.inf  # huge JSON integers must not overflow float()
    if not lo <= v <= hi:
        raise RequestError(400, f"{key} must lie in [{lo:g}, {hi:g}], got {v:g}", key)
    return v


def _name(typ: type) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", dict: "an object",
            list: "a list"}.get(typ, typ.__name__)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)
