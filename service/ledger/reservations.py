"""Reserve → commit / abort / expire: the spend transactions.

Every spend runs in a database transaction that holds the dataset's ledger head
(``SELECT … FOR UPDATE`` on the dataset row on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so each
decision is made on the current per-batch states and no two spends on a dataset interleave:

* ``reserve`` parses the event (``accountant.events.from_json``), prices it on every batch it
  reads with ``accountant.rules.reserve`` under the dataset's rule, and holds it — on all batches
  or on none. A refusal is 409 ``budget_exceeded`` (with the batch's ``remaining`` and the
  ``requested`` cost) or a rule's own code (``batch_already_read``, ``outside_plan``, ...).
* ``commit`` turns the hold into spend (``accountant.rules.commit``), records the release
  ``{model, version}`` and stores the certificate (``accountant.certificates.issue``). With an
  ``event_json`` it is a progressive commit: the cost of the run so far (never more than
  reserved); the reservation stays open, and a commit without ``event_json`` closes it.
* ``abort`` returns what was held and not committed (``accountant.rules.cancel``).
* A reservation past its ``expires_at`` expires and returns its hold exactly as ``abort`` does.
  Every spend transaction first expires the dataset's due reservations, ``expire_due`` sweeps all
  datasets, and a late commit expires its reservation and is refused (``ReservationExpired``): a
  crashed client's hold never becomes spend.

**Group commit.** A durable commit waits for the write-ahead log to reach the disk, and the
ledger head stays locked until it has, so one-transaction-per-spend caps a hot dataset at about
one spend per disk flush. Concurrent spends on one dataset within a process are therefore
combined: the first caller becomes the leader, takes every spend queued for the dataset, and runs
them in ONE transaction — each decided in turn on the states the previous ones left, exactly as
if they had run one after the other; a refused spend changes nothing and gets its own error.
Each caller gets its answer after that transaction commits. If the group transaction itself fails
(a constraint race with another process, a deadlock), each spend is retried alone, so one spend's
failure is never another's. Spends from other processes serialise on the ledger head as before.
Callers in threads (the worker, the CLI) queue on ``_Combiner``, whose first caller leads;
coroutines (the HTTP routes: ``reserve_async`` ...) queue on ``_AsyncCombiner``, whose drain task
runs each group in one worker thread. A group reads and writes through prebuilt SQLAlchemy Core
statements on the transaction's connection, and its writes are sent together
(``service.db.session.pipelined``: one round trip on PostgreSQL) while the head is locked.

Aggregates are maintained in the same transaction (per batch: its ``BatchState`` and the numbers
read from it; per task and per dataset: maxima over their batches, valid because a batch's spend
never decreases), so reads never scan charges. Audit entries go to the dataset's chain, whose head
is written with the same update of the ledger head. Numbers in answers are decimal strings.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

import anyio.to_thread
from sqlalchemy import Connection, bindparam, insert, select, tuple_, update
from sqlalchemy.exc import OperationalError

from accountant import events as ev
from accountant import rules
from accountant.certificates import BatchRecord
from accountant.errors import AccountantError, InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, exact_add, exact_sub, to_text
from accountant.rules import BatchState, Budget, Charge, Cost, PriceMemo
from service import server_secrets
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
from service.db.session import Database, pipelined
from service.ledger import audit, certificates, idempotency, pricing
from service.ledger.datasets import MAX_ID_LENGTH, cached_budget, can_be_id, check_text
from service.ledger.errors import (
    BudgetExceeded,
    ChargeRefused,
    Conflict,
    DuplicateIdempotencyKey,
    IdempotencyConflict,
    InvalidInput,
    LedgerError,
    NotFound,
    ReservationExpired,
)
from service.ledger.signing import SigningKey

DEFAULT_TTL_S: Final = 3600.0
MAX_TTL_S: Final = 30 * 24 * 3600.0
MAX_BATCHES_PER_RESERVATION: Final = 10_000
MAX_GROUP: Final = 64
_EXPIRE_PER_TRANSACTION: Final = 500
_RETRIES: Final = 5
_TRANSIENT_SQLSTATES: Final = frozenset({"40P01", "40001"})


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
        if not can_be_id(item):  # no such batch or task (and PostgreSQL refuses NUL in a query)
            raise NotFound("batch" if field_name == "batches" else "task", item)
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
    check_text(model, "release.model")  # refused before anything is locked: the hold stays open
    version = release.get("version")
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise InvalidInput("release.version", f"must be a string or an integer. Found {version!r}.")
    text = str(version)
    if not text.strip() or len(text) > 100:
        raise InvalidInput("release.version", f"must be 1-100 characters. Found {version!r}.")
    check_text(text, "release.version")
    return model, text, {"model": model, "version": version}


def _ttl(ttl_s: float) -> timedelta:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidInput("ttl_s", f"must be in (0, {MAX_TTL_S:g}] seconds. Found {ttl_s!r}.")
    return timedelta(seconds=float(ttl_s))


def _rule_error(exc: AccountantError, batch_id: str) -> LedgerError:
    """The domain error for an accountant error raised while pricing on ``batch_id``."""
    if isinstance(exc, rules.BudgetExceeded):
        return BudgetExceeded(exc.remaining, exc.requested, exc.message, batch_id=batch_id)
    if isinstance(exc, rules.ChargeRefused):
        return ChargeRefused(exc.code, exc.message, batch_id=batch_id)
    if isinstance(exc, InvalidArgumentError):
        return InvalidInput(exc.field, exc.message)
    return InvalidInput("event", str(exc))  # UnsupportedEventError: the accountant cannot


# ---------------------------------------------------------------------------------------------
# Operations: what a caller asks for, and its answer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ReserveParams:
    selector: str  # "batches" | "tasks"
    ids: list[str]
    charge: Charge
    event_document: dict[str, Any]
    ttl: timedelta


@dataclass(frozen=True)
class _CommitParams:
    reservation_id: str
    model: str
    version: str
    release: dict[str, Any]
    partial: DpEvent | None
    signer: SigningKey  # the server's active key: it signs the certificate (service.ledger.signing)


@dataclass(frozen=True)
class _AbortParams:
    reservation_id: str


@dataclass(frozen=True)
class _ExpireParams:
    reservation_ids: list[str]


_Params = _ReserveParams | _CommitParams | _AbortParams | _ExpireParams


@dataclass(eq=False)
class _Op:
    """One spend operation waiting for (or holding) its answer."""

    operation: str
    tenant_id: str
    dataset_id: str
    at: datetime
    params: _Params
    key: str | None = None
    digest: str = ""
    policy: pricing.Policy = pricing.DEFAULT_POLICY
    # Set by ``_prepare``, before the spend transaction: the charge's prices, and for a
    # progressive commit the reservation's event as parsed then (it never changes).
    prepared: bool = False
    memo: PriceMemo | None = None
    reserved_event: tuple[dict[str, Any], DpEvent] | None = None
    done: bool = False
    response: dict[str, Any] | None = None
    error: BaseException | None = None
    wake: threading.Event | None = field(default=None, repr=False)  # a sync caller's (``_Combiner``)

    def finish(self, response: dict[str, Any] | None, error: BaseException | None) -> None:
        self.response, self.error, self.done = response, error, True


# ---------------------------------------------------------------------------------------------
# Loaded state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Held:
    """One batch of a reservation: what it was admitted against, reserved, and has committed."""

    batch_id: str
    task_id: str
    position: int
    state_at_reserve: dict[str, Any]
    reserved: Cost
    committed: Cost | None


@dataclass(frozen=True)
class _Loaded:
    """A reservation (immutable: a change is a new value in ``_Work.reservations``)."""

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
    batches: tuple[_Held, ...] = ()


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


def _load_reservations(
    connection: Connection, reservation_ids: Iterable[str]
) -> tuple[dict[str, _Loaded], dict[str, dict[str, Any]], dict[str, tuple[str, tuple[Decimal, ...]]]]:
    """Reservations with their batches, the batches' states and their tasks' aggregates, in one
    query: ``(reservations, batch states, {batch id: (task id, task aggregates)})``."""
    ids = sorted(set(reservation_ids))
    if not ids:
        return {}, {}, {}
    rows = connection.execute(_LOAD_RESERVATIONS, {"ids": ids}).all()
    names = [c.key for c in _RESERVATION_COLUMNS]
    held: dict[str, list[_Held]] = {}
    first: dict[str, Any] = {}
    states: dict[str, dict[str, Any]] = {}
    tasks: dict[str, tuple[str, tuple[Decimal, ...]]] = {}
    for r in rows:
        first.setdefault(r.id, r)
        held.setdefault(r.id, []).append(
            _Held(
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
        rid: _Loaded(**{n: getattr(row, n) for n in names}, batches=tuple(held[rid]))
        for rid, row in first.items()
    }
    return loaded, states, tasks


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


# ---------------------------------------------------------------------------------------------
# The work of one spend transaction: the locked head, states, and the writes to make
# ---------------------------------------------------------------------------------------------

_HEAD_COLUMNS: Final = (
    Dataset.id,
    Dataset.tenant_id,
    Dataset.epsilon_spent,
    Dataset.delta_spent,
    Dataset.naive_epsilon,
    Dataset.epsilon_held,
    Dataset.reservations_open,
    Dataset.charges_committed,
    Dataset.ledger_version,
    Dataset.audit_seq,
    Dataset.audit_hash,
)


@dataclass
class _Head:
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


@dataclass
class _Work:
    """Everything one spend transaction reads and will write.

    Operations *decide* first (reading only; they may raise a ``LedgerError``) and then *apply*
    (writing into this object only, never raising), so a refused operation leaves no trace.
    ``flush`` writes the result with one statement per table.
    """

    connection: Connection
    head: _Head
    budget: Budget
    states: dict[str, BatchState] = field(default_factory=dict)
    batch_task: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, tuple[Decimal, ...]] = field(default_factory=dict)
    reservations: dict[str, _Loaded] = field(default_factory=dict)
    new_reservations: set[str] = field(default_factory=set)
    dirty_reservations: set[str] = field(default_factory=set)
    dirty_batches: set[str] = field(default_factory=set)
    dirty_tasks: set[str] = field(default_factory=set)
    releases: list[dict[str, Any]] = field(default_factory=list)
    released: set[tuple[str, str, str]] = field(default_factory=set)
    certificates: list[dict[str, Any]] = field(default_factory=list)
    idempotency: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[audit.AuditEvent, datetime]] = field(default_factory=list)

    # -- loading -------------------------------------------------------------------------------

    def load_reservations(self, ids: Iterable[str]) -> None:
        wanted = [i for i in ids if i not in self.reservations]
        loaded, states, tasks = _load_reservations(self.connection, wanted)
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

    def put_reservation(self, r: _Loaded, *, new: bool = False) -> None:
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


def _batch_row(batch_id: str, state: BatchState) -> dict[str, Any]:
    return {
        "batch_id": batch_id,
        "state": state.to_json(),
        "epsilon_spent": state.epsilon_spent,
        "epsilon_held": state.epsilon_held,
        "delta_spent": state.delta_spent,
        "naive_epsilon": state.naive_epsilon,
    }


def _reservation_row(r: _Loaded) -> dict[str, Any]:
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


def _reservation_batch_row(reservation_id: str, h: _Held) -> dict[str, Any]:
    return {
        "reservation_id": reservation_id,
        "batch_id": h.batch_id,
        "position": h.position,
        "state_at_reserve": h.state_at_reserve,
        "cost": h.reserved.to_json(),
        "committed": None if h.committed is None else h.committed.to_json(),
    }


# ---------------------------------------------------------------------------------------------
# The operations, each deciding on a _Work and then applying to it
# ---------------------------------------------------------------------------------------------


def _close(work: _Work, r: _Loaded, status: str, at: datetime) -> _Loaded:
    """Abort or expire ``r``: return every batch's uncommitted hold (``rules.cancel``)."""
    states: list[tuple[str, BatchState]] = []
    for h in r.batches:
        try:
            states.append(
                (h.batch_id, rules.cancel(work.budget, work.states[h.batch_id], h.reserved, h.committed))
            )
        except AccountantError as exc:
            raise _rule_error(exc, h.batch_id) from exc
    for batch_id, state in states:
        work.set_state(batch_id, state)
    work.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
    work.head.reservations_open -= 1
    closed = replace(r, status=status, closed_at=at)
    work.put_reservation(closed)
    work.audit(
        f"reservation.{status}",
        {
            "reservation_id": r.id,
            "returned": _cost_json(
                exact_sub(r.epsilon, r.committed_epsilon), exact_sub(r.delta, r.committed_delta)
            ),
            "committed": _cost_json(r.committed_epsilon, r.committed_delta),
        },
        at,
    )
    return closed


def _do_reserve(
    work: _Work, op: _Op, params: _ReserveParams, task_batches: dict[str, list[str]]
) -> dict[str, Any]:
    if params.selector == "batches":
        batch_ids = params.ids
        for batch_id in batch_ids:
            if batch_id not in work.states:
                raise NotFound("batch", batch_id)
    else:
        batch_ids = []
        for task_id in params.ids:
            if task_id not in task_batches:
                raise NotFound("task", task_id)
            batch_ids.extend(task_batches[task_id])
        if not batch_ids:
            raise InvalidInput("tasks", "the tasks have no batches.")
        if len(batch_ids) > MAX_BATCHES_PER_RESERVATION:
            raise InvalidInput("tasks", f"cover more than {MAX_BATCHES_PER_RESERVATION} batches.")
    admissions: list[tuple[str, rules.Admission]] = []
    for batch_id in batch_ids:  # decide on every batch before holding on any
        try:
            admissions.append((batch_id, rules.reserve(work.budget, work.states[batch_id], params.charge)))
        except AccountantError as exc:
            raise _rule_error(exc, batch_id) from exc
    epsilon = max(a.cost.epsilon for _, a in admissions)
    delta = max(a.cost.delta for _, a in admissions)
    r = _Loaded(
        id=f"res_{secrets.token_hex(12)}",
        tenant_id=op.tenant_id,
        dataset_id=work.head.id,
        status="reserved",
        event=params.event_document,
        noise_commitment=params.charge.noise_commitment,
        epsilon=epsilon,
        delta=delta,
        committed_epsilon=ZERO,
        committed_delta=ZERO,
        commits=0,
        expires_at=op.at + params.ttl,
        created_at=op.at,
        closed_at=None,
        batches=tuple(
            _Held(b, work.batch_task[b], i, work.states[b].to_json(), a.cost, None)
            for i, (b, a) in enumerate(admissions)
        ),
    )
    for batch_id, admission in admissions:
        work.set_state(batch_id, admission.state)
    work.put_reservation(r, new=True)
    work.hold(epsilon)
    work.head.reservations_open += 1
    response = _reservation_json(r)
    work.audit(
        "reservation.reserved",
        {
            "reservation_id": r.id,
            "event": r.event,
            "noise_commitment": r.noise_commitment,
            "cost": response["cost"],
            "batches": response["batches"],
            "expires_at": response["expires_at"],
        },
        op.at,
    )
    return response


def _do_commit(work: _Work, op: _Op, params: _CommitParams) -> tuple[dict[str, Any], LedgerError | None]:
    r = work.reservations.get(params.reservation_id)
    if r is None or r.tenant_id != op.tenant_id:
        raise NotFound("reservation", params.reservation_id)
    if r.status == "reserved" and r.expires_at <= op.at:
        # Late: the hold is returned and stays returned although this commit is refused.
        _close(work, r, "expired", op.at)
        return {}, ReservationExpired(r.id)
    if r.status == "expired":
        raise ReservationExpired(r.id)
    if r.status != "reserved":
        raise Conflict(
            f"reservation {r.id!r} is {r.status}; it cannot be committed.",
            reason="reservation_closed",
            status=r.status,
        )
    release_key = (op.tenant_id, params.model, params.version)
    if release_key in work.released:
        raise Conflict("this (model, version) has already been released.", reason="release_exists")
    if op.reserved_event is not None and op.reserved_event[0] == r.event:
        event = op.reserved_event[1]  # parsed (and priced with) before the transaction
    else:
        event = ev.from_json(r.event)
    charge = Charge(event, r.noise_commitment)
    # The run the previous progressive commit reported: this one must extend it.
    previous = None if r.committed_event is None else ev.from_json(r.committed_event)
    settled: list[tuple[_Held, BatchState, rules.Settlement]] = []
    for h in r.batches:
        before = work.states[h.batch_id]
        try:
            settlement = rules.commit(
                work.budget, before, charge, h.reserved, h.committed, params.partial, previous
            )
        except AccountantError as exc:
            raise _rule_error(exc, h.batch_id) from exc
        settled.append((h, before, settlement))
    closes = params.partial is None
    committed_epsilon = max(s.committed.epsilon for _, _, s in settled)
    committed_delta = max(s.committed.delta for _, _, s in settled)
    release_id = f"rel_{secrets.token_hex(12)}"
    certificate_id = f"cert_{secrets.token_hex(12)}"
    body = certificates.issue(
        budget=work.budget,
        charge=charge,
        batches=[
            BatchRecord(
                batch_id=h.batch_id,
                state_at_reserve=BatchState.from_json(h.state_at_reserve),
                reserved=h.reserved,
                state_before=before,
                committed_before=h.committed,
                state_after=s.state,
                committed=s.committed,
            )
            for h, before, s in settled
        ],
        reservation_id=r.id,
        release=params.release,
        partial_event=params.partial,
        previous_event=previous,
        release_id=release_id,
        dataset_id=work.head.id,
        issued_at=op.at,
        signer=params.signer,
    )
    # Decided: apply.
    for h, _, s in settled:
        work.set_state(h.batch_id, s.state)
    if closes:  # the rest of the hold returns with the final commit
        work.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
        work.head.reservations_open -= 1
    else:
        work.release_hold(exact_sub(committed_epsilon, r.committed_epsilon))
    work.head.charges_committed += 1
    work.head.last_release, work.head.last_release_at = params.release, op.at
    r = replace(
        r,
        status="committed" if closes else "reserved",
        closed_at=op.at if closes else None,
        committed_epsilon=committed_epsilon,
        committed_delta=committed_delta,
        commits=r.commits + 1,
        committed_event=None if params.partial is None else ev.to_json(params.partial),
        batches=tuple(replace(h, committed=s.committed) for h, _, s in settled),
    )
    work.put_reservation(r)
    work.released.add(release_key)
    work.releases.append(
        {
            "id": release_id,
            "tenant_id": op.tenant_id,
            "dataset_id": work.head.id,
            "reservation_id": r.id,
            "model": params.model,
            "version": params.version,
            "created_at": op.at,
        }
    )
    certificate = certificates.stored_row(
        certificate_id=certificate_id,
        tenant_id=op.tenant_id,
        dataset_id=work.head.id,
        reservation_id=r.id,
        release_id=release_id,
        body=body,
        at=op.at,
    )
    work.certificates.append(certificate)
    reservation = _reservation_json(r)
    work.audit(
        "reservation.committed",
        {
            "reservation_id": r.id,
            "release": params.release,
            "certificate_id": certificate_id,
            "content_hash": certificate["content_hash"],
            "committed": reservation["committed"],
            "final": closes,
        },
        op.at,
    )
    return {
        "certificate": certificates.row_json(certificate, params.release),
        "reservation": reservation,
    }, None


def _do_abort(work: _Work, op: _Op, params: _AbortParams) -> dict[str, Any]:
    r = work.reservations.get(params.reservation_id)
    if r is None or r.tenant_id != op.tenant_id:
        raise NotFound("reservation", params.reservation_id)
    if r.status == "committed":
        raise Conflict(
            f"reservation {r.id!r} is committed; spend is never returned.",
            reason="reservation_closed",
            status=r.status,
        )
    if r.status == "reserved":
        r = _close(work, r, "aborted", op.at)
    return _reservation_json(r)


def _expire_due(work: _Work, reservation_ids: Iterable[str], at: datetime) -> int:
    """Expire those of the reservations that are open and due at ``at``."""
    expired = 0
    for reservation_id in reservation_ids:
        r = work.reservations.get(reservation_id)
        if r is not None and r.status == "reserved" and r.expires_at <= at:
            _close(work, r, "expired", at)
            expired += 1
    return expired


# ---------------------------------------------------------------------------------------------
# Pricing, before the transaction (``service.ledger.pricing``)
# ---------------------------------------------------------------------------------------------

_DATASET: Final = select(Dataset.tenant_id, Dataset.budget).where(Dataset.id == bindparam("dataset_id"))
_SNAPSHOT_BATCHES: Final = select(Batch.state).where(
    Batch.id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id")
)
_SNAPSHOT_TASKS: Final = select(Batch.state).where(
    Batch.task_id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id")
)
# A dataset's tenant and budget never change: remembered per process, by id.
_DATASETS_SIZE: Final = 4096
_datasets: OrderedDict[str, tuple[str, Budget]] = OrderedDict()
_datasets_lock = threading.Lock()


def _known_dataset(dataset_id: str) -> tuple[str, Budget] | None:
    """``(tenant id, budget)`` of the dataset when this process knows it (no I/O)."""
    with _datasets_lock:
        return _datasets.get(dataset_id)


def _dataset_budget(db: Database, dataset_id: str) -> tuple[str, Budget]:
    """``(tenant id, budget)`` of the dataset: remembered, or one read. ``NotFound`` if none."""
    known = _known_dataset(dataset_id)
    if known is not None:
        return known
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)
    rows = db.read_all(_DATASET, {"dataset_id": dataset_id})
    if not rows:
        raise NotFound("dataset", dataset_id)
    stored = rows[0].budget
    # The same Budget object the spend transaction gets (``cached_budget``): the memo applies.
    known = (rows[0].tenant_id, cached_budget(dataset_id, lambda: stored))
    with _datasets_lock:
        _datasets[dataset_id] = known
        if len(_datasets) > _DATASETS_SIZE:
            _datasets.popitem(last=False)
    return known


def _priced_event(op: _Op) -> DpEvent | None:
    """The event ``op`` asks to price: a reservation's, a progressive commit's (else ``None``)."""
    if isinstance(op.params, _ReserveParams):
        return op.params.charge.event
    if isinstance(op.params, _CommitParams):
        return op.params.partial
    return None


def _prices_inline(op: _Op) -> bool:
    """Whether ``op`` is priced in its group's worker thread, just before the transaction: it
    prices nothing, or little under a budget this process knows. Otherwise a coroutine prices it
    in a pricing thread before it joins the group, so it never delays the group."""
    event = _priced_event(op)
    if event is None:
        return True
    known = _known_dataset(op.dataset_id)
    return known is not None and pricing.work(known[1], [event]) <= pricing.INLINE_WORK


def _prepare(db: Database, op: _Op) -> None:
    """Bound, meter and price ``op``'s charge, outside any transaction (once per op).

    The work (event nodes × the budget's orders) is checked against ``op.policy.max_work``
    (``InvalidInput`` naming ``event``) and handed to ``op.policy.meter`` (which may refuse)
    before anything is computed. Then a dry run of the rule fills ``op.memo`` with every
    state-independent price; the spend transaction decides with the same memo (``rules.pricing``),
    on the states it reads under the lock. The dry run decides nothing: a refusal it meets is
    left for the transaction, except a refusal of the event itself (invalid, unsupported, or a
    parallel read that costs nothing), which no state changes.
    """
    if op.prepared:
        return
    op.prepared = True
    event = _priced_event(op)
    if event is None:
        return
    tenant_id, budget = _dataset_budget(db, op.dataset_id)
    if tenant_id != op.tenant_id:
        raise NotFound("dataset", op.dataset_id)
    units = pricing.check_work(budget, [event], op.policy.max_work)
    memo = PriceMemo(budget)
    with op.policy.metered(units), rules.pricing(memo):
        if isinstance(op.params, _ReserveParams):
            _dry_reserve(db, op, budget, op.params)
        elif isinstance(op.params, _CommitParams):
            _dry_commit(db, op, budget, op.params)
    op.memo = memo


def _dry_run(decide: Any, *args: Any, event_errors: bool) -> None:
    """Run ``decide`` for its prices only. With ``event_errors``, an error of the event itself
    (invalid, unsupported: no state changes that) is raised now, as the transaction would."""
    try:
        decide(*args)
    except (rules.BudgetExceeded, rules.ChargeRefused):
        pass  # depends on the state: decided under the lock, on the state then
    except AccountantError as exc:
        if event_errors:
            raise _rule_error(exc, "") from exc


def _dry_reserve(db: Database, op: _Op, budget: Budget, params: _ReserveParams) -> None:
    states = [BatchState.empty()]
    if budget.plan is not None:
        # A declared plan prices the plan's prefix up to each batch's position: read them.
        query = _SNAPSHOT_BATCHES if params.selector == "batches" else _SNAPSHOT_TASKS
        rows = db.read_all(query, {"ids": params.ids, "dataset_id": op.dataset_id})
        positions: dict[int, BatchState] = {}
        for row in rows:
            state = BatchState.from_json(row.state)
            positions.setdefault(state.plan_position, replace(state, plan_open=False))
        states = list(positions.values()) or states
    for state in states:  # no state error is possible on these states: any error is the event's
        _dry_run(rules.reserve, budget, state, params.charge, event_errors=True)


def _dry_commit(db: Database, op: _Op, budget: Budget, params: _CommitParams) -> None:
    with db.session(readonly=True) as session:
        loaded, states, _ = _load_reservations(session.connection(), [params.reservation_id])
    r = loaded.get(params.reservation_id)
    if r is None or r.tenant_id != op.tenant_id or r.status != "reserved":
        return  # refused in the transaction
    try:
        reserved = ev.from_json(r.event)
    except EventValidationError:
        return
    op.reserved_event = (r.event, reserved)
    charge = Charge(reserved, r.noise_commitment)
    for h in r.batches:
        state = BatchState.from_json(states[h.batch_id])
        _dry_run(
            rules.commit, budget, state, charge, h.reserved, h.committed, params.partial, event_errors=False
        )


def _prepared(db: Database, ops: Sequence[_Op]) -> list[_Op]:
    """``ops`` priced (``_prepare``); an op whose pricing is refused is answered now and left out."""
    ready: list[_Op] = []
    for op in ops:
        try:
            _prepare(db, op)
        except Exception as exc:  # its own answer (invalid, not found, rate limited, ...)
            op.finish(None, exc)
            continue
        ready.append(op)
    return ready


# ---------------------------------------------------------------------------------------------
# One transaction for a group of operations on one dataset
# ---------------------------------------------------------------------------------------------


_DUE: Final = (
    select(Reservation.id)
    .where(
        Reservation.dataset_id == bindparam("dataset_id"),
        Reservation.status == "reserved",
        Reservation.expires_at <= bindparam("at"),
    )
    .order_by(Reservation.expires_at)
    .limit(_EXPIRE_PER_TRANSACTION)
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
_HEAD: Final = select(*_HEAD_COLUMNS).where(Dataset.id == bindparam("dataset_id"))
_HEAD_FOR_UPDATE: Final = _HEAD.with_for_update()
_BUDGET: Final = select(Dataset.budget).where(Dataset.id == bindparam("dataset_id"))


def _due_ids(connection: Connection, dataset_id: str, at: datetime) -> list[str]:
    return list(connection.scalars(_DUE, {"dataset_id": dataset_id, "at": at}))


def _stored_answers(connection: Connection, ops: Sequence[_Op]) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    by_tenant: dict[str, list[str]] = {}
    for op in ops:
        if op.key is not None:
            by_tenant.setdefault(op.tenant_id, []).append(op.key)
    for tenant_id, keys in by_tenant.items():
        for row in connection.execute(_STORED_ANSWERS, {"tenant_id": tenant_id, "keys": keys}):
            out[(tenant_id, row.key)] = (row.operation, row.request_hash, row.response)
    return out


def _released(connection: Connection, ops: Sequence[_Op]) -> set[tuple[str, str, str]]:
    """Which of the (tenant, model, version) the commits in ``ops`` release exist already."""
    wanted = {
        (op.tenant_id, op.params.model, op.params.version)
        for op in ops
        if isinstance(op.params, _CommitParams)
    }
    if not wanted:
        return set()
    rows = connection.execute(_RELEASED, {"releases": sorted(wanted)})
    return {(r.tenant_id, r.model, r.version) for r in rows}


def _replay(
    op: _Op, stored: tuple[str, str, dict[str, Any]]
) -> tuple[dict[str, Any] | None, LedgerError | None]:
    operation, digest, response = stored
    if operation != op.operation or digest != op.digest:
        return None, IdempotencyConflict(op.key or "")
    return response, None


def _replayed_reservation(op: _Op, response: Mapping[str, Any]) -> str | None:
    """The reservation a stored answer of ``op``'s operation is about (``None``: not one)."""
    if op.operation in ("reserve", "abort"):
        rid = response.get("id")
    elif op.operation == "commit":
        reservation = response.get("reservation")
        rid = reservation.get("id") if isinstance(reservation, Mapping) else None
    else:
        return None
    return rid if isinstance(rid, str) else None


def _refreshed(op: _Op, response: dict[str, Any], now: _Loaded | None) -> dict[str, Any]:
    """A replay's answer: the reservation as it is *now* — its status (reserved, committed,
    aborted or expired) and what it holds and has committed now — never the state the first
    answer saw (a retry after an abort or an expiry must not read "reserved"). A commit's replay
    keeps the certificate of its first answer (a certificate never changes) with the reservation
    as it is now; a reserve's or an abort's replay is the reservation as it is now."""
    if now is None:
        return response
    current = _reservation_json(now)
    if op.operation == "commit":
        return {**response, "reservation": current}
    return current


_Result = tuple[dict[str, Any] | None, BaseException | None]


def _group_transaction(connection: Connection, dataset_id: str, ops: Sequence[_Op]) -> dict[int, _Result]:
    """Decide and write every operation of ``ops`` in ``connection``'s transaction; their results
    (answer or error) by position. Raises only for failures of the transaction itself."""
    results: dict[int, _Result] = {}
    stored = _stored_answers(connection, ops)
    active: list[int] = []
    replays: list[tuple[int, dict[str, Any], str]] = []  # answered as the reservation is now
    for i, op in enumerate(ops):
        hit = stored.get((op.tenant_id, op.key)) if op.key is not None else None
        if hit is None:
            active.append(i)
            continue
        response, replay_error = _replay(op, hit)
        rid = None if response is None else _replayed_reservation(op, response)
        if rid is None:
            results[i] = (response, replay_error)
        else:
            assert response is not None
            replays.append((i, response, rid))
    if not active and not replays:
        return results
    at = max(ops[i].at for i in [*active, *(i for i, _, _ in replays)])
    due = _due_ids(connection, dataset_id, at)  # before the lock: usually nothing
    released = _released(connection, [ops[i] for i in active])  # releases are never deleted

    # The ledger head: SQLite's write lock is already held (BEGIN IMMEDIATE).
    head = _HEAD if connection.dialect.name == "sqlite" else _HEAD_FOR_UPDATE
    row = connection.execute(head, {"dataset_id": dataset_id}).one_or_none()
    if row is None:
        for i in active:
            results[i] = (None, NotFound("dataset", dataset_id))
        for i, response, _ in replays:
            results[i] = (response, None)
        return results
    work = _Work(
        connection,
        _Head(**row._asdict()),
        cached_budget(dataset_id, lambda: connection.scalar(_BUDGET, {"dataset_id": dataset_id})),
    )
    reservation_ids = set(due) | {rid for _, _, rid in replays}
    batch_ids: set[str] = set()
    task_ids: set[str] = set()
    for i in active:
        params = ops[i].params
        if isinstance(params, _CommitParams | _AbortParams):
            reservation_ids.add(params.reservation_id)
        elif isinstance(params, _ExpireParams):
            reservation_ids.update(params.reservation_ids)
        elif params.selector == "batches":
            batch_ids.update(params.ids)
        else:
            task_ids.update(params.ids)
    work.load_reservations(reservation_ids)
    work.load_batches(batch_ids)
    task_batches = work.load_task_batches(task_ids)
    work.released.update(released)
    expired_now = _expire_due(work, due, at)
    for i, response, rid in replays:
        r = work.reservations.get(rid)
        if r is not None and r.dataset_id == work.head.id:
            _expire_due(work, [rid], ops[i].at)  # a hold past its time is "expired" now, and freed
        results[i] = (_refreshed(ops[i], response, work.reservations.get(rid)), None)

    answered: dict[tuple[str, str], tuple[str, str, dict[str, Any]]] = {}
    for i in active:
        op = ops[i]
        if op.tenant_id != work.head.tenant_id:
            results[i] = (None, NotFound("dataset", dataset_id))
            continue
        if op.key is not None and (op.tenant_id, op.key) in answered:  # a retry within the group
            response, replay_error = _replay(op, answered[(op.tenant_id, op.key)])
            rid = None if response is None else _replayed_reservation(op, response)
            if response is not None and rid is not None:
                response = _refreshed(op, response, work.reservations.get(rid))
            results[i] = (response, replay_error)
            continue
        params = op.params
        error: LedgerError | None = None
        # Prices come from the op's memo, filled before the transaction (``_prepare``): under
        # the lock the rules only add and compare.
        priced: AbstractContextManager[object] = (
            rules.pricing(op.memo) if op.memo is not None and op.memo.adopt(work.budget) else nullcontext()
        )
        try:
            with priced:
                if isinstance(params, _ReserveParams):
                    response = _do_reserve(work, op, params, task_batches)
                elif isinstance(params, _CommitParams):
                    response, error = _do_commit(work, op, params)
                elif isinstance(params, _AbortParams):
                    response = _do_abort(work, op, params)
                else:
                    response = {"expired": expired_now + _expire_due(work, params.reservation_ids, op.at)}
        except LedgerError as exc:
            results[i] = (None, exc)
            continue
        results[i] = (None if error else response, error)
        if op.key is not None and error is None:
            answered[(op.tenant_id, op.key)] = (op.operation, op.digest, response)
            work.idempotency.append(
                {
                    "tenant_id": op.tenant_id,
                    "key": op.key,
                    "operation": op.operation,
                    "request_hash": op.digest,
                    "response": response,
                    "status_code": 201 if op.operation == "reserve" else 200,
                    "created_at": op.at,
                }
            )
    if work.events:  # every change is audited: no event, nothing changed (a refusal changes nothing)
        work.flush()
    return results


def _is_transient(exc: OperationalError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES or "database is locked" in str(
        exc.orig
    )


def _answer_raced_retries(db: Database, ops: Sequence[_Op], results: dict[int, _Result]) -> None:
    """A retry can race its first attempt (in another process): its key lookup found nothing,
    then the first attempt's commit made it fail (e.g. "already committed"). If an answer for
    its key is stored now, that is its answer."""
    refused = [
        i
        for i, op in enumerate(ops)
        if op.key is not None
        and isinstance(results[i][1], LedgerError)
        and not isinstance(results[i][1], IdempotencyConflict)
    ]
    if not refused:
        return
    with db.session(readonly=True) as session:
        connection = session.connection()
        stored = _stored_answers(connection, [ops[i] for i in refused])
        for i in refused:
            hit = stored.get((ops[i].tenant_id, ops[i].key or ""))
            if hit is None:
                continue
            response, error = _replay(ops[i], hit)
            rid = None if response is None else _replayed_reservation(ops[i], response)
            if response is not None and rid is not None:
                loaded, _, _ = _load_reservations(connection, [rid])
                response = _refreshed(ops[i], response, loaded.get(rid))
            results[i] = (response, error)


def _run_group(db: Database, dataset_id: str, ops: Sequence[_Op]) -> None:
    """Run ``ops`` in one transaction and hand every op its result once it has committed.

    When the transaction itself fails, each op is run alone, so a failure is its own op's only.
    Ops not priced yet are priced first, before the transaction opens (``_prepare``).
    """
    ops = _prepared(db, ops)
    if not ops:
        return
    attempt = 0
    while True:
        attempt += 1
        try:
            with db.transaction() as connection:
                results = _group_transaction(connection, dataset_id, ops)
        except OperationalError as exc:
            if attempt <= _RETRIES and _is_transient(exc):
                time.sleep(0.002 * attempt)
                continue
            failure: BaseException = exc
        except DuplicateIdempotencyKey as exc:
            if attempt <= _RETRIES and len(ops) == 1:
                continue  # a retry in another process committed first: its answer is there now
            failure = exc
        except Exception as exc:  # the group failed as a whole: isolate it
            failure = exc
        else:
            _answer_raced_retries(db, ops, results)
            for i, op in enumerate(ops):
                op.finish(*results[i])
            return
        if len(ops) == 1:
            ops[0].finish(None, failure)
            return
        for op in ops:
            _run_group(db, dataset_id, [op])
        return


class _Combiner:
    """Queues the spends of one dataset in one process; one caller at a time leads a group.

    Each waiting caller sleeps on its own op's ``wake`` event and is woken exactly once: when its
    op is answered, or when the leader hands it the lead (its op still queued). A leader whose own
    op is answered hands the lead to the oldest queued op, so no caller waits on another's
    transaction longer than it must, and nobody is woken just to go back to sleep (a shared
    condition's ``notify_all`` woke every waiter after every group).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: deque[_Op] = deque()
        self.busy = False

    def run(self, db: Database, dataset_id: str, op: _Op) -> None:
        wake = op.wake = threading.Event()
        with self.lock:
            self.queue.append(op)
            lead = not self.busy
            self.busy = True
        if not lead:
            wake.wait()
            if op.done:
                return
            # handed the lead: ``busy`` stayed True for us, and our op is still queued
        while True:
            with self.lock:
                group = [self.queue.popleft() for _ in range(min(MAX_GROUP, len(self.queue)))]
            try:
                _run_group(db, dataset_id, group)
            except BaseException:
                self._settle(group, op)
                with self.lock:
                    if op in self.queue:  # not in this group: it leaves with the exception
                        self.queue.remove(op)
                    self._pass_lead()
                raise
            self._settle(group, op)
            if op.done:
                with self.lock:
                    self._pass_lead()
                return

    @staticmethod
    def _settle(group: list[_Op], leader: _Op) -> None:
        for member in group:  # never leave a caller waiting, whatever happened
            if not member.done:
                member.finish(None, RuntimeError("the spend transaction was interrupted"))
            if member is not leader:
                _wake(member)

    def _pass_lead(self) -> None:
        """Under ``lock``: the oldest waiter leads the next group, or nobody leads."""
        if self.queue:
            _wake(self.queue[0])
        else:
            self.busy = False


def _wake(op: _Op) -> None:
    assert op.wake is not None  # queued by ``_Combiner.run``
    op.wake.set()


_combiners_lock = threading.Lock()
_combiners: weakref.WeakKeyDictionary[Database, dict[str, _Combiner]] = weakref.WeakKeyDictionary()


def _combiner(db: Database, dataset_id: str) -> _Combiner:
    with _combiners_lock:
        registry = _combiners.setdefault(db, {})
        combiner = registry.get(dataset_id)
        if combiner is None:
            combiner = registry[dataset_id] = _Combiner()
        return combiner


class _AsyncCombiner:
    """Queues the spends of one dataset made by the coroutines of one event loop (the HTTP routes).

    A caller waits on a future, not in a thread of its own: one drain task runs the queue in
    groups, each group in one worker thread (``_run_group``), and resolves the group's futures
    once its transaction has committed. A request thus costs no thread hop of its own, and each
    group holds every spend that arrived while the previous one ran. Spends that sync callers of
    the same process make on the dataset (``_Combiner``) serialise with these on the ledger head,
    like those of another process.
    """

    def __init__(self) -> None:
        self.queue: deque[tuple[_Op, asyncio.Future[None]]] = deque()
        self.drain: asyncio.Task[None] | None = None

    async def run(self, db: Database, dataset_id: str, op: _Op) -> None:
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()
        self.queue.append((op, answered))
        if self.drain is None:
            self.drain = loop.create_task(self._drain(db, dataset_id))
        await answered

    async def _drain(self, db: Database, dataset_id: str) -> None:
        try:
            while self.queue:
                group = [self.queue.popleft() for _ in range(min(MAX_GROUP, len(self.queue)))]
                try:
                    await anyio.to_thread.run_sync(_run_group, db, dataset_id, [op for op, _ in group])
                finally:
                    _answer(group)
        finally:
            self.drain = None
            _answer([self.queue.popleft() for _ in range(len(self.queue))])  # left by a cancellation


def _answer(group: Iterable[tuple[_Op, asyncio.Future[None]]]) -> None:
    for op, answered in group:  # never leave a caller waiting, whatever happened
        if not op.done:
            op.finish(None, RuntimeError("the spend transaction was interrupted"))
        if not answered.done():
            answered.set_result(None)


_async_combiners: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, weakref.WeakKeyDictionary[Database, dict[str, _AsyncCombiner]]
] = weakref.WeakKeyDictionary()


def _async_combiner(db: Database, dataset_id: str) -> _AsyncCombiner:
    loop = asyncio.get_running_loop()
    with _combiners_lock:
        registry = _async_combiners.setdefault(loop, weakref.WeakKeyDictionary()).setdefault(db, {})
        combiner = registry.get(dataset_id)
        if combiner is None:
            combiner = registry[dataset_id] = _AsyncCombiner()
        return combiner


def _answered(op: _Op) -> dict[str, Any]:
    if op.error is not None:
        raise op.error
    assert op.response is not None
    return op.response


def _submit(db: Database, op: _Op) -> dict[str, Any]:
    _prepare(db, op)  # priced in the caller's thread, before it queues for the transaction
    _combiner(db, op.dataset_id).run(db, op.dataset_id, op)
    return _answered(op)


async def _submit_async(db: Database, op: _Op) -> dict[str, Any]:
    if not _prices_inline(op):  # priced in a pricing thread, never on the event loop
        await anyio.to_thread.run_sync(_prepare, db, op, limiter=op.policy.limiter)
    await _async_combiner(db, op.dataset_id).run(db, op.dataset_id, op)
    return _answered(op)


def _keyed(op: _Op, key: str | None, request: Mapping[str, Any]) -> _Op:
    op.key = idempotency.check_key(key)
    op.digest = idempotency.request_hash(op.operation, request) if op.key is not None else ""
    return op


# A reservation's dataset and tenant never change, so they are remembered (per process, by id):
# a commit or abort finds its dataset's group without a database round trip.
_OWNERS_SIZE: Final = 100_000
_owners: OrderedDict[str, tuple[str, str]] = OrderedDict()
_owners_lock = threading.Lock()
_OWNER: Final = select(Reservation.dataset_id, Reservation.tenant_id).where(
    Reservation.id == bindparam("reservation_id")
)


def _remember_owner(reservation_id: str, dataset_id: str, tenant_id: str) -> None:
    with _owners_lock:
        _owners[reservation_id] = (dataset_id, tenant_id)
        if len(_owners) > _OWNERS_SIZE:
            _owners.popitem(last=False)


def _remembered_owner(reservation_id: str) -> tuple[str, str] | None:
    """``(dataset id, tenant id)`` of the reservation when this process knows it; ``NotFound``
    for what cannot be a reservation id."""
    if not can_be_id(reservation_id):
        raise NotFound("reservation", reservation_id)
    with _owners_lock:
        return _owners.get(reservation_id)


def _load_owner(db: Database, reservation_id: str) -> tuple[str, str]:
    rows = db.read_all(_OWNER, {"reservation_id": reservation_id})
    if not rows:
        raise NotFound("reservation", reservation_id)
    row = rows[0]
    _remember_owner(reservation_id, row.dataset_id, row.tenant_id)
    return row.dataset_id, row.tenant_id


def _dataset_in_tenant(owner: tuple[str, str], tenant_id: str, reservation_id: str) -> str:
    """The reservation's dataset; ``NotFound`` for another tenant's reservation."""
    if owner[1] != tenant_id:
        raise NotFound("reservation", reservation_id)
    return owner[0]


def _dataset_of(db: Database, tenant_id: str, reservation_id: str) -> str:
    owner = _remembered_owner(reservation_id) or _load_owner(db, reservation_id)
    return _dataset_in_tenant(owner, tenant_id, reservation_id)


async def _dataset_of_async(db: Database, tenant_id: str, reservation_id: str) -> str:
    owner = _remembered_owner(reservation_id)
    if owner is None:
        owner = await anyio.to_thread.run_sync(_load_owner, db, reservation_id)
    return _dataset_in_tenant(owner, tenant_id, reservation_id)


# ---------------------------------------------------------------------------------------------
# Public operations. ``reserve``, ``commit`` and ``abort`` block their thread until the spend has
# committed; ``reserve_async``, ``commit_async`` and ``abort_async`` are the same operations for
# a coroutine (the HTTP routes): same answers, same errors, and the event loop is never blocked.
# ---------------------------------------------------------------------------------------------


def _reserve_op(
    tenant_id: str,
    dataset_id: str,
    *,
    event_json: object,
    batch_ids: Sequence[str] | None,
    task_ids: Sequence[str] | None,
    noise_commitment: str | None,
    idempotency_key: str | None,
    ttl_s: float,
    now: datetime | None,
    policy: pricing.Policy | None,
) -> _Op:
    if (batch_ids is None) == (task_ids is None):
        raise InvalidInput("batches", "give exactly one of batches or tasks.")
    selector = "batches" if batch_ids is not None else "tasks"
    ids = _ids(batch_ids if batch_ids is not None else task_ids, selector)
    event = parse_event(event_json)
    charge = _charge(event, noise_commitment)
    document = ev.to_json(event)
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)
    ttl = _ttl(ttl_s)
    params = _ReserveParams(selector, ids, charge, document, ttl)
    op = _Op(
        "reserve", tenant_id, dataset_id, now or utcnow(), params, policy=policy or pricing.DEFAULT_POLICY
    )
    # Every field of the request: a retry that differs in any (the hold's ttl_s included) is
    # another request, answered 409 ``idempotency_conflict``, never the first one's answer.
    request = {
        "dataset_id": dataset_id,
        selector: ids,
        "event": document,
        "noise_commitment": noise_commitment,
        "ttl_s": ttl.total_seconds(),
    }
    return _keyed(op, idempotency_key, request)


def _reserved(op: _Op, answer: dict[str, Any]) -> dict[str, Any]:
    _remember_owner(answer["id"], op.dataset_id, op.tenant_id)
    return answer


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
    policy: pricing.Policy | None = None,
) -> dict[str, Any]:
    """Certify a planned charge on the batches (or every batch of the tasks) and hold it (201).

    Answer: ``{id, dataset_id, status: "reserved", cost: {epsilon, delta}, committed, commits,
    noise_commitment, expires_at, created_at, closed_at, batches: [{id, epsilon, delta,
    naive_epsilon, level?, replay?}]}``; ``cost`` is the maximum over the batches (they are
    disjoint). Raises ``InvalidInput`` (also an event whose pricing is above
    ``policy.max_work``), ``NotFound`` (dataset, batch or task, also another tenant's),
    ``BudgetExceeded`` / ``ChargeRefused`` (409, naming the batch; nothing is held),
    ``IdempotencyConflict``, and whatever ``policy.meter`` raises.

    The charge is priced before the spend transaction opens (``service.ledger.pricing``). A retry
    with the same ``idempotency_key`` and the same request answers the reservation as it is now
    (its current status, hold and commits), and holds nothing more.
    """
    op = _reserve_op(
        tenant_id,
        dataset_id,
        event_json=event_json,
        batch_ids=batch_ids,
        task_ids=task_ids,
        noise_commitment=noise_commitment,
        idempotency_key=idempotency_key,
        ttl_s=ttl_s,
        now=now,
        policy=policy,
    )
    return _reserved(op, _submit(db, op))


async def reserve_async(
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
    policy: pricing.Policy | None = None,
) -> dict[str, Any]:
    """``reserve`` for a coroutine (the charge is priced in a thread of ``policy.limiter``)."""
    op = _reserve_op(
        tenant_id,
        dataset_id,
        event_json=event_json,
        batch_ids=batch_ids,
        task_ids=task_ids,
        noise_commitment=noise_commitment,
        idempotency_key=idempotency_key,
        ttl_s=ttl_s,
        now=None,
        policy=policy,
    )
    return _reserved(op, await _submit_async(db, op))


def _commit_request(
    db: Database,
    reservation_id: str,
    release: Mapping[str, Any],
    event_json: object,
    idempotency_key: str | None,
) -> tuple[_CommitParams, str | None, dict[str, Any]]:
    """A commit's parameters, its idempotency key and the request its key is bound to."""
    model, version, release_json = _release(release)
    partial = parse_event(event_json) if event_json is not None else None
    key = idempotency.check_key(idempotency_key)
    signer = server_secrets.signing_keys(db).active
    params = _CommitParams(reservation_id, model, version, release_json, partial, signer)
    request = {
        "reservation_id": reservation_id,
        "release": release_json,
        "event": None if partial is None else ev.to_json(partial),
    }
    return params, key, request


def commit(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    release: Mapping[str, Any],
    event_json: object = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
    policy: pricing.Policy | None = None,
) -> dict[str, Any]:
    """Turn the reservation's hold into spend, record the release, store a certificate (200).

    ``event_json``: the run so far, for a progressive commit (its cost is never more than the
    reservation's; the reservation stays open); ``None`` commits the whole charge and closes it.
    Answer: ``{certificate: {id, dataset_id, reservation_id, release, content_hash, created_at,
    certificate}, reservation: {...}}``. Raises ``NotFound``, ``InvalidInput``, ``Conflict``
    (``reservation_closed``; ``release_exists`` when the (model, version) was released before),
    ``ReservationExpired`` (its hold is freed and stays freed), ``ChargeRefused``
    (``commit_exceeds_reservation``), ``IdempotencyConflict``. A bad ``release`` (a control
    character in ``model`` or ``version``, say) is refused before anything is locked: the
    reservation stays open and committable.

    ``event_json`` is priced before the spend transaction (bounded and metered by ``policy`` as a
    reservation's). A retry with the same ``idempotency_key`` and request answers the first
    commit's certificate with the reservation as it is now.
    """
    params, key, request = _commit_request(db, reservation_id, release, event_json, idempotency_key)
    dataset_id = _dataset_of(db, tenant_id, reservation_id)
    op = _Op(
        "commit", tenant_id, dataset_id, now or utcnow(), params, policy=policy or pricing.DEFAULT_POLICY
    )
    return _submit(db, _keyed(op, key, request))


async def commit_async(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    release: Mapping[str, Any],
    event_json: object = None,
    idempotency_key: str | None = None,
    policy: pricing.Policy | None = None,
) -> dict[str, Any]:
    """``commit`` for a coroutine."""
    params, key, request = _commit_request(db, reservation_id, release, event_json, idempotency_key)
    dataset_id = await _dataset_of_async(db, tenant_id, reservation_id)
    op = _Op("commit", tenant_id, dataset_id, utcnow(), params, policy=policy or pricing.DEFAULT_POLICY)
    return await _submit_async(db, _keyed(op, key, request))


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
    key = idempotency.check_key(idempotency_key)
    dataset_id = _dataset_of(db, tenant_id, reservation_id)
    op = _Op("abort", tenant_id, dataset_id, now or utcnow(), _AbortParams(reservation_id))
    return _submit(db, _keyed(op, key, {"reservation_id": reservation_id}))


async def abort_async(
    db: Database, tenant_id: str, reservation_id: str, *, idempotency_key: str | None = None
) -> dict[str, Any]:
    """``abort`` for a coroutine."""
    key = idempotency.check_key(idempotency_key)
    dataset_id = await _dataset_of_async(db, tenant_id, reservation_id)
    op = _Op("abort", tenant_id, dataset_id, utcnow(), _AbortParams(reservation_id))
    return await _submit_async(db, _keyed(op, key, {"reservation_id": reservation_id}))


def expire_due(db: Database, *, now: datetime | None = None, limit: int = 10_000) -> dict[str, Any]:
    """Expire every reservation past its ``expires_at`` (the background sweep): ``{expired}``.

    One spend transaction per dataset, re-checking each reservation under the dataset's lock.
    """
    at = now or utcnow()
    with db.session(readonly=True) as session:
        rows = session.execute(
            select(Reservation.id, Reservation.dataset_id, Reservation.tenant_id)
            .where(Reservation.status == "reserved", Reservation.expires_at <= at)
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
            op = _Op("expire", tenant_id, dataset_id, at, _ExpireParams(chunk))
            expired += int(_submit(db, op)["expired"])
    return {"expired": expired}


def get_reservation(db: Database, tenant_id: str, reservation_id: str) -> dict[str, Any]:
    """The reservation's JSON (another tenant's answers ``NotFound``)."""
    if not can_be_id(reservation_id):
        raise NotFound("reservation", reservation_id)
    with db.session(readonly=True) as session:
        loaded, _, _ = _load_reservations(session.connection(), [reservation_id])
    r = loaded.get(reservation_id)
    if r is None or r.tenant_id != tenant_id:
        raise NotFound("reservation", reservation_id)
    return _reservation_json(r)


__all__ = [
    "DEFAULT_TTL_S",
    "MAX_TTL_S",
    "abort",
    "abort_async",
    "commit",
    "commit_async",
    "expire_due",
    "get_reservation",
    "parse_event",
    "reserve",
    "reserve_async",
]
