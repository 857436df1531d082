"""The answers of the spend transactions, typed: frozen values with ``Decimal`` amounts, datetimes
and ids (``Reservation``, ``Commit``, ``SegmentDeclared``, ``Expired``), shaped from the typed
values the store loads (``spending.store.Loaded``) and the decisions make — outside the store,
which only reads and writes rows. In-process callers (the worker, the CLI, the quote) read their
fields; each has ONE ``to_json``, its wire form, called at the edge: the HTTP routers, and the
stored answer of an idempotency key. Nothing in the process parses its own answer back.

And the one home of an idempotent replay's answer (``replay``): the stored answer of a key,
refused when the key names another request, with the reservation as it is now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

from accountant.exact import to_text
from service.ledger.certificates import IssuedCertificate
from service.ledger.errors import IdempotencyConflict, LedgerError
from service.ledger.spending.requests import Request
from service.ledger.spending.store import HeldClass, Loaded


def cost_json(epsilon: Decimal, delta: Decimal) -> dict[str, str]:
    return {"epsilon": to_text(epsilon), "delta": to_text(delta)}


@dataclass(frozen=True, slots=True)
class EpsilonDelta:
    """An (ε, δ) pair: what a reservation holds (``cost``) or has committed."""

    epsilon: Decimal
    delta: Decimal

    def to_json(self) -> dict[str, str]:
        return cost_json(self.epsilon, self.delta)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EpsilonDelta:
        return cls(Decimal(obj["epsilon"]), Decimal(obj["delta"]))


@dataclass(frozen=True, slots=True)
class ClassCost:
    """One reservation class (the batches it read in one state): its index, how many batches,
    and their reserved cost (``naive_epsilon``: as a fresh charge; ``level``: the geometric
    level; ``replay``: a lifelong replay of committed noise)."""

    index: int
    batches: int
    epsilon: Decimal
    delta: Decimal
    naive_epsilon: Decimal
    level: int | None = None
    replay: bool = False

    @classmethod
    def of(cls, c: HeldClass) -> ClassCost:
        cost = c.reserved
        return cls(c.index, c.batches, cost.epsilon, cost.delta, cost.naive_epsilon, cost.level, cost.replay)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ClassCost:
        return cls(
            obj["class"],
            obj["batches"],
            Decimal(obj["epsilon"]),
            Decimal(obj["delta"]),
            Decimal(obj["naive_epsilon"]),
            obj.get("level"),
            bool(obj.get("replay", False)),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "class": self.index,
            "batches": self.batches,
            "epsilon": to_text(self.epsilon),
            "delta": to_text(self.delta),
            "naive_epsilon": to_text(self.naive_epsilon),
        }
        if self.level is not None:
            out["level"] = self.level
        if self.replay:
            out["replay"] = True
        return out


@dataclass(frozen=True, slots=True)
class Reservation:
    """A reservation as the ledger answers it: ``cost`` the most any of its batches holds (they
    are disjoint), ``committed`` what it has committed so far, ``batches`` how many it reads and
    ``batch_set`` the hash that commits to which (``list_batches`` pages them), ``classes`` one
    per reservation class — never per batch."""

    id: str
    dataset_id: str
    status: str  # "reserved", "committed", "aborted" or "expired"
    cost: EpsilonDelta
    committed: EpsilonDelta
    commits: int
    noise_commitment: str | None
    expires_at: datetime
    created_at: datetime
    closed_at: datetime | None
    batches: int
    batch_set: str
    classes: tuple[ClassCost, ...]
    _wire: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, r: Loaded) -> Reservation:
        return cls(
            r.id,
            r.dataset_id,
            r.status,
            EpsilonDelta(r.epsilon, r.delta),
            EpsilonDelta(r.committed_epsilon, r.committed_delta),
            r.commits,
            r.noise_commitment,
            r.expires_at,
            r.created_at,
            r.closed_at,
            r.batches,
            r.batch_set,
            tuple(ClassCost.of(c) for c in r.classes),
        )

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Reservation:
        """The reservation of an answer this ledger gave (a stored idempotent answer)."""
        batches = obj["batches"]
        closed_at = obj["closed_at"]
        return cls(
            obj["id"],
            obj["dataset_id"],
            obj["status"],
            EpsilonDelta.from_json(obj["cost"]),
            EpsilonDelta.from_json(obj["committed"]),
            obj["commits"],
            obj["noise_commitment"],
            datetime.fromisoformat(obj["expires_at"]),
            datetime.fromisoformat(obj["created_at"]),
            None if closed_at is None else datetime.fromisoformat(closed_at),
            batches["count"],
            batches["batch_set"],
            tuple(ClassCost.from_json(c) for c in batches["classes"]),
        )

    def batches_json(self) -> dict[str, Any]:
        return {
            "count": self.batches,
            "batch_set": self.batch_set,
            "classes": [c.to_json() for c in self.classes],
        }

    def to_json(self) -> dict[str, Any]:
        """The wire form, built once and then shared (the spend's audit entry, the stored
        idempotent answer and the HTTP answer read the same dict, as they did before the answers
        were typed): read it, never change it."""
        if self._wire is not None:
            return self._wire
        wire = {
            "id": self.id,
            "dataset_id": self.dataset_id,
            "status": self.status,
            "cost": self.cost.to_json(),
            "committed": self.committed.to_json(),
            "commits": self.commits,
            "noise_commitment": self.noise_commitment,
            "expires_at": self.expires_at.isoformat(),
            "created_at": self.created_at.isoformat(),
            "closed_at": self.closed_at.isoformat() if self.closed_at is not None else None,
            # Per reservation class, never per batch: the batches are paged by
            # GET /v1/reservations/{id}/batches and committed to by ``batch_set``.
            "batches": self.batches_json(),
        }
        object.__setattr__(self, "_wire", wire)
        return wire


@dataclass(frozen=True, slots=True)
class Commit:
    """A commit's answer: the stored certificate of the release and the reservation after it.

    ``stored``: for an idempotent replay, the first answer as stored under its key; its wire form
    is then those stored fields with the reservation as it is now, byte for byte whatever server
    version wrote them (``certificate`` is read from it for in-process callers)."""

    certificate: IssuedCertificate
    reservation: Reservation
    stored: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        if self.stored is not None:
            return {**self.stored, "reservation": self.reservation.to_json()}
        return {"certificate": self.certificate.to_json(), "reservation": self.reservation.to_json()}


@dataclass(frozen=True, slots=True)
class SegmentDeclared:
    """A declared plan segment of a sequential ``prv`` budget: its place (``index``), its events
    (``plan``: their documents), its (ε, δ), what all declared segments hold (``declared``) and
    what the budget has ``left``, how many batches the open segment's closing charged, and the
    theorem the budget's guarantee rests on."""

    dataset_id: str
    index: int
    plan: list[dict[str, Any]]
    epsilon: Decimal
    delta: Decimal
    declared: EpsilonDelta
    left: EpsilonDelta
    closed_batches: int
    theorem: str

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset_id": self.dataset_id,
            "index": self.index,
            "plan": self.plan,
            "delta": to_text(self.delta),
            "epsilon": to_text(self.epsilon),
            "declared": self.declared.to_json(),
            "left": self.left.to_json(),
            "closed_batches": self.closed_batches,
            "theorem": self.theorem,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SegmentDeclared:
        return cls(
            obj["dataset_id"],
            obj["index"],
            obj["plan"],
            Decimal(obj["epsilon"]),
            Decimal(obj["delta"]),
            EpsilonDelta.from_json(obj["declared"]),
            EpsilonDelta.from_json(obj["left"]),
            obj["closed_batches"],
            obj["theorem"],
        )


@dataclass(frozen=True, slots=True)
class Expired:
    """How many reservations an expiry sweep expired."""

    expired: int

    def to_json(self) -> dict[str, Any]:
        return {"expired": self.expired}


Answer = Reservation | Commit | SegmentDeclared | Expired
"""What a spend transaction answers."""

AnswerT = TypeVar("AnswerT", Reservation, Commit, SegmentDeclared, Expired)


def of_kind(kind: type[AnswerT], answer: Answer) -> AnswerT:
    """``answer`` as what its operation answers (``kind``); a ``TypeError`` is a bug here."""
    if not isinstance(answer, kind):
        raise TypeError(f"expected a {kind.__name__} answer, got {type(answer).__name__}")
    return answer


Result = tuple[Answer | None, BaseException | None]
"""An operation's answer, or the error it answers."""

Stored = tuple[str, str, dict[str, Any]]
"""A key's stored answer: ``(operation, request hash, the answer's JSON)``."""


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


def refreshed(op: Request, response: Mapping[str, Any], now: Loaded | None) -> Answer:
    """A replay's answer: the reservation as it is *now* — its status (reserved, committed,
    aborted or expired) and what it holds and has committed now — never the state the first
    answer saw (a retry after an abort or an expiry must not read "reserved"). A commit's replay
    keeps the certificate of its first answer (a certificate never changes) with the reservation
    as it is now; a reserve's or an abort's replay is the reservation as it is now. ``now``
    ``None`` (not found): the stored answer as it is."""
    if op.operation == "commit":
        current = Reservation.from_json(response["reservation"]) if now is None else Reservation.of(now)
        return Commit(IssuedCertificate.from_json(response["certificate"]), current, response)
    if op.operation == "declare_segment":
        return SegmentDeclared.from_json(response)
    return Reservation.from_json(response) if now is None else Reservation.of(now)


def replay(op: Request, stored: Stored) -> tuple[dict[str, Any] | None, LedgerError | None, str | None]:
    """A retry of ``op`` whose key has a stored answer ``(operation, request hash, answer)``:
    ``(None, IdempotencyConflict, None)`` when the key was used for another request; else the
    stored answer and the reservation it is about (``None``: none), from which the caller makes
    the answer (``refreshed``) with that reservation as it is now."""
    operation, digest, response = stored
    if operation != op.operation or digest != op.digest:
        return None, IdempotencyConflict(op.key or ""), None
    return response, None, replayed_reservation(op, response)
