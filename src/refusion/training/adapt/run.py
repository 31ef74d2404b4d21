"""The run directory of `refusion adapt`: what it holds, its state file and its log.

    DIR/state.json     the base, the options that define the run, each stage's record (done, seconds,
                       counts), written atomically after every change
    DIR/log            one timestamped line per event, appended (the progress bars go to the terminal)
    DIR/user_turns.jsonl, code_requests.jsonl, code_tests.jsonl (the model's samples), prompts.jsonl,
        data.jsonl, train/, sampler/, measure.json                                         stages' work
    DIR/adapter/       the result: a mask adapter directory naming its base (`--model DIR/adapter`)

A directory holding another model's run, or a run with other defining options, is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STATE = "state.json"
LOG = "log"
FORMAT = 1


class RunDir:
    def __init__(self, path: str | Path, quiet: bool = False) -> None:
        self.path = Path(path)
        self.quiet = quiet
        self.state: dict[str, Any] = {}

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def open(self, base: dict[str, str], defining: dict[str, Any]) -> None:
        """Start the run, or take it up again: a ValueError when DIR holds something else."""
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--out {self.path}: a file, not a directory")
        f = self.path / STATE
        if f.is_file():
            try:
                state = json.loads(f.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise ValueError(f"{f} is not valid JSON: choose another --out, or delete the directory to start "
                                 "over") from None
            if state.get("base", {}).get("fingerprint") != base["fingerprint"]:
                raise ValueError(f"--out {self.path} holds a run of another model ({state.get('base', {}).get('model')}"
                                 f"): choose another --out for {base['model']}")
            differ = [k for k in defining if state.get("options", {}).get(k) != defining[k]]
            if differ:
                was = ", ".join(f"{k}={state.get('options', {}).get(k)}" for k in differ)
                raise ValueError(f"--out {self.path} holds a run with other {', '.join(differ)} ({was}): give the "
                                 "same options to resume it, or choose another --out")
            self.state = state
        else:
            if self.path.is_dir() and any(p.name != LOG for p in self.path.iterdir()):
                raise ValueError(f"--out {self.path} is a directory with other files in it and no {STATE}: choose "
                                 "a new or empty directory")
            self.path.mkdir(parents=True, exist_ok=True)
            self.state = {"format": FORMAT, "base": base, "options": defining, "stages": {}}
            self.save()

    def save(self) -> None:
        tmp = self.path / f".{STATE}.tmp"
        tmp.write_text(json.dumps(self.state, indent=1), encoding="utf-8")
        os.replace(tmp, self.path / STATE)

    def log(self, message: str) -> None:
        """A line in DIR/log, and on stderr (once, where stderr is DIR/log: `... 2>> DIR/log`)."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        if _same_file(sys.stderr, self.path / LOG):
            print(line, file=sys.stderr, flush=True)
            return
        if not self.quiet:
            print(f"refusion adapt: {message}", file=sys.stderr, flush=True)
        with open(self.path / LOG, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def done(self, stage: str) -> bool:
        return bool(self.state["stages"].get(stage, {}).get("done"))

    def record(self, stage: str, **fields: Any) -> None:
        self.state["stages"].setdefault(stage, {}).update(fields)
        self.save()

    def finish(self, stage: str, started: float, **fields: Any) -> None:
        self.record(stage, done=True, seconds=self._seconds(stage, started), **fields)

    def stopped(self, stage: str, started: float) -> None:
        """A stage cut off (Ctrl-C, `kill`, an error): its seconds so far are kept, so that a stage's record
        is its whole wall time however often it was resumed."""
        if not self.done(stage):
            seconds = self._seconds(stage, started)
            self.record(stage, seconds=seconds)
            self.log(f"{stage}: stopped after {seconds / 60:.1f} min in all; the same command resumes it")

    def _seconds(self, stage: str, started: float) -> float:
        return round(self.state["stages"].get(stage, {}).get("seconds", 0.0) + time.time() - started, 1)


def fingerprint(path: Path) -> str:
    """What identifies a base (a model directory or a GGUF file): its config.json, and each weight file's
    name, size and first and last MiB, which differ between two trainings of one shape (reading every byte
    of a large model on each resume would cost more than it tells)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else [path / "config.json", *sorted(path.glob("*.safetensors"))]
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(_MIB))
            f.seek(max(size - _MIB, 0))
            h.update(f.read(_MIB))
    return h.hexdigest()[:16]


_MIB = 1 << 20


def _same_file(stream, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):
        return False
