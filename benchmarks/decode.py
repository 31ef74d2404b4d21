"""Decoding speed of every decoder on the same model and prompts: TPF, TPS, wall time, batch 1 and 8.

    python benchmarks/decode.py --model src/refusion/assets/refusion-tiny --prompts 16 --gen-length 160 --serial-blocks 1,5

Writes benchmarks/results/decode.json and prints a markdown table. TPF = committed tokens / forward
passes (every pass counted); TPS = generated tokens (prompt excluded, up to and including EOS) /
wall seconds of the whole batch, so batch 8 reports the throughput of the batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refusion.checkpoint import load_model
from refusion.decoding import decode
from refusion.tokenizer import Tokenizer


def load_prompts(model_dir: Path, n: int, seed: int, source: str | None, task: str | None) -> list[list[int]]:
    tok = Tokenizer.from_dir(model_dir)
    if source:
        rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
        queries = [r["query"] for r in rows]
    elif task:
        from refusion.tasks import get_task

        queries = [ex.prompt for ex in get_task(task).load("test", n=n, seed=seed)]
    else:
        from refusion.data import synthetic_records

        queries = [r["query"] for r in synthetic_records(n, seed=seed, split="test")]
    return [tok.chat_prompt_ids(q) for q in queries[:n]]


def configs(gen_length: int, slot_size: int, blocks: list[int], ts: float, tt: float) -> list[tuple[str, str, dict]]:
    out = []
    for i, b in enumerate(blocks):
        rf = dict(gen_length=gen_length, slot_size=slot_size, serial_blocks=b, slot_threshold=ts, token_threshold=tt)
        out.append((f"refusion B={b}", "refusion", rf))
        if i == 0:  # the ablations at the first block count
            out.append((f"refusion B={b} recompute_kv", "refusion", {**rf, "recompute_kv": True}))
            out.append((f"refusion B={b} left-to-right", "refusion-l2r", rf))
    return out + [
        ("ar", "ar", dict(max_new_tokens=gen_length)),
        ("mdm (llada, 1 tok/step)", "mdm", dict(gen_length=gen_length, block_length=32, steps=gen_length)),
        ("mdm threshold 0.9", "mdm-threshold", dict(gen_length=gen_length, block_length=32, threshold=0.9,
                                                    prefix_cache=True)),
    ]


def run(model, prompts, decoder, params, batch_size) -> dict:
    tokens = forwards = fed = 0
    seconds = 0.0
    outputs = []
    for i in range(0, len(prompts), batch_size):
        t = time.perf_counter()
        res = decode(model, prompts[i: i + batch_size], decoder, **params)
        seconds += time.perf_counter() - t
        tokens += sum(len(r.tokens) for r in res)
        forwards += sum(r.forwards for r in res)
        fed += sum(r.tokens_fed for r in res)
        outputs += [r.tokens for r in res]
    return dict(tokens=tokens, forwards=forwards, seconds=seconds, tpf=tokens / forwards, tps=tokens / seconds,
                fed_per_forward=fed / forwards, ms_per_forward=1000 * seconds / forwards, outputs=outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-file", help="JSONL with a 'query' field (default: synthetic task prompts)")
    ap.add_argument("--task", help="prompts from this task's test split instead (e.g. code, arith)")
    ap.add_argument("--gen-length", type=int, default=160)
    ap.add_argument("--slot-size", type=int, default=8)
    ap.add_argument("--serial-blocks", default="1", help="comma-separated: one refusion row per value")
    ap.add_argument("--slot-threshold", type=float, default=0.9)
    ap.add_argument("--token-threshold", type=float, default=0.4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 gives stable CPU timings)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    prompts = load_prompts(Path(args.model), args.prompts, args.seed, args.prompt_file, args.task)
    decode(model, prompts[:2], "ar", max_new_tokens=4)  # warm-up
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        for name, decoder, params in configs(args.gen_length, args.slot_size,
                                             [int(b) for b in args.serial_blocks.split(",")],
                                             args.slot_threshold, args.token_threshold):
            r = run(model, prompts, decoder, params, bs)
            rows.append(dict(name=name, decoder=decoder, params=params, batch_size=bs,
                             **{k: v for k, v in r.items() if k != "outputs"}))
            print(f"batch {bs:>2} {name:<26} TPF {r['tpf']:5.2f}  TPS {r['tps']:8.1f}  {r['seconds']:6.2f} s",
                  flush=True)
    ar = {r["batch_size"]: r["tps"] for r in rows if r["decoder"] == "ar"}
    print("\n| batch | decoder | tokens | TPF | TPS | wall s | TPS / AR | tokens fed / forward | ms / forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['name']} | {r['tokens']} | {r['tpf']:.2f} | {r['tps']:.1f} | {r['seconds']:.2f} | "
              f"{r['tps'] / ar[r['batch_size']]:.2f}x | {r['fed_per_forward']:.1f} | {r['ms_per_forward']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=args.model, args=vars(args), threads=args.threads,
                                   torch=torch.__version__, rows=rows), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
