"""``ledger keys``: create, revoke and list API keys.

``ledger keys create --tenant T --scope S`` prints the new key once; only its HMAC under the
server's key-hash secret is stored, so it cannot be shown again. ``ledger keys revoke KEY_ID``
revokes a key by its id (the ``id`` that ``create`` and ``list`` print, never the secret). Every
change is in the audit log.

The key-hash secret is the server's (``LEDGER_KEY_HASH_SECRET``, or ``key-hash.secret`` in
``LEDGER_SECRETS_DIR``, beside a SQLite database by default): run this command with the same
settings as ``ledger serve``. ``create`` refuses (exit 2) when the database's keys were all hashed
with another secret: a key made here would never authenticate there.
"""

from __future__ import annotations

import argparse
import json
import sys

from service.commands.migrate import DATABASE_URL_HELP, migrated_database_url


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "keys", help="create, revoke and list API keys", description=__doc__.split("\n\n")[1]
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url", help=DATABASE_URL_HELP)
    actions = parser.add_subparsers(dest="keys_action", metavar="ACTION", required=True)

    create = actions.add_parser("create", parents=[common], help="create a key; prints it once")
    create.add_argument("--tenant", required=True, help="tenant id (created if missing)")
    create.add_argument(
        "--scope", required=True, choices=("admin", "trainer", "viewer"), help="the key's scope"
    )
    create.add_argument("--json", action="store_true", help="print the key record as JSON")
    create.set_defaults(handler=_create)

    revoke = actions.add_parser("revoke", parents=[common], help="revoke a key by id")
    revoke.add_argument("key_id", help="the key's id (key_...), as create/list print it")
    revoke.add_argument("--tenant", help="only revoke if the key belongs to this tenant")
    revoke.set_defaults(handler=_revoke)

    listing = actions.add_parser("list", parents=[common], help="list a tenant's keys (never the secrets)")
    listing.add_argument("--tenant", required=True)
    listing.set_defaults(handler=_list)


def _create(args: argparse.Namespace) -> int:
    from service.db.session import Database
    from service.ledger.errors import LedgerError
    from service.ledger.tenancy import check_key_hash_secret, issue_api_key
    from service.server_secrets import SecretError

    url = migrated_database_url(args, f"keys {args.keys_action}")
    if url is None:
        return 2
    db = Database(url)
    try:
        check_key_hash_secret(db)
        record = issue_api_key(db, args.tenant, args.scope)
    except LedgerError as exc:
        print(f"ledger keys create: {exc.message}", file=sys.stderr)
        return 2
    except SecretError as exc:
        print(f"ledger keys create: {exc}", file=sys.stderr)
        return 2
    finally:
        db.dispose()
    if args.json:
        print(json.dumps(record.to_json()))
    else:
        print(record.key)
        print(
            f"(key id {record.id}, tenant {record.tenant_id}, scope {record.scope}; "
            "shown once: only its keyed hash is stored)",
            file=sys.stderr,
        )
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from service.db.session import Database
    from service.ledger.errors import LedgerError
    from service.ledger.tenancy import revoke_api_key

    url = migrated_database_url(args, f"keys {args.keys_action}")
    if url is None:
        return 2
    db = Database(url)
    try:
        record = revoke_api_key(db, args.key_id, tenant_id=args.tenant)
    except LedgerError as exc:
        print(f"ledger keys revoke: {exc.message}", file=sys.stderr)
        return 1
    finally:
        db.dispose()
    print(json.dumps(record.to_json()))
    return 0


def _list(args: argparse.Namespace) -> int:
    from service.db.session import Database
    from service.ledger.tenancy import list_api_keys

    url = migrated_database_url(args, f"keys {args.keys_action}")
    if url is None:
        return 2
    db = Database(url)
    try:
        print(json.dumps(list_api_keys(db, args.tenant).to_json()))
    finally:
        db.dispose()
    return 0
