"""`refusion adapt`: a causal LM's mask adapter, from its own answers (refusion.training.adapt)."""

from __future__ import annotations

import argparse
import signal
import sys

from refusion.cli.args import positive_int

DESCRIPTION = """\
Make a causal LM faster without changing any answer: its own greedy answers to prompts of the kinds
it is asked (its own user turns, GSM8K train questions, standard-library functions, your prompts)
teach its <|mask|> rows to draft; speculative decoding verifies every draft with the model itself.
The result, DIR/adapter, names its base: `refusion generate --model DIR/adapter` (and serve, eval)
decodes with it and with the settings measured best on held-out prompts (its decoding.json).

Every stage resumes: run the same command again after a stop. DIR/log says what each stage did;
DIR/state.json records it. With the defaults a 135M model takes hours on a CPU."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("adapt", help="make a causal LM faster with its answers unchanged (a mask adapter, "
                       "trained from its own answers)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("model", help="a causal LM: a Hugging Face directory, a llama GGUF file, or a name (smollm2)")
    a.add_argument("--out", required=True, help="the run directory (created; a rerun resumes it)")
    a.add_argument("--prompts", type=positive_int, help="training prompts in all, shared by the mix (default 6000)")
    a.add_argument("--mix", help="domains and their shares, e.g. prose=2,maths=1,code=2 (the default) or code=1")
    a.add_argument("--prompts-file", help="your own prompts too (one a line, or JSONL with \"query\"), all of them")
    a.add_argument("--hours", type=float, help="a time budget: training takes the steps that fit in it (at most "
                   "the recipe's), at the pace of its first steps")
    a.add_argument("--quick", action="store_true", help="every stage in a minute or two: a few prompts, steps and "
                   "tokens (a check of the pipeline, not a useful adapter)")
    a.add_argument("--export", metavar="DIR", help="also copy the finished adapter into DIR (e.g. "
                   "src/refusion/assets/smollm2-refusion, which `--model smollm2-refusion` names)")
    a.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's)")
    a.add_argument("--no-progress", action="store_true", help="no progress bars or stage lines on the terminal "
                   "(DIR/log keeps the lines)")
    a.set_defaults(func=cmd_adapt)


def cmd_adapt(args: argparse.Namespace) -> None:
    from refusion.training.adapt import Options, adapt
    from refusion.training.adapt.prompts import DEFAULT_MIX, parse_mix
    from refusion.training.adapt.recipe import DEFAULT_PROMPTS, QUICK_PROMPTS

    opts = Options(prompts=args.prompts or (QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS),
                   mix=parse_mix(args.mix or DEFAULT_MIX), prompts_file=args.prompts_file, quick=args.quick,
                   max_tokens=16 if args.quick else Options.max_tokens)
    # `kill` stops it as Ctrl-C does: the stage that was running keeps its seconds (the run's record)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        final = adapt(args.model, args.out, opts, hours=args.hours, threads=args.threads,
                      progress=not args.no_progress, export=args.export)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(final)
    sys.stdout.flush()
