"""The `refusion` command: one module per subcommand, each a thin layer over the Python API."""

from refusion.bundled import BUNDLED, default_model_dir  # the flat layout's refusion.cli had these
from refusion.cli.args import positive_int
from refusion.cli.main import build_parser, main

__all__ = ["BUNDLED", "build_parser", "default_model_dir", "main", "positive_int"]
