"""How big the model a config describes is, from its shapes alone, and a refusal of one larger than
this machine's memory before anything is allocated (a `hidden_size` of 10**12 would otherwise end
in an allocation error, or in torch's overflow of the tensor size, with a traceback).

    check_memory(config, bytes_per_parameter=4, what="the model")   # before Transformer(config)

Loading a checkpoint calls it with the weights' dtype; training should call it with what a step
holds per parameter (weights, gradients and the optimizer's moments).
"""

from __future__ import annotations

import os

from refusion.model.config import ConfigError, ModelConfig
from refusion.model.mask_adapter import check_adapter_config, projections


def parameter_count(cfg: ModelConfig) -> int:
    """The parameters Transformer(cfg) holds (tied embeddings once), computed, not allocated."""
    H, I, V, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    block = (2 * H  # input and post-attention norms
             + H * (q + 2 * kv) + (q + 2 * kv) * cfg.qkv_bias + q * H + H * cfg.o_bias
             + 2 * d * cfg.qk_norm
             + H * 2 * I + I * H)
    adapters = 0
    if cfg.mask_adapter is not None:
        spec = check_adapter_config(cfg.mask_adapter)
        per_block = sum(spec["rank"] * (fan_in + fan_out) for fan_in, fan_out in projections(cfg).values())
        adapters = spec.get("layers", cfg.num_layers) * per_block
    head = 0 if cfg.tie_word_embeddings else V * H
    mask_embedding = H if cfg.mask_adapter is not None else 0
    return V * H + cfg.num_layers * block + adapters + H + head + mask_embedding


def rope_bytes(cfg: ModelConfig) -> int:
    """The RoPE table every model builds when made (float32 [max_position_embeddings, 2, head_dim]),
    with the temporaries of building it (about twice as much again)."""
    return 3 * cfg.max_position_embeddings * 2 * cfg.head_dim * 4


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(cfg: ModelConfig, bytes_per_parameter: int = 4, what: str = "the model") -> None:
    """Refuse a config whose model needs more memory than this machine has (ConfigError)."""
    total = machine_memory()
    n = parameter_count(cfg)
    need = n * bytes_per_parameter + rope_bytes(cfg)
    if total is not None and need > total:
        raise ConfigError(f"{what} needs about {_gib(need)} ({n:,} parameters at {bytes_per_parameter} bytes, "
                          f"{cfg.max_position_embeddings:,} positions of RoPE table), more than this machine's "
                          f"{_gib(total)} of memory: check hidden_size, intermediate_size, num_layers, vocab_size "
                          "and max_position_embeddings")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
