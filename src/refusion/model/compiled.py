"""The inference forward compiled with torch.compile, with eager as the fallback.

On a CPU a small model's eager forward is mostly per-operator overhead (dispatch, Python, small
tensors): on the bundled model a single-token forward is 1.09 ms, of which the 17 matrix products
are 0.28 ms. Compiled as one graph (inductor fuses the norms, RoPE, residuals and SiLU into a few C++
kernels; the products and attention stay library calls) it is 0.71 ms (benchmarks/profile_step.py
[--compile], one thread).

Shapes: the batch, the feed width and the number of keys are dynamic dimensions, so one graph
serves every size >= 2 of each, and a decode whose widths change every step (speculative drafts,
plan-and-infill phases) compiles nothing after its first steps. The cache buffers go in whole, their
rows and capacity dynamic too, so a cache that grows compiles nothing either. torch specialises
sizes 0 and 1, so the buckets are "1" and "2 or more" of each size: a handful of graphs cover
everything (width, batch, logits wanted: 1 or more; all cache rows or some; padding left out or
not). Nothing is padded to a bucket, and with `real` the graph, like eager, computes only a
ragged batch's real tokens. Every decoder on one model needs about 10 graphs (check_outputs
--compile), each compiled once per process: a server or an evaluation pays it once.
CompileStats counts graphs, compile seconds and recompilations (a graph compiled again for a shape
it already had: there should be none).

The graph runs the model's own blocks (Block.forward, traced), on the cache buffers whole (the
cache's `graph_write`); this module only adds the shape handling and the fallback.

What falls back to eager: gradients, more tokens than `max_tokens` in one forward (there the
products dominate and compiling saves little), no cache, a KVCache not allocated yet (its prefill)
or fed another number of rows than it holds, a full Slot/RaggedKVCache, models with a LoRA adapter
or a hook on a module the graph would run. A mask adapter (model/mask_adapter.py) runs in the graph:
its mask rows are found outside it and passed in, a dynamic size like the others.

mode "max-autotune" (CPU): the weights are frozen into the graphs and inductor benchmarks its own
C++ matrix-product kernels against the library's for each product, keeping the faster. On a CPU
without AVX-512 the library's (MKL's) products of 2 to 16 rows cost about twice one row, since each
call repacks the weight; the prepacked kernels take most of that away, which is what makes wide
speculative steps cheap on such a machine. It costs minutes of compiling per process (the autotune
timings are not cached across processes), a second, packed copy of the weights, and graphs that
keep the weights as they were when compiled: for serving and benchmarks, not for a model that is
still training.

Not bit-identical to eager: inductor's fused reductions and transcendental kernels round
differently (logits differ by ~1e-5), so a near-tie between two tokens can resolve the other way.
It is therefore off unless asked for (enable_compile(model), load_model(compile=True),
`--compile`); benchmarks/check_outputs.py --compile reports how many outputs it changed (none of
the recorded ones on the bundled model and the words fixture, every decoder, batch 1 and 8).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refusion.model.cache import Cache, CacheWrite
from refusion.model.mask_adapter import MaskAdapter
from refusion.model.transformer import MLP, Attention, Block, RMSNorm, Transformer, additive_mask, rms_norm

PLAIN = (Block, Attention, MLP, RMSNorm, nn.Linear, nn.Embedding, nn.ModuleList, MaskAdapter)  # module types a graph runs
MODES = ("default", "max-autotune")
# inductor's options for mode "max-autotune" on a CPU (module doc): its own prepacked C++ products
# against the library's, which needs the weights frozen into the graph
CPU_AUTOTUNE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


@dataclass
class CompileStats:
    """Counters a benchmark reports: compiling is paid once per graph, recompiling should never happen."""

    graphs: int = 0  # graphs compiled
    compile_seconds: float = 0.0  # spent in the calls that compiled (tracing + C++ compilation)
    compiled_calls: int = 0
    eager_calls: int = 0  # forwards that fell back to eager
    recompiles: int = 0  # compilations for a shape class already compiled (guards that failed)
    shapes: list = field(default_factory=list)  # one line per graph: its shape class and compile seconds

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        return (f"{self.graphs} graphs compiled in {self.compile_seconds:.1f} s, {self.recompiles} recompiles, "
                f"{self.compiled_calls} forwards compiled, {self.eager_calls} eager")


def _graph(model: Transformer, ids: Tensor, pos: Tensor, mask: Tensor, write_rows: Tensor, read_rows: Tensor | None,
           cols: Tensor, kbufs: list[Tensor], vbufs: list[Tensor], last: Tensor, real: Tensor | None,
           mask_rows: Tensor | None) -> Tensor:
    """Transformer.forward of a [B, T] feed over the cache buffers, through the model's own blocks:
    logits of the columns in `last` (a tensor, not an int, so that its length is a dynamic size
    rather than a constant). With `real`, as eager: per-token work on the real tokens only, zero
    logits for padding. mask_rows: the (real) tokens that take a mask adapter's path, or None."""
    B, T = ids.shape
    ids, pos = ids.reshape(-1), pos.reshape(-1)
    if real is not None:
        ids, pos = ids[real], pos[real]
    x = F.embedding(ids, model.embed_tokens.weight)
    if mask_rows is not None:
        x = x.index_copy(0, mask_rows, model.mask_embedding.to(x.dtype).expand(mask_rows.shape[0], -1))
    cos, sin = model.rope_at(pos, x.dtype)
    io = CacheWrite(kbufs, vbufs, write_rows, read_rows, cols, mask.shape[-1])
    qk_norms = model.qk_norm_weights()
    for i, block in enumerate(model.layers):
        x = block(x, cos, sin, mask, False, io, i, (B, T), real, qk_norms[i], mask_rows)
    if real is not None:  # padding's hidden state is zero, and so its logits (rms_norm(0) = 0)
        x = x.new_zeros(B * T, x.shape[-1]).index_copy(0, real, x)
    x = x.view(B, T, -1).index_select(1, last)
    return F.linear(rms_norm(x, model.norm.weight, model.norm.eps), model.lm_head.weight)


def _plain(model: Transformer) -> bool:
    """Every module the graph runs is one of the model's own, without hooks (an adapter or a hook
    would need a graph of its own, and dynamo does not guard on hooks)."""
    if type(model.lm_head) is not nn.Linear:
        return False
    for m in (model.embed_tokens, model.lm_head, *model.layers.modules()):
        if m._forward_hooks or m._forward_pre_hooks or type(m) not in PLAIN:
            return False
    return True


def _mark(args: tuple, io: CacheWrite) -> None:
    """Mark the batch, width and key dimensions dynamic where they are >= 2 (torch specialises 0 and 1
    anyway). On every call, not only the first: should a guard ever fail, the graph compiled again
    must be the dynamic one too."""
    input_ids, position_ids, attn_mask, last, real, mask_rows = args[0], args[1], args[2], *args[-3:]
    marks = [(last, (0,)), (real, (0,)), (mask_rows, (0,)), (input_ids, (0, 1)), (position_ids, (0, 1)),
             (io.cols, (0, 1)),
             (attn_mask, tuple(range(attn_mask.dim()))), (io.rows, (0,)), (io.read, (0,))]
    marks += [(t, (0, 2)) for t in io.k + io.v]  # rows and capacity
    for t, dims in marks:
        if t is not None:
            for d in dims:
                if t.shape[d] >= 2:
                    torch._dynamo.mark_dynamic(t, d)


def _own(t: Tensor) -> Tensor:
    """t, or a copy laid out row-major from offset 0. A decoder may pass views into a larger buffer,
    and their offsets and strides are sizes to dynamo too (offset 0 or 1, a row stride other than
    the width, even where is_contiguous() holds because a size is 1) that would make graphs of
    their own."""
    want, n = [], 1
    for size in reversed(t.shape):
        want.append(n)
        n *= size
    if t.storage_offset() == 0 and t.stride() == tuple(reversed(want)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _recompile_limit(n: int) -> dict:
    """torch.compile's recompile_limit=n where it takes one (newer torch); on an older torch (a GPU
    machine's may be) the process-wide limit is raised to n instead."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": n}
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, n)
    return {}


def enable_compile(model: Transformer, on: bool = True, **options) -> CompiledForward | None:
    """Send `model`'s inference forwards through torch.compile'd graphs where a shape bucket fits,
    eager elsewhere (off: eager always). Sets and returns model.compiled, a CompiledForward (its
    .stats count graphs, compile seconds and recompiles), or None when turned off. options:
    CompiledForward's (max_tokens, mode)."""
    model.compiled = CompiledForward(model, **options) if on else None
    return model.compiled


class CompiledForward:
    """Transformer.forward for inference through compiled graphs where one fits (see the module doc)."""

    def __init__(self, model: Transformer, max_tokens: int = 512, mode: str = "default") -> None:
        if mode not in MODES:
            raise ValueError(f"compile mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.model = model
        self.max_tokens = max_tokens
        self.stats = CompileStats()
        self._seen: set[tuple] = set()

        def graph(*args):
            return _graph(model, *args)

        # Static by default (weights, head counts), with the batch, width, key and capacity sizes marked
        # dynamic on every call (see _mark), so that one graph per shape class serves every size.
        # size_asserts off: the wrapper would check ~50 input sizes and strides on every call, which
        # dynamo's guards have just checked. A graph per shape class: more than dynamo's default
        # limit of 8 where several decoders share a model.
        compiled = torch.compile(graph, fullgraph=True, dynamic=False, options={"size_asserts": False},
                                 **_recompile_limit(64))
        self._fn = compiled
        if mode == "max-autotune":
            # inductor reads freezing and autotuning from its global config while it compiles (passed
            # as torch.compile options they are silently not applied): patched around every call,
            # since a call is where a graph may compile
            import torch._inductor.config as inductor_config

            config = CPU_AUTOTUNE if model.embed_tokens.weight.device.type == "cpu" else {"max_autotune": True}

            def patched(*args):
                with inductor_config.patch(config):
                    return compiled(*args)

            self._fn = patched

    def __call__(self, input_ids: Tensor, position_ids: Tensor, attn_mask: Tensor | None, cache: Cache | None,
                 num_logits: int | None, real: Tensor | None = None) -> Tensor | None:
        """Logits as Transformer.forward returns them, or None: run eager instead."""
        m = self.model
        B, T = input_ids.shape
        io = None
        if cache is not None and B * T <= self.max_tokens and _plain(m):
            io = cache.graph_write(B, T)
        if io is None:
            self.stats.eager_calls += 1
            return None
        if attn_mask is None:
            attn_mask = cache.default_mask(T, input_ids.device)
        if attn_mask is None:  # causal in feed order, every cached entry visible
            attn_mask = torch.ones(T, io.keys, dtype=torch.bool, device=input_ids.device).tril(io.keys - T)
        if attn_mask.dtype == torch.bool:
            attn_mask = additive_mask(attn_mask, m.embed_tokens.weight.dtype)
        need = min(num_logits, T) if num_logits else T
        last = torch.arange(T - need, T, device=input_ids.device)
        input_ids, position_ids, attn_mask, io.cols = (_own(t) for t in (input_ids, position_ids, attn_mask, io.cols))
        real = None if real is None else _own(real)
        mask_rows = None
        if m.mask_embedding is not None:  # found here, as eager finds them: a data-dependent size
            ids = input_ids.reshape(-1) if real is None else input_ids.reshape(-1)[real]
            mask_rows = (ids == m.config.mask_token_id).nonzero().squeeze(1)
            mask_rows = mask_rows if mask_rows.shape[0] else None
        args = (input_ids, position_ids, attn_mask, io.rows, io.read, io.cols, io.k, io.v, last, real, mask_rows)
        # the shape class a graph serves: which sizes are 1, the mask's rank, what is left out
        key = (B >= 2, T >= 2, need >= 2, io.k[0].shape[0] >= 2, io.read is None,
               None if real is None else real.shape[0] >= 2, None if mask_rows is None else mask_rows.shape[0] >= 2,
               attn_mask.dim(), tuple(s >= 2 for s in attn_mask.shape), input_ids.dtype, io.k[0].dtype)
        _mark(args, io)
        if key in self._seen:  # the common case: no config change, just the graph
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            logits = self._fn(*args)
            if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:  # a guard failed
                self.stats.recompiles += 1
                self.stats.compile_seconds += time.perf_counter() - start
        else:
            logits = self._compile(key, args, B, T)
        cache.advance(T)
        self.stats.compiled_calls += 1
        return logits

    def _compile(self, key: tuple, args: tuple, B: int, T: int) -> Tensor:
        """The first call of a shape class, timed."""
        start = time.perf_counter()
        logits = self._fn(*args)
        seconds = time.perf_counter() - start
        self._seen.add(key)
        self.stats.graphs += 1
        self.stats.compile_seconds += seconds
        self.stats.shapes.append(dict(batch=">=2" if B >= 2 else "1", width=">=2" if T >= 2 else "1",
                                      seconds=round(seconds, 2)))
        return logits
