"""How sure the lookup corpus's vote is, against how often the model then writes the token it voted for.

    python benchmarks/corpus_votes.py --n-gsm8k 20 --n-humaneval 10 --frozen-costs benchmarks/results/smollm2_costs_frozen.json

`speculative` at batch 1, greedy, lookup on (a mask adapter's defaults), on the held-out prompts of
benchmarks/smollm2_speculative.py, with the corpus drafting as it did before its vote's cut
(`min_share` 0: corpus.MIN_SHARE is what this measures). After every step, the corpus's draft for the
row is voted again here, keeping each token's share: of the occurrences still voting (those that
agreed on every token before it), the part that continue with it. Since greedy output is fixed
whatever is drafted, each draft is then checked against the final output: per share bucket, how many
drafted tokens were reached (every token before them right) and how many of those were right. Also
per whether a copy of the sequence's own text was on offer beside the corpus's draft (widths.corpus_kind
counts the two apart): how far each went. Timing-free. Writes JSON and prints tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from refusion.bundled import resolve_model
from refusion.decoding import costs
from refusion.decoding.corpus import LookupCorpus
from refusion.decoding.params import SpeculativeParams
from refusion.decoding.speculative import SpeculativeBatch
from refusion.decoding.speculative_policy import FeedPolicy
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from draft_sources import frozen_costs, shared_prefix
from smollm2_speculative import gsm8k_examples, humaneval_examples

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)  # share buckets [lo, hi); the last is a unanimous vote


def voted(corpus: LookupCorpus, history: list[int], k: int) -> tuple[list[int], list[float]]:
    """The corpus's draft of up to k tokens after `history`, uncut, and each token's share of the vote."""
    t = corpus.tokens
    at, n = corpus.occurrences(history)
    draft, shares = [], []
    if n:
        for j in range(k):
            values, counts = np.unique(t[at + j], return_counts=True)
            i = len(counts) - 1 - int(counts[::-1].argmax())
            if values[i] < 0:
                break
            draft.append(int(values[i]))
            shares.append(float(counts[i] / len(at)))
            at = at[t[at + j] == values[i]]
    return draft, shares


class VotedPolicy(FeedPolicy):
    """Records, after each step, the corpus's draft with its shares and the copy on offer (if any)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.corpus.min_share = 0.0  # (the drafts as they were before the cut)
        self.seen: list[tuple[int, list[int], list[float], list[int]]] = []

    def offer_drafts(self, seqs) -> None:
        for q in seqs:
            if not q.done and q.index is not None:
                copy, _ = q.index.propose(q.p.draft_length)
                draft, shares = voted(self.corpus, q.index.tokens, q.p.draft_length)
                if draft:
                    self.seen.append((len(q.res.tokens), draft, shares, list(copy)))
        super().offer_drafts(seqs)


def measure(model, prompts: list[list[int]], max_tokens: int) -> dict:
    reached, right = np.zeros(len(BUCKETS)), np.zeros(len(BUCKETS))
    went = {False: [0, 0, 0], True: [0, 0, 0]}  # copy on offer -> [drafts, corpus accepted, copy accepted]
    for prompt in prompts:
        batch = SpeculativeBatch(model, policy=VotedPolicy(model))
        batch.add(prompt, SpeculativeParams(gen_length=max_tokens, lookup=True), seed=0)
        result = None
        while len(batch):
            for _, result in batch.step():
                pass
        out = result.tokens
        for g, draft, shares, copy in batch.policy.seen:
            j = shared_prefix(draft, out[g:])
            for i, share in enumerate(shares[: j + 1]):  # the tokens reached
                b = len(BUCKETS) - 1 if share >= 1.0 else int(np.searchsorted(BUCKETS, share, "right")) - 1
                reached[b] += 1
                right[b] += i < j
            w = went[bool(copy)]
            w[0], w[1], w[2] = w[0] + 1, w[1] + j, w[2] + shared_prefix(copy, out[g:])
    return dict(buckets=list(BUCKETS), reached=reached.tolist(), right=right.tolist(),
                beside_copy={str(k): dict(drafts=v[0], corpus_accepted=v[1] / max(v[0], 1), copy_accepted=v[2] / max(v[0], 1))
                             for k, v in went.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-refusion")
    ap.add_argument("--n-gsm8k", type=int, default=20)
    ap.add_argument("--n-humaneval", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--frozen-costs", metavar="JSON", help="the forward costs from this file (draft_sources.py)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/corpus_votes.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = load_model(path)
    tok = Tokenizer.from_dir(path)
    if args.frozen_costs:
        costs.COSTS[costs.cost_key(model)] = frozen_costs(model, Path(args.frozen_costs))
    benches = {"gsm8k": gsm8k_examples("tasks", args.n_gsm8k, 0) if args.n_gsm8k else [],
               "humaneval": humaneval_examples("tasks", args.n_humaneval, 0) if args.n_humaneval else []}
    results = {b: measure(model, [tok.chat_prompt_ids(e.prompt) for e in exs], args.max_tokens)
               for b, exs in benches.items() if exs}
    print("| benchmark | share of the vote | tokens reached | the model's next token |\n|---|---|---|---|")
    for b, r in results.items():
        for i, lo in enumerate(BUCKETS):
            name = "1 (unanimous)" if lo == 1.0 else f"[{lo:.1f}, {BUCKETS[i + 1]:.1f})"
            print(f"| {b} | {name} | {r['reached'][i]:.0f} | {r['right'][i] / max(r['reached'][i], 1):.0%} |")
    print("\n| benchmark | a copy on offer | corpus drafts | corpus accepted | copy accepted |\n|---|---|---|---|---|")
    for b, r in results.items():
        for k, v in r["beside_copy"].items():
            print(f"| {b} | {k} | {v['drafts']} | {v['corpus_accepted']:.2f} | {v['copy_accepted']:.2f} |")
    Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
