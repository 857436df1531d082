"""``ledger datasets archive|unarchive NAME_OR_ID``: take a dataset out of use, or back.

Client side (a plain install), through ``LedgerClient`` and the API's routes
(``POST /v1/datasets/{id}/archive`` / ``unarchive``, an admin key): the dataset is looked up by
id, then by name (``LedgerClient.find_dataset``; names are unique per tenant). Archiving never
deletes nor frees budget: the dataset takes no new work (409 ``dataset_archived``), leaves the
default list, and its ledger, certificates and audit chain stay readable and verifiable. Both are
audited (``dataset.archived`` / ``dataset.unarchived``) and idempotent: archiving an archived
dataset changes nothing. Prints the dataset's id, name and ``archived_at``; exit 0 on success,
2 with the server's message (it names the field or the reason) otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

from service.commands.export import add_connection_arguments, connection_error


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "datasets",
        help="archive or unarchive a dataset (by id or name; an admin key)",
        description="Archive a dataset (it takes no new work; its ledger stays) or make it active again.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, summary in (
        ("archive", "archive the dataset: no new tasks, batches, reservations or jobs; nothing deleted"),
        ("unarchive", "make an archived dataset active again, exactly as it was"),
    ):
        sub = actions.add_parser(action, help=summary, description=summary)
        add_connection_arguments(sub)
        sub.add_argument("dataset", metavar="NAME_OR_ID", help="the dataset's id or name")
        sub.add_argument("--json", action="store_true", help="print the dataset as the API answers it")
        sub.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from service.client import LedgerClient, LedgerError

    command = f"datasets {args.action}"
    problem = connection_error(command, args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if not args.dataset.strip():
        print(f"ledger {command}: NAME_OR_ID must name a dataset.", file=sys.stderr)
        return 2
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            dataset_id = str(client.find_dataset(args.dataset)["id"])
            if args.action == "archive":
                answer = client.archive_dataset(dataset_id)
            else:
                answer = client.unarchive_dataset(dataset_id)
    except LedgerError as exc:
        print(f"ledger {command}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
    elif answer.get("archived_at"):
        print(f"archived {answer['id']} ({answer['name']}) at {answer['archived_at']}")
    else:
        print(f"active {answer['id']} ({answer['name']})")
    return 0
