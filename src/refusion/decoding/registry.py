"""What a decoder is, in one place: a `Decoder` record per name, registered here.

The CLI's decoder flags, the server's request fields and their types, the engine's grouping,
lm-eval's settings and the web page's controls are all read from these records (and from the
fields of each record's Params dataclass), so a decoder registered anywhere, the built-in ones in
`decoding/params.py` or a toy one in a test, is reachable from all of them with no other change.

A Params dataclass is frozen and checks itself when it is made (`__post_init__` calls
`validate()`), so parameters are validated exactly once, however they arrive; what they need of a
model (a width within its context) a Params checks in an optional `check_model(config)`, which
make_params runs when given the model's config. Its fields are declared with `option()`, which
carries what a flag, a request field or a page control shows.

This module imports no torch (`refusion --help` builds its flags from it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

if typing.TYPE_CHECKING:
    from refusion.model.config import ModelConfig


def option(default: Any, help: str, *, flag: str | None = None, hidden: bool = False) -> Any:
    """A Params field. help: one line for --help, the server's decoders endpoint and the page.
    flag: the CLI flag when it is not --field-name (a boolean's flag sets the opposite of its
    default). hidden: a Python-only parameter (a research knob of the decoder's policy), with no
    flag, request field, page control or lm-eval setting: decode() and a model's decoding.json
    take it."""
    return field(default=default, metadata={"help": help, "flag": flag, "hidden": hidden})


@dataclass(frozen=True)
class Decoder:
    """One decoder.

    run(model, prompts, params, *, eos_ids, seed, on_commit) -> list[DecodeResult]; a string
    "module:function" is imported on first use (the built-in decoders import torch).
    fixed: Params fields this decoder sets itself, which are not parameters of it (refusion-l2r is
    ReFusionParams with left_to_right). defaults: its own defaults where they differ from the
    Params' (mdm-threshold's threshold). aliases: other keyword names decode() takes for a field.
    gen_unit(settings): gen_length must be a multiple of it, given the decoder's full settings
    (lm-eval rounds max_gen_toks up to it). batch(params, config): the SpeculativeParams it joins
    the server's continuous batch with, or None (it runs through decode() in static groups); a
    decoder with one also takes run(..., max_rows=) (decode()'s batch_size).
    seeds_per_row: a sampled row's draws depend on the seed alone (a generator of its own, or
    position-keyed uniforms), not on the other rows, so rows with the same seed may share one
    decode() call. controls: its run takes `controls=` (a list, one Controls or None per prompt)
    and honours them exactly; decode() refuses controls for a decoder without.
    """

    name: str
    params: type
    run: Callable[..., list] | str
    description: str
    fits: tuple[str, ...] = ()  # training objectives (config.json "training_objective") it fits
    needs_mask: bool = True  # needs a model with a <|mask|> token
    fixed: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    gen_unit: Callable[[Mapping[str, Any]], int] = lambda settings: 1
    batch: Callable[[Any, ModelConfig], Any] | None = None
    seeds_per_row: bool = False
    controls: bool = False  # takes controls (decoding/controls.py: grammar, bias, penalties, logprobs) exactly

    def runner(self) -> Callable[..., list]:
        if isinstance(self.run, str):
            module, name = self.run.split(":")
            return getattr(importlib.import_module(module), name)
        return self.run


@dataclass(frozen=True)
class Option:
    """A decoder parameter as a flag, request field and page control show it. type: int, float,
    bool or str (None allowed when `optional`)."""

    name: str
    type: type
    optional: bool
    default: Any
    help: str
    flag: str
    hidden: bool


_REGISTRY: dict[str, Decoder] = {}


def register(decoder: Decoder) -> Decoder:
    """Add a decoder. A field it shares by name with a registered decoder must have the same type
    (one flag and one request field serve both)."""
    if decoder.name in _REGISTRY:
        raise ValueError(f"decoder {decoder.name!r} is already registered")
    if not dataclasses.is_dataclass(decoder.params):
        raise TypeError(f"{decoder.name}: params must be a dataclass, got {decoder.params!r}")
    mine = {o.name: o for o in _all_options(decoder)}
    for other in _REGISTRY.values():
        for o in _all_options(other):
            if o.name in mine and (mine[o.name].type, mine[o.name].optional) != (o.type, o.optional):
                raise TypeError(f"{decoder.name}: field {o.name!r} has another type in decoder {other.name!r}")
    _REGISTRY[decoder.name] = decoder
    return decoder


def unregister(name: str) -> None:
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def with_controls(among: tuple[str, ...] | None = None) -> list[str]:
    """The decoders (of `among`, default all) that apply controls exactly (Decoder.controls)."""
    return [n for n in (names() if among is None else among) if _REGISTRY[n].controls]


def batch_decoders() -> list[str]:
    """The decoders that run each sequence on its own in a continuous batch (Decoder.batch)."""
    return [n for n in names() if _REGISTRY[n].batch is not None]


def get(name: str) -> Decoder:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown decoder {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def options(name: str, hidden: bool = False) -> list[Option]:
    """The parameters decoder `name` takes, in field order, with its own defaults (hidden ones too
    when asked)."""
    d = get(name)
    return [dataclasses.replace(o, default=d.defaults.get(o.name, o.default))
            for o in _all_options(d) if o.name not in d.fixed and (hidden or not o.hidden)]


def _all_options(d: Decoder) -> tuple[Option, ...]:
    return _fields_of(d.params)


@functools.cache  # decode() asks on every call, and reading type hints costs about a millisecond
def _fields_of(params: type) -> tuple[Option, ...]:
    hints = typing.get_type_hints(params)
    out = []
    for f in dataclasses.fields(params):
        typ = hints[f.name]
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        optional = type(None) in typing.get_args(typ)
        meta = f.metadata
        out.append(Option(f.name, args[0] if optional else typ, optional, f.default, meta.get("help", ""),
                          meta.get("flag") or "--" + f.name.replace("_", "-"), meta.get("hidden", False)))
    return tuple(out)


def make_params(decoder: str, config: ModelConfig | None = None, **params) -> Any:
    """`decoder`'s validated Params from keyword arguments: what decode() checks before it touches
    the model, usable without one. A parameter the decoder does not take is an error. Given the
    model's config, also what the parameters need of that model: a Params class may define
    check_model(config) (the speculative widths within the model's context)."""
    d = get(decoder)
    params = dict(params)
    for alias, name in d.aliases.items():
        if alias in params:
            if name in params:
                raise ValueError(f"give {name} or {alias}, not both")
            params[name] = params.pop(alias)
    takes = [o.name for o in options(decoder, hidden=True)]
    bad = sorted(set(params) - set(takes))
    if bad:
        raise ValueError(refusal(decoder, bad, takes))
    p = d.params(**{**d.defaults, **params, **d.fixed})
    if config is not None and hasattr(p, "check_model"):
        p.check_model(config)
    return p


def refusal(decoder: str, bad: list[str], takes: list[str]) -> str:
    """The message for parameters `decoder` does not take; where they are fields it fixes that a
    sibling on the same Params takes (mdm's threshold), it names the sibling."""
    d = get(decoder)
    msg = f"decoder {decoder!r} does not take {', '.join(bad)} (it takes: {', '.join(sorted(takes))})"
    siblings = [o.name for o in _REGISTRY.values() if o.params is d.params and o is not d
                and all(b in d.fixed and b not in o.fixed for b in bad)]
    if siblings:
        msg += f"; use {' or '.join(map(repr, siblings))} for {', '.join(bad)}"
    return msg


def settings(decoder: str, **params) -> dict[str, Any]:
    """Every field of `decoder`'s Params as it would run with `params`, not validated (what
    gen_unit reads)."""
    d = get(decoder)
    return {**{f.name: f.default for f in dataclasses.fields(d.params)}, **d.defaults, **params, **d.fixed}


def round_gen_length(decoder: str, n: int, **params) -> int:
    """n rounded up to a gen_length `decoder` takes with `params` (whole slots, whole blocks)."""
    unit = get(decoder).gen_unit(settings(decoder, **params))
    return -(-n // unit) * unit


def available(config: ModelConfig) -> tuple[str, ...]:
    """The decoders a model can run: those that need a mask token only when it has one."""
    has_mask = config.mask_token_id is not None
    return tuple(d.name for d in _REGISTRY.values() if has_mask or not d.needs_mask)


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
    if objective is None:
        return None
    fitting = [d.name for d in _REGISTRY.values() if objective in d.fits]
    if not fitting or decoder in fitting:
        return None
    return (f"this model was trained with the {objective} objective, which decoder {decoder!r} does not fit "
            f"(fitting: {', '.join(fitting)}); expect poor output")
