"""KVCache: the keys and values of the committed tokens, with the operations plan-and-infill needs.

Layout per layer: k, v of shape [rows, kv_heads, length, head_dim] (RoPE already applied, so the
order of entries along `length` does not matter to later queries, only which entries exist).

Storage is a buffer with spare capacity so that appending one token does not copy the whole
cache (the pattern of gpt-fast's static cache, but growable for CPU use). `expand` makes k rows
that share the storage of one row (a stride-0 view, no copy); the copy happens only when a row
is written to (copy-on-write), and then only of the part that is kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

CAPACITY_STEP = 256  # capacities are multiples of this: buffers grow (and are copied) rarely


def round_capacity(n: int) -> int:
    return -(-max(n, 1) // CAPACITY_STEP) * CAPACITY_STEP


class StaticIO:
    """A cache as a compiled forward (refusion.compiled) uses it: per layer, the whole buffers
    ([rows, kv_heads, capacity, head_dim]: the capacity is a dynamic size of the graph, so a cache
    that grows compiles nothing), the cache row and column of every fed token, and which rows
    attention reads. Built by a cache's `static_io`, traced into the graph, where `keys` (every
    column a query may see, and every column this forward writes) is the mask's last size."""

    def __init__(self, k: list[Tensor], v: list[Tensor], write_rows: Tensor, read_rows: Tensor | None,
                 cols: Tensor, keys: int) -> None:
        self.k, self.v = k, v
        self.write_rows = write_rows  # [B, 1]: the cache row of each batch row
        self.read_rows = read_rows  # [B], or None: the batch is every row of the buffers, in order
        self.cols = cols  # [B, T]
        self.keys = keys

    def update(self, i: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        self.k[i][self.write_rows, :, self.cols] = k_new.transpose(1, 2).to(self.k[i].dtype)
        self.v[i][self.write_rows, :, self.cols] = v_new.transpose(1, 2).to(self.v[i].dtype)
        k, v = self.k[i][:, :, : self.keys], self.v[i][:, :, : self.keys]
        if self.read_rows is None:
            return k, v
        return k.index_select(0, self.read_rows), v.index_select(0, self.read_rows)


class KVCache:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.k: list[Tensor | None] = [None] * num_layers  # buffers [rows, H, capacity, D]
        self.v: list[Tensor | None] = [None] * num_layers
        self.length = 0  # valid entries in every row
        self._pending = 0  # entries added to the layers of the forward pass now running
        self._shared = False  # buffers are stride-0 views made by expand()

    # ---- shape ------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def __len__(self) -> int:
        return self.length

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Valid keys and values of layer i: [rows, H, length, D] views."""
        return self.k[i][:, :, : self.length], self.v[i][:, :, : self.length]

    # ---- append (used by the model's forward) -----------------------------------

    def update(self, i: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append k_new/v_new [rows, H, t, D] to layer i; return all keys/values of layer i.

        The length advances after the last layer (see `commit`), so every layer of one
        forward pass sees the same prefix.
        """
        t = k_new.shape[2]
        end = self.length + t
        buf_k, buf_v = self.k[i], self.v[i]
        if buf_k is None:
            cap = round_capacity(end)
            shape = (k_new.shape[0], k_new.shape[1], cap, k_new.shape[3])
            # zeros, not empty: a compiled forward reads whole buffers under a mask, and uninitialised
            # memory can hold NaN, which no mask cancels (NaN + -inf is NaN)
            buf_k, buf_v = k_new.new_zeros(shape), v_new.new_zeros(shape)
        elif self._shared or end > buf_k.shape[2] or buf_k.shape[0] != k_new.shape[0]:
            buf_k, buf_v = self._grown(buf_k, end, k_new.shape[0]), self._grown(buf_v, end, k_new.shape[0])
        buf_k[:, :, self.length: end] = k_new
        buf_v[:, :, self.length: end] = v_new
        self.k[i], self.v[i] = buf_k, buf_v
        self._pending = t
        if i == self.num_layers - 1:
            self.commit()
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
        if all(b is not None and b.stride(0) != 0 for b in self.k):
            self._shared = False

    def _grown(self, buf: Tensor, need: int, rows: int) -> Tensor:
        cap = buf.shape[2]
        if need > cap:
            cap = round_capacity(max(need, 2 * cap))
        new = buf.new_zeros((rows, buf.shape[1], cap, buf.shape[3]))
        new[:, :, : self.length] = buf[:, :, : self.length]  # broadcasts a shared row to all rows
        return new

    # ---- plan-and-infill operations ---------------------------------------------

    def crop(self, length: int) -> None:
        """Keep the first `length` entries of every row."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def expand(self, rows: int) -> None:
        """Turn a one-row cache into `rows` rows sharing its entries (no copy until written)."""
        if self.rows != 1:
            raise ValueError(f"expand needs a cache with one row, this one has {self.rows}")
        for i in range(self.num_layers):
            self.k[i] = self.k[i][:, :, : self.length].expand(rows, -1, -1, -1)
            self.v[i] = self.v[i][:, :, : self.length].expand(rows, -1, -1, -1)
        self._shared = True

    def select(self, rows: Tensor | list[int]) -> None:
        """Keep only the given rows, in the given order."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.k[0].device)
        for i in range(self.num_layers):
            self.k[i] = self.k[i][:, :, : self.length].index_select(0, idx)
            self.v[i] = self.v[i][:, :, : self.length].index_select(0, idx)
        self._shared = False

    def merge_rows(self, prefix: int, lengths: list[int]) -> None:
        """Make one row: the shared first `prefix` entries, then row r's entries
        prefix..prefix+lengths[r], row after row. This is how the KV computed by the parallel
        infill rows is appended to the committed cache without recomputing it."""
        if len(lengths) != self.rows:
            raise ValueError(f"merge_rows got {len(lengths)} lengths for {self.rows} rows")
        if any(n < 0 or prefix + n > self.length for n in lengths):
            raise ValueError(f"merge_rows lengths {lengths} exceed the cache length {self.length - prefix} past the prefix")
        total = prefix + sum(lengths)
        for i in range(self.num_layers):
            for name in ("k", "v"):
                buf = getattr(self, name)[i]
                parts = [buf[:1, :, :prefix]] + [buf[r: r + 1, :, prefix: prefix + n] for r, n in enumerate(lengths)]
                merged = buf.new_zeros((1, buf.shape[1], round_capacity(total), buf.shape[3]))
                merged[:, :, :total] = torch.cat(parts, dim=2)
                getattr(self, name)[i] = merged
        self.length = total
        self._shared = False

    def static_io(self, B: int, T: int) -> StaticIO | None:
        """For a compiled forward of B x T tokens appended at columns length..length+T-1; None when
        this cache cannot: not allocated yet, or rows shared by expand() or other than B."""
        if self.k[0] is None or self._shared or self.rows != B:
            return None
        keys = self.length + T
        # room past the keys: a graph traced with keys < capacity takes the keys as a strided view, and
        # keys == capacity (a contiguous one) would be a shape class of its own
        if self.k[0].shape[2] <= keys:
            for name in ("k", "v"):
                bufs = getattr(self, name)
                for i in range(self.num_layers):
                    bufs[i] = self._grown(bufs[i], keys + 1, B)
        dev = self.k[0].device
        cols = torch.arange(self.length, keys, device=dev).expand(B, T)
        return StaticIO(list(self.k), list(self.v), torch.arange(B, device=dev)[:, None], None, cols, keys)

    def advance(self, T: int) -> None:
        """What the last layer's update does in an eager forward: the T new entries become valid."""
        self.length += T

    def clone(self) -> "KVCache":
        c = KVCache(self.num_layers)
        c.k = [None if b is None else b[:, :, : self.length].clone() for b in self.k]
        c.v = [None if b is None else b[:, :, : self.length].clone() for b in self.v]
        c.length = self.length
        return c


class SlotKVCache:
    """A preallocated cache per sequence in which the decoder chooses where each fed token's
    keys and values go (`write_index`, set before every forward).

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
        self.write_index: Tensor | None = None  # [B, T] columns for the tokens of the next forward
        self.rows: Tensor | None = None  # which cache rows the batch rows are (None: all, in order)
        self.used = 0  # attention reads columns [0, used)
        self.length = 0  # the model reads this to decide on a default mask; the decoder always passes one
        self._write_rows: Tensor | None = None  # [B, 1], built once per forward (at layer 0)

    def update(self, i: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        if i == 0 or self._write_rows is None:
            rows = self.rows if self.rows is not None else torch.arange(k_new.shape[0], device=k_new.device)
            self._write_rows = rows[:, None]
        self.k[i][self._write_rows, :, self.write_index] = k_new.transpose(1, 2).to(self.k[i].dtype)
        self.v[i][self._write_rows, :, self.write_index] = v_new.transpose(1, 2).to(self.v[i].dtype)
        k, v = self.k[i][:, :, : self.used], self.v[i][:, :, : self.used]
        if self.rows is not None:
            k, v = k.index_select(0, self.rows), v.index_select(0, self.rows)
        return k, v

    def static_io(self, B: int, T: int) -> StaticIO | None:
        if self.used >= self.capacity:  # see KVCache.static_io: eager rather than a graph of its own
            return None
        rows = self.rows if self.rows is not None else torch.arange(B, device=self.k[0].device)
        return StaticIO(list(self.k), list(self.v), rows[:, None], self.rows, self.write_index, self.used)


class RaggedKVCache:
    """Rows of different lengths in one preallocated buffer, for decoders whose sequences advance by
    different amounts per forward (speculative decoding) and join or leave between forwards.

    Layout per layer: [rows, kv_heads, capacity, head_dim]. Row r's kept entries are columns
    [0, length_r); the decoder tracks the lengths. Before each forward it sets `row0` (the batch is
    rows row0 .. row0+B-1, a contiguous range, so reads are views, never gathers), `write_index`
    [B, T] (the column of every fed token) and `used` (columns attention reads); which of them a
    query may see is the decoder's mask. Dropping entries is only a length change on the decoder's
    side: nothing is copied or recomputed.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, rows: int = 1, capacity: int = 64) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (rows, kv_heads, round_capacity(capacity), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.row0 = 0
        self.write_index: Tensor | None = None
        self.used = 0
        self.length = 0  # read by the model only to pick a default mask; the decoder always passes one
        self._rows: Tensor | None = None  # batch row -> cache row, built once per forward (at layer 0)

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, rows: int, capacity: int) -> None:
        """Grow (never shrink) to at least `rows` x `capacity`, keeping every entry."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        # grow geometrically so that a server admitting one sequence at a time reallocates rarely
        rows = self.rows if rows <= self.rows else max(rows, 2 * self.rows)
        capacity = self.capacity if capacity <= self.capacity else round_capacity(max(capacity, 2 * self.capacity))
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

    def row(self, r: int, length: int) -> tuple[list[Tensor], list[Tensor]]:
        """Row r's first `length` keys and values per layer ([kv_heads, length, head_dim] views)."""
        return [k[r, :, :length] for k in self.k], [v[r, :, :length] for v in self.v]

    def update(self, i: int, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        B = k_new.shape[0]
        if i == 0 or self._rows is None or self._rows.shape[0] != B:
            self._rows = torch.arange(self.row0, self.row0 + B, device=k_new.device)[:, None]
        self.k[i][self._rows, :, self.write_index] = k_new.transpose(1, 2).to(self.dtype)
        self.v[i][self._rows, :, self.write_index] = v_new.transpose(1, 2).to(self.dtype)
        sl = slice(self.row0, self.row0 + B)
        return self.k[i][sl, :, : self.used], self.v[i][sl, :, : self.used]

    def static_io(self, B: int, T: int) -> StaticIO | None:
        if self.used >= self.capacity:  # see KVCache.static_io: eager rather than a graph of its own
            return None
        rows = torch.arange(self.row0, self.row0 + B, device=self.device)
        read = None if self.row0 == 0 and B == self.rows else rows
        return StaticIO(list(self.k), list(self.v), rows[:, None], read, self.write_index, self.used)
