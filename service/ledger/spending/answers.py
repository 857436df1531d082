"""The JSON answers of the spend transactions, shaped from the typed values the store loads
(``spending.store.Loaded``) and the decisions make — outside the store, which only reads and
writes rows — and the one home of an idempotent replay's answer (``replay``): the stored answer
of a key, refused when the key names another request, with the reservation as it is now.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from accountant.exact import to_text
from accountant.rules import Cost
from service.ledger.errors import IdempotencyConflict, LedgerError
from service.ledger.spending.requests import Request
from service.ledger.spending.store import HeldClass, Loaded

Result = tuple[dict[str, Any] | None, BaseException | None]
"""An operation's answer, or the error it answers."""


def cost_json(epsilon: Decimal, delta: Decimal) -> dict[str, str]:
    return {"epsilon": to_text(epsilon), "delta": to_text(delta)}


def _cost_fields(cost: Cost) -> dict[str, Any]:
    out: dict[str, Any] = {
        "epsilon": to_text(cost.epsilon),
        "delta": to_text(cost.delta),
        "naive_epsilon": to_text(cost.naive_epsilon),
    }
    if cost.level is not None:
        out["level"] = cost.level
    if cost.replay:
        out["replay"] = True
    return out


def class_cost_json(c: HeldClass) -> dict[str, Any]:
    """One reservation class in an answer: its index, how many batches, and their reserved cost."""
    return {"class": c.index, "batches": c.batches, **_cost_fields(c.reserved)}


def reservation_json(r: Loaded) -> dict[str, Any]:
    return {
        "id": r.id,
        "dataset_id": r.dataset_id,
        "status": r.status,
        "cost": cost_json(r.epsilon, r.delta),
        "committed": cost_json(r.committed_epsilon, r.committed_delta),
        "commits": r.commits,
        "noise_commitment": r.noise_commitment,
        "expires_at": r.expires_at.isoformat(),
        "created_at": r.created_at.isoformat(),
        "closed_at": r.closed_at.isoformat() if r.closed_at is not None else None,
        # Per reservation class, never per batch: the batches are paged by
        # GET /v1/reservations/{id}/batches and committed to by ``batch_set``.
        "batches": {
            "count": r.batches,
            "batch_set": r.batch_set,
            "classes": [class_cost_json(c) for c in r.classes],
        },
    }


def replayed_reservation(op: Request, response: Mapping[str, Any]) -> str | None:
    """The reservation a stored answer of ``op``'s operation is about (``None``: not one)."""
    if op.operation in ("reserve", "abort", "extend"):
        rid = response.get("id")
    elif op.operation == "commit":
        reservation = response.get("reservation")
        rid = reservation.get("id") if isinstance(reservation, Mapping) else None
    else:
        return None
    return rid if isinstance(rid, str) else None


def refreshed(op: Request, response: dict[str, Any], now: Loaded | None) -> dict[str, Any]:
    """A replay's answer: the reservation as it is *now* — its status (reserved, committed,
    aborted or expired) and what it holds and has committed now — never the state the first
    answer saw (a retry after an abort or an expiry must not read "reserved"). A commit's replay
    keeps the certificate of its first answer (a certificate never changes) with the reservation
    as it is now; a reserve's or an abort's replay is the reservation as it is now."""
    if now is None:
        return response
    current = reservation_json(now)
    if op.operation == "commit":
        return {**response, "reservation": current}
    return current


def replay(op: Request, stored: tuple[str, str, dict[str, Any]]) -> tuple[Result, str | None]:
    """The answer of a retry of ``op`` whose key has a stored answer ``(operation, request hash,
    answer)``: an ``IdempotencyConflict`` when the key was used for another request; else the
    stored answer, and the reservation it is about (``None``: none), which the caller refreshes
    (``refreshed``) as that reservation is now."""
    operation, digest, response = stored
    if operation != op.operation or digest != op.digest:
        conflict: LedgerError = IdempotencyConflict(op.key or "")
        return (None, conflict), None
    return (response, None), replayed_reservation(op, response)
