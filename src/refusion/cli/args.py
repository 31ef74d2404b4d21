"""What every subcommand's parser shares: one-line errors, defaults in help, common argument types."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except where there is nothing to show (None, off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        d = action.default  # (compared by identity: 0 == False, yet a default of 0 is worth showing)
        if d is None or d is False or d == [] or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subparsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # one line, like every other error of the command (argparse would print the usage first)
        print(f"refusion: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


SMALL_MODEL_THREADS = "1 for a model under 50M parameters, where more only add waiting; else torch's default"


def warn(msg: str) -> None:
    print(f"refusion: warning: {msg}", file=sys.stderr)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def utf8_text(text: str) -> str:
    """argparse type: text that is UTF-8. Python hands bytes that are not (a terminal in another
    encoding, a file name) over as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"character U+{c:04X}"
        raise argparse.ArgumentTypeError(f"not UTF-8 text ({what} at character {e.start}); pass UTF-8 text (is the "
                                         "terminal's encoding UTF-8?)") from None
    return text


def seed_int(text: str) -> int:
    """argparse type: a seed torch's generators take, an integer in [0, 2**63 - 1]."""
    from refusion.decoding.params import MAX_SEED

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= v <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is an integer in [0, 2**63 - 1], got {v}")
    return v


def check_out_dir(path: str, overwrite: bool) -> None:
    """Before any slow work: an output directory that holds something is only replaced on request."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{p} is a file, not a directory")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise ValueError(f"{p} exists and is not empty; choose another directory or pass --overwrite")


MODEL_HELP = ("a model directory, a mask adapter directory (its base with it attached), or a name: refusion-tiny, "
              "smollm2, smollm2-refusion (default: the bundled refusion-tiny)")


def resolve_model_dir(args: argparse.Namespace) -> Path:
    """--model (a directory or a name, refusion.bundled.resolve_model), or the bundled model when none is
    named (an empty name is an error)."""
    from refusion.bundled import resolve_model

    return resolve_model(args.model)


def add_runtime_flags(p: argparse.ArgumentParser, threads_default: str = SMALL_MODEL_THREADS) -> None:
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights' dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument("--threads", type=positive_int, help=f"CPU threads (default: {threads_default})")
    add_compile_flag(p)


# refusion.model.compiled.MODES, spelled out so that parsing arguments imports no torch
COMPILE_MODES = ("default", "max-autotune")


def add_compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="run the model through torch.compile'd graphs: faster forwards once each shape class is "
                        "compiled (seconds, paid once per process), outputs not bit-identical to eager. "
                        "`--compile max-autotune` also tunes the matrix products (on a CPU: minutes of compiling, "
                        "a second copy of the weights, much cheaper multi-token forwards)")
