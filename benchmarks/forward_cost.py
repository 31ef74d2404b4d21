"""What one forward costs by the number of tokens it feeds, eager and through compiled graphs.

    python benchmarks/forward_cost.py --model smollm2 --threads 1
    python benchmarks/forward_cost.py --model refusion-tiny --modes eager,default --out benchmarks/results/forward_cost_tiny.json
    python benchmarks/forward_cost.py --dtype bfloat16 --modes eager,eager-linear

A speculative step feeds a row's next token and its draft in one forward, so what a draft earns
depends on how much dearer a forward of W tokens is than one of a single token. Each cell: one row
of W tokens on a cache of --context tokens, logits of every fed token and their argmax brought to the
host (a speculative step's shape), the median of --repeats. The modes are separate instances of the
model in one process: eager; eager-packed, eager with the library products only (the project's
few-row kernel off, refusion/model/few_rows.py); eager-linear, eager with every product as F.linear (MKL: the model's
oneDNN packed weights off, what eager was before them, for a model large enough to take them); and
`enable_compile(mode=...)` for each compile mode named (compiled before any timing: every width once). Modes alternate within each round so that a drift of the
machine hits all of them. Also recorded: each mode's largest logit difference from eager, and its
compile seconds. Nothing else should run on the machine. Writes JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from refusion.bundled import resolve_model
from refusion.model.checkpoint import load_model
from refusion.model import packed
from refusion.model.compiled import MODES, enable_compile


EAGER = ("eager", "eager-packed", "eager-linear")


def forward(model, cache, context: int, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds of one forward of ids [1, W] after `context` cached tokens (the cache cut back after)."""
    W = ids.shape[1]
    pos = torch.arange(context, context + W)[None]
    start = time.perf_counter()
    logits = model(ids, pos, cache=cache, num_logits=W)
    logits.argmax(-1).tolist()
    seconds = time.perf_counter() - start
    cache.crop(context)
    return seconds, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' dtype")
    ap.add_argument("--context", type=int, default=200, help="cached tokens each forward attends to")
    ap.add_argument("--widths", default="1,2,4,8,16,32")
    ap.add_argument("--modes", default="eager,eager-linear,max-autotune",
                    help=f"eager, eager-linear and compile modes ({', '.join(MODES)})")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON (default: benchmarks/results/forward_cost_<model>.json)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if set(modes) - {*EAGER, *MODES}:
        ap.error(f"unknown modes {sorted(set(modes) - {*EAGER, *MODES})}: {', '.join(EAGER)}, {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    widths = [int(w) for w in args.widths.split(",")]
    with torch.inference_mode():
        first = load_model(path, dtype=args.dtype)
        vocab = first.config.vocab_size
        prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
        feeds = {W: torch.randint(0, vocab, (1, W), generator=gen) for W in widths}
        models, caches, compile_seconds = {}, {}, {}
        for i, mode in enumerate(modes):
            model = first if i == 0 else load_model(path, dtype=args.dtype)
            if mode == "eager-linear":
                model.set_streamed(False)
            elif mode not in EAGER:
                enable_compile(model, mode=mode)
            cache = model.new_cache()
            model(prompt, torch.arange(args.context)[None], cache=cache)  # the prefill (eager)
            start = time.perf_counter()
            for W in widths:  # every shape class compiled before the clock
                forward(model, cache, args.context, feeds[W])
            compile_seconds[mode] = time.perf_counter() - start
            print(f"{mode}: ready in {compile_seconds[mode]:.0f} s", flush=True)
            models[mode], caches[mode] = model, cache
        times = {(m, W): [] for m in modes for W in widths}
        logits = {}
        for _ in range(args.repeats):
            for W in widths:
                for m in modes:
                    with packed.without_kernel() if m == "eager-packed" else contextlib.nullcontext():
                        s, logits[m, W] = forward(models[m], caches[m], args.context, feeds[W])
                    times[m, W].append(s)
    rows = []
    for W in widths:
        row = dict(width=W)
        for m in modes:
            row[f"{m}_ms"] = 1e3 * statistics.median(times[m, W])
            if "eager" in modes and m != "eager":
                row[f"{m}_max_logit_diff"] = float((logits[m, W] - logits["eager", W]).abs().max())
        rows.append(row)
        print(f"width {W:>3}: " + ", ".join(f"{m} {row[f'{m}_ms']:.1f} ms" for m in modes), flush=True)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    out = Path(args.out or f"benchmarks/results/forward_cost_{Path(path).name}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows,
                                   compile_seconds=compile_seconds), indent=1))
    one = {m: rows[0][f"{m}_ms"] for m in modes}
    print("\n| tokens fed | " + " | ".join(f"{m} ms (x 1 token)" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for r in rows:
        print(f"| {r['width']} | " + " | ".join(f"{r[f'{m}_ms']:.1f} ({r[f'{m}_ms'] / one[m]:.2f})" for m in modes) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
