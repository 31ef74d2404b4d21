"""Writing a run's checkpoints and its final model.

A checkpoint is a Hugging Face directory written atomically (refusion.model.checkpoint.save_model),
with the optimizer, layout generator, step and RNG states in training_state.pt; under FSDP it is a
sharded checkpoint (refusion.training.sharded_checkpoint); a mask-only run's holds its mask adapter
and training_state.pt only (its base is `init`, which it never changes). refusion.training.setup
reads each back.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import torch

from refusion.bundled import is_model_name
from refusion.files import writing
from refusion.model.checkpoint import DTYPES, STATE_FILE, atomic_dir, save_model
from refusion.model.lora import merged_state_dict
from refusion.model.mask_adapter import save_mask_adapter
from refusion.model.transformer import Transformer
from refusion.training.run_dir import prune_checkpoints
from refusion.training.setup import Run, mask_only, rng_state


def training_state(run: Run) -> bytes:
    """training_state.pt: what a resumed run needs besides the weights (setup._resume reads it)."""
    s = {"step": run.step, "layout_gen": run.layout_gen.get_state(), "rng": rng_state(),
         "config": dataclasses.asdict(run.cfg)}
    if run.fsdp:  # weights and optimizer are in the shards; the export rebuilds LoRA's token rows
        s["new_tokens"] = run.new_tokens
    else:
        s["optimizer"] = run.optimizer.state_dict()
        s["lora"] = {k: v for k, v in run.model.state_dict().items() if "lora_" in k}
    buf = io.BytesIO()
    torch.save(s, buf)
    return buf.getvalue()


def save_checkpoint(run: Run) -> Path | None:
    """OUT/checkpoint-<step> (every process calls this); its path on rank 0, None elsewhere."""
    path = run.out / f"checkpoint-{run.step}"
    if mask_only(run.cfg):  # the adapters and the training state: the base is `init`, unchanged
        _save_adapter(run, path, None, {STATE_FILE: training_state(run)})
    elif run.fsdp:  # every process writes its own shards
        from refusion.training.sharded_checkpoint import save_sharded

        save_sharded(path, run.model, run.optimizer, rng_state(), run.tokenizer,
                     {STATE_FILE: training_state(run)} if run.rank == 0 else {})
    elif run.rank == 0:
        _save_model(run, path, None, {STATE_FILE: training_state(run)})
    if run.rank != 0:
        return None
    prune_checkpoints(run.out, run.cfg.keep_checkpoints)
    return path


def final_dir(run: Run) -> Path:
    """Where the finished run's result goes: OUT/model, or OUT/adapter for a mask-only run."""
    return run.out / ("adapter" if mask_only(run.cfg) else "model")


def export_model(run: Run, final: Path) -> None:
    """The finished run's model as a Hugging Face directory in save_dtype (rank 0 only); a mask-only
    run's as its mask adapter alone, which names its base (`refusion generate --model OUT/adapter`)."""
    if mask_only(run.cfg):
        _save_adapter(run, final, DTYPES[run.cfg.save_dtype], None)
    elif run.fsdp:  # consolidated from the last checkpoint's shards, by this process alone
        from refusion.training.sharded_checkpoint import export_checkpoint

        export_checkpoint(run.out / f"checkpoint-{run.step}", final, DTYPES[run.cfg.save_dtype], overwrite=True)
    else:
        _save_model(run, final, DTYPES[run.cfg.save_dtype], None)


def _save_model(run: Run, path: Path, dtype: torch.dtype | None, extra: dict | None) -> None:
    model = run.model
    if run.cfg.lora:  # save the merged weights under the plain names
        model = Transformer(run.model.config)
        model.load_state_dict(merged_state_dict(run.model))
    save_model(model, path, run.tokenizer, dtype=dtype, overwrite=True, extra_files=extra)


def adapter_base_name(init: str) -> str:
    """How a mask adapter names the base it was trained on: a model name as it is, a directory by its
    absolute path."""
    return init if is_model_name(init) else str(Path(init).resolve())


def _save_adapter(run: Run, path: Path, dtype: torch.dtype | None, extra: dict | None) -> None:
    """A mask-only run's mask path (save_mask_adapter) and `extra` files, written atomically."""
    with writing(path), atomic_dir(path, overwrite=True) as tmp:
        save_mask_adapter(run.model, tmp, base=adapter_base_name(run.cfg.init), dtype=dtype)
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
