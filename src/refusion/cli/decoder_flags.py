"""--decoder and every registered decoder's parameters as flags, shared by `generate` and `eval`.

The flags are the union of the registered decoders' public parameters (decoding.registry.options),
one flag per field name, grouped by the decoders that take them; their defaults are the Params'.
A model's decoding.json (decoding/model_settings.py) comes between: a flag given wins over it, a
flag not given leaves the model's setting. The Python-only parameters (hidden options) and the
flags removed in 0.2 are still recognised, so that using one ends in a line naming what replaces it.
"""

from __future__ import annotations

import argparse

from refusion.cli.args import seed_int, warn
from refusion.decoding import registry


def add_decoder_flags(g: argparse.ArgumentParser) -> None:
    """--decoder, --seed and one flag per decoder parameter (each left None when not given, so a
    flag the user set is told from a default)."""
    g.add_argument("--decoder", choices=registry.names(),
                   help="default: the one the model's training objective fits: speculative for a ReFusion model, "
                        "mdm-threshold for an MDM one, ar for a model without a mask token")
    add_parameter_flags(g)
    add_removed_flags(g)
    g.add_argument("--seed", type=seed_int, default=0, help="for sampling (and, in eval, the sample of examples)")


def add_parameter_flags(g: argparse.ArgumentParser) -> None:
    """One flag per decoder parameter, each default None, grouped by the decoders that take it."""
    names = registry.names()
    takers: dict[str, list[str]] = {}  # field -> the decoders that take it
    first: dict[str, registry.Option] = {}
    for name in names:
        for o in registry.options(name):
            takers.setdefault(o.name, []).append(name)
            first.setdefault(o.name, o)
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for field, decoders in takers.items():
        if len(decoders) == len(names):  # every decoder's: among the general flags
            _add_flag(g, first[field], decoders)
            continue
        key = tuple(decoders)
        if key not in groups:
            groups[key] = g.add_argument_group(_group_title(key))
        _add_flag(groups[key], first[field], decoders)


# flags that were public before 0.2 and are not a hidden option's: what replaces them
RENAMED = {"--fixed-widths": "decode(..., widths=\"fixed\") from Python",
           "--no-sampler": "decode(..., sampler=False) from Python"}
GUARD_FLAGS = ("--join-check", "--causal-infill", "--recheck-rows")  # one public mode now: --checks


def removed_flag_message(flag: str) -> str | None:
    """The one line a flag that is no longer public ends in (None for any other flag)."""
    if flag in GUARD_FLAGS:
        return f"{flag} is now part of --checks (join check, causal infill and row recheck together)"
    if flag in RENAMED:
        return (f"{flag} is no longer a flag: the drafting policy is Python-only ({RENAMED[flag]}), and a model's "
                "decoding.json sets the policy measured best for it")
    hidden = {o.flag: o for name in registry.names() for o in registry.options(name, hidden=True) if o.hidden}
    if flag in hidden:
        o = hidden[flag]
        return (f"{flag} is no longer a flag: {o.name} is a Python-only setting (decode(..., {o.name}=...)), and a "
                "model's decoding.json sets what was measured best for it")
    return None


class _Removed(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(removed_flag_message(option_string))


def add_removed_flags(g: argparse.ArgumentParser) -> None:
    """The flags removed from the public surface, hidden from --help, each failing with what replaces it."""
    public = {o.flag for name in registry.names() for o in registry.options(name)}
    hidden = {o.flag for name in registry.names() for o in registry.options(name, hidden=True) if o.hidden}
    for flag in sorted((hidden - public) | set(RENAMED) | set(GUARD_FLAGS)):
        g.add_argument(flag, nargs="?", action=_Removed, dest="removed_" + flag.lstrip("-").replace("-", "_"),
                       default=None, help=argparse.SUPPRESS)


def _add_flag(g, o: registry.Option, decoders: list[str]) -> None:
    defaults = {d: next(x.default for x in registry.options(d) if x.name == o.name) for d in decoders}
    if o.type is bool and o.optional:  # unset: the model's choice; --NAME / --no-NAME override it
        g.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None, help=o.help)
        return
    if o.type is bool:  # a switch: sets the opposite of the default
        note = "" if o.flag == "--" + o.name.replace("_", "-") else f" (this flag: {o.name} = {not o.default})"
        g.add_argument(o.flag, dest=o.name, action="store_const", const=not o.default, default=None,
                       help=o.help + note)
        return
    shown = set(map(repr, defaults.values()))
    if shown == {"None"}:
        note = ""
    elif len(shown) == 1:
        note = f" (default: {o.default})"
    else:
        note = " (default: " + ", ".join(f"{v} for {d}" for d, v in defaults.items() if v is not None) + ")"
    g.add_argument(o.flag, dest=o.name, type=o.type, default=None, help=o.help + note)


def _group_title(decoders: tuple[str, ...]) -> str:
    """The decoders' description when there is one of them, else the Params' (when they share it)."""
    records = [registry.get(d) for d in decoders]
    if len(records) == 1:
        return f"{decoders[0]}: {records[0].description}"
    classes = {r.params for r in records}
    doc = (next(iter(classes)).__doc__ or "").strip().splitlines() if len(classes) == 1 else []
    return f"{doc[0]} ({', '.join(decoders)})" if doc else ", ".join(decoders)


def decoder_params(args: argparse.Namespace, decoder: str) -> dict:
    """The parameters of `decoder` the user gave flags for, as keyword arguments of
    refusion.decoding.decode (the rest come from the model's decoding.json or the defaults).

    A decoder flag the user set that `decoder` does not take is an error, not silently ignored.
    """
    takes = registry.options(decoder)
    p = {o.name: getattr(args, o.name) for o in takes if getattr(args, o.name, None) is not None}
    flags = {o.name: o.flag for name in registry.names() for o in registry.options(name)}
    unused = [flags[f] for f in flags if f not in p and getattr(args, f, None) is not None]
    if unused:
        raise ValueError(f"{', '.join(unused)} does not apply to decoder {decoder!r} "
                         f"(its flags: {', '.join(o.flag for o in takes)})")
    return p


def choose_decoder(args: argparse.Namespace, config, model_dir) -> tuple[str, dict]:
    """The decoder and its parameters: the flags given over the model's decoding.json, over the
    defaults (decoding/model_settings.py); a warning when the decoder does not fit the model."""
    from refusion.decoding import mismatch, model_settings

    settings = model_settings.read(model_dir)
    decoder = model_settings.choose(settings, config, args.decoder)
    _, params = model_settings.resolve(settings, config, decoder, decoder_params(args, decoder))
    note = mismatch(config, decoder)
    if note:
        warn(note)
    return decoder, params
