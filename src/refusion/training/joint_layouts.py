"""Layouts that pack the ARM's example with a second view of the same response in one row, the second
view blind to the first (training/variants.py):

- draft_inputs (the `joint` variant): the response in order, then a copy of it as blocks of masks
  that draft from in-order prefixes; draft_masks, the same masks as a feed on top of the in-order
  example's cache (the `decoupled` and `mask-only` variants: the in-order part then runs once
  without a graph, and only the masks are back-propagated);
- hybrid_inputs (the `hybrid` variant): the response in order, then the paper's layout of it;
- joint_hybrid_inputs (the `joint-hybrid` variant): the draft layout, then the paper's layout of the
  response, blind to both (in-order drafting and out-of-order slots, what plan-and-infill asks).

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

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from refusion.training.objectives import (IGNORE, Batch, TrainInputs, ar_inputs, label_prompt_end,
                                         refusion_inputs)


def draft_blocks(batch: Batch, gen: torch.Generator, slot_sizes: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The draft layout's draws: per example a block size L (from slot_sizes) and a phase in [0, L),
    as [B, 1] tensors; response index i then lies in the block starting at ((i + phase) // L) * L - phase."""
    slot_sizes = tuple(slot_sizes)
    if not slot_sizes or any(int(s) != s or s <= 0 for s in slot_sizes):
        raise ValueError(f"slot sizes must be a non-empty list of positive integers, got {slot_sizes}")
    B, dev = batch.response_ids.shape[0], batch.response_ids.device
    size_idx = torch.randint(len(slot_sizes), (B,), generator=gen, device=gen.device).to(dev)
    phase_u = torch.rand(B, generator=gen, device=gen.device).to(dev)
    L = torch.tensor(slot_sizes, dtype=torch.long, device=dev)[size_idx][:, None]
    return L, (phase_u[:, None] * L).long().clamp(max=L - 1)


def draft_inputs(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32)
                 ) -> TrainInputs:
    """The draft layout of `batch` (module docstring). mask_rate is 1: the loss's mask term is then
    the mean over examples of each example's mean mask cross-entropy (refusion_loss)."""
    L, phase = draft_blocks(batch, gen, slot_sizes)
    resp = batch.response_ids
    B, R = resp.shape
    dev = resp.device

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
    block_start = ((idx + phase) // L * L - phase).clamp(min=0)
    visible_end = torch.where(in_mask, pl_ + block_start, c + 1)
    block = torch.where(in_mask, block_start, -1)
    q, k = c[:, :, None], c[:, None, :]  # [1, T, 1], [1, 1, T]
    attn = (k < visible_end[:, :, None]) | ((block[:, :, None] == block[:, None, :]) & in_mask[:, None, :]
                                            & in_mask[:, :, None] & (k <= q))
    attn = attn & ~pad[:, None, :]
    attn.diagonal(dim1=1, dim2=2).fill_(True)
    return TrainInputs(input_ids, position_ids, labels, in_mask, torch.ones(B, device=dev), "custom", attn[:, None],
                       pad, slot_size=L[:, 0])


class _Joined(NamedTuple):
    """Columns of a row that holds `front`'s columns (prompt and `views` copies of the response) and
    then the paper's response columns; c [1, T] the column index."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    is_masked: Tensor
    c: Tensor
    first: Tensor
    second: Tensor
    pad: Tensor


def _then_paper(front: TrainInputs, paper: TrainInputs, batch: Batch, views: int) -> _Joined:
    """front's columns as they are (prompt + `views` * response long), then the paper's response
    columns (which sit at prompt_len.. in `paper`), then padding."""
    B = front.input_ids.shape[0]
    dev = front.input_ids.device
    pl, rl = batch.prompt_len[:, None], batch.response_len[:, None]
    T = int((batch.prompt_len + (views + 1) * batch.response_len).max()) if B else 0
    c = torch.arange(T, device=dev)[None, :]
    first = c < pl + views * rl
    second = ~first & (c < pl + (views + 1) * rl)
    pad = ~first & ~second

    def ext(x: Tensor, fill) -> Tensor:  # a spare column so clamped gathers stay valid
        return torch.cat([x, x.new_full((B, 1), fill)], 1)

    f_col = c.clamp(max=front.input_ids.shape[1]).expand(B, T)
    p_col = (c - views * rl).clamp(0, paper.input_ids.shape[1])

    def pick(f: Tensor, p: Tensor, fill) -> Tensor:
        return torch.where(first, ext(f, fill).gather(1, f_col), torch.where(second, ext(p, fill).gather(1, p_col), fill))

    input_ids = pick(front.input_ids, paper.input_ids, batch.pad_id)
    position_ids = torch.where(pad, c, pick(front.position_ids, paper.position_ids, 0))
    return _Joined(input_ids, position_ids, pick(front.labels, paper.labels, IGNORE),
                   pick(front.is_masked, paper.is_masked, False), c, first, second, pad)


def hybrid_inputs(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32),
                  eps: float = 1e-3) -> TrainInputs:
    """The ARM's example and the paper's layout of the same response in one row:

        prompt | response in order (next-token labels, prompt end -> r0) | the paper's clean slots in
        random order, then its masked slots (spec section 3, its labels) | padding

    The in-order part is causal; the paper's part sees the prompt and, causally, itself, never the
    in-order part (which holds its masked tokens' true values). Draws: exactly refusion_inputs's."""
    paper = refusion_inputs(batch, mask_id, gen, slot_sizes, eps)
    j = _then_paper(ar_inputs(batch), paper, batch, views=1)
    input_ids, position_ids, labels, is_masked, c, first, second, pad = j
    pl, rl = batch.prompt_len[:, None], batch.response_len[:, None]
    k = c[:, None, :]
    causal = k <= c[:, :, None]
    # a paper row sees the prompt and the paper part before it; an in-order row everything before it
    blind = second[:, :, None] & (k >= pl[:, :, None]) & (k < (pl + rl)[:, :, None])
    attn = causal & ~blind & ~pad[:, None, :]
    attn.diagonal(dim1=1, dim2=2).fill_(True)
    return TrainInputs(input_ids, position_ids, labels, is_masked, paper.mask_rate, "custom", attn[:, None], pad,
                       slot_size=paper.slot_size)


def joint_hybrid_inputs(batch: Batch, mask_id: int, gen: torch.Generator,
                        slot_sizes: tuple[int, ...] = (4, 8, 16, 32), eps: float = 1e-3) -> TrainInputs:
    """The draft layout and the paper's layout of the same response in one row:

        prompt | response in order (next-token labels) | its blocks of masks (draft_inputs) | the paper's
        clean slots in random order, then its masked slots (spec section 3) | padding

    The first three parts are draft_inputs's row as it is; the paper's part sees the prompt and,
    causally, itself, never the in-order response or the masks. Its masks' loss is divided by the
    paper's p, the draft masks' by 1, so mask_rate is per column: the MDM term is the joint variant's
    mask term plus the paper's. Draws: draft_inputs's, then refusion_inputs's."""
    draft = draft_inputs(batch, mask_id, gen, slot_sizes)
    paper = refusion_inputs(batch, mask_id, gen, slot_sizes, eps)
    input_ids, position_ids, labels, is_masked, c, first, second, pad = _then_paper(draft, paper, batch, views=2)
    B, T = input_ids.shape
    T1 = draft.input_ids.shape[1]
    dev = input_ids.device
    pl = batch.prompt_len[:, None]
    mask_rate = torch.where(second, paper.mask_rate[:, None], torch.ones((), device=dev))
    # draft rows: draft_inputs's attention (its padding columns, the paper's here, are already hidden);
    # paper rows: the prompt and the paper's part before them
    attn = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
    attn[:, :T1, :T1] = draft.attn_mask[:, 0]
    k = c[:, None, :]
    paper_rows = (k < pl[:, :, None]) | (second[:, None, :] & (k <= c[:, :, None]))
    attn = torch.where(second[:, :, None], paper_rows, attn & first[:, :, None]) & ~pad[:, None, :]
    attn.diagonal(dim1=1, dim2=2).fill_(True)
    return TrainInputs(input_ids, position_ids, labels, is_masked, mask_rate, "custom", attn[:, None], pad,
                       slot_size=paper.slot_size)


@dataclass
class DraftMasks:
    """The draft layout's masks alone, fed on top of the cache of the in-order example (ar_inputs):
    what a pass that trains only the mask path needs (the `decoupled` variant, mask-only adaptation).
    The clean tokens' forward then runs once, without a graph, and the backward covers the mask rows.

    All [B, M] with M the longest response; mask i of a row sits at its response token i's position.
    A mask sees the cache's columns before `visible_end` (the prompt and the response before its
    block) and the masks of its own `block` up to itself."""

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    valid: Tensor  # a mask (True) or padding
    visible_end: Tensor
    block: Tensor

    def rows(self, lo: int, hi: int) -> "DraftMasks":
        """Rows lo:hi, cut to their longest response."""
        M = int(self.valid[lo:hi].sum(1).max()) if hi > lo else 0
        return DraftMasks(*(getattr(self, f.name)[lo:hi, :M] for f in fields(self)))

    def to(self, device) -> "DraftMasks":
        return DraftMasks(*(getattr(self, f.name).to(device) for f in fields(self)))

    def attn_mask(self, cached: int) -> Tensor:
        """[B, 1, M, cached + M] bool over the cache's `cached` columns then the masks."""
        B, M = self.input_ids.shape
        k = torch.arange(cached, device=self.input_ids.device)
        clean = k[None, None, :] < self.visible_end[:, :, None]
        i = torch.arange(M, device=self.input_ids.device)
        own = (self.block[:, :, None] == self.block[:, None, :]) & (i[None, None, :] <= i[None, :, None])
        own = own & self.valid[:, None, :] | torch.eye(M, dtype=torch.bool, device=own.device)
        return torch.cat([clean, own], 2)[:, None]


def draft_masks(batch: Batch, mask_id: int, gen: torch.Generator, slot_sizes: tuple[int, ...] = (4, 8, 16, 32)
                ) -> DraftMasks:
    """The masks of draft_inputs (the same draws, so the same blocks) as a feed after the cache of
    ar_inputs(batch)."""
    L, phase = draft_blocks(batch, gen, slot_sizes)
    resp = batch.response_ids
    i = torch.arange(resp.shape[1], device=resp.device)[None, :]
    valid = i < batch.response_len[:, None]
    block = ((i + phase) // L * L - phase).clamp(min=0)
    pl = batch.prompt_len[:, None]
    return DraftMasks(torch.where(valid, mask_id, batch.pad_id), torch.where(valid, pl + i, 0),
                      torch.where(valid, resp, IGNORE), valid, torch.where(valid, pl + block, 0),
                      torch.where(valid, block, -1))


def base_distribution(logits: Tensor, prompt_len: Tensor, valid: Tensor) -> Tensor:
    """The in-order pass's next-token distributions [B, M, V] (float32) at the masks' positions: mask i
    of a row sits at response token i, which column prompt_len + i - 1 predicts; zeros where not valid."""
    B, M = valid.shape
    col = prompt_len[:, None] - 1 + torch.arange(M, device=valid.device)[None, :]
    col = torch.where(valid, col, 0)
    rows = logits.gather(1, col[:, :, None].expand(B, M, logits.shape[-1])).float()
    return torch.where(valid[:, :, None], rows.softmax(-1), 0.0)
