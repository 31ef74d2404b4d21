"""A run directory belongs to one training at a time (a lock) and to one configuration (a resume
compares its configuration with the saved one, field by field)."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refusion.cli import main
from refusion.model.config import ConfigError
from refusion.training.config import TrainConfig
from refusion.training.config_changes import (FIXED, FREE, NOT_COMPARED, ON_REQUEST, check_allow_changed,
                                              resume_changes)
from refusion.training.optimizer import lr_at
from refusion.training.run_dir import LOCK_FILE, locked
from refusion.training.setup import setup
from refusion.training.trainer import train
from tests.helpers.train_helpers import TINY, data_file, tiny_config  # noqa: F401 (data_file: a fixture)


def small_run(data_file: Path, out: Path, **kw) -> TrainConfig:
    """tiny_config, shorter: 6 steps with a checkpoint every 3, validated."""
    return tiny_config(data_file, out, **{"max_steps": 6, "warmup_steps": 2, "save_every": 3, **kw}).validate()


def cli_args(data_file: Path, out: Path, *extra: str) -> list[str]:
    return ["train", f"--data={data_file}", "--set=vocab_size=300", f"--set=model={json.dumps(TINY)}",
            "--set=batch_size=8", "--set=warmup_steps=2", "--set=lr=3e-3", "--set=save_every=3", f"--out={out}",
            "--no-progress", *extra]


def _cli(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`refusion ARGV` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out.out, out.err)


def one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("refusion: error: ")]
    assert len(errors) == 1, p.stderr
    return errors[0]


# ---- the configuration a resume may change --------------------------------------------------


def test_every_field_is_in_exactly_one_group():
    groups = [set(FIXED), set(ON_REQUEST), set(FREE), set(NOT_COMPARED)]
    assert sum(map(len, groups)) == len(set().union(*groups))
    assert set().union(*groups) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_a_change_on_request_is_refused_with_each_field_old_and_new_until_allowed():
    old = TrainConfig(max_steps=400, lr=1e-3).validate()
    new = TrainConfig(max_steps=800, lr=3e-4, stop_after=500, save_every=50, out_dir="moved").validate()
    saved = json.loads(json.dumps(dataclasses.asdict(old)))  # as train_config.json holds it
    with pytest.raises(ConfigError) as e:
        resume_changes(saved, new)
    msg = str(e.value)
    assert msg.startswith("cannot resume moved with a changed configuration (max_steps 400 -> 800, stop_after null "
                          "-> 500, lr 0.001 -> 0.0003, save_every 200 -> 50).")
    assert "max_steps: the run ends at the new max_steps, and since the cosine schedule spans max_steps" in msg
    assert msg.endswith("To accept, pass --allow-changed max_steps,lr; to start over, choose a new --out")
    with pytest.raises(ConfigError, match=r"pass --allow-changed lr;"):
        resume_changes(saved, new, ["max_steps"])
    # allowed: every change listed for the log, the free ones (stop_after, save_every) with them
    assert resume_changes(saved, new, ["max_steps", "lr"]) == [
        "max_steps 400 -> 800", "stop_after null -> 500", "lr 0.001 -> 0.0003", "save_every 200 -> 50"]
    assert resume_changes(saved, TrainConfig(max_steps=400, out_dir="elsewhere", device="cpu").validate()) == [
        'device "auto" -> "cpu"']


def test_what_the_run_trains_never_changes_whatever_is_allowed():
    saved = dataclasses.asdict(TrainConfig(model=dict(TINY), lr=1e-3).validate())
    new = TrainConfig(model=dict(TINY, num_layers=3), lr=2e-3).validate()
    with pytest.raises(ConfigError) as e:
        resume_changes(saved, new, list(ON_REQUEST))
    assert str(e.value) == ("cannot resume runs/refusion with another configuration (model.num_layers 2 -> 3, lr 0.001 "
                            "-> 0.002): model sets what the run trains and cannot change within a run; train into a "
                            "new --out")
    with pytest.raises(ConfigError, match=r"\(objective \"refusion\" -> \"ar\", vocab_size 1024 -> 512\): objective, "
                                          r"vocab_size set what the run trains"):
        resume_changes(dataclasses.asdict(TrainConfig()), TrainConfig(objective="ar", vocab_size=512))


def test_a_field_the_saved_file_lacks_counts_as_its_default_and_unknown_ones_are_ignored():
    saved = dataclasses.asdict(TrainConfig())
    del saved["mask_token"], saved["corpus"]  # fields newer than the run
    saved["retired_option"] = 3  # a field older code had
    assert resume_changes(saved, TrainConfig()) == []
    with pytest.raises(ConfigError, match=r"mask_token false -> true"):
        resume_changes(saved, TrainConfig(mask_token=True))


def test_allow_changed_names_only_fields_that_may_change():
    check_allow_changed(["lr", "max_steps", "stop_after"])
    with pytest.raises(ConfigError, match=r"--allow-changed lrr: no such training option \(fields that may change on "
                                          r"request: data, "):
        check_allow_changed(["lrr"])
    with pytest.raises(ConfigError, match=r"--allow-changed model: model sets what the run trains and cannot change "
                                          r"within a run; train into a new --out"):
        check_allow_changed(["model"])


def test_resume_checks_the_configuration_through_the_command_line(data_file, tmp_path, capsys):
    out = tmp_path / "run"
    train(small_run(data_file, out), progress=False)
    saved = (out / "train_config.json").read_text()
    metrics = (out / "metrics.jsonl").read_text()
    # another shape: refused, and the run directory is as it was
    p = _cli(capsys, *cli_args(data_file, out, "--set=max_steps=6", "--set=model.num_layers=3"))
    assert one_line_error(p) == (f"refusion: error: cannot resume {out} with another configuration (model.num_layers "
                                 "2 -> 3): model sets what the run trains and cannot change within a run; train into a "
                                 "new --out")
    p = _cli(capsys, *cli_args(data_file, out, "--set=max_steps=10", "--set=lr=1e-3"))
    assert "(max_steps 6 -> 10, lr 0.003 -> 0.001)" in one_line_error(p)
    assert "To accept, pass --allow-changed max_steps,lr;" in p.stderr
    assert (out / "train_config.json").read_text() == saved and (out / "metrics.jsonl").read_text() == metrics
    # accepted on request: the run goes on from step 6 on the new schedule, and records the new configuration
    p = _cli(capsys, *cli_args(data_file, out, "--set=max_steps=10", "--set=lr=1e-3",
                               "--allow-changed=max_steps,stop_after", "--allow-changed", "lr"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resuming with a changed configuration: max_steps 6 -> 10, lr 0.003 -> 0.001" in p.stderr
    new = small_run(data_file, out, max_steps=10, lr=1e-3)
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["lr"] for r in recs[6:]] == [lr_at(s, new) for s in range(6, 10)]
    assert json.loads((out / "train_config.json").read_text()) == dataclasses.asdict(new)
    # the same configuration again (a finished run): nothing to refuse
    p = _cli(capsys, *cli_args(data_file, out, "--set=max_steps=10", "--set=lr=1e-3"))
    assert p.returncode == 0 and "changed configuration" not in p.stderr, p.stderr[-2000:]


def test_a_resume_that_changes_adams_settings_uses_them(data_file, tmp_path):
    # the saved optimizer state carries its own betas and weight decay: without care they would win
    cfg = small_run(data_file, tmp_path, max_steps=3)
    train(cfg, progress=False)
    new = small_run(data_file, tmp_path, max_steps=3, betas=[0.8, 0.9], weight_decay=0.3)
    run = setup(new, allow_changed=["betas", "weight_decay"])
    assert run.step == 3
    assert [(g["betas"], g["weight_decay"]) for g in run.optimizer.param_groups] == [((0.8, 0.9), 0.3), ((0.8, 0.9), 0.0)]
    assert run.optimizer.state  # and the moments carried over


# ---- one training per run directory ------------------------------------------------------------


def test_the_lock_names_its_holder_and_goes_with_it(tmp_path):
    with locked(tmp_path / "run"):
        held = (tmp_path / "run" / LOCK_FILE).read_text()
        assert held.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        with pytest.raises(ValueError) as e:
            with locked(tmp_path / "run"):
                pass
        assert str(e.value) == (f"{tmp_path / 'run'} is in use by another training ({held.strip()}): wait for it to "
                                "end, or choose another --out")
    with locked(tmp_path / "run"):  # released at the end of the block
        pass


def test_a_second_training_into_a_busy_directory_fails_at_once_and_the_first_completes(data_file, tmp_path, capsys):
    out = tmp_path / "run"
    argv = cli_args(data_file, out, "--set=max_steps=300", "--set=save_every=1000")
    first = subprocess.Popen([sys.executable, "-m", "refusion.cli", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.01)
    assert metrics.exists(), "the first training did not start in time"
    # the second, through the command line in this process (torch is imported already: it tries at once)
    assert main(argv) == 2
    assert first.poll() is None, "the first training ended before the second tried (make it longer)"
    error = capsys.readouterr().err
    assert error.startswith(f"refusion: error: {out} is in use by another training (pid {first.pid} on "
                            f"{socket.gethostname()}, since ")
    assert error.endswith("): wait for it to end, or choose another --out\n") and error.count("\n") == 1
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == list(range(1, 301))  # one run's lines, none from the second
    assert (out / "model" / "config.json").is_file()
