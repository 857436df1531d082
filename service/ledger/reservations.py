"""Reserve → commit / abort / expire: the spend transactions.

Each operation is one database transaction holding the dataset's ledger head
(``lock_ledger_head``: ``SELECT … FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so
every decision is made on the current per-batch states and no two spends on a dataset interleave:

* ``reserve`` parses the event (``accountant.events.from_json``), prices it on every batch it
  reads with ``accountant.rules.reserve`` under the dataset's rule, and holds it — on all batches
  or on none (any refusal rolls the whole transaction back). 409 ``budget_exceeded`` carries the
  batch's ``remaining`` and the ``requested`` cost.
* ``commit`` turns the hold into spend (``accountant.rules.commit``), records the release
  ``{model, version}`` and stores the certificate (``accountant.certificates.issue``). With an
  ``event`` it is a progressive commit: the cost of the run so far (never more than reserved);
  the reservation stays open for later commits, and a commit without ``event`` closes it.
* ``abort`` returns what was held and not committed (``accountant.rules.cancel``).
* A reservation past its ``expires_at`` expires: its hold is returned exactly as by ``abort``.
  Every spend transaction first expires the dataset's due reservations, ``expire_due`` sweeps
  all datasets, and a commit that arrives late expires its reservation and is refused
  (``ReservationExpired``), so a crashed client's hold never becomes spend.

Aggregates are maintained in the same transaction (per batch: its ``BatchState`` and the numbers
read from it; per task and per dataset: maxima over their batches, valid because a batch's spend
never decreases), so reads never scan charges. The transaction's audit entries go to the
dataset's chain, whose head is written with the same update of the ledger head.

Hot path, in round trips under the lock — reserve: lock, load batches, update batches, insert
reservation, insert its batches, update head + insert audit (and the idempotency row); commit:
lock, load, update batches / reservation batches / reservation / tasks, insert release and
certificate, update head + insert audit. Everything that does not need the lock (parsing,
validation, the due-expiry lookup, the idempotency lookup) happens before it.

Numbers in answers are decimal strings (``accountant.exact.to_text``): exact, as stored.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Row, insert, select, update
from sqlalchemy.orm import Session

from accountant import events as ev
from accountant import rules
from accountant.base import AccountantError, InvalidArgumentError, UnsupportedEventError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, exact_add, exact_sub, to_text
from accountant.rules import BatchState, Budget, Charge, Cost
from service.db.base import utcnow
from service.db.models import (
    AuditEntry,
    Batch,
    Dataset,
    Release,
    Reservation,
    ReservationBatch,
    Task,
)
from service.db.session import Database
from service.ledger import audit, certificates, idempotency
from service.ledger.datasets import cached_budget
from service.ledger.errors import (
    BudgetExceeded,
    ChargeRefused,
    Conflict,
    InvalidInput,
    NotFound,
    ReservationExpired,
)

DEFAULT_TTL_S: Final = 3600.0
MAX_TTL_S: Final = 30 * 24 * 3600.0
MAX_BATCHES_PER_RESERVATION: Final = 10_000
MAX_ID_LENGTH: Final = 64
_EXPIRE_PER_TRANSACTION: Final = 500


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def _ids(value: object, field_name: str) -> list[str]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise InvalidInput(field_name, "must be a non-empty list of ids.")
    if len(value) > MAX_BATCHES_PER_RESERVATION:
        raise InvalidInput(
            field_name, f"must hold at most {MAX_BATCHES_PER_RESERVATION} ids. Found {len(value)}."
        )
    out: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item or len(item) > MAX_ID_LENGTH:
            raise InvalidInput(f"{field_name}[{i}]", f"must be an id string. Found {item!r}.")
        if item in seen:
            raise InvalidInput(f"{field_name}[{i}]", f"repeats {item!r}.")
        seen.add(item)
        out.append(item)
    return out


def parse_event(obj: object, field_name: str = "event") -> DpEvent:
    """A mechanism event from its JSON; ``InvalidInput`` names the bad field (``event.scale``)."""
    try:
        return ev.from_json(obj, field_name)
    except EventValidationError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def _charge(event: DpEvent, noise_commitment: object) -> Charge:
    if noise_commitment is not None and not isinstance(noise_commitment, str):
        raise InvalidInput("noise_commitment", f"must be a string. Found {noise_commitment!r}.")
    try:
        return Charge(event, noise_commitment)
    except InvalidArgumentError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def _release(release: object) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(release, Mapping):
        raise InvalidInput("release", f"must be an object {{model, version}}. Found {release!r}.")
    model = release.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > 200:
        raise InvalidInput("release.model", f"must be a non-empty string (<= 200). Found {model!r}.")
    version = release.get("version")
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise InvalidInput("release.version", f"must be a string or an integer. Found {version!r}.")
    text = str(version)
    if not text.strip() or len(text) > 100:
        raise InvalidInput("release.version", f"must be 1-100 characters. Found {version!r}.")
    return model, text, {"model": model, "version": version}


def _ttl(ttl_s: float) -> timedelta:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidInput("ttl_s", f"must be in (0, {MAX_TTL_S:g}] seconds. Found {ttl_s!r}.")
    return timedelta(seconds=float(ttl_s))


def _rule_error(exc: Exception, batch_id: str) -> Exception:
    """The domain error for an accountant error raised while pricing on ``batch_id``."""
    if isinstance(exc, rules.BudgetExceeded):
        return BudgetExceeded(exc.remaining, exc.requested, exc.message, batch_id=batch_id)
    if isinstance(exc, rules.ChargeRefused):
        return ChargeRefused(exc.code, exc.message, batch_id=batch_id)
    if isinstance(exc, InvalidArgumentError):
        return InvalidInput(exc.field, exc.message)
    if isinstance(exc, UnsupportedEventError):
        return InvalidInput("event", str(exc))
    return InvalidInput("event", str(exc))


# ---------------------------------------------------------------------------------------------
# The ledger head and the spend transaction
# ---------------------------------------------------------------------------------------------

_HEAD_COLUMNS: Final = (
    Dataset.id,
    Dataset.tenant_id,
    Dataset.ledger_version,
    Dataset.epsilon_spent,
    Dataset.delta_spent,
    Dataset.naive_epsilon,
    Dataset.epsilon_held,
    Dataset.reservations_open,
    Dataset.charges_committed,
    Dataset.audit_seq,
    Dataset.audit_hash,
)


@dataclass
class _Head:
    """The locked dataset row's aggregates, changed in memory and written once at the end."""

    id: str
    tenant_id: str
    ledger_version: int
    epsilon_spent: Decimal
    delta_spent: Decimal
    naive_epsilon: Decimal
    epsilon_held: Decimal
    reservations_open: int
    charges_committed: int
    audit_seq: int
    audit_hash: str
    last_release: dict[str, Any] | None = None

    def hold(self, epsilon: Decimal) -> None:
        self.epsilon_held = exact_add(self.epsilon_held, epsilon)

    def release_hold(self, epsilon: Decimal) -> None:
        self.epsilon_held = max(ZERO, exact_sub(self.epsilon_held, epsilon))

    def spend(self, state: BatchState) -> None:
        self.epsilon_spent = max(self.epsilon_spent, state.epsilon_spent)
        self.delta_spent = max(self.delta_spent, state.delta_spent)
        self.naive_epsilon = max(self.naive_epsilon, state.naive_epsilon)


class _SpendTransaction:
    """One spend transaction on one dataset: lock, budget, due expiries, audit, final write."""

    def __init__(self, session: Session, tenant_id: str, dataset_id: str, at: datetime) -> None:
        self.session = session
        self.at = at
        self.events: list[audit.AuditEvent] = []
        due = _due_ids(session, dataset_id, at)  # before the lock: usually empty
        stmt = select(*_HEAD_COLUMNS).where(Dataset.id == dataset_id)
        if session.get_bind().dialect.name != "sqlite":
            stmt = stmt.with_for_update()
        row = session.execute(stmt).one_or_none()
        if row is None or row.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        self.head = _Head(**row._asdict())
        self.budget = _budget(session, dataset_id)
        self.expired: list[str] = []
        if due:
            self.expired = _expire(self, due)

    def audit(self, event_type: str, payload: Mapping[str, Any]) -> None:
        self.events.append(
            audit.AuditEvent(event_type, payload, tenant_id=self.head.tenant_id, dataset_id=self.head.id)
        )

    def finish(self) -> None:
        """Append the audit entries and write the ledger head: the transaction's last writes."""
        head = self.head
        rows, head.audit_seq, head.audit_hash = audit.chain_rows(
            head.id, head.audit_seq, head.audit_hash, self.events, self.at
        )
        if rows:
            self.session.execute(insert(AuditEntry), rows)
        values: dict[str, Any] = {
            "ledger_version": head.ledger_version + 1,
            "epsilon_spent": head.epsilon_spent,
            "delta_spent": head.delta_spent,
            "naive_epsilon": head.naive_epsilon,
            "epsilon_held": head.epsilon_held,
            "reservations_open": head.reservations_open,
            "charges_committed": head.charges_committed,
            "audit_seq": head.audit_seq,
            "audit_hash": head.audit_hash,
            "updated_at": self.at,
        }
        if head.last_release is not None:
            values["last_release"] = head.last_release
            values["last_release_at"] = self.at
        self.session.execute(update(Dataset).where(Dataset.id == head.id).values(**values))


def _budget(session: Session, dataset_id: str) -> Budget:
    """The dataset's budget, parsed once per process (budgets never change)."""
    return cached_budget(
        dataset_id, lambda: session.scalar(select(Dataset.budget).where(Dataset.id == dataset_id))
    )


def _due_ids(session: Session, dataset_id: str, at: datetime) -> list[str]:
    return list(
        session.scalars(
            select(Reservation.id)
            .where(
                Reservation.dataset_id == dataset_id,
                Reservation.status == "reserved",
                Reservation.expires_at <= at,
            )
            .order_by(Reservation.expires_at)
            .limit(_EXPIRE_PER_TRANSACTION)
        )
    )


# ---------------------------------------------------------------------------------------------
# Loading a reservation with its batches (one query)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Held:
    """One batch of a reservation: reserved cost, committed cost, the batch's state, its task."""

    batch_id: str
    task_id: str
    position: int
    state_at_reserve: BatchState
    reserved: Cost
    committed: Cost | None
    state: BatchState
    task_epsilon: Decimal
    task_delta: Decimal
    task_naive: Decimal


@dataclass
class _Loaded:
    id: str
    dataset_id: str
    status: str
    event: dict[str, Any]
    noise_commitment: str | None
    epsilon: Decimal
    delta: Decimal
    committed_epsilon: Decimal
    committed_delta: Decimal
    commits: int
    expires_at: datetime
    created_at: datetime
    closed_at: datetime | None
    batches: list[_Held] = field(default_factory=list)


def _load_reservation(session: Session, reservation_id: str) -> _Loaded:
    rows: Sequence[Row[Any]] = session.execute(
        select(
            Reservation.id,
            Reservation.dataset_id,
            Reservation.status,
            Reservation.event,
            Reservation.noise_commitment,
            Reservation.epsilon,
            Reservation.delta,
            Reservation.committed_epsilon,
            Reservation.committed_delta,
            Reservation.commits,
            Reservation.expires_at,
            Reservation.created_at,
            Reservation.closed_at,
            ReservationBatch.batch_id,
            ReservationBatch.position,
            ReservationBatch.state_at_reserve,
            ReservationBatch.cost,
            ReservationBatch.committed,
            Batch.task_id,
            Batch.state,
            Task.epsilon_spent.label("task_epsilon"),
            Task.delta_spent.label("task_delta"),
            Task.naive_epsilon.label("task_naive"),
        )
        .join(ReservationBatch, ReservationBatch.reservation_id == Reservation.id)
        .join(Batch, Batch.id == ReservationBatch.batch_id)
        .join(Task, Task.id == Batch.task_id)
        .where(Reservation.id == reservation_id)
        .order_by(ReservationBatch.position)
    ).all()
    first = rows[0]
    loaded = _Loaded(
        **{name: getattr(first, name) for name in _Loaded.__dataclass_fields__ if name != "batches"}
    )
    loaded.batches = [
        _Held(
            batch_id=r.batch_id,
            task_id=r.task_id,
            position=r.position,
            state_at_reserve=BatchState.from_json(r.state_at_reserve),
            reserved=Cost.from_json(r.cost),
            committed=None if r.committed is None else Cost.from_json(r.committed),
            state=BatchState.from_json(r.state),
            task_epsilon=r.task_epsilon,
            task_delta=r.task_delta,
            task_naive=r.task_naive,
        )
        for r in rows
    ]
    return loaded


def _owner(session: Session, tenant_id: str, reservation_id: str) -> str:
    """The reservation's dataset id (read before the lock); ``NotFound`` for another tenant's."""
    if not isinstance(reservation_id, str) or len(reservation_id) > MAX_ID_LENGTH:
        raise NotFound("reservation", reservation_id)
    row = session.execute(
        select(Reservation.dataset_id, Reservation.tenant_id).where(Reservation.id == reservation_id)
    ).one_or_none()
    if row is None or row.tenant_id != tenant_id:
        raise NotFound("reservation", reservation_id)
    dataset_id: str = row.dataset_id
    return dataset_id


def _cost_json(epsilon: Decimal, delta: Decimal) -> dict[str, str]:
    return {"epsilon": to_text(epsilon), "delta": to_text(delta)}


def _batch_cost_json(batch_id: str, cost: Cost) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": batch_id,
        "epsilon": to_text(cost.epsilon),
        "delta": to_text(cost.delta),
        "naive_epsilon": to_text(cost.naive_epsilon),
    }
    if cost.level is not None:
        out["level"] = cost.level
    if cost.replay:
        out["replay"] = True
    return out


def _reservation_json(r: _Loaded) -> dict[str, Any]:
    return {
        "id": r.id,
        "dataset_id": r.dataset_id,
        "status": r.status,
        "cost": _cost_json(r.epsilon, r.delta),
        "committed": _cost_json(r.committed_epsilon, r.committed_delta),
        "commits": r.commits,
        "noise_commitment": r.noise_commitment,
        "expires_at": r.expires_at.isoformat(),
        "created_at": r.created_at.isoformat(),
        "closed_at": r.closed_at.isoformat() if r.closed_at is not None else None,
        "batches": [_batch_cost_json(b.batch_id, b.reserved) for b in r.batches],
    }


def _close(tx: _SpendTransaction, r: _Loaded, status: str) -> None:
    """Abort or expire: return every batch's uncommitted hold (``rules.cancel``)."""
    changes = []
    for held in r.batches:
        try:
            held.state = rules.cancel(tx.budget, held.state, held.reserved, held.committed)
        except AccountantError as exc:
            raise _rule_error(exc, held.batch_id) from exc
        changes.append(_batch_values(held.batch_id, held.state))
    tx.session.execute(update(Batch), changes)
    tx.head.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
    tx.head.reservations_open -= 1
    r.status, r.closed_at = status, tx.at
    tx.session.execute(
        update(Reservation).where(Reservation.id == r.id).values(status=status, closed_at=tx.at)
    )
    tx.audit(
        f"reservation.{status}",
        {
            "reservation_id": r.id,
            "returned": _cost_json(
                exact_sub(r.epsilon, r.committed_epsilon), exact_sub(r.delta, r.committed_delta)
            ),
            "committed": _cost_json(r.committed_epsilon, r.committed_delta),
        },
    )


def _expire(tx: _SpendTransaction, reservation_ids: Sequence[str]) -> list[str]:
    """Expire the given reservations that are still open and due (re-checked under the lock)."""
    expired = []
    for reservation_id in reservation_ids:
        r = _load_reservation(tx.session, reservation_id)
        if r.status == "reserved" and r.expires_at <= tx.at:
            _close(tx, r, "expired")
            expired.append(r.id)
    return expired


def _batch_values(batch_id: str, state: BatchState) -> dict[str, Any]:
    return {
        "id": batch_id,
        "state": state.to_json(),
        "epsilon_spent": state.epsilon_spent,
        "epsilon_held": state.epsilon_held,
        "delta_spent": state.delta_spent,
        "naive_epsilon": state.naive_epsilon,
    }


# ---------------------------------------------------------------------------------------------
# reserve
# ---------------------------------------------------------------------------------------------


def reserve(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    event_json: object,
    batch_ids: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
    noise_commitment: str | None = None,
    idempotency_key: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Certify a planned charge on the batches (or on every batch of the tasks) and hold it (201).

    Answer: ``{id, dataset_id, status: "reserved", cost: {epsilon, delta}, committed, commits,
    noise_commitment, expires_at, created_at, closed_at, batches: [{id, epsilon, delta,
    naive_epsilon, level?, replay?}]}``; ``cost`` is the maximum over the batches (they are
    disjoint). Raises ``InvalidInput``, ``NotFound`` (dataset, batch or task, also another
    tenant's), ``BudgetExceeded`` / ``ChargeRefused`` (409, naming the batch; nothing is held).
    """
    if (batch_ids is None) == (task_ids is None):
        raise InvalidInput("batches", "give exactly one of batches or tasks.")
    selector = "batches" if batch_ids is not None else "tasks"
    ids = _ids(batch_ids if batch_ids is not None else task_ids, selector)
    event = parse_event(event_json)
    charge = _charge(event, noise_commitment)
    ttl = _ttl(ttl_s)
    event_document = ev.to_json(event)

    def body(session: Session, at: datetime) -> idempotency.Outcome:
        tx = _SpendTransaction(session, tenant_id, dataset_id, at)
        rows = _load_batches(session, dataset_id, selector, ids)
        admissions: list[tuple[str, rules.Admission]] = []
        for batch_id, state_json in rows:
            try:
                admission = rules.reserve(tx.budget, BatchState.from_json(state_json), charge)
            except AccountantError as exc:
                raise _rule_error(exc, batch_id) from exc
            admissions.append((batch_id, admission))
        states_at_reserve = dict(rows)
        epsilon = max(a.cost.epsilon for _, a in admissions)
        delta = max(a.cost.delta for _, a in admissions)
        reservation_id = f"res_{secrets.token_hex(12)}"
        expires_at = at + ttl
        session.execute(update(Batch), [_batch_values(b, a.state) for b, a in admissions])
        session.execute(
            insert(Reservation),
            {
                "id": reservation_id,
                "tenant_id": tenant_id,
                "dataset_id": dataset_id,
                "status": "reserved",
                "event": event_document,
                "noise_commitment": charge.noise_commitment,
                "epsilon": epsilon,
                "delta": delta,
                "committed_epsilon": ZERO,
                "committed_delta": ZERO,
                "commits": 0,
                "expires_at": expires_at,
                "created_at": at,
            },
        )
        session.execute(
            insert(ReservationBatch),
            [
                {
                    "reservation_id": reservation_id,
                    "batch_id": b,
                    "position": i,
                    "state_at_reserve": states_at_reserve[b],
                    "cost": a.cost.to_json(),
                    "committed": None,
                }
                for i, (b, a) in enumerate(admissions)
            ],
        )
        tx.head.hold(epsilon)
        tx.head.reservations_open += 1
        loaded = _Loaded(
            id=reservation_id,
            dataset_id=dataset_id,
            status="reserved",
            event=event_document,
            noise_commitment=charge.noise_commitment,
            epsilon=epsilon,
            delta=delta,
            committed_epsilon=ZERO,
            committed_delta=ZERO,
            commits=0,
            expires_at=expires_at,
            created_at=at,
            closed_at=None,
        )
        response = _reservation_json(loaded)
        response["batches"] = [_batch_cost_json(b, a.cost) for b, a in admissions]
        tx.audit(
            "reservation.reserved",
            {
                "reservation_id": reservation_id,
                "event": event_document,
                "noise_commitment": charge.noise_commitment,
                "cost": response["cost"],
                "batches": response["batches"],
                "expires_at": response["expires_at"],
            },
        )
        tx.finish()
        return idempotency.Outcome(response)

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="reserve",
        request={
            "dataset_id": dataset_id,
            selector: ids,
            "event": event_document,
            "noise_commitment": noise_commitment,
        },
        idempotency_key=idempotency_key,
        body=body,
        status_code=201,
        now=now,
    )


def _load_batches(
    session: Session, dataset_id: str, selector: str, ids: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    """``[(batch id, state JSON)]`` in the order asked (tasks: their batches, oldest first)."""
    if selector == "batches":
        found = {
            r.id: r.state
            for r in session.execute(
                select(Batch.id, Batch.state).where(Batch.id.in_(ids), Batch.dataset_id == dataset_id)
            )
        }
        for batch_id in ids:
            if batch_id not in found:
                raise NotFound("batch", batch_id)
        return [(batch_id, found[batch_id]) for batch_id in ids]
    tasks = set(session.scalars(select(Task.id).where(Task.id.in_(ids), Task.dataset_id == dataset_id)))
    for task_id in ids:
        if task_id not in tasks:
            raise NotFound("task", task_id)
    rows = session.execute(
        select(Batch.id, Batch.state, Batch.task_id)
        .where(Batch.task_id.in_(ids), Batch.dataset_id == dataset_id)
        .order_by(Batch.position)
    ).all()
    order = {task_id: i for i, task_id in enumerate(ids)}
    rows = sorted(rows, key=lambda r: order[r.task_id])  # stable: positions stay in order
    if not rows:
        raise InvalidInput("tasks", "the tasks have no batches.")
    if len(rows) > MAX_BATCHES_PER_RESERVATION:
        raise InvalidInput("tasks", f"cover more than {MAX_BATCHES_PER_RESERVATION} batches.")
    return [(r.id, r.state) for r in rows]


# ---------------------------------------------------------------------------------------------
# commit
# ---------------------------------------------------------------------------------------------


def commit(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    release: Mapping[str, Any],
    event_json: object = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Turn the reservation's hold into spend, record the release, store a certificate (200).

    ``event_json``: the run so far, for a progressive commit (its cost is never more than the
    reservation's; the reservation stays open); ``None`` commits the whole charge and closes it.
    Answer: ``{certificate: {id, dataset_id, reservation_id, release, content_hash, created_at,
    body}, reservation: {...}}``. Raises ``NotFound``, ``InvalidInput``, ``Conflict``
    (``reservation_closed``; ``release_exists`` when the (model, version) was released before),
    ``ReservationExpired`` (its hold is freed and stays freed), ``ChargeRefused``.
    """
    model, version, release_json = _release(release)
    partial = parse_event(event_json) if event_json is not None else None

    def body(session: Session, at: datetime) -> idempotency.Outcome:
        dataset_id = _owner(session, tenant_id, reservation_id)
        tx = _SpendTransaction(session, tenant_id, dataset_id, at)
        r = _load_reservation(session, reservation_id)
        if r.status == "reserved" and r.expires_at <= at:  # due; the lookup before the lock missed it
            _close(tx, r, "expired")
            tx.expired.append(r.id)
        if r.status == "expired":
            if tx.expired:  # expiries made in this transaction stand although the commit fails
                tx.finish()
                return idempotency.Outcome({}, error=ReservationExpired(r.id))
            raise ReservationExpired(r.id)
        if r.status != "reserved":
            raise Conflict(
                f"reservation {r.id!r} is {r.status}; it cannot be committed.",
                reason="reservation_closed",
                status=r.status,
            )
        charge = Charge(ev.from_json(r.event), r.noise_commitment)
        settlements: list[tuple[_Held, rules.Settlement]] = []
        for held in r.batches:
            try:
                settlement = rules.commit(
                    tx.budget, held.state, charge, held.reserved, held.committed, partial
                )
            except AccountantError as exc:
                raise _rule_error(exc, held.batch_id) from exc
            settlements.append((held, settlement))
        closes = partial is None
        committed_epsilon = max(s.committed.epsilon for _, s in settlements)
        committed_delta = max(s.committed.delta for _, s in settlements)
        # The hold shrinks by what became spend; a final commit returns all of the rest.
        if closes:
            tx.head.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
            tx.head.reservations_open -= 1
        else:
            tx.head.release_hold(exact_sub(committed_epsilon, r.committed_epsilon))
        tx.head.charges_committed += 1
        tx.head.last_release = release_json

        session.execute(update(Batch), [_batch_values(h.batch_id, s.state) for h, s in settlements])
        session.execute(
            update(ReservationBatch),
            [
                {"reservation_id": r.id, "batch_id": h.batch_id, "committed": s.committed.to_json()}
                for h, s in settlements
            ],
        )
        # Tasks: the maximum over their batches, kept incrementally (a batch's spend never drops).
        before = {h.task_id: (h.task_epsilon, h.task_delta, h.task_naive) for h in r.batches}
        after = dict(before)
        for _, settlement in settlements:
            tx.head.spend(settlement.state)
        for held, settlement in settlements:
            eps, dlt, naive = after[held.task_id]
            state = settlement.state
            after[held.task_id] = (
                max(eps, state.epsilon_spent),
                max(dlt, state.delta_spent),
                max(naive, state.naive_epsilon),
            )
        changed_tasks = [
            {"id": task_id, "epsilon_spent": v[0], "delta_spent": v[1], "naive_epsilon": v[2]}
            for task_id, v in after.items()
            if v != before[task_id]
        ]
        if changed_tasks:
            session.execute(update(Task), changed_tasks)

        r.status = "committed" if closes else "reserved"
        r.closed_at = at if closes else None
        r.committed_epsilon, r.committed_delta = committed_epsilon, committed_delta
        r.commits += 1
        session.execute(
            update(Reservation)
            .where(Reservation.id == r.id)
            .values(
                status=r.status,
                closed_at=r.closed_at,
                committed_epsilon=committed_epsilon,
                committed_delta=committed_delta,
                commits=r.commits,
            )
        )
        release_id = f"rel_{secrets.token_hex(12)}"
        session.execute(
            insert(Release),
            {
                "id": release_id,
                "tenant_id": tenant_id,
                "dataset_id": dataset_id,
                "reservation_id": r.id,
                "model": model,
                "version": version,
                "created_at": at,
            },
        )
        certificate = certificates.issue_for_commit(
            session,
            tenant_id=tenant_id,
            dataset_id=dataset_id,
            reservation_id=r.id,
            release_id=release_id,
            release=release_json,
            budget=tx.budget,
            charge=charge,
            partial_event=partial,
            batches=[
                certificates.BatchRecord(
                    batch_id=h.batch_id,
                    state_at_reserve=h.state_at_reserve,
                    reserved=h.reserved,
                    state_before=h.state,
                    committed_before=h.committed,
                    state_after=s.state,
                    committed=s.committed,
                )
                for h, s in settlements
            ],
            at=at,
        )
        reservation = _reservation_json(r)
        tx.audit(
            "reservation.committed",
            {
                "reservation_id": r.id,
                "release": release_json,
                "certificate_id": certificate["id"],
                "content_hash": certificate["content_hash"],
                "committed": reservation["committed"],
                "final": closes,
            },
        )
        tx.finish()
        return idempotency.Outcome({"certificate": certificate, "reservation": reservation})

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="commit",
        request={
            "reservation_id": reservation_id,
            "release": release_json,
            "event": None if partial is None else ev.to_json(partial),
        },
        idempotency_key=idempotency_key,
        body=body,
        status_code=200,
        now=now,
    )


# ---------------------------------------------------------------------------------------------
# abort, expire, read
# ---------------------------------------------------------------------------------------------


def abort(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Free what the reservation holds and has not committed (200): the reservation's JSON.

    Aborting an aborted or expired reservation answers its current state and changes nothing;
    a fully committed one is a ``Conflict`` (``reservation_closed``): spend is never returned.
    """

    def body(session: Session, at: datetime) -> idempotency.Outcome:
        dataset_id = _owner(session, tenant_id, reservation_id)
        tx = _SpendTransaction(session, tenant_id, dataset_id, at)
        r = _load_reservation(session, reservation_id)
        if r.status == "committed":
            raise Conflict(
                f"reservation {r.id!r} is committed; spend is never returned.",
                reason="reservation_closed",
                status=r.status,
            )
        if r.status == "reserved":
            _close(tx, r, "aborted")
        tx.finish()
        return idempotency.Outcome(_reservation_json(r))

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="abort",
        request={"reservation_id": reservation_id},
        idempotency_key=idempotency_key,
        body=body,
        status_code=200,
        now=now,
    )


def expire_due(db: Database, *, now: datetime | None = None, limit: int = 10_000) -> dict[str, Any]:
    """Expire every reservation past its ``expires_at`` (the background sweep): ``{expired}``.

    One spend transaction per dataset, each re-checking under the dataset's lock.
    """
    at = now
    with db.session(readonly=True) as session:
        rows = session.execute(
            select(Reservation.id, Reservation.dataset_id, Reservation.tenant_id)
            .where(Reservation.status == "reserved", Reservation.expires_at <= (at or utcnow()))
            .order_by(Reservation.expires_at)
            .limit(limit)
        ).all()
    by_dataset: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        by_dataset.setdefault((row.dataset_id, row.tenant_id), []).append(row.id)
    expired = 0
    for (dataset_id, tenant_id), ids in by_dataset.items():
        for start in range(0, len(ids), _EXPIRE_PER_TRANSACTION):
            chunk = ids[start : start + _EXPIRE_PER_TRANSACTION]
            result = idempotency.execute(
                db,
                tenant_id=tenant_id,
                operation="expire",
                request={},
                idempotency_key=None,
                body=functools.partial(
                    _expire_body, tenant_id=tenant_id, dataset_id=dataset_id, ids=chunk
                ),
                now=at,
            )
            expired += int(result["expired"])
    return {"expired": expired}


def _expire_body(
    session: Session, at: datetime, *, tenant_id: str, dataset_id: str, ids: list[str]
) -> idempotency.Outcome:
    tx = _SpendTransaction(session, tenant_id, dataset_id, at)
    done = set(tx.expired)
    done.update(_expire(tx, [i for i in ids if i not in done]))
    tx.finish()
    return idempotency.Outcome({"expired": len(done)})


def get_reservation(db: Database, tenant_id: str, reservation_id: str) -> dict[str, Any]:
    """The reservation's JSON (another tenant's answers ``NotFound``)."""
    with db.session(readonly=True) as session:
        _owner(session, tenant_id, reservation_id)
        return _reservation_json(_load_reservation(session, reservation_id))


__all__ = [
    "DEFAULT_TTL_S",
    "abort",
    "commit",
    "expire_due",
    "get_reservation",
    "parse_event",
    "reserve",
]
