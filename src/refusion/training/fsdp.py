"""Sharded data parallel training on PyTorch's own engine (FSDP2, `torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit; the root unit holds what is left (embeddings, final norm,
LM head). Every process keeps only its 1/N slice of the float32 weights, of their gradients and of
the AdamW state; a unit's full weights exist only while it runs (all-gathered before its forward
and again before its backward, freed after). A tied LM head is the embedding's own parameter, so
both sit in the root unit as one parameter: the tie survives sharding and the gradient of both
uses arrives in one place.

No process holds the whole model where its weights come from files. training/setup.py builds the
model on the meta device (shapes, no storage) with every change a run makes to it (the mask
token's rows, LoRA adapters, config flags), `shard_model` shards it and allocates each process's
slices, empty, and they are filled from

    a Hugging Face directory  load_hf_shards: each process reads its rows of every tensor straight
                              from the safetensors files (a fused q/k/v or gate/up slice from the
                              parts it spans); rank 0 alone reads the whole embedding (and an
                              untied LM head) once, for the mean a new mask row starts from
    a training checkpoint     sharded_checkpoint.load_sharded (DCP reads each process's slices)

The few tensors a run initialises itself (LoRA adapters, from the run's seed) are small: they are
made whole on the CPU, as before sharding ever existed, and each process keeps its slice. A model
trained from scratch is drawn whole by `Transformer.init_weights` on every process (one generator
walks every weight in turn, so a slice's values depend on all that comes before it) and sharded;
such models are the small ones (setup.py refuses one the machine cannot hold).

Mixed precision (dtype = "bfloat16") is FSDP's own, not autocast: the gathered weights and the
compute are bf16, the sharded master weights, the gradient reduce-scatter and the optimizer stay
float32. CPU offload (cpu_offload = true, FSDP2's CPUOffloadPolicy) keeps the sharded weights, their
gradients and the AdamW state in host memory: a unit's slices are copied to the device for its
all-gather, its gradients back for the optimizer step, which runs on the CPU.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from refusion.model.checkpoint import MaskRows, WeightSlices, check_weights, hf_parts, load_config, to_hf
from refusion.model.config import ModelConfig
from refusion.model.lora import HEAD_ROWS, ROWS, base_name
from refusion.model.transformer import Transformer


def shard_model(model: Transformer, device: torch.device, bf16: bool, offload: bool = False) -> Transformer:
    """Shard `model` over the default process group, one unit per block.

    A model whole on the CPU is sharded one unit at a time, so a CUDA device only ever holds the
    shards plus one block's full weights. A model on the meta device gets its slices allocated,
    empty, for load_hf_shards or load_sharded to fill; whatever of it is not on the meta device
    (LoRA adapters made on the CPU) keeps its values. Buffers are on `device` either way."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    # pinned host memory speeds the copies to a GPU; a CPU-only process has nothing to pin it for
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    meta = any(p.is_meta for p in model.parameters())
    kept = {name: t.detach().clone() for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if meta and not t.is_meta}
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    # the root keeps its weights gathered from forward to backward: the LM head runs last in the
    # forward and first in the backward, so freeing it in between would only gather it again
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=False)
    if not meta:
        return model  # buffers (RoPE frequencies, LoRA token ids) were moved to the device by fully_shard
    model.to_empty(device="cpu" if offload else device)  # (offloaded slices live on the host)
    model.reset_rope(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in kept:
                start, stop = local_rows(p)
                p.to_local().copy_(kept[name][start:stop])
        for name, b in model.named_buffers():
            if name in kept:
                b.copy_(kept[name])
    return model


def local_rows(p: Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the whole parameter that this process's slice of `p` holds (FSDP2
    shards dim 0 as torch.chunk does: ceil(rows / N) each, the last ones shorter or empty)."""
    rows = p.shape[0]
    if not isinstance(p, DTensor):
        return 0, rows
    n, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-rows // n)
    start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    if p.to_local().shape[0] != stop - start:
        raise AssertionError(f"a slice of {tuple(p.shape)} holds {p.to_local().shape[0]} rows, not rows {start}:{stop}")
    return start, stop


def load_hf_shards(model: Transformer, path: str | Path, mask: MaskRows | None,
                   device: torch.device) -> WeightSlices:
    """Fill this process's slices of a model that shard_model allocated on the meta device with the
    weights of Hugging Face directory `path` (any safetensors dtype, as float32), reading only its
    own rows; `mask`: the rows of a mask token register_mask_token added, set to the mean of the
    file's rows as add_mask_token sets them. Every process calls this (rank 0 computes the means
    and sends them). Returns the reader (its elements_read)."""
    cfg = model.config
    files = WeightSlices(path)
    _check_names(path, files)
    means = _mask_means(files, cfg, mask, device)

    def rows(name: str, start: int, stop: int) -> Tensor:
        """Rows [start, stop) of the model's tensor `name`: from the parts of the files they span,
        and the mean at the mask token's rows."""
        out, at = [], 0
        for key, n in hf_parts(name, cfg):
            n = n or files.shape(key)[0]
            lo, hi = max(start, at), min(stop, at + n)
            if lo < hi:
                out.append(files.rows(key, lo - at, hi - at, torch.float32))
            at += n
        if name not in means:
            return torch.cat(out)
        # the embedding or LM head of a grown vocabulary lacks the new rows in the file
        t = torch.cat(out + [torch.empty(stop - start - sum(len(o) for o in out), cfg.hidden_size)])
        for r in mask.rows:
            if start <= r < stop:
                t[r - start] = means[name]
        return t

    token_rows = {ROWS: "embed_tokens.weight", HEAD_ROWS: "lm_head.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            start, stop = local_rows(p)
            if name in token_rows:  # LoRA's copies of its new tokens' rows (model/lora.py): the mask's, the mean
                p.to_local().copy_(means[token_rows[name]].expand(stop - start, -1))
            elif "lora_" not in name:  # (the adapters kept their values through shard_model)
                if stop > start:
                    p.to_local().copy_(rows(base_name(name), start, stop))
    return files


def _check_names(path: str | Path, files: WeightSlices) -> None:
    """The files hold the tensors their config.json implies, by name and shape (as load_model checks)."""
    cfg = load_config(path)  # the file's own (before a mask token grows the vocabulary)
    with torch.device("meta"):
        expected = to_hf(Transformer(cfg).state_dict(), cfg)
    shapes = files.shapes()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    check_weights(path, shapes, expected)


def _mask_means(files: WeightSlices, cfg: ModelConfig, mask: MaskRows | None,
                device: torch.device) -> dict[str, Tensor]:
    """The rows a new mask token starts from, by the model's tensor name: the mean of the file's
    rows [:mask.mean_of] of the embedding (and of an untied LM head), the same arithmetic as
    add_mask_token's on the same float32 rows. The mean of a matrix needs all of it: rank 0 alone
    reads it (one vocabulary x hidden matrix at a time, not the model) and sends the result."""
    if mask is None:
        return {}
    means = {}
    for name in ["embed_tokens.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"]):
        mean = torch.empty(cfg.hidden_size, device=device)
        if dist.get_rank() == 0:
            ((key, _),) = hf_parts(name, cfg)
            mean.copy_(files.rows(key, 0, mask.mean_of, torch.float32).mean(0))
        dist.broadcast(mean, src=0)
        means[name] = mean.cpu()
    return means


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """clip_grad_norm_ for sharded gradients: the total norm over all shards (one all-reduce),
    returned as a plain tensor, the same number one process computes over whole gradients."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(norm, DTensor):
        host, comm = norm.device, norm.device_mesh.device_type
        if host.type != comm:  # CPU offload: the gradients on the host, the collectives on the device (NCCL has no CPU)
            norm = DTensor.from_local(norm.to_local().to(comm), norm.device_mesh, norm.placements)
        norm = norm.full_tensor().to(host)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
