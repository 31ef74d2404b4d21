"""The transformer: a decoder-only model covering Qwen3 (q/k RMSNorm) and Llama / Qwen2 (optional qkv bias).

forward(input_ids, position_ids, attn_mask=None, cache=None) -> logits

Two orders meet here, and keeping them apart is the whole ReFusion trick: attention is causal in
the order tokens are *fed*, while RoPE uses the *position ids* given with each token, which can be
in any order. Module names mirror Hugging Face's (without the leading "model.") so checkpoints map
one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .cache import KVCache
from .config import ConfigError, ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # normalise in float32 like the reference implementations, then return to the input dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.float()
    kind = sc.get("rope_type")
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, a smooth ramp between.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_len = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        ramp = ((old_len / wavelen - lo) / (hi - lo)).clamp(0, 1)
        scaled = (1 - ramp) * inv / factor + ramp * inv
        out = torch.where(wavelen > old_len / lo, inv / factor, scaled)
        out = torch.where(wavelen < old_len / hi, inv, out)
        return out.float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    ang = positions[..., None].float() * inv_freq  # [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)[:, None]  # [B, 1, T, D]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                cache: KVCache | None, layer: int) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d)
        k = self.k_proj(x).view(B, T, self.kvh, self.d)
        v = self.v_proj(x).view(B, T, self.kvh, self.d).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           enable_gqa=self.kvh != self.h)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, is_causal, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.gradient_checkpointing = False

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "Transformer":
        """Fresh initialisation for training from scratch (normal(0, std), unit norms, zero biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        self.inv_freq = rope_inv_freq(self.config).to(self.embed_tokens.weight.device)
        return self

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attn_mask: Tensor | None = None,
                cache: KVCache | None = None, num_logits: int | None = None) -> Tensor:
        """Logits [B, T, V] (or of the last `num_logits` tokens).

        attn_mask: None for causal in feed order (every cached entry visible), or a bool mask
        (True = may attend) / additive float mask broadcastable to [B, heads, T, len(cache) + T].
        """
        B, T = input_ids.shape
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        past = 0 if cache is None else cache.length
        is_causal = False
        if attn_mask is None and T > 1:
            if past == 0:
                is_causal = True
            else:  # SDPA's is_causal aligns top-left; with a cache we need the bottom-right triangle
                attn_mask = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(past)
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, x.dtype)
        for i, block in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, attn_mask, is_causal, None, i, use_reentrant=False)
            else:
                x = block(x, cos, sin, attn_mask, is_causal, cache, i)
        if num_logits is not None:
            x = x[:, -num_logits:]
        return self.lm_head(self.norm(x))
