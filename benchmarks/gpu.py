"""Correctness and speed on a GPU (or any device) in one command: JSON + printed tables.

    python benchmarks/gpu.py                                # every part, on cuda where there is one
    python benchmarks/gpu.py --quick                        # the same code paths at tiny sizes
    python benchmarks/gpu.py --device cpu --quick --model tests/fixtures/refusion-words   # what the tests run
    python benchmarks/gpu.py --only forward --out results/gpu_forward.json

Parts (--skip / --only take their names, comma-separated), in the order they run:

  correctness  the bundled model and --model (default smollm2-refusion), float32 and bfloat16: greedy
               `speculative` against greedy `ar`, token for token, at batch 1 and 8 (gpu_checks.py);
               plan-and-infill's float32 outputs against the CPU's record (benchmarks/expected/).
               Differences are counted and each is explained (the logit gap of the two tokens where
               the outputs part, whether the machine's CPU gives the record)
  decode       ar, speculative (the model's settings), plan-and-infill (refusion) and mdm-threshold
               on --model: TPS, TPF and speed against ar at batch 1, 8 and 32 on GSM8K test
               questions and chat prompts (256 tokens); host syncs per forward; the cost policy's
               table measured on the device and the widths it fed
  serve        benchmarks/serve_load.py against `refusion serve` on the device: throughput, time to
               first token and latency at 1, 8 and 32 concurrent streams
  forward      one forward at widths 1..64, batch 1 and 8, cache 256 and 2048, eager and compiled
               (model/compiled.py), for --model and a randomly initialised Qwen3-8B-shaped model
               (0.6B-shaped where memory is short), against the memory-bandwidth floor (gpu_forward.py)

Each part's result is written to --out as soon as it ends (a part that fails records its error and
the rest still run); --budget-s stops starting work past a deadline. --quick: 4 prompts, short
answers, batch 1 and 2, a few widths, tiny model shapes (under a minute on a GPU). Without a cached
SmolLM2 and no network, scripts/gpu_prepare.sh makes what to carry (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import gpu_checks  # (beside this file)
import gpu_forward
from refusion.bundled import BUNDLED, resolve_model
from refusion.decoding import costs, decode
from refusion.model.checkpoint import load_config, load_model
from refusion.model.tokenizer import Tokenizer
from refusion.runtime import count_host_syncs, resolve_device

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("correctness", "decode", "serve", "forward")
COMPILE_ROOM_S = 120  # budget a compiled pass of the forward part needs left to start
CHAT = [  # chat prompts of the kinds a served model gets (the GSM8K questions come from --prompts or refusion.tasks)
    "Write a short poem about the sea.", "What is the capital of France, and why is it famous?",
    "Explain what a hash table is in two sentences.", "Give me three tips for sleeping better.",
    "Write a Python function that reverses a string.", "Summarise the plot of Romeo and Juliet.",
    "What are the primary colours?", "How do I boil an egg?", "Translate 'good morning' into Spanish and German.",
    "List five animals that live in the ocean.", "What is photosynthesis?", "Write a haiku about autumn.",
    "Explain recursion to a child.", "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop.", "How many days are there in a leap year?",
]


class Run:
    """The report being written: environment, one entry per part, saved after every change."""

    def __init__(self, out: Path, args: argparse.Namespace, device: torch.device) -> None:
        self.out, self.device = out, device
        self.deadline = time.perf_counter() + args.budget_s
        self.report = dict(args=vars(args), env=environment(device), parts={})

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.out)

    def part(self, name: str, fn, *args) -> None:
        entry = self.report["parts"][name] = dict(status="running")
        if self.left() <= 0:
            entry.update(status="skipped", why="over --budget-s")
            log(f"== {name}: skipped (over --budget-s)")
            return
        log(f"== {name}")
        start = time.perf_counter()
        try:
            fn(self, entry, *args)
            entry["status"] = "ok"
        except Exception as e:  # a part that fails must not lose the others: record it, go on
            entry.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            log(f"{name} failed: {type(e).__name__}: {e}")
        entry["seconds"] = time.perf_counter() - start
        self.save()


START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:5.0f} s] {msg}", flush=True)


def environment(device: torch.device) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
               device=str(device), cpus=os.cpu_count(), machine=costs.machine())
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, gpu_memory_gb=p.total_memory / 1e9, multiprocessors=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}")
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def model_dir(name: str) -> Path:
    """--model's directory; a SmolLM2 that is neither cached nor downloadable says what to carry."""
    try:
        return resolve_model(name)
    except Exception as e:
        raise RuntimeError(f"{name} cannot be loaded here ({type(e).__name__}: {e}). Offline, carry SmolLM2's GGUF: "
                           "run scripts/gpu_prepare.sh where there is a network and send what it prints "
                           "(docs/gpu.md)") from None


def model_prompts(args: argparse.Namespace, tok: Tokenizer, n: int, room: int) -> tuple[list[list[int]], dict]:
    """n prompts for --model, half GSM8K test questions and half chat prompts, as token ids, each
    at most `room` tokens (those longer are left out); where they came from."""
    gsm8k, source = [], "none"
    if args.prompts:
        gsm8k, source = json.loads(Path(args.prompts).read_text())["gsm8k"], args.prompts
    else:
        try:
            from refusion.tasks import get_task

            gsm8k, source = [ex.prompt for ex in get_task("gsm8k").load("test", n=n, seed=0)], "refusion.tasks"
        except Exception as e:  # offline without --prompts: chat prompts alone
            source = f"unavailable ({type(e).__name__}: {e})"
    questions = [ids for ids in map(tok.chat_prompt_ids, gsm8k) if len(ids) <= room][: n // 2]
    chat = [ids for ids in map(tok.chat_prompt_ids, CHAT) if len(ids) <= room][: n - len(questions)]
    if not questions + chat:
        raise ValueError(f"no prompt fits the model's positions with the answer ({room} tokens left for a prompt)")
    return questions + chat, dict(gsm8k=len(questions), chat=len(chat), gsm8k_source=source)


# ---- the parts --------------------------------------------------------------------------------------


def correctness(run: Run, entry: dict, args: argparse.Namespace) -> None:
    q = args.quick
    models = {"bundled": BUNDLED, args.model: model_dir(args.model)}
    entry["speculative_vs_ar"] = rows = []
    for label, path in models.items():
        tok = Tokenizer.from_dir(path)
        if label == "bundled":
            prompts = gpu_checks.task_prompts(tok, n=1 if q else 8)
            L = 32 if q else 96
        else:
            L = 24 if q else 128
            prompts, _ = model_prompts(args, tok, 4 if q else 32, load_config(path).max_position_embeddings - L)
        for dtype in ("float32", "bfloat16"):
            if run.left() <= 0:
                rows.append(dict(model=label, dtype=dtype, skipped="over --budget-s"))
                continue
            model = load_model(path, dtype=dtype, device=run.device)
            for bs in ((1, 2) if q else (1, 8)):
                row = gpu_checks.speculative_vs_ar(model, prompts, bs, L)
                rows.append(dict(model=label, dtype=dtype, **row))
                log(f"  {label} {dtype} batch {bs}: speculative = ar on {row['same']}/{row['prompts']} prompts"
                    + "".join(f"; prompt {d['prompt']} parts at token {d['at']} (logit gap {d['logit_gap']:.3g})"
                              for d in row["differences"][:3]))
                run.save()
            del model
    if run.left() > 0:
        entry["plan_and_infill_vs_cpu_record"] = gpu_checks.against_record(run.device, quick=q, log=log)


def decode_speed(run: Run, entry: dict, args: argparse.Namespace) -> None:
    q = args.quick
    path = model_dir(args.model)
    dtype = "bfloat16" if run.device.type == "cuda" else "float32"
    model, tok = load_model(path, dtype=dtype, device=run.device), Tokenizer.from_dir(path)
    L = 32 if q else 256
    prompts, entry["prompts"] = model_prompts(args, tok, 4 if q else 32, model.config.max_position_embeddings - L)
    entry.update(model=args.model, dtype=dtype, gen_length=L)
    decoders = {"ar": ("ar", dict(max_new_tokens=L)), "speculative": ("speculative", dict(gen_length=L)),
                "plan-and-infill": ("refusion", dict(gen_length=L, slot_size=8, serial_blocks=1,
                                                     slot_threshold=0.9, token_threshold=0.4)),
                "mdm-threshold": ("mdm-threshold", dict(gen_length=L, block_length=32, threshold=0.9,
                                                        prefix_cache=True))}
    entry["errors"] = {}
    for name, (decoder, params) in list(decoders.items()):  # warm-up: allocations, kernels, the cost table
        try:
            with torch.inference_mode():
                decode(model, prompts[:2], decoder, **params)
        except Exception as e:  # (one decoder that cannot run here must not take the others with it)
            entry["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"  {name}: {entry['errors'][name]}")
            del decoders[name]
    entry["cost_table"] = costs.cost_model(model).table()
    widths: dict[int, int] = {}  # tokens fed per row -> forwards, while the hook is on

    def fed(module, a, kw) -> None:
        w = (a[0] if a else kw["input_ids"]).shape[1]
        widths[w] = widths.get(w, 0) + 1

    hook = model.register_forward_pre_hook(fed, with_kwargs=True)
    entry["syncs"] = {}
    entry["rows"] = rows = []
    ar_outputs = {}
    try:
        for name, (decoder, params) in decoders.items():  # host syncs per forward, on a short run of its own
            small = dict(params, **{k: min(v, 32) for k, v in params.items() if k in ("gen_length", "max_new_tokens")})
            widths.clear()
            with torch.inference_mode(), count_host_syncs(run.device) as counted:
                decode(model, prompts[:2], decoder, **small)
            entry["syncs"][name] = counted["sync"] / max(sum(widths.values()), 1)
        log("  host syncs per forward: " + ", ".join(f"{k} {v:.2f}" for k, v in entry["syncs"].items()))
        for bs in ((1, 2) if q else (1, 8, 32)):
            chosen = prompts[:8] if bs == 1 and not q else prompts
            for name, (decoder, params) in decoders.items():
                if run.left() <= 0:
                    rows.append(dict(batch=bs, decoder=name, skipped="over --budget-s"))
                    continue
                widths.clear()
                outputs, tokens, forwards, seconds = [], 0, 0, 0.0
                with torch.inference_mode():
                    for i in range(0, len(chosen), bs):
                        gpu_forward.synchronize(run.device)
                        t = time.perf_counter()
                        res = decode(model, chosen[i:i + bs], decoder, **params)
                        seconds += time.perf_counter() - t
                        outputs += [r.tokens for r in res]
                        tokens += sum(len(r.tokens) for r in res)
                        forwards += sum(r.forwards for r in res)
                if name == "ar":
                    ar_outputs[bs] = outputs
                row = dict(batch=bs, decoder=name, prompts=len(chosen), tokens=tokens, forwards=forwards,
                           seconds=seconds, tps=tokens / seconds, tpf=tokens / max(forwards, 1),
                           same_as_ar=sum(a == b for a, b in zip(outputs, ar_outputs.get(bs, outputs), strict=True)),
                           fed_widths=dict(sorted(widths.items())))
                rows.append(row)
                log(f"  batch {bs:>2} {name:<16} TPS {row['tps']:8.1f}  TPF {row['tpf']:5.2f}  "
                    f"same as ar {row['same_as_ar']}/{len(chosen)}")
                run.save()
    finally:
        hook.remove()
    for row in rows:
        ar = next((r for r in rows if r["batch"] == row["batch"] and r["decoder"] == "ar" and "tps" in r), None)
        if ar and "tps" in row:
            row["x_ar"] = row["tps"] / ar["tps"]


def serve(run: Run, entry: dict, args: argparse.Namespace) -> None:
    q = args.quick
    path = model_dir(args.model)
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"the server needs starlette and uvicorn ({e}): pip install -e '.[serve]', or offline, "
                           "carry their wheels (scripts/gpu_prepare.sh)") from None
    prompts = Path(str(run.out) + ".serve_prompts.json")
    texts = (json.loads(Path(args.prompts).read_text())["gsm8k"][:16] if args.prompts else []) + CHAT
    tok, room = Tokenizer.from_dir(path), load_config(path).max_position_embeddings - (16 if q else 128)
    prompts.write_text(json.dumps([t for t in texts if len(tok.chat_prompt_ids(t)) <= room]))
    out = Path(str(run.out) + ".serve.json")
    dtype = "bfloat16" if run.device.type == "cuda" else "float32"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", str(path), "--device",
           str(run.device), "--dtype", dtype, "--clients", "1,2" if q else "1,8,32",
           "--requests", "4" if q else "64", "--max-tokens", "16" if q else "128", "--bad", "0", "--good", "0",
           "--screenshot", "", "--prompts", str(prompts), "--out", str(out)]
    if run.device.type == "cpu":
        cmd += ["--server-threads", str(torch.get_num_threads())]
    entry["command"] = " ".join(cmd)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, run.left() + 60))
    prompts.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"serve_load.py exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    entry.update(dtype=dtype, max_tokens=result["max_tokens"], load=result["load"])
    for lv in result["load"]:
        log(f"  {lv['clients']:>2} streams: {lv['tokens_per_s']:.0f} tok/s, TTFT p50 {1e3 * lv['ttft_p50']:.0f} ms, "
            f"latency p50 {lv['latency_p50']:.2f} s, {lv['correct']}/{lv['requests']} as decode() gives")


def forward(run: Run, entry: dict, args: argparse.Namespace) -> None:
    q, dev = args.quick, run.device
    entry["bandwidth"] = bw = gpu_forward.bandwidth(dev)
    log(f"  memory bandwidth: copy {bw['copy_bytes_per_s'] / 1e9:.0f} GB/s, vendor "
        + (f"{bw['known_bytes_per_s'] / 1e9:.0f} GB/s" if bw["known_bytes_per_s"] else "unknown")
        + f" ({bw['device_name']}); the floor uses the {bw['floor_source']}'s")
    widths = [1, 4] if q else [1, 2, 4, 8, 16, 32, 64]
    batches, caches = ([1, 2], [64, 128]) if q else ([1, 8], [256, 2048])
    repeats = 3 if q else 20
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    models = {args.model: lambda: load_model(model_dir(args.model), dtype=dtype, device=dev)}
    large = gpu_forward.QWEN3_TINY if q or dev.type == "cpu" else gpu_forward.QWEN3_8B
    if dev.type == "cuda" and not q and torch.cuda.mem_get_info(dev)[0] < 40e9:  # 16 GB of weights, caches, compiling
        large = gpu_forward.QWEN3_06B
    name = {id(gpu_forward.QWEN3_8B): "qwen3-8b-shaped", id(gpu_forward.QWEN3_06B): "qwen3-0.6b-shaped"}.get(
        id(large), "qwen3-tiny-shaped")
    models[name] = lambda: gpu_forward.random_model(large, dev, dtype)
    entry["models"] = {}
    # eager cells of every model first, then the compiled ones: compiling a large model is what may not fit
    for compiled in (False, True):
        for label, make in models.items():
            # (compiling cannot be stopped once started: it needs room, COMPILE_ROOM_S at least)
            if run.left() <= (COMPILE_ROOM_S if compiled and not q else 0):
                entry["models"].setdefault(label, {})["compiled_skipped" if compiled else "skipped"] = "over --budget-s"
                continue
            cells = (widths, batches, caches)
            if compiled and q:  # one graph, of the last model: compiling is minutes on a CPU
                if label != name:
                    continue
                cells = (widths[-1:], batches[-1:], caches[:1])
            first = entry["models"].get(args.model, {})
            if compiled and label == name and "compile_seconds" in first:
                # inductor compiles the unrolled layers: what the first model took, scaled by layers
                guess = first["compile_seconds"] * large.num_layers / first["layers"]
                if guess > run.left():
                    why = f"its compiling (about {guess:.0f} s, from {args.model}'s) would pass --budget-s"
                    entry["models"].setdefault(label, {})["compiled_skipped"] = why
                    continue
            try:
                model = make()
            except Exception as e:
                entry["models"].setdefault(label, {})["error"] = f"{type(e).__name__}: {e}"
                log(f"  {label}: {type(e).__name__}: {e}")
                continue
            result = gpu_forward.forward_costs(model, *cells, repeats, bw["floor_bytes_per_s"], run.deadline, log,
                                               "compiled" if compiled else "eager")
            m = entry["models"].setdefault(label, {})
            m.setdefault("rows", [])
            m.update(parameters=sum(p.numel() for p in model.parameters()), dtype=str(dtype),
                     layers=model.config.num_layers)
            m["rows"] += result["rows"]
            m["left_out"] = m.get("left_out", 0) + result["left_out"]
            if compiled:
                m["compile_seconds"] = result["compile_seconds"]
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            run.save()


# ---- the tables ---------------------------------------------------------------------------------------


def tables(report: dict) -> str:
    env, parts = report["env"], report["parts"]
    cuda = f", CUDA {env['cuda']}" if env["cuda"] else ""
    out = [f"# {env.get('gpu', env['device'])}, torch {env['torch']}{cuda}",
           "", "| part | status | seconds |", "|---|---|---:|"]
    out += [f"| {k} | {v['status']} | {v.get('seconds', 0):.0f} |" for k, v in parts.items()]
    c = parts.get("correctness", {})
    if c.get("speculative_vs_ar"):
        out += ["", "greedy speculative against greedy ar, token for token", "",
                "| model | dtype | batch | identical | first differences (prompt: token, logit gap) |",
                "|---|---|---:|---:|---|"]
        for r in c["speculative_vs_ar"]:
            if "skipped" in r:
                continue
            diffs = "; ".join(f"{d['prompt']}: {d['at']}, {d['logit_gap']:.2g}" for d in r["differences"][:4]) or "-"
            out.append(f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['same']}/{r['prompts']} | {diffs} |")
    rec = c.get("plan_and_infill_vs_cpu_record")
    if rec:
        out += ["", "plan-and-infill float32 against the CPU's record (benchmarks/expected)", "",
                "| setting | identical | differing prompts: first token that differs | machine's CPU: the record |",
                "|---|---:|---|---|"]
        for r in rec["settings"]:
            diffs = ", ".join(f"{d['prompt']}: {d['at']}" for d in r["differences"]) or "-"
            out.append(f"| {r['setting']} | {r['same']}/{r['prompts']} | {diffs} | {r['cpu_matches_record']} |")
    d = parts.get("decode", {})
    if d.get("rows"):
        out += ["", f"decode: {d['model']} {d['dtype']}, {d['gen_length']} tokens, prompts {d['prompts']}", "",
                "| batch | decoder | TPS | TPF | x AR | same as AR | host syncs / forward |",
                "|---:|---|---:|---:|---:|---:|---|"]
        for r in d["rows"]:
            if "tps" in r:
                syncs, x_ar = d["syncs"].get(r["decoder"], float("nan")), r.get("x_ar", 1.0)
                out.append(f"| {r['batch']} | {r['decoder']} | {r['tps']:.0f} | {r['tpf']:.2f} | {x_ar:.2f} | "
                           f"{r['same_as_ar']}/{r['prompts']} | {syncs:.2f} |")
        spec = [r for r in d["rows"] if r["decoder"] == "speculative" and "fed_widths" in r]
        out += [f"speculative's fed widths (width: forwards, prefills included) at batch {r['batch']}: "
                f"{r['fed_widths']}" for r in spec]
    s = parts.get("serve", {})
    if s.get("load"):
        out += ["", f"serve: {s['dtype']}, {s['max_tokens']} tokens per request", "",
                "| streams | requests | tok/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 | as decode() |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {lv['clients']} | {lv['requests']} | {lv['tokens_per_s']:.0f} | {1e3 * lv['ttft_p50']:.0f} ms | "
                f"{1e3 * lv['ttft_p99']:.0f} ms | {lv['latency_p50']:.2f} s | {lv['latency_p99']:.2f} s | "
                f"{lv['correct']}/{lv['requests']} |" for lv in s["load"]]
    f = parts.get("forward", {})
    if f.get("models"):
        bw = f["bandwidth"]
        out += ["", f"memory bandwidth: copy {bw['copy_bytes_per_s'] / 1e9:.0f} GB/s, vendor "
                + (f"{bw['known_bytes_per_s'] / 1e9:.0f} GB/s" if bw["known_bytes_per_s"] else "unknown")
                + f"; floor from the {bw['floor_source']}'s"]
        for label, m in f["models"].items():
            if m.get("rows"):
                out += ["", gpu_forward.forward_table(f"{label} ({m['parameters'] / 1e6:.0f}M, {m['dtype']})", m)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda where there is one)")
    ap.add_argument("--quick", action="store_true", help="every code path at tiny sizes")
    ap.add_argument("--only", help=f"comma-separated parts to run ({', '.join(PARTS)})")
    ap.add_argument("--skip", help="comma-separated parts to leave out")
    ap.add_argument("--model", default="smollm2-refusion", help="the real model of the correctness, decode, serve "
                                                                "and forward parts: a name or a directory")
    ap.add_argument("--prompts", help='JSON {"gsm8k": [question prompts]} (scripts/gpu_prepare.sh writes one; '
                                      "default: refusion.tasks' GSM8K, which needs its download)")
    ap.add_argument("--budget-s", type=float, help="start no work past this many seconds (default 480, --quick 60)")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu.json"))
    args = ap.parse_args()
    chosen = args.only.split(",") if args.only else list(PARTS)
    skipped = args.skip.split(",") if args.skip else []
    if bad := sorted(set(chosen + skipped) - set(PARTS)):
        ap.error(f"unknown parts {', '.join(bad)}: the parts are {', '.join(PARTS)}")
    if args.budget_s is None:
        args.budget_s = 60.0 if args.quick else 480.0
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    torch.manual_seed(0)
    run = Run(Path(args.out), args, device)
    parts = ", ".join(p for p in chosen if p not in skipped)
    log(f"{run.report['env'].get('gpu', device)}: torch {torch.__version__}, parts {parts}")
    fns = dict(correctness=correctness, decode=decode_speed, serve=serve, forward=forward)
    for name in PARTS:
        if name in chosen and name not in skipped:
            run.part(name, fns[name], args)
    run.save()
    print()
    print(tables(run.report))
    print(f"\nwrote {run.out}")
    sys.exit(1 if any(p["status"] == "error" for p in run.report["parts"].values()) else 0)


if __name__ == "__main__":
    main()
