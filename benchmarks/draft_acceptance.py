"""How far a mask adapter's drafts go, independent of timing: `speculative` at fixed widths.

    python benchmarks/draft_acceptance.py --models smollm2-refusion,runs/smollm2-refusion/features-top4/adapter
    python benchmarks/draft_acceptance.py --models smollm2-refusion --redraft both --draft-lengths 2,3,4
    python benchmarks/draft_acceptance.py --models smollm2-refusion --after-miss both --draft-lengths 2,4,8

With `widths fixed` every step feeds the same draft and mask counts whatever a forward costs, so
tokens per forward (TPF) measures the drafts alone: 1 + the accepted draft tokens per step. The
default `cost` widths also weigh each width's measured cost, which on a CPU makes TPF depend on the
machine. Greedy, batch 1, on held-out prompts (GSM8K test questions, HumanEval prompts, as
benchmarks/smollm2_speculative.py asks them); every output is the base model's greedy output either
way. Writes JSON (per model, benchmark and draft length: tokens, forwards, TPF) and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from refusion.bundled import resolve_model
from refusion.decoding import decode
from refusion.decoding.speculative import fresh_after_miss_by_default
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from smollm2_speculative import gsm8k_examples, humaneval_examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-refusion", help="comma-separated model names or directories "
                    "(an adapter directory attaches to its base)")
    ap.add_argument("--gsm8k", default="tasks", help="'tasks' (refusion.tasks) or a GSM8K-format test JSONL")
    ap.add_argument("--humaneval", default="tasks", help="'tasks' or a HumanEval JSONL(.gz)")
    ap.add_argument("--n-gsm8k", type=int, default=20)
    ap.add_argument("--n-humaneval", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-lengths", default="1,3", help="comma-separated: draft tokens per step (masks: one more)")
    ap.add_argument("--seed", type=int, default=0, help="of the sample of prompts")
    ap.add_argument("--redraft", default="off", choices=["off", "on", "both"],
                    help="speculative's redraft blocks (a fresh draft after every rejection): without, with, or both")
    ap.add_argument("--after-miss", default="default", choices=["default", "fresh", "rest", "both"],
                    help="after a rejection: the model's default, fresh masks (fresh_after_miss), the rest of the "
                         "rejected draft (spec section 7), or both")
    ap.add_argument("--out", default="benchmarks/results/draft_acceptance.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    benches = {"gsm8k": gsm8k_examples(args.gsm8k, args.n_gsm8k, args.seed),
               "humaneval": humaneval_examples(args.humaneval, args.n_humaneval, args.seed)}
    rows = []
    redrafts = {"off": [False], "on": [True], "both": [False, True]}[args.redraft]
    after_miss = {"default": [None], "fresh": [True], "rest": [False], "both": [False, True]}[args.after_miss]
    for name in args.models.split(","):
        path = resolve_model(name)
        model, tok = load_model(path).eval(), Tokenizer.from_dir(path)
        if model.config.mask_token_id is None:
            raise SystemExit(f"{name}: a model without a mask token drafts nothing")
        eos = sorted(set(model.config.eos_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
        for bench, exs in benches.items():
            prompts = [tok.chat_prompt_ids(e.prompt) for e in exs]
            for k, redraft, fresh in itertools.product((int(x) for x in args.draft_lengths.split(",")), redrafts,
                                                        after_miss):
                res = decode(model, prompts, "speculative", eos_ids=eos, gen_length=args.max_tokens, widths="fixed",
                             draft_length=k, mask_length=k + 1, lookup=False, redraft=redraft,
                             fresh_after_miss=fresh)  # the masks alone
                tokens, forwards = sum(len(r.tokens) for r in res), sum(r.forwards for r in res)
                fed = sum(r.tokens_fed for r in res)
                fresh = fresh_after_miss_by_default(model.config) if fresh is None else fresh
                rows.append(dict(model=name, bench=bench, draft_length=k, redraft=redraft, fresh_after_miss=fresh,
                                 prompts=len(prompts), tokens=tokens, forwards=forwards, tokens_fed=fed,
                                 tpf=tokens / forwards))
                print(f"{name:<48} {bench:<9} draft {k:>2}{' redraft' if redraft else ''}"
                      f"{' fresh' if fresh else ' rest'} after a miss  TPF {tokens / forwards:.3f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), torch=torch.__version__, rows=rows), indent=1))
    print("\n| model | benchmark | draft tokens per step | redraft | after a miss | tokens | forwards "
          "| tokens fed per forward | TPF |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['bench']} | {r['draft_length']} | {'yes' if r['redraft'] else 'no'} | "
              f"{'fresh' if r['fresh_after_miss'] else 'rest'} | {r['tokens']} | {r['forwards']} | "
              f"{r['tokens_fed'] / r['forwards']:.1f} | {r['tpf']:.3f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
