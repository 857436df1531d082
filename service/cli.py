"""The ``ledger`` console script: one entry point, one module per subcommand (``service.commands``).

Only the module of the command being run is imported, so the client-side commands (``epsilon``,
``check``, ``export``) start without the server's packages: a plain ``pip install privacy-ledger``
has no FastAPI, uvicorn, SQLAlchemy or Alembic, and those are not loaded even when installed. A
server command run without the ``server`` extra says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

# Subcommands, in the order ``ledger --help`` lists them, with their one-line help and the
# extra they need beyond a plain install.
_COMMANDS: Final[dict[str, tuple[str, str | None]]] = {
    "serve": ("migrate the database and serve the HTTP API (and dashboard)", "server"),
    "worker": ("run a training worker (claims jobs, trains, releases certified model versions)", "worker"),
    "migrate": ("apply the database migrations (alembic upgrade head)", "server"),
    "keys": ("create, revoke and list API keys", "server"),
    "epsilon": ("compute epsilon for an event or a DP-SGD run (JSON out)", None),
    "calibrate": ("the noise multiplier a dataset charges at most a target epsilon for (JSON out)", None),
    "check": ("CI gate: exit 1 when a dataset's privacy guarantees do not hold", None),
    "verify": (
        "verify the audit log's hash chains, every tenant's (exit 1 at the first broken row)",
        "server",
    ),
    "export": ("export a dataset's ledger (budget, spend, certificates, audit chain) as a JSON bundle", None),
    "datasets": ("archive or unarchive a dataset, by id or name (an admin key)", None),
    "model-card": ("a model version's DP statement as a model card (Hugging Face front matter)", None),
    "experiment": ("reproduce a paper's claim at small scale (JSON report, PNG plots, table)", "worker"),
}


class MissingExtra(Exception):
    """A command's module needs a package of an extra that is not installed."""


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first argument that is not an option, nor the value of
    ``--home``)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--home":
            skip = True
            continue
        if not arg.startswith("-"):
            return arg if arg in _COMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the command ``argv`` names is registered in full (its module imported), the
    others as one-line entries for ``ledger --help``. ``argv=None``: every command in full."""
    parser = argparse.ArgumentParser(
        prog="ledger",
        description="privacy-ledger: privacy budgets, certified model releases, accountants.",
    )
    parser.add_argument(
        "--home",
        metavar="DIR",
        help="the folder of the ledger's state: its database, artifacts and secrets (default: "
        "LEDGER_HOME, else $XDG_DATA_HOME/privacy-ledger, ~/.local/share/privacy-ledger)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else _command(argv)
    for name, (summary, extra) in _COMMANDS.items():
        if argv is not None and name != chosen:
            subparsers.add_parser(name, help=summary, add_help=False)
            continue
        try:
            module = importlib.import_module(f"service.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if argv is None:
                subparsers.add_parser(name, help=summary, add_help=False)
                continue
            raise MissingExtra(
                f"ledger {name} needs the {extra!r} extra ({exc.name} is not installed): "
                f"pip install 'privacy-ledger[{extra}]'"
            ) from None
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(arguments)
    except MissingExtra as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(arguments)
    if args.home is not None:
        if not args.home.strip():
            print("ledger: --home must name a folder.", file=sys.stderr)
            return 2
        # Every setting is read from the environment (service.settings), by this process and by
        # the server's worker processes: the flag is LEDGER_HOME for all of them.
        os.environ["LEDGER_HOME"] = str(Path(args.home).expanduser().resolve())
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    code: int = handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
