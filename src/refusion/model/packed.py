"""Products on oneDNN's packed weights and the project's few-row kernel: how a CPU streams a large
model's weights (float32 or bfloat16).

A forward of a few tokens through a model whose weights do not fit in the CPU's caches costs what
reading its weights costs, if the product reads each weight once at memory speed. MKL's F.linear
does not for 2 to 16 rows: it repacks the weight on every call and is bound by its own arithmetic
from a few rows on one thread, so a forward of 8 tokens costs over twice one of 1. oneDNN's product
on a weight packed once into its own blocked layout runs near memory speed for dozens of rows, and
in float32 gives each row the same bits whatever rows are beside it (benchmarks/forward_cost.py,
modes eager and eager-linear). A bfloat16 weight, on a CPU that multiplies in it natively, streams
through it too (half float32's bytes at nearly its pace; F.linear's bfloat16 product of few rows
reads far below memory speed), though its rows' last bits may depend on the rows beside them. The
packed copy costs a second copy of each weight, and about 10 microseconds a call: a small model,
whose weights sit in cache, keeps F.linear (Transformer.streamed decides).

For float32 products of a few rows, the project's kernel (few_rows.py) reads the plain weight at
about MKL's one-row speed, and gives each row the same bits alone or beside others.

What differs between CPUs is measured here rather than assumed, by one probe per process, thread
count and dtype (`_probe`, under a second), and each row count takes the path timed fastest:

- which counts the few-row kernel is the fastest at (`kernel_rows`; none where it cannot be built,
  or for bfloat16). On this project's CPU: 2 to 8 or 16 rows, a decode step's forwards, where it
  saves up to a quarter of the forward; MKL's one row is a few percent faster still, and more rows
  (a prompt's prefill) take oneDNN's packed product.
- which kernel oneDNN runs for fewer than 4 rows. On some CPUs (AVX-512 ones among them) its one-
  and two-row products stream the weights markedly slower than its four-row one, so a one-token
  forward costs more than a four-token one. `padded_rows` pads a product of 1-3 rows with zero rows
  where that is faster.
- whether MKL's one-row product (gemv) beats the packed ones (`gemv_one_row`), for a one-row
  product the kernel does not take. It rounds otherwise than a row beside others, so a one-token
  forward's logits then differ from a verifying forward's in their last bits, as attention's already
  do (a lone query is summed in another order): greedy `speculative` and `ar` can part only where two
  tokens' logits tie that closely.
- whether one packed row gives the same bits as the same row beside others. Where the one-row
  kernel sums in another order, `packed_weight` checks each weight when it packs it, and a product
  of one row on a weight that fails the check runs as two rows.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refusion.model import few_rows

PACKED_FOR_ROWS = 16  # the row count oneDNN chooses its weight layout for (any count then runs)
FEW_ROWS = 4  # products of fewer rows may be padded up to this many (padded_rows)
PROBE_BYTES = 96 * 2**20  # padded_rows' weights: well past a last-level cache, so they stream
PROBE_SHAPES = ((1536, 576), (576, 1536))  # (out, in) of the probe's weights, alternating
PROBE_ROUNDS = 5
PAD_GAIN = 0.95  # pad only where the padded product takes at most this share of the time
PACKED_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_PROBE = (1, 2, 4, 8, 16)  # row counts the probe times the few-row kernel at
PACKED_PROBE = (*range(1, FEW_ROWS + 1), 8, 16)


def _product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@functools.cache
def onednn_packing() -> bool:
    """Whether this PyTorch build has oneDNN's packed-weight linear (torch.ops.mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(2, 2)
        got = _product(torch.ones(1, 2), torch.ops.mkldnn._reorder_linear_weight(w, 1), None)
        return bool(torch.equal(got, torch.full((1, 2), 2.0)))
    except (AttributeError, RuntimeError):
        return False


def pack(w: Tensor) -> Tensor:
    """w [out, in] in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACKED_FOR_ROWS)


def one_row_differs(packed: Tensor, in_features: int) -> bool:
    """Whether a one-row product on `packed` rounds otherwise than the same row beside another."""
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
    return not torch.equal(_product(x[:1], packed, None)[0], _product(x, packed, None)[0])


def written(t: Tensor) -> tuple[int, int]:
    """What tells a tensor's contents apart from before, for a copy made of it: its storage and its
    in-place write counter (-1 for an inference tensor, which has none)."""
    return t.data_ptr(), -1 if t.is_inference() else t._version


def packed_weight(m: nn.Linear) -> tuple[Tensor, bool]:
    """m's weight in oneDNN's layout, packed on first use and again whenever the weight has changed
    since (another tensor, or the same one written in place: its version counter), and whether a
    one-row product on it must run as two rows to round as a row beside others does. An inference
    tensor (made under torch.inference_mode) has no version counter: it is packed once per storage,
    and writing it in place afterwards, itself only possible under inference_mode, goes unseen."""
    w = m._parameters["weight"]
    key = (*written(w), w.shape)
    got = m.__dict__.get("_onednn_weight")
    if got is None or got[0] != key:
        p = pack(w)
        got = m.__dict__["_onednn_weight"] = (key, p, one_row_differs(p, w.shape[1]))
    return got[1], got[2]


def padded_rows(dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """For a product of r = 1 .. FEW_ROWS - 1 rows, how many rows it runs as on the packed weight
    (entry r - 1): the fastest of r .. FEW_ROWS over weights that stream from memory (PROBE_BYTES),
    r itself unless padding saves more than 1 - PAD_GAIN."""
    return _probe(torch.get_num_threads(), dtype).padded_rows


def gemv_one_row(dtype: torch.dtype = torch.float32) -> bool:
    """Whether a one-row product the kernel does not take runs as F.linear on the plain weight (MKL's
    gemv): where the probe timed it faster, by the margin PAD_GAIN, than the packed product
    padded_rows chose."""
    return _probe(torch.get_num_threads(), dtype).gemv_one_row


def kernel_rows(dtype: torch.dtype = torch.float32) -> range:
    """The row counts whose products take the few-row kernel (empty: none)."""
    if dtype != torch.float32 or _without_kernel or not few_rows.available():
        return range(0)
    return _probe(torch.get_num_threads(), dtype).kernel_rows


def paths(dtype: torch.dtype = torch.float32) -> tuple:
    """Which path each row count's product takes (padded_rows, gemv_one_row, kernel_rows), hashable:
    what a forward's cost depends on beside the model's shape (decoding/costs.py keys its tables by it)."""
    kernel = kernel_rows(dtype)
    return padded_rows(dtype), gemv_one_row(dtype), (kernel.start, kernel.stop)


_without_kernel = 0


@contextlib.contextmanager
def without_kernel() -> Iterator[None]:
    """Products within take the library paths only (what a benchmark compares the kernel with)."""
    global _without_kernel
    _without_kernel += 1
    try:
        yield
    finally:
        _without_kernel -= 1


class Choices(NamedTuple):
    padded_rows: tuple[int, ...]
    gemv_one_row: bool
    kernel_rows: range


@functools.cache
def _probe(threads: int, dtype: torch.dtype) -> Choices:
    per = sum(o * i for o, i in PROBE_SHAPES) * dtype.itemsize
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(*PROBE_SHAPES[i % 2], generator=g).to(dtype) for i in range(2 * max(1, PROBE_BYTES // per))]
    weights = [pack(w) for w in plain]
    counts = sorted({*PACKED_PROBE, *KERNEL_PROBE})
    inputs = {r: [torch.randn(r, PROBE_SHAPES[i][1], generator=g).to(dtype) for i in range(2)] for r in counts}
    timed = {"packed": PACKED_PROBE, "gemv": (1,)}
    if dtype == torch.float32 and few_rows.available():
        timed["kernel"] = KERNEL_PROBE

    def sweep(path: str, r: int) -> float:
        x = inputs[r]
        start = time.perf_counter()
        if path == "gemv":
            for i, w in enumerate(plain):
                F.linear(x[i % 2], w)
        elif path == "kernel":
            for i, w in enumerate(plain):
                few_rows.linear(x[i % 2], w)
        else:
            for i, w in enumerate(weights):
                _product(x[i % 2], w, None)
        return time.perf_counter() - start

    for path in timed:  # (first touches)
        sweep(path, 1)
    times = {(path, r): [] for path, rs in timed.items() for r in rs}
    for _ in range(PROBE_ROUNDS):  # interleaved, so that a drift of the machine hits every count
        for path, r in times:
            times[path, r].append(sweep(path, r))
    seconds = {k: statistics.median(t) for k, t in times.items()}
    return choices({r: seconds["packed", r] for r in PACKED_PROBE}, seconds["gemv", 1],
                   {r: seconds["kernel", r] for r in timed.get("kernel", ())})


def choices(packed_seconds: dict[int, float], gemv_seconds: float, kernel_seconds: dict[int, float]) -> Choices:
    """The probe's choices from the time of a product of each row count on the packed weights (1 ..
    FEW_ROWS, and more), of one row through F.linear, and of each row count through the few-row
    kernel (none where it is not built). The kernel takes the counts from the first one timed at which
    it is faster than the best other path up to the last one from there on at which it still is (the
    counts between two timed ones go with them)."""
    rows = rows_to_run({r: packed_seconds[r] for r in range(1, FEW_ROWS + 1)})
    gemv = gemv_seconds < PAD_GAIN * packed_seconds[rows[0]]
    first = last = 0
    for r in sorted(kernel_seconds):
        other = gemv_seconds if r == 1 and gemv else packed_seconds[rows[r - 1] if r < FEW_ROWS else r]
        if kernel_seconds[r] < other:
            first, last = first or r, r
        elif first:
            break
    return Choices(rows, gemv, range(first, last + 1) if first else range(0))


def rows_to_run(seconds: dict[int, float]) -> tuple[int, ...]:
    """padded_rows from the time of a product of each row count 1 .. FEW_ROWS: for each r below
    FEW_ROWS the fastest count from r up, where it beats r's own time by the margin PAD_GAIN."""
    rows = []
    for r in range(1, FEW_ROWS):
        best = min(range(r, FEW_ROWS + 1), key=seconds.__getitem__)
        rows.append(best if seconds[best] < PAD_GAIN * seconds[r] else r)
    return tuple(rows)


def packed_linear(m: nn.Linear, x: Tensor) -> Tensor:
    """F.linear(x, m.weight, m.bias) on m's packed weight, a product of few rows padded with zero
    rows where padded_rows or the weight's rounding (packed_weight) asks for it; one row as F.linear
    itself where gemv_one_row says that is faster; the counts kernel_rows names by the few-row kernel."""
    b = m._parameters["bias"]
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if rows in kernel_rows(x.dtype):
        return few_rows.linear(x, m._parameters["weight"], b)
    if rows == 1 and gemv_one_row(x.dtype):
        return F.linear(x, m._parameters["weight"], b)
    w, one_row_differs = packed_weight(m)
    if 0 < rows < FEW_ROWS:
        run = padded_rows(x.dtype)[rows - 1]
        if rows == 1 and one_row_differs:
            run = max(run, 2)
        if run > rows:
            y = _product(F.pad(x.reshape(rows, K), (0, 0, 0, run - rows)), w, b)[:rows]
            return y.view(*x.shape[:-1], y.shape[-1])
    return _product(x, w, b)
