"""Engines, sessions, the spend transaction, and the one place database errors become domain errors.

``Database(url)`` owns an engine and hands out sessions, each one transaction:

* **SQLite** (the embedded default): WAL journal (readers never block the writer), foreign keys
  on, a busy timeout so concurrent writers queue instead of failing, and ``BEGIN IMMEDIATE`` for
  every write transaction — the write lock is taken at ``BEGIN``, so two spend transactions can
  never both read a batch's state before either writes it. Python's ``sqlite3`` module would
  otherwise issue its own deferred ``BEGIN`` lazily; the pysqlite event hooks take that job over
  (SQLAlchemy's documented recipe). Read-only sessions use a deferred ``BEGIN``.
* **PostgreSQL**: READ COMMITTED; a spend transaction takes ``SELECT … FOR UPDATE`` on the
  dataset's row, the *ledger head* (``lock_ledger_head``), so spends on one dataset are
  serialised while other datasets proceed. A transaction locks at most one ledger head (and
  tenant/key events the global audit head, never together with a ledger head), so spends cannot
  deadlock.

Integrity errors are translated here and nowhere else: a violation of a named unique constraint
becomes the domain error registered for that name in ``CONSTRAINT_ERRORS`` (by ``service.ledger``,
which owns the errors: this layer imports nothing above it), raised ``from exc``.
SQLite reports the table and columns instead of the name; ``constraint_name`` maps them back
through the models' metadata.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import (
    Connection,
    Engine,
    PrimaryKeyConstraint,
    UniqueConstraint,
    bindparam,
    create_engine,
    event,
    select,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import Pool

from accountant import canonical
from service.db.models import Base, Dataset

DEFAULT_BUSY_TIMEOUT_S: Final = 60.0


def canonical_json(value: Any) -> str:
    """The stored form of every document: ``accountant.canonical`` JSON, refusing Decimals."""
    return canonical.canonical_json(value, default=_default)


def _default(value: Any) -> Any:
    if isinstance(value, Decimal):
        raise TypeError(
            f"a Decimal ({value}) reached a JSON document; store it as text (accountant.exact.to_text)"
        )
    raise TypeError(f"{type(value).__name__} is not JSON serialisable: {value!r}")


def create_ledger_engine(
    url: str | URL,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    pool_timeout_s: float = 60.0,
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    poolclass: type[Pool] | None = None,
    echo: bool = False,
) -> Engine:
    """An engine configured as the module docstring says, for ``url``."""
    url = make_url(url)
    kwargs: dict[str, Any] = {"json_serializer": canonical_json, "echo": echo}
    if poolclass is not None:
        kwargs["poolclass"] = poolclass
    if url.get_backend_name() == "sqlite":
        if url.database in (None, "", ":memory:"):
            raise ValueError(
                "an in-memory SQLite database cannot be shared between connections; "
                "use a file (sqlite:///path/to/ledger.db)"
            )
        kwargs["connect_args"] = {"timeout": busy_timeout_s, "check_same_thread": False}
        if poolclass is None:
            kwargs.update(pool_size=pool_size, max_overflow=max_overflow, pool_timeout=pool_timeout_s)
        engine = create_engine(url, **kwargs)
        _install_sqlite_hooks(engine, busy_timeout_s)
        return engine
    if poolclass is None:
        kwargs.update(
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout_s,
            pool_pre_ping=True,
        )
    return create_engine(url, **kwargs)


SQLITE_CACHE_KIB: Final = 65_536


def _install_sqlite_hooks(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN away from the sqlite3 module; ``_on_begin`` emits it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            # A page cache of up to 64 MiB per connection (SQLite's default is 2 MiB): a charge
            # or a batch creation over 10⁵-10⁶ batches walks indexes larger than the default
            # (creation 30% faster at 2·10⁶ records, bench/scale.py).
            cursor.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")


# ---------------------------------------------------------------------------------------------
# Error translation
# ---------------------------------------------------------------------------------------------

CONSTRAINT_ERRORS: Final[dict[str, Callable[[], Exception]]] = {}
"""The domain error of each named unique constraint, by name: registered by the layer that owns
the errors (``service.ledger`` registers ``service.ledger.errors.CONSTRAINT_ERRORS`` when it is
imported), so that the database layer imports nothing above it."""


def register_constraint_errors(errors: Mapping[str, Callable[[], Exception]]) -> None:
    """Translate a violation of each named constraint of ``errors`` into its domain error."""
    CONSTRAINT_ERRORS.update(errors)


def _columns_to_constraint() -> dict[tuple[str, tuple[str, ...]], str]:
    out: dict[tuple[str, tuple[str, ...]], str] = {}
    for table in Base.metadata.tables.values():
        for constraint in table.constraints:
            if isinstance(constraint, UniqueConstraint | PrimaryKeyConstraint) and isinstance(
                constraint.name, str
            ):
                out[(table.name, tuple(c.name for c in constraint.columns))] = constraint.name
    return out


_BY_COLUMNS: Final = _columns_to_constraint()
_SQLITE_UNIQUE: Final = re.compile(r"UNIQUE constraint failed: (.+)$")


def constraint_name(exc: IntegrityError) -> str | None:
    """The name of the violated constraint, from PostgreSQL's diagnostics or SQLite's message."""
    diag = getattr(exc.orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    if isinstance(name, str):
        return name
    match = _SQLITE_UNIQUE.search(str(exc.orig))
    if match is None:
        return None
    qualified = [part.strip() for part in match.group(1).split(",")]
    tables = {part.split(".", 1)[0] for part in qualified}
    if len(tables) != 1:
        return None
    columns = tuple(part.split(".", 1)[1] for part in qualified)
    return _BY_COLUMNS.get((tables.pop(), columns))


def translate_integrity_error(exc: IntegrityError) -> Exception | None:
    """The domain error for ``exc``, or ``None`` when no named constraint explains it."""
    name = constraint_name(exc)
    factory = CONSTRAINT_ERRORS.get(name) if name is not None else None
    return factory() if factory is not None else None


@contextmanager
def _domain_errors() -> Iterator[None]:
    """Integrity errors on named constraints leave the block as domain errors."""
    try:
        yield
    except IntegrityError as exc:
        translated = translate_integrity_error(exc)
        if translated is None:
            raise
        raise translated from exc


# ---------------------------------------------------------------------------------------------
# Database
# ---------------------------------------------------------------------------------------------


class Database:
    """One database: an engine and its sessions. Thread-safe; share one per process."""

    def __init__(
        self,
        url: str | URL,
        *,
        pool_size: int = 10,
        max_overflow: int = 10,
        pool_timeout_s: float = 60.0,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        echo: bool = False,
    ) -> None:
        self.url = make_url(url)
        self.engine = create_ledger_engine(
            self.url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout_s=pool_timeout_s,
            busy_timeout_s=busy_timeout_s,
            echo=echo,
        )
        self.dialect: str = self.engine.dialect.name
        self._write = sessionmaker(self.engine, expire_on_commit=False, autoflush=False)
        self._read = sessionmaker(
            self.engine.execution_options(sqlite_begin="DEFERRED"),
            expire_on_commit=False,
            autoflush=False,
        )
        # PostgreSQL: single-statement reads outside a transaction (``read_all``).
        self._autocommit = (
            self.engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.dialect == "postgresql"
            else None
        )

    @property
    def is_postgresql(self) -> bool:
        return self.dialect == "postgresql"

    @contextmanager
    def session(self, *, readonly: bool = False) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on any exception.

        A write session on SQLite begins with ``BEGIN IMMEDIATE``. Integrity errors on named
        constraints leave as domain errors (``translate_integrity_error``).
        """
        session = (self._read if readonly else self._write)()
        try:
            with _domain_errors():
                try:
                    yield session
                    if not readonly:  # a read-only transaction ends with close(), keeping loaded rows
                        session.commit()
                except BaseException:
                    session.rollback()
                    raise
        finally:
            session.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One write transaction on a Core connection, without an ORM session (the spend
        transactions, which read and write through Core statements only): committed when the
        block ends, rolled back on any exception. As ``session``: ``BEGIN IMMEDIATE`` on SQLite,
        integrity errors on named constraints leave as domain errors."""
        with _domain_errors(), self.engine.connect() as connection, connection.begin():
            yield connection

    def read_all(self, statement: Any, parameters: dict[str, Any] | None = None) -> list[Any]:
        """The rows ``statement`` selects: a single-statement read.

        PostgreSQL: on an ``AUTOCOMMIT`` connection, so the statement is its own transaction and
        costs one round trip (a read-only session would add ``BEGIN`` and ``ROLLBACK``); it sees
        what was committed before it started, exactly as the first statement of a READ COMMITTED
        transaction would. SQLite: a read-only session (no network to save).
        """
        if self._autocommit is not None:
            with self._autocommit.connect() as connection:
                return list(connection.execute(statement, parameters).all())
        with self.session(readonly=True) as session:
            return list(session.execute(statement, parameters).all())

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def pipelined(connection: Connection) -> Iterator[None]:
    """Send the writes executed in the block together, in one round trip.

    PostgreSQL: psycopg's pipeline mode; each statement is queued and the block's end waits for
    all of them, so a spend transaction's writes cost one round trip instead of one each. Only
    writes belong here (a read needs its rows at once). An error raised by a queued statement
    leaves the block as SQLAlchemy's exception for it (``IntegrityError`` with the violated
    constraint, so ``translate_integrity_error`` applies). SQLite: no network, nothing to do.
    """
    if connection.dialect.name != "postgresql":
        yield
        return
    dbapi_error = connection.dialect.loaded_dbapi.Error
    driver = connection.connection.driver_connection
    assert driver is not None  # a connection in a transaction has its DBAPI connection
    try:
        with driver.pipeline():
            yield
    except dbapi_error as exc:
        if connection.dialect.is_disconnect(exc, driver, None):
            connection.invalidate(exc)
        raise DBAPIError.instance(None, None, exc, dbapi_error, dialect=connection.dialect) from exc


LEDGER_HEAD_COLUMNS: Final = (
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
    Dataset.plan_segments,
    Dataset.archived_at,
)
_HEAD: Final = select(*LEDGER_HEAD_COLUMNS).where(Dataset.id == bindparam("dataset_id"))
_HEAD_FOR_UPDATE: Final = _HEAD.with_for_update()


def lock_ledger_head(connection: Connection, dataset_id: str) -> Any:
    """Lock the dataset's row, the ledger head of every write to the dataset's ledger, and read
    its aggregates (a row of ``LEDGER_HEAD_COLUMNS``; ``None``: no such dataset). The one way to lock it:
    spends (``service.ledger.spending.store.Work.open``) and batch creation use it alike.

    PostgreSQL: ``SELECT … FOR UPDATE``; concurrent spends on the dataset wait here. SQLite: the
    write transaction already holds the database's write lock (``BEGIN IMMEDIATE``).
    """
    statement = _HEAD if connection.dialect.name == "sqlite" else _HEAD_FOR_UPDATE
    return connection.execute(statement, {"dataset_id": dataset_id}).one_or_none()


# SQLSTATEs of errors a later transaction does not repeat: serialization failure, deadlock
# (the transaction was rolled back), the backend terminated or the server shutting down or not
# yet up (class 57P), and the connection classes (08xxx).
_TRANSIENT_SQLSTATES: Final = frozenset({"40001", "40P01", "57P01", "57P02", "57P03"})


def is_transient_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a database error that a later
    transaction, on a new connection, is expected not to meet: a terminated or lost connection,
    a serialization failure, a deadlock, SQLite busy past its timeout, the pool exhausted. A job
    that meets one is retried, not failed (``service.worker.gate``)."""
    from sqlalchemy import exc as sa_exc

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sa_exc.TimeoutError):  # no pooled connection in time
            return True
        if isinstance(current, DBAPIError):
            if current.connection_invalidated:
                return True
            sqlstate = getattr(current.orig, "sqlstate", None) or ""
            if sqlstate in _TRANSIENT_SQLSTATES or sqlstate.startswith("08"):
                return True
            if isinstance(current, sa_exc.OperationalError) and "database is locked" in str(current.orig):
                return True
        current = current.__cause__ or current.__context__
    return False


__all__ = [
    "CONSTRAINT_ERRORS",
    "LEDGER_HEAD_COLUMNS",
    "Database",
    "canonical_json",
    "constraint_name",
    "create_ledger_engine",
    "is_transient_error",
    "lock_ledger_head",
    "pipelined",
    "register_constraint_errors",
    "translate_integrity_error",
]
