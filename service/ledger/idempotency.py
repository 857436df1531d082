"""Idempotency keys, and the one runner every mutating ledger operation goes through.

Every mutating operation takes an optional ``idempotency_key`` (the HTTP ``Idempotency-Key``
header). The first successful answer is stored under ``(tenant, key)`` in the same transaction as
the operation, together with the operation's name and a hash of the request. Then:

* same key, same request → the stored first answer, and nothing is charged again;
* same key, different request (or another operation) → ``IdempotencyConflict``;
* two retries racing: both may run, but the unique constraint lets only the first commit; the
  second's whole transaction (its charge included) rolls back and it answers the stored answer.

A refused request (a ``LedgerError``) stores nothing, so retrying it re-evaluates it.

``execute`` is the unit of work: run the operation's body in one transaction, store the
idempotent answer, append the body's audit events (last: they lock the audit head), commit;
retry the whole transaction on a deadlock or serialization failure.

The body answers a typed value (``Answer``: anything with a ``to_json``, its wire form); that
wire form is what a key stores. A replay answers ``replay(stored)``: the operation's
``from_json``, which reads the typed fields from the stored answer and keeps the stored JSON as
its wire form, so a retry's bytes are the first answer's whatever server version wrote them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, Generic, Protocol, TypeVar

from sqlalchemy import insert, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from accountant.canonical import sha256_hex
from accountant.exact import to_text
from service.db.base import utcnow
from service.db.models import IdempotencyKey
from service.db.session import Database
from service.ledger import audit
from service.ledger.errors import (
    DuplicateIdempotencyKey,
    IdempotencyConflict,
    InvalidInput,
    LedgerError,
)

MAX_KEY_LENGTH: Final = 255
_TRANSIENT_RETRIES: Final = 5
# PostgreSQL: deadlock_detected, serialization_failure. SQLite: busy timeout ran out.
_TRANSIENT_SQLSTATES: Final = frozenset({"40P01", "40001"})


class Answer(Protocol):
    """A typed answer: its ``to_json`` is its wire form (what a key stores)."""

    def to_json(self) -> dict[str, Any]: ...


AnswerT = TypeVar("AnswerT", bound=Answer)


@dataclass
class Outcome(Generic[AnswerT]):
    """What an operation's body produced: the answer, its audit events, and possibly an error
    that must be raised *after* the commit (a state change that stands although the call
    fails, e.g. the expiry a late commit discovers)."""

    response: AnswerT
    audit: list[audit.AuditEvent] = field(default_factory=list)
    error: LedgerError | None = None


def check_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(
            "Idempotency-Key", f"must be a non-empty string of at most {MAX_KEY_LENGTH} characters."
        )
    if not key.isprintable():
        raise InvalidInput("Idempotency-Key", "must contain printable characters only.")
    return key


def request_hash(operation: str, request: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the operation and its request (decimals as text)."""
    return sha256_hex({"operation": operation, "request": request}, default=_as_text)


def _as_text(value: Any) -> Any:
    if isinstance(value, Decimal):
        return to_text(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"{type(value).__name__} in an idempotent request: {value!r}")


def lookup(
    session: Session, *, tenant_id: str, key: str, operation: str, digest: str
) -> dict[str, Any] | None:
    """The stored first answer for ``key``, ``None`` if there is none; raises on a mismatch."""
    row = session.execute(
        select(IdempotencyKey.operation, IdempotencyKey.request_hash, IdempotencyKey.response).where(
            IdempotencyKey.tenant_id == tenant_id, IdempotencyKey.key == key
        )
    ).one_or_none()
    if row is None:
        return None
    if row.operation != operation or row.request_hash != digest:
        raise IdempotencyConflict(key)
    response: dict[str, Any] = row.response
    return response


def _is_transient(exc: OperationalError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate in _TRANSIENT_SQLSTATES:
        return True
    return "database is locked" in str(exc.orig)


def execute(
    db: Database,
    *,
    tenant_id: str,
    operation: str,
    request: Mapping[str, Any],
    idempotency_key: str | None,
    body: Callable[[Session, datetime], Outcome[AnswerT]],
    replay: Callable[[Mapping[str, Any]], AnswerT],
    status_code: int = 200,
    now: datetime | None = None,
) -> AnswerT:
    """Run ``body`` as one idempotent, audited transaction and return its answer; a key's stored
    answer is returned as ``replay(stored)``."""
    key = check_key(idempotency_key)
    digest = request_hash(operation, request) if key is not None else ""
    attempt = 0
    while True:
        attempt += 1
        try:
            return _execute_once(db, tenant_id, operation, key, digest, body, replay, status_code, now)
        except DuplicateIdempotencyKey:
            # A concurrent retry with this key committed first: answer with its answer.
            if attempt > _TRANSIENT_RETRIES:
                raise
        except LedgerError:
            # A retry racing the first request can be refused by the state the first one left
            # (e.g. "already committed") after its key lookup found nothing: answer the first
            # answer if it is there now.
            if key is not None:
                with db.session(readonly=True) as session:
                    stored = lookup(session, tenant_id=tenant_id, key=key, operation=operation, digest=digest)
                if stored is not None:
                    return replay(stored)
            raise
        except OperationalError as exc:
            if attempt > _TRANSIENT_RETRIES or not _is_transient(exc):
                raise
            time.sleep(0.005 * attempt)


def _execute_once(
    db: Database,
    tenant_id: str,
    operation: str,
    key: str | None,
    digest: str,
    body: Callable[[Session, datetime], Outcome[AnswerT]],
    replay: Callable[[Mapping[str, Any]], AnswerT],
    status_code: int,
    now: datetime | None,
) -> AnswerT:
    with db.session() as session:
        if key is not None:
            stored = lookup(session, tenant_id=tenant_id, key=key, operation=operation, digest=digest)
            if stored is not None:
                return replay(stored)
        at = now or utcnow()
        outcome = body(session, at)
        if key is not None and outcome.error is None:
            session.execute(
                insert(IdempotencyKey),
                {
                    "tenant_id": tenant_id,
                    "key": key,
                    "operation": operation,
                    "request_hash": digest,
                    "response": outcome.response.to_json(),
                    "status_code": status_code,
                    "created_at": at,
                },
            )
        session.flush()
        audit.append(session, outcome.audit, now=at)
    if outcome.error is not None:
        raise outcome.error
    return outcome.response


def job_reservations(db: Database, tenant_id: str, job_id: str) -> list[tuple[str, str]]:
    """``(key, reservation id)`` of every reserve call the worker made for a job, in any of its
    attempts, whose stored answer names a reservation: the keys ``job:<job id>:a<attempt>:…reserve``
    of ``service.worker.gate`` (a reserve that succeeded but was never recorded on the job is
    found by its key)."""
    with db.session(readonly=True) as session:
        rows = session.execute(
            select(IdempotencyKey.key, IdempotencyKey.response).where(
                IdempotencyKey.tenant_id == tenant_id,
                IdempotencyKey.key.like(f"job:{job_id}:a%:%reserve"),
            )
        ).all()
    found = []
    for key, response in rows:
        reservation_id = response.get("id") if isinstance(response, Mapping) else None
        if isinstance(reservation_id, str):
            found.append((key, reservation_id))
    return found


__all__ = [
    "MAX_KEY_LENGTH",
    "Answer",
    "Outcome",
    "check_key",
    "execute",
    "job_reservations",
    "lookup",
    "request_hash",
]
