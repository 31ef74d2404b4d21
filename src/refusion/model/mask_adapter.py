"""Mask-only adaptation: a mask embedding and low-rank updates that act on `<|mask|>` rows only.

A causal LM keeps every answer it gives when only its mask path learns: the model's forward adds
these updates to the rows whose input token is the mask (gathered by index, so no other row's
arithmetic changes by a single bit), and every other token's hidden states, keys, values and
logits are the base model's. `speculative` decoding then returns the base model's greedy output
token for token, at whatever tokens per forward the masks' drafts earn (spec section 8).

    cfg.mask_adapter = {"rank": 16, "alpha": 32}     # ModelConfig: the blocks carry a MaskAdapter
    model = Transformer(cfg)                         # adapters start at zero: nothing changes yet

"layers": N puts adapters on the top N blocks only (default: every block). Below them a mask row
computes what the base computes for the mask embedding, so with that embedding frozen the lower
blocks' mask states are fixed and a trainer can compute them once (training/mask_features.py).

Each adapted block's MaskAdapter holds, per projection (the fused q/k/v, o, the fused gate/up, down), A
[rank, in] and B [out, rank]; a mask row's projection output gains B(A(h)) * alpha / rank. B starts
at zero. The mask's input embedding is `Transformer.mask_embedding` (it replaces the embedding
table's row, which a frozen or shared table cannot learn); the LM head is the base's.

The adapters can be stored apart from the base (save_mask_adapter / attach_mask_adapter: a small
directory naming its base), or inside a full model directory (config.json's "mask_adapter").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from refusion.model.config import ConfigError, ModelConfig
from refusion.model.packed import written

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "mask_adapter.json", "mask_adapter.safetensors"
KEYS = {"rank", "alpha", "layers"}


def check_adapter_config(spec: dict) -> dict:
    """{"rank": r, "alpha": a[, "layers": n]} with defaults filled in (alpha = 2 * rank; no "layers":
    every block); ConfigError names what is wrong."""
    if not isinstance(spec, dict) or set(spec) - KEYS:
        raise ConfigError(f"mask_adapter must be a table with keys {sorted(KEYS)}, got {spec!r}")
    r = spec.get("rank", 16)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"mask_adapter.rank must be an integer >= 1, got {r!r}")
    a = spec.get("alpha", 2 * r)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
        raise ConfigError(f"mask_adapter.alpha must be a number > 0, got {a!r}")
    out = {"rank": r, "alpha": float(a)}
    if "layers" in spec:
        n = spec["layers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"mask_adapter.layers (how many top blocks carry adapters) must be an integer >= 1, "
                              f"got {n!r}")
        out["layers"] = n
    return out


def adapted_from(cfg: ModelConfig) -> int:
    """The first block that carries a mask adapter (blocks from it to the last do)."""
    n = check_adapter_config(cfg.mask_adapter).get("layers", cfg.num_layers)
    if n > cfg.num_layers:
        raise ConfigError(f"mask_adapter.layers is {n} but the model has {cfg.num_layers} blocks")
    return cfg.num_layers - n


def projections(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The adapted projections of a block, by module name: (in features, out features)."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, h)}


class MaskAdapter(nn.Module):
    """One block's low-rank updates for mask rows (parameters `<proj>_A`, `<proj>_B`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        spec = check_adapter_config(cfg.mask_adapter)
        r = spec["rank"]
        self.scale = spec["alpha"] / r
        for name, (fan_in, fan_out) in projections(cfg).items():
            self.register_parameter(f"{name}_A", nn.Parameter(torch.empty(r, fan_in)))
            self.register_parameter(f"{name}_B", nn.Parameter(torch.zeros(fan_out, r)))
        self.reset_parameters()

    def reset_parameters(self, gen: torch.Generator | None = None) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (nn.Linear's initialisation), B = 0: a fresh adapter changes nothing."""
        with torch.no_grad():
            for name, p in self._parameters.items():
                if p.is_meta:  # nothing to draw; torch.rand on "meta" would import torch._dynamo (seconds)
                    continue
                if name.endswith("_A"):
                    bound = 1 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
                else:
                    p.zero_()

    def add(self, y: Tensor, name: str, x: Tensor, rows: Tensor | slice) -> Tensor:
        """y (a projection's output, [N, out]) with the update of the mask rows `rows` added; x is
        that projection's input [N, in]. rows: their indices, or outside autograd a slice where they
        are contiguous (Transformer.embed). Other rows are returned untouched. Outside autograd y
        itself is updated (callers pass a projection's fresh output)."""
        grad = torch.is_grad_enabled()
        if not grad and not torch.compiler.is_compiling():  # (a graph keeps no Python-side weights)
            at, bt = self.product_weights(name, x.dtype)
            if isinstance(rows, slice):  # (views, not a gather and a scatter: a decode step's masks are one run)
                y[rows].addmm_(torch.mm(x[rows], at), bt)
                return y
            return y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), at), bt))
        p = self._parameters
        a, b = p[f"{name}_A"], p[f"{name}_B"]
        if a.dtype != x.dtype:
            a, b = a.to(x.dtype), b.to(x.dtype)
        delta = F.linear(F.linear(x.index_select(0, rows), a), b)
        return y.index_add(0, rows, delta, alpha=self.scale) if grad else y.index_add_(0, rows, delta, alpha=self.scale)

    def product_weights(self, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A transposed and B transposed times the scale, contiguous, in `dtype`: what a decode step
        multiplies by (two plain products per projection; the adapters run four times per block on a
        row or a few, so their operator count is what they cost). Made again whenever A or B has
        changed since (packed.written: another tensor or an in-place write)."""
        p = self._parameters
        a, b = p[f"{name}_A"], p[f"{name}_B"]
        key = (written(a), written(b), dtype)
        made = self.__dict__.setdefault("_product_weights", {})
        got = made.get(name)
        if got is None or got[0] != key:
            with torch.no_grad():
                got = made[name] = (key, a.detach().t().to(dtype).contiguous(),
                                    (b.detach() * self.scale).t().to(dtype).contiguous())
        return got[1], got[2]


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The mask path's own parameters (embedding and adapters), by name."""
    return [(n, p) for n, p in model.named_parameters() if n == "mask_embedding" or ".mask_adapter." in n]


def is_adapter_name(name: str) -> bool:
    return name == "mask_embedding" or ".mask_adapter." in name


def add_mask_adapter(model: nn.Module, spec: dict, gen: torch.Generator | None = None) -> None:
    """Give `model` (a Transformer with a mask token) a fresh mask path: the embedding starts at the
    table's mask row, the adapters at zero effect. Changes nothing any token computes yet."""
    cfg = model.config
    if cfg.mask_token_id is None:
        raise ConfigError("mask-only adaptation needs a mask token: add one first (refusion add-mask-token)")
    if cfg.mask_adapter is not None:
        raise ConfigError("this model already has a mask adapter")
    cfg.mask_adapter = check_adapter_config(spec)
    cfg.causal_first_token = True  # the base's causal path answers: its first token too
    w = model.embed_tokens.weight
    model.mask_embedding = nn.Parameter(w.detach()[cfg.mask_token_id].clone())
    for block in model.layers[adapted_from(cfg):]:
        block.mask_adapter = MaskAdapter(cfg).to(device=w.device, dtype=w.dtype)
        block.mask_adapter.reset_parameters(gen)


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in adapter_parameters(model)}


def save_mask_adapter(model: nn.Module, path: str | Path, base: str, dtype: torch.dtype | None = None) -> Path:
    """Write the mask path alone (ADAPTER_WEIGHTS + ADAPTER_CONFIG, which names `base`: a model
    directory or a name `refusion` resolves) into the directory `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype else v) for k, v in adapter_state_dict(model).items()}
    save_file(sd, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = model.config
    meta = {"base": base, "mask_token_id": cfg.mask_token_id, "vocab_size": cfg.vocab_size, **cfg.mask_adapter}
    (path / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2))
    return path


def read_adapter_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path / ADAPTER_CONFIG} is not a readable mask adapter config: {e}") from None
    if not isinstance(meta, dict) or "base" not in meta:
        raise ConfigError(f"{path / ADAPTER_CONFIG} names no base model (\"base\")")
    return meta


def attach_mask_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the mask path saved at `path` onto `model`, its base (checked: same vocabulary and mask token)."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_adapter_config(path)
    cfg = model.config
    if cfg.mask_token_id != meta.get("mask_token_id") or cfg.vocab_size != meta.get("vocab_size"):
        raise ConfigError(f"{path}: the adapter was made for a base with vocab_size {meta.get('vocab_size')} and "
                          f"mask_token_id {meta.get('mask_token_id')}; this model has {cfg.vocab_size} and "
                          f"{cfg.mask_token_id}")
    add_mask_adapter(model, {k: meta[k] for k in KEYS if k in meta})
    sd = load_file(str(path / ADAPTER_WEIGHTS))
    own = dict(adapter_parameters(model))
    if set(sd) != set(own):
        raise ConfigError(f"{path / ADAPTER_WEIGHTS} does not hold this model's adapter tensors "
                          f"(missing {sorted(set(own) - set(sd))[:3]}, unexpected {sorted(set(sd) - set(own))[:3]})")
    with torch.no_grad():
        for k, p in own.items():
            if sd[k].shape != p.shape:
                raise ConfigError(f"{path}: {k} has shape {tuple(sd[k].shape)}, the model needs {tuple(p.shape)}")
            p.copy_(sd[k])
    return model
