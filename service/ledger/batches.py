"""Tasks and their fixed, disjoint batches.

A batch is immutable once created. Its records are stored only as HMAC-SHA256(dataset salt,
record id), keyed by the dataset's and the batch's integer ``key``, under the primary key
(dataset_key, record_hash), so a record can be in one batch only and an overlapping batch is
refused by the database itself (``BatchOverlap``, naming the first shared record id as the
client gave it). Record ids are strings (1-256 characters) or integers; an
integer and its decimal string are the same record.

Batch creation locks the dataset's ledger head: concurrent creations on one dataset then insert
their records one after the other, so they cannot deadlock on the unique index and the refused
one can name the record it shares.

The creations, deletions and the lists answer typed values (issue 29 §1: ``TaskAnswer``,
``TasksPage``, ``BatchesCreated`` of ``CreatedBatch``, ``TaskDeleted``, ``BatchDeleted``, and
``BatchesPage`` / ``TaskBatchesPage`` of ``BatchAnswer``, each batch's ``StoredSpend``), each
with one ``to_json``, its wire form, called at the edge; an idempotent replay is the type's
``from_json`` of the stored answer, whose wire form stays that stored JSON.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from itertools import chain, repeat
from typing import Any, Final

from sqlalchemy import Connection, bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session

from accountant.exact import to_text
from accountant.rules import BatchState
from service.db.models import Batch, BatchRecord, BatchStateRow, Dataset, Task
from service.db.session import Database, lock_ledger_head
from service.ledger import audit, idempotency
from service.ledger.datasets import (
    UNENCODABLE,
    can_be_id,
    check_name,
    encodes,
    load_dataset,
    refuse_archived,
    refuse_while_a_job_runs,
)
from service.ledger.errors import BatchOverlap, Conflict, InvalidInput, NotFound
from service.ledger.spending.store import (
    EFFECTIVE_STATE,
    MATERIALISE,
    SET_TASK_STATE,
    state_id,
    unfold_whole_tasks,
)

MAX_BATCHES_PER_REQUEST: Final = 10_000
# Tasks of one dataset: GET /v1/datasets/{id}/spend lists them all, so they are bounded (the
# worker's trainers take at most 1000 tasks: service.contract.job_params.MAX_TASKS).
MAX_TASKS_PER_DATASET: Final = 10_000
# Pages of GET /v1/datasets/{id}/tasks (offset) and .../tasks/{task}/batches (cursor).
DEFAULT_TASK_PAGE: Final = 100
MAX_TASK_PAGE: Final = 1000
DEFAULT_BATCH_PAGE: Final = 1000
MAX_BATCH_PAGE: Final = 10_000
MAX_RECORDS_PER_REQUEST: Final = 2_000_000
MAX_RECORD_ID_LENGTH: Final = 256
_LOOKUP_CHUNK: Final = 1_000
_EMPTY_STATE: Final = BatchState.empty()


def record_key(record: object, batch: int, index: int) -> str:
    """The canonical text of a record id, record ``index`` of ``batches[batch]`` (``InvalidInput``
    naming ``batches[batch].records[index]`` if it is not one). Strings are tested first and the
    field's name is built only for an error: this runs once per record of a creation."""
    if isinstance(record, str) and 1 <= len(record) <= MAX_RECORD_ID_LENGTH:
        return record
    if isinstance(record, int) and not isinstance(record, bool):
        return str(record)
    field = f"batches[{batch}].records[{index}]"
    if isinstance(record, bool):
        raise InvalidInput(field, f"must be a string or an integer. Found {record!r}.")
    raise InvalidInput(
        field, f"must be a string of 1-{MAX_RECORD_ID_LENGTH} characters or an integer. Found {record!r}."
    )


def record_hash(salt: bytes, key: str) -> bytes:
    """HMAC-SHA256(salt, key): ``hmac.digest``, the one-shot C path (3x ``hmac.new``)."""
    return hmac.digest(salt, key.encode(), "sha256")


def record_hashes(salt: bytes, keys: Iterable[str]) -> list[bytes]:
    """``[record_hash(salt, key) for key in keys]``, keyed once: HMAC-SHA256 written out (RFC 2104,
    ``H((K ^ opad) || H((K ^ ipad) || m))``) on two SHA-256 states that absorbed the padded key,
    copied per record. 1.3 µs a record against 2.0 µs copying a keyed ``hmac.HMAC`` (its
    Python-level ``copy``/``update``/``digest``) and 2.9 µs re-keying each time (``hmac.digest``)."""
    if len(salt) > _SHA256_BLOCK:
        salt = hashlib.sha256(salt).digest()
    block = salt.ljust(_SHA256_BLOCK, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in block)).copy
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in block)).copy
    out: list[bytes] = []
    append = out.append
    for data in map(str.encode, keys):
        h = inner()
        h.update(data)
        o = outer()
        o.update(h.digest())
        append(o.digest())
    return out


_SHA256_BLOCK: Final = 64


@dataclass(frozen=True, slots=True)
class TaskAnswer:
    """A task of a dataset as the ledger answers it."""

    id: str
    dataset_id: str
    name: str
    created_at: datetime
    _wire: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, row: Task) -> TaskAnswer:
        return cls(row.id, row.dataset_id, row.name, row.created_at)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TaskAnswer:
        """The task of an answer this ledger gave (a stored idempotent answer); its wire form is
        that answer as stored."""
        created_at = datetime.fromisoformat(obj["created_at"])
        return cls(obj["id"], obj["dataset_id"], obj["name"], created_at, dict(obj))

    def to_json(self) -> dict[str, Any]:
        if self._wire is not None:
            return self._wire
        return {
            "id": self.id,
            "dataset_id": self.dataset_id,
            "name": self.name,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class TasksPage:
    """A page of a dataset's tasks (``list_tasks``) and how many it has in all."""

    data: tuple[TaskAnswer, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [t.to_json() for t in self.data], "count": self.count}


@dataclass(frozen=True, slots=True)
class CreatedBatch:
    """A batch as its creation answers it (its spend is nothing yet)."""

    id: str
    name: str
    size: int
    task_id: str
    created_at: datetime

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CreatedBatch:
        return cls(
            obj["id"], obj["name"], obj["size"], obj["task_id"], datetime.fromisoformat(obj["created_at"])
        )


@dataclass(frozen=True, slots=True)
class BatchesCreated:
    """The batches one ``create_batches`` made, in the order asked. Its wire form is built once
    (a request makes up to ``MAX_BATCHES_PER_REQUEST``: the stored answer and the HTTP answer
    share it)."""

    data: tuple[CreatedBatch, ...]
    _wire: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BatchesCreated:
        """The batches of an answer this ledger gave (a stored idempotent answer); its wire form
        is that answer as stored."""
        return cls(tuple(CreatedBatch.from_json(b) for b in obj["data"]), dict(obj))

    def to_json(self) -> dict[str, Any]:
        if self._wire is not None:
            return self._wire
        at: dict[datetime, str] = {}  # one text per creation time (they all share one)
        wire = {
            "data": [
                {
                    "id": b.id,
                    "name": b.name,
                    "size": b.size,
                    "task_id": b.task_id,
                    "created_at": at.get(b.created_at)
                    or at.setdefault(b.created_at, b.created_at.isoformat()),
                }
                for b in self.data
            ]
        }
        object.__setattr__(self, "_wire", wire)
        return wire


@dataclass(frozen=True, slots=True)
class TaskDeleted:
    """A deleted task: its id, name, and how many batches and records went with it."""

    id: str
    name: str
    batches: int
    records: int

    def document(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "batches": self.batches, "records": self.records}

    def to_json(self) -> dict[str, Any]:
        return {"deleted": self.document()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TaskDeleted:
        d = obj["deleted"]
        return cls(d["id"], d["name"], d["batches"], d["records"])


@dataclass(frozen=True, slots=True)
class BatchDeleted:
    """A deleted batch: its id, task, name and size."""

    id: str
    task_id: str
    name: str
    size: int

    def document(self) -> dict[str, Any]:
        return {"id": self.id, "task_id": self.task_id, "name": self.name, "size": self.size}

    def to_json(self) -> dict[str, Any]:
        return {"deleted": self.document()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BatchDeleted:
        d = obj["deleted"]
        return cls(d["id"], d["task_id"], d["name"], d["size"])


@dataclass(frozen=True, slots=True)
class StoredSpend:
    """A batch's spend as its stored state (a ``BatchStateRow``'s JSON) records it: committed
    ``epsilon_spent`` and ``delta_spent`` under the rule, ``epsilon_held`` by open reservations,
    and the ``naive_sequential_epsilon`` of every charge counted. A field the state lacks is 0."""

    epsilon_spent: Decimal
    epsilon_held: Decimal
    delta_spent: Decimal
    naive_sequential_epsilon: Decimal

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> StoredSpend:
        return cls(
            Decimal(str(state.get("epsilon_spent", "0"))),
            Decimal(str(state.get("epsilon_held", "0"))),
            Decimal(str(state.get("delta_spent", "0"))),
            Decimal(str(state.get("naive_epsilon", "0"))),
        )

    def to_json(self) -> dict[str, str]:
        """The spend fields (canonical decimal text, as the state stores them)."""
        return {
            "epsilon_spent": to_text(self.epsilon_spent),
            "epsilon_held": to_text(self.epsilon_held),
            "delta_spent": to_text(self.delta_spent),
            "naive_sequential_epsilon": to_text(self.naive_sequential_epsilon),
        }


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """A batch with the spend its state records, as the batch lists answer it."""

    id: str
    task_id: str
    position: int
    name: str
    size: int
    created_at: datetime
    spend: StoredSpend

    @classmethod
    def of(cls, row: Batch, state: Mapping[str, Any]) -> BatchAnswer:
        spend = StoredSpend.of(state)
        return cls(row.id, row.task_id, row.position, row.name, row.size, row.created_at, spend)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task_id": self.task_id,
            "position": self.position,
            "name": self.name,
            "size": self.size,
            "created_at": self.created_at.isoformat(),
            **self.spend.to_json(),
        }


@dataclass(frozen=True, slots=True)
class BatchesPage:
    """Every batch of a dataset or a task (``list_batches``) and how many they are."""

    data: tuple[BatchAnswer, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [b.to_json() for b in self.data], "count": self.count}


@dataclass(frozen=True, slots=True)
class TaskBatchesPage:
    """A page of a task's batches (``task_batches``): ``count`` is every batch of the task,
    ``next`` the ``after`` of the next page (the last position of this one; ``None``: the last
    page)."""

    data: tuple[BatchAnswer, ...]
    count: int
    next: int | None

    def to_json(self) -> dict[str, Any]:
        return {"data": [b.to_json() for b in self.data], "count": self.count, "next": self.next}


def _dataset_key(session: Session, dataset_id: str) -> int:
    """The dataset's integer key (its records' ``dataset_key``); the dataset exists."""
    return int(session.scalar(select(Dataset.key).where(Dataset.id == dataset_id)))  # type: ignore[arg-type]


def _load_task(session: Session, dataset_id: str, task_id: str) -> Task:
    task = session.get(Task, task_id) if can_be_id(task_id) else None
    if task is None or task.dataset_id != dataset_id:
        raise NotFound("task", task_id)
    return task


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


def create_task(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    name: str,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> TaskAnswer:
    """Register a task of the dataset (201): ``{id, dataset_id, name, created_at}``. A dataset
    holds at most ``MAX_TASKS_PER_DATASET`` tasks (``Conflict`` ``too_many_tasks``)."""
    check_name(name)

    def body(session: Session, at: datetime) -> idempotency.Outcome[TaskAnswer]:
        dataset = load_dataset(session, tenant_id, dataset_id)
        head = lock_ledger_head(session.connection(), dataset_id)  # the count below stays true
        refuse_archived(dataset_id, head.archived_at if head is not None else dataset.archived_at)
        tasks = session.scalar(select(func.count()).select_from(Task).where(Task.dataset_id == dataset_id))
        if (tasks or 0) >= MAX_TASKS_PER_DATASET:
            raise Conflict(
                f"dataset {dataset_id!r} holds {MAX_TASKS_PER_DATASET} tasks, the most a dataset may hold.",
                reason="too_many_tasks",
            )
        row = Task(id=f"task_{secrets.token_hex(12)}", dataset_id=dataset_id, name=name, created_at=at)
        session.add(row)
        session.flush()
        event = audit.AuditEvent(
            "task.created", {"task_id": row.id, "name": name}, tenant_id=tenant_id, dataset_id=dataset_id
        )
        return idempotency.Outcome(TaskAnswer.of(row), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="create_task",
        request={"dataset_id": dataset_id, "name": name},
        idempotency_key=idempotency_key,
        body=body,
        replay=TaskAnswer.from_json,
        status_code=201,
        now=now,
    )


# ---------------------------------------------------------------------------------------------
# Deleting what was never charged (issue 28 §7)
# ---------------------------------------------------------------------------------------------
#
# A task or a batch registered by mistake (an empty task left by a refused registration, a batch
# with the wrong records) can be deleted while nothing was ever charged or held on it: every one
# of its batches is in the empty state, which a reservation leaves only by a refund of what
# provably never ran. Then no certificate, reservation charge or spend refers to it, and removing
# it (with its record hashes, so the records can be registered again) changes no guarantee. The
# deletion is appended to the dataset's audit chain (``task.deleted`` / ``batch.deleted``); the
# ``task.created`` / ``batches.created`` entries stay, so the history shows both. A charged or
# held batch is never deletable (409 ``charged``); neither is anything while a job of the
# dataset is queued or running (409 ``dataset_in_use``: its plan reads every batch). Datasets are
# not deleted: their audit chain is their history.


def _refuse_charged(session: Session, dataset_id: str, where: Any, what: str) -> None:
    empty = state_id(dataset_id, _EMPTY_STATE)
    charged = session.scalars(select(Batch.id).where(where, EFFECTIVE_STATE != empty).limit(1)).first()
    if charged is not None:
        raise Conflict(
            f"{what} cannot be deleted: batch {charged!r} was charged or is held by a reservation "
            "(a certificate, a charge or a hold refers to it), and spend is never undone.",
            reason="charged",
            batch_id=charged,
        )


def delete_batch(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    task_id: str,
    batch_id: str,
    *,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> BatchDeleted:
    """Delete a batch nothing was ever charged on, with its records (200: ``{deleted: batch}``);
    audited as ``batch.deleted``. ``NotFound`` (also another tenant's), ``Conflict``
    (``charged``, ``dataset_in_use``)."""

    def body(session: Session, at: datetime) -> idempotency.Outcome[BatchDeleted]:
        head = lock_ledger_head(session.connection(), dataset_id) if can_be_id(dataset_id) else None
        if head is None or head.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        _load_task(session, dataset_id, task_id)
        row = session.get(Batch, batch_id) if can_be_id(batch_id) else None
        if row is None or row.task_id != task_id:
            raise NotFound("batch", batch_id)
        refuse_while_a_job_runs(session, dataset_id, "delete once it has finished (or cancel it)")
        _refuse_charged(session, dataset_id, Batch.id == batch_id, f"batch {batch_id!r}")
        deleted = BatchDeleted(row.id, task_id, row.name, row.size)
        connection = session.connection()
        unfold_whole_tasks(connection, task_id, row.position)  # their lists keep naming it
        connection.execute(
            delete(BatchRecord).where(
                BatchRecord.dataset_key == _dataset_key(session, dataset_id), BatchRecord.batch_key == row.key
            )
        )
        connection.execute(delete(Batch).where(Batch.id == batch_id))
        event = audit.AuditEvent(
            "batch.deleted", deleted.document(), tenant_id=tenant_id, dataset_id=dataset_id
        )
        return idempotency.Outcome(deleted, [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="delete_batch",
        request={"dataset_id": dataset_id, "task_id": task_id, "batch_id": batch_id},
        idempotency_key=idempotency_key,
        body=body,
        replay=BatchDeleted.from_json,
        now=now,
    )


def delete_task(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    task_id: str,
    *,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> TaskDeleted:
    """Delete a task none of whose batches was ever charged, with its batches and their records
    (200: ``{deleted: {id, name, batches, records}}``); audited as ``task.deleted``.
    ``NotFound`` (also another tenant's), ``Conflict`` (``charged``, ``dataset_in_use``)."""

    def body(session: Session, at: datetime) -> idempotency.Outcome[TaskDeleted]:
        head = lock_ledger_head(session.connection(), dataset_id) if can_be_id(dataset_id) else None
        if head is None or head.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        task = _load_task(session, dataset_id, task_id)
        refuse_while_a_job_runs(session, dataset_id, "delete once it has finished (or cancel it)")
        _refuse_charged(session, dataset_id, Batch.task_id == task_id, f"task {task_id!r}")
        count, records = session.execute(
            select(func.count(), func.coalesce(func.sum(Batch.size), 0)).where(Batch.task_id == task_id)
        ).one()
        deleted = TaskDeleted(task.id, task.name, int(count), int(records))
        connection = session.connection()
        unfold_whole_tasks(connection, task_id, 0)  # their lists keep naming its batches
        keys = select(Batch.key).where(Batch.task_id == task_id).scalar_subquery()
        records_of_task = delete(BatchRecord).where(
            BatchRecord.dataset_key == _dataset_key(session, dataset_id), BatchRecord.batch_key.in_(keys)
        )
        connection.execute(records_of_task)
        connection.execute(delete(Batch).where(Batch.task_id == task_id))
        connection.execute(delete(Task).where(Task.id == task_id))
        event = audit.AuditEvent(
            "task.deleted", deleted.document(), tenant_id=tenant_id, dataset_id=dataset_id
        )
        return idempotency.Outcome(deleted, [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="delete_task",
        request={"dataset_id": dataset_id, "task_id": task_id},
        idempotency_key=idempotency_key,
        body=body,
        replay=TaskDeleted.from_json,
        now=now,
    )


def list_tasks(
    db: Database, tenant_id: str, dataset_id: str, *, limit: int = DEFAULT_TASK_PAGE, offset: int = 0
) -> TasksPage:
    """A page of the dataset's tasks, oldest first: ``{data, count}`` (``count``: all of them)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_TASK_PAGE:
        raise InvalidInput("limit", f"must be an integer in [1, {MAX_TASK_PAGE}]. Found {limit!r}.")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidInput("offset", f"must be an integer >= 0. Found {offset!r}.")
    with db.session(readonly=True) as session:
        load_dataset(session, tenant_id, dataset_id)
        mine = Task.dataset_id == dataset_id
        rows = session.scalars(
            select(Task).where(mine).order_by(Task.created_at, Task.id).limit(limit).offset(offset)
        ).all()
        count = session.scalar(select(func.count()).select_from(Task).where(mine))
        return TasksPage(tuple(TaskAnswer.of(r) for r in rows), int(count or 0))


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


Parsed = list[tuple[str, list[str], list[str | int]]]


def _parse_batches(batches: object) -> Parsed:
    """``[(name, record keys, records as given)]``; refuses a record given twice in the request.

    A batch whose records are all strings of 1-256 characters, or all integers, is checked with
    loops in C (``map``/``set``) instead of a Python test per record; anything else, and any
    refusal, goes through ``_parse_batches_one_by_one``, which names the first bad field."""
    if not isinstance(batches, Sequence) or isinstance(batches, str | bytes) or not batches:
        raise InvalidInput("batches", "must be a non-empty list of {name, records}.")
    if len(batches) > MAX_BATCHES_PER_REQUEST:
        raise InvalidInput(
            "batches", f"must hold at most {MAX_BATCHES_PER_REQUEST} batches. Found {len(batches)}."
        )
    parsed: Parsed = []
    seen: set[str] = set()
    total = 0
    for i, item in enumerate(batches):
        if not isinstance(item, Mapping):
            raise InvalidInput(f"batches[{i}]", f"must be an object {{name, records}}. Found {item!r}.")
        name = check_name(item.get("name"), f"batches[{i}].name")
        records = item.get("records")
        if not isinstance(records, Sequence) or isinstance(records, str | bytes) or not records:
            raise InvalidInput(f"batches[{i}].records", "must be a non-empty list of record ids.")
        total += len(records)
        if total > MAX_RECORDS_PER_REQUEST:
            raise InvalidInput(
                "batches", f"must hold at most {MAX_RECORDS_PER_REQUEST} records in one request."
            )
        kinds = set(map(type, records))
        keys: list[str]
        if kinds == _STR:
            keys = list(records)
            if min(map(len, keys)) < 1 or max(map(len, keys)) > MAX_RECORD_ID_LENGTH:
                return _parse_batches_one_by_one(batches)
            given: list[str | int] = keys  # type: ignore[assignment]
        elif kinds == _INT:
            given = list(records)
            keys = list(map(str, given))
        else:
            return _parse_batches_one_by_one(batches)
        before = len(seen)
        seen.update(keys)
        if len(seen) != before + len(keys):  # a record given twice: name the first
            return _parse_batches_one_by_one(batches)
        parsed.append((name, keys, given))
    return parsed


_STR: Final = frozenset({str})
_INT: Final = frozenset({int})


def _parse_batches_one_by_one(batches: Sequence[Any]) -> Parsed:
    """``_parse_batches`` one record at a time: raises the error naming the first bad field."""
    parsed: Parsed = []
    seen: set[str] = set()
    for i, item in enumerate(batches):
        name = check_name(item.get("name"), f"batches[{i}].name")
        keys: list[str] = []
        given: list[str | int] = []
        for j, record in enumerate(item.get("records")):
            key = record_key(record, i, j)
            as_given = record if isinstance(record, int) else key
            if key in seen:
                raise BatchOverlap(as_given)
            seen.add(key)
            keys.append(key)
            given.append(as_given)
        parsed.append((name, keys, given))
    return parsed


def _unencodable_record(parsed: Parsed) -> InvalidInput:
    """``InvalidInput`` naming the first record id that UTF-8 cannot carry (hashing it failed)."""
    for i, (_, keys, _) in enumerate(parsed):
        for j, key in enumerate(keys):
            if not encodes(key):
                return InvalidInput(f"batches[{i}].records[{j}]", f"{UNENCODABLE} Found {key!r}.")
    return InvalidInput("batches", UNENCODABLE)


def create_batches(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    task_id: str,
    *,
    batches: Sequence[Mapping[str, Any]],
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> BatchesCreated:
    """Create fixed, disjoint batches of a task (201): ``{data: [{id, name, size, task_id,
    created_at}]}``. ``BatchOverlap`` names the first record already in a batch of the dataset."""
    parsed = _parse_batches(batches)
    with db.session(readonly=True) as session:  # the salt never changes: hash outside the lock
        dataset = load_dataset(session, tenant_id, dataset_id)
        salt, dataset_key = dataset.record_salt, dataset.key  # neither ever changes
    try:
        digests = record_hashes(salt, chain.from_iterable(keys for _, keys, _ in parsed))
    except UnicodeEncodeError:  # a lone surrogate: found only now, off the per-record path
        raise _unencodable_record(parsed) from None

    def body(session: Session, at: datetime) -> idempotency.Outcome[BatchesCreated]:
        head = lock_ledger_head(session.connection(), dataset_id)
        if head is None or head.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        refuse_archived(dataset_id, head.archived_at)
        task = _load_task(session, dataset_id, task_id)
        last = session.scalar(select(func.max(Batch.position)).where(Batch.task_id == task_id))
        empty = state_id(dataset_id, _EMPTY_STATE)  # every new batch starts in the empty state
        if session.get(BatchStateRow, empty) is None:
            session.execute(
                insert(BatchStateRow),
                [{"id": empty, "dataset_id": dataset_id, "state": _EMPTY_STATE.to_json(), "created_at": at}],
            )
        # Born compact: into a task with no batches, or compact in the empty state, the new
        # batches take no pointer and the task holds (or keeps) the empty state, so no charge on
        # the whole task ever rewrites them one by one. The empty state holds nothing (every
        # reserve counts a read, ``BatchState.reads``), so no open reservation reads such a task.
        # Into a compact task in another state, its batches take its pointer first; into a task
        # that is not compact, each new batch its own pointer.
        born_compact = task.state_id == empty or (task.state_id is None and last is None)
        if born_compact and task.state_id is None:
            session.connection().execute(SET_TASK_STATE, {"task": task_id, "state": empty})
        elif not born_compact and task.state_id is not None:
            session.connection().execute(MATERIALISE, {"task": task_id, "state": task.state_id})
            session.connection().execute(SET_TASK_STATE, {"task": task_id, "state": None})
        session.expire(task)
        pointer = None if born_compact else empty
        # after the last position (a deleted batch leaves a gap: positions are never reused)
        existing = 0 if last is None else last + 1
        ids = [f"batch_{secrets.token_hex(12)}" for _ in parsed]
        connection = session.connection()
        after = connection.execute(
            _TAKE_BATCH_KEYS, {"dataset": dataset_id, "taken": len(parsed)}
        ).scalar_one()
        batch_keys = range(after - len(parsed), after)
        rows = [
            {
                "id": ids[i],
                "dataset_id": dataset_id,
                "key": batch_keys[i],
                "task_id": task_id,
                "position": existing + i,
                "name": name,
                "size": len(keys),
                "state_id": pointer,
                "created_at": at,
            }
            for i, (name, keys, _) in enumerate(parsed)
        ]
        if connection.dialect.name == "postgresql":  # COPY: a pipelined INSERT took 20 µs a row
            _copy(connection, _COPY_BATCHES, ([row[c] for c in _BATCH_COLUMNS] for row in rows))
        else:
            _insert_batches(connection, rows, at)
        insert_records(connection, dataset_key, batch_keys, [len(keys) for _, keys, _ in parsed], digests)
        created = BatchesCreated(
            tuple(
                CreatedBatch(ids[i], name, len(keys), task_id, at) for i, (name, keys, _) in enumerate(parsed)
            )
        )
        event = audit.AuditEvent(
            "batches.created",
            {
                "task_id": task_id,
                "batches": [{"id": b.id, "name": b.name, "size": b.size} for b in created.data],
            },
            tenant_id=tenant_id,
            dataset_id=dataset_id,
        )
        return idempotency.Outcome(created, [event])

    try:
        return idempotency.execute(
            db,
            tenant_id=tenant_id,
            operation="create_batches",
            # read only to hash a keyed request: 10⁵ dicts not built for an unkeyed one
            request={
                "dataset_id": dataset_id,
                "task_id": task_id,
                "batches": [{"name": n, "records": keys} for n, keys, _ in parsed],
            }
            if idempotency_key is not None
            else {},
            idempotency_key=idempotency_key,
            body=body,
            replay=BatchesCreated.from_json,
            status_code=201,
            now=now,
        )
    except BatchOverlap as exc:
        if exc.record_id is not None:
            raise
        shared = _first_shared_record(db, dataset_key, parsed, digests)
        if shared is None:
            raise
        raise BatchOverlap(shared) from exc


def insert_records(
    connection: Connection,
    dataset_key: int,
    batch_keys: Sequence[int],
    sizes: Sequence[int],
    digests: list[bytes],
) -> None:
    """Insert the ``batch_records`` rows of new batches: ``sizes[i]`` records of the batch keyed
    ``batch_keys[i]``, their hashes ``digests`` in batch order. Sorted by hash first, so the
    primary key (dataset_key, record_hash) is written in order (one descent per leaf, not one per
    record). At the driver level: binary ``COPY`` of (int8, int8, bytea) on PostgreSQL, built in
    C by ``bytes.join``; a prepared ``executemany`` on SQLite. A record already in the dataset
    raises ``BatchOverlap`` (unnamed: ``create_batches`` names it)."""
    # sorting indices by a key compares bytes directly: 2x faster than sorting (hash, id) pairs
    order = sorted(range(len(digests)), key=digests.__getitem__)
    if connection.dialect.name == "postgresql":
        prefixes = [_COPY_PREFIX.pack(3, 8, dataset_key, 8, key, 32) for key in batch_keys]
        owners = list(chain.from_iterable(map(repeat, prefixes, sizes)))
        try:
            _copy_binary(connection, _COPY_RECORDS, order, owners, digests)
        except Exception as exc:  # the driver's own error: COPY runs below SQLAlchemy
            diag = getattr(exc, "diag", None)
            if getattr(diag, "constraint_name", None) == _RECORD_KEY:
                raise BatchOverlap(None) from exc
            raise
        return
    owners = list(chain.from_iterable(map(repeat, batch_keys, sizes)))
    rows = zip(repeat(dataset_key), map(digests.__getitem__, order), map(owners.__getitem__, order))
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(_INSERT_RECORDS, rows)
    except sqlite3.IntegrityError as exc:  # the driver's own error: not wrapped by SQLAlchemy
        if _SQLITE_RECORD_UNIQUE in str(exc):
            raise BatchOverlap(None) from exc
        raise
    finally:
        cursor.close()


def _copy_binary(
    connection: Connection, statement: str, order: list[int], prefixes: list[bytes], digests: list[bytes]
) -> None:
    """``COPY … FROM STDIN (FORMAT BINARY)``: row ``i`` is ``prefixes[i] + digests[i]``, sent in
    the given order, in blocks."""
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    with cursor.copy(statement) as copy:
        copy.write(_PGCOPY_HEADER)
        for start in range(0, len(order), _COPY_BLOCK):
            block = order[start : start + _COPY_BLOCK]
            fields = zip(map(prefixes.__getitem__, block), map(digests.__getitem__, block), strict=True)
            copy.write(b"".join(chain.from_iterable(fields)))
        copy.write(_PGCOPY_TRAILER)


def _insert_batches(connection: Connection, rows: list[dict[str, Any]], at: datetime) -> None:
    """The ``batches`` rows on SQLite, by the driver's ``executemany`` (the Core built and
    processed parameters per row), ``created_at`` converted once for all of them."""
    stamp = Batch.__table__.c.created_at.type.bind_processor(connection.dialect)
    created = stamp(at) if stamp is not None else at
    if isinstance(created, datetime):  # as sqlite3's own adapter writes it, once, not per row
        created = created.isoformat(" ")
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.executemany(
            _INSERT_BATCHES, ([row[c] for c in _BATCH_COLUMNS[:-1]] + [created] for row in rows)
        )
    finally:
        cursor.close()


def _copy(connection: Connection, statement: str, rows: Iterable[Sequence[object]]) -> None:
    """``COPY … FROM STDIN`` of ``rows`` on the transaction's PostgreSQL connection."""
    cursor = connection.connection.driver_connection.cursor()  # type: ignore[union-attr]
    with cursor.copy(statement) as copy:
        for row in rows:
            copy.write_row(row)


_BATCH_COLUMNS: Final = (
    "id",
    "dataset_id",
    "key",
    "task_id",
    "position",
    "name",
    "size",
    "state_id",
    "created_at",
)
# Take a run of batch keys from the (locked) dataset: the keys before the returned value.
_TAKE_BATCH_KEYS: Final = (
    update(Dataset)
    .where(Dataset.id == bindparam("dataset"))
    .values(next_batch_key=Dataset.next_batch_key + bindparam("taken"))
    .returning(Dataset.next_batch_key)
)
_COPY_BATCHES: Final = f"COPY batches ({', '.join(_BATCH_COLUMNS)}) FROM STDIN"
_INSERT_BATCHES: Final = (
    f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) VALUES ({', '.join('?' * len(_BATCH_COLUMNS))})"
)
_INSERT_RECORDS: Final = "INSERT INTO batch_records (dataset_key, record_hash, batch_key) VALUES (?, ?, ?)"
_COPY_RECORDS: Final = "COPY batch_records (dataset_key, batch_key, record_hash) FROM STDIN (FORMAT BINARY)"
_PGCOPY_HEADER: Final = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" * 2  # signature, flags, extension
_PGCOPY_TRAILER: Final = b"\xff\xff"
# A binary COPY tuple of batch_records up to its hash's bytes: 3 fields, (length 8, dataset key),
# (length 8, batch key), the hash's length (32).
_COPY_PREFIX: Final = struct.Struct(">hiqiqi")
_COPY_BLOCK: Final = 65_536
_RECORD_KEY: Final = "pk_batch_records"
_SQLITE_RECORD_UNIQUE: Final = (
    "UNIQUE constraint failed: batch_records.dataset_key, batch_records.record_hash"
)


def _first_shared_record(
    db: Database,
    dataset_key: int,
    parsed: Parsed,
    digests: list[bytes],
) -> str | int | None:
    """The first record (in the client's order, as the client gave it) already in the dataset."""
    given = [record for _, _, records in parsed for record in records]
    with db.session(readonly=True) as session:
        for start in range(0, len(digests), _LOOKUP_CHUNK):
            chunk = digests[start : start + _LOOKUP_CHUNK]
            existing = set(
                session.scalars(
                    select(BatchRecord.record_hash).where(
                        BatchRecord.dataset_key == dataset_key, BatchRecord.record_hash.in_(chunk)
                    )
                )
            )
            for offset, digest in enumerate(chunk):
                if bytes(digest) in existing:
                    return given[start + offset]
    return None


def list_batches(db: Database, tenant_id: str, dataset_id: str, *, task_id: str | None = None) -> BatchesPage:
    """Every batch of the dataset (or of one task) with its spend. Unbounded:
    for the process's own use (tests, tools); the API pages a task's (``task_batches``)."""
    with db.session(readonly=True) as session:
        load_dataset(session, tenant_id, dataset_id)
        stmt = select(Batch, BatchStateRow.state).join(BatchStateRow, BatchStateRow.id == EFFECTIVE_STATE)
        if task_id is None:
            stmt = stmt.where(Batch.dataset_id == dataset_id)
        else:
            _load_task(session, dataset_id, task_id)
            stmt = stmt.where(Batch.task_id == task_id)
        rows = session.execute(stmt.order_by(Batch.created_at, Batch.task_id, Batch.position)).all()
        return BatchesPage(tuple(BatchAnswer.of(b, state) for b, state in rows), len(rows))


def task_batches(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    task_id: str,
    *,
    after: int | None = None,
    limit: int = DEFAULT_BATCH_PAGE,
) -> TaskBatchesPage:
    """A page of a task's batches with their spend, in position order.
    ``after`` is a position (the batches after it; ``None``: from the first); ``next`` the
    ``after`` of the next page (``None``: the last); ``count`` the task's batches. A page is one
    range read of the (task_id, position) index, however many batches the task has (500 000
    batches unpaged: 24.8 s and 143 MB, issue 24 §5)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_BATCH_PAGE:
        raise InvalidInput("limit", f"must be an integer in [1, {MAX_BATCH_PAGE}]. Found {limit!r}.")
    if after is not None and (isinstance(after, bool) or not isinstance(after, int) or after < 0):
        raise InvalidInput("after", f"must be a batch position (an integer >= 0). Found {after!r}.")
    with db.session(readonly=True) as session:
        load_dataset(session, tenant_id, dataset_id)
        _load_task(session, dataset_id, task_id)
        rows = session.execute(
            select(Batch, BatchStateRow.state)
            .join(BatchStateRow, BatchStateRow.id == EFFECTIVE_STATE)
            .where(Batch.task_id == task_id, Batch.position > (-1 if after is None else after))
            .order_by(Batch.position)
            .limit(limit + 1)
        ).all()
        count = session.scalar(select(func.count()).select_from(Batch).where(Batch.task_id == task_id))
    data = tuple(BatchAnswer.of(b, state) for b, state in rows[:limit])
    more = len(rows) > limit
    return TaskBatchesPage(data, int(count or 0), data[-1].position if more else None)


def record_batches(db: Database, dataset_id: str) -> tuple[bytes, dict[bytes, str]]:
    """The dataset's record salt and the batch of each record it holds, by stored record hash
    (HMAC-SHA256 under the salt: ``record_hash``): what a worker compares a source's records
    with. ``NotFound`` for no such dataset."""
    with db.session(readonly=True) as session:
        found = session.execute(
            select(Dataset.record_salt, Dataset.key).where(Dataset.id == dataset_id)
        ).first()
        if found is None:
            raise NotFound("dataset", dataset_id)
        salt, key = found
        batch_ids = dict(
            session.execute(select(Batch.key, Batch.id).where(Batch.dataset_id == dataset_id)).all()
        )
        rows = session.execute(
            select(BatchRecord.record_hash, BatchRecord.batch_key).where(BatchRecord.dataset_key == key)
        ).all()
    return bytes(salt), {bytes(digest): batch_ids[batch_key] for digest, batch_key in rows}


@dataclass(frozen=True, slots=True)
class TaskLayout:
    """A task and its batches ``(id, position, size)`` in position order."""

    id: str
    name: str
    batches: tuple[tuple[str, int, int], ...]


def task_layout(db: Database, dataset_id: str) -> list[TaskLayout]:
    """The dataset's tasks in creation order, each with its batches in position order (two
    reads, however many tasks): what a staged run plans its stages on."""
    with db.session(readonly=True) as session:
        task_rows = session.execute(
            select(Task.id, Task.name).where(Task.dataset_id == dataset_id).order_by(Task.created_at, Task.id)
        ).all()
        batch_rows = session.execute(
            select(Batch.id, Batch.task_id, Batch.position, Batch.size)
            .where(Batch.dataset_id == dataset_id)
            .order_by(Batch.task_id, Batch.position)
        ).all()
    by_task: dict[str, list[tuple[str, int, int]]] = {}
    for b in batch_rows:
        by_task.setdefault(b.task_id, []).append((b.id, b.position, b.size))
    return [TaskLayout(t.id, t.name, tuple(by_task.get(t.id, ()))) for t in task_rows]


def count_records(db: Database, dataset_id: str) -> int:
    with db.session(readonly=True) as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(BatchRecord)
                .join(Dataset, Dataset.key == BatchRecord.dataset_key)
                .where(Dataset.id == dataset_id)
            )
            or 0
        )


__all__ = [
    "DEFAULT_BATCH_PAGE",
    "DEFAULT_TASK_PAGE",
    "MAX_BATCH_PAGE",
    "MAX_RECORD_ID_LENGTH",
    "MAX_TASKS_PER_DATASET",
    "MAX_TASK_PAGE",
    "BatchAnswer",
    "BatchDeleted",
    "BatchesCreated",
    "BatchesPage",
    "CreatedBatch",
    "StoredSpend",
    "TaskAnswer",
    "TaskBatchesPage",
    "TaskDeleted",
    "TaskLayout",
    "TasksPage",
    "count_records",
    "create_batches",
    "create_task",
    "delete_batch",
    "delete_task",
    "list_batches",
    "list_tasks",
    "record_batches",
    "record_hash",
    "record_key",
    "task_batches",
    "task_layout",
]
