"""Where a SmolLM2 decode step's time goes, per setting of smollm2_speculative.py, on a few prompts: a
quick timed look before a full-set run.

    python benchmarks/smollm2_steps.py --n 12 --only "base ar,speculative +lookup,speculative +lookup +fork price 0.25"
    python benchmarks/smollm2_steps.py --n 12 --frozen-costs benchmarks/results/smollm2_costs_intel_1thread.json

The first --n GSM8K test questions (smollm2_speculative.py's prompts), each decoded alone (batch 1)
after one warm-up decode, every setting on the adapted model (base ar too: its clean tokens compute
what the base computes). Per setting: TPF, TPS, seconds per step, the share of it inside the model's
forward (the rest is the decoder's host work), the tokens each decode forward fed (prefills left
out), and what the cost table the policy read says those forwards cost (modelled ms / step): where
it is close to the forward's own time, the policy's choices were priced right; the JSON keeps the
table as it was after the warm-up and after the last prompt (a live table moves). --frozen-costs has
the policy read that table, frozen, instead of the machine's measured one. Time only on an idle
machine. Writes JSON (--out) and prints a markdown table.
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


class ForwardTimer:
    """Every forward's fed tokens and seconds (the model's forward wrapped)."""

    def __init__(self, model) -> None:
        self.model, self.inner, self.events = model, model.forward, []
        model.forward = self

    def __call__(self, ids, *args, **kwargs):
        start = time.perf_counter()
        out = self.inner(ids, *args, **kwargs)  # (the decoder brings its result to the host after)
        self.events.append((ids.numel(), time.perf_counter() - start))
        return out

    def remove(self) -> None:
        del self.model.forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--n", type=int, default=12, help="the first N GSM8K test questions")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="base ar,speculative +lookup,speculative +lookup +fork price 0.25",
                    help=f"comma-separated settings of smollm2_speculative.py ({', '.join(OURS)})")
    ap.add_argument("--frozen-costs", metavar="JSON", help="the cost table the policy reads, frozen")
    ap.add_argument("--out", default="benchmarks/results/smollm2_steps.json")
    args = ap.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in OURS or OURS[n][0].endswith(" compiled") or n.startswith("refusion")]
    if unknown:
        ap.error(f"unknown or unsupported settings {unknown}: eager `ar` and `speculative` ones of "
                 f"smollm2_speculative.py only")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    eos = sorted(set(model.config.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    prompts = [tok.chat_prompt_ids(e.prompt) for e in gsm8k_examples("tasks", args.n, 0)]
    if args.frozen_costs:
        table = costs.CostModel.from_table(json.loads(Path(args.frozen_costs).read_text()), frozen=True)
        costs.COSTS[costs.cost_key(model)] = table
    rows = []
    for name in names:
        _, decoder, params = OURS[name]
        params = dict(params, gen_length=args.max_tokens)
        decode(model, prompts[:1], decoder, eos_ids=eos, **params)  # warm-up (and the cost table, measured)
        warm_table = costs.cost_model(model).table() if decoder == "speculative" else None
        timer = ForwardTimer(model)
        tokens = forwards = 0
        seconds = 0.0
        decode_events = []
        for p in prompts:
            start, first = time.perf_counter(), len(timer.events)
            r = decode(model, [p], decoder, eos_ids=eos, **params)[0]
            seconds += time.perf_counter() - start
            tokens, forwards = tokens + len(r.tokens), forwards + r.forwards
            decode_events += timer.events[first + 1:]  # (the first forward is the prompt's prefill)
        timer.remove()
        fed = [w for w, _ in decode_events]
        table = costs.cost_model(model) if decoder == "speculative" else None
        rows.append(dict(name=name, tokens=tokens, forwards=forwards, seconds=seconds,
                         forward_seconds=sum(s for _, s in timer.events),
                         fed_per_step=sum(fed) / max(len(fed), 1),
                         decode_forward_ms=1000 * sum(s for _, s in decode_events) / max(len(fed), 1),
                         modelled_ms=1000 * float(table(1, fed).sum()) / len(fed) if table is not None and fed else None,
                         table_after_warm_up=warm_table, table_after=table.table() if table is not None else None))
        print(f"{name}: TPF {tokens / forwards:.2f} TPS {tokens / seconds:.1f}", flush=True)
    ar = next((r for r in rows if r["name"] == "base ar"), None)
    print("\n| setting | TPF | TPS | TPS / AR | ms / step | in forward | fed / step | forward ms / step "
          "| modelled ms / step |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tps = r["tokens"] / r["seconds"]
        vs = f"{tps / (ar['tokens'] / ar['seconds']):.2f}x" if ar else "-"
        modelled = f"{r['modelled_ms']:.1f}" if r["modelled_ms"] is not None else "-"
        print(f"| {r['name']} | {r['tokens'] / r['forwards']:.2f} | {tps:.1f} | {vs} | "
              f"{1000 * r['seconds'] / r['forwards']:.1f} | {100 * r['forward_seconds'] / r['seconds']:.0f}% | "
              f"{r['fed_per_step']:.1f} | {r['decode_forward_ms']:.1f} | {modelled} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
