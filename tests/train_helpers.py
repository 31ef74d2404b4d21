"""What the training tests share: a tiny model shape, a learnable data file and a config for both."""

import json
import random
from pathlib import Path

import pytest

from refusion.training.config import TrainConfig

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def write_jsonl(tmp_path_factory, recs: list[dict]) -> Path:
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Addition problems with a worked answer: learnable in a few dozen steps."""
    rng = random.Random(0)
    recs = []
    for _ in range(300):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        recs.append({"query": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}. The answer is {a + b}."})
    return write_jsonl(tmp_path_factory, recs)


def tiny_config(data_file: Path, out: Path, **kw) -> TrainConfig:
    """A fresh TINY model trained on `data_file` for 20 steps (kw overrides any field)."""
    base = dict(data=str(data_file), out_dir=str(out), vocab_size=300, model=dict(TINY), batch_size=8,
                max_steps=20, warmup_steps=3, lr=3e-3, save_every=1000)
    base.update(kw)
    return TrainConfig(**base)
