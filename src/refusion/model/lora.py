"""LoRA fine-tuning: peft adapters on the chosen projections, plus trainable rows for new tokens.

A causal LM turned into a ReFusion starting point gets a <|mask|> token whose embedding (and LM-head)
row starts at the mean of the others. LoRA freezes every base weight, so that row would never
learn what a mask means. Its row is therefore a small trainable parameter of its own, swapped in by
forward hooks: the embedding output at the new tokens' positions, and the LM head's logit columns
for them. Nothing else of the embedding is trained, and the optimizer holds state for these rows
only (a whole trainable embedding would cost vocab x hidden of Adam state).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from refusion.model.transformer import Transformer

ROWS, HEAD_ROWS, IDS = "lora_token_rows", "lora_token_head_rows", "lora_token_ids"  # "lora_": saved with the adapters


def apply_lora(model: Transformer, lora: dict, new_tokens: list[int] = ()) -> None:
    """Inject LoRA adapters (peft) and make only them, and the rows of `new_tokens`, trainable."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ValueError("LoRA needs the peft package: pip install 'refusion[train]' (or pip install peft)") from None
    conf = LoraConfig(r=lora.get("r", 8), lora_alpha=lora.get("alpha", 16), lora_dropout=lora.get("dropout", 0.0),
                      target_modules=lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"]))
    inject_adapter_in_model(conf, model)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    if new_tokens:
        _train_rows(model, list(new_tokens))


def _train_rows(model: Transformer, ids: list[int]) -> None:
    w = model.embed_tokens.weight
    model.register_buffer(IDS, torch.tensor(ids, device=w.device))
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
    model's names."""
    sd = {}
    lora_layers = {n: m for n, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    for name, t in model.state_dict().items():
        if "lora_" in name:
            continue
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if owner in lora_layers and name.endswith("weight"):
            t = t + lora_layers[owner].get_delta_weight("default").to(t.dtype)
        sd[name.replace(".base_layer.", ".")] = t
    if hasattr(model, ROWS):
        ids = getattr(model, IDS)
        for key, rows in (("embed_tokens.weight", ROWS), ("lm_head.weight", HEAD_ROWS)):
            if hasattr(model, rows):
                sd[key] = sd[key].clone()
                sd[key][ids] = getattr(model, rows).detach().to(sd[key].dtype)
        if model.lm_head.weight is model.embed_tokens.weight:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
    return sd
