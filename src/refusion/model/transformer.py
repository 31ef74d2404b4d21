"""The transformer: a decoder-only model covering Qwen3 (q/k RMSNorm) and Llama / Qwen2 (optional qkv bias).

forward(input_ids, position_ids, attn_mask=None, cache=None) -> logits

Two orders meet here, and keeping them apart is the whole ReFusion trick: attention is causal in
the order tokens are *fed*, while RoPE uses the *position ids* given with each token, which can be
in any order. Module names mirror Hugging Face's (without the leading "model.") so checkpoints map
one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from refusion.model.cache import KVCache
from refusion.model.config import ConfigError, ModelConfig


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


def linear(m: nn.Module, x: Tensor) -> Tensor:
    """m(x), calling F.linear directly for a plain nn.Linear without hooks (a module call's overhead
    is a noticeable share of a small model's forward); anything else (an adapter) is called."""
    if type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks):
        return F.linear(x, m.weight, m.bias)
    return m(x)


def attend(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, is_causal: bool,
           cache: KVCache | None, layer: int, B: int, T: int, real: Tensor | None, heads: int, kvh: int,
           gqa: bool) -> Tensor:
    """Attention of the fed tokens, from their normed q and k ([N, heads + kv_heads, d], side by side)
    and v ([N, kv_heads, d]); returns [N, heads * d]. Shared by the module and inference paths.
    gqa (kvh != heads) comes as a plain bool: under torch.compile with dynamic sizes the head counts
    are symbols, and SDPA takes no symbolic bool."""
    d = v.shape[2]
    qk = apply_rope(qk, cos, sin)  # per token: q and k of every head at once
    if real is not None:  # back to the padded [B, T] grid for the cache and attention
        qk = qk.new_zeros(B * T, heads + kvh, d).index_copy_(0, real, qk)
        v = v.new_zeros(B * T, kvh, d).index_copy_(0, real, v)
    qk = qk.view(B, T, heads + kvh, d).transpose(1, 2)
    q, k = qk[:, :heads], qk[:, heads:]
    v = v.view(B, T, kvh, d).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(layer, k, v)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
    y = y.transpose(1, 2).reshape(B * T, heads * d)
    return y if real is None else y.index_select(0, real)


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
                cache: KVCache | None, layer: int, shape: tuple[int, int], real: Tensor | None) -> Tensor:
        """x: [N, hidden], the fed tokens flattened (every B x T of them, or only the `real` ones)."""
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.h, self.d)
        k = self.k_proj(x).view(N, self.kvh, self.d)
        v = self.v_proj(x).view(N, self.kvh, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        y = attend(torch.cat([q, k], dim=1), v, cos, sin, mask, is_causal, cache, layer, *shape, real, self.h, self.kvh,
                   self.kvh != self.h)
        return self.o_proj(y)


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

    def forward(self, x, cos, sin, mask, is_causal, cache, layer, shape, real):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, layer, shape, real)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- the inference path ---------------------------------------------------------------------------
#
# Without gradients, the blocks run as one function over plain tensors instead of as modules: a
# small model's forward is mostly per-call overhead (Python, module calls, dispatch), not arithmetic.
# q/k/v and gate/up become one matrix product each. Their stacked weights are the storage: each
# layer's weight (and bias) is re-pointed (`param.data`) to a row block of the stack, so the layers
# keep their names in state_dict (a checkpoint stays an ordinary Hugging Face one), an in-place update
# of a layer (optimizer step, load_state_dict, copy_) is an update of the stack, and nothing is stored
# twice. Every forward checks that each block still holds the same plain modules without hooks and
# the same storage (model.to() and load_state_dict(assign=True) replace it); otherwise the tensors
# are gathered again, or, with an adapter (LoRA) or a hook on a layer, the modules run.


@dataclass
class BlockWeights:
    """One block's tensors as the inference path reads them."""

    eps: float
    gqa: bool  # fewer key/value heads than query heads
    ln1: Tensor
    qkv: Tensor  # q_proj, k_proj and v_proj stacked by rows; their weights are views of it
    qkv_bias: Tensor | None
    qk_norm: Tensor | None  # [heads + kv_heads, d]: q_norm's weight for each query head, then k_norm's
    o: Tensor
    o_bias: Tensor | None
    ln2: Tensor
    gate_up: Tensor  # gate_proj and up_proj stacked likewise
    down: Tensor


def stack_linears(parts: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) for several linear layers on the same input, the layers' own parameters
    re-pointed to row blocks of it."""
    sizes = [m.out_features for m in parts]
    # outside inference mode: the stack becomes the parameters' storage, which training may use later
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight for m in parts])
        for m, w in zip(parts, weight.split(sizes)):
            m.weight.data = w
        bias = None
        if parts[0].bias is not None:
            bias = torch.cat([m.bias for m in parts])
            for m, b in zip(parts, bias.split(sizes)):
                m.bias.data = b
    return weight, bias


def _block_parts(block: nn.Module) -> list[nn.Module] | None:
    """The modules the inference path replaces, in a fixed order, or None when one is not the plain
    module (an adapter) or has hooks (which the modules' own calls would run)."""
    if type(block) is not Block:
        return None
    attn, mlp = block._modules["self_attn"], block._modules["mlp"]
    if type(attn) is not Attention or type(mlp) is not MLP:
        return None
    am, mm = attn._modules, mlp._modules
    parts = [block._modules["input_layernorm"], block._modules["post_attention_layernorm"],
             am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"], mm["gate_proj"], mm["up_proj"], mm["down_proj"]]
    if attn.qk_norm:
        parts += [am["q_norm"], am["k_norm"]]
    for m in (block, attn, mlp, *parts):
        if m._forward_hooks or m._forward_pre_hooks:
            return None
    for m in parts[:2] + parts[9:]:
        if type(m) is not RMSNorm:
            return None
    for m in parts[2:9]:
        if type(m) is not nn.Linear:
            return None
    return parts


def _gather(block: Block, parts: list[nn.Module]) -> BlockWeights:
    ln1, ln2, q, k, v, o, gate, up, down = parts[:9]
    attn = block.self_attn
    qkv, qkv_bias = stack_linears([q, k, v])
    gate_up, _ = stack_linears([gate, up])
    qk_norm = None
    if attn.qk_norm:
        qn, kn = parts[9:]
        with torch.inference_mode(False), torch.no_grad():
            qk_norm = torch.cat([qn.weight.expand(attn.h, -1), kn.weight.expand(attn.kvh, -1)])
    return BlockWeights(eps=ln1.eps, gqa=attn.kvh != attn.h, ln1=ln1.weight, qkv=qkv, qkv_bias=qkv_bias, qk_norm=qk_norm, o=o.weight,
                        o_bias=o.bias, ln2=ln2.weight, gate_up=gate_up, down=down.weight)


class Watch:
    """What the gathered tensors depend on, checked before every inference forward in a few
    microseconds: each block's modules are the same objects in the same places, without hooks;
    their parameters are the same objects on the same storage; and the q/k norms were not changed in
    place (their stacked weight is a copy)."""

    def __init__(self, blocks: list[nn.Module], parts: list[list[nn.Module]]) -> None:
        self.places: list[tuple[dict, str, object]] = []
        for block in blocks:
            for owner in (block, block._modules["self_attn"], block._modules["mlp"]):
                self.places += [(owner._modules, k, m) for k, m in owner._modules.items()]
        self.places += [(m._parameters, k, p) for ps in parts for m in ps for k, p in m._parameters.items()]
        self.hooks = [d for block in blocks for m in block.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.params = [p for ps in parts for m in ps for p in m._parameters.values() if p is not None]
        self.ptrs = [p.data_ptr() for p in self.params]
        self.norms = [m.weight for ps in parts for m in ps[9:]]
        self.versions = [_version(w) for w in self.norms]

    def holds(self) -> bool:
        for d, k, o in self.places:
            if d.get(k) is not o:
                return False
        for h in self.hooks:
            if h:
                return False
        return [p.data_ptr() for p in self.params] == self.ptrs and [_version(w) for w in self.norms] == self.versions


def _version(t: Tensor) -> int:
    # tensors made under inference_mode keep no version counter (and cannot be changed outside it)
    return 0 if t.is_inference() else t._version


def block_inference(x: Tensor, w: BlockWeights, heads: int, kv_heads: int, cos: Tensor, sin: Tensor,
                    mask: Tensor | None, is_causal: bool, cache: KVCache | None, layer: int, B: int, T: int,
                    real: Tensor | None) -> Tensor:
    """Block.forward's arithmetic over plain tensors (the same products, to the bit)."""
    d = w.qkv.shape[0] // (heads + 2 * kv_heads)
    qkv = F.linear(rms_norm(x, w.ln1, w.eps), w.qkv, w.qkv_bias).view(-1, heads + 2 * kv_heads, d)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads:]
    if w.qk_norm is not None:
        qk = rms_norm(qk, None, w.eps) * w.qk_norm
    y = attend(qk, v, cos, sin, mask, is_causal, cache, layer, B, T, real, heads, kv_heads, w.gqa)
    x = x + F.linear(y, w.o, w.o_bias)
    gate, up = F.linear(rms_norm(x, w.ln2, w.eps), w.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.down)


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
        self.compiled = None  # a refusion.compiled.CompiledForward once enable_compile() was called
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

    def enable_compile(self, on: bool = True, **options):
        """Inference forwards through torch.compile'd graphs where a shape bucket fits, eager
        elsewhere (refusion.compiled: what is compiled, when it falls back, and why it is off by
        default: not bit-identical to eager). Returns the CompiledForward (its .stats count graphs,
        compile seconds and recompiles), or None when turned off."""
        from refusion.model.compiled import CompiledForward

        self.compiled = CompiledForward(self, **options) if on else None
        return self.compiled

    def _inference_weights(self) -> list[BlockWeights] | None:
        """Every block's tensors for the inference path (gathered again when a block's modules or
        storage changed), or None when some block must run as modules."""
        cached = self.__dict__.get("_inference_cache")
        if cached is not None and cached[0].holds():
            return cached[1]
        parts = [_block_parts(b) for b in self.layers]
        if any(p is None for p in parts):
            return None
        weights = [_gather(b, p) for b, p in zip(self.layers, parts)]
        # stacking re-pointed the projections' storage: the watch is set up after it
        self.__dict__["_inference_cache"] = (Watch(list(self.layers), parts), weights)
        return weights

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
        if self.compiled is not None and not torch.is_grad_enabled():
            out = self.compiled(input_ids, position_ids, attn_mask, cache, num_logits, real)
            if out is not None:
                return out
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
        fast = None if torch.is_grad_enabled() else self._inference_weights()
        for i, block in enumerate(self.layers):
            if fast is not None:
                x = block_inference(x, fast[i], self.config.num_heads, self.config.num_kv_heads, cos, sin, attn_mask,
                                    is_causal, cache, i, B, T, real)
            elif self.gradient_checkpointing and self.training and cache is None:
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
