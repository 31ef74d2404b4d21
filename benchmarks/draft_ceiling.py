"""How many tokens per forward the drafts that need no forward could reach: the ceiling of the copy,
the corpus and their other ways on, fed one beside another, on the base model's own greedy answers.

    python benchmarks/draft_ceiling.py --results benchmarks/results/smollm2_speculative_s47_b1.json

Greedy output is fixed whatever is drafted, so the drafts on offer at every point of an answer
depend on the answer alone: the copy of the text's own earlier words (lookup.NgramIndex.propose)
and the other ways the text went after them (NgramIndex.alternatives), the lookup corpus's vote
(corpus.LookupCorpus.propose) and its runner-up (LookupCorpus.runner_up). This reads the base's
answers from a smollm2_speculative.py result file (its `base ar` rows, with the prompts that file's
arguments name), walks each answer step by step, and counts the forwards a decoder would need if it
fed, every step:

- one draft: the copy where there is one, else the corpus's (uncut);
- the better of the copy and the corpus's (a decoder that always chose right, or fed both whole);
- the best of every draft on offer, alternatives included (uncut);
- within a forward of T tokens (x and the drafts): the first draft cut at a tokens, and after it
  the others, each from where it parts from the first (a branch, as `speculative --fork` feeds
  them) and cut at w tokens, as many as fit; the best (a, w) for each T.

TPF counts the prefill as one forward that commits one token. The masks' drafts are left out (they
need the model; the decoder feeds them on a few percent of steps), and a real decoder pays for its
choices' errors and for the widths it picks: these are ceilings for the drafts, not the decoder's
TPF. Writes JSON and prints a table. No model forward; about a minute per 100 answers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from refusion.bundled import resolve_model
from refusion.decoding.corpus import corpus_of
from refusion.decoding.lookup import NgramIndex
from refusion.decoding.params import MAX_BRANCHES
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from draft_sources import shared_prefix
from smollm2_speculative import gsm8k_examples, humaneval_examples

CAP = 32  # draft tokens looked at (the cost policy's default draft_length)


def offers_along(prompt: list[int], answer: list[int], corpus) -> list[dict]:
    """At each response position g >= 1 (the prefill commits position 0): the first draft (the copy,
    else the corpus's), the others (the corpus's beside a copy, then the alternatives), and the answer
    from g on."""
    index = NgramIndex(prompt + answer[:1])
    out = []
    for g in range(1, len(answer)):
        copy, _ = index.propose(CAP)
        voted, _ = corpus.propose(index.tokens, CAP) if corpus is not None else ([], 0)
        others = index.alternatives(CAP, MAX_BRANCHES) if copy else []
        if voted:
            runner_up = corpus.runner_up(index.tokens, voted, CAP)
            others = ([voted] if copy else []) + others + ([runner_up] if runner_up else [])
        out.append(dict(first=copy or voted, others=others, truth=answer[g:g + CAP]))
        index.extend(answer[g:g + 1])
    return out


def accepted_in(step: dict, T: int, a: int, w: int) -> int:
    """Draft tokens accepted by a forward of T tokens: the first draft cut at a, then branches of w."""
    first, truth = step["first"], step["truth"]
    a = min(a, len(first), T - 1)
    j = shared_prefix(first[:a], truth)
    best, room = j, T - 1 - a
    for other in step["others"]:
        at = shared_prefix(first, other)
        if at >= a or at >= len(other):  # (no branch: it parts after the cut, or is the first's prefix)
            continue
        n = min(w, room, len(other) - at)
        if n <= 0:
            break
        room -= n
        if j == at:  # tested: the first draft was rejected where this one parts from it
            best = max(best, min(shared_prefix(other, truth), at + n))
    return best


def tpf(steps: list[list[dict]], accepted) -> float:
    tokens = forwards = 0
    for answer in steps:
        g, f = 1, 1  # the prefill's forward and token
        while g < len(answer) + 1:
            g += accepted(answer[g - 1]) + 1
            f += 1
        tokens, forwards = tokens + len(answer) + 1, forwards + f
    return tokens / forwards


def measure(steps: list[list[dict]], budgets: list[int]) -> dict:
    both = lambda s: max(shared_prefix(d, s["truth"]) for d in [s["first"]] + s["others"][:1]) if s["first"] else 0
    r = {"one draft (the copy, else the corpus)": tpf(steps, lambda s: shared_prefix(s["first"], s["truth"])),
         "the better of the copy and the corpus": tpf(steps, both),
         "the best of every draft on offer": tpf(steps, lambda s: max(
             [shared_prefix(d, s["truth"]) for d in [s["first"]] + s["others"]]))}
    within = {}
    for T in budgets:
        grid = {(a, w): tpf(steps, lambda s: accepted_in(s, T, a, w)) for a in range(1, T) for w in (1, 2, 3, 4, 6, 8)}
        (a, w), best = max(grid.items(), key=lambda kv: kv[1])
        alone = tpf(steps, lambda s: accepted_in(s, T, T - 1, 0))
        within[str(T)] = dict(tpf=best, first=a, branch=w, first_alone=alone)
    return dict(ceilings=r, within=within)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results/smollm2_speculative_s47_b1.json",
                    help="a smollm2_speculative.py result file with base ar rows (the answers)")
    ap.add_argument("--model", default="smollm2-refusion", help="the model whose lookup corpus drafts")
    ap.add_argument("--n-gsm8k", type=int, default=None, help="the first n answers only (default: all)")
    ap.add_argument("--n-humaneval", type=int, default=None)
    ap.add_argument("--budgets", default="8,12,16", help="forward widths T (x and the drafts), comma-separated")
    ap.add_argument("--out", default="benchmarks/results/draft_ceiling.json")
    args = ap.parse_args()
    budgets = [int(t) for t in args.budgets.split(",")]
    if min(budgets) < 3:
        ap.error(f"--budgets must be at least 3 (x and a token of each branch), got {args.budgets}")
    saved = json.loads(Path(args.results).read_text())
    run = saved["args"]
    path = resolve_model(args.model)
    corpus, tok = corpus_of(load_model(path)), Tokenizer.from_dir(path)
    benches = {"gsm8k": (gsm8k_examples, run["gsm8k"], run["n_gsm8k"], args.n_gsm8k),
               "humaneval": (humaneval_examples, run["humaneval"], run["n_humaneval"], args.n_humaneval)}
    results = {}
    print("| benchmark | answers | drafts fed | TPF ceiling |\n|---|---|---|---|")
    for bench, (examples, source, n, first) in benches.items():
        rows = [r for r in saved["rows"] if r["name"] == "base ar" and r["bench"] == bench]
        if not rows or not n:
            continue
        answers = rows[0]["outputs"]
        answers = json.loads(answers) if isinstance(answers, str) else answers
        exs = examples(source, n, run.get("seed", 0))
        if len(exs) != len(answers):
            raise SystemExit(f"{args.results}: {len(answers)} {bench} answers for {len(exs)} prompts")
        pairs = list(zip(exs, answers))[:first]
        steps = [offers_along(tok.chat_prompt_ids(e.prompt), a, corpus) for e, a in pairs]
        r = results[bench] = dict(answers=len(pairs), **measure(steps, budgets))
        for name, v in r["ceilings"].items():
            print(f"| {bench} | {len(pairs)} | {name} | {v:.2f} |")
        for T, v in r["within"].items():
            print(f"| {bench} | {len(pairs)} | in {T} tokens: the first alone | {v['first_alone']:.2f} |")
            print(f"| {bench} | {len(pairs)} | in {T} tokens: the first cut at {v['first']}, branches of "
                  f"{v['branch']} | {v['tpf']:.2f} |")
    Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
