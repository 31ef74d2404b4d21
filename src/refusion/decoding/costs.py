"""What a forward costs, for the speculative decoder's cost policy (widths.py).

`CostModel`: seconds as a function of the batch's rows and of the tokens the forward computes, which
is what the code really computes: on a CPU the sum of the rows' fed tokens (a ragged batch computes
only its real tokens, common.packed_index), elsewhere rows x the widest row (rows are padded to one
width). It is measured at first use for this device type, dtype, model shape, thread count and
forward (compiled or eager): timed forwards on a scratch cache, widths 1..64 at 1 and 8 rows (wider
ones extrapolated once a row count has taken CALIBRATION_SECONDS and reached CALIBRATION_TOKENS
tokens), each the fastest of three, smoothed into a nondecreasing convex curve (a busy machine's
spikes taken out), interpolated linearly and extrapolated past the grid. It is then kept up to date
from the decode's own step timings: every decode forward already ends in a host transfer, so timing
it adds no sync, and each step moves the table a little towards what the step took (its host work
included; REFRESH_EVERY steps' timings at a time): the whole table of its row count, every width
alike. The refresh corrects the level; the calibration gives the shape. A decode times only the few
widths it uses, and moving cells by width bent the shape either way: moving only the cells around
them flattened the curve past them (wider steps looked nearly free); moving every cell past them
too made those cells take every step's noise and no step's correction once the policy stopped
feeding them, so that they climbed without bound over a long run. A CPU's ragged batch computes only its real
tokens in its products, but attention and the cache still see rows x the widest row: the cost of
each padding slot is measured too (one forward with one wide row and the others one token wide) and
added to the table's. `CostModel.of` makes a fixed table from a function
(`SpeculativeBatch(cost=...)`, `generate_speculative(cost=...)`; tests/conftest.py gives every test
one).

The measured table is kept on disk (`$REFUSION_CACHE/costs`, default `~/.cache/refusion/costs`), one
file per machine (CPU or GPU model, torch version) and setting above, so that a new process starts
deciding at once (measuring takes seconds on a 100M-parameter model, longer than a short answer's
decode) and every process starts from the same numbers; the live update then corrects a table taken
on a busier day. Delete the folder to measure anew.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from refusion.decoding.common import packed_index
from refusion.model import packed
from refusion.model.cache import RaggedKVCache
from refusion.model.packed import PACKED_DTYPES
from refusion.model.fetch import cache_dir
from refusion.model.transformer import Transformer

CALIBRATION_ROWS = (1, 8)
CALIBRATION_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CALIBRATION_CONTEXT = 64  # cached columns the calibration's queries attend to
CALIBRATION_SECONDS = 1.0  # per row count, once CALIBRATION_TOKENS are measured
# a row count's forwards are measured up to this many tokens (and at two widths) whatever they take: a
# step is priced from the cells around it, and a decode's timings of steps past a short table's end
# scale its last cells, which then priced the narrow steps as the wide ones
CALIBRATION_TOKENS = 16
REFRESH_RATE = 0.1  # how far one step's timing moves the table (in log seconds)
REFRESH_EVERY = 8  # step timings are applied this many at a time (each application re-evaluates the table)


def _line(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys), extended linearly past both ends."""
    y = np.interp(x, xs, ys)
    if len(xs) < 2:
        return y
    lo = ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
    hi = ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.where(x < xs[0], lo, np.where(x > xs[-1], hi, y))


def _smooth(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """The greatest nondecreasing convex function below the points (xs ascending), at xs: what is
    left of timings once a busy machine's spikes, which only ever add time, are taken out. A
    forward's cost has that shape: flat while the device has room (an accelerator, a CPU's product
    bound by reading its weights), then linear."""
    ys = np.minimum.accumulate(ys[::-1])[::-1]  # nondecreasing: a point is no dearer than any to its right
    hull = [0]
    for i in range(1, len(xs)):  # the lower convex hull, left to right
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (ys[b] - ys[a]) * (xs[i] - xs[a]) >= (ys[i] - ys[a]) * (xs[b] - xs[a]):
                hull.pop()  # b lies on or above the chord from a to i
            else:
                break
        hull.append(i)
    return np.interp(xs, xs[hull], ys[hull])


def _bracket(xs: np.ndarray, x: float) -> tuple[int, float]:
    """(i, f): x lies a fraction f of the way from xs[i] to xs[i + 1] (f outside [0, 1] past the ends)."""
    if len(xs) < 2:
        return 0, 0.0
    i = min(max(bisect.bisect_left(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


class CostModel:
    """Seconds a forward takes, from a table: for each of a few row counts, seconds at a few token
    counts (the tokens the forward computes). packed: a ragged batch computes its rows' real tokens
    (a CPU) rather than rows x its widest row; pad: what each padding slot of a packed batch costs
    on top (seconds per slot of rows x widest row not taken by a real token: attention and the
    cache see the padded grid). frozen: never refreshed by observe()."""

    def __init__(self, rows: Sequence[int], tokens: Sequence[Sequence[float]], seconds: Sequence[Sequence[float]],
                 packed: bool, frozen: bool = False, pad: float = 0.0) -> None:
        self.rows = np.asarray(rows, dtype=float)
        self.tokens = [np.asarray(t, dtype=float) for t in tokens]
        self.seconds = [_smooth(t, np.asarray(s, dtype=float)) for t, s in zip(self.tokens, seconds)]
        self.packed, self.frozen, self.pad = packed, frozen, float(pad) if packed else 0.0
        self.floor = 0.5 * min(float(s.min()) for s in self.seconds)  # no estimate below it, extrapolated or not
        self.grids: dict[int, np.ndarray] = {}  # rows -> self(rows, [0, 1, 2, ...]) until observe() moves the table
        self.noted: list[tuple[int, int, float, int]] = []  # note()'s timings not yet observed

    @classmethod
    def of(cls, seconds: Callable[[int, int], float], packed: bool = True, pad: float = 0.0) -> CostModel:
        """A frozen table of seconds(rows, tokens) on the calibration grid: a cost that does not
        depend on timings (tests)."""
        tokens = [[r * w for w in CALIBRATION_WIDTHS] for r in CALIBRATION_ROWS]
        return cls(CALIBRATION_ROWS, tokens, [[seconds(r, t) for t in ts] for r, ts in zip(CALIBRATION_ROWS, tokens)],
                   packed, frozen=True, pad=pad)

    def table(self) -> dict:
        """The table as plain lists (from_table's input): what the cost cache and --frozen-costs keep."""
        return dict(rows=self.rows.tolist(), tokens=[t.tolist() for t in self.tokens],
                    seconds=[s.tolist() for s in self.seconds], packed=self.packed, pad=self.pad)

    @classmethod
    def from_table(cls, t: dict, frozen: bool = False) -> CostModel:
        return cls(t["rows"], t["tokens"], t["seconds"], t["packed"], frozen=frozen, pad=t["pad"])

    def __call__(self, rows: int, tokens) -> np.ndarray:
        """Seconds of forwards of `rows` rows computing `tokens` tokens (an array: one estimate each)."""
        t = np.asarray(tokens, dtype=float)
        i, f = _bracket(self.rows, rows)
        y = _line(t, self.tokens[i], self.seconds[i])
        if f != 0:  # (more rows never cost less for as many tokens, extrapolated or not; f = 0 would add 0)
            y = y + f * (np.maximum(_line(t, self.tokens[i + 1], self.seconds[i + 1]), y) - y)
        return np.maximum(y, self.floor)

    def grid(self, rows: int, n: int) -> np.ndarray:
        """self(rows, [0, 1, ..., m - 1]) for some m >= n, kept until observe() moves the table: a
        CPU's choice looks its costs up here (the same numbers), and so does the step's observe()."""
        g = self.grids.get(rows)
        if g is None or len(g) < n:
            g = self.grids[rows] = self(rows, np.arange(max(n, 2 * len(g) if g is not None else 0)))
        return g

    def note(self, rows: int, tokens: int, seconds: float, padding: int = 0) -> None:
        """observe(), REFRESH_EVERY timings at a time, in the order noted: a decode notes every step,
        and re-evaluating the table's grid after each would cost a step's choice as much again."""
        if self.frozen:
            return
        self.noted.append((rows, tokens, seconds, padding))
        if len(self.noted) >= REFRESH_EVERY:
            for timing in self.noted:
                self.observe(*timing)
            self.noted.clear()

    def observe(self, rows: int, tokens: int, seconds: float, padding: int = 0) -> None:
        """A decode forward computing `tokens` tokens and `padding` padding slots took `seconds`:
        scale the tables of the row counts around `rows` towards it, each by its share of the
        interpolation (a step's noise moves them by a few percent at most), every cell of a table
        alike: the level follows the decode, the shape stays the calibration's (module docstring)."""
        if self.frozen or not seconds > 0:
            return
        g = self.grids.get(rows)
        estimate = float(g[tokens] if g is not None and tokens < len(g) else self(rows, tokens))
        estimate += self.pad * padding
        ratio = min(max(seconds / estimate, 0.5), 2.0)
        i, f = _bracket(self.rows, rows)
        for r, wr in zip((i, i + 1), _shares(f)) if len(self.rows) > 1 else ((0, 1.0),):
            if wr != 0:  # (no share: its cells would be multiplied by 1)
                self.seconds[r] *= ratio ** (REFRESH_RATE * wr)
        self.grids.clear()


class WidthPriced:
    """A cost table read with only `share` of what a forward's tokens beyond one per row add
    (SpeculativeParams.width_price): the cost policy, which weighs expected tokens against these
    seconds, then feeds wider forwards and more branches. Its choices are myopic (one step's tokens
    per second), and what a wider step feeds (masks, branches) also drafts the steps after it; a
    share below 1 stands for that. It reads `cost` afresh each time, so the live refresh shows."""

    def __init__(self, cost: CostModel, share: float) -> None:
        self.cost, self.share = cost, share
        self.packed, self.pad, self.floor = cost.packed, share * cost.pad, cost.floor
        self.grids: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # rows -> (cost's grid, priced), kept as it is

    def __call__(self, rows: int, tokens) -> np.ndarray:
        base = float(self.cost(rows, [rows])[0])  # every row feeds at least one token
        return base + self.share * (self.cost(rows, tokens) - base)

    def grid(self, rows: int, n: int) -> np.ndarray:
        g = self.cost.grid(rows, max(n, rows + 1))
        kept = self.grids.get(rows)
        if kept is None or kept[0] is not g:  # (the cost's grid is a new array whenever its table moved)
            kept = self.grids[rows] = (g, g[rows] + self.share * (g - g[rows]))
        return kept[1]


def _shares(f: float) -> tuple[float, float]:
    """How much of an observation each of the two cells (row counts' tables, or token counts)
    around it takes: their interpolation weights, or all of it each past the ends, where both
    extrapolate it (scaling both scales the estimate there; moving only the nearer one would tilt
    the line)."""
    return (1 - f, f) if 0 <= f <= 1 else (1.0, 1.0)


def cost_key(model: Transformer) -> tuple:
    """What a forward's cost depends on: device type, dtype, the model's shape, threads, compiled, and
    for a model that streams its weights on a CPU which product each row count takes (model/packed.py's
    probe: a forward of 8 tokens on the few-row kernel costs otherwise than on oneDNN's product)."""
    c, w = model.config, model.embed_tokens.weight
    products = packed.paths(w.dtype) if model.streamed and w.device.type == "cpu" and w.dtype in PACKED_DTYPES \
        and packed.onednn_packing() else None
    return (w.device.type, str(w.dtype), c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
            c.num_kv_heads, c.head_dim, c.vocab_size, torch.get_num_threads(), model.compiled is not None, products)


COSTS: dict[tuple, CostModel] = {}  # cost_key -> its CostModel, read or measured once per process


def cost_model(model: Transformer) -> CostModel:
    """The model's CostModel for the current settings: the cost cache's, else measured (on first use)."""
    key = cost_key(model)
    if key not in COSTS:
        COSTS[key] = stored_cost(model)
    return COSTS[key]


@functools.cache
def machine() -> str:
    """What the cost cache tells machines apart by: the processor's model (or the GPU's), torch's version."""
    name = platform.processor()
    try:
        name = next(x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        name += " / " + torch.cuda.get_device_name()
    return f"{platform.machine()} {name}, torch {torch.__version__}"


def cost_path(model: Transformer) -> Path:
    """The cost cache's file for this model's setting on this machine."""
    digest = hashlib.sha256(repr((machine(), cost_key(model))).encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def stored_cost(model: Transformer) -> CostModel:
    """The cost cache's table for this model's setting (module docstring), or one measured now and
    written there (atomically; a cache that cannot be written is skipped, a file that cannot be read
    is measured anew)."""
    path = cost_path(model)
    try:
        return CostModel.from_table(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    cost = measure_cost(model)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(machine=machine(), key=repr(cost_key(model)), **cost.table())))
        os.replace(tmp, path)
    except OSError:  # (a cache that cannot be written: measured again next time)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return cost


@torch.inference_mode()
def measure_cost(model: Transformer) -> CostModel:
    """Time forwards the way a speculative step runs them (a RaggedKVCache, a bool mask, logits of
    every fed token, their argmax brought to the host), on a scratch cache: nothing of any decode
    is touched."""
    cfg, weight = model.config, model.embed_tokens.weight
    limit = cfg.max_position_embeddings
    ctx = min(CALIBRATION_CONTEXT, limit // 2)
    widths = [w for w in CALIBRATION_WIDTHS if ctx + w <= limit] or [1, 2]
    tokens, seconds = [], []
    for rows in CALIBRATION_ROWS:
        cache = RaggedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, weight.dtype, weight.device,
                              rows=rows, capacity=ctx + widths[-1])
        for w in widths[:2]:  # a shape's first call allocates (or compiles: width 1 and wider are two graphs)
            _timed_forward(model, cache, rows, w, ctx)
        start, measured = time.perf_counter(), []
        for w in widths:
            if (len(measured) >= 2 and rows * widths[len(measured) - 1] >= CALIBRATION_TOKENS
                    and time.perf_counter() - start > CALIBRATION_SECONDS):
                break  # the rest is extrapolated (and refreshed as real steps run)
            measured.append(min(_timed_forward(model, cache, rows, w, ctx) for _ in range(3)))
        tokens.append([rows * w for w in widths[: len(measured)]])
        seconds.append(measured)
    cost = CostModel(CALIBRATION_ROWS, tokens, seconds, packed=weight.device.type == "cpu")
    if cost.packed:  # one row wide and the others one token: its padding's cost, beyond its tokens'
        rows, w = CALIBRATION_ROWS[-1], widths[min(len(measured), len(widths)) - 1]
        if w > 1:
            ragged = [w] + [1] * (rows - 1)
            took = min(_timed_forward(model, cache, rows, w, ctx, ragged) for _ in range(3))
            cost.pad = max(0.0, took - float(cost(rows, [sum(ragged)])[0])) / (rows * w - sum(ragged))
    return cost


def _timed_forward(model: Transformer, cache: RaggedKVCache, rows: int, width: int, ctx: int,
                   ragged: list[int] | None = None) -> float:
    """One forward of `rows` rows of `width` tokens (or of the `ragged` widths, the widest `width`,
    packed as a decode step packs them) after `ctx` cached columns."""
    dev = cache.device
    cols = torch.arange(ctx, ctx + width, device=dev).repeat(rows, 1)
    ids = torch.full((rows, width), model.config.mask_token_id or 0, device=dev)
    mask = torch.arange(ctx + width, device=dev)[None, None, :] <= cols[:, :, None]
    real = packed_index(ragged, width, dev) if ragged else None
    start = time.perf_counter()
    write = cache.at(cols, keys=ctx + width, first=ctx if rows == 1 else None)  # (as a decode step writes)
    logits = model(ids, cols, attn_mask=mask[:, None], cache=write, num_logits=width, real=real)
    logits.float().argmax(-1).cpu()  # the step's host transfer, which waits for the device
    return time.perf_counter() - start
