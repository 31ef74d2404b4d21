"""The draft layout: the response in order, then a copy of it as blocks of masks that draft from in-order
prefixes (the `joint` and `decoupled` objective variants; mask-only adaptation of a pretrained LM).

Per example, fed in this order (one row of the batch):

    prompt p0..p(Lp-1) | response r0..r(Lr-1) | masks m0..m(Lr-1) | padding

- The prompt and the response are causal, with next-token labels on every response token (the
  prompt's last token predicts r0): exactly the ARM's example.
- Mask mi sits at r_i's position and is labelled r_i. The response is cut into blocks of L tokens
  (L drawn per example from slot_sizes) at a random phase, so cut points fall everywhere; a mask of
  the block starting at response index b sees the prompt, r0..r(b-1), and the masks of its own block
  up to itself. That is what `speculative` asks of its masks: draft the next L tokens from an
  in-order prefix.
- Attention is causal in feed order (a mask row only sees earlier columns, a subset of them), so
  nothing a row sees depends on a later column; no mask sees a key computed from the true token of
  any position of its block (the spec's rule, section 8).

Draws (all batched): size_idx = randint(len(slot_sizes), (B,)), then phase = rand(B) -> floor(phase * L).
"""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.training.objectives import IGNORE, Batch, TrainInputs, label_prompt_end


def draft_inputs(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32)
                 ) -> TrainInputs:
    """The draft layout of `batch` (module docstring). mask_rate is 1: the loss's mask term is then
    the mean over examples of each example's mean mask cross-entropy (refusion_loss)."""
    slot_sizes = tuple(slot_sizes)
    if not slot_sizes or any(int(s) != s or s <= 0 for s in slot_sizes):
        raise ValueError(f"slot sizes must be a non-empty list of positive integers, got {slot_sizes}")
    resp = batch.response_ids
    B, R = resp.shape
    dev = resp.device
    size_idx = torch.randint(len(slot_sizes), (B,), generator=gen, device=gen.device).to(dev)
    phase_u = torch.rand(B, generator=gen, device=gen.device).to(dev)
    L = torch.tensor(slot_sizes, dtype=torch.long, device=dev)[size_idx]  # [B]
    phase = (phase_u * L).long().clamp(max=L - 1)

    pl, rl = batch.prompt_len, batch.response_len
    T = int((pl + 2 * rl).max()) if B else 0  # the one host sync: T sets shapes
    c = torch.arange(T, device=dev)[None, :]
    pl_, rl_ = pl[:, None], rl[:, None]
    in_prompt = c < pl_
    in_resp = ~in_prompt & (c < pl_ + rl_)
    in_mask = (c >= pl_ + rl_) & (c < pl_ + 2 * rl_)
    pad = c >= pl_ + 2 * rl_
    # response index of a response or mask column (0 elsewhere)
    idx = torch.where(in_resp, c - pl_, torch.where(in_mask, c - pl_ - rl_, 0))

    def ext(x: Tensor, fill: int) -> Tensor:  # a spare column so clamped gathers stay valid when P or R is 0
        return torch.cat([x, x.new_full((B, 1), fill)], 1)

    p_tok = ext(batch.prompt_ids, batch.pad_id).gather(1, c.clamp(max=batch.prompt_ids.shape[1]).expand(B, T))
    r_tok = ext(resp, batch.pad_id).gather(1, idx.clamp(max=R))
    input_ids = torch.where(in_prompt, p_tok, torch.where(in_resp, r_tok, torch.where(in_mask, mask_id, batch.pad_id)))
    position_ids = torch.where(in_resp | in_mask, pl_ + idx, c)  # padding continues past Lp + Lr
    r_next = ext(resp, IGNORE).gather(1, (idx + 1).clamp(max=R))
    labels = torch.where(in_resp & (idx + 1 < rl_), r_next, torch.where(in_mask, r_tok, IGNORE))
    labels = label_prompt_end(labels, batch)

    # columns a row sees: every column before `visible_end` (causal rows: up to itself; a mask row:
    # the prompt and the response before its block), plus, for a mask row, its block's masks up to it
    block_start = ((idx + phase[:, None]) // L[:, None] * L[:, None] - phase[:, None]).clamp(min=0)
    visible_end = torch.where(in_mask, pl_ + block_start, c + 1)
    block = torch.where(in_mask, block_start, -1)
    q, k = c[:, :, None], c[:, None, :]  # [1, T, 1], [1, 1, T]
    attn = (k < visible_end[:, :, None]) | ((block[:, :, None] == block[:, None, :]) & in_mask[:, None, :]
                                            & in_mask[:, :, None] & (k <= q))
    attn = attn & ~pad[:, None, :]
    attn.diagonal(dim1=1, dim2=2).fill_(True)
    return TrainInputs(input_ids, position_ids, labels, in_mask, torch.ones(B, device=dev), "custom", attn[:, None],
                       pad, slot_size=L)
