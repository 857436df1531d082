"""Domain errors of the ledger: what a refused or invalid ledger operation raises.

Nothing below the HTTP router raises ``HTTPException``; the API maps these in one place. Every
error carries a stable ``code`` (the ``error`` field of the JSON answer), an HTTP ``status`` hint,
a human ``message`` naming the field and the value, and ``details`` merged into the JSON body:
``{"error": code, "message": message, **details}`` (``to_json``).

A refused operation changes nothing: every ledger operation is one database transaction and a
domain error rolls it back (the one exception, documented in ``reservations``, is the expiry that a
late commit discovers: it is stored before ``ReservationExpired`` is raised).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final


class LedgerError(Exception):
    """Base class. ``code``: stable error code; ``status``: HTTP status hint."""

    code: str = "ledger_error"
    status: int = 400

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}


class NotFound(LedgerError):
    """An unknown id, or an id of another tenant (which must look exactly the same)."""

    code = "not_found"
    status = 404

    def __init__(self, what: str, identifier: object) -> None:
        super().__init__(f"{what} {identifier!r} not found.", details={"resource": what})
        self.what = what
        self.identifier = identifier


class InvalidInput(LedgerError):
    """Malformed input. ``field`` is the dotted path of the bad field (``"event.epsilon"``)."""

    code = "invalid_input"
    status = 422

    def __init__(self, field: str, message: str) -> None:
        text = message if message.startswith(field) else f"{field} {message}"
        super().__init__(text, details={"field": field})
        self.field = field


class PayloadTooLarge(LedgerError):
    """An upload above its limit (``field`` names it, ``limit`` in bytes); nothing was kept."""

    code = "payload_too_large"
    status = 413

    def __init__(self, field: str, limit: int) -> None:
        super().__init__(f"{field} must be at most {limit} bytes.", details={"field": field, "limit": limit})
        self.field = field


class BudgetExceeded(LedgerError):
    """The charge does not fit: ``remaining`` and ``requested`` as decimal strings."""

    code = "budget_exceeded"
    status = 409

    def __init__(
        self,
        remaining: dict[str, str],
        requested: dict[str, str],
        message: str = "",
        *,
        batch_id: str | None = None,
    ) -> None:
        details: dict[str, Any] = {"remaining": remaining, "requested": requested}
        if batch_id is not None:
            details["batch_id"] = batch_id
        super().__init__(
            message or f"the charge {requested} does not fit the remaining budget {remaining}.",
            details=details,
        )
        self.remaining = remaining
        self.requested = requested
        self.batch_id = batch_id


class BatchOverlap(LedgerError):
    """A record id is already in a batch of this dataset (or twice in the request)."""

    code = "batch_overlap"
    status = 409

    def __init__(self, record_id: str | int | None) -> None:
        message = (
            f"record {record_id!r} is already in a batch of this dataset."
            if record_id is not None
            else "a record is already in a batch of this dataset."
        )
        super().__init__(message, details={"record_id": record_id})
        self.record_id = record_id


class ChargeRefused(LedgerError):
    """The rule refuses the charge for a reason other than its size.

    ``code`` is the rule's reason: ``batch_already_read`` (parallel, S2), ``no_geometric_level``,
    ``outside_plan`` (prv plan), ``noise_commitment_mismatch`` (lifelong), ...
    """

    status = 409

    def __init__(self, code: str, message: str, *, batch_id: str | None = None) -> None:
        details: dict[str, Any] = {}
        if batch_id is not None:
            details["batch_id"] = batch_id
        super().__init__(message, details=details)
        self.code = code
        self.batch_id = batch_id


class IdempotencyConflict(LedgerError):
    """An Idempotency-Key reused for a different request."""

    code = "idempotency_conflict"
    status = 409

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency-Key {key!r} was already used for a different request.",
            details={"idempotency_key": key},
        )
        self.key = key


class Conflict(LedgerError):
    """The operation conflicts with the current state (``reason`` says how)."""

    code = "conflict"
    status = 409

    def __init__(self, message: str, *, reason: str = "conflict", **details: Any) -> None:
        super().__init__(message, details={"reason": reason, **details})
        self.reason = reason


class ReleaseExists(Conflict):
    """The (model, version) was released before: a release is recorded once per tenant. Raised
    at commit, and at reserve when the caller names its release there (checked before training)."""

    def __init__(self, model: str, version: str) -> None:
        super().__init__(
            f"model {model!r} version {version!r} has already been released; release this run "
            "under another version (or another model name).",
            reason="release_exists",
            model=model,
            version=version,
        )


class DuplicateIdempotencyKey(Conflict):
    """Another request with the same Idempotency-Key committed first (a race between retries).

    ``service.ledger.idempotency`` catches it and answers with the stored first answer; it reaches
    a client only if that answer cannot be read, as a 409 asking to retry.
    """

    code = "idempotency_in_progress"

    def __init__(self) -> None:
        super().__init__(
            "a request with this Idempotency-Key is being processed; retry it.",
            reason="idempotency_in_progress",
        )


class ReservationExpired(Conflict):
    """A commit or an extension arrived after the reservation's TTL: the reservation expired,
    which charges everything it reserved (as an abort does), and it releases nothing."""

    code = "reservation_expired"

    def __init__(self, reservation_id: str) -> None:
        super().__init__(
            f"reservation {reservation_id!r} expired; an expiry charges everything reserved "
            "(a certificate of outcome expired) and releases nothing. Extend a hold before its "
            "expires_at (POST /v1/reservations/{id}/extend).",
            reason="reservation_expired",
            reservation_id=reservation_id,
        )


class LifetimeExceeded(Conflict):
    """An extension would keep the hold past the reservation's maximum lifetime
    (``LEDGER_RESERVATION_MAX_LIFETIME_S`` from its creation): ``latest_expires_at`` is as far as
    it may go. Nothing changes."""

    code = "reservation_lifetime_exceeded"

    def __init__(
        self, reservation_id: str, ttl_s: float, latest_expires_at: str, max_lifetime_s: float
    ) -> None:
        super().__init__(
            f"ttl_s {ttl_s:g} would hold reservation {reservation_id!r} past its maximum lifetime "
            f"of {max_lifetime_s:g} s from creation; the latest expires_at is {latest_expires_at}. "
            "Commit what ran (a progressive commit) and reserve the rest anew.",
            reason="reservation_lifetime_exceeded",
            field="ttl_s",
            reservation_id=reservation_id,
            latest_expires_at=latest_expires_at,
            max_lifetime_s=max_lifetime_s,
        )


class RateLimited(LedgerError):
    """The tenant used up its share of a shared resource (pricing CPU time); retry later.

    ``retry_after_s`` is when enough is back for the request (the API sends it as ``Retry-After``).
    """

    code = "rate_limited"
    status = 429

    def __init__(self, message: str, *, retry_after_s: float, **details: Any) -> None:
        super().__init__(message, details={"retry_after_s": round(retry_after_s, 3), **details})
        self.retry_after_s = retry_after_s


CONSTRAINT_ERRORS: Final[Mapping[str, Callable[[], LedgerError]]] = {
    # The record is named by ``service.ledger.batches``, which knows what the client sent.
    "pk_batch_records": lambda: BatchOverlap(None),
    "uq_idempotency_keys_tenant_id_key": lambda: DuplicateIdempotencyKey(),
    "uq_releases_tenant_id_model_version": lambda: Conflict(
        "this (model, version) has already been released.", reason="release_exists"
    ),
    "uq_certificates_release_id": lambda: Conflict(
        "this release already has a certificate.", reason="release_exists"
    ),
    "pk_tenants": lambda: Conflict("the tenant already exists.", reason="tenant_exists"),
    # (``service.ledger.datasets`` names the dataset that has the name; this is the race's answer)
    "uq_datasets_tenant_id_name": lambda: Conflict(
        "a dataset of this tenant already has this name; choose another.", reason="dataset_name_taken"
    ),
    "uq_api_keys_key_hash": lambda: Conflict("the API key already exists.", reason="key_exists"),
}
"""The error a violation of each named unique constraint of the schema is (``service.db.session``
translates it; ``service.ledger`` registers this when it is imported)."""


__all__ = [
    "CONSTRAINT_ERRORS",
    "BatchOverlap",
    "BudgetExceeded",
    "ChargeRefused",
    "Conflict",
    "DuplicateIdempotencyKey",
    "IdempotencyConflict",
    "InvalidInput",
    "LedgerError",
    "LifetimeExceeded",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "ReleaseExists",
    "ReservationExpired",
]
