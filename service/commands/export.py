"""``ledger export``: a dataset's ledger as one JSON bundle, checkable offline by ``ledger check``.

::

    ledger export --url http://127.0.0.1:8000 --key "$LEDGER_API_KEY" --dataset ds_… -o ledger.json
    ledger check --bundle ledger.json

The bundle is composed from HTTP API v1 reads only (``service.client.LedgerClient``):

* ``dataset`` (``GET /v1/datasets/{id}``: its budget) and ``spend`` (``GET …/spend``);
* ``certificates``: every certificate of the dataset (``GET …/certificates``, all pages) —
  releases and the charges of aborts and expiries (``release: null``) — and any the chain
  anchors that the pages missed, each re-verifiable offline with
  ``accountant.certificates.verify``; the offline proof needs every one the chain anchors;
* ``batch_sets``: for each reservation a certificate names, its (batch id, class) pairs
  (``GET /v1/reservations/{id}/batches``, all pages): what the certificate's ``batch_set``
  commits to (``accountant.certificates.check_batch_set``);
* ``audit``: the dataset's hash chain — ``head`` and every ``entries`` row
  (``GET /v1/datasets/{id}/audit``), so the chain can be recomputed offline and the history
  replayed along it — and the server's own verdict (``GET /v1/audit/verify?dataset_id=…``). A
  server without the entries route still exports; ``entries`` is then ``null`` and ``ledger
  check`` fails the bundle: a verdict proves nothing offline;
* ``models``: the model registry's versions of every model the certificates name (or
  ``--model``) that were trained on this dataset (``GET /v1/models/{name}/versions``);
* ``signing_keys``: the server's public keys (``GET /.well-known/privacy-ledger/signing-keys``),
  which verify each certificate's ``signature`` and the ``signature`` of ``audit.head``
  (``service.verification.signing``); ``null`` from a server that signs nothing. Keys a bundle carries
  are only *declared* by it: ``ledger check --trusted-key`` / ``--trusted-keys`` pins the keys a
  verifier fetched from the server itself;
* ``bundle_hash``: ``sha256:`` over the canonical JSON of everything else. It detects a bundle
  damaged or edited after export (an edit with a recomputed hash is caught by the recomputations
  of ``ledger check``, which derive the budget check and the chain from the certificates and the
  entries themselves, and by the signatures, which nobody without the server's key can remake).

Exit 0 when written; 2 on usage or connection errors, an unknown dataset or a refused key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from service.verification.bundle import BUNDLE_KIND, BUNDLE_VERSION, bundle_hash
from service.verification.history import anchored_certificate_id

if TYPE_CHECKING:
    from service.client import LedgerClient

URL_ENV: Final = "LEDGER_URL"
KEY_ENV: Final = "LEDGER_API_KEY"
_CONSISTENT_READS: Final = 5  # rereads of spend and chain while the ledger moves under the export


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url``, ``--key`` (defaults from ``LEDGER_URL`` / ``LEDGER_API_KEY``), ``--timeout``."""
    parser.add_argument(
        "--url", default=os.environ.get(URL_ENV), help=f"server root URL (default: ${URL_ENV})"
    )
    parser.add_argument(
        "--key",
        default=os.environ.get(KEY_ENV),
        help=f"API key, viewer scope is enough (default: ${KEY_ENV}; prefer it to the flag in CI logs)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP attempt (default 30)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a dataset's ledger (budget, spend, certificates, audit chain) as a JSON bundle",
        description="Write a JSON bundle of one dataset's ledger, checkable offline with "
        "`ledger check --bundle FILE`.",
    )
    add_connection_arguments(parser)
    parser.add_argument("--dataset", required=True, help="the dataset's id or name")
    parser.add_argument("--model", help="also export the registry versions of this model")
    parser.add_argument("-o", "--output", required=True, help="file to write ('-' for standard output)")
    parser.set_defaults(handler=run)


def model_names(certificates: Iterable[dict[str, Any]], model: str | None) -> list[str]:
    names = {str(c["release"]["model"]) for c in certificates if isinstance(c.get("release"), dict)}
    if model is not None:
        names.add(model)
    return sorted(names)


def collect(client: LedgerClient, dataset_id: str, *, model: str | None = None) -> dict[str, Any]:
    """The bundle of ``dataset_id``, read through ``client`` (raises ``service.client`` errors).

    Read in an order that keeps a live ledger's bundle consistent: certificates first, then the
    chain up to its current head (so it records every certificate read), then the certificate of
    any settlement the chain recorded meanwhile, and the spend; then the chain again: if it grew
    while the spend was read, the new entries' certificates and the spend are read again, so the
    spend is the one of the chain's head (``ledger check`` recomputes it from the certificates
    the chain anchors and requires them equal).
    """
    dataset = client.get_dataset(dataset_id)
    certificates = list(client.iter_certificates(dataset_id))
    head, entries = read_chain(client, dataset_id)
    known = {c["id"] for c in certificates}
    verdict = client.verify_audit(dataset_id)

    def read_anchored() -> None:
        for entry in entries or ():
            certificate_id = anchored_certificate_id(entry)
            if certificate_id is not None and certificate_id not in known:
                certificates.append(client.get_certificate(certificate_id))
                known.add(certificate_id)

    for _ in range(_CONSISTENT_READS):
        read_anchored()
        spend = client.spend(dataset_id)
        if entries is None:
            break
        later_head, later = read_chain(client, dataset_id, after=len(entries))
        if not later:
            break
        head, entries = later_head, [*entries, *later]
        verdict = client.verify_audit(dataset_id)
    read_anchored()  # a ledger still moving: its bundle's spend may lag the chain (check fails)
    keys = signing_keys(client)
    models = registry_versions(client, dataset_id, model_names(certificates, model))
    # The batches each certificate's ``batch_set`` commits to (version 2), once per reservation.
    batch_sets = {
        rid: [list(pair) for pair in client.iter_reservation_batches(rid)]
        for rid in sorted(
            {c["reservation_id"] for c in certificates if "batch_set" in c["certificate"]["inputs"]}
        )
    }
    bundle: dict[str, Any] = {
        "kind": BUNDLE_KIND,
        "version": BUNDLE_VERSION,
        "exported_at": datetime.now(UTC).isoformat(),
        "source": client.base_url,
        "dataset": dataset,
        "spend": spend,
        "certificates": certificates,
        "audit": {"head": head, "entries": entries, "verify": verdict},
        "models": models,
        "signing_keys": keys,
        "batch_sets": batch_sets,
    }
    bundle["bundle_hash"] = bundle_hash(bundle)
    return bundle


def signing_keys(client: LedgerClient) -> dict[str, Any] | None:
    """The server's public signing keys, or ``None`` from a server without the well-known route."""
    from service.client import NotFound

    try:
        return client.signing_keys()
    except NotFound:
        return None


def read_chain(
    client: LedgerClient, dataset_id: str, *, after: int = 0
) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
    """The dataset's chain head and every entry after entry ``after`` up to it, or ``(None,
    None)`` from a server without ``GET /v1/datasets/{id}/audit`` (the dataset was found, so a
    404 is the route)."""
    from service.client import NotFound

    entries: list[dict[str, Any]] = []
    while True:
        try:
            page = client.audit_entries(dataset_id, after=after, limit=1000)
        except NotFound:
            if not entries:
                return None, None
            raise
        entries.extend(page["data"])
        if page.get("next_after") is None:
            return page["head"], entries
        after = int(page["next_after"])


def registry_versions(
    client: LedgerClient, dataset_id: str, names: Iterable[str]
) -> dict[str, list[dict[str, Any]]]:
    """The registry's versions of each model trained on ``dataset_id`` (none: ``[]``), each with
    its ``dp_statement``."""
    from service.client import NotFound

    models: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        try:
            versions = list(client.iter_model_versions(name))
        except NotFound:
            versions = []  # released by an external trainer only: nothing in the registry
        models[name] = [
            # each with its DP statement (Ponomareva et al. 2023, §5.3), derived by the server
            {**v, "dp_statement": client.get_model_version(name, int(v["version"])).get("dp_statement")}
            for v in versions
            if v.get("dataset_id") == dataset_id
        ]
    return models


def connection_error(command: str, args: argparse.Namespace) -> str | None:
    """The usage error of missing ``--url`` / ``--key``, or ``None``."""
    if not args.url:
        return f"ledger {command}: --url (or ${URL_ENV}) is required."
    if not args.key:
        return f"ledger {command}: --key (or ${KEY_ENV}) is required."
    return None


def run(args: argparse.Namespace) -> int:
    from service.client import LedgerClient, LedgerError

    problem = connection_error("export", args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            args.dataset = str(client.find_dataset(args.dataset)["id"])  # an id or a name
            bundle = collect(client, args.dataset, model=args.model)
    except LedgerError as exc:
        print(f"ledger export: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(bundle, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"ledger export: cannot write {args.output}: {exc}", file=sys.stderr)
            return 2
        entries = bundle["audit"]["entries"]
        print(
            f"exported dataset {args.dataset}: {len(bundle['certificates'])} certificate(s), "
            f"{'no' if entries is None else len(entries)} audit entries -> {args.output}",
            file=sys.stderr,
        )
    return 0
