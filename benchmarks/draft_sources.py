"""Where a mask-adapted model's accepted drafts come from, and what feeding every draft would accept.

    python benchmarks/draft_sources.py --n-gsm8k 30 --n-humaneval 0
    python benchmarks/draft_sources.py --model runs/smollm2-refusion/train/adapter --n-gsm8k 10 --n-humaneval 10

`speculative` (cost widths, lookup on: a mask adapter's defaults) at batch 1, greedy, on the held-out prompts
benchmarks/smollm2_speculative.py uses. Each step feeds one draft: the masks' own, a copy of earlier
text (lookup), or a continuation from the lookup corpus. Per kind: the steps that fed it, the draft
tokens fed and accepted a step. And, since greedy output is fixed whatever is drafted, how far each
draft on offer after a step (the masks' draft the row held, the copy, the corpus's) would have been
accepted against the final output: "best of all" is the step-by-step maximum over them (each cut at
--cap tokens), an upper bound on what feeding them side by side (a tree of drafts) could accept.
Instruments the decoder by subclassing SpeculativeBatch (two internal methods); timing-free. Writes
JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from refusion.bundled import resolve_model
from refusion.decoding import widths
from refusion.decoding.params import SpeculativeParams
from refusion.decoding.speculative import SpeculativeBatch
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from smollm2_speculative import gsm8k_examples, humaneval_examples


def source(kind: int) -> str:
    return "masks" if kind < widths.LOOKUP else "copy" if kind < widths.PLAN else "plan" if kind == widths.PLAN \
        else "corpus"


class WatchedBatch(SpeculativeBatch):
    """A batch that records, per step of its (single) row: the response position, the kind of draft
    fed and its length; and after the step, every draft on offer."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.fed: list[tuple[int, int, int]] = []
        self.offers: list[tuple[int, dict[str, list[int]]]] = []

    def _forward(self, lo, hi, prefill, start) -> None:
        for q in self.running[lo:hi]:
            self.fed.append((len(q.res.tokens), q.kind, min(len(q.draft), q.width)))
        super()._forward(lo, hi, prefill, start)

    def _offer_drafts(self, seqs) -> None:
        for q in seqs:
            if q.done:
                continue
            on = {"masks": list(q.draft)} if q.kind < widths.LOOKUP else {}
            if q.index is not None:
                copy, _ = q.index.propose(q.p.draft_length)
                if copy:
                    on["copy"] = list(copy)
                if self.corpus is not None:
                    draft, _ = self.corpus.propose(q.index.tokens, q.p.draft_length)
                    if draft:
                        on["corpus"] = list(draft)
            self.offers.append((len(q.res.tokens), on))
        super()._offer_drafts(seqs)


def accepted(draft: list[int], output: list[int], at: int, cap: int) -> int:
    n = 0
    for a, b in zip(draft[:cap], output[at:]):
        if a != b:
            break
        n += 1
    return n


def measure(model, prompts: list[list[int]], max_tokens: int, cap: int) -> dict:
    per = defaultdict(lambda: dict(steps=0, fed=0, accepted=0))
    tokens = forwards = steps = 0
    outputs = []
    best = {"best of all": 0, "the draft fed": 0}
    for prompt in prompts:
        batch = WatchedBatch(model)
        batch.add(prompt, SpeculativeParams(gen_length=max_tokens, lookup=True), seed=0)
        result = None
        while len(batch):
            for _, result in batch.step():
                pass
        out = result.tokens
        outputs.append(out)
        tokens, forwards = tokens + len(out), forwards + result.forwards
        at = [g for g, _, _ in batch.fed] + [len(out)]
        for i, (g, kind, k) in enumerate(batch.fed[1:], 1):  # (the prefill fed no draft)
            j = at[i + 1] - g - 1  # draft tokens this step accepted: it committed them and one more
            p = per[source(kind) if k else "no draft"]
            p["steps"] += 1
            p["fed"] += k
            p["accepted"] += j
        for i, (g, on) in enumerate(batch.offers):  # the offers after step i feed step i + 1 (none after the last)
            steps += 1
            best["best of all"] += max([accepted(d, out, g, cap) for d in on.values()], default=0)
            best["the draft fed"] += at[i + 2] - at[i + 1] - 1
    return dict(tokens=tokens, forwards=forwards, tpf=tokens / forwards, kinds=dict(per), outputs=outputs,
                accepted_per_step={k: v / max(steps, 1) for k, v in best.items()}, steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--gsm8k", default="tasks")
    ap.add_argument("--humaneval", default="tasks")
    ap.add_argument("--n-gsm8k", type=int, default=30)
    ap.add_argument("--n-humaneval", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cap", type=int, default=8, help="draft tokens counted of each offer for 'best of all'")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/draft_sources.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = load_model(path)
    tok = Tokenizer.from_dir(path)
    benches = {"gsm8k": gsm8k_examples(args.gsm8k, args.n_gsm8k, 0) if args.n_gsm8k else [],
               "humaneval": humaneval_examples(args.humaneval, args.n_humaneval, 0) if args.n_humaneval else []}
    results = {}
    print("| benchmark | draft fed | steps | share of steps | draft tokens fed / step | accepted / step |")
    print("|---|---|---|---|---|---|")
    for bench, exs in benches.items():
        if not exs:
            continue
        r = results[bench] = measure(model, [tok.chat_prompt_ids(e.prompt) for e in exs], args.max_tokens, args.cap)
        total = sum(v["steps"] for v in r["kinds"].values())
        for kind, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["steps"]):
            print(f"| {bench} | {kind} | {v['steps']} | {v['steps'] / total:.0%} | {v['fed'] / v['steps']:.2f} | "
                  f"{v['accepted'] / v['steps']:.2f} |")
        a = r["accepted_per_step"]
        print(f"| {bench} | TPF {r['tpf']:.2f}; accepted a step: the draft fed {a['the draft fed']:.2f}, "
              f"best of all on offer (cut at {args.cap}) {a['best of all']:.2f} | | | | |")
    Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
