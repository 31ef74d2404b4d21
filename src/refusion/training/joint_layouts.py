"""Layouts that pack the ARM's example with a second view of the same response in one row, the second
view blind to the first (training/variants.py):

- draft_inputs (the `joint`, `decoupled` and `mask-only` variants): the response in order, then a copy
  of it as blocks of masks that draft from in-order prefixes; split_draft cuts it into two feeds
  (the in-order part, then the masks on top of its cache), so that a frozen model's in-order part
  runs without gradients;
- hybrid_inputs (the `hybrid` variant): the response in order, then the paper's layout of it.

The draft layout, per example, fed in this order (one row of the batch):

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

from refusion.training.objectives import (IGNORE, Batch, TrainInputs, ar_inputs, causal_attn_mask, label_prompt_end,
                                         refusion_inputs)


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


def split_draft(inputs: TrainInputs, batch: Batch) -> tuple[TrainInputs, TrainInputs]:
    """The draft layout (draft_inputs) as two feeds of one model with one cache (mask-only adaptation):

        prefix   prompt | response, causal, the response's next-token labels   [B, max(Lp + Lr)]
        masks    the mask columns, fed on top of the prefix's cached keys and   [B, max(Lr)]
                 values; attention [B, 1, max(Lr), max(Lp + Lr) + max(Lr)]

    Every mask sees exactly the columns it sees in the one-row layout, so its logits are the same
    (up to the order of floating-point sums), while the prefix can run without gradients. A row
    shorter than the longest is padded in both feeds (pad = True); a padded prefix column is
    hidden from every mask."""
    B, T = inputs.input_ids.shape
    dev = inputs.input_ids.device
    pl, rl = batch.prompt_len[:, None].to(dev), batch.response_len[:, None].to(dev)
    clean = pl + rl
    T1, T2 = (int(clean.max()), int(rl.max())) if B else (0, 0)
    c1, c2 = torch.arange(T1, device=dev)[None], torch.arange(T2, device=dev)[None]

    pad1 = c1 >= clean  # the prefix: the layout's first columns, another row's mask columns padded out
    prefix = TrainInputs(torch.where(pad1, batch.pad_id, inputs.input_ids[:, :T1]),
                         torch.where(pad1, c1, inputs.position_ids[:, :T1]),
                         torch.where(pad1, IGNORE, inputs.labels[:, :T1]), torch.zeros_like(pad1),
                         torch.ones(B, device=dev), "custom", causal_attn_mask(pad1), pad1)

    pad2 = c2 >= rl  # the masks: columns Lp + Lr + i of the layout
    cols = (clean + c2).clamp(max=max(T - 1, 0))

    def take(x: Tensor, fill) -> Tensor:
        return torch.where(pad2, fill, x.gather(1, cols))

    rows = inputs.attn_mask[:, 0].gather(1, cols[:, :, None].expand(B, T2, T))  # [B, T2, T]: the masks' rows
    sees_prefix = rows[:, :, :T1] & ~pad1[:, None, :]
    sees_masks = rows.gather(2, cols[:, None, :].expand(B, T2, T2)) & ~pad2[:, None, :]
    sees_masks.diagonal(dim1=1, dim2=2).fill_(True)  # a padded row must see something (SDPA: no all -inf row)
    masks = TrainInputs(take(inputs.input_ids, batch.pad_id), take(inputs.position_ids, 0),
                        take(inputs.labels, IGNORE), take(inputs.is_masked, False), inputs.mask_rate, "custom",
                        torch.cat([sees_prefix, sees_masks], 2)[:, None], pad2, slot_size=inputs.slot_size)
    return prefix, masks


def hybrid_inputs(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32),
                  eps: float = 1e-3) -> TrainInputs:
    """The ARM's example and the paper's layout of the same response in one row:

        prompt | response in order (next-token labels, prompt end -> r0) | the paper's clean slots in
        random order, then its masked slots (spec section 3, its labels) | padding

    The in-order part is causal; the paper's part sees the prompt and, causally, itself, never the
    in-order part (which holds its masked tokens' true values). Draws: exactly refusion_inputs's."""
    paper = refusion_inputs(batch, mask_id, gen, slot_sizes, eps)
    arm = ar_inputs(batch)
    B = arm.input_ids.shape[0]
    dev = arm.input_ids.device
    pl, rl = batch.prompt_len[:, None], batch.response_len[:, None]
    T = int((batch.prompt_len + 2 * batch.response_len).max()) if B else 0
    c = torch.arange(T, device=dev)[None, :]
    first = c < pl + rl  # prompt and in-order response: arm's columns as they are
    second = ~first & (c < pl + 2 * rl)  # the paper's response columns, which sit at pl.. in `paper`
    pad = ~first & ~second

    def ext(x: Tensor, fill) -> Tensor:  # a spare column so clamped gathers stay valid
        return torch.cat([x, x.new_full((B, 1), fill)], 1)

    a_col = c.clamp(max=arm.input_ids.shape[1]).expand(B, T)
    p_col = (c - rl).clamp(0, paper.input_ids.shape[1])

    def pick(a: Tensor, p: Tensor, fill) -> Tensor:
        return torch.where(first, ext(a, fill).gather(1, a_col), torch.where(second, ext(p, fill).gather(1, p_col), fill))

    input_ids = pick(arm.input_ids, paper.input_ids, batch.pad_id)
    position_ids = torch.where(pad, c, pick(arm.position_ids, paper.position_ids, 0))
    labels = pick(arm.labels, paper.labels, IGNORE)
    is_masked = pick(arm.is_masked, paper.is_masked, False)
    k = c[:, None, :]
    causal = k <= c[:, :, None]
    # a paper row sees the prompt and the paper part before it; an in-order row everything before it
    blind = second[:, :, None] & (k >= pl[:, :, None]) & (k < (pl + rl)[:, :, None])
    attn = causal & ~blind & ~pad[:, None, :]
    attn.diagonal(dim1=1, dim2=2).fill_(True)
    return TrainInputs(input_ids, position_ids, labels, is_masked, paper.mask_rate, "custom", attn[:, None], pad,
                       slot_size=paper.slot_size)
