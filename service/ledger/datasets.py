"""Datasets and their budgets.

A dataset is created with a budget ``{rule, epsilon, delta, accountant, geometric?: {first,
ratio}, orders?, plan?: [events]}``, validated by ``accountant.rules.Budget.create`` (a sequential
dataset on ``prv`` must declare its ``plan`` of events here; its PRV ε is computed once, now, and
stored with the budget; ``plan_delta`` prices it at a share of δ, leaving the rest for later plan
segments, ``service.ledger.plan_segments``). The budget changes afterwards only by growing
segments, counted in ``datasets.plan_segments``, so parsed budgets are cached per dataset id and
read again when the count moves (``cached_budget``).

A dataset owns its data source (``data_source``: the URI the worker reads its records from,
``builtin:…`` or a ``file://`` path under the tenant's data roots; DESIGN-NOTES 8), set by an
admin when the dataset is created or later (``set_data_source``), checked against the data roots
(``service.contract.data_roots.check_source``) before it is stored, and audited in the dataset's chain.
A job never names a source: the worker reads the dataset's.

An admin archives a dataset (``archive``; issue 28 §7) instead of deleting it: its audit chain
is its history, and its certificates must keep verifying. Any dataset may be archived, charged or
not (a retired one): archiving only refuses — new reservations, plan segments, jobs, quotes,
tasks and batches get 409 ``dataset_archived`` (``refuse_archived``) — and never frees or
changes budget, spend or certificates; ``unarchive`` makes it active again exactly as it was.
It is refused while a reservation is open or a job is queued or running (409
``dataset_in_use``), so no admitted work is stranded. Both are audited (``dataset.archived``,
``dataset.unarchived``); a repeat changes nothing and appends nothing. The default list hides
archived datasets (``archived="false"``; ``"true"``: only them; ``"all"``).

Answers are typed (issue 29 §1): a ``DatasetAnswer`` (its ``budget`` the stored budget document,
its ``warnings`` ``DeltaWarning``s, datetimes) and a ``DatasetsPage`` of them, each with one
``to_json``, the wire form ``{id, name, budget, data_source, records, warnings, archived_at,
created_at}`` with the budget's numbers as decimal strings (``Budget.to_json``);
``data_source`` is ``null`` until an admin sets one, ``archived_at`` while it is active. An
idempotent replay is ``DatasetAnswer.from_json`` of the stored answer, whose wire form stays that
stored JSON.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import false, func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from accountant import events as ev
from accountant.errors import AccountantError, InvalidArgumentError, UnsupportedEventError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import to_text
from accountant.rules import Budget
from service.contract.data_roots import DataRoots, check_source
from service.contract.data_sources import DataSourceError
from service.db.models import DATA_SOURCE_LENGTH, Batch, Dataset, Job
from service.db.session import Database, lock_ledger_head
from service.ledger import audit, idempotency
from service.ledger.errors import Conflict, InvalidInput, NotFound

MAX_NAME_LENGTH: Final = 200
MAX_PAGE: Final = 1000
_BUDGET_KEYS: Final = frozenset(
    {"rule", "epsilon", "delta", "accountant", "geometric", "orders", "plan", "plan_delta"}
)
_CACHE_SIZE: Final = 4096


# C0 control characters (U+0000-U+001F, tab included) and DEL. PostgreSQL refuses NUL in text
# and jsonb alike (a 500, after which a commit's reservation stayed open), SQLite stores it; the
# others would let a name forge lines in logs, exports and the dashboard. Refused in every name,
# model and version a client sends, on both databases, before anything is read or locked.
CONTROL_CHARACTERS: Final = frozenset(map(chr, [*range(0x20), 0x7F]))


def check_text(value: str, field: str) -> str:
    """``value``, or ``InvalidInput`` naming ``field`` when it holds a control character or a
    lone surrogate (JSON's ``"\\ud800"``: no database stores it, so it was a 500)."""
    if not CONTROL_CHARACTERS.isdisjoint(value):
        bad = next(c for c in value if c in CONTROL_CHARACTERS)
        raise InvalidInput(
            field,
            f"must not contain control characters (U+0000-U+001F, U+007F). Found {bad!r} in {value!r}.",
        )
    if not encodes(value):
        raise InvalidInput(field, f"{UNENCODABLE} Found {value!r}.")
    return value


UNENCODABLE: Final = "must be Unicode text: a lone surrogate (U+D800-U+DFFF) cannot be stored."


def encodes(value: str) -> bool:
    """Whether ``value`` can be written as UTF-8 (what both databases store)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


MAX_ID_LENGTH: Final = 64


def can_be_id(value: object) -> bool:
    """Whether ``value`` could be an id this ledger made (``ds_<hex>``, ``res_<hex>``, ...).

    What cannot be one is "not found" without a query: a NUL in a query parameter is an error
    on PostgreSQL (a 500), not an unknown id."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_ID_LENGTH
        and CONTROL_CHARACTERS.isdisjoint(value)
        and encodes(value)
    )


def check_name(value: object, field: str = "name") -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME_LENGTH:
        raise InvalidInput(
            field, f"must be a non-empty string of at most {MAX_NAME_LENGTH} characters. Found {value!r}."
        )
    return check_text(value, field)


def parse_budget(obj: object) -> Budget:
    """The ``Budget`` for a request's ``budget`` object; ``InvalidInput`` names the bad field."""
    if not isinstance(obj, Mapping):
        raise InvalidInput("budget", f"must be an object. Found {obj!r}.")
    unknown = sorted(set(obj) - _BUDGET_KEYS)
    if unknown:
        raise InvalidInput(
            f"budget.{unknown[0]}", f"is not a budget field (allowed: {sorted(_BUDGET_KEYS)})."
        )
    for name in ("rule", "epsilon", "delta", "accountant"):
        if name not in obj:
            raise InvalidInput(f"budget.{name}", "is required.")
    plan: list[DpEvent] | None = None
    if obj.get("plan") is not None:
        items = obj["plan"]
        if not isinstance(items, list):
            raise InvalidInput("budget.plan", f"must be a list of events. Found {items!r}.")
        try:
            plan = [ev.from_json(item, f"budget.plan[{i}]", new=True) for i, item in enumerate(items)]
        except EventValidationError as exc:
            raise InvalidInput(exc.field, exc.message) from None
    orders = obj.get("orders")
    try:
        return Budget.create(
            rule=obj["rule"],
            epsilon=obj["epsilon"],
            delta=obj["delta"],
            accountant=obj["accountant"],
            geometric=obj.get("geometric"),
            orders=orders,
            plan=plan,
            plan_delta=obj.get("plan_delta"),
        )
    except InvalidArgumentError as exc:
        raise InvalidInput(exc.field, exc.message) from None
    except UnsupportedEventError as exc:
        raise InvalidInput("budget.plan", str(exc)) from None
    except (AccountantError, TypeError, ValueError) as exc:
        raise InvalidInput("budget", str(exc)) from None


class _BudgetCache:
    """Parsed budgets by dataset id. A budget changes only by growing plan segments
    (``Budget.with_segment``), so an entry is current iff it lists as many segments as the
    dataset row's ``plan_segments`` says; a caller that read that count passes it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, Budget] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, dataset_id: str, load: Callable[[], Any], segments: int | None = None) -> Budget:
        with self._lock:
            budget = self._items.get(dataset_id)
            if budget is not None and (segments is None or len(budget.segments) == segments):
                self._items.move_to_end(dataset_id)
                return budget
        budget = Budget.from_json(load())
        with self._lock:
            self._items[dataset_id] = budget
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return budget


_budgets: Final = _BudgetCache(_CACHE_SIZE)


def budget_of(dataset: Dataset) -> Budget:
    """The dataset's parsed budget (cached; read again when the row lists more plan segments)."""
    return _budgets.get(dataset.id, lambda: dataset.budget, dataset.plan_segments)


def cached_budget(dataset_id: str, load: Callable[[], Any], *, segments: int | None = None) -> Budget:
    """The parsed budget of ``dataset_id``; ``load()`` returns its stored JSON on a cache miss,
    or when the cached one does not list ``segments`` plan segments (the count just read)."""
    return _budgets.get(dataset_id, load, segments)


@dataclass(frozen=True, slots=True)
class DeltaWarning:
    """What a dataset's answer warns of (``delta_warnings``): a ``code``, the ``field`` it is
    about and a ``message`` that says why."""

    code: str
    field: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "field": self.field, "message": self.message}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DeltaWarning:
        return cls(obj["code"], obj["field"], obj["message"])


def delta_warnings(budget: Mapping[str, Any], records: int) -> tuple[DeltaWarning, ...]:
    """What the dataset's answer warns of (issue 28 §5): a δ of at least 1/N for the N records
    registered. (ε, δ)-DP with δ ≥ 1/N allows a mechanism that publishes one record in the clear
    with probability δ — about δ·N records of N — and still meets the definition (Dwork & Roth
    2014, §2.3: δ should be much smaller than 1/N). A warning, not a refusal: records are
    registered after the budget is set, and the number grows."""
    delta = Decimal(str(budget.get("delta", "0")))
    if records <= 0 or delta <= 0 or delta * records < 1:
        return ()
    return (
        DeltaWarning(
            "delta_not_below_one_over_n",
            "budget.delta",
            f"budget delta {to_text(delta)} is at least 1/N for the {records} records registered "
            f"(1/N = {to_text(Decimal(1) / Decimal(records))}): a mechanism that publishes about "
            f"delta*N = {to_text(delta * records)} records in the clear meets this guarantee. Use a "
            "delta well below 1/N (a common choice: below 1/N^1.1, or 1e-5 for tens of thousands).",
        ),
    )


@dataclass(frozen=True, slots=True)
class DatasetAnswer:
    """A dataset as the ledger answers it: ``budget`` is its stored budget document (decimal
    strings, as ``Budget.to_json`` wrote it; ``budget_of`` parses it), ``records`` how many
    records its batches hold, ``archived_at`` ``None`` while it is active."""

    id: str
    name: str
    budget: Mapping[str, Any]
    data_source: str | None
    records: int
    warnings: tuple[DeltaWarning, ...]
    archived_at: datetime | None
    created_at: datetime
    _wire: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, row: Dataset, records: int) -> DatasetAnswer:
        """The answer for ``row``; ``records``: how many records its batches hold (``records_of``)."""
        return cls(
            row.id,
            row.name,
            row.budget,
            row.data_source,
            records,
            delta_warnings(row.budget, records),
            row.archived_at,
            row.created_at,
        )

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DatasetAnswer:
        """The dataset of an answer this ledger gave (a stored idempotent answer); its wire form
        is that answer as stored (an older server's lacks the fields it did not have yet: their
        defaults are the schema's)."""
        archived_at = obj.get("archived_at")
        return cls(
            obj["id"],
            obj["name"],
            obj["budget"],
            obj.get("data_source"),
            obj.get("records", 0),
            tuple(DeltaWarning.from_json(w) for w in obj.get("warnings", ())),
            None if archived_at is None else datetime.fromisoformat(archived_at),
            datetime.fromisoformat(obj["created_at"]),
            dict(obj),
        )

    def to_json(self) -> dict[str, Any]:
        if self._wire is not None:
            return self._wire
        return {
            "id": self.id,
            "name": self.name,
            "budget": self.budget,
            "data_source": self.data_source,
            "records": self.records,
            "warnings": [w.to_json() for w in self.warnings],
            "archived_at": None if self.archived_at is None else self.archived_at.isoformat(),
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class DatasetsPage:
    """A page of the tenant's datasets (``list_datasets``) and how many match in all."""

    data: tuple[DatasetAnswer, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [d.to_json() for d in self.data], "count": self.count}


def records_of(session: Session, dataset_ids: Sequence[str]) -> dict[str, int]:
    """Records registered per dataset (the sum of its batches' sizes), one grouped read."""
    if not dataset_ids:
        return {}
    rows = session.execute(
        select(Batch.dataset_id, func.sum(Batch.size))
        .where(Batch.dataset_id.in_(list(dataset_ids)))
        .group_by(Batch.dataset_id)
    )
    return {dataset_id: int(total or 0) for dataset_id, total in rows}


def check_data_source(value: object, tenant_id: str, data_roots: DataRoots | None) -> str | None:
    """The form to store of ``value`` (``DataSource.canonical``: one string per file) if it may be
    the tenant's dataset's source now, else ``InvalidInput`` naming ``data_source``: its syntax,
    and for a file the data-root checks (``service.contract.data_roots``), made without
    opening the file. ``None`` (no source) is allowed."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > DATA_SOURCE_LENGTH:
        raise InvalidInput(
            "data_source", f"must be a URI string of at most {DATA_SOURCE_LENGTH} characters or null."
        )
    roots = (data_roots or DataRoots()).for_tenant(tenant_id)
    try:
        return check_source(value, roots).canonical
    except DataSourceError as exc:
        raise InvalidInput("data_source", f"is refused: {exc}") from None


def refuse_archived(dataset_id: str, archived_at: datetime | None) -> None:
    """``Conflict`` ``dataset_archived`` naming the dataset if it is archived: it takes no new
    work (its ledger, certificates and audit chain stay readable and verifiable)."""
    if archived_at is not None:
        raise Conflict(
            f"dataset {dataset_id!r} is archived (since {archived_at.isoformat()}): it takes no new "
            "reservations, jobs, quotes, plan segments, tasks or batches. An admin may unarchive it "
            f"(POST /v1/datasets/{dataset_id}/unarchive).",
            reason="dataset_archived",
            dataset_id=dataset_id,
        )


def load_dataset(session: Session, tenant_id: str, dataset_id: str) -> Dataset:
    """The tenant's dataset, or ``NotFound`` (another tenant's dataset is not found either)."""
    row = session.get(Dataset, dataset_id) if can_be_id(dataset_id) else None
    if row is None or row.tenant_id != tenant_id:
        raise NotFound("dataset", dataset_id)
    return row


def create_dataset(
    db: Database,
    tenant_id: str,
    *,
    name: str,
    budget: Mapping[str, Any],
    data_source: str | None = None,
    data_roots: DataRoots | None = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> DatasetAnswer:
    """Create a dataset with its budget and, optionally, its data source (201), checked against
    ``data_roots`` (the operator's ``LEDGER_DATA_ROOTS``; none: only ``builtin:`` sources).
    ``InvalidInput`` names a bad field."""
    check_name(name)
    parsed = parse_budget(budget)
    document = parsed.to_json()
    source = check_data_source(data_source, tenant_id, data_roots)

    def body(session: Session, at: datetime) -> idempotency.Outcome[DatasetAnswer]:
        taken = session.scalar(select(Dataset.id).where(Dataset.tenant_id == tenant_id, Dataset.name == name))
        if taken is not None:
            raise Conflict(
                f"dataset {taken!r} of this tenant is named {name!r} already: a name stands for one "
                "dataset (it may be used where an id is). Choose another name.",
                reason="dataset_name_taken",
                field="name",
                dataset_id=taken,
            )
        row = Dataset(
            id=f"ds_{secrets.token_hex(12)}",
            tenant_id=tenant_id,
            name=name,
            rule=parsed.rule,
            accountant=parsed.accountant,
            budget=document,
            epsilon_budget=parsed.epsilon,
            delta_budget=parsed.delta,
            record_salt=secrets.token_bytes(32),
            data_source=source,
            created_at=at,
            updated_at=at,
        )
        session.add(row)
        session.flush()
        payload: dict[str, Any] = {"name": name, "budget": document}
        if source is not None:  # (entries of datasets without one keep their old shape)
            payload["data_source"] = source
        event = audit.AuditEvent("dataset.created", payload, tenant_id=tenant_id, dataset_id=row.id)
        return idempotency.Outcome(DatasetAnswer.of(row, 0), [event])

    request: dict[str, Any] = {"name": name, "budget": dict(budget)}
    if source is not None:
        request["data_source"] = source
    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="create_dataset",
        request=request,
        idempotency_key=idempotency_key,
        body=body,
        replay=DatasetAnswer.from_json,
        status_code=201,
        now=now,
    )


def set_data_source(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    data_source: str | None,
    data_roots: DataRoots | None = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> DatasetAnswer:
    """Set, replace or (``None``) remove the dataset's data source (an admin's call); the dataset.

    The source is checked against ``data_roots`` first, outside the transaction (the worker
    checks it again when it reads). A change appends ``dataset.data_source_set`` with the old and
    the new source to the dataset's audit chain; setting the source it already has changes
    nothing and appends nothing, so a repeated call is idempotent even without a key.
    """
    source = check_data_source(data_source, tenant_id, data_roots)
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)

    def body(session: Session, at: datetime) -> idempotency.Outcome[DatasetAnswer]:
        statement = select(Dataset).where(Dataset.id == dataset_id, Dataset.tenant_id == tenant_id)
        if session.get_bind().dialect.name != "sqlite":  # (SQLite: BEGIN IMMEDIATE already)
            statement = statement.with_for_update()  # "previous" is the value this replaces
        row = session.scalars(statement).one_or_none()
        if row is None:
            raise NotFound("dataset", dataset_id)
        previous = row.data_source
        records = records_of(session, [row.id]).get(row.id, 0)
        if previous == source:
            return idempotency.Outcome(DatasetAnswer.of(row, records))
        row.data_source = source
        row.updated_at = at
        session.flush()
        event = audit.AuditEvent(
            "dataset.data_source_set",
            {"data_source": source, "previous": previous},
            tenant_id=tenant_id,
            dataset_id=dataset_id,
        )
        return idempotency.Outcome(DatasetAnswer.of(row, records), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="set_data_source",
        request={"dataset_id": dataset_id, "data_source": source},
        idempotency_key=idempotency_key,
        body=body,
        replay=DatasetAnswer.from_json,
        now=now,
    )


def set_archived(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    archived: bool,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> DatasetAnswer:
    """Archive (``archived=True``) or unarchive the dataset (an admin's call); the dataset.

    Decided on the locked ledger head, so it is ordered with every reservation: refused
    (``Conflict`` ``dataset_in_use``) while a reservation of the dataset is open or a job is
    queued or running. A change appends ``dataset.archived`` / ``dataset.unarchived`` to the
    dataset's audit chain; asking for the state it is in changes nothing and appends nothing.
    Budget, spend, certificates and batches are never touched."""
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)

    def body(session: Session, at: datetime) -> idempotency.Outcome[DatasetAnswer]:
        head = lock_ledger_head(session.connection(), dataset_id)
        if head is None or head.tenant_id != tenant_id:
            raise NotFound("dataset", dataset_id)
        row = session.get(Dataset, dataset_id)
        assert row is not None
        records = records_of(session, [row.id]).get(row.id, 0)
        if (row.archived_at is not None) == archived:
            return idempotency.Outcome(DatasetAnswer.of(row, records))
        if head.reservations_open > 0:
            raise Conflict(
                f"dataset {dataset_id!r} has {head.reservations_open} open reservation(s); commit, "
                "abort or let them expire first.",
                reason="dataset_in_use",
            )
        refuse_while_a_job_runs(session, dataset_id, "wait for it to finish (or cancel it)")
        row.archived_at = at if archived else None
        row.updated_at = at
        session.flush()
        kind = "dataset.archived" if archived else "dataset.unarchived"
        event = audit.AuditEvent(kind, {"name": row.name}, tenant_id=tenant_id, dataset_id=dataset_id)
        return idempotency.Outcome(DatasetAnswer.of(row, records), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="archive_dataset" if archived else "unarchive_dataset",
        request={"dataset_id": dataset_id},
        idempotency_key=idempotency_key,
        body=body,
        replay=DatasetAnswer.from_json,
        now=now,
    )


def data_source(db: Database, tenant_id: str, dataset_id: str) -> str | None:
    """The dataset's own data source, read now (``None``: none set, or no such dataset of the
    tenant)."""
    with db.session(readonly=True) as session:
        return session.scalar(
            select(Dataset.data_source).where(Dataset.id == dataset_id, Dataset.tenant_id == tenant_id)
        )


def check_page(limit: int, offset: int, most: int = MAX_PAGE) -> None:
    """``InvalidInput`` naming ``limit`` unless it is in [1, most], ``offset`` unless it is >= 0."""
    if not 1 <= limit <= most:
        raise InvalidInput("limit", f"must be in [1, {most}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")


def dataset_page(
    session: Session, where: Sequence[ColumnElement[bool]], *, limit: int, offset: int
) -> tuple[Sequence[Dataset], int]:
    """A page of the datasets ``where`` selects, oldest first, and how many it selects in all: the
    one page query of the dataset list (``list_datasets``) and the dashboard's spend summaries
    (``views.spend_summaries``)."""
    rows = session.scalars(
        select(Dataset).where(*where).order_by(Dataset.created_at, Dataset.id).limit(limit).offset(offset)
    ).all()
    count = session.scalar(select(func.count()).select_from(Dataset).where(*where))
    return rows, count or 0


def get_dataset(db: Database, tenant_id: str, dataset_id: str) -> DatasetAnswer:
    with db.session(readonly=True) as session:
        row = load_dataset(session, tenant_id, dataset_id)
        return DatasetAnswer.of(row, records_of(session, [row.id]).get(row.id, 0))


ARCHIVED_FILTERS: Final = ("false", "true", "all")


def list_datasets(
    db: Database,
    tenant_id: str,
    *,
    limit: int = 100,
    offset: int = 0,
    name: str | None = None,
    archived: str = "false",
) -> DatasetsPage:
    """The tenant's datasets, oldest first: ``{data, count}`` (``count``: all that match);
    ``archived``: ``"false"`` the active ones, ``"true"`` the archived ones, ``"all"`` both. With
    ``name``, only the one of that name (names are unique per tenant), archived or not: a name
    still stands for its dataset."""
    if archived not in ARCHIVED_FILTERS:
        raise InvalidInput("archived", f"must be one of {list(ARCHIVED_FILTERS)}. Found {archived!r}.")
    check_page(limit, offset)
    where: list[ColumnElement[bool]] = [Dataset.tenant_id == tenant_id]
    if name is not None:
        try:
            check_text(name, "name")  # (PostgreSQL refuses NUL in a query)
        except InvalidInput:  # no dataset has such a name (names refuse control characters)
            where.append(false())
        else:
            where.append(Dataset.name == name)
    elif archived != "all":
        where.append(
            Dataset.archived_at.is_(None) if archived == "false" else Dataset.archived_at.is_not(None)
        )
    with db.session(readonly=True) as session:
        rows, count = dataset_page(session, where, limit=limit, offset=offset)
        records = records_of(session, [r.id for r in rows])
        return DatasetsPage(tuple(DatasetAnswer.of(r, records.get(r.id, 0)) for r in rows), count)


def refuse_while_a_job_runs(session: Session, dataset_id: str, then: str) -> None:
    """409 ``dataset_in_use`` while a job of the dataset is queued or running (its plan reads every
    batch): deleting a task or batch, or archiving the dataset, waits for it; ``then`` says what
    the caller may do."""
    job = session.scalar(
        select(Job.id).where(Job.dataset_id == dataset_id, Job.status.in_(("queued", "running"))).limit(1)
    )
    if job is not None:
        raise Conflict(
            f"job {job!r} of dataset {dataset_id!r} is queued or running and reads every batch; {then}.",
            reason="dataset_in_use",
            job_id=job,
        )


__all__ = [
    "ARCHIVED_FILTERS",
    "MAX_ID_LENGTH",
    "MAX_PAGE",
    "UNENCODABLE",
    "DatasetAnswer",
    "DatasetsPage",
    "DeltaWarning",
    "budget_of",
    "cached_budget",
    "can_be_id",
    "check_data_source",
    "check_name",
    "check_page",
    "check_text",
    "create_dataset",
    "data_source",
    "dataset_page",
    "delta_warnings",
    "encodes",
    "get_dataset",
    "list_datasets",
    "load_dataset",
    "parse_budget",
    "records_of",
    "refuse_archived",
    "refuse_while_a_job_runs",
    "set_archived",
    "set_data_source",
]
