"""Persistence of the spend transactions: loaded reservations, the locked ledger head, and the
rows one transaction reads and writes.

A ``Work`` holds everything one spend transaction reads and will write; the decisions
(``spending.decisions``) change it in memory and ``Work.flush`` writes it with prebuilt
SQLAlchemy Core statements on the transaction's connection, sent together
(``service.db.session.pipelined``: one round trip on PostgreSQL) while the head is locked.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    Column,
    ColumnElement,
    Connection,
    Engine,
    Integer,
    MetaData,
    Table,
    bindparam,
    delete,
    func,
    insert,
    literal,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateTable

from accountant.canonical import canonical_bytes
from accountant.exact import ZERO, exact_add, exact_sub
from accountant.rules import BatchState, Budget, Cost
from service.db.base import utcnow
from service.db.models import (
    ID,
    AuditEntry,
    Batch,
    BatchStateRow,
    Certificate,
    Dataset,
    IdempotencyKey,
    Release,
    Reservation,
    ReservationBatch,
    ReservationTask,
    Task,
)
from service.db.session import LEDGER_HEAD_COLUMNS, Database, pipelined
from service.ledger import audit
from service.ledger.datasets import cached_budget, can_be_id
from service.ledger.errors import InvalidInput, NotFound
from service.ledger.spending.requests import AbortParams, CommitParams, ExpireParams, ExtendParams, Request
from service.verification.signing import SigningKey

EXPIRE_PER_TRANSACTION: Final = 500


# ---------------------------------------------------------------------------------------------
# Loaded state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldClass:
    """The batches of a reservation that were in one state when it was reserved (a *reservation
    class*): that state, the reserved cost, the cumulative committed one, and how many batches."""

    index: int
    state_at_reserve: dict[str, Any]
    reserved: Cost
    committed: Cost | None
    batches: int
    # The whole compact tasks it read, as ``(task id, last position, batches)``: all of the
    # class's batches when non-empty (a reservation of whole tasks; ``reservation_tasks``).
    tasks: tuple[tuple[str, int, int], ...] = ()


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
    batches: int = 0
    batch_set: str = ""
    classes: tuple[HeldClass, ...] = ()


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
    Reservation.classes,
    Reservation.batches,
    Reservation.batch_set,
    Reservation.expires_at,
    Reservation.created_at,
    Reservation.closed_at,
)


# Statements of the spend transaction, built once: each execution reuses the compiled form.
# A reservation holds its classes in its row (``Reservation.classes``): nothing per batch.
_LOAD_RESERVATIONS: Final = select(*_RESERVATION_COLUMNS).where(
    Reservation.id.in_(bindparam("ids", expanding=True))
)
_RESERVATION_NAMES: Final = tuple(c.key for c in _RESERVATION_COLUMNS if c.key != "classes")


def held_class(document: Mapping[str, Any]) -> HeldClass:
    """A reservation class from its entry in ``Reservation.classes``."""
    committed = document["committed"]
    return HeldClass(
        index=document["index"],
        state_at_reserve=document["state_at_reserve"],
        reserved=Cost.from_json(document["cost"]),
        committed=None if committed is None else Cost.from_json(committed),
        batches=document["batches"],
        tasks=tuple((t, last, n) for t, last, n in document.get("tasks", ())),
    )


def class_documents(classes: Iterable[HeldClass]) -> list[dict[str, Any]]:
    """``Reservation.classes`` of ``classes``, in index order."""
    return [
        {
            "index": c.index,
            "state_at_reserve": c.state_at_reserve,
            "cost": c.reserved.to_json(),
            "committed": None if c.committed is None else c.committed.to_json(),
            "batches": c.batches,
            **({"tasks": [list(t) for t in c.tasks]} if c.tasks else {}),
        }
        for c in sorted(classes, key=lambda c: c.index)
    ]


def load_reservations(connection: Connection, reservation_ids: Iterable[str]) -> dict[str, Loaded]:
    """Reservations with their classes, in one query (one row each, nothing per batch)."""
    ids = sorted(set(reservation_ids))
    if not ids:
        return {}
    return {
        row.id: Loaded(
            **{n: getattr(row, n) for n in _RESERVATION_NAMES},
            classes=tuple(held_class(c) for c in row.classes),
        )
        for row in connection.execute(_LOAD_RESERVATIONS, {"ids": ids})
    }


# ---------------------------------------------------------------------------------------------
# Batch states: stored once per distinct state, named by their content
# ---------------------------------------------------------------------------------------------


def state_id(dataset_id: str, state: BatchState) -> str:
    """The id of ``state`` in the dataset: ``"bs_"`` + SHA-256 of the dataset id, a NUL byte and
    the state's canonical JSON, cut to 37 hex digits (148 bits). Equal states share one row."""
    return _state_id_of(dataset_id, state.to_json())


def _state_id_of(dataset_id: str, document: Mapping[str, Any]) -> str:
    """``state_id`` of the state whose JSON is ``document`` (made once by a caller that stores it
    too: ``Work.intern``)."""
    digest = hashlib.sha256(dataset_id.encode() + b"\0" + canonical_bytes(document)).hexdigest()
    return "bs_" + digest[:37]


class StateCache:
    """What this process knows of batch states, so that a spend reads and writes no
    ``batch_states`` row it does not need.

    * ``parsed``: state id -> state. A state id names its content (``state_id``: a hash of the
      dataset id and the canonical JSON), so the entry is true in every database and forever:
      a state read or interned once is never read or parsed again (bounded, least recently used).
    * ``stored``: per database (engine), the state ids whose row is *committed*: added when a
      transaction that wrote them has committed (``Work.committed``) or when a row is read. Rows
      of ``batch_states`` are never deleted, so an entry stays true; a state not known here is
      written with ``INSERT … ON CONFLICT DO NOTHING`` (one statement, no read first).
    """

    SIZE: Final = 65_536

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parsed: OrderedDict[str, BatchState] = OrderedDict()
        self.stored: weakref.WeakKeyDictionary[Engine, OrderedDict[str, None]] = weakref.WeakKeyDictionary()

    def get(self, sid: str) -> BatchState | None:
        with self.lock:
            state = self.parsed.get(sid)
            if state is not None:
                self.parsed.move_to_end(sid)
            return state

    def put(self, sid: str, state: BatchState) -> None:
        with self.lock:
            self.parsed[sid] = state
            if len(self.parsed) > self.SIZE:
                self.parsed.popitem(last=False)

    def is_stored(self, engine: Engine, sid: str) -> bool:
        with self.lock:
            known = self.stored.get(engine)
            return known is not None and sid in known

    def mark_stored(self, engine: Engine, sids: Iterable[str]) -> None:
        with self.lock:
            known = self.stored.setdefault(engine, OrderedDict())
            for sid in sids:
                known[sid] = None
            while len(known) > self.SIZE:
                known.popitem(last=False)


STATES: Final = StateCache()


Mark = tuple[int, int, str]
"""Where a dataset's ledger stands: its head's ``(ledger_version, audit_seq, audit_hash)``. Every
transaction that changes the dataset's batches, tasks or reservations moves it: a spend writes
``ledger_version + 1`` and its audit entries, batch and task creation and deletion append to the
dataset's audit chain. The audit hash chains every entry, so a mark names one history."""


@dataclass
class Known:
    """What this process knows of one dataset's spend rows, true while its head is at ``mark``:
    batch pointers and tasks (``batches``: id -> (state id, task id)), the tasks' maxima, its
    reservations (as ``Loaded``) and the membership of its small ones (``members``: reservation
    id -> (class index, batch id) pairs). Filled after a transaction commits (``Work.committed``)
    from what it read and wrote; a spend reads from it instead of the database."""

    mark: Mark
    batches: dict[str, tuple[str, str]] = field(default_factory=dict)
    tasks: dict[str, tuple[Decimal, ...]] = field(default_factory=dict)
    reservations: dict[str, Loaded] = field(default_factory=dict)
    members: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    task_sets: dict[tuple[str, ...], TaskSet] = field(default_factory=dict)
    counted: int = 0  # the rows ``KnownDatasets`` counts for it

    @property
    def rows(self) -> int:
        return (
            len(self.batches)
            + len(self.tasks)
            + len(self.reservations)
            + len(self.members)
            + len(self.task_sets)
        )


@dataclass(frozen=True)
class TaskSet:
    """The batches of whole tasks read together in one state, as a pass over them found them:
    their ``batch_set`` (every batch in class 0), how many, each task's ``(batches, last
    position)``, and the smallest batch id. True while the dataset's head is at the mark it is
    known at: only creating or deleting batches changes a task's batches, and both move it."""

    batch_set: str
    batches: int
    tasks: Mapping[str, tuple[int, int]]
    example: str


@dataclass(frozen=True)
class Learned:
    """What one committed spend transaction leaves known (``Known``), at its final mark."""

    batches: Mapping[str, tuple[str, str]]
    tasks: Mapping[str, tuple[Decimal, ...]]
    reservations: Iterable[Loaded]
    members: Mapping[str, tuple[tuple[int, str], ...]]
    task_sets: Mapping[tuple[str, ...], TaskSet] = field(default_factory=dict)
    forget_tasks: frozenset[str] = frozenset()  # tasks made compact: their batches' pointers go


class _Entries(OrderedDict[str, Known]):
    """One engine's entries, least recently used first, and how many rows they hold."""

    total = 0


class KnownDatasets:
    """Per database (engine) and dataset, the ``Known`` rows of its ledger.

    A spend transaction locks the head and reads its mark (``Work.open``): an entry at another
    mark is dropped (another process, or a write outside the spends, moved the ledger), so what
    it reads from an entry is what the database holds. Only the transaction holding the head at
    the entry's mark may extend it, once it has committed (``learn``): one that committed late,
    after another one opened the dataset at a newer mark, finds the entry replaced and adds
    nothing. A transaction that moved batches by a set statement (batch ids not known) drops
    the entry. Bounded: ``rows`` rows per engine (the datasets used least recently are
    forgotten first; an entry alone above it is emptied)."""

    def __init__(self, rows: int = 262_144) -> None:
        self.rows = rows
        self.lock = threading.Lock()
        self.by_engine: weakref.WeakKeyDictionary[Engine, _Entries] = weakref.WeakKeyDictionary()

    def at(self, engine: Engine, dataset_id: str, mark: Mark) -> Known:
        """The entry of the dataset at ``mark`` (its head, read locked): a new, empty one unless
        the known one is at that mark."""
        with self.lock:
            entries = self.by_engine.setdefault(engine, _Entries())
            known = entries.get(dataset_id)
            if known is None or known.mark != mark:
                if known is not None:
                    entries.total -= known.counted
                known = entries[dataset_id] = Known(mark)
            entries.move_to_end(dataset_id)
            return known

    def learn(
        self, engine: Engine, dataset_id: str, known: Known, opened: Mark, mark: Mark, learned: Learned | None
    ) -> None:
        """After a transaction that opened ``known`` at ``opened`` committed at ``mark``: extend
        the entry with ``learned`` (``None``: what it wrote is not known, drop the entry)."""
        with self.lock:
            entries = self.by_engine.get(engine)
            if entries is None or entries.get(dataset_id) is not known or known.mark != opened:
                return  # another transaction opened the dataset since: its entry stands
            if learned is None:
                del entries[dataset_id]
                entries.total -= known.counted
                return
            known.batches.update(learned.batches)
            if learned.forget_tasks:  # a batch of a compact task has the task's pointer, not its own
                forget = learned.forget_tasks
                for batch_id in [b for b, (_, t) in known.batches.items() if t in forget]:
                    del known.batches[batch_id]
            known.tasks.update(learned.tasks)
            known.reservations.update((r.id, r) for r in learned.reservations)
            known.members.update(learned.members)
            known.task_sets.update(learned.task_sets)
            entries.total += known.rows - known.counted
            known.counted = known.rows
            known.mark = mark
            while entries.total > self.rows:  # forget the least recently used first
                oldest_id, oldest = next(iter(entries.items()))
                if oldest is known:  # alone above the bound: emptied
                    for rows in (
                        known.batches,
                        known.tasks,
                        known.reservations,
                        known.members,
                        known.task_sets,
                    ):
                        rows.clear()
                    entries.total -= known.counted
                    known.counted = 0
                    break
                del entries[oldest_id]
                entries.total -= oldest.counted


KNOWN: Final = KnownDatasets()


def parse_states(rows: Iterable[Any]) -> dict[str, BatchState]:
    """``{id: state}`` of ``(id, state JSON)`` rows, each parsed once per process (``STATES``)."""
    out: dict[str, BatchState] = {}
    for sid, document in rows:
        state = STATES.get(sid)
        if state is None:
            state = BatchState.from_json(document)
            STATES.put(sid, state)
        out[sid] = state
    return out


@dataclass
class Selection:
    """The batches one reservation reads, grouped by their current state: ``counts[state id]``,
    the tasks with batches in each state, the reservation's batch count and ``batch_set``, and the
    predicate that selects them (``scope``) for the set-based writes."""

    scope: Scope
    counts: dict[str, int]
    tasks: dict[str, set[str]]
    classes: dict[str, int]  # state id -> reservation class index (first appearance, by batch id)
    batch_set: str
    positions: list[tuple[str, int]] | None  # explicitly named batches: (id, place in request)
    example: dict[str, str]  # state id -> a batch in it (the first named), for error messages
    named: dict[str, str] | None = None  # explicitly named batches: batch id -> state id
    members: dict[str, list[str]] | None = None  # state id -> its batches (a small charge only)
    # Whole tasks, each in one state: state id -> [(task id, last position, batches)], when the
    # reservation reads them as compact tasks (``Task.state_id``); else ``None``.
    whole: dict[str, list[tuple[str, int, int]]] | None = None

    @property
    def batches(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class StateGroup:
    """Batches of a dataset in one state: how many, their tasks, and the smallest batch id (a
    sample to name). What the spend transactions decide once per state, and what a quote prices
    once (``service.ledger.quotes``)."""

    state_id: str
    batches: int
    tasks: frozenset[str]
    example: str


def state_groups_query(
    dataset_id: str, where: ColumnElement[bool] | None = None
) -> tuple[Any, dict[str, Any]]:
    """``(statement, parameters)`` of the aggregate read of the dataset's batches (those ``where``
    selects) by (state, task): one row per pair, never one per batch. ``state_groups`` folds it."""
    return (_STATE_GROUPS if where is None else _STATE_GROUPS.where(where)), {"dataset_id": dataset_id}


def state_groups(rows: Iterable[Any]) -> list[StateGroup]:
    """The rows of ``state_groups_query`` as one ``StateGroup`` per state, by state id."""
    found: dict[str, tuple[int, set[str], str]] = {}
    for state_id_, task_id, count, example in rows:
        total, tasks, first = found.get(state_id_, (0, set(), example))
        tasks.add(task_id)
        found[state_id_] = (total + count, tasks, min(first, example))
    return [
        StateGroup(sid, count, frozenset(tasks), example)
        for sid, (count, tasks, example) in sorted(found.items())
    ]


@dataclass(frozen=True)
class Move:
    """Batches in state ``source`` go to ``target``; ``tasks`` are their tasks, ``batch_ids``
    the batches when a small charge knows them (``SMALL_CHARGE``: the move is then kept in the
    transaction's overlay and written once by ``flush``), else ``None`` (one set-based UPDATE).
    ``compact``: they are all the batches of those tasks, compact (``Task.state_id``), and move by
    rewriting the tasks' pointers; ``scope``: the batches are those it selects, not those of the
    scope ``Work.move`` is given (a task a reservation read whole that is no longer compact)."""

    source: str
    target: BatchState
    count: int
    tasks: frozenset[str]
    batch_ids: tuple[str, ...] | None = None
    compact: bool = False
    scope: Scope | None = None


class Group(NamedTuple):
    """Batches of a reservation class in one current state: how many, their tasks, and (for a
    small reservation) which; ``compact`` and ``scope`` as in ``Move``."""

    state_id: str
    batches: int
    tasks: frozenset[str]
    batch_ids: tuple[str, ...] | None
    compact: bool = False
    scope: Scope | None = None

    def move(self, target: BatchState) -> Move:
        return Move(self.state_id, target, self.batches, self.tasks, self.batch_ids, self.compact, self.scope)


# A charge over at most this many batches is decided on its batches' ids: its moves go to the
# transaction's overlay (``Work.overlay``) and are written once, at ``flush``, pipelined with the
# other writes — a group of spends on the same few batches rewrites each pointer once, not once
# per spend, and pays no round trip per spend for it. A larger charge moves by set statements.
SMALL_CHARGE: Final = 256


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
    archived_at: datetime | None = None  # an archived dataset refuses new reservations


# The ledger head (``service.db.session.lock_ledger_head``) and, in the same statement, when the
# dataset's next open reservation expires (the partial index ``ix_reservations_open_dataset_id_
# expires_at``): the due reservations are read only when one is due, not by every spend.
_NEXT_EXPIRY: Final = (
    select(func.min(Reservation.expires_at))
    .where(Reservation.dataset_id == Dataset.id, Reservation.status == "reserved")
    .scalar_subquery()
    .label("next_expiry")
)
_HEAD_AND_EXPIRY: Final = select(*LEDGER_HEAD_COLUMNS, _NEXT_EXPIRY).where(
    Dataset.id == bindparam("dataset_id")
)
_SPEND_HEAD: Final = {
    "sqlite": _HEAD_AND_EXPIRY,  # BEGIN IMMEDIATE holds the write lock already
    "postgresql": _HEAD_AND_EXPIRY.with_for_update(of=Dataset),
}


def _aware(value: Any) -> datetime | None:
    """A timestamp read by an aggregate (no column type applies): aware UTC, or ``None``."""
    if value is None:
        return None
    at: datetime = datetime.fromisoformat(value) if isinstance(value, str) else value
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


_LOAD_STATES: Final = select(BatchStateRow.id, BatchStateRow.state).where(
    BatchStateRow.id.in_(bindparam("ids", expanding=True))
)
_TASKS_OF_DATASET: Final = select(Task.id, Task.state_id).where(
    Task.id.in_(bindparam("ids", expanding=True)), Task.dataset_id == bindparam("dataset_id")
)
_TASK_AGGREGATES: Final = select(
    Task.id, Task.epsilon_spent, Task.delta_spent, Task.naive_epsilon, Task.state_id
).where(Task.id.in_(bindparam("ids", expanding=True)))
# Compact tasks (``Task.state_id``): a task's batches take its pointer (materialise: the task is
# no longer compact), or give theirs up to it (compact), or the task's pointer moves.
MATERIALISE: Final = (
    update(Batch)
    .where(Batch.task_id == bindparam("task"), Batch.state_id.is_(None))
    .values(state_id=bindparam("state"))
)
_COMPACT: Final = update(Batch).where(Batch.task_id == bindparam("task")).values(state_id=None)
SET_TASK_STATE: Final = update(Task).where(Task.id == bindparam("task")).values(state_id=bindparam("state"))
_MOVE_TASK: Final = (
    update(Task)
    .where(Task.id == bindparam("task"), Task.state_id == bindparam("source"))
    .values(state_id=bindparam("target"))
)
_TASK_PART_GROUPS: Final = (
    select(Batch.state_id, func.count(), func.min(Batch.id))
    .where(Batch.task_id == bindparam("scope_task"), Batch.position <= bindparam("scope_last"))
    .group_by(Batch.state_id)
)
_INSERT_RESERVATION_TASKS: Final = insert(ReservationTask).inline()
_COMPACT_TASKS: Final = select(Task.id).where(
    Task.dataset_id == bindparam("dataset_id"), Task.state_id.is_not(None)
)
# With each task's aggregates (read under the lock, so a charge that raises them needs no
# second read): one row per (class, state, task).
_RESERVATION_GROUPS: Final = (
    select(
        ReservationBatch.class_index,
        Batch.state_id,
        Batch.task_id,
        func.count(),
        Task.epsilon_spent,
        Task.delta_spent,
        Task.naive_epsilon,
    )
    .join(Batch, Batch.id == ReservationBatch.batch_id)
    .join(Task, Task.id == Batch.task_id)
    .where(ReservationBatch.reservation_id == bindparam("reservation_id"))
    .group_by(
        ReservationBatch.class_index,
        Batch.state_id,
        Batch.task_id,
        Task.epsilon_spent,
        Task.delta_spent,
        Task.naive_epsilon,
    )
)
# The same per batch, for a small reservation (``SMALL_CHARGE``).
_RESERVATION_MEMBERS: Final = (
    select(
        ReservationBatch.class_index,
        Batch.id,
        Batch.state_id,
        Batch.task_id,
        Task.epsilon_spent,
        Task.delta_spent,
        Task.naive_epsilon,
    )
    .join(Batch, Batch.id == ReservationBatch.batch_id)
    .join(Task, Task.id == Batch.task_id)
    .where(ReservationBatch.reservation_id == bindparam("reservation_id"))
)
_REPOINT: Final = update(Batch).where(Batch.id == bindparam("batch")).values(state_id=bindparam("state"))
# By each batch's state: its own pointer or its compact task's.
_STATE_GROUPS: Final = (
    select(func.coalesce(Batch.state_id, Task.state_id), Batch.task_id, func.count(), func.min(Batch.id))
    .join(Task, Task.id == Batch.task_id)
    .where(Batch.dataset_id == bindparam("dataset_id"))
    .group_by(func.coalesce(Batch.state_id, Task.state_id), Batch.task_id)
)
# Executed on the transaction's Connection with one parameter set per row (executemany): plain
# Core statements, not the ORM's bulk-persistence layer. ``inline``: nothing is read back (no
# implicit RETURNING of generated keys), so the writes can be sent pipelined (``flush``).
# A state row is written unless it exists: no read first, and a concurrent writer of the same
# state (same content, same id) is no conflict.
_INSERT_NEW_STATE: Final = {
    "postgresql": postgresql.insert(BatchStateRow).on_conflict_do_nothing(index_elements=["id"]),
    "sqlite": sqlite.insert(BatchStateRow).on_conflict_do_nothing(index_elements=["id"]),
}
_INSERT_RESERVATIONS: Final = insert(Reservation).inline()
_INSERT_RESERVATION_BATCHES: Final = insert(ReservationBatch).inline()
_INSERT_RELEASES: Final = insert(Release).inline()
_INSERT_CERTIFICATES: Final = insert(Certificate).inline()
_INSERT_IDEMPOTENCY_KEYS: Final = insert(IdempotencyKey).inline()
_INSERT_AUDIT_ENTRIES: Final = insert(AuditEntry).inline()
# The SET clause of an executemany UPDATE is every parameter named after a column.
_UPDATE_RESERVATIONS: Final = update(Reservation).where(Reservation.id == bindparam("reservation_id"))
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


# A per-connection scratch table: the states one statement maps batches from, with the state
# each moves to (``Work.move``) or the reservation class it joins (``Work.add_reservation``), so
# a statement over many states joins one table by key instead of testing a list per batch.
STATE_MAP: Final = Table(
    "ledger_state_map",
    MetaData(),
    Column("state_id", ID, primary_key=True),
    Column("target", ID),
    Column("class_index", Integer),
    prefixes=["TEMPORARY"],
)


# Which batches a statement of the spend transaction touches, as predicates with bound
# parameters: the statements are built once and compiled once (a statement built per spend cost
# more CPU than its execution). None tests ``batches.dataset_id``: each names batches already
# checked to be the dataset's, and that test would let the planner (SQLite's) walk every batch
# of the dataset by its index instead of the few named.
_SCOPES: Final[dict[str, ColumnElement[bool]]] = {
    "batches": Batch.id.in_(bindparam("scope_ids", expanding=True)),
    "tasks": Batch.task_id.in_(bindparam("scope_ids", expanding=True)),
    "members": Batch.id.in_(
        select(ReservationBatch.batch_id).where(
            ReservationBatch.reservation_id == bindparam("scope_reservation"),
            ReservationBatch.class_index == bindparam("scope_class"),
        )
    ),
    "dataset": Batch.dataset_id == bindparam("scope_dataset"),
    # The batches a reservation read of a whole task (``reservation_tasks``).
    "task_part": (Batch.task_id == bindparam("scope_task")) & (Batch.position <= bindparam("scope_last")),
}


@dataclass(frozen=True)
class Scope:
    """Batches of the locked dataset a statement touches: ``kind`` names the predicate (named
    batches, the batches of tasks, of a reservation class, or all of the dataset) and ``params``
    its bound values."""

    kind: str
    params: Mapping[str, Any]

    @property
    def where(self) -> ColumnElement[bool]:
        return _SCOPES[self.kind]


def members_of(reservation_id: str, class_index: int) -> Scope:
    """The batches of one reservation class."""
    return Scope("members", {"scope_reservation": reservation_id, "scope_class": class_index})


def whole_dataset(dataset_id: str) -> Scope:
    return Scope("dataset", {"scope_dataset": dataset_id})


def task_part(task_id: str, last_position: int) -> Scope:
    """The batches of a task up to ``last_position`` (those a reservation read of it whole)."""
    return Scope("task_part", {"scope_task": task_id, "scope_last": last_position})


# A batch's state: its own pointer, or its compact task's.
EFFECTIVE_STATE: Final = func.coalesce(
    Batch.state_id,
    select(Task.state_id).where(Task.id == Batch.task_id).correlate_except(Task).scalar_subquery(),
)


def reservation_members() -> Any:
    """``(reservation_id, batch_id, class_index)`` of every reservation's batches: its
    ``reservation_batches`` rows and the batches of the whole tasks it read
    (``reservation_tasks``, up to the last position it read)."""
    rows = select(ReservationBatch.reservation_id, ReservationBatch.batch_id, ReservationBatch.class_index)
    tasks = select(
        ReservationTask.reservation_id, Batch.id.label("batch_id"), ReservationTask.class_index
    ).join(
        Batch, (Batch.task_id == ReservationTask.task_id) & (Batch.position <= ReservationTask.last_position)
    )
    return union_all(rows, tasks).subquery("reservation_members")


# The ``reservation_tasks`` rows that cover a task's batches from a position on.
_COVERING: Final = (ReservationTask.task_id == bindparam("task")) & (
    ReservationTask.last_position >= bindparam("first")
)
_UNFOLD: Final = insert(ReservationBatch).from_select(
    ["reservation_id", "batch_id", "position", "class_index"],
    select(ReservationTask.reservation_id, Batch.id, Batch.position, ReservationTask.class_index)
    .join(
        Batch, (Batch.task_id == ReservationTask.task_id) & (Batch.position <= ReservationTask.last_position)
    )
    .where(_COVERING),
)
_DROP_COVERING: Final = delete(ReservationTask).where(_COVERING)


def unfold_whole_tasks(connection: Connection, task_id: str, first_position: int) -> None:
    """Before batches of a task are deleted from ``first_position`` on: every reservation that
    read the task whole up to a position at or after it (a ``reservation_tasks`` row, which the
    batch list expands into the task's *current* batches) gets one ``reservation_batches`` row
    per batch it read, and the task row goes, so its list names the same batches forever — also
    the deleted ones, and not a later batch that takes a deleted last position again.

    Only deletion changes what a row expands to (new batches come after every position a row
    names while none is deleted), and only batches in the empty state are deleted: a
    reservation that read them is closed (fully refunded), so no move reads its task rows
    again. Rare and set-based, so creation and the spend path pay nothing for it; a scan of
    ``reservation_tasks`` (no index by task: each whole-task reserve would pay for one)."""
    params = {"task": task_id, "first": first_position}
    connection.execute(_UNFOLD, params)
    connection.execute(_DROP_COVERING, params)


_MOVE_FROM_ONE: Final = {
    kind: update(Batch)
    .where(Batch.state_id == bindparam("source"), where)
    .values(state_id=bindparam("target"))
    for kind, where in _SCOPES.items()
}
_MOVE_THROUGH_MAP: Final = {
    kind: update(Batch)
    .where(Batch.state_id == STATE_MAP.c.state_id, where)
    .values(state_id=STATE_MAP.c.target)
    for kind, where in _SCOPES.items()
}
# How many batches each task has and its last position (``Work._compact_pass``).
_TASK_COUNTS: Final = (
    select(Batch.task_id, func.count(), func.max(Batch.position))
    .where(Batch.task_id.in_(bindparam("ids", expanding=True)))
    .group_by(Batch.task_id)
)
_IDS_OF_TASKS: Final = {
    "sqlite": "SELECT id FROM batches WHERE task_id IN ({}) ORDER BY id",
    "postgresql": 'SELECT id FROM batches WHERE task_id = ANY(%s) ORDER BY id COLLATE "C"',
}
_IDS_PER_FETCH: Final = 50_000


def _batch_ids_in_order(connection: Connection, task_ids: Sequence[str]) -> Iterator[list[str]]:
    """The ids of the tasks' batches in code-point order, in lists of up to ``_IDS_PER_FETCH``,
    through the driver's cursor in the connection's transaction: 10⁶ ORM rows took seconds of
    CPU. PostgreSQL's is a server-side cursor, so the ids are never all held here."""
    driver = connection.connection.driver_connection
    assert driver is not None
    if connection.dialect.name == "postgresql":
        cursor = driver.cursor(name="ledger_batch_ids")
        query, params = _IDS_OF_TASKS["postgresql"], (list(task_ids),)
    else:
        cursor = driver.cursor()
        query, params = _IDS_OF_TASKS["sqlite"].format(",".join("?" * len(task_ids))), tuple(task_ids)
    try:
        cursor.execute(query, params)
        while rows := cursor.fetchmany(_IDS_PER_FETCH):
            yield [row[0] for row in rows]
    finally:
        cursor.close()


_SELECT_BATCHES: Final = {
    (kind, dialect): select(Batch.id, Batch.state_id, Batch.task_id, Batch.position)
    .where(*([Batch.dataset_id == bindparam("dataset_id")] if kind == "batches" else []), _SCOPES[kind])
    .order_by(Batch.id.collate("C") if dialect == "postgresql" else Batch.id)
    .execution_options(yield_per=50_000)
    for kind in ("batches", "tasks")
    for dialect in ("postgresql", "sqlite")
}


@dataclass
class Work:
    """Everything one spend transaction reads and writes.

    Operations *decide* first (reading only; they may raise a ``LedgerError``) and then *apply*.
    What a later operation of the same group must read — reservations, their classes and
    batches, the batches' states — is written as it is applied, with one set-based statement per
    move (``move``; through a state map when several states move), never one per batch; the
    aggregates (head, tasks), reservation updates, releases, certificates, idempotency keys and
    audit entries are written once by ``flush``. A refused operation writes nothing.
    """

    connection: Connection
    head: Head
    budget: Budget
    states: dict[str, BatchState] = field(default_factory=dict)  # by state id, as loaded
    written_states: set[str] = field(default_factory=set)  # state rows this transaction writes
    new_states: list[dict[str, Any]] = field(default_factory=list)  # written by ``flush``
    overlay: dict[str, str] = field(default_factory=dict)  # batch id -> state id, not yet written
    _interned: dict[int, str] = field(default_factory=dict)  # id(state) -> state id
    _interned_objects: dict[int, BatchState] = field(default_factory=dict)  # keeps ids unique
    tasks: dict[str, tuple[Decimal, ...]] = field(default_factory=dict)
    reservations: dict[str, Loaded] = field(default_factory=dict)
    dirty_reservations: set[str] = field(default_factory=set)
    dirty_tasks: set[str] = field(default_factory=set)
    releases: list[dict[str, Any]] = field(default_factory=list)
    released: set[tuple[str, str, str]] = field(default_factory=set)
    certificates: list[dict[str, Any]] = field(default_factory=list)
    idempotency: list[dict[str, Any]] = field(default_factory=list)
    new_reservations: list[Loaded] = field(default_factory=list)  # written by ``flush``
    new_reservation_batches: list[dict[str, Any]] = field(default_factory=list)  # named ones
    new_reservation_tasks: list[dict[str, Any]] = field(default_factory=list)  # whole tasks
    # Tasks read in this transaction: their pointer (``Task.state_id``: compact) or ``None``.
    task_states: dict[str, str | None] = field(default_factory=dict)
    events: list[tuple[audit.AuditEvent, datetime]] = field(default_factory=list)
    expired_on_open: int = 0  # due reservations expired as the transaction opened
    next_expiry: datetime | None = None  # of the dataset's open reservations, read with the head
    budget_grown: bool = False  # a plan segment was declared: the budget is written with the head
    # The server's active signing key, asked for only when an abort or an expiry issues a
    # certificate (a commit carries its own: ``CommitParams.signer``).
    signer: Callable[[], SigningKey] | None = None
    # What the process knows of the dataset at the head's mark (``KNOWN``), and what this
    # transaction adds: batch pointers as they are now (read, or moved by a small charge), the
    # membership of its small reservations. ``unsure``: batches moved by a set statement, so no
    # pointer is taken from what is known any more (and the entry is dropped at the end).
    known: Known | None = None
    opened: Mark = (0, 0, "")
    final: Mark | None = None  # the head's mark as this transaction writes it (``flush``)
    seen_batches: dict[str, tuple[str, str]] = field(default_factory=dict)
    seen_members: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    seen_task_sets: dict[tuple[str, ...], TaskSet] = field(default_factory=dict)
    compacted: set[str] = field(default_factory=set)  # tasks made compact by this transaction
    unsure: bool = False

    @classmethod
    def open(cls, connection: Connection, dataset_id: str) -> Work | None:
        """The work of a spend transaction on the dataset, its ledger head locked (``None``: no
        such dataset), with when its next open reservation expires (same statement)."""
        statement = _SPEND_HEAD[connection.dialect.name]
        row = connection.execute(statement, {"dataset_id": dataset_id}).one_or_none()
        if row is None:
            return None
        values = row._asdict()
        next_expiry = values.pop("next_expiry")
        head = Head(**values)
        # The head's segment count says which budget is current: a budget another process grew
        # by a plan segment since this one cached it is read again.
        budget = cached_budget(
            dataset_id,
            lambda: connection.scalar(_BUDGET, {"dataset_id": dataset_id}),
            segments=head.plan_segments,
        )
        work = cls(connection, head, budget)
        work.next_expiry = _aware(next_expiry)
        work.opened = (head.ledger_version, head.audit_seq, head.audit_hash)
        work.known = KNOWN.at(connection.engine, dataset_id, work.opened)
        return work

    # -- loading -------------------------------------------------------------------------------

    def load_for(self, requests: Iterable[Request], reservation_ids: Iterable[str]) -> None:
        """Load the reservations ``requests`` decide on, and ``reservation_ids``."""
        wanted = set(reservation_ids)
        for op in requests:
            params = op.params
            if isinstance(params, CommitParams | AbortParams | ExtendParams):
                wanted.add(params.reservation_id)
            elif isinstance(params, ExpireParams):
                wanted.update(params.reservation_ids)
        self.load_reservations(wanted)

    def load_reservations(self, ids: Iterable[str]) -> None:
        """Reservations not loaded yet: those the process knows (``known``), the others read."""
        missing = []
        for rid in ids:
            if rid in self.reservations:
                continue
            r = None if self.known is None else self.known.reservations.get(rid)
            if r is None:
                missing.append(rid)
            else:
                self.reservations[rid] = r
        self.reservations.update(load_reservations(self.connection, missing))

    def _batch(self, batch_id: str) -> tuple[str, str] | None:
        """``(state id, task id)`` of a batch of the dataset as it is now in this transaction,
        without reading: ``None`` when not known."""
        if self.unsure:
            return None
        seen = self.seen_batches.get(batch_id)
        if seen is None and self.known is not None:
            seen = self.known.batches.get(batch_id)
        return seen

    def _task_spent(self, task_id: str) -> tuple[Decimal, ...] | None:
        spent = self.tasks.get(task_id)
        if spent is None and self.known is not None:
            spent = self.known.tasks.get(task_id)
        return spent

    def _known_rows(self, ids: Sequence[str]) -> list[tuple[str, str, str]] | None:
        """``(id, state id, task id)`` of the named batches by id, when all are known."""
        rows = []
        for batch_id in sorted(set(ids)):
            entry = self._batch(batch_id)
            if entry is None:
                return None
            rows.append((batch_id, *entry))
        return rows

    def state(self, state_id: str) -> BatchState:
        """The state stored under ``state_id`` (read once per process: ``STATES``)."""
        if state_id not in self.states:
            self.load_states([state_id])
        return self.states[state_id]

    def load_states(self, ids: Iterable[str]) -> None:
        """The states of ``ids`` (pointers read from batch rows, so their rows exist): from the
        process's cache, the others read in one query."""
        wanted = []
        for sid in sorted({i for i in ids if i not in self.states}):
            state = STATES.get(sid)
            if state is None:
                wanted.append(sid)
            else:
                self.states[sid] = state
        if wanted:
            rows = self.connection.execute(_LOAD_STATES, {"ids": wanted})
            read = parse_states((row.id, row.state) for row in rows)
            self.states.update(read)
            STATES.mark_stored(self.connection.engine, read)  # not ours (ours are in ``states``)

    def select(self, selector: str, ids: Sequence[str], most: int) -> Selection:
        """The batches a reservation reads (``selector`` ``"batches"`` or ``"tasks"``), grouped
        by state. ``NotFound`` names the first batch or task not in this dataset; ``InvalidInput``
        when the tasks have no batches or more than ``most``.

        One pass over ``(id, state id, task id, position)`` in ascending id order, kept as
        counters and a running SHA-256 (``batch_set``), not as a list: memory grows with the
        distinct states and tasks, not with the batches. A batch of a compact task takes the
        task's state. Whole tasks each in one state, all compact or more than ``SMALL_CHARGE``
        batches, are read as compact tasks (``Selection.whole``: those not compact yet become
        so); otherwise the compact tasks it touches are materialised (their batches take the
        task's pointer), so that every batch it reads has its own."""
        dataset_id = self.head.id
        scope = Scope(selector, {"scope_ids": list(ids)})
        task_states = self.task_states
        if selector == "tasks":
            rows = self.connection.execute(_TASKS_OF_DATASET, {"ids": list(ids), "dataset_id": dataset_id})
            found = {task_id: sid for task_id, sid in rows}
            for task_id in ids:
                if task_id not in found:
                    raise NotFound("task", task_id)
            task_states.update(found)
            cached = self._task_set(tuple(sorted(found)))
            if cached is not None:  # whole compact tasks in one state, passed over before
                if cached.batches > most:
                    raise InvalidInput("tasks", f"cover more than {most} batches.")
                [sid] = {found[t] for t in found}
                return Selection(
                    scope,
                    {sid: cached.batches},
                    {sid: set(found)},
                    {sid: 0},
                    cached.batch_set,
                    None,
                    {sid: cached.example},
                    whole={sid: [(t, last, n) for t, (n, last) in sorted(cached.tasks.items())]},
                )
            if None not in found.values() and len(set(found.values())) == 1:
                return self._compact_pass(scope, found, most)
        known = self._known_rows(ids) if selector == "batches" and len(ids) <= SMALL_CHARGE else None
        parts: Iterable[Sequence[Any]]
        if known is not None:
            parts = [known]
        else:
            parts = self.connection.execute(
                _SELECT_BATCHES[(selector, self.connection.dialect.name)],
                {**scope.params, "dataset_id": dataset_id},  # a named batch may be another dataset's
            ).partitions()
        seen: list[tuple[str, str, str]] = []
        counts: dict[str, int] = {}
        tasks: dict[str, set[str]] = {}
        classes: dict[str, int] = {}
        named: dict[str, str] | None = {} if selector == "batches" else None  # batch -> state
        example: dict[str, str] = {}  # state -> its first batch (named in errors)
        per_task: dict[str, list[Any]] = {}  # task -> [state, batches, last position, uniform]
        digest = hashlib.sha256()
        total = 0
        overlay = self.overlay
        members: dict[str, list[str]] | None = {}
        for part in parts:
            lines = []
            for batch_id, state_id_, task_id, *position in part:
                if state_id_ is None:  # a batch of a compact task
                    state_id_ = task_states.get(task_id) or self._task_state(task_id)
                elif overlay:
                    state_id_ = overlay.get(batch_id, state_id_)
                index = classes.get(state_id_)
                if index is None:
                    index = classes[state_id_] = len(classes)
                    counts[state_id_], tasks[state_id_] = 0, set()
                    example[state_id_] = batch_id
                lines.append(f"{batch_id} {index}\n")
                counts[state_id_] += 1
                t = per_task.get(task_id)
                if t is None:
                    per_task[task_id] = [state_id_, 1, position[0] if position else -1, True]
                    tasks[state_id_].add(task_id)
                else:
                    t[1] += 1
                    if position and position[0] > t[2]:
                        t[2] = position[0]
                    if t[0] != state_id_:
                        t[3] = False
                        tasks[state_id_].add(task_id)
                if named is not None:
                    named[batch_id] = state_id_
                if members is not None:
                    members.setdefault(state_id_, []).append(batch_id)
                    seen.append((batch_id, state_id_, task_id))
            digest.update("".join(lines).encode())
            total += len(part)
            if total > SMALL_CHARGE:
                members = None
            if total > most:
                raise InvalidInput("tasks", f"cover more than {most} batches.")
        if named is not None:
            for batch_id in ids:  # in the order named: the first missing, the first of a state
                if batch_id not in named:
                    raise NotFound("batch", batch_id)
            example = {}
            for batch_id in ids:
                example.setdefault(named[batch_id], batch_id)
        if not total:
            raise InvalidInput("tasks", "the tasks have no batches.")
        compact = [t for t in per_task if task_states.get(t)]
        whole: dict[str, list[tuple[str, int, int]]] | None = None
        if (
            selector == "tasks"
            and all(t[3] for t in per_task.values())
            and (total > SMALL_CHARGE or len(compact) == len(per_task))
        ):
            self.compact({t: v[0] for t, v in per_task.items() if not task_states.get(t)})
            whole = {}
            for task_id in sorted(per_task):
                sid, n, last, _ = per_task[task_id]
                whole.setdefault(sid, []).append((task_id, last, n))
            members = None  # moved by their tasks' pointers
            if len(whole) == 1:  # the next charge on these tasks needs no pass (``_task_set``)
                [sid] = whole
                self.seen_task_sets[tuple(sorted(per_task))] = TaskSet(
                    "sha256:" + digest.hexdigest(),
                    total,
                    {t: (n, last) for t, last, n in whole[sid]},
                    example[sid],
                )
        elif compact:
            self.materialise(compact)
        if members is not None:
            self.seen_batches.update((b, (sid, t)) for b, sid, t in seen)
        positions = None if selector != "batches" else [(b, i) for i, b in enumerate(ids)]
        return Selection(
            scope,
            counts,
            tasks,
            classes,
            "sha256:" + digest.hexdigest(),
            positions,
            example,
            named,
            members,
            whole,
        )

    def _compact_pass(self, scope: Scope, found: Mapping[str, str], most: int) -> Selection:
        """``select`` of whole tasks all compact in one state, not passed over before: every
        batch is in class 0, so the pass needs only their ids. Counts and last positions come
        from one aggregate over the tasks' ``(task_id, position)`` index (refused there if more
        than ``most``); the ids stream in code-point order through the driver's own cursor, no
        ORM row per batch, and are hashed as joined chunks (the hash's lines, ``batch_set_hash``)."""
        [sid] = set(found.values())
        per_task = {
            t: (n, last) for t, n, last in self.connection.execute(_TASK_COUNTS, {"ids": sorted(found)})
        }
        total = sum(n for n, _ in per_task.values())
        if not total:
            raise InvalidInput("tasks", "the tasks have no batches.")
        if total > most:
            raise InvalidInput("tasks", f"cover more than {most} batches.")
        digest, first, read = hashlib.sha256(), "", 0
        for ids in _batch_ids_in_order(self.connection, sorted(per_task)):
            first = first or ids[0]
            digest.update((" 0\n".join(ids) + " 0\n").encode())
            read += len(ids)
        if read != total:  # the head is locked: nothing can have changed in between
            raise RuntimeError(f"the pass read {read} batches of tasks that hold {total}")
        batch_set = "sha256:" + digest.hexdigest()
        self.seen_task_sets[tuple(sorted(per_task))] = TaskSet(batch_set, total, per_task, first)
        return Selection(
            scope,
            {sid: total},
            {sid: set(per_task)},
            {sid: 0},
            batch_set,
            None,
            {sid: first},
            whole={sid: [(t, last, n) for t, (n, last) in sorted(per_task.items())]},
        )

    def _task_set(self, key: tuple[str, ...]) -> TaskSet | None:
        """The known pass over the whole tasks ``key`` when all are compact in one state."""
        states = {self.task_states.get(t) for t in key}
        if len(states) != 1 or None in states:
            return None
        cached = self.seen_task_sets.get(key)
        if cached is None and self.known is not None:
            cached = self.known.task_sets.get(key)
        return cached if cached is not None and set(cached.tasks) == set(key) else None

    def _task_state(self, task_id: str) -> str:
        """The pointer of a compact task (one of whose batches has none), read once."""
        state = self.task_states.get(task_id)
        if state is None:
            for row in self.connection.execute(_TASK_AGGREGATES, {"ids": [task_id]}):
                self.task_states[row.id] = row.state_id
                if row.id not in self.tasks:
                    self.tasks[row.id] = (row.epsilon_spent, row.delta_spent, row.naive_epsilon)
            state = self.task_states.get(task_id)
        if state is None:
            raise RuntimeError(f"batch of task {task_id!r} has no state and its task none")
        return state

    def materialise(self, task_ids: Iterable[str]) -> None:
        """The compact tasks ``task_ids`` are no longer compact: their batches take the task's
        pointer (one statement per task, over its batches; no batch changes state)."""
        rows = [{"task": t, "state": self._task_state(t)} for t in sorted(set(task_ids))]
        if not rows:
            return
        execute = self.connection.execute
        for row in rows:
            execute(MATERIALISE, row)
        execute(SET_TASK_STATE, [{"task": row["task"], "state": None} for row in rows])
        for row in rows:
            self.task_states[row["task"]] = None

    def compact(self, states: Mapping[str, str]) -> None:
        """The tasks of ``states`` (each with all its batches in that state) become compact: the
        task holds the pointer, its batches none (no batch changes state)."""
        if not states:
            return
        self.write_overlay()  # the pointers it drops must not be written after it
        self.compacted.update(states)  # what the process knows of their batches is forgotten
        execute = self.connection.execute
        ordered = sorted(states.items())
        for task_id, _ in ordered:
            execute(_COMPACT, {"task": task_id})
        execute(SET_TASK_STATE, [{"task": t, "state": sid} for t, sid in ordered])
        self.task_states.update(states)

    def groups(self, reservation_id: str, batches: int) -> dict[int, list[Group]]:
        """``{class index: [Group]}`` of a reservation over ``batches`` batches, by current
        state: the classes of whole tasks (``HeldClass.tasks``) from their tasks' rows (a task
        still compact: one group of its class; one no longer: its batches by state, ``task_part``);
        the others by one query over its batches — per batch for a small reservation
        (``SMALL_CHARGE``: the groups then name their batches, and the transaction's overlay
        applies), else one aggregate row per (class, state, task) — with each task's maxima."""
        r = self.reservations.get(reservation_id)
        out: dict[int, list[Group]] = {}
        by_rows = batches
        if r is not None and any(c.tasks for c in r.classes):
            self._whole_groups(r, out)
            by_rows = batches - sum(c.batches for c in r.classes if c.tasks)
        if by_rows > 0:
            for index, groups in self._row_groups(reservation_id, by_rows).items():
                out.setdefault(index, []).extend(groups)
        return dict(sorted(out.items()))

    def _whole_groups(self, r: Loaded, out: dict[int, list[Group]]) -> None:
        """The groups of ``r``'s classes of whole tasks, read from the tasks' rows."""
        wanted = sorted({t for c in r.classes for t, _, _ in c.tasks if t not in self.task_states})
        if wanted:
            for row in self.connection.execute(_TASK_AGGREGATES, {"ids": wanted}):
                self.task_states[row.id] = row.state_id
                self.tasks.setdefault(row.id, (row.epsilon_spent, row.delta_spent, row.naive_epsilon))
        found: dict[tuple[int, str], tuple[int, set[str]]] = {}
        for c in r.classes:
            for task_id, last, count in c.tasks:
                sid = self.task_states.get(task_id)
                if sid is not None:  # still compact: all its batches in its state
                    n, tasks = found.get((c.index, sid), (0, set()))
                    tasks.add(task_id)
                    found[(c.index, sid)] = (n + count, tasks)
                    continue
                self.write_overlay()  # the aggregate reads the pointers
                scope = task_part(task_id, last)
                for state_id_, n, _ in self.connection.execute(_TASK_PART_GROUPS, dict(scope.params)):
                    self.load_states([state_id_])
                    out.setdefault(c.index, []).append(
                        Group(state_id_, n, frozenset([task_id]), None, False, scope)
                    )
        self.load_states(sid for _, sid in found)
        for (index, sid), (count, tasks) in sorted(found.items()):
            scope = Scope("tasks", {"scope_ids": sorted(tasks)})  # names an example in errors
            out.setdefault(index, []).append(Group(sid, count, frozenset(tasks), None, True, scope))

    def _row_groups(self, reservation_id: str, batches: int) -> dict[int, list[Group]]:
        """The groups of a reservation's ``reservation_batches`` rows (``groups``). A batch
        without a pointer is of a task that became compact since: the task is materialised."""
        found: dict[tuple[int, str], tuple[int, set[str], list[str]]] = {}
        small = batches <= SMALL_CHARGE
        if small:
            r = self.reservations.get(reservation_id)
            ours = r is not None and r.dataset_id == self.head.id  # its batches are this dataset's
            if not ours:
                self.unsure = True  # another dataset's batches and tasks: learn nothing of them
            known = self._known_members(reservation_id) if ours else None
            rows: Iterable[Sequence[Any]] = (
                self.connection.execute(_RESERVATION_MEMBERS, {"reservation_id": reservation_id}).all()
                if known is None
                else known
            )
            rows = list(rows)
            compact = {
                row[3]: self._task_state(row[3])
                for row in rows
                if row[2] is None or self.task_states.get(row[3])
            }
            if compact:
                self.materialise(compact)
            overlay = self.overlay
            members = []
            for index, batch_id, state_id_, task_id, *spent in rows:
                if state_id_ is None or task_id in compact:
                    state_id_ = compact[task_id]
                state_id_ = overlay.get(batch_id, state_id_)
                self.tasks.setdefault(task_id, tuple(spent))  # an earlier op's raise stays
                total, tasks, ids = found.get((index, state_id_), (0, set(), []))
                tasks.add(task_id)
                ids.append(batch_id)
                found[(index, state_id_)] = (total + 1, tasks, ids)
                members.append((index, batch_id))
                if ours and not self.unsure:
                    self.seen_batches[batch_id] = (state_id_, task_id)
            if ours:
                self.seen_members[reservation_id] = tuple(members)
        else:
            self.write_overlay()  # the aggregate reads the pointers
            aggregated = self.connection.execute(
                _RESERVATION_GROUPS, {"reservation_id": reservation_id}
            ).all()
            compact = {row[2] for row in aggregated if row[1] is None or self.task_states.get(row[2])}
            if compact:  # rare: materialise and read again
                self.materialise(compact)
                aggregated = self.connection.execute(
                    _RESERVATION_GROUPS, {"reservation_id": reservation_id}
                ).all()
            for index, state_id_, task_id, count, *spent in aggregated:
                self.tasks.setdefault(task_id, tuple(spent))
                total, tasks, ids = found.get((index, state_id_), (0, set(), []))
                tasks.add(task_id)
                found[(index, state_id_)] = (total + count, tasks, ids)
        self.load_states(state for _, state in found)
        out: dict[int, list[Group]] = {}
        for (index, state_id_), (count, tasks, ids) in sorted(found.items()):
            out.setdefault(index, []).append(
                Group(state_id_, count, frozenset(tasks), tuple(ids) if small else None)
            )
        return out

    def _known_members(self, reservation_id: str) -> list[tuple[Any, ...]] | None:
        """The rows of ``_RESERVATION_MEMBERS`` for a small reservation, when all are known."""
        members = self.seen_members.get(reservation_id)
        if members is None and self.known is not None:
            members = self.known.members.get(reservation_id)
        if members is None:
            return None
        rows: list[tuple[Any, ...]] = []
        for index, batch_id in members:
            entry = self._batch(batch_id)
            spent = None if entry is None else self._task_spent(entry[1])
            if entry is None or spent is None:
                return None
            rows.append((index, batch_id, *entry, *spent))
        return rows

    def dataset_groups(self) -> list[tuple[str, int, frozenset[str]]]:
        """``[(state id, batches, their tasks)]`` over every batch of the dataset: one aggregate
        query, one row per (state, task) (``state_groups``)."""
        self.materialise(self.connection.scalars(_COMPACT_TASKS, {"dataset_id": self.head.id}))
        self.write_overlay()
        groups = state_groups(self.connection.execute(*state_groups_query(self.head.id)))
        self.load_states(g.state_id for g in groups)
        return [(g.state_id, g.batches, g.tasks) for g in groups]

    def example_batch(self, state_id_: str, scope: Scope | None = None) -> str:
        """A batch in state ``state_id_`` (of those ``scope`` selects), to name in an error."""
        scope = scope or whole_dataset(self.head.id)
        self.write_overlay()
        query = select(func.min(Batch.id)).where(EFFECTIVE_STATE == bindparam("state"), scope.where)
        return str(self.connection.scalar(query, {**scope.params, "state": state_id_}))

    # -- applying --------------------------------------------------------------------------------

    def audit(self, event_type: str, payload: Mapping[str, Any], at: datetime) -> None:
        event = audit.AuditEvent(event_type, payload, tenant_id=self.head.tenant_id, dataset_id=self.head.id)
        self.events.append((event, at))

    def intern(self, state: BatchState, at: datetime) -> str:
        """The id of ``state``'s row, written unless this process knows it is stored (``STATES``):
        one ``INSERT … ON CONFLICT DO NOTHING``, no read. An id is hashed once per state object
        (``_interned``: the rules return the same object for the same settlement)."""
        sid = self._interned.get(id(state))
        document = None  # the state's JSON, made once for its id and its row
        if sid is None or self._interned_objects.get(id(state)) is not state:
            document = state.to_json()
            sid = _state_id_of(self.head.id, document)
            self._interned[id(state)], self._interned_objects[id(state)] = sid, state
        if sid not in self.written_states and not STATES.is_stored(self.connection.engine, sid):
            # Written by ``flush``: no row is read in the transaction (no foreign key points here).
            self.new_states.append(
                {
                    "id": sid,
                    "dataset_id": self.head.id,
                    "state": state.to_json() if document is None else document,
                    "created_at": at,
                }
            )
            self.written_states.add(sid)
        self.states.setdefault(sid, state)
        STATES.put(sid, state)
        return sid

    def committed(self) -> None:
        """After the transaction committed: the states it wrote are stored (``STATES``), and what
        it read and wrote of the dataset is known at the head's new mark (``KNOWN``)."""
        engine = self.connection.engine
        if self.written_states:
            STATES.mark_stored(engine, self.written_states)
        if self.known is None:
            return
        dataset_id = self.head.id
        learned = (
            None
            if self.unsure
            else Learned(
                self.seen_batches,
                self.tasks,
                [r for r in self.reservations.values() if r.dataset_id == dataset_id],
                self.seen_members,
                self.seen_task_sets,
                frozenset(self.compacted),
            )
        )
        KNOWN.learn(engine, dataset_id, self.known, self.opened, self.final or self.opened, learned)

    def move(self, scope: Scope, moves: Sequence[Move], at: datetime) -> None:
        """Move the batches ``scope`` selects from each move's source state to its target, and
        raise the task and dataset maxima. One prebuilt UPDATE: from one state, with the target as a
        parameter; from several, through the transaction's state map (``_map_states``), so every
        batch is rewritten once from the state it was in (a move into another move's source
        state cannot move a batch twice) in time linear in the batches, however many states."""
        targets = {id(m): self.intern(m.target, at) for m in moves}  # each state hashed once
        if any(m.compact or m.scope is not None for m in moves):
            rest = [m for m in moves if not m.compact and m.scope is None]
            self._move_tasks([m for m in moves if m.compact], targets)
            by_scope: dict[int, tuple[Scope, list[Move]]] = {}  # a task part's groups share one
            for m in moves:
                if m.scope is not None and not m.compact:
                    by_scope.setdefault(id(m.scope), (m.scope, []))[1].append(m)
            for other, grouped in by_scope.values():
                self.move(other, [replace(m, scope=None) for m in grouped], at)
            if rest:
                self.move(scope, rest, at)
            return
        if all(m.batch_ids is not None for m in moves):  # a small charge: kept until ``flush``
            for m in moves:
                for batch_id in m.batch_ids or ():
                    self.overlay[batch_id] = targets[id(m)]
                    entry = self._batch(batch_id)
                    if entry is None:
                        self.unsure = True  # not read in this transaction: not expected
                    else:
                        self.seen_batches[batch_id] = (targets[id(m)], entry[1])
            for m in moves:
                self._raise_maxima(self.state(m.source), m.target, m.tasks)
            return
        self.write_overlay()  # the set statement tests the pointers
        self.unsure = True  # which batches it moves is not known here
        pending = {m.source: (targets[id(m)], m.count) for m in moves if targets[id(m)] != m.source}
        if len(pending) == 1:
            [(source, (target, expected))] = pending.items()
            statement = _MOVE_FROM_ONE[scope.kind]
            params = {**scope.params, "source": source, "target": target}
        elif pending:
            expected = sum(count for _, count in pending.values())
            self._map_states({source: (target, None) for source, (target, _) in pending.items()})
            statement, params = _MOVE_THROUGH_MAP[scope.kind], dict(scope.params)
        if pending:
            moved = self.connection.execute(statement, params).rowcount
            if moved != expected:  # the head is locked: nothing else moves these batches
                raise RuntimeError(f"moved {moved} batches out of {len(pending)} states, expected {expected}")
        for m in moves:
            self._raise_maxima(self.state(m.source), m.target, m.tasks)

    def _move_tasks(self, moves: Sequence[Move], targets: Mapping[int, str]) -> None:
        """Move whole compact tasks: one pointer per task (``Task.state_id``), not per batch."""
        rows = [
            {"task": t, "source": m.source, "target": targets[id(m)]}
            for m in moves
            if targets[id(m)] != m.source
            for t in sorted(m.tasks)
        ]
        if rows:  # the process knows no batch of a compact task by its own pointer: nothing to forget
            moved = self.connection.execute(_MOVE_TASK, rows).rowcount
            if moved not in (-1, len(rows)):  # the head is locked: nothing else moves them
                raise RuntimeError(f"moved {moved} tasks, expected {len(rows)}")
            for row in rows:
                self.task_states[row["task"]] = row["target"]
        for m in moves:
            self._raise_maxima(self.state(m.source), m.target, m.tasks)

    def _raise_maxima(self, before: BatchState, state: BatchState, tasks: Iterable[str]) -> None:
        """Raise the tasks' and the dataset's maxima with a state some of their batches moved to."""
        spent = (state.epsilon_spent, state.delta_spent, state.naive_epsilon)
        if spent == (before.epsilon_spent, before.delta_spent, before.naive_epsilon):
            return  # holds move, spend does not: no maximum changes
        head = self.head
        head.epsilon_spent = max(head.epsilon_spent, state.epsilon_spent)
        head.delta_spent = max(head.delta_spent, state.delta_spent)
        head.naive_epsilon = max(head.naive_epsilon, state.naive_epsilon)
        for task_id in tasks:
            if task_id not in self.tasks and self.known is not None and task_id in self.known.tasks:
                self.tasks[task_id] = self.known.tasks[task_id]
        missing = sorted(t for t in tasks if t not in self.tasks)
        if missing:
            for row in self.connection.execute(_TASK_AGGREGATES, {"ids": missing}):
                self.tasks[row.id] = (row.epsilon_spent, row.delta_spent, row.naive_epsilon)
        for task_id in tasks:
            eps, dlt, naive = self.tasks[task_id]
            raised = (max(eps, spent[0]), max(dlt, spent[1]), max(naive, spent[2]))
            if raised != (eps, dlt, naive):
                self.tasks[task_id] = raised
                self.dirty_tasks.add(task_id)

    def add_reservation(self, r: Loaded, selection: Selection) -> None:
        """A new reservation, its classes and its batches (one narrow row each). Named batches
        are written by ``flush`` with the group's other rows (no operation of the group can name
        a reservation made in it: its id is answered after the commit); a task's batches by one
        ``INSERT … SELECT`` now, before they move (their class is read from their state)."""
        self.reservations[r.id] = r
        self.new_reservations.append(r)
        if selection.members is not None:
            self.seen_members[r.id] = tuple(
                (selection.classes[sid], b) for sid, batch_ids in selection.members.items() for b in batch_ids
            )
        if selection.whole is not None:  # whole compact tasks: one row per task, by ``flush``
            self.new_reservation_tasks.extend(
                {
                    "reservation_id": r.id,
                    "task_id": task_id,
                    "class_index": selection.classes[sid],
                    "last_position": last,
                    "batches": count,
                }
                for sid, entries in selection.whole.items()
                for task_id, last, count in entries
            )
            return
        if selection.positions is not None:
            assert selection.named is not None
            index_of, state_of = selection.classes, selection.named
            self.new_reservation_batches.extend(
                {"reservation_id": r.id, "batch_id": b, "position": i, "class_index": index_of[state_of[b]]}
                for b, i in selection.positions
            )
            return
        self.write_overlay()  # the classes are read from the pointers
        execute = self.connection.execute
        columns = ["reservation_id", "batch_id", "position", "class_index"]
        chosen = (Batch.task_id.in_(list(selection.scope.params["scope_ids"])),)  # checked by ``select``
        if len(selection.classes) == 1:  # the head is locked: every chosen batch is in its state
            rows = select(literal(r.id), Batch.id, Batch.position, literal(0)).where(*chosen)
        else:  # the class of each batch, from its state, through the state map
            self._map_states({sid: (None, index) for sid, index in selection.classes.items()})
            rows = select(literal(r.id), Batch.id, Batch.position, STATE_MAP.c.class_index).where(
                *chosen, Batch.state_id == STATE_MAP.c.state_id
            )
        # In key order: the index on (reservation, batch) grows at its right edge.
        written = execute(insert(ReservationBatch).from_select(columns, rows.order_by(Batch.id))).rowcount
        # The head is locked: the selection cannot have changed (-1: a driver that does not count
        # an INSERT ... SELECT; the move that follows checks its count either way).
        if written not in (-1, selection.batches):
            raise RuntimeError(f"wrote {written} reservation batches, expected {selection.batches}")

    def write_overlay(self, *, counted: bool = True) -> None:
        """Write the pointers of the small charges' moves (``overlay``), one statement, and
        check that each batch was written (``counted``: not in a pipeline, whose executemany
        reports no count)."""
        if not self.overlay:
            return
        rows = [{"batch": b, "state": sid} for b, sid in sorted(self.overlay.items())]
        written = self.connection.execute(_REPOINT, rows).rowcount
        if counted and written not in (-1, len(rows)):  # -1: a driver that does not sum them
            raise RuntimeError(f"repointed {written} batches, expected {len(rows)}")
        self.overlay.clear()

    def _map_states(self, mapping: Mapping[str, tuple[str | None, int | None]]) -> None:
        """Fill the connection's state map (``STATE_MAP``, a temporary table: created on first
        use, emptied here) with ``{state id: (target state id, class index)}``."""
        execute = self.connection.execute
        execute(CreateTable(STATE_MAP, if_not_exists=True))
        execute(STATE_MAP.delete())
        execute(
            STATE_MAP.insert(),
            [
                {"state_id": sid, "target": target, "class_index": index}
                for sid, (target, index) in mapping.items()
            ],
        )

    def grow_budget(self, budget: Budget) -> None:
        """The budget with one more declared plan segment, written with the head (``flush``)."""
        self.budget = budget
        self.head.plan_segments = len(budget.segments)
        self.budget_grown = True

    def put_reservation(self, r: Loaded) -> None:
        self.reservations[r.id] = r
        self.dirty_reservations.add(r.id)

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
        if self.new_states:
            execute(_INSERT_NEW_STATE[self.connection.dialect.name], self.new_states)
        # The head is locked and each batch was read in this transaction; PostgreSQL's pipeline
        # returns no count for an executemany.
        self.write_overlay(counted=self.connection.dialect.name != "postgresql")
        if self.new_reservations:
            latest = [self.reservations[r.id] for r in self.new_reservations]
            execute(_INSERT_RESERVATIONS, [_reservation_row(r) for r in latest])
        if self.new_reservation_batches:
            execute(_INSERT_RESERVATION_BATCHES, self.new_reservation_batches)
        if self.new_reservation_tasks:
            execute(_INSERT_RESERVATION_TASKS, self.new_reservation_tasks)
        new = {r.id for r in self.new_reservations}
        changed = [self.reservations[i] for i in sorted(self.dirty_reservations - new)]
        if changed:
            execute(
                _UPDATE_RESERVATIONS,
                [
                    {
                        "reservation_id": r.id,
                        "status": r.status,
                        "expires_at": r.expires_at,
                        "closed_at": r.closed_at,
                        "committed_epsilon": r.committed_epsilon,
                        "committed_delta": r.committed_delta,
                        "commits": r.commits,
                        "committed_event": r.committed_event,
                        "classes": class_documents(r.classes),
                    }
                    for r in changed
                ],
            )
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
        self.final = (values["ledger_version"], head.audit_seq, head.audit_hash)
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
        "classes": class_documents(r.classes),
        "batches": r.batches,
        "batch_set": r.batch_set,
        "expires_at": r.expires_at,
        "created_at": r.created_at,
        "closed_at": r.closed_at,
    }


# ---------------------------------------------------------------------------------------------
# Datasets (read before the transaction, by ``spending.pre_pricing``) and the group's reads
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


_BATCH_STATE_IDS: Final = {
    "batches": select(Batch.id, Batch.state_id).where(
        Batch.id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id")
    ),
    "tasks": select(Batch.id, Batch.state_id).where(
        Batch.task_id.in_(bindparam("ids", expanding=True)), Batch.dataset_id == bindparam("dataset_id")
    ),
}


def batch_states(
    db: Database, dataset_id: str, selector: str, ids: Sequence[str]
) -> tuple[dict[str, str], dict[str, BatchState]]:
    """``({batch id: state id}, {state id: state})`` of the named batches (or the tasks'
    batches), read outside the spend transaction; each distinct state is parsed once."""
    rows = db.read_all(_BATCH_STATE_IDS[selector], {"ids": list(ids), "dataset_id": dataset_id})
    of_batch = {row.id: row.state_id for row in rows}
    return of_batch, read_states(db, of_batch.values())


def read_states(db: Database, state_ids: Iterable[str]) -> dict[str, BatchState]:
    """``{state id: state}``, read outside the spend transaction; each distinct state parsed once."""
    out: dict[str, BatchState] = {}
    wanted = []
    for sid in sorted(set(state_ids)):
        state = STATES.get(sid)
        if state is None:
            wanted.append(sid)
        else:
            out[sid] = state
    if wanted:
        out.update(parse_states((row.id, row.state) for row in db.read_all(_LOAD_STATES, {"ids": wanted})))
    return out


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


def stored_answers(connection: Connection, requests: Sequence[Request]) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    by_tenant: dict[str, list[str]] = {}
    for op in requests:
        if op.key is not None:
            by_tenant.setdefault(op.tenant_id, []).append(op.key)
    for tenant_id, keys in by_tenant.items():
        for row in connection.execute(_STORED_ANSWERS, {"tenant_id": tenant_id, "keys": keys}):
            out[(tenant_id, row.key)] = (row.operation, row.request_hash, row.response)
    return out


def released(connection: Connection, requests: Sequence[Request]) -> set[tuple[str, str, str]]:
    """Which of the (tenant, model, version) the commits in ``requests`` release exist already."""
    wanted = {
        (op.tenant_id, op.params.model, op.params.version)
        for op in requests
        if isinstance(op.params, CommitParams)
    }
    if not wanted:
        return set()
    rows = connection.execute(_RELEASED, {"releases": sorted(wanted)})
    return {(r.tenant_id, r.model, r.version) for r in rows}
