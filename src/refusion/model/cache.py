"""The Cache protocol (what the model asks of a cache) and the caches the decoders use.

Keys and values are kept per layer as [rows, kv_heads, columns, head_dim] buffers, RoPE already
applied: a later query only cares which entries it may see (its mask), not their order.

- KVCache appends: a forward's tokens go to the columns after its length, in every row.
- SlotKVCache and RaggedKVCache are preallocated buffers in which the decoder places every fed token
  itself. They are not handed to the model as they are: `at(...)` describes where one forward writes
  and what it reads, as a CacheWrite, and that is the cache the model gets:

      logits = model(ids, pos, attn_mask=mask, cache=slots.at(cols, keys=used, rows=rows))

  Nothing about the next forward is set on the cache from outside.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

CAPACITY_STEP = 256  # capacities are multiples of this: buffers grow (and are copied) rarely


def round_capacity(n: int) -> int:
    return -(-max(n, 1) // CAPACITY_STEP) * CAPACITY_STEP


def _grown_capacity(need: int, grown: int, limit: int | None) -> int:
    """`grown` (rounded, geometric) cut back to `limit` where given, but never below `need`."""
    return grown if limit is None else max(need, min(grown, limit))


class Cache(Protocol):
    """What Transformer.forward (and the compiled forward) calls on the `cache` it is given.

    Where the forward writes is the cache's own business, fixed before the call: a KVCache appends
    at its length; a CacheWrite (from SlotKVCache.at / RaggedKVCache.at) carries the buffer row and
    column of every fed token and how many columns attention reads.
    """

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store layer `layer`'s keys and values of the fed tokens ([B, kv_heads, T, head_dim]) and
        return every key and value attention reads ([B, kv_heads, keys, head_dim]). Called once per
        layer, in order; after the last layer the forward's entries are in place."""
        ...

    def default_mask(self, T: int, device: torch.device) -> Tensor | None:
        """The bool mask (True = may attend, broadcastable to [B, heads, T, keys]) for a forward of T
        tokens whose caller passes none, or None when the fed tokens need no mask beyond causal among
        themselves (nothing is cached before them, or only one token is fed)."""
        ...

    def graph_write(self, B: int, T: int) -> CacheWrite | None:
        """This forward's write over the whole buffers, for a compiled graph (model/compiled.py),
        or None: run eager."""
        ...

    def advance(self, T: int) -> None:
        """After a compiled forward: what the last layer's `update` does in an eager one."""
        ...


class CacheWrite:
    """One forward's place in preallocated buffers (a Cache).

    k, v: per layer, [rows, kv_heads, capacity, head_dim] buffers.
    rows: [B, 1], the buffer row of each batch row (None: the rows `read`, made where needed).
    read: the buffer rows attention reads, in batch order: None (every row, in order), a slice (a
      view) or an index tensor (a gather).
    cols: [B, T], the column each fed token's key and value go to.
    keys: attention reads columns [0, keys); which of them a query sees is the mask's business.
    first: where the caller knows that the rows `read` (a slice, or None: all) write columns first,
      first + 1, ... (cols[b] = first + arange(T) for every b), a copy into that block replaces the scatter.
    index: where the caller keeps it, the place of every element written, shaped as the keys and
      values written ([B, kv_heads, T, head_dim]), in the buffers seen flat (RaggedKVCache.write_index):
      a put_ of them, without the advanced-index assignment's reshaping (a decode step of several rows
      of one token each: about the cost of a block copy, half the scatter's on a CPU).
    """

    def __init__(self, k: list[Tensor], v: list[Tensor], rows: Tensor | None, read: slice | Tensor | None,
                 cols: Tensor, keys: int, first: int | None = None, index: Tensor | None = None) -> None:
        self.k, self.v = k, v
        self._rows, self.read, self.cols, self.keys = rows, read, cols, keys
        self.first = first if read is None or isinstance(read, slice) else None
        self.index = index

    @property
    def rows(self) -> Tensor:
        if self._rows is None:
            read = self.read if self.read is not None else slice(0, self.k[0].shape[0])
            self._rows = torch.arange(read.start, read.stop, device=self.cols.device)[:, None]
        return self._rows

    def update(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        kb, vb = self.k[layer], self.v[layer]
        if self.first is not None:  # (a block copy: a one-row decode step's columns are one run)
            rows = self.read if self.read is not None else slice(None)
            cols = slice(self.first, self.first + k_new.shape[2])
            kb[rows, :, cols] = k_new
            vb[rows, :, cols] = v_new
        elif self.index is not None:
            kb.put_(self.index, k_new.to(kb.dtype))
            vb.put_(self.index, v_new.to(vb.dtype))
        else:
            kb[self.rows, :, self.cols] = k_new.transpose(1, 2).to(kb.dtype)
            vb[self.rows, :, self.cols] = v_new.transpose(1, 2).to(vb.dtype)
        k, v = kb[:, :, : self.keys], vb[:, :, : self.keys]
        if self.read is None:
            return k, v
        if isinstance(self.read, slice):
            return k[self.read], v[self.read]
        return k.index_select(0, self.read), v.index_select(0, self.read)

    def default_mask(self, T: int, device: torch.device) -> Tensor:
        """Causal in column order: a query sees every column at or before its own."""
        return torch.arange(self.keys, device=device)[None, None, None, :] <= self.cols[:, None, :, None]

    def graph_write(self, B: int, T: int) -> CacheWrite | None:
        # keys == capacity would make the keys a contiguous view: a shape class of its own, so eager
        if self.keys >= self.k[0].shape[2]:
            return None
        read = self.read
        if isinstance(read, slice):  # a graph takes no Python ints that change from call to call
            whole = read.start == 0 and read.stop == self.k[0].shape[0]
            read = None if whole else torch.arange(read.start, read.stop, device=self.cols.device)
        return CacheWrite(list(self.k), list(self.v), self.rows, read, self.cols, self.keys)

    def advance(self, T: int) -> None:
        pass  # the decoder keeps the lengths


class KVCache:
    """A Cache that appends: each forward's keys and values go to the columns after `length`.

    Storage is a buffer with spare capacity so that appending one token does not copy the whole
    cache (the pattern of gpt-fast's static cache, but growable for CPU use).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.k: list[Tensor | None] = [None] * num_layers  # buffers [rows, kv_heads, capacity, head_dim]
        self.v: list[Tensor | None] = [None] * num_layers
        self.length = 0  # valid entries in every row

    @property
    def rows(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def __len__(self) -> int:
        return self.length

    def update(self, layer: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append k_new / v_new [rows, kv_heads, t, head_dim] to layer `layer`; return all its keys and
        values. The length advances after the last layer, so every layer of a forward sees the same
        prefix."""
        end = self.length + k_new.shape[2]
        kb, vb = self.k[layer], self.v[layer]
        if kb is None:
            shape = (k_new.shape[0], k_new.shape[1], round_capacity(end), k_new.shape[3])
            # zeros, not empty: a compiled forward reads whole buffers under a mask, and uninitialised
            # memory can hold NaN, which no mask cancels (NaN + -inf is NaN)
            kb, vb = k_new.new_zeros(shape), v_new.new_zeros(shape)
        elif end > kb.shape[2]:
            kb, vb = self._grown(kb, end), self._grown(vb, end)
        kb[:, :, self.length: end] = k_new
        vb[:, :, self.length: end] = v_new
        self.k[layer], self.v[layer] = kb, vb
        if layer == self.num_layers - 1:
            self.length = end
        return kb[:, :, :end], vb[:, :, :end]

    def default_mask(self, T: int, device: torch.device) -> Tensor | None:
        """Causal in feed order, every cached entry visible (SDPA's is_causal aligns the triangle
        top-left; after cached entries it must be bottom-right)."""
        if self.length == 0 or T == 1:
            return None
        return torch.ones(T, self.length + T, dtype=torch.bool, device=device).tril(self.length)

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every row."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def graph_write(self, B: int, T: int) -> CacheWrite | None:
        """Columns length..length+T-1 of every row; None when not allocated yet (the prefill runs
        eager) or holding other than B rows."""
        if self.k[0] is None or self.rows != B:
            return None
        keys = self.length + T
        # room past the keys: see CacheWrite.graph_write
        if self.k[0].shape[2] <= keys:
            self.k = [self._grown(b, keys + 1) for b in self.k]
            self.v = [self._grown(b, keys + 1) for b in self.v]
        dev = self.k[0].device
        cols = torch.arange(self.length, keys, device=dev).expand(B, T)
        return CacheWrite(list(self.k), list(self.v), torch.arange(B, device=dev)[:, None], None, cols, keys)

    def advance(self, T: int) -> None:
        self.length += T

    def _grown(self, buf: Tensor, need: int) -> Tensor:
        cap = buf.shape[2]
        if need > cap:
            cap = round_capacity(max(need, 2 * cap))
        new = buf.new_zeros((buf.shape[0], buf.shape[1], cap, buf.shape[3]))
        new[:, :, : self.length] = buf[:, :, : self.length]
        return new


class SlotKVCache:
    """A preallocated cache per sequence in which the decoder chooses where each fed token's keys
    and values go (`at`, once per forward).

    Plan-and-infill uses it to keep k infill rows of one sequence inside that sequence's single
    row: row r of a slot of size s writes at columns committed + r*s + j. The shared committed
    prefix is therefore never copied, and when the rows are accepted their KV already sits in
    commit order right after the prefix, so "appending each row's KV" costs nothing. Which
    columns a query may see is the decoder's attention mask.
    """

    def __init__(self, num_layers: int, rows: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        capacity = round_capacity(capacity)
        shape = (rows, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    def at(self, cols: Tensor, keys: int, rows: Tensor | None = None) -> CacheWrite:
        """The next forward's place: batch row b is cache row rows[b] (None: every row, in order), its
        tokens go to columns cols[b] ([B, T]), and attention reads columns [0, keys)."""
        write = rows if rows is not None else torch.arange(cols.shape[0], device=cols.device)
        return CacheWrite(self.k, self.v, write[:, None], rows, cols, keys)


class RaggedKVCache:
    """Rows of different lengths in one preallocated buffer, for decoders whose sequences advance by
    different amounts per forward (speculative decoding) and join or leave between forwards.

    Layout per layer: [rows, kv_heads, capacity, head_dim]. Row r's kept entries are columns
    [0, length_r); the decoder tracks the lengths. A forward runs on a contiguous range of rows
    (`at(cols, keys, row0)`: reads are views, never gathers); which columns a query may see is the
    decoder's mask. Dropping entries is only a length change on the decoder's side: nothing is
    copied or recomputed.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, rows: int = 1, capacity: int = 64,
                 max_capacity: int | None = None) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (rows, kv_heads, _grown_capacity(capacity, round_capacity(capacity), max_capacity), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def at(self, cols: Tensor, keys: int, row0: int = 0, first: int | None = None,
           index: Tensor | None = None) -> CacheWrite:
        """The next forward's place: batch row b is cache row row0 + b, its tokens go to columns
        cols[b] ([B, T]), and attention reads columns [0, keys). first: where the caller knows every
        row's columns are first, first + 1, ... (CacheWrite). index: write_index(cols, row0), where the
        caller keeps it (a decoder stepping the same rows one column on: index + head_dim)."""
        B = cols.shape[0]
        read = None if row0 == 0 and B == self.rows else slice(row0, row0 + B)  # (every row: no slicing)
        return CacheWrite(self.k, self.v, None, read, cols, keys, first, index)

    def write_index(self, cols: Tensor, row0: int = 0) -> Tensor:
        """[B, kv_heads, T, head_dim]: where in each layer's buffer, seen flat, batch row b's tokens at
        columns cols[b] ([B, T]) write their keys (or values), element by element (cache row row0 + b);
        valid while the capacity stays (reserve may change it)."""
        B, H, C, D = cols.shape[0], self.kv_heads, self.capacity, self.head_dim
        heads = torch.arange(row0 * H, (row0 + B) * H, device=self.device).view(B, H, 1, 1) * C
        return (heads + cols[:, None, :, None]) * D + torch.arange(D, device=self.device)

    def reserve(self, rows: int, capacity: int, max_rows: int | None = None, max_capacity: int | None = None) -> None:
        """Grow (never shrink) to at least `rows` x `capacity`, keeping every entry; the growth stops at
        `max_rows` x `max_capacity` where given (a server's limits), never below what is asked."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        # grow geometrically so that a server admitting one sequence at a time reallocates rarely
        if rows > self.rows:
            rows = max(rows, min(2 * self.rows, max_rows if max_rows is not None else 2 * self.rows))
        else:
            rows = self.rows
        if capacity > self.capacity:
            capacity = _grown_capacity(capacity, round_capacity(max(capacity, 2 * self.capacity)), max_capacity)
        else:
            capacity = self.capacity
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_zeros((rows, self.kv_heads, capacity, self.head_dim))
                new[: old.shape[0], :, : old.shape[2]] = old
                buffers[i] = new

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` entries into row dst (to keep the running rows contiguous)."""
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[dst, :, :length] = buf[src, :, :length]

    def move_columns(self, row: int, src: int, dst: int, n: int) -> None:
        """Copy row `row`'s columns [src, src + n) to [dst, dst + n) (the ranges may overlap): a
        speculative step keeps the KV of a branch's accepted tokens where its first draft's were."""
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[row, :, dst:dst + n] = buf[row, :, src:src + n].clone()

    def row(self, r: int, length: int) -> tuple[list[Tensor], list[Tensor]]:
        """Row r's first `length` keys and values per layer ([kv_heads, length, head_dim] views)."""
        return [k[r, :, :length] for k in self.k], [v[r, :, :length] for v in self.v]
