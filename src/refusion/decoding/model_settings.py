"""A model's own best decoding settings: `decoding.json` beside its weights (or its mask adapter's).

The settings measured best for one model (a wider drafting policy that pays on one CPU, the plan-and-
infill checks that lift one model's accuracy) are not the best for every model, so they travel with
the model rather than with the code. The command that measured them writes the file:

    {"decoder": "speculative", "params": {"fork": true, "width_price": 0.25},
     "measured_by": "python benchmarks/smollm2_speculative.py ...", "note": "..."}

and every way of decoding a model (`refusion generate`, `serve`, `eval`, lm-eval, and `decode()` on a
model from `load_model`) starts from them: a parameter given explicitly wins over the file's, and
naming another decoder leaves the file's parameters out. `params` may hold the Python-only policy
knobs (`registry.option(..., hidden=True)`), which is how a model gets them without a flag.

This module imports no torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refusion.decoding import registry
from refusion.files import write_text

FILE = "decoding.json"


@dataclass(frozen=True)
class ModelSettings:
    """decoder: a registered decoder's name. params: keyword arguments of decode() for it (validated
    when read). measured_by: the command that measured them; note: what it found, in a line."""

    decoder: str
    params: Mapping[str, Any] = field(default_factory=dict)
    measured_by: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"decoder": self.decoder, "params": dict(self.params), "measured_by": self.measured_by,
                "note": self.note}


def check(settings: ModelSettings, where: str = FILE) -> ModelSettings:
    """The settings, or a ValueError naming `where` and what is wrong with them."""
    if settings.decoder not in registry.names():
        raise ValueError(f"{where}: unknown decoder {settings.decoder!r}; choose one of {', '.join(registry.names())}")
    if not isinstance(settings.params, Mapping) or not all(isinstance(k, str) for k in settings.params):
        raise ValueError(f"{where}: params must be an object of parameter names and values")
    try:
        registry.make_params(settings.decoder, **settings.params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    return settings


def read(model_dir: str | Path) -> ModelSettings | None:
    """The settings in `model_dir`/decoding.json, checked; None when there is no such file."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it") from None
    if not isinstance(d, dict) or not isinstance(d.get("decoder"), str):
        raise ValueError(f"{path} must be a JSON object with a \"decoder\" name and its \"params\"")
    unknown = sorted(set(d) - {"decoder", "params", "measured_by", "note"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} (it takes decoder, params, measured_by, note)")
    return check(ModelSettings(d["decoder"], d.get("params") or {}, str(d.get("measured_by", "")),
                               str(d.get("note", ""))), str(path))


def write(model_dir: str | Path, settings: ModelSettings) -> Path:
    """Write `settings` (checked first) to `model_dir`/decoding.json, atomically."""
    check(settings)
    path = Path(model_dir) / FILE
    write_text(path, json.dumps(settings.to_dict(), indent=2) + "\n")
    return path


def choose(settings: ModelSettings | None, config: Any, decoder: str | None = None) -> str:
    """The decoder to run: `decoder` if named, else the model's settings', else the one its training
    objective fits."""
    if decoder is not None:
        return decoder
    return settings.decoder if settings is not None else registry.default_decoder(config)


def resolve(settings: ModelSettings | None, config: Any, decoder: str | None,
            params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The decoder to run (choose) and its keyword arguments: the settings' parameters under `params`
    when they are for that decoder."""
    decoder = choose(settings, config, decoder)
    base = dict(settings.params) if settings is not None and settings.decoder == decoder else {}
    return decoder, {**base, **params}


def of_model(model: Any) -> ModelSettings | None:
    """The settings kept beside a model loaded by `load_model` (its `directory`); None for a model
    built in memory. Read again only when the file changes."""
    directory = getattr(model, "directory", None)
    if directory is None:
        return None
    path = Path(directory) / FILE
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _read_once(str(directory), stamp)


@functools.lru_cache(maxsize=16)
def _read_once(directory: str, stamp: int) -> ModelSettings | None:
    return read(directory)
