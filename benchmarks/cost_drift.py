"""Does the live cost table keep its shape over a long decode? SmolLM2's speculative decoder, batch 1.

    python benchmarks/cost_drift.py --n 12 --drift 30 --out benchmarks/results/cost_drift.json

One process decodes the first --n GSM8K test questions (smollm2_speculative.py's prompts, after one
warm-up decode), then the next --drift ones, then the first --n again, each alone, greedy, with the
cost table the policy reads measured (or read from the cost cache) and refreshed by every step as a
decode refreshes it (decoding/costs.py). Prints TPF and ms per step of each pass and the one-row and
eight-row tables before and after: a refresh that keeps the calibration's shape leaves every cell in
the same ratio to the others; one that moves cells by the widths fed lets the cells the decode stops
feeding wander. Remove the cost cache first (`~/.cache/refusion/costs`) to start from a fresh
calibration. Time only on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refusion.bundled import resolve_model
from refusion.decoding import costs, decode
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from smollm2_speculative import OURS, gsm8k_examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--n", type=int, default=12, help="the first N GSM8K test questions, decoded before and after")
    ap.add_argument("--drift", type=int, default=30, help="how many further questions are decoded in between")
    ap.add_argument("--setting", default="speculative +lookup +fork price 0.25", help="a speculative setting of smollm2_speculative.py")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/cost_drift.json")
    args = ap.parse_args()
    if args.setting not in OURS or OURS[args.setting][1] != "speculative" or args.setting.endswith(" compiled"):
        ap.error(f"--setting {args.setting!r}: an eager speculative setting of smollm2_speculative.py")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    eos = sorted(set(model.config.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    prompts = [tok.chat_prompt_ids(e.prompt) for e in gsm8k_examples("tasks", args.n + args.drift, 0)]
    params = dict(OURS[args.setting][2], gen_length=args.max_tokens)

    decode(model, prompts[:1], "speculative", eos_ids=eos, **params)  # warm-up (and the table, measured)
    table = costs.cost_model(model)
    before = table.table()
    passes = []
    for name, ps in (("first", prompts[: args.n]), ("between", prompts[args.n:]), ("first again", prompts[: args.n])):
        tokens = forwards = 0
        start = time.perf_counter()
        for p in ps:
            r = decode(model, [p], "speculative", eos_ids=eos, **params)[0]
            tokens, forwards = tokens + len(r.tokens), forwards + r.forwards
        seconds = time.perf_counter() - start
        passes.append(dict(name=name, prompts=len(ps), tokens=tokens, forwards=forwards, seconds=seconds))
        print(f"{name} ({len(ps)} prompts): TPF {tokens / max(forwards, 1):.2f}, "
              f"{1000 * seconds / max(forwards, 1):.1f} ms / step", flush=True)
    after = table.table()
    print("\n| rows | tokens | ms before | ms after | after / before |\n|---|---|---|---|---|")
    for r, ts, s0, s1 in zip(before["rows"], before["tokens"], before["seconds"], after["seconds"]):
        for t, a, b in zip(ts, s0, s1):
            print(f"| {r:g} | {t:g} | {1000 * a:.1f} | {1000 * b:.1f} | {b / a:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, passes=passes,
                                   table_before=before, table_after=after), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
