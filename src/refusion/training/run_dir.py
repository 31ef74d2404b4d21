"""A training run's output directory on disk: its checkpoints (the newest complete one, pruning,
which strategy wrote one), metrics.jsonl and TensorBoard logs.

    OUT/checkpoint-N/   complete checkpoints (written elsewhere and renamed into place)
    OUT/metrics.jsonl   one JSON line per step
    OUT/tensorboard/    when TensorBoard is installed
    OUT/model/          the final model
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from refusion.model.checkpoint import SHARDED_DIR, STATE_FILE


def checkpoints(out: Path) -> list[Path]:
    """checkpoint-N directories, oldest first (temporary .checkpoint-N.tmp ones do not match)."""
    return sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    found = [p for p in checkpoints(out) if (p / STATE_FILE).exists()]
    return found[-1] if found else None


def prune_checkpoints(out: Path, keep: int) -> None:
    for p in checkpoints(out)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def written_by(ckpt: Path) -> str:
    """The strategy whose checkpoint this is: fsdp (sharded) or ddp (a Hugging Face directory)."""
    return "fsdp" if (ckpt / SHARDED_DIR).is_dir() else "ddp"


def truncate_metrics(path: Path, step: int) -> None:
    """Drop lines past `step`: a killed run may have logged steps after its last checkpoint."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in lines))


def tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # TensorBoard is optional; metrics.jsonl always has everything
        return None
    return SummaryWriter(str(out / "tensorboard"))
