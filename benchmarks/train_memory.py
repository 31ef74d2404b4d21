"""Peak memory per process of training steps: one process, 2 processes with DDP, 2 with FSDP.

    python benchmarks/train_memory.py                 # a 134M-parameter model, 3 steps, 1 example per process
    python benchmarks/train_memory.py --layers 6 --steps 2

Each setting runs in fresh processes (torchrun for the 2-process ones, gloo on the CPU), which
build the trainer and take optimizer steps; no checkpoint is written (its serialisation would be
measured too). Memory is the peak resident set size of each process (getrusage ru_maxrss, i.e.
VmHWM: torch has no allocator statistics for CPU memory), so it covers the whole process: the
Python interpreter and torch (`base`, measured before the model is built), start-up and the steps.

What to expect: float32 weights, gradients and AdamW's two moments are 16 bytes per parameter.
DDP keeps all of them on every process, plus its gradient buckets (4 more bytes per parameter);
FSDP keeps 1/N of the 16 bytes (N processes) plus the full weights of the unit running. Over `base`,
FSDP on 2 processes should need about 8 / 20 = 0.4 of DDP's memory, and half of one process's.

Writes benchmarks/results/train_memory.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "src" / "refusion" / "assets" / "refusion-tiny"  # no BPE to train first


def _mib(kib: int) -> float:
    return kib / 1024


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def worker(args: argparse.Namespace) -> None:
    """One process of one setting: build the trainer, take the steps, report memory (rank 0 writes)."""
    import torch
    import torch.distributed as dist

    from refusion.runtime import count_parameters
    from refusion.training.setup import setup
    from refusion.training.step import train_step
    from refusion.training.trainer import TrainConfig

    base = _rss_kib()
    model = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_layers": args.layers,
             "num_heads": args.hidden // 64, "num_kv_heads": max(args.hidden // 256, 1)}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig(objective="ar", data="synthetic", synthetic_examples=64, tokenizer=str(TOKENIZER),
                      model=model, max_length=128, batch_size=world, max_steps=args.steps, warmup_steps=0,
                      out_dir=args.out_dir, strategy=args.strategy)
    run = setup(cfg, resume=False)
    built = _rss_kib()
    losses = [train_step(run)["loss"] for _ in range(args.steps)]
    rec = {"rank": int(os.environ.get("RANK", "0")), "base_mib": _mib(base), "after_build_mib": _mib(built),
           "peak_mib": _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), "losses": losses,
           "parameters": count_parameters(run.model)}
    recs = [rec]
    if dist.is_initialized():
        recs = [None] * dist.get_world_size()
        dist.all_gather_object(recs, rec)
    if rec["rank"] == 0:
        Path(args.report).write_text(json.dumps(recs))
    torch.set_num_threads(1)  # nothing left to compute; keeps the exit quiet


def run_setting(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    report = tmp / f"{name}.json"
    me = [str(Path(__file__).resolve()), "--worker", f"--report={report}", f"--out-dir={tmp / name}",
          f"--steps={args.steps}", f"--layers={args.layers}", f"--hidden={args.hidden}",
          f"--intermediate={args.intermediate}"]
    if name == "single":
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *me,
               f"--strategy={name}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    recs = json.loads(report.read_text())
    return {"setting": name, "processes": len(recs), "per_process": recs,
            "peak_mib": max(x["peak_mib"] for x in recs), "base_mib": max(x["base_mib"] for x in recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_memory.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_setting(name, args, Path(tmp)) for name in ("single", "ddp", "fsdp")]
    P = rows[0]["per_process"][0]["parameters"]
    by = {r["setting"]: r for r in rows}
    over = {k: r["peak_mib"] - r["base_mib"] for k, r in by.items()}
    result = {"parameters": P, "steps": args.steps, "model": {"layers": args.layers, "hidden": args.hidden,
                                                              "intermediate": args.intermediate},
              "memory": "peak RSS per process (getrusage ru_maxrss), MiB", "settings": rows,
              "expected_fsdp_over_ddp": 8 / 20, "measured_fsdp_over_ddp": over["fsdp"] / over["ddp"],
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mib = P * 4 / 2**20
    print(f"{P / 1e6:.0f}M parameters ({mib:.0f} MiB in float32), {args.steps} steps, 1 example per process\n")
    print("| setting | processes | peak RSS per process (MiB) | of which over base | x float32 weights | vs DDP |")
    print("|---|---|---|---|---|---|")
    for name, label in (("single", "one process"), ("ddp", "DDP"), ("fsdp", "FSDP")):
        r = by[name]
        print(f"| {label} | {r['processes']} | {r['peak_mib']:.0f} | {over[name]:.0f} | {over[name] / mib:.1f} | "
              f"{over[name] / over['ddp']:.2f} |")
    print(f"\nexpected FSDP / DDP over base: about {8 / 20:.2f}; measured {over['fsdp'] / over['ddp']:.2f}")


if __name__ == "__main__":
    main()
