"""Resuming a sharded run on another number of processes: a run checkpointed by N processes and
resumed by M continues as an uninterrupted run of M does (the same global batches, layouts and
learning rates; DCP reshards the weights and the AdamW state), tested 2 -> 1 and 1 -> 2 (and DDP 1 -> 2).

Tolerance: the steps before the checkpoint ran on N processes, whose reduce-scatter adds the
gradient in another order than M's, so the weights at the checkpoint differ from the M-run's by
float32 rounding, and so do the steps after it (seen: equal losses, gradient norms within 2e-7
relative, weights within 1.2e-7). Losses and gradient norms are compared within rel 1e-6, weights
within 1e-6, tokens and learning rates exactly. A checkpoint resharded wrongly moves them by far
more (AdamW's moments lost: the first resumed loss by 1e-3 relative).

The runs train in three torchrun launches (`runs`), as few as the order allows: a resumed run
needs the run it resumes, and each launch starts Python, torch and the process group again.
"""

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from refusion.model.checkpoint import load_model
from refusion.training.setup import setup
from refusion.training.sharded_checkpoint import export_checkpoint
from refusion.training.step import train_step
from tests.training.test_fsdp import COMMON, _fsdp
from tests.training.test_train import data_file, losses, tiny_config  # noqa: F401 (data_file: a fixture)
from tests.helpers.train_helpers import torchrun_train, train_here

STEPS, CKPT = 8, 4  # COMMON saves every 4 steps and keeps the last two checkpoints


def _cut_back(run: Path, out: Path) -> Path:
    """`run` copied to `out` and cut back to its checkpoint at step CKPT."""
    shutil.copytree(run, out)
    for later in out.glob("checkpoint-*"):
        if int(later.name.split("-")[1]) > CKPT:
            shutil.rmtree(later)
    return out


@pytest.fixture(scope="module")
def runs(data_file, tmp_path_factory) -> tuple[dict[str, Path], dict[str, str]]:
    """The run directories and the logs (stderr) of these runs, by name:
    run1, run2: uninterrupted FSDP runs of STEPS steps on 1 and on 2 processes;
    run2-on-1, run1-on-2: run2 (run1) cut back to its checkpoint at step CKPT and resumed by 1 (2)
    processes up to STEPS;
    ddp: a one-process run (ddp: whole checkpoints) up to CKPT, then resumed by 2 DDP processes up to STEPS;
    ddp-as-fsdp: the one-process run resumed as fsdp before that, which is refused."""
    root = tmp_path_factory.mktemp("reshard")
    dirs = {name: root / name for name in ("run1", "run2", "run2-on-1", "run1-on-2", "ddp")}
    dirs["ddp-as-fsdp"] = dirs["ddp"]
    until = f"--set=stop_after={STEPS}"
    train_here(f"--data={data_file}", *COMMON, f"--out={dirs['ddp']}", f"--set=stop_after={CKPT}")
    logs = torchrun_train(1, {"run1": _fsdp(data_file, dirs["run1"], until),
                              "ddp-as-fsdp": _fsdp(data_file, dirs["ddp"], until)},
                          root / "log1.json", refused="ddp-as-fsdp")
    _cut_back(dirs["run1"], dirs["run1-on-2"])
    logs |= torchrun_train(2, {"run2": _fsdp(data_file, dirs["run2"], until),
                               "run1-on-2": _fsdp(data_file, dirs["run1-on-2"], until),
                               "ddp": [f"--data={data_file}", *COMMON, f"--out={dirs['ddp']}", until]},
                           root / "log2.json")
    _cut_back(dirs["run2"], dirs["run2-on-1"])
    logs |= torchrun_train(1, {"run2-on-1": _fsdp(data_file, dirs["run2-on-1"], until)}, root / "log3.json")
    return dirs, logs


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_processes(runs, tmp_path, before, after):
    dirs, logs = runs
    name = f"run{before}-on-{after}"
    out = dirs[name]
    assert f"checkpoint-{CKPT} was written by {before} processes, resumed by {after}: DCP reshards" in logs[name]
    got, want = losses(out), losses(dirs[f"run{after}"])
    assert len(got) == len(want) == STEPS
    assert got[:CKPT] == losses(dirs[f"run{before}"])[:CKPT]  # the steps taken before the checkpoint, as they were logged
    for a, b in zip(got[CKPT:], want[CKPT:], strict=True):
        assert (a["step"], a["tokens"], a["lr"]) == (b["step"], b["tokens"], b["lr"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    ckpt = out / f"checkpoint-{STEPS}"
    assert sorted(p.name for p in ckpt.glob("rng-*.pt")) == [f"rng-{r}.pt" for r in range(after)]
    a, b = (load_model(export_checkpoint(d / f"checkpoint-{STEPS}", tmp_path / f"export{i}"))
            for i, d in enumerate((out, dirs[f"run{after}"])))
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize("objective", ["refusion", "mdm", "ar"])
def test_a_step_draws_nothing_from_the_global_generators(data_file, tmp_path, objective):
    """Why a process the checkpoint did not have may start from rank 0's saved RNG states: a step
    draws its layout from the run's layout generator (one for the global batch, in every process)
    and nothing from torch's, Python's or NumPy's global generators (LoRA dropout would)."""
    run = setup(tiny_config(data_file, tmp_path, objective=objective, gradient_checkpointing=True, micro_batch_size=2))
    before = torch.get_rng_state()
    layout = run.layout_gen.get_state()
    py, nps = random.getstate(), np.random.get_state()[1].copy()
    train_step(run)
    train_step(run)
    assert torch.equal(torch.get_rng_state(), before)
    assert random.getstate() == py and (np.random.get_state()[1] == nps).all()
    assert torch.equal(run.layout_gen.get_state(), layout) == (objective == "ar")  # AR's layout is not random


def test_ddp_resumes_on_another_number_of_processes_but_not_as_fsdp(runs):
    """A one-process run (ddp: whole checkpoints) resumed by 2 DDP processes continues as a run of 2
    does (here the FSDP one, equal to DDP up to rounding: rel 1e-5 as in test_fsdp); resuming it as
    fsdp is refused (torchrun_train checks that it fails)."""
    dirs, logs = runs
    assert f"checkpoint-{CKPT} was written with strategy ddp: resume it with --strategy ddp" in logs["ddp-as-fsdp"]
    for a, b in zip(losses(dirs["ddp"])[CKPT:], losses(dirs["run2"])[CKPT:], strict=True):
        assert (a["step"], a["tokens"], a["lr"]) == (b["step"], b["tokens"], b["lr"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
