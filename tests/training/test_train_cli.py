"""`refusion train` as a user meets it: a line for each setup stage, one CPU thread for a small model,
a warning where bfloat16 would be emulated, a seed torch can take. The trainings run in this process
(refusion.cli.main, as the command does), their threads set back when the module ends."""

import json
import platform
import subprocess
import sys

import pytest
import torch

from refusion.cli import main
from refusion.model.checkpoint import load_model
from refusion.model.config import ConfigError
from refusion.runtime import count_parameters
from refusion.training.config import TrainConfig
from refusion.training.setup import cpu_bf16_is_emulated
from tests.helpers.train_helpers import TINY, doubling_file

pytestmark = pytest.mark.usefixtures("one_thread")  # (--threads=2 below sets torch's threads)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return doubling_file(tmp_path_factory)


def _train(data_file, out, capsys, *extra: str) -> str:
    """`refusion train` for one step, in this process; what it wrote on stderr."""
    capsys.readouterr()
    argv = ["train", f"--data={data_file}", "--set=vocab_size=300", f"--set=model={json.dumps(TINY)}",
            "--set=batch_size=8", "--max-steps=1", f"--out={out}", "--no-progress", *extra]
    assert main(argv) == 0
    return capsys.readouterr().err


def test_setup_stages_one_thread_for_a_small_model_and_the_bfloat16_warning(data_file, tmp_path, capsys):
    err = _train(data_file, tmp_path / "a", capsys, "--set=dtype=\"bfloat16\"")
    lines = [ln.removeprefix("refusion train: ") for ln in err.splitlines()]
    n = count_parameters(load_model(tmp_path / "a" / "model"))
    stages = [f"reading {data_file}", "training a BPE tokenizer on 40 records", "building a new model",
              f"{n:,} parameters, 1 CPU thread", "tokenizing 40 records",
              f"training steps 1 to 1 of 1 -> {tmp_path / 'a'}"]
    assert [ln for ln in lines if ln in stages] == stages  # each once, in the order they run
    warning = ("warning: dtype bfloat16 on this CPU (no AVX512-BF16 or AMX instructions) is emulated and many times "
               "slower than float32; training goes on in bfloat16 as asked: set dtype = \"float32\" (--set "
               "dtype='\"float32\"') to train at full speed")
    assert (warning in lines) == cpu_bf16_is_emulated()
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["dtype"] == "bfloat16"  # kept, as asked
    # --threads overrides the rule; float32 has nothing to warn about
    err = _train(data_file, tmp_path / "b", capsys, "--threads=2")
    assert f"refusion train: {n:,} parameters, 2 CPU threads" in err.splitlines()
    assert "bfloat16" not in err


@pytest.mark.parametrize("machine, avx512_bf16, amx, emulated", [
    ("x86_64", False, False, True),
    ("x86_64", True, False, False),
    ("AMD64", False, True, False),
    ("aarch64", False, False, False),  # another architecture: not known to emulate, no warning
])
def test_which_cpus_emulate_bfloat16(monkeypatch, machine, avx512_bf16, amx, emulated):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_bf16_is_emulated() == emulated
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # a torch that cannot tell: no warning
    assert not cpu_bf16_is_emulated()


def test_the_seed_is_one_torch_can_take():
    assert TrainConfig(seed=2**63 - 1).validate().seed == 2**63 - 1
    for bad in (2**63, -1):
        with pytest.raises(ConfigError, match=rf"^seed must be an integer in \[0, 2\*\*63 - 1\], got {bad}$"):
            TrainConfig(seed=bad).validate()
    p = subprocess.run([sys.executable, "-m", "refusion.cli", "train", f"--set=seed={2**70}"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == f"refusion: error: seed must be an integer in [0, 2**63 - 1], got {2**70}\n"


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(data_file, tmp_path):
    huge = json.dumps({**TINY, "hidden_size": 10**6, "intermediate_size": 10**7})
    argv = ["train", f"--data={data_file}", "--set=vocab_size=300", f"--set=model={huge}", "--max-steps=1",
            f"--out={tmp_path / 'huge'}", "--no-progress"]
    p = subprocess.run([sys.executable, "-m", "refusion.cli", *argv], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "more than this machine's" in p.stderr and "hidden_size" in p.stderr
