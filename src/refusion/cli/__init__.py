"""The `refusion` command: one module per subcommand, each a thin layer over the Python API."""

from refusion.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
