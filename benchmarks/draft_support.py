"""How far a copy and a corpus draft go, by how sure their source is: the split the decoder counts
its drafts' acceptance by (lookup.NgramIndex.support, corpus.LookupCorpus.offer; widths.lookup_kind,
widths.corpus_kind).

    python benchmarks/draft_support.py --results benchmarks/results/smollm2_speculative_s47_b1.json

Greedy output is fixed whatever is drafted, so the drafts on offer at every point of an answer
depend on the answer alone. This reads the base's answers from a smollm2_speculative.py result file
(its `base ar` rows, with the prompts that file's arguments name), walks each answer token by token,
and at every position counts how far the copy of earlier text and the lookup corpus's draft would
be accepted (cut at --cap tokens), per class:

- a copy by its support: its matched words occurred once before, or several times and their
  continuations agree on no token (split), one, two or three, or four and more (agreed); and for
  copies whose earlier occurrences agree on d >= 1 tokens, how often a token is accepted (given
  every one before it was) before the place they part, at it, and after it;
- a corpus draft by whether its first token was contested (fewer than half of the voting
  occurrences continue with it) and whether a copy was on offer beside it.

No model forward (the lookup corpus of --model is read); every position counted, not only those a
decoder would step at. Writes JSON and prints tables.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from refusion.bundled import resolve_model
from refusion.decoding.corpus import corpus_of
from refusion.decoding.lookup import COPY_AGREED, COPY_AGREED_1, COPY_AGREED_2, COPY_ONCE, COPY_SPLIT, NgramIndex
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from draft_sources import shared_prefix
from smollm2_speculative import gsm8k_examples, humaneval_examples

SUPPORT_NAMES = {COPY_ONCE: "once", COPY_SPLIT: "split", COPY_AGREED_1: "agree on 1",
                 COPY_AGREED_2: "agree on 2-3", COPY_AGREED: "agree on 4+"}


def walk(prompt: list[int], answer: list[int], corpus, cap: int, counts: dict) -> None:
    index = NgramIndex(prompt + answer[:1])
    for g in range(1, len(answer)):
        truth = answer[g:g + cap]
        copy, n = index.propose(cap)
        if copy:
            support = index.support(n)
            got = shared_prefix(copy, truth)
            counts["copy"][SUPPORT_NAMES[support]].append(got)
            if support != COPY_ONCE:
                _, d = index.agreement(n, cap)
                for i in range(min(got + 1, len(truth))):  # each token reached: accepted or not
                    where = "before" if i < d else "at" if i == d else "after"
                    counts["rate"][where].append(int(i < got))
        if corpus is not None:
            draft, _, contested = corpus.offer(index.tokens, cap)
            if draft:
                name = ("contested" if contested else "most agree") + (", beside a copy" if copy else "")
                counts["corpus"][name].append(shared_prefix(draft, truth))
        index.extend(answer[g:g + 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results/smollm2_speculative_s47_b1.json",
                    help="a smollm2_speculative.py result file with base ar rows (the answers)")
    ap.add_argument("--model", default="smollm2-refusion", help="the model whose lookup corpus drafts")
    ap.add_argument("--cap", type=int, default=8, help="draft tokens counted")
    ap.add_argument("--out", default="benchmarks/results/draft_support.json")
    args = ap.parse_args()
    saved = json.loads(Path(args.results).read_text())
    run = saved["args"]
    path = resolve_model(args.model)
    corpus, tok = corpus_of(load_model(path)), Tokenizer.from_dir(path)
    results = {}
    for bench, examples in (("gsm8k", gsm8k_examples), ("humaneval", humaneval_examples)):
        rows = [r for r in saved["rows"] if r["name"] == "base ar" and r["bench"] == bench]
        if not rows or not run.get(f"n_{bench}"):
            continue
        answers = rows[0]["outputs"]
        answers = json.loads(answers) if isinstance(answers, str) else answers
        exs = examples(run[bench], run[f"n_{bench}"], run.get("seed", 0))
        if len(exs) != len(answers):
            raise SystemExit(f"{args.results}: {len(answers)} {bench} answers for {len(exs)} prompts")
        counts: dict = defaultdict(lambda: defaultdict(list))
        for e, a in zip(exs, answers):
            walk(tok.chat_prompt_ids(e.prompt), a, corpus, args.cap, counts)
        results[bench] = {part: {name: dict(positions=len(v), mean=sum(v) / len(v)) for name, v in per.items()}
                          for part, per in counts.items()}
    print(f"| benchmark | draft | class | positions | accepted (cut at {args.cap}) |\n|---|---|---|---|---|")
    for bench, r in results.items():
        for part in ("copy", "corpus"):
            for name, v in sorted(r.get(part, {}).items()):
                print(f"| {bench} | {part} | {name} | {v['positions']} | {v['mean']:.2f} |")
    print("\n| benchmark | a copy's token, where its earlier occurrences agree on d tokens | tokens reached | "
          "accepted |\n|---|---|---|---|")
    for bench, r in results.items():
        for where in ("before", "at", "after"):
            v = r.get("rate", {}).get(where)
            if v:
                print(f"| {bench} | {where} the d-th | {v['positions']} | {v['mean']:.3f} |")
    Path(args.out).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
