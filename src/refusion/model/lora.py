"""LoRA fine-tuning: low-rank adapters on the chosen projections, plus trainable rows for new tokens.

Targets are named as in Hugging Face models (q_proj, v_proj, gate_proj, ...), and each means that
projection alone, although q, k and v run as one fused Linear here (and gate / up as another): a
LoRA wraps the Linear and adds one low-rank update per adapted part, to that part's rows of the
output (transformer.fused_parts says which rows). peft cannot do that: it adapts whole modules.

A causal LM turned into a ReFusion starting point gets a <|mask|> token whose embedding (and LM-head)
row starts at the mean of the others. LoRA freezes every base weight, so that row would never
learn what a mask means. Its row is therefore a small trainable parameter of its own, swapped in by
forward hooks: the embedding output at the new tokens' positions, and the LM head's logit columns
for them. Nothing else of the embedding is trained, and the optimizer holds state for these rows
only (a whole trainable embedding would cost vocab x hidden of Adam state).

Every trainable name contains "lora_": that is how training saves, restores and selects them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from refusion.model.transformer import Transformer, fused_parts

ROWS, HEAD_ROWS, IDS = "lora_token_rows", "lora_token_head_rows", "lora_token_ids"  # "lora_": saved with the adapters
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class LoRA(nn.Module):
    """A frozen Linear (`base`) plus, per adapted part, B(A(dropout(x))) * alpha / r added to that
    part's output rows. B starts at zero, so a fresh adapter changes nothing."""

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], r: int, alpha: float,
                 dropout: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.base = base
        self.parts = parts  # part name -> (first row, end row) of the base's output
        kw = dict(device=device or base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.ModuleDict({p: nn.Linear(base.in_features, r, bias=False, **kw) for p in parts})
        self.lora_B = nn.ModuleDict({p: nn.Linear(r, hi - lo, bias=False, **kw) for p, (lo, hi) in parts.items()})
        for p in parts:
            nn.init.kaiming_uniform_(self.lora_A[p].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[p].weight)
        self.scale = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        h = self.dropout(x)
        for p, (lo, hi) in self.parts.items():
            # in place is safe: a linear layer's backward needs its input and weight, not its output
            y[..., lo:hi] += self.lora_B[p](self.lora_A[p](h)) * self.scale
        return y

    def delta_weight(self) -> Tensor:
        """What the adapters add to base.weight (zero rows where no part is adapted)."""
        delta = torch.zeros_like(self.base.weight)
        for p, (lo, hi) in self.parts.items():
            delta[lo:hi] = (self.lora_B[p].weight @ self.lora_A[p].weight) * self.scale
        return delta


def _targets(model: Transformer, names: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """Module name (within a block) -> the parts to adapt, each with its output rows."""
    fused = fused_parts(model.config)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for module, parts in fused.items():
        row = 0
        for part, rows in parts:
            if part in names:
                out.setdefault(module, {})[part] = (row, row + rows)
            row += rows
    block = model.layers[0]
    for name in names:
        if not any(name in parts for parts in out.values()):
            linear = next((m for n, m in block.named_modules() if n.rsplit(".", 1)[-1] == name), None)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"LoRA target {name!r} is not a projection of this model")
            out[name] = {name: (0, linear.out_features)}
    return out


def apply_lora(model: Transformer, lora: dict, new_tokens: list[int] = (),
               device: torch.device | str | None = None) -> None:
    """Wrap the targeted projections of every block in LoRA adapters and make only them, and the rows
    of `new_tokens`, trainable. lora: r, alpha, dropout, target_modules (Hugging Face names).
    device: where the adapters (and the new tokens' ids) are made, by default the base weights'
    device; a model on the meta device can thus get adapters with their initial values, the same
    as on a real one (the new tokens' rows stay on the base's device: they copy its rows)."""
    targets = _targets(model, lora.get("target_modules", DEFAULT_TARGETS))
    r, alpha, dropout = lora.get("r", 8), lora.get("alpha", 16), lora.get("dropout", 0.0)
    for block in model.layers:
        for owner in (block.self_attn, block.mlp):
            for name, parts in targets.items():
                if isinstance(getattr(owner, name, None), nn.Linear):
                    setattr(owner, name, LoRA(getattr(owner, name), parts, r, alpha, dropout, device))
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    if new_tokens:
        _train_rows(model, list(new_tokens), device)


def base_name(name: str) -> str:
    """The plain model's name of a LoRA-wrapped parameter (`...qkv_proj.base.weight` ->
    `...qkv_proj.weight`); other names as they are."""
    return name.replace(".base.", ".")


def _train_rows(model: Transformer, ids: list[int], device: torch.device | str | None = None) -> None:
    w = model.embed_tokens.weight
    model.register_buffer(IDS, torch.tensor(ids, device=device or w.device))
    setattr(model, ROWS, nn.Parameter(w.detach()[ids].clone()))
    tied = model.lm_head.weight is w
    if not tied:
        setattr(model, HEAD_ROWS, nn.Parameter(model.lm_head.weight.detach()[ids].clone()))

    def embed_hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
        # no data-dependent branch (no host sync): positions of other tokens get out * 1 + 0
        hit = (inputs[0][..., None] == getattr(model, IDS)).to(out.dtype)  # [B, T, n]
        rows = getattr(model, ROWS).to(out.dtype)
        return out * (1 - hit.sum(-1, keepdim=True)) + hit @ rows

    def head_hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
        rows = getattr(model, ROWS if tied else HEAD_ROWS)
        # in place is safe: a linear layer's backward needs its input and weight, not its output
        return out.index_copy_(-1, getattr(model, IDS), (inputs[0] @ rows.T.to(inputs[0].dtype)).to(out.dtype))

    model.embed_tokens.register_forward_hook(embed_hook)
    model.lm_head.register_forward_hook(head_hook)


def merged_state_dict(model: Transformer) -> dict[str, Tensor]:
    """The model's weights with any LoRA adapters and trained token rows folded in, under the plain
    model's names (load them into a Transformer of the same config)."""
    sd = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    for name, m in model.named_modules():
        if isinstance(m, LoRA):
            sd[f"{name}.weight"] = sd.pop(f"{name}.base.weight") + m.delta_weight().detach().to(m.base.weight.dtype)
            if f"{name}.base.bias" in sd:
                sd[f"{name}.bias"] = sd.pop(f"{name}.base.bias")
    if hasattr(model, ROWS):
        ids = getattr(model, IDS)
        for key, rows in (("embed_tokens.weight", ROWS), ("lm_head.weight", HEAD_ROWS)):
            if hasattr(model, rows):
                sd[key] = sd[key].clone()
                sd[key][ids] = getattr(model, rows).detach().to(sd[key].dtype)
        if model.lm_head.weight is model.embed_tokens.weight:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
    return sd
