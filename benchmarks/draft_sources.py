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

Two finer questions, with the same bookkeeping:
- "alternatives": per set of drafts on offer and the one the row went on to feed, how far each
  would have been accepted (cut at --cap): how well the row's choice among them does;
- "branches": within a forward of --budget tokens (x and the drafts), the draft the row feeds cut
  at a tokens (each a in turn), and beside it in the rest the best other offer (after the prefix it
  shares with the first, which it sees: a two-branch tree), against that draft alone in all of them.
  (Accepted tokens only: what a tree would cost per forward is not modelled.)

--corpus-fraction f decodes with a sample of the lookup corpus's answers (each kept with chance f,
seeded): whether more answers would draft more. --corpus-where-no-copy offers a corpus draft only
where the row has no copy on offer (an experiment on the choice). --frozen-costs measures the forward
costs once into a JSON file, or reads them from it, and keeps them (the widths then follow the same
numbers in every run given that file, so two runs differ only by what they change; by default the
costs follow each step's timing), and then also reports tokens per modelled second: the tokens over
the frozen table's seconds for every forward's width (prefills included, host work not), a speed
comparison between two settings that no timing noise moves. Instruments the decoder by subclassing
SpeculativeBatch (its forward) and FeedPolicy (its offers); timing-free. Writes JSON and prints tables.

    python benchmarks/draft_sources.py --n-gsm8k 30 --n-humaneval 15 --corpus-fraction 0.25 --out /tmp/quarter.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from refusion.bundled import resolve_model
from refusion.decoding import costs, widths
from refusion.decoding.corpus import LookupCorpus
from refusion.decoding.costs import CostModel
from refusion.decoding.params import SpeculativeParams
from refusion.decoding.speculative import SpeculativeBatch
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from smollm2_speculative import gsm8k_examples, humaneval_examples


def source(kind: int) -> str:
    return "masks" if kind < widths.LOOKUP else "copy" if kind < widths.PLAN else "plan" if kind == widths.PLAN \
        else "corpus"


def corpus_sample(corpus: LookupCorpus | None, fraction: float, seed: int = 0) -> LookupCorpus | None:
    """The corpus of a sample of `corpus`'s answers, each kept with chance `fraction` (seeded)."""
    if corpus is None or fraction >= 1:
        return corpus
    t = corpus.tokens
    ends = np.flatnonzero(t == -1)
    answers = np.split(t, ends[:-1] + 1)  # (each with its closing -1)
    keep = np.random.default_rng(seed).random(len(answers)) < fraction
    kept = [a for a, k in zip(answers, keep) if k]
    return LookupCorpus(np.concatenate(kept)) if kept else None


class CorpusWhereNoCopy:
    """A lookup corpus that proposes nothing to a row a copy is on offer to (WatchedBatch tells it
    before each row's offers: `copy_on_offer`)."""

    def __init__(self, corpus: LookupCorpus) -> None:
        self.corpus, self.copy_on_offer = corpus, False

    def offer(self, history, k: int) -> tuple[list[int], int, bool]:
        return ([], 0, False) if self.copy_on_offer else self.corpus.offer(history, k)

    def propose(self, history, k: int) -> tuple[list[int], int]:
        return self.offer(history, k)[:2]


class WatchedPolicy(FeedPolicy):
    """A batch's choices that record, after each step of its (single) row, every draft on offer and
    which of them the row holds."""

    def __init__(self, model, cost: CostModel | None = None, corpus_fraction: float = 1.0,
                 corpus_where_no_copy: bool = False) -> None:
        super().__init__(model, cost)
        self.corpus = corpus_sample(self.corpus, corpus_fraction)
        if corpus_where_no_copy and self.corpus is not None:
            self.corpus = CorpusWhereNoCopy(self.corpus)
        self.offers: list[tuple[int, dict[str, list[int]]]] = []
        self.holding: list[str] = []  # after each step's offers: the source of the draft the row holds

    def offer_drafts(self, seqs) -> None:
        for q in seqs:
            if q.done:
                continue
            on = {"masks": list(q.draft)} if q.kind < widths.LOOKUP and q.draft else {}
            if q.index is not None:
                copy, _ = q.index.propose(q.p.draft_length)
                if copy:
                    on["copy"] = list(copy)
                if isinstance(self.corpus, CorpusWhereNoCopy):  # (one row: the next proposal is this row's)
                    self.corpus.copy_on_offer = bool(copy)
                if self.corpus is not None:
                    draft, _ = self.corpus.propose(q.index.tokens, q.p.draft_length)
                    if draft:
                        on["corpus"] = list(draft)
            self.offers.append((len(q.res.tokens), on))
        super().offer_drafts(seqs)
        for q in seqs:
            if not q.done:
                self.holding.append(source(q.kind) if q.draft else "none")


class WatchedBatch(SpeculativeBatch):
    """A batch that records, per step of its (single) row: the response position, the kind of draft
    fed and its length; and (its policy, WatchedPolicy) after the step, the drafts on offer."""

    def __init__(self, model, corpus_fraction: float = 1.0, corpus_where_no_copy: bool = False, **k) -> None:
        policy = WatchedPolicy(model, k.get("cost"), corpus_fraction, corpus_where_no_copy)
        super().__init__(model, policy=policy, **k)
        self.fed: list[tuple[int, int, int]] = []
        self.widths: list[int] = []  # every forward's tokens (one row: the width of the ids fed), prefills too

    def _forward(self, lo, hi, prefill, start) -> None:
        for q in self.running[lo:hi]:
            self.fed.append((len(q.res.tokens), q.kind, min(len(q.draft), q.width)))
        hook = self.model.register_forward_pre_hook(lambda m, args, kw: self.widths.append(int(args[0].shape[1])),
                                                    with_kwargs=True)
        try:
            super()._forward(lo, hi, prefill, start)
        finally:
            hook.remove()


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accepted(draft: list[int], output: list[int], at: int, cap: int) -> int:
    """How far `draft`, cut at `cap` tokens, would be accepted at response position `at`."""
    return shared_prefix(draft[:cap], output[at:])


def two_branches(held: list[int], others: list[list[int]], output: list[int], at: int, budget: int, a: int) -> int:
    """Draft tokens accepted by a two-branch step of `budget` tokens: `held` cut at a tokens, and in
    the budget - 1 - a left the best of `others` after the prefix it shares with `held`'s cut (a
    branch that sees that prefix, and x)."""
    first = held[:a]
    j = accepted(first, output, at, a)
    best = j
    for b in others:
        p = shared_prefix(first, b)
        if j >= p:  # (it leaves the first, or goes on after it, where the first was right so far)
            best = max(best, accepted(b, output, at, p + budget - 1 - len(first)))
    return best


def measure(model, prompts: list[list[int]], max_tokens: int, cap: int, budget: int = 8,
            corpus_fraction: float = 1.0, corpus_where_no_copy: bool = False, sampler: bool = True,
            fork: bool = False, cost: CostModel | None = None, price: CostModel | None = None,
            width_price: float = 1.0) -> dict:
    """The counts on `prompts`; cost: the frozen table the decode's choices read (--frozen-costs),
    which then prices every forward (modelled_seconds, modelled_tps) unless `price` (--price-costs)
    is given."""
    per = defaultdict(lambda: dict(steps=0, fed=0, accepted=0))
    tokens = forwards = steps = 0
    outputs = []
    best = {"best of all": 0, "the draft fed": 0}
    alternatives: dict[str, dict] = {}
    branches = dict(alone=0, **{f"first cut at {a}": 0 for a in range(1, budget - 1)})
    fed_widths = []
    for prompt in prompts:
        batch = WatchedBatch(model, corpus_fraction=corpus_fraction, corpus_where_no_copy=corpus_where_no_copy)
        batch.add(prompt, SpeculativeParams(gen_length=max_tokens, lookup=True, sampler=sampler, fork=fork,
                                              width_price=width_price), seed=0)
        result = None
        while len(batch):
            for _, result in batch.step():
                pass
        out = result.tokens
        outputs.append(out)
        fed_widths += batch.widths
        tokens, forwards = tokens + len(out), forwards + result.forwards
        at = [g for g, _, _ in batch.fed] + [len(out)]
        for i, (g, kind, k) in enumerate(batch.fed[1:], 1):  # (the prefill fed no draft)
            j = at[i + 1] - g - 1  # draft tokens this step accepted: it committed them and one more
            p = per[source(kind) if k else "no draft"]
            p["steps"] += 1
            p["fed"] += k
            p["accepted"] += j
        for i, ((g, on), held) in enumerate(zip(batch.policy.offers, batch.policy.holding)):  # the offers after step i feed step i + 1
            steps += 1
            best["best of all"] += max([accepted(d, out, g, cap) for d in on.values()], default=0)
            best["the draft fed"] += at[i + 2] - at[i + 1] - 1
            alt = alternatives.setdefault(f"{'+'.join(on) or 'none'} -> {held}", dict(steps=0, **{k: 0 for k in on}))
            alt["steps"] += 1
            for k, d in on.items():
                alt[k] += accepted(d, out, g, cap)
            if held in on:
                branches["alone"] += accepted(on[held], out, g, budget - 1)
                others = [d for k, d in on.items() if k != held]
                for a in range(1, budget - 1):
                    branches[f"first cut at {a}"] += two_branches(on[held], others, out, g, budget, a)
    per_step = {k: v / max(steps, 1) for k, v in branches.items()}
    for alt in alternatives.values():
        for k in alt:
            if k != "steps":
                alt[k] /= alt["steps"]
    price = price if price is not None else cost
    modelled = float(price(1, fed_widths).sum()) if price is not None else None
    return dict(tokens=tokens, forwards=forwards, tpf=tokens / forwards, kinds=dict(per), outputs=outputs,
                accepted_per_step={k: v / max(steps, 1) for k, v in best.items()}, steps=steps,
                alternatives=alternatives, branches=dict(budget=budget, accepted_per_step=per_step),
                modelled_seconds=modelled, modelled_tps=None if modelled is None else tokens / modelled)


def frozen_costs(model, path: Path) -> CostModel:
    """The model's cost table read from `path`, or measured and written there; frozen either way."""
    if path.is_file():
        t = json.loads(path.read_text())
    else:
        t = costs.cost_model(model).table()
        path.write_text(json.dumps(t))
    return CostModel.from_table(t, frozen=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--gsm8k", default="tasks")
    ap.add_argument("--humaneval", default="tasks")
    ap.add_argument("--n-gsm8k", type=int, default=30)
    ap.add_argument("--n-humaneval", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--cap", type=int, default=8, help="draft tokens counted of each offer for 'best of all'")
    ap.add_argument("--budget", type=int, default=8, help="tokens of the forward in the two-branch estimate")
    ap.add_argument("--corpus-fraction", type=float, default=1.0,
                    help="decode with this share of the lookup corpus's answers (seeded sample)")
    ap.add_argument("--corpus-where-no-copy", action="store_true",
                    help="offer corpus drafts only where no copy is on offer (an experiment)")
    ap.add_argument("--no-sampler", action="store_true",
                    help="the masks draft their argmax, without the model's sampler (model/mask_sampler.py)")
    ap.add_argument("--fork", action=argparse.BooleanOptionalAction, default=False,
                    help="decode with (--fork) or without (--no-fork) branches beside the first draft where they "
                         "pay (SpeculativeParams.fork; default: without, the decoder's default)")
    ap.add_argument("--width-price", type=float, default=1.0,
                    help="SpeculativeParams.width_price: the share of width's measured cost the policy counts")
    ap.add_argument("--frozen-costs", metavar="JSON",
                    help="the forward costs from this file (measured into it if it does not exist), kept "
                         "unchanged: runs given the same file compare exactly")
    ap.add_argument("--price-costs", metavar="JSON",
                    help="price the modelled seconds with this cost table instead of --frozen-costs' (the choices "
                         "still read --frozen-costs): what a policy given other costs than the machine's would cost")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="of the sample of prompts (smollm2_speculative.py's --seed)")
    ap.add_argument("--out", default="benchmarks/results/draft_sources.json")
    args = ap.parse_args()
    if not 0 < args.corpus_fraction <= 1:
        ap.error(f"--corpus-fraction must lie in (0, 1], got {args.corpus_fraction}")
    if args.budget < 3:
        ap.error(f"--budget must be at least 3 (x and a token of each branch), got {args.budget}")
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = load_model(path)
    tok = Tokenizer.from_dir(path)
    cost = None
    if args.frozen_costs:
        cost = costs.COSTS[costs.cost_key(model)] = frozen_costs(model, Path(args.frozen_costs))
    price = None
    if args.price_costs:
        if cost is None:
            ap.error("--price-costs prices what --frozen-costs chose: give both")
        price = CostModel.from_table(json.loads(Path(args.price_costs).read_text()), frozen=True)
    benches = {"gsm8k": gsm8k_examples(args.gsm8k, args.n_gsm8k, args.seed) if args.n_gsm8k else [],
               "humaneval": humaneval_examples(args.humaneval, args.n_humaneval, args.seed) if args.n_humaneval else []}
    results = {}
    print("| benchmark | draft fed | steps | share of steps | draft tokens fed / step | accepted / step |")
    print("|---|---|---|---|---|---|")
    for bench, exs in benches.items():
        if not exs:
            continue
        r = results[bench] = measure(model, [tok.chat_prompt_ids(e.prompt) for e in exs], args.max_tokens, args.cap,
                                     args.budget, args.corpus_fraction, args.corpus_where_no_copy,
                                     sampler=not args.no_sampler, fork=args.fork, cost=cost, price=price,
                                     width_price=args.width_price)
        total = sum(v["steps"] for v in r["kinds"].values())
        for kind, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["steps"]):
            print(f"| {bench} | {kind} | {v['steps']} | {v['steps'] / total:.0%} | {v['fed'] / v['steps']:.2f} | "
                  f"{v['accepted'] / v['steps']:.2f} |")
        a = r["accepted_per_step"]
        tps = f"; {r['modelled_tps']:.1f} tokens per modelled second" if r["modelled_tps"] else ""
        print(f"| {bench} | TPF {r['tpf']:.2f}{tps}; accepted a step: the draft fed {a['the draft fed']:.2f}, "
              f"best of all on offer (cut at {args.cap}) {a['best of all']:.2f} | | | | |")
    print(f"\n| benchmark | on offer -> held | steps | accepted of each (cut at {args.cap}) |\n|---|---|---|---|")
    for bench, r in results.items():
        for key, alt in sorted(r["alternatives"].items(), key=lambda kv: -kv[1]["steps"]):
            each = ", ".join(f"{k} {v:.2f}" for k, v in alt.items() if k != "steps")
            print(f"| {bench} | {key} | {alt['steps']} | {each} |")
    print(f"\n| benchmark | forward of {args.budget} tokens | accepted / step |\n|---|---|---|")
    for bench, r in results.items():
        for key, v in r["branches"]["accepted_per_step"].items():
            print(f"| {bench} | {'the held draft alone' if key == 'alone' else 'two branches, ' + key} | {v:.3f} |")
    Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
