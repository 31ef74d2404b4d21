"""Sharded training checkpoints (torch.distributed.checkpoint, DCP) and their export to an ordinary
Hugging Face directory.

An FSDP run's checkpoint-N/ holds

    dcp/               the model's and the optimizer's shards, each process writing its own slice
                       (DCP reshards on load: another number of processes can read them)
    rng-R.pt           process R's random number generator states
    training_state.pt  step, data position, layout generator, run config (written by rank 0)
    config.json        the model's Hugging Face config; tokenizer files

No process ever holds the whole model or optimizer state to write one. The directory is written as
.checkpoint-N.tmp and renamed to checkpoint-N once every process has finished, so a checkpoint-N
is always complete: a run killed while saving leaves only the temporary directory, which resuming
ignores and the next save of that step replaces.

A run resumes from them without reading its starting weights: setup.py builds the model on the
meta device, shards it (fsdp.py) and `load_sharded` fills every process's slices.

`export_checkpoint` writes a Hugging Face directory that `load_model` and transformers read, in
one process without a process group, one FSDP unit at a time (the root, then block by block: DCP
reads just that unit's tensors, LoRA is merged into them), into safetensors files of at most 2 GiB
(several, with model.safetensors.index.json, past that), each written as soon as it is full.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from refusion.files import writing
from refusion.model.checkpoint import (SHARDED_DIR, STATE_FILE, CheckpointError, _commit_dir, load_config, to_hf,
                                       write_model_dir)
from refusion.model.lora import apply_lora, merged_state_dict
from refusion.model.transformer import Transformer
from refusion.model.tokenizer import Tokenizer


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded (FSDP) training checkpoint rather than a Hugging Face directory."""
    return (Path(path) / SHARDED_DIR).is_dir()


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rng: dict, tokenizer: Tokenizer,
                 files: dict[str, bytes]) -> Path:
    """Write checkpoint `path` atomically; every process calls this. `rng` is this process's RNG
    states; `files` (the training state) are written by rank 0."""
    rank = dist.get_rank()
    tmp = path.with_name(f".{path.name}.tmp")  # one name that every process knows without being told
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving this step
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / SHARDED_DIR)
    buf = io.BytesIO()  # (torch.save to a file reports a full disk as a RuntimeError without its cause)
    torch.save(rng, buf)
    with writing(path):
        (tmp / f"rng-{rank}.pt").write_bytes(buf.getvalue())
    dist.barrier()  # every process's files are on disk before the directory is declared complete
    if rank == 0:
        try:
            with writing(path):
                (tmp / "config.json").write_text(_config_json(model))
                tokenizer.save(tmp)
                for name, data in files.items():
                    (tmp / name).write_bytes(data)
                _commit_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    dist.barrier()  # nobody reads, prunes or exits before the checkpoint exists
    return path


def _config_json(model: nn.Module) -> str:
    hf = model.config.to_hf()
    hf["torch_dtype"] = "float32"  # the master weights, whatever the compute dtype
    return json.dumps(hf, indent=2)


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Load the model's and optimizer's shards of checkpoint `path` into a sharded model and its
    optimizer (every process calls this); returns this process's saved RNG states (None if the
    checkpoint was written by fewer processes). The checkpoint may come from any number of
    processes: DCP reads each process's slices from whichever files hold them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path / SHARDED_DIR)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = path / f"rng-{dist.get_rank()}.pt"
    return torch.load(rng, weights_only=False) if rng.exists() else None


def export_checkpoint(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None,
                      overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Consolidate sharded checkpoint `ckpt` into a Hugging Face directory `out` (one process, no
    process group; LoRA adapters and trained token rows are merged into the plain weights), one
    FSDP unit at a time: the root (embeddings, final norm, LM head), then each block, read from the
    shards, merged and handed to the writer, which writes a file of at most max_shard_bytes
    whenever one is full. The process holds one file's tensors and one unit's, never the model."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist" if not ckpt.exists()
                              else f"{ckpt} is a file, not a checkpoint directory")
    if not is_sharded(ckpt):
        raise CheckpointError(f"{ckpt} is not a sharded training checkpoint (no {SHARDED_DIR}/ directory)")
    if not (ckpt / STATE_FILE).is_file():
        raise CheckpointError(f"{ckpt} has no {STATE_FILE}: not a complete checkpoint")
    state = torch.load(ckpt / STATE_FILE, weights_only=False)
    cfg = load_config(ckpt)
    # no random initialisation (minutes for a large model), no storage: each unit is allocated as it is read
    with torch.device("meta"):
        model = Transformer(cfg)
    lora = state["config"].get("lora")
    if lora:
        apply_lora(model, lora, state.get("new_tokens", []))
    blocks, model.layers = model.layers, nn.ModuleList()  # `model` is the root unit alone now
    units = [("", model), *((f"layers.{i}.", block) for i, block in enumerate(blocks))]

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for prefix, unit in units:
            yield from to_hf(_read_unit(ckpt, prefix, unit), cfg).items()

    return write_model_dir(out, cfg, weights(), Tokenizer.from_dir(ckpt), dtype, max_shard_bytes, overwrite)


def _read_unit(ckpt: Path, prefix: str, unit: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of one unit of the meta model (the root, or the block whose names start with
    `prefix`) read from checkpoint `ckpt`'s shards, LoRA merged in, under the plain model's names;
    the unit goes back to the meta device."""
    unit.to_empty(device="cpu")
    if isinstance(unit, Transformer) and unit.config.tie_word_embeddings:
        unit.lm_head.weight = unit.embed_tokens.weight  # to_empty gives each use its own tensor: tie them again
    sd = {prefix + k: v for k, v in unit.state_dict().items()}  # the unit's own tensors: DCP reads into them
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": sd}, checkpoint_id=ckpt / SHARDED_DIR, no_dist=True)
    merged = {prefix + k: v for k, v in merged_state_dict(unit).items()}
    unit.to_empty(device="meta")
    return merged
