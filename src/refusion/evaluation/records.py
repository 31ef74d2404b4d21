"""An evaluation's per-sample records, kept as they are scored, so that no work is lost.

While a task runs, each batch's records are appended to OUT/<stem>.partial.jsonl (after a first line
that says which evaluation they belong to) as soon as the batch is scored. A run stopped in any way
(Ctrl-C, a kill, a full disk) leaves whole batches there, and the same command run again goes on
from them: the batches left are decoded with the seeds they would have had, so the finished
records are those of a run never stopped (the timings aside). When the task is done the records
are written whole to OUT/<stem>.jsonl and the partial file is removed.
"""

from __future__ import annotations

import json
from pathlib import Path

from refusion.files import Appender, write_text


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during an evaluation, with what was kept and how to go on (the message)."""


def partial_path(records_path: Path) -> Path:
    return records_path.with_name(records_path.name.removesuffix(".jsonl") + ".partial.jsonl")


class RecordsFile:
    """The records of one task's evaluation: `kept` (whole batches an earlier run of the same
    evaluation wrote), `add` a batch's records, `finish` with all of them."""

    def __init__(self, records_path: str | Path, evaluation: dict, batch_size: int, overwrite: bool = False) -> None:
        self.path = Path(records_path)
        self.partial = partial_path(self.path)
        self.evaluation = json.loads(json.dumps(evaluation))  # as it reads back
        self.kept: list[dict] = []
        if self.partial.exists() and not overwrite:
            self.kept = self._read(batch_size)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"evaluation": self.evaluation})] + [json.dumps(r) for r in self.kept]
        write_text(self.partial, "".join(x + "\n" for x in lines))  # (a torn line or part of a batch goes)
        self._out = Appender(self.partial)
        self.written = len(self.kept)  # records whole in the file

    def _read(self, batch_size: int) -> list[dict]:
        lines = self.partial.read_text(encoding="utf-8").splitlines()
        try:
            head = json.loads(lines[0])["evaluation"] if lines else None
        except (ValueError, KeyError, TypeError):
            head = None
        if head != self.evaluation:
            raise ValueError(f"{self.partial} holds the records of another evaluation (another model, task, decoder "
                             "or setting); pass --overwrite to start this one afresh, or --label / --tag to keep both")
        records = []
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except ValueError:
                break  # a torn last line, from a kill: it and anything after it go
        return records[: len(records) // batch_size * batch_size]  # whole batches: their seeds are known

    def add(self, records: list[dict]) -> None:
        """Append one batch's records (flushed to the file before this returns)."""
        self._out.write("".join(json.dumps(r) + "\n" for r in records))
        self.written += len(records)

    def finish(self, records: list[dict]) -> None:
        self._out.close()
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))
        self.partial.unlink()

    def close(self) -> None:
        self._out.close()
