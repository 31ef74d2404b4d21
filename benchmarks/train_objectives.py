"""Training speed of the three objectives on the same model and data, and the share of each step
spent building the objective's layout (slot masking, shuffling, packing, the attention mask).

    python benchmarks/train_objectives.py                      # the study's model size, synthetic data
    python benchmarks/train_objectives.py --steps 30 --batch-size 16

Writes benchmarks/results/train_objectives.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from refusion.training.setup import setup
from refusion.training.step import train_step
from refusion.training.trainer import TrainConfig

STUDY_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}


def measure(objective: str, args: argparse.Namespace, out: Path) -> dict:
    cfg = TrainConfig(objective=objective, data=args.data, synthetic_examples=args.examples, vocab_size=args.vocab_size,
                      model=dict(STUDY_MODEL), batch_size=args.batch_size, max_steps=args.warmup + args.steps,
                      warmup_steps=1, out_dir=str(out / objective), save_every=10**9, dtype=args.dtype,
                      seed=args.seed)
    run = setup(cfg, resume=False)
    recs = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        rec = train_step(run)
        rec["seconds"] = time.perf_counter() - t0
        if i >= args.warmup:
            recs.append(rec)
    secs = sum(r["seconds"] for r in recs)
    layout = sum(r["layout_s"] for r in recs)
    tokens = sum(r["tokens"] for r in recs)
    return {"objective": objective, "steps": len(recs), "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
            "layout_seconds": layout, "layout_share": layout / secs, "ms_per_step": 1000 * secs / len(recs),
            "final_loss": recs[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="synthetic")
    ap.add_argument("--examples", type=int, default=4000, help="synthetic examples to draw batches from")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/train_objectives.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="refusion-bench-"))
    try:
        rows = [measure(obj, args, tmp) for obj in ("refusion", "ar", "mdm")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"model": STUDY_MODEL, "batch_size": args.batch_size, "dtype": args.dtype, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| objective | tokens/s | ms/step | layout share of step |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['objective']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.1f} | {100 * r['layout_share']:.2f}% |")
    print(f"\n{args.batch_size} examples per step, {args.steps} steps after {args.warmup} warm-up, "
          f"{torch.get_num_threads()} threads; written to {args.out}")


if __name__ == "__main__":
    main()
