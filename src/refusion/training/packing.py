"""Packed rows: several examples side by side in one row of the model's input, instead of one example
per row padded to the longest (TrainConfig.pack).

    packed = pack(inputs, pad_id)        # inputs: an objective's layout, one example per row
    logits = model(packed.inputs.input_ids, packed.inputs.position_ids, packed.inputs.attn_mask)
    ce = packed.unpack(token_ce(logits, packed.inputs.labels))   # back to one example per row
    loss, stats = loss_from_ce(objective, ce, inputs, ...)       # exactly the unpacked loss's sums

Each example keeps its objective's layout as it is (feed order, position ids, labels, its own attention
mask: ReFusion's permuted causal mask, AR's causal one, MDM's bidirectional one, a joint layout's):
its columns are copied, whole and in order, into a packed row, and its attention mask onto the
diagonal of the row's mask. A column then sees exactly the columns it saw unpacked, its position ids
are its own (they restart with every example), and nothing crosses from one example to another. The
loss is taken on the columns moved back to their examples' rows, so every normaliser (the AR token
count, each example's response length and mask rate) is the unpacked one's: packing changes the
rounding of the sums inside attention, not what is computed.

Rows are as long as the longest example of the batch, and examples go into them first-fit in order
of decreasing length: the padded layout is one such packing (one example per row), so packed rows
never hold more columns, nor attention entries, than padded ones. The packing is a pure function of
the examples' lengths (ties by their order), so a resumed run packs every batch as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from refusion.training.objectives import IGNORE, TrainInputs


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of at most `capacity`: longest first (ties by index),
    each into the first row with room for it."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"an example of {lengths[i]} columns does not fit rows of {capacity}")
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


@dataclass
class Packed:
    """inputs: the packed rows [rows, T] (mask_rate and slot_size stay per example); index [B, T]:
    where each column of the unpacked layout sits in the packed rows, as a flat index into
    [rows * T]; real [B, T]: the unpacked layout's non-padding columns (the only ones index holds)."""

    inputs: TrainInputs
    index: Tensor
    real: Tensor

    def unpack(self, x: Tensor) -> Tensor:
        """Per-column values of the packed rows [rows, T] back in the unpacked layout [B, T'] (0 at its
        padding), differentiably."""
        return torch.where(self.real, x.reshape(-1)[self.index], 0.0)

    def to(self, device) -> "Packed":
        return Packed(self.inputs.to(device), self.index.to(device), self.real.to(device))


def pack(inputs: TrainInputs, pad_id: int) -> Packed:
    """Pack the examples of `inputs` (one per row, padding at the end) into as few rows as
    first_fit_decreasing finds, each as long as the longest example (module docstring). Padding
    columns of the packed rows hold pad_id and see only themselves."""
    real = ~inputs.pad
    lengths = real.sum(1).tolist()  # the host sync that sets the shapes
    T = max(lengths, default=0)
    rows = first_fit_decreasing(lengths, T)
    R = len(rows)
    ids = inputs.input_ids.new_full((R, T), pad_id)
    pos = inputs.position_ids.new_zeros(R, T)
    labels = inputs.labels.new_full((R, T), IGNORE)
    is_masked = inputs.is_masked.new_zeros(R, T)
    attn = torch.zeros(R, T, T, dtype=torch.bool, device=ids.device)
    pad = torch.ones(R, T, dtype=torch.bool, device=ids.device)
    index = torch.zeros_like(inputs.input_ids)
    cols = torch.arange(T, device=ids.device)
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            n, end = lengths[b], at + lengths[b]
            ids[r, at:end] = inputs.input_ids[b, :n]
            pos[r, at:end] = inputs.position_ids[b, :n]
            labels[r, at:end] = inputs.labels[b, :n]
            is_masked[r, at:end] = inputs.is_masked[b, :n]
            attn[r, at:end, at:end] = inputs.attn_mask[b, 0, :n, :n]
            pad[r, at:end] = False
            index[b, :n] = r * T + at + cols[:n]
            at = end
    attn.diagonal(dim1=1, dim2=2).fill_(True)  # padding columns see themselves: no all-False row for SDPA
    packed = TrainInputs(ids, pos, labels, is_masked, inputs.mask_rate, "custom", attn[:, None], pad,
                         slot_size=inputs.slot_size)
    return Packed(packed, index, real)
