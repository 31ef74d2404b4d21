"""`refusion data`: download the real benchmarks' files into the cache (refusion.tasks.sources)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from refusion.tasks import sources

    p = sub.add_parser("data", help="download the real benchmarks (GSM8K, MATH, MBPP, HumanEval, ARC-C, MMLU)",
                       description=sources.__doc__)
    p.add_argument("names", nargs="*", help=f"benchmarks (default: all): {', '.join(sources.BENCHMARKS)}")
    p.add_argument("--list", action="store_true", help="list the benchmarks and whether they are cached")
    p.set_defaults(func=cmd_data)


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
