"""`refusion data`: download the real benchmarks' files into the cache (refusion.tasks.sources).
`refusion self-generate`: training data a model writes itself (refusion.training.self_generate).
`refusion lookup-corpus`: keep a model's own answers beside it as drafts (refusion.decoding.corpus)."""

from __future__ import annotations

import argparse
import sys

from refusion.cli.args import MODEL_HELP, positive_int, resolve_model_dir, seed_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    from refusion.tasks import sources

    p = sub.add_parser("data", help="download the real benchmarks (GSM8K, MATH, MBPP, HumanEval, ARC-C, MMLU)",
                       description=sources.__doc__)
    p.add_argument("names", nargs="*", help=f"benchmarks (default: all): {', '.join(sources.BENCHMARKS)}")
    p.add_argument("--list", action="store_true", help="list the benchmarks and whether they are cached")
    p.set_defaults(func=cmd_data)

    g = sub.add_parser("self-generate", help="training data: prompts answered by the model's own greedy output",
                       description=_doc_head())
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--prompts", required=True, help="comma-separated sources: gsm8k-train (shipped), gsm8k:FILE (a train split), "
                   "stdlib-functions, stdlib-methods, stdlib, jsonl:FILE")
    g.add_argument("--n", type=positive_int, help="prompts per source (a seeded sample; default: all, "
                   "1000 for stdlib)")
    g.add_argument("--seed", type=seed_int, default=0, help="of the sample of prompts")
    g.add_argument("--max-tokens", type=positive_int, default=256, help="longest response (tokens)")
    g.add_argument("--batch-size", type=positive_int, default=8, help="prompts decoded together")
    g.add_argument("--out", required=True, help="JSONL file, appended to: prompts already in it are skipped")
    g.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_self_generate)

    c = sub.add_parser("lookup-corpus", help="keep a model's own answers (self-generate's JSONL) beside it: "
                       "speculative decoding with lookup drafts what it usually writes next from them",
                       description=_corpus_doc())
    c.add_argument("data", help="JSONL with a \"response\" per line (refusion self-generate's output); "
                   "answers to training prompts only, never a test split")
    c.add_argument("--model", help="whose tokenizer encodes the answers: " + MODEL_HELP)
    c.add_argument("--out", required=True, help="the model or mask-adapter directory to keep the corpus in "
                   "(its lookup_corpus.safetensors)")
    c.set_defaults(func=cmd_lookup_corpus)


def _doc_head() -> str:
    from refusion.training import self_generate

    return self_generate.__doc__ or ""


def _corpus_doc() -> str:
    from refusion.decoding import corpus

    return corpus.__doc__ or ""


def cmd_data(args: argparse.Namespace) -> None:
    from refusion.tasks.sources import BENCHMARKS, benchmark_files, benchmarks_dir, cached

    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    if args.list:
        for n in BENCHMARKS:
            print(f"{n:15s} {'cached' if cached(n) else 'not downloaded':15s} {len(BENCHMARKS[n])} file(s)")
        return
    for n in names:
        benchmark_files(n)
        print(f"{n}: {len(BENCHMARKS[n])} file(s) ready", file=sys.stderr)
    print(benchmarks_dir())


def cmd_self_generate(args: argparse.Namespace) -> None:
    from refusion.model.checkpoint import load_model
    from refusion.model.tokenizer import Tokenizer
    from refusion.runtime import set_threads
    from refusion.training.self_generate import load_prompts, self_generate

    prompts = load_prompts(args.prompts, args.n, args.seed)  # bad sources fail before the model loads
    model_dir = resolve_model_dir(args)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    set_threads(args.threads)
    c = self_generate(model, tok, prompts, args.out, args.max_tokens, args.batch_size, progress=not args.no_progress)
    print(f"{args.out}: {c['written']} responses written ({c['finished']} ended within {args.max_tokens} tokens), "
          f"{c['skipped']} prompts already there; {c['retokenized']} responses re-encode to other tokens than the "
          "model wrote", file=sys.stderr)


def cmd_lookup_corpus(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from refusion.decoding.corpus import write_corpus
    from refusion.model.tokenizer import Tokenizer

    out = Path(args.out)
    if not out.is_dir():
        raise ValueError(f"--out {out}: no such directory (a model or mask-adapter directory)")
    answers, bad = [], 0
    try:
        lines = Path(args.data).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{args.data}: cannot read it ({e.strerror})") from None
    tok = Tokenizer.from_dir(resolve_model_dir(args))
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text = rec["response"]
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        ids = tok.encode(text)
        if rec.get("finished") and tok.eos_id is not None:  # the answer ended there: its end is drafted too
            ids.append(tok.eos_id)
        answers.append(ids)
    if not answers:
        raise ValueError(f"{args.data}: no line holds a JSON object with a \"response\" (refusion self-generate's "
                         "format)")
    path = write_corpus(out, answers)
    print(f"{path}: {len(answers)} answers, {sum(map(len, answers))} tokens"
          + (f" ({bad} lines without a response skipped)" if bad else ""), file=sys.stderr)
