"""What the training tests share: a tiny model shape, a learnable data file, a config for both, and
a torchrun launch that runs several trainings."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.cli import main
from refusion.training.config import TrainConfig

WORKER = Path(__file__).with_name("train_worker.py")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def write_jsonl(tmp_path_factory, recs: list[dict]) -> Path:
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return path


def doubling_file(tmp_path_factory) -> Path:
    """40 one-step records ("What is 3 plus 3?" -> "6."): for tests of a step or two."""
    return write_jsonl(tmp_path_factory, [{"query": f"What is {a} plus {a}?", "response": f"{2 * a}."}
                                          for a in range(40)])


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


def train_here(*args: str) -> None:
    """`refusion train` with these arguments in this process: one process, no torchrun."""
    assert main(["train", *args]) == 0


def torchrun_train(n: int, jobs: dict[str, list[str]], log: Path, refused: str | None = None) -> dict[str, str]:
    """`refusion train` with each job's arguments, in order, in one torchrun launch of n processes
    (tests/helpers/train_worker.py: each launch of its own would start Python, torch and the process group
    again); each job's log (stderr) by name. Every job succeeds but `refused`, the last, which must
    end with an error (exit status 2)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(WORKER),
           str(log), json.dumps(jobs)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    done = json.loads(log.read_text()) if log.exists() else {}
    for name in jobs:
        assert name in done, f"job {name} did not run:\n{r.stderr[-3000:]}"
        assert done[name]["rc"] == (2 if name == refused else 0), f"job {name}:\n{done[name]['stderr'][-3000:]}"
    assert refused or r.returncode == 0, r.stderr[-3000:]
    return {name: done[name]["stderr"] for name in jobs}
