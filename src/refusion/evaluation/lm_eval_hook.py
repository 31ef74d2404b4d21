"""Registers `--model refusion` in lm-eval's model registry when lm-eval imports it.

Imported at interpreter start by the one-line `refusion_lm_eval.pth` that
`python -m refusion.evaluation.lm_eval --install-hook` writes into site-packages, because lm-eval
discovers no plugins by itself (see evaluation/lm_eval.py). Standard library only, and it
imports nothing of lm-eval or torch: it waits, as a meta-path finder, for lm_eval.api.registry to be
imported, and then registers "refusion" as a lazy "module:class" placeholder, the same kind lm-eval
uses for its own models, so nothing is loaded until `--model refusion` is asked for.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

TARGET = "refusion.evaluation.lm_eval:ReFusionLM"


class _RegistryWatcher(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "lm_eval.api.registry":
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                if "refusion" not in module.model_registry:
                    module.model_registry.register("refusion", target=TARGET)
            except Exception:  # a registry of another shape: lm-eval must still work
                pass

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _RegistryWatcher) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegistryWatcher())
