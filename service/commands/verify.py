"""``ledger verify``: walk the audit log's hash chains end to end — the operator's global walk.

Exit 0 when every row chains to the previous one and the last matches the head; exit 1 with the
first broken row otherwise. Prints the result as JSON (``{ok, entries, first_broken, reason}``).

It reads the database directly (``--database-url``) and checks every tenant's dataset chains and
the global chain of tenant and key events (``service.ledger.audit.verify``). That differs on
purpose from ``GET /v1/audit/verify``, which a tenant's key calls and which walks only that
tenant's dataset chains (``verify_tenant``): a break in one tenant's chain is the operator's to
see, never another tenant's.
"""

from __future__ import annotations

import argparse
import json
import sys

from service.commands.migrate import DATABASE_URL_HELP, migrated_database_url
from service.verification.audit_chain import broken_message


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="verify the audit log's hash chains, every tenant's (exit 1 at the first broken row)",
        description="Walk every audit hash chain in the database (all tenants' datasets and the global "
        "chain of tenants and keys); exit 0 if intact, 1 at the first broken row. The HTTP route "
        "GET /v1/audit/verify checks only the calling key's tenant.",
    )
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument("--dataset", help="check only this dataset's chain")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from service.db.session import Database
    from service.ledger import audit

    url = migrated_database_url(args, "verify")
    if url is None:
        return 2
    db = Database(url)
    try:
        result = audit.verify(db, dataset_id=args.dataset)
    finally:
        db.dispose()
    print(json.dumps(result.to_json()))
    if not result.ok:
        print(broken_message(result.to_json()), file=sys.stderr)
        return 1
    return 0
