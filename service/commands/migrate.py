"""``ledger migrate``: bring the database schema to the newest revision (Alembic), or to one named.

The schema is created and changed only by the migrations in ``alembic/`` (``service.db.migrations``).
``ledger serve`` runs the same upgrade before it listens.
"""

from __future__ import annotations

import argparse
import sys

from service.settings import Settings

DATABASE_URL_HELP = "SQLAlchemy URL (default: LEDGER_DATABASE_URL, else ledger.db in the ledger's home)"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="apply the database migrations (alembic upgrade head)",
        description="Apply the schema migrations to LEDGER_DATABASE_URL (or --database-url).",
    )
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument("--revision", default="head", help="target revision (default: head, the newest)")
    parser.add_argument(
        "--downgrade",
        action="store_true",
        help="migrate down to --revision instead of up ('base' removes every table)",
    )
    parser.set_defaults(handler=run)


def database_url(args: argparse.Namespace) -> str:
    """The URL from ``--database-url``, else from the settings (environment)."""
    url: str | None = getattr(args, "database_url", None)
    return url if url else Settings().database_url


def migrated_database_url(args: argparse.Namespace, command: str) -> str | None:
    """The database URL when it holds a ledger at the newest revision; else says why in one line
    on stderr (``ledger COMMAND: no ledger at ...``) and answers ``None`` (the caller exits 2)."""
    from service.db import migrations

    url = database_url(args)
    problem = migrations.missing_ledger(url)
    if problem is not None:
        print(f"ledger {command}: {problem}", file=sys.stderr)
        return None
    return url


def run(args: argparse.Namespace) -> int:
    from service.db import migrations

    url = database_url(args)
    migrations.make_home(url)
    if args.downgrade:
        if args.revision == "head":
            print("ledger migrate: --downgrade needs --revision (e.g. 'base').", file=sys.stderr)
            return 2
        migrations.downgrade(url, args.revision)
    else:
        migrations.upgrade(url, args.revision)
    print(f"database at revision {migrations.current_revision(url) or 'base'}")
    return 0
