"""Training throughput with and without packed rows (TrainConfig.pack): non-padding tokens per second of
the same optimizer steps, padded (one example per row, padded to the longest of its micro-batch) and
packed (training/packing.py), on a mix of example lengths drawn log-normally between 30 and 1000 tokens.

    python benchmarks/train_throughput.py --steps 6 --warmup 1 --threads 1 --out benchmarks/results/train_throughput.json
    python benchmarks/train_throughput.py --steps 1 --warmup 0 --examples 64 --batch-size 4 --hidden-size 32 \
        --layers 1 --median-length 40 --max-length 96 --out /tmp/train_throughput.json   # a smoke run

Every setting builds the trainer afresh (same seed: same model, same batches) and times `--steps`
steps after `--warmup` ones, with `--threads` CPU threads. Two batch orders are measured, because
packing only saves what padding wastes:
    bucketed  the trainer's default order (length_grouping = true, training/data.py): examples of
              similar length share a batch, so padding is already small;
    random    length_grouping = false: batches of examples drawn at random from the mix, where
              padding to the longest of the batch wastes most columns.
Packed and padded steps of one order compute the same loss (the table gives the largest relative
difference), so their times compare like for like. `padding share` is the share of the columns fed to
the model that are padding. Records are digit strings (one token per digit with the bundled tokenizer),
so lengths are exact; the content does not matter to the speed.

FlexAttention (torch.nn.attention.flex_attention) is probed, not measured, where it cannot train: the
result records why (on the CPU, torch has no backward for it).

Writes `--out` (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from refusion.training.config import TrainConfig
from refusion.training.packing import first_fit_decreasing
from refusion.training.setup import setup
from refusion.training.step import train_step

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "src" / "refusion" / "assets" / "refusion-tiny"  # one token per digit; no BPE to train
TEMPLATE = 14  # tokens the chat template adds to a query with this tokenizer


def lengths_mix(n: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    """n example lengths (prompt + response tokens), log-normal around `median`, clipped to [lo, hi]."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def records(lengths: list[int], seed: int) -> list[dict]:
    """Digit-string records of exactly these token lengths: about 30% prompt (with the chat template), the
    rest response (with its EOS)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        q = max(1, round(0.3 * n) - TEMPLATE)
        r = n - TEMPLATE - q - 1
        out.append({"query": "".join(rng.choices("0123456789", k=q)),
                    "response": "".join(rng.choices("0123456789", k=max(r, 1)))})
    return out


def layout_length(prompt: int, response: int, variant: str | None) -> int:
    """Columns of one example's layout: the joint layouts hold the response twice."""
    return prompt + (2 if variant in ("hybrid", "joint") else 1) * response


def columns(lens: list[int], micro: int, packed: bool) -> int:
    """Columns fed to the model for one step's layouts `lens`, micro-batch by micro-batch."""
    total = 0
    for lo in range(0, len(lens), micro):
        part = lens[lo:lo + micro]
        rows = len(first_fit_decreasing(part, max(part))) if packed else len(part)
        total += rows * max(part)
    return total


def measure(order: str, packed: bool, args: argparse.Namespace, data: Path, out: Path) -> dict:
    cfg = TrainConfig(objective=args.objective, variant=args.variant, data=str(data), tokenizer=str(TOKENIZER),
                      model=dict(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                                 num_layers=args.layers, num_heads=max(args.hidden_size // 32, 1),
                                 num_kv_heads=max(args.hidden_size // 64, 1)),
                      max_length=args.max_length, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                      max_steps=args.warmup + args.steps, warmup_steps=1, out_dir=str(out / f"{order}-{packed}"),
                      save_every=10**9, seed=args.seed, pack=packed, length_grouping=order == "bucketed",
                      device=args.device)
    run = setup(cfg, resume=False, threads=args.threads)
    variant = args.variant if args.objective == "refusion" else None
    recs, cols = [], 0
    for i in range(args.warmup + args.steps):
        idx = run.order(run.step)
        t0 = time.perf_counter()
        rec = train_step(run)
        rec["seconds"] = time.perf_counter() - t0
        if i >= args.warmup:
            recs.append(rec)
            lens = [layout_length(len(run.examples[j].prompt), len(run.examples[j].response), variant) for j in idx]
            cols += columns(lens, run.micro, packed)
    tokens, secs = sum(r["tokens"] for r in recs), sum(r["seconds"] for r in recs)
    return {"order": order, "mode": "packed" if packed else "padded", "steps": len(recs), "tokens": tokens,
            "columns": cols, "padding_share": 1 - tokens / cols, "seconds": secs, "tokens_per_s": tokens / secs,
            "ms_per_step": 1000 * secs / len(recs), "losses": [r["loss"] for r in recs]}


def flex_attention_probe() -> str:
    """'trains' where FlexAttention runs a forward and backward here; else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"unavailable: {e}"
    q = torch.randn(1, 1, 128, 16, requires_grad=True)
    mask = create_block_mask(lambda b, h, i, j: j <= i, 1, 1, 128, 128, device="cpu")
    try:
        flex_attention(q, q, q, block_mask=mask).sum().backward()
    except Exception as e:  # torch says why, in its own words
        return f"{type(e).__name__}: {e}"
    return "trains"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objective", default="refusion", choices=("refusion", "ar", "mdm"))
    ap.add_argument("--variant", default="paper", help="of the refusion objective (training/variants.py)")
    ap.add_argument("--examples", type=int, default=2000, help="examples in the mix")
    ap.add_argument("--median-length", type=float, default=150, help="of the log-normal length mix, in tokens")
    ap.add_argument("--sigma", type=float, default=0.9, help="of the log-normal length mix (of the log)")
    ap.add_argument("--min-length", type=int, default=30)
    ap.add_argument("--max-length", type=int, default=1000, help="the longest example (and max_length)")
    ap.add_argument("--hidden-size", type=int, default=256, help="model width; heads of 32, MLP 3x")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16, help="examples per optimizer step")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="examples per forward (default: the batch)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per setting")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = ap.parse_args()
    if args.objective != "refusion":
        args.variant = None
    lengths = lengths_mix(args.examples, args.median_length, args.sigma, args.min_length, args.max_length, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="refusion-bench-"))
    try:
        data = tmp / "mix.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in records(lengths, args.seed)))
        rows = [measure(order, packed, args, data, tmp) for order in ("bucketed", "random") for packed in (False, True)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = []
    for order in ("bucketed", "random"):
        padded, packed = (next(r for r in rows if r["order"] == order and r["mode"] == m) for m in ("padded", "packed"))
        diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(padded["losses"], packed["losses"]))
        summary.append({"order": order, "speedup": packed["tokens_per_s"] / padded["tokens_per_s"],
                        "loss_max_rel_diff": diff})
    padded_bucketed, packed_random = (next(r for r in rows if r["order"] == o and r["mode"] == m)
                                      for o, m in (("bucketed", "padded"), ("random", "packed")))
    random_vs_grouped = packed_random["tokens_per_s"] / padded_bucketed["tokens_per_s"]
    result = {"objective": args.objective, "variant": args.variant, "model": {"hidden_size": args.hidden_size,
              "layers": args.layers}, "lengths": {"examples": args.examples, "median": args.median_length,
              "sigma": args.sigma, "min": args.min_length, "max": args.max_length, "mean": sum(lengths) / len(lengths)},
              "batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size, "steps": args.steps,
              "warmup": args.warmup, "threads": torch.get_num_threads(), "device": args.device,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "attention": "SDPA with a boolean mask", "flex_attention": flex_attention_probe(),
              "rows": rows, "summary": summary, "packed_random_vs_padded_bucketed": random_vs_grouped}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("| batch order | padded tokens/s | packed tokens/s | packed / padded | padding share (padded, packed) "
          "| loss max rel. diff |\n|---|---|---|---|---|---|")
    for s in summary:
        padded, packed = (next(r for r in rows if r["order"] == s["order"] and r["mode"] == m)
                          for m in ("padded", "packed"))
        print(f"| {s['order']} | {padded['tokens_per_s']:.0f} | {packed['tokens_per_s']:.0f} | {s['speedup']:.2f}x "
              f"| {100 * padded['padding_share']:.0f}%, {100 * packed['padding_share']:.0f}% "
              f"| {s['loss_max_rel_diff']:.1e} |")
    print(f"\n{args.objective}{f' ({args.variant})' if args.variant else ''}, {args.batch_size} examples per step, "
          f"lengths log-normal (median {args.median_length:g}, sigma {args.sigma:g}) in [{args.min_length}, "
          f"{args.max_length}], {args.steps} steps after {args.warmup} warm-up, {torch.get_num_threads()} thread(s); "
          f"FlexAttention: {result['flex_attention']}; written to {args.out}")
    print(f"random batches packed reach {random_vs_grouped:.2f}x the tokens/s of length-grouped batches padded")


if __name__ == "__main__":
    main()
