"""config.json fields with a fixed set of values are checked at load: an unknown training objective or
dtype is refused, naming the field and the values it takes, instead of being taken silently."""

from __future__ import annotations

import json
import shutil

import pytest

from refusion.bundled import BUNDLED
from refusion.cli import main
from refusion.model.checkpoint import load_config, load_model


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(BUNDLED, d)
    return d


def set_field(d, **kv) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kv)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field, value, message", [
    ("training_objective", "banana", "training_objective must be one of refusion, ar, mdm (or absent), got 'banana'"),
    ("training_objective", 3, "training_objective must be one of refusion, ar, mdm (or absent), got 3"),
    ("torch_dtype", "int8", "torch_dtype must be one of float32, bfloat16, float16, float64, got 'int8'"),
    ("torch_dtype", "torch.int8", "torch_dtype must be one of float32, bfloat16, float16, float64, got 'torch.int8'"),
])
def test_an_unknown_value_is_refused_at_load(model_dir, field, value, message, capsys):
    set_field(model_dir, **{field: value})
    for load in (load_config, load_model):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load(model_dir)
    assert main(["generate", "--model", str(model_dir), "hi", "--gen-length", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("field, value", [("training_objective", "ar"), ("training_objective", None),
                                          ("torch_dtype", "torch.float32"), ("torch_dtype", "bfloat16")])
def test_the_values_it_takes_load(model_dir, field, value):
    set_field(model_dir, **{field: value})
    assert load_model(model_dir).config.vocab_size > 0
