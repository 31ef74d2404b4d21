"""--decoder and every registered decoder's parameters as flags, shared by `generate` and `eval`.

The flags are the union of the registered decoders' parameters (decoding.registry.options), one
flag per field name, grouped by the decoders that take them; their defaults are the Params'.
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
    """Every parameter of `decoder`, from its flag or its default, as keyword arguments of
    refusion.decoding.decode.

    A decoder flag the user set that `decoder` does not take is an error, not silently ignored.
    """
    takes = registry.options(decoder)
    p = {o.name: getattr(args, o.name) if getattr(args, o.name, None) is not None else o.default for o in takes}
    flags = {o.name: o.flag for name in registry.names() for o in registry.options(name)}
    unused = [flags[f] for f in flags if f not in p and getattr(args, f, None) is not None]
    if unused:
        raise ValueError(f"{', '.join(unused)} does not apply to decoder {decoder!r} "
                         f"(its flags: {', '.join(o.flag for o in takes)})")
    return p


def choose_decoder(args: argparse.Namespace, config) -> str:
    from refusion.decoding import default_decoder, mismatch

    decoder = args.decoder or default_decoder(config)
    note = mismatch(config, decoder)
    if note:
        warn(note)
    return decoder
