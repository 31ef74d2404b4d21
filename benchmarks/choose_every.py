"""How often a batch's cost policy should re-choose its widths (widths.CHOOSE_EVERY): the default
`speculative` with the choice every 1, 2, 3, ... steps, against fixed widths 8 and 16 and `ar`.

    python benchmarks/choose_every.py --model tests/fixtures/refusion-words --tasks sort,add,repeat
    python benchmarks/choose_every.py --model src/refusion/assets/refusion-tiny --tasks sort,add,repeat,code \
        --rounds 8 --temperature 0.7

Every setting decodes the same held-out prompts batch by batch in turn (the order rotating), each
with its own pooled acceptance counts and the model's one cost table, for --rounds rounds; a cell is
the median over rounds of the setting's TPS / AR in that round. Writes JSON and prints a table.
Nothing else should run on the machine while this does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from refusion.decoding import decode, widths
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.tasks import get_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True, help="comma-separated task names (their test split is used)")
    ap.add_argument("--n", type=int, default=16, help="prompts per task")
    ap.add_argument("--gen-length", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--every", default="1,2,3,4", help="comma-separated CHOOSE_EVERY values to compare")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/choose_every_<model dir name>.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in args.tasks.split(",")
               for ex in get_task(name).load("test", n=args.n, seed=0)]
    L, t = args.gen_length, args.temperature
    settings = [("ar", "ar", dict(max_new_tokens=L, temperature=t), widths.CHOOSE_EVERY)]
    settings += [(f"cost, every {e}", "speculative", dict(gen_length=L, temperature=t), int(e))
                 for e in args.every.split(",")]
    settings += [(f"fixed {w}", "speculative", dict(gen_length=L, temperature=t, widths="fixed", draft_length=w),
                  widths.CHOOSE_EVERY) for w in (8, 16)]
    priors = {name: widths.Acceptance() for name, *_ in settings}
    eos = model.config.eos_ids

    def run(name: str, decoder: str, params: dict, every: int, batch: list[list[int]]):
        widths.PRIORS[model], widths.CHOOSE_EVERY = priors[name], every
        return decode(model, batch, decoder, eos_ids=eos, seed=0, **params)

    for s in settings:  # warm-up: the cost table is measured here, untimed
        run(*s, prompts[: args.batch_size])
    ratios: dict[str, list[float]] = {name: [] for name, *_ in settings}
    counts = {name: [0, 0] for name, *_ in settings}  # tokens, forwards
    for r in range(args.rounds):
        seconds = dict.fromkeys(ratios, 0.0)
        for n, i in enumerate(range(0, len(prompts), args.batch_size)):
            for k in np.roll(np.arange(len(settings)), -(n + r)).tolist():
                name = settings[k][0]
                start = time.perf_counter()
                res = run(*settings[k], prompts[i: i + args.batch_size])
                seconds[name] += time.perf_counter() - start
                counts[name][0] += sum(len(x.tokens) for x in res)
                counts[name][1] += sum(x.forwards for x in res)
        for name in ratios:  # (every setting commits the same tokens: TPS / AR is a ratio of seconds)
            ratios[name].append(seconds["ar"] / seconds[name])
    rows = [dict(name=name, tps_vs_ar=statistics.median(ratios[name]), rounds=ratios[name],
                 tpf=counts[name][0] / counts[name][1]) for name in ratios]
    print(f"\n{model_dir.name}, batch {args.batch_size}, {args.threads} thread(s), T = {t:g}, {args.rounds} rounds\n")
    print("| setting | TPS / AR (median of rounds) | TPF |\n|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['tps_vs_ar']:.3f}x | {row['tpf']:.2f} |")
    out = Path(args.out or f"benchmarks/results/choose_every_{model_dir.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=str(model_dir), args=vars(args), torch=torch.__version__, rows=rows), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
