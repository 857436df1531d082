"""The ``ledger`` console script: one entry point, one module per subcommand (``service.commands``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules, in the order ``ledger --help`` lists them. A module that is not there yet
# (a feature not built) is skipped, so the CLI always starts.
_COMMANDS = (
    "serve",
    "worker",
    "migrate",
    "keys",
    "epsilon",
    "check",
    "verify",
    "export",
    "demo",
    "experiment",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ledger",
        description="privacy-ledger: privacy budgets, certified model releases, accountants.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"service.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"service.commands.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    code: int = handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
