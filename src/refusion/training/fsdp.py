"""Sharded data parallel training on PyTorch's own engine (FSDP2, `torch.distributed.fsdp.fully_shard`).

Each transformer block is one FSDP unit; the root unit holds what is left (embeddings, final norm,
LM head). Every process keeps only its 1/N slice of the float32 weights, of their gradients and of
the AdamW state; a unit's full weights exist only while it runs (all-gathered before its forward
and again before its backward, freed after). A tied LM head is the embedding's own parameter, so
both sit in the root unit as one parameter: the tie survives sharding and the gradient of both
uses arrives in one place.

Mixed precision (dtype = "bfloat16") is FSDP's own, not autocast: the gathered weights and the
compute are bf16, the sharded master weights, the gradient reduce-scatter and the optimizer stay
float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from refusion.model.transformer import Transformer


def shard_model(model: Transformer, device: torch.device, bf16: bool) -> Transformer:
    """Shard `model` (whole, on the CPU) over the default process group, one unit per block.

    Units are sharded one at a time, so a CUDA device only ever holds the shards plus one
    block's full weights (the full model stays on the CPU until its slices are taken)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # the root keeps its weights gathered from forward to backward: the LM head runs last in the
    # forward and first in the backward, so freeing it in between would only gather it again
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model  # buffers (RoPE frequencies, LoRA token ids) were moved to the device by fully_shard


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """clip_grad_norm_ for sharded gradients: the total norm over all shards (one all-reduce),
    returned as a plain tensor, the same number one process computes over whole gradients."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
