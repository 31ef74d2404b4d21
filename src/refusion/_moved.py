"""Import paths of the flat layout (refusion 0.1), kept working for one release.

`import refusion.checkpoint` still gives the module now at refusion.model.checkpoint (the same
module object, so patching either name patches both), with a DeprecationWarning that names the new
path. Remove in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "refusion.config": "refusion.model.config",
    "refusion.cache": "refusion.model.cache",
    "refusion.compiled": "refusion.model.compiled",
    "refusion.checkpoint": "refusion.model.checkpoint",
    "refusion.tokenizer": "refusion.model.tokenizer",
    "refusion.lora": "refusion.model.lora",
    "refusion.fetch": "refusion.model.fetch",
    "refusion.convert": "refusion.model",
    "refusion.convert.gguf": "refusion.model.gguf",
    "refusion.objectives": "refusion.training.objectives",
    "refusion.data": "refusion.training.data",
    "refusion.corpus": "refusion.training.corpus",
    "refusion.train_config": "refusion.training.config",
    "refusion.train": "refusion.training.trainer",
    "refusion.fsdp": "refusion.training.fsdp",
    "refusion.sharded_checkpoint": "refusion.training.sharded_checkpoint",
    "refusion.run_dir": "refusion.training.run_dir",
    "refusion.evaluate": "refusion.evaluation.evaluate",
    "refusion.report": "refusion.evaluation.report",
    "refusion.lm_eval_hook": "refusion.evaluation.lm_eval_hook",
    "refusion.sandbox": "refusion.tasks.sandbox",
    "refusion.view": "refusion.cli.view",
    "refusion.serve.command": "refusion.cli.serve",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        if not new.startswith("refusion.evaluation.lm_eval_hook"):  # a .pth imports that one at every start
            warnings.warn(f"{spec.name} moved to {new}; the old path goes in refusion 0.3",
                          DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module was executed under its new name


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
