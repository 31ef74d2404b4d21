"""What one forward costs by the number of tokens it feeds, with the LM head as x @ W^T (F.linear,
"before") and as W @ x^T for a few rows on a CPU (model/transformer.py head_linear, "after").

    python benchmarks/forward_cost.py --model smollm2 --threads 1
    python benchmarks/forward_cost.py --model refusion-tiny --threads 1 --out benchmarks/results/forward_cost_tiny.json

Each cell: a forward of W tokens (one row) on a cache of --context tokens, logits of every fed
token and their argmax brought to the host (a speculative step's shape), the median of --repeats
after a warm-up; "before" and "after" alternate cell by cell so that a drift of the machine hits
both. The logits of the two agree to float rounding (the maximum difference is recorded). Nothing
else should run on the machine. Writes JSON and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from refusion.bundled import resolve_model
from refusion.model import transformer
from refusion.model.cache import KVCache
from refusion.model.checkpoint import load_model


def timed(model, cache_len: int, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward of ids [1, W] after cache_len cached tokens (the cache cut back afterwards)."""
    W = ids.shape[1]
    pos = torch.arange(cache_len, cache_len + W)[None]
    start = time.perf_counter()
    logits = model(ids, pos, cache=CACHE, num_logits=W)
    logits.argmax(-1).tolist()
    seconds = time.perf_counter() - start
    CACHE.crop(cache_len)
    return seconds, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200, help="cached tokens each forward attends to")
    ap.add_argument("--widths", default="1,2,3,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/forward_cost_smollm2.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model)).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    global CACHE
    CACHE = KVCache(model.config.num_layers)
    with torch.inference_mode():
        model(torch.randint(0, vocab, (1, args.context), generator=gen), torch.arange(args.context)[None], cache=CACHE)
        rows = []
        for W in [int(w) for w in args.widths.split(",")]:
            ids = torch.randint(0, vocab, (1, W), generator=gen)
            times = {"before": [], "after": []}
            logits = {}
            for r in range(args.repeats + 2):
                for name, limit in (("before", 0), ("after", transformer.HEAD_TRANSPOSED_ROWS)):
                    transformer_limit = transformer.HEAD_TRANSPOSED_ROWS
                    transformer.HEAD_TRANSPOSED_ROWS = limit
                    try:
                        s, logits[name] = timed(model, args.context, ids)
                    finally:
                        transformer.HEAD_TRANSPOSED_ROWS = transformer_limit
                    if r >= 2:
                        times[name].append(s)
            before, after = statistics.median(times["before"]), statistics.median(times["after"])
            diff = float((logits["before"] - logits["after"]).abs().max())
            rows.append(dict(width=W, before_ms=1e3 * before, after_ms=1e3 * after, speedup=before / after,
                             max_logit_diff=diff))
            print(f"width {W:>3}: before {1e3 * before:7.2f} ms, after {1e3 * after:7.2f} ms "
                  f"({before / after:.2f}x), logits differ by <= {diff:.1e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows), indent=1))
    one = rows[0]["after_ms"]
    print("\n| tokens fed | before (ms) | after (ms) | after / before | after / 1 token |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | {r['after_ms'] / r['before_ms']:.2f} "
              f"| {r['after_ms'] / one:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
