"""`refusion COMMAND ...`: the parser of every subcommand, and one way to fail.

Each subcommand lives in its own module here and only parses its flags and calls the library.
Bad input ends with one line `refusion: error: ...` and exit code 2, whether argparse or the library
finds it. torch is imported only inside the commands, so `refusion --help` answers at once.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from refusion.cli import adapt, data, evaluate, generate, models, serve, train, train_sampler
from refusion.cli.args import Parser
from refusion.model.fetch import FetchError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("refusion")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="refusion", description="ReFusion: train, decode, evaluate.")
    p.add_argument("--version", action="version", version=f"refusion {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    models.add_parsers(sub)
    evaluate.add_parsers(sub)
    train.add_parser(sub)
    train_sampler.add_parser(sub)
    data.add_parser(sub)
    adapt.add_parser(sub)
    serve.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, where it is handled, not at exit
    except BrokenPipeError:
        # `refusion info | head`: the reader left early, which is its right. Point stdout at
        # /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, FetchError, OSError) as e:  # our errors carry one-line messages; OSError names its file
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"refusion: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def console_main() -> int:
    """The `refusion` executable and `python -m refusion.cli`: main(), then an exit without most of the
    interpreter's teardown, which is the cyclic collector walking every object of every module loaded
    (torch's are hundreds of thousands), more than once, after the work is done. The garbage the
    command left is collected once here, so every finalizer of what it dropped runs; what is still
    alive (the modules) is frozen, out of the collector's reach, for the operating system to reclaim.
    Output is flushed and the exit code kept as in any exit."""
    code = main()
    gc.collect()
    gc.freeze()
    return code
