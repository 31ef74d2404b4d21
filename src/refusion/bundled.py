"""Where a model named on the command line lies: `--model` (and the server, `refusion eval`, lm-eval's
`pretrained`, a training run's `init`) resolve here, and nowhere else.

    resolve_model(None)                  the default: `refusion-tiny`, shipped inside the package (also by name)
    resolve_model("runs/x/model")        a model directory, as it is
    resolve_model("smollm2")             SmolLM2-135M-Instruct, imported from its GGUF package once
    resolve_model("smollm2-refusion")    SmolLM2 with the mask adapter shipped in assets/smollm2-refusion
    resolve_model("runs/x/adapter")      any mask adapter directory (mask_adapter.json): its base with it attached

A mask adapter (model/mask_adapter.py) is stored apart from its base and names it ("base": a name
above or a directory). Resolving one builds, once, a whole model directory in the download cache:
the base, its `<|mask|>` token added where it has none, the adapter attached; every command then
loads that directory as it loads any other. The directory's path depends on the adapter's bytes, so
a changed adapter gets a directory of its own. An existing path always wins over a name.

scripts/study.sh makes refusion-tiny (recipe.toml lies beside it); where it is absent (a trimmed
install), the default is SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
BUNDLED = ASSETS / "refusion-tiny"
SMOLLM2 = "smollm2"
ADAPTER_CONFIG = "mask_adapter.json"  # (model/mask_adapter.py's name, without importing torch here)
DECODING_SETTINGS = "decoding.json"  # (decoding/model_settings.py's FILE: bundled.py sits below decoding/)


def adapter_names() -> list[str]:
    """Names of the mask adapters shipped in the package (directories of assets/ with a mask_adapter.json)."""
    return sorted(p.name for p in ASSETS.iterdir() if (p / ADAPTER_CONFIG).is_file()) if ASSETS.is_dir() else []


def model_names() -> list[str]:
    return [BUNDLED.name] * (BUNDLED / "config.json").exists() + [SMOLLM2, *adapter_names()]


def is_model_name(text: str) -> bool:
    """Whether `text` means a named model rather than a path (an existing path wins)."""
    return not Path(text).exists() and text in model_names()


def resolve_model(name: str | Path | None) -> Path:
    """The model directory `name` means (module docstring); a ValueError says what is wrong."""
    if name is None:
        return default_model_dir()
    if not str(name).strip():  # a typo or an unset variable ("--model $M"), not a request for the default
        raise ValueError(f"the model name is empty: give a model directory or a name ({', '.join(model_names())}), "
                         "or none at all for the bundled model")
    path = Path(name)
    if not path.exists():
        if str(name) == BUNDLED.name and (BUNDLED / "config.json").exists():
            return BUNDLED
        if str(name) == SMOLLM2:
            return smollm2_dir()
        if str(name) in adapter_names():
            return adapted_model_dir(ASSETS / str(name))
        raise ValueError(f"{name} does not exist: it is neither a model directory nor a model name "
                         f"({', '.join(model_names())})")
    if path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        return adapted_model_dir(path)
    return path


def default_model_dir() -> Path:
    """The bundled model's directory, or SmolLM2-135M-Instruct imported once where it is absent
    (autoregressive decoding only: it has no mask token)."""
    if (BUNDLED / "config.json").exists():
        return BUNDLED
    return smollm2_dir()


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory in the download cache (imported on first use)."""
    from refusion.model.fetch import cache_dir

    path = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        from refusion.model.gguf import import_smollm2

        print(f"refusion: importing SmolLM2-135M-Instruct into {path} (once) ...", file=sys.stderr)
        import_smollm2(path, overwrite=True)
    return path


def adapter_base(adapter: Path, base: str) -> Path:
    """The base model directory an adapter's "base" names: a model name, or a directory (a relative
    one is taken from the adapter's directory)."""
    if Path(base).is_absolute() or is_model_name(base):
        return resolve_model(base)
    return resolve_model(adapter / base)


def adapted_model_dir(adapter: Path) -> Path:
    """A model directory holding the base the adapter at `adapter` names with the adapter attached:
    built into the download cache the first time, then reused."""
    from refusion.model.checkpoint import LOOKUP_CORPUS, add_mask_token, load_model, save_model
    from refusion.model.fetch import cache_dir
    from refusion.model.mask_adapter import ADAPTER_WEIGHTS, attach_mask_adapter, read_adapter_config
    from refusion.model.mask_sampler import MASK_SAMPLER
    from refusion.model.tokenizer import Tokenizer

    meta = read_adapter_config(adapter)
    try:
        base = adapter_base(adapter, meta["base"])
    except ValueError as e:
        raise ValueError(f"{adapter}: its base model {meta['base']!r} cannot be found ({e})") from None
    kept = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LOOKUP_CORPUS, MASK_SAMPLER) if (adapter / f).is_file()]
    h = hashlib.sha256(str(base.resolve()).encode())
    for f in kept:
        h.update((adapter / f).read_bytes())
    out = cache_dir() / "models" / "adapted" / h.hexdigest()[:16] / _name(adapter.resolve())
    if (out / "config.json").exists():
        _sync_settings(adapter, out)
        return out
    print(f"refusion: attaching the mask adapter {adapter} to {base} -> {out} (once) ...", file=sys.stderr)
    model, tok = load_model(base), Tokenizer.from_dir(base)
    if model.config.mask_token_id is None:
        add_mask_token(model, tok)
    try:
        attach_mask_adapter(model, adapter)
    except ValueError as e:
        raise ValueError(f"the mask adapter {adapter} does not fit its base {base}: {e}") from None
    save_model(model, out, tok, overwrite=True)
    # files kept beside the weights, read by the decoder: the adapter's drafts from its base's own
    # answers (decoding/corpus.py) and its masks' sampler (model/mask_sampler.py)
    for f in (LOOKUP_CORPUS, MASK_SAMPLER):
        if f in kept:
            shutil.copyfile(adapter / f, out / f)
    _sync_settings(adapter, out)
    return out


def _sync_settings(adapter: Path, out: Path) -> None:
    """The adapter's decoding settings (decoding.json) as the adapted model's, kept current: they are
    not part of the directory's hash, so that measuring them again rebuilds nothing."""
    src, dst = adapter / DECODING_SETTINGS, out / DECODING_SETTINGS
    if not src.is_file():
        dst.unlink(missing_ok=True)
        return
    data = src.read_bytes()
    if dst.is_file() and dst.read_bytes() == data:
        return
    tmp = dst.with_name(f".{DECODING_SETTINGS}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


def _name(adapter: Path) -> str:
    """The adapted model's directory name (what results and the server call it): the adapter's, or for
    the names a training run gives (`adapter`, `checkpoint-N`) the run's and that name."""
    if adapter.name == "adapter" or adapter.name.startswith("checkpoint-"):
        return f"{adapter.parent.name}-{adapter.name}"
    return adapter.name
