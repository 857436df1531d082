"""Persistence of the spend transactions: loaded reservations, the locked ledger head, and the
rows one transaction reads and writes.

A ``Work`` holds everything one spend transaction reads and will write; the decisions
(``spending.decisions``) change it in memory and ``Work.flush`` writes it with prebuilt
SQLAlchemy Core statements on the transaction's connection, sent together
(``service.db.session.pipelined``: one round trip on PostgreSQL) while the head is locked.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Connection, bindparam, insert, select, tuple_, update

from accountant.exact import ZERO, exact_add, exact_sub, to_text
from accountant.rules import BatchState, Budget, Cost
from service.db.base import utcnow
from service.db.models import (
    AuditEntry,
    Batch,
    Certificate,
    Dataset,
    IdempotencyKey,
    Release,
    Reservation,
    ReservationBatch,
    Task,
)
from service.db.session import Database, lock_ledger_head, pipelined
from service.ledger import audit
from service.ledger.datasets import cached_budget, can_be_id
from service.ledger.errors import NotFound
from service.ledger.spending.requests import AbortParams, CommitParams, ExpireParams, Op, SegmentParams

EXPIRE_PER_TRANSACTION: Final = 500


# ---------------------------------------------------------------------------------------------
# Loaded state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One batch of a reservation: what it was admitted against, reserved, and has committed."""

    batch_id: str
    task_id: str
    position: int
    state_at_reserve: dict[str, Any]
    reserved: Cost
    committed: Cost | None


@dataclass(frozen=True)
class Loaded:
    """A reservation (immutable: a change is a new value in ``Work.reservations``)."""

    id: str
    tenant_id: str
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
    committed_event: dict[str, Any] | None = None
    batches: tuple[Held, ...] = ()


_RESERVATION_COLUMNS: Final = (
    Reservation.id,
    Reservation.tenant_id,
    Reservation.dataset_id,
    Reservation.status,
    Reservation.event,
    Reservation.noise_commitment,
    Reservation.epsilon,
    Reservation.delta,
    Reservation.committed_epsilon,
    Reservation.committed_delta,
    Reservation.commits,
    Reservation.committed_event,
    Reservation.expires_at,
    Reservation.created_at,
    Reservation.closed_at,
)


# Statements of the spend transaction, built once: each execution reuses the compiled form.
_LOAD_RESERVATIONS: Final = (
    select(
        *_RESERVATION_COLUMNS,
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
    .where(Reservation.id.in_(bindparam("ids", expanding=True)))
    .order_by(Reservation.id, ReservationBatch.position)
)


def load_reservations(
    connection: Connection, reservation_ids: Iterable[str]
) -> tuple[dict[str, Loaded], dict[str, dict[str, Any]], dict[str, tuple[str, tuple[Decimal, ...]]]]:
    """Reservations with their batches, the batches' states and their tasks' aggregates, in one
    query: ``(reservations, batch states, {batch id: (task id, task aggregates)})``."""
    ids = sorted(set(reservation_ids))
    if not ids:
        return {}, {}, {}
    rows = connection.execute(_LOAD_RESERVATIONS, {"ids": ids}).all()
    names = [c.key for c in _RESERVATION_COLUMNS]
    held: dict[str, list[Held]] = {}
    first: dict[str, Any] = {}
    states: dict[str, dict[str, Any]] = {}
    tasks: dict[str, tuple[str, tuple[Decimal, ...]]] = {}
    for r in rows:
        first.setdefault(r.id, r)
        held.setdefault(r.id, []).append(
            Held(
                batch_id=r.batch_id,
                task_id=r.task_id,
                position=r.position,
                state_at_reserve=r.state_at_reserve,
                reserved=Cost.from_json(r.cost),
                committed=None if r.committed is None else Cost.from_json(r.committed),
            )
        )
        states[r.batch_id] = r.state
        tasks[r.batch_id] = (r.task_id, (r.task_epsilon, r.task_delta, r.task_naive))
    loaded = {
        rid: Loaded(**{n: getattr(row, n) for n in names}, batches=tuple(held[rid]))
        for rid, row in first.items()
    }
    return loaded, states, tasks


def cost_json(epsilon: Decimal, delta: Decimal) -> dict[str, str]:
    return {"epsilon": to_text(epsilon), "delta": to_text(delta)}


def batch_cost_json(batch_id: str, cost: Cost) -> dict[str, Any]:
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
        "batches": [batch_cost_json(b.batch_id, b.reserved) for b in r.batches],
    }


# ---------------------------------------------------------------------------------------------
# The work of one spend transaction: the locked head, states, and the writes to make
# ---------------------------------------------------------------------------------------------


@dataclass
class Head:
    """The locked dataset row's aggregates, changed in memory and written once at the end."""

    id: str
    tenant_id: str
    epsilon_spent: Decimal
    delta_spent: Decimal
    naive_epsilon: Decimal
    epsilon_held: Decimal
    reservations_open: int
    charges_committed: int
    ledger_version: int
    audit_seq: int
    audit_hash: str
    plan_segments: int
    last_release: dict[str, Any] | None = None
    last_release_at: datetime | None = None


_LOAD_BATCHES: Final = select(Batch.id, Batch.task_id, Batch.state).where(
    Batch.id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id")
)
_TASKS_OF_DATASET: Final = select(Task.id).where(
    Task.id.in_(bindparam("ids", expanding=True)), Task.dataset_id == bindparam("dataset_id")
)
_BATCHES_OF_TASKS: Final = (
    select(Batch.id, Batch.task_id, Batch.state)
    .where(Batch.task_id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id"))
    .order_by(Batch.task_id, Batch.position)
)
_BATCHES_OF_DATASET: Final = (
    select(Batch.id, Batch.task_id, Batch.state)
    .where(Batch.dataset_id == bindparam("dataset_id"))
    .order_by(Batch.id)
)
_TASK_AGGREGATES: Final = select(Task.epsilon_spent, Task.delta_spent, Task.naive_epsilon).where(
    Task.id == bindparam("id")
)
# Executed on the transaction's Connection with one parameter set per row (executemany): plain
# Core statements, not the ORM's bulk-persistence layer. ``inline``: nothing is read back (no
# implicit RETURNING of generated keys), so the writes can be sent pipelined (``flush``).
_INSERT_RESERVATIONS: Final = insert(Reservation).inline()
_INSERT_RESERVATION_BATCHES: Final = insert(ReservationBatch).inline()
_INSERT_RELEASES: Final = insert(Release).inline()
_INSERT_CERTIFICATES: Final = insert(Certificate).inline()
_INSERT_IDEMPOTENCY_KEYS: Final = insert(IdempotencyKey).inline()
_INSERT_AUDIT_ENTRIES: Final = insert(AuditEntry).inline()
# The SET clause of an executemany UPDATE is every parameter named after a column.
_UPDATE_RESERVATIONS: Final = update(Reservation).where(Reservation.id == bindparam("reservation_id"))
_UPDATE_RESERVATION_BATCHES: Final = update(ReservationBatch).where(
    ReservationBatch.reservation_id == bindparam("held_reservation_id"),
    ReservationBatch.batch_id == bindparam("held_batch_id"),
)
_UPDATE_BATCHES: Final = update(Batch).where(Batch.id == bindparam("batch_id"))
_UPDATE_TASKS: Final = update(Task).where(Task.id == bindparam("task_id"))
_HEAD_WRITTEN: Final = (
    "ledger_version",
    "epsilon_spent",
    "delta_spent",
    "naive_epsilon",
    "epsilon_held",
    "reservations_open",
    "charges_committed",
    "audit_seq",
    "audit_hash",
    "updated_at",
)
_UPDATE_HEAD: Final = (
    update(Dataset)
    .where(Dataset.id == bindparam("dataset_id"))
    .values({name: bindparam(name) for name in _HEAD_WRITTEN})
)
_UPDATE_HEAD_RELEASED: Final = _UPDATE_HEAD.values(
    last_release=bindparam("last_release"), last_release_at=bindparam("last_release_at")
)
_UPDATE_BUDGET: Final = (
    update(Dataset)
    .where(Dataset.id == bindparam("dataset_id"))
    .values(budget=bindparam("budget"), plan_segments=bindparam("plan_segments"))
)


@dataclass
class Work:
    """Everything one spend transaction reads and will write.

    Operations *decide* first (reading only; they may raise a ``LedgerError``) and then *apply*
    (writing into this object only, never raising), so a refused operation leaves no trace.
    ``flush`` writes the result with one statement per table.
    """

    connection: Connection
    head: Head
    budget: Budget
    states: dict[str, BatchState] = field(default_factory=dict)
    batch_task: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, tuple[Decimal, ...]] = field(default_factory=dict)
    reservations: dict[str, Loaded] = field(default_factory=dict)
    new_reservations: set[str] = field(default_factory=set)
    dirty_reservations: set[str] = field(default_factory=set)
    dirty_batches: set[str] = field(default_factory=set)
    dirty_tasks: set[str] = field(default_factory=set)
    releases: list[dict[str, Any]] = field(default_factory=list)
    released: set[tuple[str, str, str]] = field(default_factory=set)
    certificates: list[dict[str, Any]] = field(default_factory=list)
    idempotency: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[audit.AuditEvent, datetime]] = field(default_factory=list)
    task_batches: dict[str, list[str]] = field(default_factory=dict)  # of the tasks reserved on
    expired_on_open: int = 0  # due reservations expired as the transaction opened
    budget_grown: bool = False  # a plan segment was declared: the budget is written with the head

    @classmethod
    def open(cls, connection: Connection, dataset_id: str) -> Work | None:
        """The work of a spend transaction on the dataset, its ledger head locked (``None``: no
        such dataset)."""
        row = lock_ledger_head(connection, dataset_id)
        if row is None:
            return None
        head = Head(**row._asdict())
        # The head's segment count says which budget is current: a budget another process grew
        # by a plan segment since this one cached it is read again.
        budget = cached_budget(
            dataset_id,
            lambda: connection.scalar(_BUDGET, {"dataset_id": dataset_id}),
            segments=head.plan_segments,
        )
        return cls(connection, head, budget)

    # -- loading -------------------------------------------------------------------------------

    def load_for(self, ops: Iterable[Op], reservation_ids: Iterable[str]) -> None:
        """Load what ``ops`` decide on, and the reservations ``reservation_ids``."""
        wanted = set(reservation_ids)
        batch_ids: set[str] = set()
        task_ids: set[str] = set()
        for op in ops:
            params = op.params
            if isinstance(params, CommitParams | AbortParams):
                wanted.add(params.reservation_id)
            elif isinstance(params, ExpireParams):
                wanted.update(params.reservation_ids)
            elif isinstance(params, SegmentParams):
                continue  # it loads every batch itself (``decisions.declare_segment``)
            elif params.selector == "batches":
                batch_ids.update(params.ids)
            else:
                task_ids.update(params.ids)
        self.load_reservations(wanted)
        self.load_batches(batch_ids)
        self.task_batches = self.load_task_batches(task_ids)

    def load_reservations(self, ids: Iterable[str]) -> None:
        wanted = [i for i in ids if i not in self.reservations]
        loaded, states, tasks = load_reservations(self.connection, wanted)
        self.reservations.update(loaded)
        for batch_id, state in states.items():
            self.states.setdefault(batch_id, BatchState.from_json(state))
        for batch_id, (task_id, aggregates) in tasks.items():
            self.batch_task[batch_id] = task_id
            self.tasks.setdefault(task_id, aggregates)

    def load_batches(self, ids: Iterable[str]) -> None:
        wanted = sorted({i for i in ids if i not in self.states})
        if not wanted:
            return
        for row in self.connection.execute(_LOAD_BATCHES, {"ids": wanted, "dataset_id": self.head.id}):
            self.states[row.id] = BatchState.from_json(row.state)
            self.batch_task[row.id] = row.task_id

    def load_all_batches(self) -> None:
        """Load every batch of the dataset (declaring a plan segment closes the open one on all)."""
        for row in self.connection.execute(_BATCHES_OF_DATASET, {"dataset_id": self.head.id}):
            self.states.setdefault(row.id, BatchState.from_json(row.state))
            self.batch_task[row.id] = row.task_id

    def grow_budget(self, budget: Budget) -> None:
        """The budget with one more declared plan segment, written with the head (``flush``)."""
        self.budget = budget
        self.head.plan_segments = len(budget.segments)
        self.budget_grown = True

    def load_task_batches(self, task_ids: Iterable[str]) -> dict[str, list[str]]:
        """``{task id: its batch ids in order}`` for the tasks of this dataset."""
        wanted = sorted(set(task_ids))
        if not wanted:
            return {}
        out: dict[str, list[str]] = {
            t: []
            for t in self.connection.scalars(_TASKS_OF_DATASET, {"ids": wanted, "dataset_id": self.head.id})
        }
        rows = self.connection.execute(_BATCHES_OF_TASKS, {"ids": list(out), "dataset_id": self.head.id})
        for row in rows:
            out[row.task_id].append(row.id)
            self.states.setdefault(row.id, BatchState.from_json(row.state))
            self.batch_task[row.id] = row.task_id
        return out

    # -- applying --------------------------------------------------------------------------------

    def audit(self, event_type: str, payload: Mapping[str, Any], at: datetime) -> None:
        event = audit.AuditEvent(event_type, payload, tenant_id=self.head.tenant_id, dataset_id=self.head.id)
        self.events.append((event, at))

    def set_state(self, batch_id: str, state: BatchState) -> None:
        """Store a batch's new state and raise the task's and the dataset's maxima with it."""
        before = self.states[batch_id]
        self.states[batch_id] = state
        self.dirty_batches.add(batch_id)
        spent = (state.epsilon_spent, state.delta_spent, state.naive_epsilon)
        if spent == (before.epsilon_spent, before.delta_spent, before.naive_epsilon):
            return  # holds move, spend does not: no maximum changes
        head = self.head
        head.epsilon_spent = max(head.epsilon_spent, state.epsilon_spent)
        head.delta_spent = max(head.delta_spent, state.delta_spent)
        head.naive_epsilon = max(head.naive_epsilon, state.naive_epsilon)
        task_id = self.batch_task[batch_id]
        if task_id not in self.tasks:  # commits load their tasks; load it if anything else spends
            self.tasks[task_id] = tuple(self.connection.execute(_TASK_AGGREGATES, {"id": task_id}).one())
        eps, dlt, naive = self.tasks[task_id]
        raised = (max(eps, state.epsilon_spent), max(dlt, state.delta_spent), max(naive, state.naive_epsilon))
        if raised != (eps, dlt, naive):
            self.tasks[task_id] = raised
            self.dirty_tasks.add(task_id)

    def put_reservation(self, r: Loaded, *, new: bool = False) -> None:
        self.reservations[r.id] = r
        (self.new_reservations if new else self.dirty_reservations).add(r.id)

    def hold(self, epsilon: Decimal) -> None:
        self.head.epsilon_held = exact_add(self.head.epsilon_held, epsilon)

    def release_hold(self, epsilon: Decimal) -> None:
        self.head.epsilon_held = max(ZERO, exact_sub(self.head.epsilon_held, epsilon))

    # -- writing -----------------------------------------------------------------------------------

    def flush(self) -> None:
        with pipelined(self.connection):  # the ledger head is locked: one round trip, not ten
            self._write()

    def _write(self) -> None:
        execute = self.connection.execute
        new = [self.reservations[i] for i in sorted(self.new_reservations)]
        if new:
            execute(_INSERT_RESERVATIONS, [_reservation_row(r) for r in new])
            execute(
                _INSERT_RESERVATION_BATCHES,
                [_reservation_batch_row(r.id, h) for r in new for h in r.batches],
            )
        changed = [self.reservations[i] for i in sorted(self.dirty_reservations - self.new_reservations)]
        if changed:
            execute(
                _UPDATE_RESERVATIONS,
                [
                    {
                        "reservation_id": r.id,
                        "status": r.status,
                        "closed_at": r.closed_at,
                        "committed_epsilon": r.committed_epsilon,
                        "committed_delta": r.committed_delta,
                        "commits": r.commits,
                        "committed_event": r.committed_event,
                    }
                    for r in changed
                ],
            )
            committed = [
                {"held_reservation_id": r.id, "held_batch_id": h.batch_id, "committed": h.committed.to_json()}
                for r in changed
                for h in r.batches
                if h.committed is not None
            ]
            if committed:
                execute(_UPDATE_RESERVATION_BATCHES, committed)
        if self.dirty_batches:
            execute(_UPDATE_BATCHES, [_batch_row(b, self.states[b]) for b in sorted(self.dirty_batches)])
        if self.dirty_tasks:
            execute(
                _UPDATE_TASKS,
                [
                    {"task_id": t, "epsilon_spent": v[0], "delta_spent": v[1], "naive_epsilon": v[2]}
                    for t in sorted(self.dirty_tasks)
                    for v in (self.tasks[t],)
                ],
            )
        if self.releases:
            execute(_INSERT_RELEASES, self.releases)
        if self.certificates:
            execute(_INSERT_CERTIFICATES, self.certificates)
        if self.idempotency:
            execute(_INSERT_IDEMPOTENCY_KEYS, self.idempotency)
        self._flush_head()

    def _flush_head(self) -> None:
        head = self.head
        rows: list[dict[str, Any]] = []
        for event, at in self.events:
            chained, head.audit_seq, head.audit_hash = audit.chain_rows(
                head.id, head.audit_seq, head.audit_hash, [event], at
            )
            rows.extend(chained)
        if rows:
            self.connection.execute(_INSERT_AUDIT_ENTRIES, rows)
        values: dict[str, Any] = {
            "dataset_id": head.id,
            "ledger_version": head.ledger_version + 1,
            "epsilon_spent": head.epsilon_spent,
            "delta_spent": head.delta_spent,
            "naive_epsilon": head.naive_epsilon,
            "epsilon_held": head.epsilon_held,
            "reservations_open": head.reservations_open,
            "charges_committed": head.charges_committed,
            "audit_seq": head.audit_seq,
            "audit_hash": head.audit_hash,
            "updated_at": max((at for _, at in self.events), default=utcnow()),
        }
        if head.last_release is None:
            self.connection.execute(_UPDATE_HEAD, values)
        else:
            values.update(last_release=head.last_release, last_release_at=head.last_release_at)
            self.connection.execute(_UPDATE_HEAD_RELEASED, values)
        if self.budget_grown:
            self.connection.execute(
                _UPDATE_BUDGET,
                {"dataset_id": head.id, "budget": self.budget.to_json(), "plan_segments": head.plan_segments},
            )


def _batch_row(batch_id: str, state: BatchState) -> dict[str, Any]:
    return {
        "batch_id": batch_id,
        "state": state.to_json(),
        "epsilon_spent": state.epsilon_spent,
        "epsilon_held": state.epsilon_held,
        "delta_spent": state.delta_spent,
        "naive_epsilon": state.naive_epsilon,
    }


def _reservation_row(r: Loaded) -> dict[str, Any]:
    return {
        "id": r.id,
        "tenant_id": r.tenant_id,
        "dataset_id": r.dataset_id,
        "status": r.status,
        "event": r.event,
        "noise_commitment": r.noise_commitment,
        "epsilon": r.epsilon,
        "delta": r.delta,
        "committed_epsilon": r.committed_epsilon,
        "committed_delta": r.committed_delta,
        "commits": r.commits,
        "committed_event": r.committed_event,
        "expires_at": r.expires_at,
        "created_at": r.created_at,
        "closed_at": r.closed_at,
    }


def _reservation_batch_row(reservation_id: str, h: Held) -> dict[str, Any]:
    return {
        "reservation_id": reservation_id,
        "batch_id": h.batch_id,
        "position": h.position,
        "state_at_reserve": h.state_at_reserve,
        "cost": h.reserved.to_json(),
        "committed": None if h.committed is None else h.committed.to_json(),
    }


# ---------------------------------------------------------------------------------------------
# Datasets (read before the transaction, by ``spending.prices``) and the group's reads
# ---------------------------------------------------------------------------------------------


_DATASET: Final = select(Dataset.tenant_id, Dataset.budget, Dataset.plan_segments).where(
    Dataset.id == bindparam("dataset_id")
)
_SEGMENTS: Final = select(Dataset.plan_segments).where(Dataset.id == bindparam("dataset_id"))
# A dataset's tenant never changes and its budget only grows plan segments: remembered per
# process, by id (``dataset_budget`` checks the segment count of a budget with a plan).
_DATASETS_SIZE: Final = 4096
_datasets: OrderedDict[str, tuple[str, Budget]] = OrderedDict()
_datasets_lock = threading.Lock()


def known_dataset(dataset_id: str) -> tuple[str, Budget] | None:
    """``(tenant id, budget)`` of the dataset when this process knows it (no I/O)."""
    with _datasets_lock:
        return _datasets.get(dataset_id)


def dataset_budget(db: Database, dataset_id: str) -> tuple[str, Budget]:
    """``(tenant id, budget)`` of the dataset: remembered, or one read. ``NotFound`` if none.

    A budget with a declared plan can grow plan segments: its remembered form is used only while
    the row's ``plan_segments`` still matches (one small read)."""
    known = known_dataset(dataset_id)
    if known is not None and (
        known[1].plan is None
        or [r.plan_segments for r in db.read_all(_SEGMENTS, {"dataset_id": dataset_id})]
        == [len(known[1].segments)]
    ):
        return known
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)
    rows = db.read_all(_DATASET, {"dataset_id": dataset_id})
    if not rows:
        raise NotFound("dataset", dataset_id)
    stored = rows[0].budget
    # The same Budget object the spend transaction gets (``cached_budget``): the memo applies.
    known = (rows[0].tenant_id, cached_budget(dataset_id, lambda: stored, segments=rows[0].plan_segments))
    with _datasets_lock:
        _datasets[dataset_id] = known
        if len(_datasets) > _DATASETS_SIZE:
            _datasets.popitem(last=False)
    return known


_DUE: Final = (
    select(Reservation.id)
    .where(
        Reservation.dataset_id == bindparam("dataset_id"),
        Reservation.status == "reserved",
        Reservation.expires_at <= bindparam("at"),
    )
    .order_by(Reservation.expires_at)
    .limit(EXPIRE_PER_TRANSACTION)
)
_STORED_ANSWERS: Final = select(
    IdempotencyKey.key, IdempotencyKey.operation, IdempotencyKey.request_hash, IdempotencyKey.response
).where(
    IdempotencyKey.tenant_id == bindparam("tenant_id"),
    IdempotencyKey.key.in_(bindparam("keys", expanding=True)),
)
_RELEASED: Final = select(Release.tenant_id, Release.model, Release.version).where(
    tuple_(Release.tenant_id, Release.model, Release.version).in_(bindparam("releases", expanding=True))
)
_BUDGET: Final = select(Dataset.budget).where(Dataset.id == bindparam("dataset_id"))


def due_ids(connection: Connection, dataset_id: str, at: datetime) -> list[str]:
    return list(connection.scalars(_DUE, {"dataset_id": dataset_id, "at": at}))


def stored_answers(connection: Connection, ops: Sequence[Op]) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    by_tenant: dict[str, list[str]] = {}
    for op in ops:
        if op.key is not None:
            by_tenant.setdefault(op.tenant_id, []).append(op.key)
    for tenant_id, keys in by_tenant.items():
        for row in connection.execute(_STORED_ANSWERS, {"tenant_id": tenant_id, "keys": keys}):
            out[(tenant_id, row.key)] = (row.operation, row.request_hash, row.response)
    return out


def released(connection: Connection, ops: Sequence[Op]) -> set[tuple[str, str, str]]:
    """Which of the (tenant, model, version) the commits in ``ops`` release exist already."""
    wanted = {
        (op.tenant_id, op.params.model, op.params.version)
        for op in ops
        if isinstance(op.params, CommitParams)
    }
    if not wanted:
        return set()
    rows = connection.execute(_RELEASED, {"releases": sorted(wanted)})
    return {(r.tenant_id, r.model, r.version) for r in rows}


def replayed_reservation(op: Op, response: Mapping[str, Any]) -> str | None:
    """The reservation a stored answer of ``op``'s operation is about (``None``: not one)."""
    if op.operation in ("reserve", "abort"):
        rid = response.get("id")
    elif op.operation == "commit":
        reservation = response.get("reservation")
        rid = reservation.get("id") if isinstance(reservation, Mapping) else None
    else:
        return None
    return rid if isinstance(rid, str) else None


def refreshed(op: Op, response: dict[str, Any], now: Loaded | None) -> dict[str, Any]:
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
