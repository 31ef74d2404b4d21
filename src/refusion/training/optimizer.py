"""The optimizer of a run (AdamW, weight decay where it belongs) and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from refusion.training.config import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # no weight decay on norms, biases and embeddings (the usual choice for transformers)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        embedding = "embed_tokens" in name or "token_rows" in name or "token_head_rows" in name
        (no_decay if p.ndim < 2 or embedding or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr, then cosine down to lr * min_lr_ratio at max_steps (step counts from 0)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
