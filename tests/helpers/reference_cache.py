"""The row operations of a KVCache that only the reference port (reference_refusion.py) uses.

The package's KVCache appends; plan-and-infill in the package keeps its rows in a SlotKVCache. The
reference port instead decodes the infill rows of one sequence as rows of a KVCache sharing the
committed prefix, then merges them back into one row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.model.cache import KVCache, round_capacity


class ReferenceKVCache(KVCache):
    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Valid keys and values of layer i: [rows, kv_heads, length, head_dim] views."""
        return self.k[i][:, :, : self.length], self.v[i][:, :, : self.length]

    def expand(self, rows: int) -> None:
        """Turn a one-row cache into `rows` rows sharing its entries: stride-0 views, no copy. The
        buffers are exactly `length` long, so the next append grows them, which is the copy."""
        if self.rows != 1:
            raise ValueError(f"expand needs a cache with one row, this one has {self.rows}")
        for i in range(self.num_layers):
            self.k[i] = self.k[i][:, :, : self.length].expand(rows, -1, -1, -1)
            self.v[i] = self.v[i][:, :, : self.length].expand(rows, -1, -1, -1)

    def select(self, rows: list[int]) -> None:
        """Keep only the given rows, in the given order."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.k[0].device)
        for i in range(self.num_layers):
            self.k[i] = self.k[i][:, :, : self.length].index_select(0, idx)
            self.v[i] = self.v[i][:, :, : self.length].index_select(0, idx)

    def merge_rows(self, prefix: int, lengths: list[int]) -> None:
        """Make one row: the shared first `prefix` entries, then row r's entries
        prefix..prefix+lengths[r], row after row (the KV of accepted infill rows, in commit order)."""
        if len(lengths) != self.rows:
            raise ValueError(f"merge_rows got {len(lengths)} lengths for {self.rows} rows")
        if any(n < 0 or prefix + n > self.length for n in lengths):
            raise ValueError(f"merge_rows lengths {lengths} exceed the cache length {self.length - prefix} past the prefix")
        total = prefix + sum(lengths)
        for bufs in (self.k, self.v):
            for i, buf in enumerate(bufs):
                parts = [buf[:1, :, :prefix]] + [buf[r: r + 1, :, prefix: prefix + n] for r, n in enumerate(lengths)]
                merged = buf.new_zeros((1, buf.shape[1], round_capacity(total), buf.shape[3]))
                merged[:, :, :total] = torch.cat(parts, dim=2)
                bufs[i] = merged
        self.length = total
