"""The model a command runs when none is named: `refusion-tiny`, shipped inside the package.

scripts/study.sh makes it (recipe.toml lies beside it). Where it is absent (a trimmed install),
SmolLM2-135M-Instruct is imported from its GGUF package on first use, into the download cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

BUNDLED = Path(__file__).parent / "assets" / "refusion-tiny"


def default_model_dir() -> Path:
    """The bundled model's directory, or SmolLM2-135M-Instruct imported once where it is absent
    (autoregressive decoding only: it has no mask token)."""
    if (BUNDLED / "config.json").exists():
        return BUNDLED
    from refusion.model.fetch import cache_dir

    path = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        from refusion.model.gguf import import_smollm2

        print(f"refusion: importing the default model into {path} (once) ...", file=sys.stderr)
        import_smollm2(path, overwrite=True)
    return path
