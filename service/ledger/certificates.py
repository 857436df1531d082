"""Certificates: issued by ``accountant.certificates`` at every commit, abort and expiry (each a
charge; only a commit releases), stored, listed, fetched.

A certificate is the frozen JSON record ``accountant.certificates.issue`` returns: rule,
accountant, inputs (events, δ, the histories of the classes of batches the commit touched and the
commitment to which batches: ``batch_set``), the result bound,
library versions and a content hash; ``accountant.certificates.verify`` re-checks it offline from
its own contents. The ledger signs it with its active key (``signature``, over the content hash,
which does not cover it: ``service.verification.signing``) and stores it unchanged
(``certificates.body``) with its content hash.

Answer shape: ``{id, dataset_id, reservation_id, release, outcome, content_hash, created_at,
certificate}`` (``release`` is ``null`` for an aborted or expired reservation) where
``certificate`` is the issued record itself (its ``hash`` field is ``content_hash``) — pass it
to ``accountant.certificates.verify`` as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import func, select

from accountant import certificates as issuing
from accountant.certificates import BatchSet, ClassRecord
from accountant.errors import AccountantError
from accountant.events import DpEvent
from accountant.rules import Budget, Charge
from service import server_secrets
from service.db.models import Certificate, Release
from service.db.session import Database
from service.ledger import pricing_limits
from service.ledger.datasets import can_be_id, load_dataset
from service.ledger.errors import InvalidInput, NotFound
from service.verification import signing
from service.verification.signing import SigningKey

MAX_PAGE: Final = 1000


def issue_signed(
    *,
    budget: Budget,
    charge: Charge,
    classes: Sequence[ClassRecord],
    batch_set: BatchSet,
    reservation_id: str,
    release: Mapping[str, Any] | None,
    partial_event: DpEvent | None,
    previous_event: DpEvent | None,
    release_id: str | None,
    dataset_id: str,
    issued_at: datetime,
    signer: SigningKey,
    outcome: str = "released",
) -> dict[str, Any]:
    """The certificate of one commit, abort or expiry (``accountant.certificates.issue``: pure, no
    accounting; ``outcome`` and ``release=None`` for an abort or expiry), signed by ``signer``
    (its ``signature`` is over its content hash, which does not cover it)."""
    body = issuing.issue(
        budget=budget,
        charge=charge,
        classes=classes,
        batch_set=batch_set,
        reservation_id=reservation_id,
        release=None if release is None else dict(release),
        partial_event=partial_event,
        previous_event=previous_event,
        release_id=release_id,
        dataset_id=dataset_id,
        issued_at=issued_at.isoformat(),
        outcome=outcome,
    )
    return signing.sign_certificate(body, signer)


def stored_row(
    *,
    certificate_id: str,
    tenant_id: str,
    dataset_id: str,
    reservation_id: str,
    release_id: str | None,
    body: dict[str, Any],
    at: datetime,
) -> dict[str, Any]:
    """The ``certificates`` row that stores ``body`` (its content hash in its own column)."""
    return {
        "id": certificate_id,
        "tenant_id": tenant_id,
        "dataset_id": dataset_id,
        "reservation_id": reservation_id,
        "release_id": release_id,
        "body": body,
        "content_hash": str(body["hash"]),
        "created_at": at,
    }


@dataclass(frozen=True, slots=True)
class IssuedCertificate:
    """A stored certificate as the ledger answers it (the module docstring's answer shape), typed:
    ``document`` is the issued, signed record itself — JSON by nature (its content hash and
    signature are over its canonical bytes), passed to ``accountant.certificates.verify`` as it
    is. ``to_json`` is its one wire form (a commit's answer, the listings)."""

    id: str
    dataset_id: str
    reservation_id: str
    release: dict[str, Any] | None
    content_hash: str
    created_at: datetime
    document: dict[str, Any]

    @property
    def outcome(self) -> str:
        """``released``, ``aborted`` or ``expired``, as the certificate states it."""
        document: object = self.document
        return document.get("outcome", "released") if isinstance(document, Mapping) else "released"

    @classmethod
    def of_row(cls, row: Mapping[str, Any], release: Mapping[str, Any] | None) -> IssuedCertificate:
        """The certificate of a stored row (``stored_row``) and its release (``None``: none)."""
        return cls(
            row["id"],
            row["dataset_id"],
            row["reservation_id"],
            None if release is None else dict(release),
            row["content_hash"],
            row["created_at"],
            row["body"],
        )

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> IssuedCertificate:
        """The certificate of an answer this ledger gave (an idempotent replay's stored answer)."""
        return cls(
            obj["id"],
            obj["dataset_id"],
            obj["reservation_id"],
            obj["release"],
            obj["content_hash"],
            datetime.fromisoformat(obj["created_at"]),
            obj["certificate"],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "dataset_id": self.dataset_id,
            "reservation_id": self.reservation_id,
            "release": self.release,
            "outcome": self.outcome,
            "content_hash": self.content_hash,
            "created_at": self.created_at.isoformat(),
            "certificate": self.document,
        }


def _row_json(row: Certificate, release: Release | None) -> dict[str, Any]:
    stated = row.body.get("release") if isinstance(row.body, Mapping) else None
    release_json = (
        dict(stated)
        if isinstance(stated, Mapping)
        else None
        if release is None
        else {"model": release.model, "version": release.version}
    )
    return IssuedCertificate(
        row.id, row.dataset_id, row.reservation_id, release_json, row.content_hash, row.created_at, row.body
    ).to_json()


def list_certificates(
    db: Database, tenant_id: str, dataset_id: str, *, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    """The dataset's certificates, oldest first: ``{data, count}``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    with db.session(readonly=True) as session:
        load_dataset(session, tenant_id, dataset_id)
        rows = session.execute(
            select(Certificate, Release)
            .outerjoin(Release, Release.id == Certificate.release_id)
            .where(Certificate.dataset_id == dataset_id)
            .order_by(Certificate.created_at, Certificate.id)
            .limit(limit)
            .offset(offset)
        ).all()
        count = session.scalar(
            select(func.count()).select_from(Certificate).where(Certificate.dataset_id == dataset_id)
        )
        return {"data": [_row_json(c, r) for c, r in rows], "count": count or 0}


def get_certificate(db: Database, tenant_id: str, certificate_id: str) -> dict[str, Any]:
    """One certificate by id (another tenant's answers ``NotFound``)."""
    if not can_be_id(certificate_id):
        raise NotFound("certificate", certificate_id)
    with db.session(readonly=True) as session:
        row = session.execute(
            select(Certificate, Release)
            .outerjoin(Release, Release.id == Certificate.release_id)
            .where(Certificate.id == certificate_id)
        ).one_or_none()
        if row is None or row[0].tenant_id != tenant_id:
            raise NotFound("certificate", certificate_id)
        return _row_json(row[0], row[1])


def verification_work(certificate: Mapping[str, Any], budget: Budget) -> int:
    """Pricing work of re-verifying ``certificate`` under ``budget``: its events' nodes (the
    charge, the partial event, a declared plan, whose PRV ε is recomputed) and one node per class
    of batches (version 1: per batch; each reserve and commit is replayed on its states), times
    the budget's orders (``service.ledger.pricing_limits``)."""
    inputs = certificate.get("inputs") if isinstance(certificate, Mapping) else None
    if not isinstance(inputs, Mapping):
        return 0
    events: list[DpEvent] = list(budget.plan or ())
    for obj in (inputs.get("charge"), {"event": inputs.get("partial_event")}):
        if isinstance(obj, Mapping) and obj.get("event") is not None:
            try:
                events.append(Charge.from_json(obj).event)
            except AccountantError:
                pass  # invalid: verify says so at once, at no cost
    records = inputs.get("classes", inputs.get("batches"))  # version 2: classes; 1: batches
    count = len(records) if isinstance(records, list) else 0
    return (pricing_limits.nodes(events) + count) * pricing_limits.orders_of(budget)


def verify_stored(
    db: Database, tenant_id: str, certificate_id: str, *, policy: pricing_limits.Policy | None = None
) -> dict[str, Any]:
    """Re-verify a stored certificate: ``{ok, reason, signature}``.

    ``ok`` needs both halves: ``accountant.certificates.verify`` recomputes the bound from the
    certificate's own inputs (integrity: an edit breaks the hash or a recomputation), and its
    ``signature`` verifies under one of this server's keys, active or retired (authenticity: a
    forgery with consistent inputs and a recomputed hash has no valid signature). ``signature``
    says which (``service.verification.signing.SignatureCheck``). A certificate issued before the
    ledger signed certificates is ``unsigned``, never signed now: a row edited in the database
    would be signed just the same (docs/DESIGN-NOTES.md, note 20).

    Verifying recomputes every price in the certificate, which a viewer key may ask for as often
    as it likes: it is bounded and metered as a reservation's pricing (``policy``): above
    ``policy.max_work`` it is refused (``InvalidInput`` naming ``certificate_id``: verify it
    offline, ``ledger check --bundle``), and the tenant's meter pays for it.
    """
    policy = policy or pricing_limits.DEFAULT_POLICY
    certificate = get_certificate(db, tenant_id, certificate_id)["certificate"]
    signature = signature_status(db, certificate)
    try:
        budget = Budget.from_json(certificate["inputs"]["budget"])
    except (AccountantError, KeyError, TypeError) as exc:
        return {"ok": False, "reason": f"invalid certificate: {exc}", "signature": signature.to_json()}
    work = verification_work(certificate, budget)
    if work > policy.max_work:
        raise InvalidInput(
            "certificate_id",
            f"costs too much to verify on the server: {work} units of pricing work, above this "
            f"server's limit of {policy.max_work} per request (LEDGER_MAX_PRICING_WORK). Verify it "
            "offline: download it and run accountant.certificates.verify, or `ledger check --bundle`.",
        )
    with policy.metered(work):
        result = issuing.verify(certificate)
    if not result.ok:
        reason = result.reason
    elif not signature.ok:
        reason = f"its inputs re-verify, but {signature.reason}"
    else:
        reason = f"{result.reason}; {signature.reason}"
    return {"ok": bool(result.ok and signature.ok), "reason": reason, "signature": signature.to_json()}


def signature_status(db: Database, certificate: Mapping[str, Any]) -> signing.SignatureCheck:
    """The signature of ``certificate`` checked against this server's keys (active and retired)."""
    check = signing.check_certificate(certificate, server_secrets.signing_keys(db).public_keys())
    if check.status == "unsigned":
        return signing.SignatureCheck(
            "unsigned",
            None,
            "the certificate is not signed (issued before this ledger signed certificates): "
            "nothing shows that this server issued it",
        )
    if check.status == "unknown_key":
        return signing.SignatureCheck(
            "unknown_key",
            check.key_id,
            f"certificate.signature.key_id {check.key_id!r} is none of this server's keys, active "
            "or retired (LEDGER_SIGNING_KEY, LEDGER_SIGNING_KEYS_RETIRED)",
        )
    return check


__all__ = [
    "IssuedCertificate",
    "get_certificate",
    "issue_signed",
    "list_certificates",
    "signature_status",
    "stored_row",
    "verify_stored",
]
