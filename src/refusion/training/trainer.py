"""The training loop: one process or many (torchrun), three objectives, exact resume.

    refusion train --config configs/synthetic-scratch.toml --set lr=3e-4 --set max_steps=2000
    torchrun --nproc-per-node 2 -m refusion.cli train --config ...

    train(cfg)  =  fit(setup(cfg))
        setup.py          the Run: process group, tokenizer, model, data, optimizer, resumed state
        step.py           one optimizer step on one global batch (micro-batches, DDP / FSDP)
        checkpointing.py  checkpoints and the final model

Checkpoints are Hugging Face directories written atomically, with the optimizer, scheduler, data
position and RNG states in training_state.pt: a run killed at any point and resumed from its last
checkpoint continues bit for bit.

Under torchrun the processes share the work in one of two ways (`strategy`): "ddp" keeps the whole
model, its gradients and optimizer state on every process; "fsdp" shards all three over the
processes (refusion.training.fsdp) and writes sharded checkpoints
(refusion.training.sharded_checkpoint), exported as a Hugging Face directory at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import torch.distributed as dist

from refusion.files import Appender, write_text
from refusion.training.checkpointing import export_model, final_dir, save_checkpoint
from refusion.training.config import TrainConfig, load_train_config, to_toml  # noqa: F401 (the API in one place)
from refusion.training.config_changes import CONFIG_FILE, check_allow_changed
from refusion.training.mask_features import prepare_features
from refusion.training.run_dir import checkpoints, locked, tensorboard, truncate_metrics
from refusion.training.setup import Run, log, setup
from refusion.training.step import train_step


def train(cfg: TrainConfig, resume: bool = True, progress: bool = True, allow_changed: Collection[str] = (),
          threads: int | None = None) -> Path:
    """Train (or resume) a run; returns the final model directory (a mask-only run: its adapter's).

    The run holds a lock on out_dir while it lasts (under torchrun, rank 0 holds it for all the
    processes): a second training into it fails at once. A resume may change the configuration only
    where refusion.training.config_changes allows, `allow_changed` naming the fields it allows on
    request. `threads`: CPU threads; None: one for a small model, else torch's default.

    A run that fails before its first checkpoint (a bad option that only shows at step one, data
    that does not fit) leaves no directory behind if it created the directory: a later attempt
    with the same out_dir then starts clean instead of meeting a half-made run.
    """
    cfg.validate()
    check_allow_changed(allow_changed)
    out = Path(cfg.out_dir)
    created = not out.exists()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with locked(out) if rank0 else contextlib.nullcontext():
        try:
            return fit(setup(cfg, resume=resume, allow_changed=allow_changed, threads=threads), progress=progress)
        except Exception:
            if created and rank0 and not checkpoints(out):
                shutil.rmtree(out, ignore_errors=True)
            raise


def fit(run: Run, progress: bool = True) -> Path:
    """Train `run` up to max_steps, or stop_after; returns the final model directory (the last
    checkpoint when stopped early)."""
    cfg = run.cfg
    run.out.mkdir(parents=True, exist_ok=True)
    end = min(cfg.max_steps, cfg.stop_after or cfg.max_steps)
    if run.rank == 0:
        # what the next resume compares its configuration with; replaced whole, never half-written
        write_text(run.out / CONFIG_FILE, json.dumps(dataclasses.asdict(cfg), indent=2))
        truncate_metrics(run.out / "metrics.jsonl", run.step)
        if run.step < end:
            log(f"training steps {run.step + 1} to {end} of {cfg.max_steps} -> {run.out}")
    if cfg.feature_cache and run.features is None and run.step < end:
        run.features = prepare_features(run.model, run.examples, run.out, cfg.feature_phases, max(cfg.slot_sizes),
                                        cfg.seed, progress=progress, log=log)
    with _Metrics(run, progress) as metrics:
        while run.step < end:
            t0 = time.perf_counter()
            rec = train_step(run)
            rec["seconds"] = time.perf_counter() - t0
            rec["tokens_per_s"] = rec["tokens"] / rec["seconds"]
            metrics.add(rec)
            if run.step % cfg.save_every == 0 or run.step == end:
                save_checkpoint(run)
    final = final_dir(run)
    if run.rank == 0 and run.step >= cfg.max_steps:
        export_model(run, final)
        log(f"saved {final}")
    if run.world > 1:
        dist.barrier()
    return final if run.step >= cfg.max_steps else run.out / f"checkpoint-{run.step}"


class _Metrics:
    """Where each step's record goes, on rank 0: metrics.jsonl, TensorBoard, the progress bar."""

    SCALARS = ("loss", "ar_loss", "mdm_loss", "lr", "grad_norm", "tokens_per_s")

    def __init__(self, run: Run, progress: bool) -> None:
        rank0 = run.rank == 0
        self.writer = tensorboard(run.out) if rank0 else None
        self.bar = None
        if progress and rank0:
            from tqdm import tqdm

            self.bar = tqdm(total=run.cfg.max_steps, initial=run.step, desc=f"train {run.cfg.objective}", unit="step",
                            dynamic_ncols=True)
        self.log = Appender(run.out / "metrics.jsonl") if rank0 else None  # a record is whole or absent

    def add(self, rec: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")
        if self.writer is not None:
            for k in self.SCALARS:
                if k in rec:
                    self.writer.add_scalar(f"train/{k}", rec[k], rec["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")

    def __enter__(self) -> "_Metrics":
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.bar, self.log, self.writer):
            if f is not None:
                f.close()
