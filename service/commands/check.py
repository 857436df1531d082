"""``ledger check``: the CI gate on a dataset's privacy guarantees.

::

    ledger check --url http://ledger:8000 --key "$LEDGER_API_KEY" --dataset ds_… \\
                 [--model NAME] [--max-epsilon 2.0] [--json]
    ledger check --bundle ledger.json [--model NAME] [--max-epsilon 2.0] [--json]
    ledger check ... --pin ledger-2026-11-01.json   # today's ledger must extend that export
    ledger check --bundle ledger.json --trusted-keys signing-keys.json   # pin the signer
    ledger check --bundle ledger.json --allow-unverified-signer          # exit 0 on the bundle's own keys

Online, it reads the dataset's ledger over HTTP API v1 into the same bundle ``ledger export``
writes (``service.commands.export.collect``); with ``--bundle`` it reads an exported one and
touches no server. Either way every verdict is *recomputed* here, not taken from the server:

``certificates``
    every certificate of the dataset re-verifies offline (``accountant.certificates.verify``:
    hash, budget, every batch's reserve and commit recomputed, state within the budget), certifies
    this dataset under the dataset's own budget, and matches the hash, release and outcome it is
    stored with.
``releases``
    every published version has a committed certificate: each release a certificate names is
    unique, and each model-registry version trained on the dataset (``--model``: of that model)
    points at a certificate of this dataset that certifies exactly that ``{model, version}``;
    every ``model_version.published`` entry of the chain is in the bundle's registry (none left
    out). A certificate with ``release: null`` (a settled abort or expiry) releases nothing.
    ``--model`` naming a model with no release at all fails (a misspelt gate must not pass).
``artifacts``
    every registry version records the SHA-256 its signed certificate states for the release
    (``release.artifact_sha256``; the registry's ``artifact.sha256``) and, online, its bytes,
    downloaded, have it too; offline the bytes are not at hand, so a bundle whose registry swaps a
    version's hash fails, and a downloaded artifact is compared with the certified hash by whoever
    holds it. Versions whose certificate states none (published before releases did) are
    counted, not failed.
``budget``
    spend ≤ budget under the dataset's rule: the ε and δ spent — the largest of what the server
    reports, what the certificates state and what the history adds up to — are within the budget;
    the spend is of this dataset, rule, accountant and budget, and its stated ``guarantee`` and
    ``epsilon_spent_is`` are the ones the recomputed spend gives (``accountant.statements``); a
    server reporting less than its certificates prove fails too.
``audit chain``
    the chain and its head are present (a bundle without them fails: whoever edits a bundle also
    writes the server's verdict in it); the server's verdict (``GET /v1/audit/verify``) is ``ok``;
    the chain's entries are recomputed hash by hash from the genesis hash to the head by the
    walk the server runs (``service.verification.audit_chain.check_chain``); certificates and
    anchoring entries are one to one
    (``service.verification.history.anchors``: an entry whose payload carries a ``certificate_id`` and
    a ``content_hash`` anchors that certificate — ``reservation.committed``, and an abort or
    expiry that settles a charge; each certificate anchored once, with its hash, and listed once;
    the entry records the settlement the certificate states: its kind, ``reservation.committed``
    for a release and ``reservation.aborted`` / ``.expired`` for that ``outcome``, and its release).
``history``
    the history proven along the chain (``service.verification.history``): per batch, from the empty
    state, each certificate's ``state_at_reserve`` is the state the batch was in at its
    reservation's ``reservation.reserved`` entry and its ``state_before`` the state the previous
    settlement left (plan segment closes replayed), compared on what only settlements move; the
    ε and δ spent recomputed from it (maximum over batches) equal the spend the bundle states.
    This is what catches a certificate built on an invented earlier state, which
    ``accountant.certificates.verify`` alone accepts.
``max epsilon`` (``--max-epsilon E``)
    a stricter bound: the dataset's ε spent *as the history recomputes it* (never a stated
    figure; a history that does not hold proves none, and the check fails) is ≤ E; with
    ``--model``: the largest ε any of the model's certificates states.
``privacy audit`` (only where a version carries one, ``dp_sgd_audit``)
    every audited version's ε lower bound (one-run auditing, ``accountant.privacy_audit``), recomputed
    here at its certificate's δ from the audit's counts, is at most the ε its certificate states
    for the run; a lower bound above the upper bound means the code or the accounting is wrong.
``run alone (derived)`` (only where a version's DP statement shows ``run_alone``)
    every statement's ``run_alone`` — the run alone, not the release's guarantee — is recomputed
    from its certificate's certified inputs (the reserved charge's event, the budget's δ;
    ``accountant.statements.certificate_run_alone``): the same accountant and δ, an ε no smaller.
    It is a derived figure, not a certified one: the certificate does not state it, and the
    check's line says so.
``signatures``
    every certificate's ``signature`` (over its content hash) and the audit head's (over the
    dataset, ``chain_seq`` and ``hash``) verify under a trusted Ed25519 key
    (``service.verification.signing``). This is what catches a forgery that edits a certificate's event,
    budget and states consistently, recomputes its hash, rewrites the chain to match and
    recomputes the bundle hash: every other check passes on it. Trusted keys are the *pinned*
    ones (``--trusted-key KEYID:BASE64``, repeatable, or ``--trusted-keys FILE``, the JSON of
    ``GET /.well-known/privacy-ledger/signing-keys`` fetched from the server itself); without
    them, the keys the server declares (online: the server the check itself connected to) or the
    bundle declares. The bundle's own keys only show it is self-consistent — anyone can re-sign
    a forgery and declare their key — so offline without a pinned key the check reads
    ``UNVERIFIED SIGNER`` and exits 1 unless ``--allow-unverified-signer`` is passed. The audit
    head must be present and signed. An unsigned certificate (issued before the ledger signed)
    fails: nothing shows the server issued it.
``bundle`` (``--bundle`` only)
    the bundle's own hash matches (damage or an edit without recomputing it).
``pin`` (``--pin OLD_BUNDLE``, repeatable)
    the ledger still *extends* a bundle exported earlier and kept outside the database (the
    externally recorded head of docs/RELIABILITY.md): the old bundle is intact (its own hash),
    names the same dataset, its audit head (``chain_seq``, ``hash``) is an entry of today's chain
    with the same hash, every certificate it holds is still present with the same content hash,
    and the ε and δ spent have not decreased. This is what catches a database whose chain tail
    was cut *and* whose stored head was rewritten to match: ``ledger verify`` and the ``audit
    chain`` check pass on such a database, the pin does not.

Each check reads ``PASS``, ``FAIL`` or (``signatures`` of a bundle with no pinned key)
``UNVERIFIED SIGNER``; the last line is ``result: PASS``, ``result: FAIL (n of m checks failed)``,
``result: UNVERIFIED SIGNER (…)`` or ``result: PASS (signer unverified, allowed by
--allow-unverified-signer)``. Exit 0 when every check holds under a pinned (or, online, the
server's) signer, or with ``--allow-unverified-signer``; 1 when a guarantee fails or the signer is
unverified (a summary on stdout, or a JSON report with ``--json``: ``ok``, ``result``, each
check's ``status``); 2 on usage errors, an unreadable bundle, an unreachable server, a refused key
or an unknown dataset.

What an offline check cannot prove: that a bundle is the *latest* — an older genuine bundle
passes as of when it was exported (pin its successor to it with ``--pin``, or compare its
``audit.head`` with the live server's); and the parts of a batch's state that other reservations
move between certificates (held amounts, reads, levels, plan position), which only
``accountant.certificates.verify`` checks within each certificate.
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING

from service.commands.export import add_connection_arguments, connection_error
from service.verification.bundle import BUNDLE_KIND, BUNDLE_VERSION, Json, Report, Trust, evaluate

if TYPE_CHECKING:
    from service.client import LedgerClient
    from service.verification.signing import PublicKey


class UsageError(Exception):
    """Exit 2: the check could not run (bad arguments, unreadable bundle, no server)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check",
        help="CI gate: exit 1 when a dataset's privacy guarantees do not hold",
        description="Verify a dataset's certificates, releases, budget, audit chain and history, "
        "online (--url/--key/--dataset) or on an exported bundle (--bundle). Each check prints "
        "PASS, FAIL or UNVERIFIED SIGNER (a bundle checked without --trusted-key(s): signed only "
        "by keys it declares itself). Exit 0: all hold (a bundle: under a pinned key, or with "
        "--allow-unverified-signer); 1: a guarantee fails or the signer is unverified; 2: usage "
        "or connection error.",
    )
    add_connection_arguments(parser)
    parser.add_argument("--dataset", help="the dataset's id or name (required online)")
    parser.add_argument("--bundle", help="check an exported bundle offline (ledger export)")
    parser.add_argument("--model", help="check the published versions of this model")
    parser.add_argument(
        "--max-epsilon",
        help="fail when the dataset's epsilon spent, as recomputed from the certificates' history "
        "(or the largest epsilon certified for --model), exceeds this stricter bound",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="OLD_BUNDLE",
        help="a bundle exported earlier (ledger export) that today's ledger must extend: its "
        "audit head still in the chain, its certificates still present, spend not decreased "
        "(repeatable)",
    )
    parser.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="KEYID:BASE64",
        help="pin a signing key the certificates and the audit head must be signed by (a key of "
        "GET /.well-known/privacy-ledger/signing-keys; repeatable). Without a pinned key, the keys "
        "the bundle or server declares are used; a bundle's own keys make it UNVERIFIED SIGNER "
        "(exit 1 unless --allow-unverified-signer)",
    )
    parser.add_argument(
        "--trusted-keys",
        metavar="FILE",
        help="pin every key of this JSON file, as GET /.well-known/privacy-ledger/signing-keys answers it",
    )
    parser.add_argument(
        "--allow-unverified-signer",
        action="store_true",
        help="with --bundle and no pinned key: exit 0 although the signer is only the one the "
        "bundle declares (the report still says UNVERIFIED SIGNER); without this flag such a "
        "bundle exits 1",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _served_artifacts(client: LedgerClient, bundle: Json) -> dict[tuple[str, str], str]:
    """The SHA-256 of every registry version's bytes as the server serves them now."""
    from service.client import LedgerError

    served: dict[tuple[str, str], str] = {}
    for name, versions in (bundle.get("models") or {}).items():
        for version in versions:
            key = (name, str(version["version"]))
            try:
                served[key] = client.download_artifact(name, int(version["version"])).sha256
            except LedgerError as exc:
                served[key] = f"unreadable ({exc})"
    return served


def _bound(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value <= 0:
        raise UsageError(f"--max-epsilon must be a finite number > 0. Found {text!r}.")
    return value


def load_bundle(path: str) -> Json:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read bundle {path}: {exc}") from exc
    try:
        bundle = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"bundle {path} is not JSON: {exc}") from exc
    if not isinstance(bundle, dict) or bundle.get("kind") != BUNDLE_KIND:
        raise UsageError(f"{path} is not a privacy-ledger bundle (see `ledger export`).")
    if bundle.get("version") != BUNDLE_VERSION:
        raise UsageError(
            f"bundle {path} has version {bundle.get('version')!r}; this ledger reads {BUNDLE_VERSION}."
        )
    return bundle


def _trust(args: argparse.Namespace) -> Trust:
    """The keys ``--trusted-key`` and ``--trusted-keys`` pin (none given: ``Trust()``)."""
    from service.verification import signing

    pinned: dict[str, PublicKey] = {}
    sources = []
    try:
        for i, text in enumerate(getattr(args, "trusted_key", None) or []):
            key = signing.trusted_key(text, f"--trusted-key[{i}]")
            pinned[key.key_id] = key
        if getattr(args, "trusted_keys", None):
            path = args.trusted_keys
            try:
                document = json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise UsageError(f"--trusted-keys: cannot read {path} as JSON: {exc}") from exc
            pinned.update(signing.keys_from_json(document, f"--trusted-keys {path}"))
            sources.append(f"--trusted-keys {path}")
    except signing.SigningKeyError as exc:
        raise UsageError(str(exc)) from exc
    if getattr(args, "trusted_key", None):
        sources.insert(0, "--trusted-key")
    if not sources:
        return Trust()
    if not pinned:
        raise UsageError(f"{' and '.join(sources)} pin no key.")
    return Trust(pinned, " and ".join(sources))


def _report(args: argparse.Namespace) -> Report:
    max_epsilon = _bound(args.max_epsilon)
    trust = _trust(args)
    pins = {path: load_bundle(path) for path in getattr(args, "pin", None) or []}
    if args.bundle is not None:
        bundle = load_bundle(args.bundle)
        dataset_id = (bundle.get("dataset") or {}).get("id")
        if args.dataset is not None and args.dataset != dataset_id:
            raise UsageError(f"--dataset {args.dataset} but the bundle holds dataset {dataset_id}.")
        return evaluate(
            bundle,
            mode="bundle",
            source=args.bundle,
            model=args.model,
            max_epsilon=max_epsilon,
            pins=pins,
            trust=trust,
            allow_unverified_signer=args.allow_unverified_signer,
        )

    from service.client import LedgerClient, LedgerError
    from service.commands.export import collect

    problem = connection_error("check", args)
    if problem is None and not args.dataset:
        problem = "ledger check: --dataset is required (or --bundle FILE)."
    if problem is not None:
        raise UsageError(problem)
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            dataset_id = str(client.find_dataset(args.dataset)["id"])  # an id or a name
            bundle = collect(client, dataset_id, model=args.model)
            served = _served_artifacts(client, bundle)
    except LedgerError as exc:
        raise UsageError(f"ledger check: {exc}") from exc
    return evaluate(
        bundle,
        mode="online",
        source=args.url,
        model=args.model,
        max_epsilon=max_epsilon,
        pins=pins,
        trust=trust,
        served=served,
        allow_unverified_signer=args.allow_unverified_signer,
    )


def run(args: argparse.Namespace) -> int:
    try:
        report = _report(args)
    except UsageError as exc:
        message = str(exc)
        if args.json:
            print(json.dumps({"ok": False, "error": "usage", "message": message}))
        print(message, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.text())
    return 0 if report.ok else 1
