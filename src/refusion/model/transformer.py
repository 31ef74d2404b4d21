"""The transformer: a decoder-only model covering Qwen3 (q/k RMSNorm) and Llama / Qwen2 (optional qkv bias).

forward(input_ids, position_ids, attn_mask=None, cache=None) -> logits

Two orders meet here, and keeping them apart is the whole ReFusion trick: attention is causal in
the order tokens are *fed*, while RoPE uses the *position ids* given with each token, which can be
in any order.

One forward serves training and inference. On a CPU a small model's forward is mostly per-call
overhead, so the work is shaped to make few calls: q/k/v is one projection (`qkv_proj`) and the
MLP's gate/up another (`gate_up_proj`), fused once when the weights are made or loaded; a block is
one module call whose forward runs its projections as F.linear; the mask and the RoPE angles are
made once per forward, not per layer. Module names are Hugging Face's (without the leading
"model.") except the two fused projections, which checkpoints store as their parts
(model/checkpoint.py: to_hf, from_hf; fused_parts says which).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from refusion.model.cache import Cache, KVCache
from refusion.model.config import ConfigError, ModelConfig
from refusion.model.mask_adapter import MaskAdapter, adapted_from
from refusion.model.packed import PACKED_DTYPES, onednn_packing, packed_linear
from refusion.model.size import parameter_count


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dimension, normalised in float32 like the reference implementations."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # one call for the same arithmetic as below (bit-identical), without its dispatch overhead
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


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


def fused_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """The projections that run as one Linear, by name, with the Hugging Face projections they
    stack by rows, as (name, rows) in row order. Checkpoints hold the parts (model/checkpoint.py),
    LoRA adapts them one by one (model/lora.py), init_weights draws them one by one."""
    q, kv, mlp = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", mlp), ("up_proj", mlp)]}


def hooked(m: nn.Module) -> bool:
    """Whether calling m runs more than its forward: hooks of its own (FSDP2's unsharding among them)
    or global ones. Blocks nobody hooks are run through `forward` directly: a small model's forward
    pays for every nn.Module.__call__."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) or _global_hooks()


def _global_hooks() -> bool:
    mod = torch.nn.modules.module
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks or mod._global_backward_hooks
                or mod._global_backward_pre_hooks or mod._global_forward_hooks_always_called)


# A model whose float32 weights are far larger than a CPU's last-level cache streams them: its
# products outside autograd run on oneDNN's packed weights (model/packed.py says why).
STREAMED_BYTES = 128 * 2**20


def linear(m: nn.Module, x: Tensor, streamed: bool = False) -> Tensor:
    """m(x), calling F.linear directly for a plain nn.Linear without hooks (a module call's overhead
    is a noticeable share of a small model's forward); anything else (an adapter) is called.
    streamed: the model's weights stream from memory (Transformer.streamed): a CPU float32 or bfloat16
    product outside autograd and autocast takes the oneDNN packed weight (packed.packed_linear)."""
    if type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks):
        p = m._parameters  # (not m.weight: see Block)
        w, b = p["weight"], p["bias"]
        if (streamed and x.is_cpu and w.dtype in PACKED_DTYPES and x.dtype == w.dtype
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and not torch.compiler.is_compiling() and onednn_packing()):
            return packed_linear(m, x)
        return F.linear(x, w, b)
    return m(x)


def attention_mask(attn_mask: Tensor | None, cache: Cache | None, T: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[Tensor | None, bool]:
    """The mask every layer's attention uses (additive, made once per forward) and whether it is SDPA's
    is_causal instead. No mask given: the cache's default (causal, see Cache.default_mask)."""
    if attn_mask is None and cache is not None:
        attn_mask = cache.default_mask(T, device)
    if attn_mask is None:
        return None, T > 1
    if attn_mask.dtype == torch.bool:
        attn_mask = additive_mask(attn_mask, dtype)
    return attn_mask, False


class Attention(nn.Module):
    """A block's attention weights: q, k and v as one projection (rows q, k, v), o, and Qwen3's
    per-head q / k norms. Block.forward runs them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gqa = cfg.num_kv_heads != cfg.num_heads  # a plain bool: SDPA takes no symbolic one under torch.compile
        rows = sum(n for _, n in fused_parts(cfg)["qkv_proj"])
        self.qkv_proj = nn.Linear(cfg.hidden_size, rows, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm


class MLP(nn.Module):
    """A block's SwiGLU weights: gate and up as one projection (rows gate, up), down. Block.forward runs them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Block(nn.Module):
    """One layer, called as one module (FSDP shards block by block, activation checkpointing wraps
    blocks): its forward is the layer's whole arithmetic, the submodules only hold the weights."""

    def __init__(self, cfg: ModelConfig, adapted: bool = False, streamed: bool = False) -> None:
        super().__init__()
        self.streamed = streamed  # the model's weights stream from memory (linear, Transformer.streamed)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if adapted:
            self.mask_adapter = MaskAdapter(cfg)

    # The forward reads submodules and parameters from nn.Module's own dicts (`_modules`,
    # `_parameters`) rather than as attributes: attribute access goes through nn.Module.__getattr__,
    # which costs about as much as one small operator, and a block reads some twenty of them.

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                cache: Cache | None, layer: int, shape: tuple[int, int], real: Tensor | None,
                qk_norm: Tensor | None = None, mask_rows: Tensor | slice | None = None) -> Tensor:
        """x: [N, hidden], the fed tokens flattened (every one of the B x T = `shape`, or only the
        `real` ones); cos, sin: [N, 1, head_dim], their RoPE angles; qk_norm: this layer's q and k
        norm weights per head (Transformer.qk_norm_weights), where the model has them; mask_rows:
        the rows of x that are mask tokens, where the block has a mask adapter."""
        m = self._modules
        ln1, ln2, mlp = m["input_layernorm"], m["post_attention_layernorm"], m["mlp"]._modules
        ad = m.get("mask_adapter") if mask_rows is not None else None
        h = rms_norm(x, ln1._parameters["weight"], ln1.eps)
        x = x + self.attention(h, cos, sin, mask, is_causal, cache, layer, shape, real, qk_norm, ad, mask_rows)
        h = rms_norm(x, ln2._parameters["weight"], ln2.eps)
        gate_up = linear(mlp["gate_up_proj"], h, self.streamed)
        if ad is not None:
            gate_up = ad.add(gate_up, "gate_up_proj", h, mask_rows)
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = linear(mlp["down_proj"], h, self.streamed)
        if ad is not None:
            y = ad.add(y, "down_proj", h, mask_rows)
        return x + y

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
                  cache: Cache | None, layer: int, shape: tuple[int, int], real: Tensor | None,
                  qk_norm: Tensor | None, ad: MaskAdapter | None = None, mask_rows: Tensor | slice | None = None) -> Tensor:
        """Self-attention of the normed tokens x [N, hidden]; returns [N, hidden]."""
        attn = self._modules["self_attn"]
        a = attn._modules
        h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = linear(a["qkv_proj"], x, self.streamed)
        if ad is not None:
            qkv = ad.add(qkv, "qkv_proj", x, mask_rows)
        qkv = qkv.view(-1, h + 2 * kvh, d)
        qk, v = qkv[:, : h + kvh], qkv[:, h + kvh:]  # q and k side by side: normed and rotated together
        if attn.qk_norm:  # q_norm(q) and k_norm(k) as one product
            qn, kn = a["q_norm"], a["k_norm"]
            if qk_norm is None:  # the weights per head, from inside the block (FSDP unshards them here)
                qk_norm = torch.cat([qn._parameters["weight"].expand(h, d), kn._parameters["weight"].expand(kvh, d)])
            qk = rms_norm(qk, None, qn.eps) * qk_norm
        qk = apply_rope(qk, cos, sin)
        B, T = shape
        if real is not None:  # back to the padded [B, T] grid for the cache and attention
            qk = qk.new_zeros(B * T, h + kvh, d).index_copy_(0, real, qk)
            v = v.new_zeros(B * T, kvh, d).index_copy_(0, real, v)
        qk = qk.view(B, T, h + kvh, d).transpose(1, 2)
        q, k = qk[:, :h], qk[:, h:]
        v = v.view(B, T, kvh, d).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=attn.gqa)
        y = y.transpose(1, 2).reshape(B * T, h * d)
        if real is not None:
            y = y.index_select(0, real)
        out = linear(a["o_proj"], y, self.streamed)
        return out if ad is None else ad.add(out, "o_proj", y, mask_rows)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # On "meta" (a model whose weights come from a file) nothing is computed: arithmetic there runs
        # torch._refs paths that import torch._dynamo, seconds of start-up for every process that loads one
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if not embed.is_meta:
            nn.init.normal_(embed)  # nn.Embedding's own initialisation: the same draws
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embed)
        first = adapted_from(cfg) if cfg.mask_adapter is not None else cfg.num_layers
        # float32 weights far larger than a CPU's caches: products take oneDNN's packed weights (linear)
        self.streamed = 4 * parameter_count(cfg) > STREAMED_BYTES
        self.layers = nn.ModuleList(Block(cfg, adapted=i >= first, streamed=self.streamed)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # the mask path's own input embedding (model/mask_adapter.py); the blocks hold its adapters
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mask_adapter is not None else None
        self.gradient_checkpointing = False
        # a refusion.model.compiled.CompiledForward, set by compiled.enable_compile: inference forwards
        # go through it first (it returns None where it does not apply)
        self.compiled = None
        self.reset_rope(embed.device)

    def set_streamed(self, on: bool) -> None:
        """Whether CPU float32 products outside autograd take oneDNN's packed weights (linear; default:
        the model's size decides)."""
        self.streamed = on
        for block in self.layers:
            block.streamed = on

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent buffers: the RoPE frequencies, the cos / sin tables of every
        position and the q/k norm rows (not in checkpoints). On "meta" they are empty, of their shapes:
        a model built there calls this again once it has weights."""
        c = self.config
        if device is not None and torch.device(device).type == "meta":  # (see __init__: no arithmetic there)
            half = (c.head_dim + 1) // 2
            self.register_buffer("inv_freq", torch.empty(half, device="meta"), persistent=False)
            self.register_buffer("rope", torch.empty(c.max_position_embeddings, 2, 2 * half, device="meta"),
                                 persistent=False)
            rows = torch.empty(c.num_layers * (c.num_heads + c.num_kv_heads), dtype=torch.long, device="meta")
            self.register_buffer("qk_norm_rows", rows, persistent=False)
            return
        inv = rope_inv_freq(c).to(device)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("rope", rope_table(c, inv), persistent=False)
        # row of every head's q / k norm weight in the stack of all layers' [q_norm, k_norm] weights
        per_layer = torch.tensor([0] * c.num_heads + [1] * c.num_kv_heads, device=inv.device)
        rows = torch.cat([per_layer + 2 * i for i in range(c.num_layers)])
        self.register_buffer("qk_norm_rows", rows, persistent=False)

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "Transformer":
        """Fresh initialisation for training from scratch (normal(0, std), unit norms, zero biases).
        A fused projection draws its parts one after another, as separate layers would."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        fused = fused_parts(self.config)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name == "mask_embedding" or ".mask_adapter." in name:
                    continue  # set below, from the table and as adapters of zero effect
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    module = name.rsplit(".", 2)[-2]
                    sizes = [n for _, n in fused[module]] if module in fused else [p.shape[0]]
                    for part in p.split(sizes):
                        part.copy_(torch.randn(part.shape, generator=gen) * std)
        if self.mask_embedding is not None:
            with torch.no_grad():
                self.mask_embedding.copy_(self.embed_tokens.weight[self.config.mask_token_id])
            for block in self.layers[adapted_from(self.config):]:
                block.mask_adapter.reset_parameters(gen)
        self.reset_rope(self.embed_tokens.weight.device)
        return self

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_layers)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attn_mask: Tensor | None = None,
                cache: Cache | None = None, num_logits: int | None = None,
                real: Tensor | None = None, states: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Logits [B, T, V] (or of the last `num_logits` tokens); with states, also the final normed
        hidden states those logits are the LM head of ([B, need, hidden]: a mask sampler's input).

        attn_mask: None for causal in feed order over every cached entry (the cache's
        `default_mask`), or a bool mask (True = may attend) / additive float mask broadcastable to
        [B, heads, T, keys], keys being what the cache's `update` returns (len(cache) + T for a
        KVCache).
        cache: where keys and values are kept (model/cache.py: the Cache protocol; a KVCache appends,
        a SlotKVCache / RaggedKVCache `.at(...)` says where this forward writes).
        real: the flat indices (into B x T, ascending) of the tokens whose outputs matter; the others
        are padding. Every per-token operation (embedding, projections, norms, MLP, LM head) then
        runs on the real tokens only, packed, and only attention sees the padded grid. Padding
        gets zero keys / values in the cache and zero logits. On a CPU, where a forward costs in
        proportion to the tokens it computes, this is what makes ragged batches pay.
        """
        B, T = input_ids.shape
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        if self.compiled is not None and not torch.is_grad_enabled() and not states:
            logits = self.compiled(input_ids, position_ids, attn_mask, cache, num_logits, real)
            if logits is not None:
                return logits
        ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
        if real is not None:
            ids, pos = ids[real], pos[real]
        x, mask_rows = self.embed(ids)
        x = self.run_blocks(x, pos, attn_mask, cache, (B, T), real, mask_rows)
        return self.logits(x, (B, T), num_logits, real, states)

    def embed(self, ids: Tensor) -> tuple[Tensor, Tensor | slice | None]:
        """The input embeddings [N, hidden] of the flat token ids [N], and which rows are mask tokens
        taking the mask path: their indices, or outside autograd on a CPU a slice where they are one
        run (None for a model without one, or, outside autograd, a feed without masks)."""
        x = self.embed_tokens(ids)
        if self.mask_embedding is None:
            return x, None
        mask_rows = (ids == self.config.mask_token_id).nonzero().squeeze(1)
        n = len(mask_rows)
        if torch.is_grad_enabled():  # (a trainer's graph keeps the adapters' products, on zero rows too)
            return x.index_copy(0, mask_rows, self.mask_embedding.to(x.dtype).expand(n, -1)), mask_rows
        if not n:
            return x, None  # (decoding: no adapter products on zero rows)
        x.index_copy_(0, mask_rows, self.mask_embedding.to(x.dtype).expand(n, -1))
        if ids.is_cpu:  # (reading two indices would wait for an accelerator)
            lo, hi = int(mask_rows[0]), int(mask_rows[-1]) + 1
            if hi - lo == n:  # one run of masks (a decode step's, one row): the adapters take views
                return x, slice(lo, hi)
        return x, mask_rows

    def run_blocks(self, x: Tensor, pos: Tensor, attn_mask: Tensor | None, cache: Cache | None,
                   shape: tuple[int, int], real: Tensor | None = None, mask_rows: Tensor | slice | None = None,
                   start: int = 0, stop: int | None = None) -> Tensor:
        """Blocks start..stop-1 on the hidden states x [N, hidden] of the tokens at positions pos [N]
        (the `shape` = (B, T) grid, or its `real` tokens); attn_mask and cache as in forward. A
        trainer that keeps some blocks' outputs runs the rest from them (training/mask_features.py)."""
        B, T = shape
        mask, is_causal = attention_mask(attn_mask, cache, T, x.dtype, x.device)
        cos, sin = self.rope_at(pos, x.dtype)
        # every layer's q/k norm weights in one gather, where the blocks hold their own parameters
        # (a hooked block, e.g. FSDP2's, may only have them inside its call: it builds its own)
        hooks = any(hooked(b) for b in self.layers)
        qk_norms = [None] * len(self.layers) if hooks else self.qk_norm_weights()
        checkpointing = self.gradient_checkpointing and self.training and cache is None
        stop = len(self.layers) if stop is None else stop
        for i in range(start, stop):
            block = self.layers[i]
            if checkpointing:
                x = checkpoint(block, x, cos, sin, mask, is_causal, None, i, (B, T), real, qk_norms[i], mask_rows,
                               use_reentrant=False)
            else:
                run = block if hooks else block.forward
                x = run(x, cos, sin, mask, is_causal, cache, i, (B, T), real, qk_norms[i], mask_rows)
        return x

    def qk_norm_weights(self) -> list[Tensor | None]:
        """Per layer, its q_norm weight for each query head and its k_norm weight for each key head
        ([heads + kv_heads, head_dim]), gathered for every layer in one operation per forward, so
        that each layer norms q and k with one product; Nones for a model without q/k norms."""
        if not self.config.qk_norm:
            return [None] * len(self.layers)
        weights = []
        for block in self.layers:
            a = block._modules["self_attn"]._modules
            weights += [a["q_norm"]._parameters["weight"], a["k_norm"]._parameters["weight"]]
        stacked = torch.stack(weights).index_select(0, self.qk_norm_rows)
        return list(stacked.view(len(self.layers), -1, self.config.head_dim).unbind(0))

    def rope_at(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin_rot (see apply_rope) of the positions pos [N], as [N, 1, head_dim] (broadcast
        over heads): one gather from the table."""
        rope = self.rope[pos]
        if rope.dtype != dtype:
            rope = rope.to(dtype)
        return rope[:, :1], rope[:, 1:]

    def logits(self, x: Tensor, shape: tuple[int, int], num_logits: int | None, real: Tensor | None,
               states: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The final norm and LM head of the last blocks' output x [N, hidden]: logits [B, need, V] of
        each row's last `need` tokens (zeros for padding), and with states the normed states too."""
        B, T = shape
        need = min(num_logits, T) if num_logits else T  # (0 meant every token before, as x[:, -0:])
        w, eps = self.norm.weight, self.norm.eps
        if real is None:
            h = rms_norm(x.view(B, T, -1)[:, T - need:], w, eps)
            logits = linear(self.lm_head, h, self.streamed)
            return (logits, h) if states else logits
        col = real % T
        keep = (col >= T - need).nonzero().squeeze(1)
        dst = (real // T * need + col - (T - need))[keep]
        h = rms_norm(x[keep], w, eps)
        logits = linear(self.lm_head, h, self.streamed)
        logits = logits.new_zeros(B * need, logits.shape[-1]).index_copy_(0, dst, logits).view(B, need, -1)
        if not states:
            return logits
        return logits, h.new_zeros(B * need, h.shape[-1]).index_copy_(0, dst, h).view(B, need, -1)
