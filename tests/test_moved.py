"""The flat layout's import paths keep working for one release, as the same module objects."""

import importlib
import subprocess
import sys
import warnings

import pytest

from refusion._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(MOVED[old])
    if old != "refusion.lm_eval_hook":  # imported by a .pth at every interpreter start: silent
        assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught)


def test_old_from_imports_give_the_same_objects():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from refusion.checkpoint import load_model as old_load
        from refusion.model import transformer
        from refusion.model.checkpoint import load_model
        from refusion.train import train as old_train
        from refusion.training.trainer import train
    assert old_load is load_model and old_train is train
    import refusion.model  # the old module refusion.model is now the package: its main name is still there

    assert refusion.model.Transformer is transformer.Transformer


def test_top_level_names_load_lazily_without_torch_at_import():
    code = ("import sys, refusion; assert 'torch' not in sys.modules; "
            "from refusion.model.checkpoint import load_model; assert refusion.load_model is load_model; "
            "from refusion.decoding import decode; assert refusion.decode is decode; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_unknown_top_level_name_is_an_attribute_error():
    import refusion

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        refusion.nope
