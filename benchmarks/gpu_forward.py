"""benchmarks/gpu.py's forward part: what one forward costs against the memory-bandwidth floor.

A cell is one forward of `batch` rows of `width` tokens on top of `cache` cached columns, shaped as
a speculative step runs it (a RaggedKVCache written at those columns, a bool mask, logits of every
fed token, their argmax brought to the host), the median of a few timed repeats, eager and through
the project's compiled path (model/compiled.py). Its floor is the bytes such a forward must read
(every weight once, the embedding's rows only for the fed tokens, the cache's keys and values) over
the device's memory bandwidth: measured by a copy, and the vendor's figure where the device is in
KNOWN_BANDWIDTH.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from refusion.model.cache import RaggedKVCache, round_capacity
from refusion.model.compiled import enable_compile
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer

# the vendor's memory bandwidth, bytes per second, by a substring of torch.cuda.get_device_name()
KNOWN_BANDWIDTH = {
    "H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "GH200": 4.0e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12,
    "A10G": 0.6e12, "A10": 0.6e12, "RTX 4090": 1.008e12, "RTX 3090": 0.936e12, "V100": 0.9e12, "T4": 0.32e12,
}

# Qwen3's published shapes (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-0.6B), random weights
QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
                       torch_dtype="bfloat16")
QWEN3_06B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                        num_kv_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                        torch_dtype="bfloat16")
# the same family's layout at a size a CPU run (--quick, --device cpu) takes in seconds
QWEN3_TINY = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
                         torch_dtype="bfloat16")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> dict:
    """The device's memory bandwidth: a copy's (bytes read + written per second, the best of 5), and the
    vendor's figure where known. The floor uses the vendor's where there is one, else the copy's."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    known = next((bw for key, bw in KNOWN_BANDWIDTH.items() if key in name), None)
    copy = 2 * n / best
    return dict(device_name=name, copy_bytes_per_s=copy, known_bytes_per_s=known, floor_bytes_per_s=known or copy,
                floor_source="vendor" if known else "measured copy")


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A model of cfg's shape with normal(0, 0.02) weights drawn on the device (an 8B model's 16 GB
    would take minutes through the CPU), unit norms."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)  # (no float32 copy on the way)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope(device)
    return model.eval()


def model_bytes(model: Transformer) -> tuple[int, int]:
    """(bytes of every weight but the input embedding, bytes of one embedding row). A tied embedding
    is the LM head: read whole by the head, so counted there."""
    emb = model.embed_tokens.weight
    rest = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if p is not emb)
    row = emb.shape[1] * emb.element_size()
    if model.lm_head.weight is emb:
        rest += emb.numel() * emb.element_size()
    return rest, row


def floor_bytes(model: Transformer, batch: int, width: int, cache: int) -> int:
    """Bytes one forward must read: the weights, the fed tokens' embedding rows, every cached and
    new key and value of every row."""
    c = model.config
    rest, row = model_bytes(model)
    item = model.embed_tokens.weight.element_size()
    kv = 2 * batch * (cache + width) * c.num_layers * c.num_kv_heads * c.head_dim * item
    return rest + batch * width * row + kv


def step_forward(model: Transformer, kv: RaggedKVCache, batch: int, width: int, ctx: int, ids: torch.Tensor) -> float:
    """Seconds of one speculative-step-shaped forward (module doc), host transfer included."""
    dev = kv.device
    synchronize(dev)
    start = time.perf_counter()
    cols = torch.arange(ctx, ctx + width, device=dev).repeat(batch, 1)
    mask = torch.arange(ctx + width, device=dev)[None, None, :] <= cols[:, :, None]
    write = kv.at(cols, keys=ctx + width, first=ctx if batch == 1 else None)
    logits = model(ids, cols, attn_mask=mask[:, None], cache=write, num_logits=width)
    logits.float().argmax(-1).cpu()
    return time.perf_counter() - start


def forward_costs(model: Transformer, widths: list[int], batches: list[int], caches: list[int], repeats: int,
                  floor_bw: float, deadline: float, log: Callable[[str], None], mode: str = "eager") -> dict:
    """Every (batch, cache, width) cell, eager or ("compiled") through enable_compile: ms per forward
    (median of `repeats`), the floor's ms, and the compiled path's compile seconds. Cells past the
    deadline (time.perf_counter()) are left out and counted."""
    dev, c = model.embed_tokens.weight.device, model.config
    # caches past the model's positions are cut back to what fits (a small test model's 256)
    caches = sorted({min(ctx, c.max_position_embeddings - max(widths)) for ctx in caches})
    rows, left_out, compile_seconds = [], 0, 0.0
    gen = torch.Generator().manual_seed(0)
    stats = enable_compile(model).stats if mode == "compiled" else None
    for batch in batches:
        for ctx in caches:
            # capacity past the widest feed: a compiled forward reads the buffers whole (compiled.py)
            kv = RaggedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, model.embed_tokens.weight.dtype, dev,
                               rows=batch, capacity=round_capacity(ctx + max(widths) + 1))
            for width in widths:
                if time.perf_counter() > deadline:
                    left_out += 1
                    continue
                ids = torch.randint(0, c.vocab_size, (batch, width), generator=gen).to(dev)
                with torch.inference_mode():
                    step_forward(model, kv, batch, width, ctx, ids)  # allocates, compiles a new shape class
                    step_forward(model, kv, batch, width, ctx, ids)
                    ms = 1e3 * statistics.median(step_forward(model, kv, batch, width, ctx, ids)
                                                 for _ in range(repeats))
                floor = 1e3 * floor_bytes(model, batch, width, ctx) / floor_bw
                rows.append(dict(mode=mode, batch=batch, cache=ctx, width=width, ms=ms, floor_ms=floor,
                                 x_floor=ms / floor))
            del kv
    if stats is not None:
        compile_seconds = stats.compile_seconds
        log(f"  compiled: {stats.summary()}")
        enable_compile(model, False)
    return dict(rows=rows, left_out=left_out, compile_seconds=compile_seconds)


def forward_table(name: str, result: dict) -> str:
    """Markdown: one line per (batch, cache, width), eager and compiled ms side by side with the floor."""
    cells = {(r["mode"], r["batch"], r["cache"], r["width"]): r for r in result["rows"]}
    keys = sorted({k[1:] for k in cells})
    lines = [f"{name}: ms per forward (x the bandwidth floor)", "",
             "| batch | cache | width | eager ms | compiled ms | floor ms | eager x floor | compiled x floor |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, ctx, w in keys:
        e, k = cells.get(("eager", b, ctx, w)), cells.get(("compiled", b, ctx, w))
        floor = (e or k)["floor_ms"]
        lines.append(f"| {b} | {ctx} | {w} | {e['ms']:.3f} | " if e else f"| {b} | {ctx} | {w} | - | ")
        lines[-1] += (f"{k['ms']:.3f} | " if k else "- | ") + f"{floor:.3f} | "
        lines[-1] += (f"{e['x_floor']:.1f} | " if e else "- | ") + (f"{k['x_floor']:.1f} |" if k else "- |")
    return "\n".join(lines)
