"""Memory per process of FSDP training steps on 1, 2 and 4 CPU processes (gloo), against the plan.

    python benchmarks/train_memory.py --procs 1,2,4 --hidden 1024 --layers 12 --vocab 32000 \\
        --max-length 128 --micro 1 --steps 3 --out benchmarks/results/train_memory.json
    python benchmarks/train_memory.py --procs 1,2 --hidden 128 --layers 2 --intermediate 384 --vocab 1024 \\
        --out /tmp/train_memory.json                                  # a smoke run, seconds

Each setting runs in fresh processes (torchrun --nproc-per-node N, also for N = 1: FSDP needs a
process group), which build a fresh model from the shape given (no checkpoint is written: its
serialisation would be measured too) and take --steps optimizer steps on rows of exactly
--max-length tokens, --micro rows per forward. The global batch is --micro x the largest of --procs
for every setting, so every setting trains the same steps (their losses are in the JSON).

What is measured, per process, against what refusion.training.plan predicts for the same
configuration (its configured setting: fsdp, checkpointing as given, no offload):

  exact accounting  the bytes of the storage behind this process's parameters (its shards) and
                    buffers, of its sharded gradients just before the optimizer step, and of the
                    AdamW state after the last step: the plan's weights, gradients and optimizer.
  tensor peak       of the last step (the first also creates AdamW's state): the states present
                    when it starts (weights, buffers, AdamW's state: exact) plus the highest running
                    total of what it allocated and had not yet freed, from every tensor allocation
                    and free torch.profiler records (profile_memory). The plan's `peak`. Split into
                    the forward/backward (activations, gathered weights, unsharded gradients) and
                    AdamW's step (its temporaries). On gloo it includes gloo's own copies (its
                    all-gather and reduce-scatter on the CPU copy their buffers), which NCCL has not.
  RSS               the peak resident set size (getrusage ru_maxrss) through the steps: it also
                    counts the interpreter with torch, building the model, the profiler's records,
                    the allocator's slack and gloo's buffers, none of which the plan predicts.
                    Note: the model here is fresh (no `init`), which every FSDP process draws whole
                    and then shards (`RSS after build` is after sharding; the RSS peak may be set by
                    the build); a run from a Hugging Face directory never holds the whole model.

Targets: the tensor peak within 20% of the plan's, and weights + optimizer per process falling as
1/N. Writes --out (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "src" / "refusion" / "assets" / "refusion-tiny"  # one token per digit, no BPE to train
PROMPT = "Repeat these digits."


def _mib(n: float) -> float:
    return n / 2**20


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def train_config(args: argparse.Namespace, data: str, out_dir: str):
    """The TrainConfig every process of every setting trains with (and the plan reads)."""
    from refusion.training.config import TrainConfig

    model = {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
             "num_layers": args.layers, "num_heads": args.hidden // 64, "num_kv_heads": max(args.hidden // 256, 1),
             "max_position_embeddings": args.max_length}  # no RoPE table for positions no row reaches
    batch = args.micro * max(args.procs)
    return TrainConfig(objective=args.objective, variant=args.variant if args.objective == "refusion" else None,
                       data=data, tokenizer=str(TOKENIZER), model=model, max_length=args.max_length,
                       batch_size=batch, micro_batch_size=args.micro, max_steps=args.steps, warmup_steps=0,
                       out_dir=out_dir, strategy="fsdp", gradient_checkpointing=args.checkpointing)


def write_data(path: Path, args: argparse.Namespace) -> None:
    """Records of exactly max_length tokens: the chat-formatted prompt, digits (one token each), EOS."""
    from refusion.model.tokenizer import Tokenizer
    from refusion.training.data import encode_records

    prompt_len = len(encode_records([{"query": PROMPT, "response": ""}], Tokenizer.from_dir(TOKENIZER))[0].prompt)
    n = args.max_length - prompt_len - 1
    rng = random.Random(0)
    recs = [{"query": PROMPT, "response": "".join(rng.choice("0123456789") for _ in range(n))}
            for _ in range(args.micro * max(args.procs) * args.steps)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _storage_bytes(tensors) -> int:
    """Bytes of the storage behind `tensors` in this process (a DTensor's local shard, padding
    included; a storage shared by several tensors once)."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _allocations(prof) -> list[tuple[int, int, str]]:
    """(time, bytes allocated by the steps and not yet freed, phase) at every allocation and free the
    profiler saw, in order; phase: 'stepK' or 'stepK/optimizer' (inside AdamW's step).

    The profiler sees the allocations and frees of the threads it profiles; gloo frees some buffers
    (the clone its reduce-scatter makes) on a thread of its own. A pointer allocated again was freed
    before, seen or not: counting that way keeps such frees from accumulating over the steps."""
    from torch._C._profiler import _EventType

    events = []

    def walk(nodes, phase):
        for e in nodes:
            p = phase
            if e.name.startswith("train_step "):
                p = e.name.split()[1]
            elif e.name.startswith("Optimizer.step") and phase and "/" not in phase:
                p = f"{phase}/optimizer"
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, p))
            walk(e.children, p)

    walk(prof.profiler.kineto_results.experimental_event_tree(), "")
    live: dict[int, int] = {}
    total, out = 0, []
    for t, size, ptr, phase in sorted(events):
        total -= live.pop(ptr, 0)  # a free, or an allocation where an unseen free left room
        if size > 0:
            live[ptr] = size
            total += size
        out.append((t, total, phase))
    return out


def worker(args: argparse.Namespace) -> None:
    """One process of one setting: build, take the steps under the profiler, report (rank 0 writes)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from refusion.training.setup import setup
    from refusion.training.step import train_step

    base = _rss_bytes()
    run = setup(train_config(args, args.data, args.out_dir), resume=False)
    built = _rss_bytes()
    model, opt = run.model, run.optimizer
    weights = _storage_bytes(model.parameters())
    buffers = _storage_bytes(model.buffers())
    grads = []
    opt.register_step_pre_hook(lambda *_: grads.append(_storage_bytes(p.grad for p in model.parameters())))
    losses = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for k in range(args.steps):
            with record_function(f"train_step step{k + 1}"):
                losses.append(train_step(run)["loss"])
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the profiler's own work
    optimizer = _storage_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    # the last step (the first also creates AdamW's state): what it allocates on top of the states
    # present when it starts, weights, buffers and AdamW's state (the gradients were set to None)
    last = f"step{args.steps}"
    trace = _allocations(prof)
    first = next(i for i, (_, _, p) in enumerate(trace) if p.startswith(last))
    start = weights + buffers + optimizer - (trace[first - 1][1] if first else 0)
    fwd_bwd = start + max(total for _, total, p in trace[first:] if p == last)
    step = start + max(total for _, total, p in trace[first:] if p == f"{last}/optimizer")
    rec = {"rank": run.rank, "parameters": sum(p.numel() for p in model.parameters()),
           "weights": weights, "buffers": buffers, "gradients": grads[-1], "optimizer": optimizer,
           "tensor_peak": max(fwd_bwd, step), "forward_backward_peak": fwd_bwd, "optimizer_step_peak": step,
           "rss_base": base, "rss_after_build": built, "rss_peak": rss_peak,
           "losses": losses, "threads": torch.get_num_threads()}
    recs = [rec]
    if dist.is_initialized():
        recs = [None] * dist.get_world_size()
        dist.all_gather_object(recs, rec)
    if run.rank == 0:
        Path(args.report).write_text(json.dumps(recs))


def run_setting(n: int, args: argparse.Namespace, data: Path, tmp: Path) -> list[dict]:
    """The per-process records of one setting: n processes."""
    report = tmp / f"procs{n}.json"
    me = [str(Path(__file__).resolve()), "--worker", f"--report={report}", f"--out-dir={tmp / f'run{n}'}",
          f"--data={data}", *_shape_args(args)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *me]
    threads = args.threads or max((os.cpu_count() or 1) // n, 1)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{n} processes failed:\n{r.stderr[-3000:]}")
    return json.loads(report.read_text())


def _shape_args(args: argparse.Namespace) -> list[str]:
    return [f"--procs={','.join(map(str, args.procs))}", f"--hidden={args.hidden}", f"--layers={args.layers}",
            f"--intermediate={args.intermediate}", f"--vocab={args.vocab}", f"--max-length={args.max_length}",
            f"--micro={args.micro}", f"--steps={args.steps}", f"--objective={args.objective}",
            f"--variant={args.variant}"] + \
        (["--checkpointing"] if args.checkpointing else [])


def planned(args: argparse.Namespace, n: int) -> dict:
    """What refusion.training.plan predicts per process for n processes."""
    from refusion.training.plan import make_plan, read_model_config

    cfg = train_config(args, "synthetic", "unused")
    mc, _ = read_model_config(None, cfg)
    p = make_plan(cfg, mc, n, 1, None)
    return next(s for s in p["settings"] if s["configured"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4],
                    help="numbers of processes, one setting each (default 1,2,4)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-length", type=int, default=128, help="tokens of every row")
    ap.add_argument("--micro", type=int, default=1, help="rows per forward (micro_batch_size)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--objective", default="refusion", choices=("refusion", "ar", "mdm"))
    ap.add_argument("--variant", default="paper",
                    help="of the refusion objective (default paper: rows as long as the examples, as the plan assumes)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--threads", type=int, help="CPU threads per process (default: the CPUs / processes)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_memory.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits.jsonl"
        write_data(data, args)
        for n in args.procs:
            recs = run_setting(n, args, data, Path(tmp))
            plan = planned(args, n)
            worst = max(recs, key=lambda r: r["tensor_peak"])
            rows.append({"processes": n, "per_process": recs, "plan": plan,
                         "tensor_peak": worst["tensor_peak"], "rss_peak": max(r["rss_peak"] for r in recs),
                         "tensor_peak_over_plan": worst["tensor_peak"] / plan["peak"],
                         "weights_and_optimizer": max(r["weights"] + r["optimizer"] for r in recs)})
    P = rows[0]["per_process"][0]["parameters"]
    for r in rows:  # 1 when the sharded states fall as 1/N: float32 weights and AdamW's two moments, 12 bytes
        r["weights_and_optimizer_times_n_over_12P"] = r["weights_and_optimizer"] * r["processes"] / (12 * P)
    result = {"parameters": P, "plan_parameters": planned_parameters(args),
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "report", "out_dir", "data")},
              "memory": "bytes per process; tensor peak traced by torch.profiler (profile_memory), RSS by getrusage",
              "settings": rows, "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


def planned_parameters(args: argparse.Namespace) -> int:
    from refusion.model.size import parameter_count
    from refusion.training.plan import read_model_config

    return parameter_count(read_model_config(None, train_config(args, "synthetic", "unused"))[0])


def table(result: dict) -> str:
    a = result["args"]
    lines = [f"{result['parameters'] / 1e6:.1f}M parameters (the plan counts {result['plan_parameters'] / 1e6:.1f}M), "
             f"fsdp, {a['objective']}, {a['steps']} steps of micro-batch {a['micro']} x {a['max_length']} "
             f"tokens, activation checkpointing {'on' if a['checkpointing'] else 'off'}; MiB per process "
             "(the largest of the processes)", "",
             "| processes | weights | buffers | gradients | optimizer | (weights+optimizer) x N / 12P | fwd/bwd peak | "
             "optimizer-step peak | tensor peak | plan's peak | measured / plan | RSS after build | RSS peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["settings"]:
        w = max(r["per_process"], key=lambda x: x["tensor_peak"])
        p = r["plan"]
        lines.append(f"| {r['processes']} | {_mib(w['weights']):.0f} | {_mib(w['buffers']):.0f} | "
                     f"{_mib(w['gradients']):.0f} | {_mib(w['optimizer']):.0f} ({_mib(p['optimizer']):.0f}) | "
                     f"{r['weights_and_optimizer_times_n_over_12P']:.3f} | "
                     f"{_mib(w['forward_backward_peak']):.0f} | {_mib(w['optimizer_step_peak']):.0f} | "
                     f"{_mib(r['tensor_peak']):.0f} | {_mib(p['peak']):.0f} | {r['tensor_peak_over_plan']:.2f} | "
                     f"{_mib(max(x['rss_after_build'] for x in r['per_process'])):.0f} | {_mib(r['rss_peak']):.0f} |")
    lines += ["", "In parentheses: the plan's figure. Weights: this process's parameter shards (the plan's weights "
                  "add the buffers). Gradients: the sharded ones, before the optimizer step (the plan's add the "
                  "unsharded ones in flight during the backward). P: the parameters; 12 bytes each: float32 weights "
                  "and AdamW's two moments."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
