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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one call for the same arithmetic as below (bit-identical), without its dispatch overhead
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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


def rope_table(cfg: ModelConfig, inv_freq: Tensor) -> Tensor:
    """[max_position_embeddings, 2, head_dim] float32: cos of every position's angles, and sin with
    its first half negated (so that rotating half of x is a roll: see apply_rope).

    Built once: a forward only indexes it by position id (one gather instead of a product, a
    concatenation and two transcendental functions over [B, T, head_dim] every time).
    """
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=inv_freq.device)
    ang = pos[:, None] * inv_freq.float()
    ang = torch.cat([ang, ang], dim=-1)
    sin = ang.sin()
    half = sin.shape[-1] // 2
    return torch.stack([ang.cos(), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)], dim=1)


def apply_rope(x: Tensor, cos: Tensor, sin_rot: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x) * sin_rot: cat(-x2, x1) * sin
    and cat(x2, x1) * cat(-sin1, sin2) are the same products to the bit (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_rot


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as the additive float mask SDPA turns it into, built once per
    forward instead of once per layer. The same where(mask, 0, -inf) SDPA itself uses, so the
    scores are bit-identical."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), float("-inf"), dtype=dtype, device=mask.device))


class FusedLinears:
    """Several nn.Linear submodules on the same input as one matrix product (q/k/v, gate/up).

    The stacked weight is the storage: each layer's weight (and bias) becomes a row-block view of it
    (`param.data` is re-pointed, the Parameter objects stay), so the layers keep their own names in
    state_dict and a checkpoint is an ordinary Hugging Face one, and every in-place update of a part
    (optimizer step, load_state_dict, copy_) is already an update of the whole; nothing is stored
    twice. A part whose storage was replaced (model.to(), load_state_dict(assign=True)) is noticed
    by its data pointer and the stack is rebuilt on the next inference forward. The parts are looked
    up by name on every call, so a layer replaced by an adapter (LoRA) is seen: then, or with
    hooks on a part, or when training with gradients, the layers run one by one.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self._ptrs: list[int] = []

    def __call__(self, owner: nn.Module, x: Tensor) -> Tensor:
        parts = [getattr(owner, n) for n in self.names]
        for m in parts:
            if (type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks
                    or (m.weight.requires_grad and torch.is_grad_enabled())):
                return torch.cat([m(x) for m in parts], dim=-1)
        if self.weight is None or self._pointers(parts) != self._ptrs:
            self._stack(parts)
        return F.linear(x, self.weight, self.bias)

    @staticmethod
    def _pointers(parts: list[nn.Linear]) -> list[int]:
        return [t.data_ptr() for m in parts for t in (m.weight, m.bias) if t is not None]

    def _stack(self, parts: list[nn.Linear]) -> None:
        sizes = [m.out_features for m in parts]
        # outside inference mode: the views become the parameters' storage, which training may use later
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.cat([m.weight for m in parts])
            for m, w in zip(parts, self.weight.split(sizes)):
                m.weight.data = w
            self.bias = None
            if parts[0].bias is not None:
                self.bias = torch.cat([m.bias for m in parts])
                for m, b in zip(parts, self.bias.split(sizes)):
                    m.bias.data = b
        self._ptrs = self._pointers(parts)


def linear(m: nn.Module, x: Tensor) -> Tensor:
    """m(x), calling F.linear directly for a plain nn.Linear without hooks (a module call's overhead
    is a noticeable share of a small model's forward); anything else (an adapter) is called."""
    if type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks):
        return F.linear(x, m.weight, m.bias)
    return m(x)


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
        self.eps = cfg.rms_norm_eps
        self.qkv = FusedLinears(["q_proj", "k_proj", "v_proj"])  # a plain attribute: no new names

    def _qk_normed(self, qk: Tensor) -> Tensor:
        """q_norm and k_norm in one pass over q and k side by side ([N, h + kvh, d]): the same
        arithmetic per head as the two RMSNorms, with the weight of each head's own norm."""
        if type(self.q_norm) is not RMSNorm or type(self.k_norm) is not RMSNorm:
            return torch.cat([self.q_norm(qk[:, : self.h]), self.k_norm(qk[:, self.h:])], dim=1)
        w = torch.cat([self.q_norm.weight.expand(self.h, -1), self.k_norm.weight.expand(self.kvh, -1)])
        if qk.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(qk, (self.d,), None, self.eps) * w  # bit-identical to the lines below
        h = qk.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(qk.dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                cache: KVCache | None, layer: int, shape: tuple[int, int], real: Tensor | None) -> Tensor:
        """x: [N, hidden], the fed tokens flattened (every B x T of them, or only the `real` ones)."""
        B, T = shape
        h, kvh, d = self.h, self.kvh, self.d
        qkv = self.qkv(self, x).view(-1, h + 2 * kvh, d)
        qk, v = qkv[:, : h + kvh], qkv[:, h + kvh:]
        if self.qk_norm:
            qk = self._qk_normed(qk)
        qk = apply_rope(qk, cos, sin)  # per token: q and k of every head at once
        if real is not None:  # back to the padded [B, T] grid for the cache and attention
            qk = qk.new_zeros(B * T, h + kvh, d).index_copy_(0, real, qk)
            v = v.new_zeros(B * T, kvh, d).index_copy_(0, real, v)
        qk = qk.view(B, T, h + kvh, d).transpose(1, 2)
        q, k = qk[:, :h], qk[:, h:]
        v = v.view(B, T, kvh, d).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=kvh != h)
        y = y.transpose(1, 2).reshape(B * T, h * d)
        if real is not None:
            y = y.index_select(0, real)
        return linear(self.o_proj, y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinears(["gate_proj", "up_proj"])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(self, x).chunk(2, dim=-1)
        return linear(self.down_proj, F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, is_causal, cache, layer, shape, real):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, layer, shape, real)
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
        self.gradient_checkpointing = False
        self.reset_rope()

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)build the RoPE frequencies and the cos / sin tables of every position (non-persistent
        buffers: they are not in checkpoints, and a model built on "meta" must call this once)."""
        inv = rope_inv_freq(self.config).to(device)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("rope", rope_table(self.config, inv), persistent=False)

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
        self.reset_rope(self.embed_tokens.weight.device)
        return self

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attn_mask: Tensor | None = None,
                cache: KVCache | None = None, num_logits: int | None = None,
                real: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] (or of the last `num_logits` tokens).

        attn_mask: None for causal in feed order (every cached entry visible), or a bool mask
        (True = may attend) / additive float mask broadcastable to [B, heads, T, len(cache) + T].
        real: the flat indices (into B x T, ascending) of the tokens whose outputs matter; the others
        are padding. Every per-token operation (embedding, projections, norms, MLP, LM head) then
        runs on the real tokens only, packed, and only attention sees the padded grid. Padding
        gets zero keys / values in the cache and zero logits. On a CPU, where a forward costs in
        proportion to the tokens it computes, this is what makes ragged batches pay.
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
        ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
        if real is not None:
            ids, pos = ids[real], pos[real]
        x = self.embed_tokens(ids)  # [N, hidden]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = additive_mask(attn_mask, x.dtype)
        rope = self.rope[pos]  # [N, 2, head_dim]
        if rope.dtype != x.dtype:
            rope = rope.to(x.dtype)
        cos, sin = rope[:, :1], rope[:, 1:]  # [N, 1, head_dim]: broadcast over heads
        for i, block in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, attn_mask, is_causal, None, i, (B, T), real, use_reentrant=False)
            else:
                x = block(x, cos, sin, attn_mask, is_causal, cache, i, (B, T), real)
        need = min(num_logits, T) if num_logits else T  # (0 meant every token before, as x[:, -0:])
        if real is None:
            return linear(self.lm_head, self.norm(x.view(B, T, -1)[:, T - need:]))
        # logits of the real tokens among each row's last `need`, zeros for padding
        col = real % T
        keep = (col >= T - need).nonzero().squeeze(1)
        dst = (real // T * need + col - (T - need))[keep]
        logits = linear(self.lm_head, self.norm(x[keep]))
        return logits.new_zeros(B * need, logits.shape[-1]).index_copy_(0, dst, logits).view(B, need, -1)
