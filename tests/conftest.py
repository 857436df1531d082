"""Shared fixtures: real databases, migrated through Alembic, on SQLite and on PostgreSQL.

* ``database_url`` — parametrised over ``sqlite`` (a real file in ``tmp_path``) and ``postgres``
  (a fresh database per test on the server named by ``LEDGER_TEST_POSTGRES_URL``), migrated to
  head with ``service.db.migrations.upgrade``. Tests using it run once per backend.
* ``db`` — a ``service.db.session.Database`` on ``database_url``, disposed after the test.
* ``empty_database_url`` — the same, but never migrated (for migration tests).
* ``template_keys`` — API keys for two tenants (``acme``, ``rival``) in every scope, plus a
  revoked key (``Keys``); ``template_tenants`` — tenants ``t1`` and ``t2``. A test that asks for
  them (the API tests' ``keys``, the ledger tests' ``ledger``) gets its database copied from a
  template that already holds them (``FILLINGS``), made once per session and backend.
* ``_one_torch_thread`` (autouse) — torch, where a test module loaded it, runs on one intra-op
  thread during each test: the models are tiny, so extra threads buy nothing, and on a shared
  machine with few cores (two xdist workers on two cores) OpenMP's spinning threads made small
  ops ten times slower (an AdaDp run went from ~1 s to ~14 s). The previous setting is restored.

Several people run tests against the same PostgreSQL server at once, so every test session
creates its own databases, named ``ledger_test_<random hex>...``, through an AUTOCOMMIT
connection to the server's database and drops them at the end. Without
``LEDGER_TEST_POSTGRES_URL`` the PostgreSQL cases skip — unless ``CI`` is set, where they fail.

Speed: each backend is migrated once per session into a template (a SQLite file; a PostgreSQL
database used as ``TEMPLATE``); each test gets a copy of it. A test's PostgreSQL database is
dropped in the background (``PostgresServer.drop_later``): ``DROP DATABASE`` waits for a
checkpoint, a second or more on a busy disk, which the next test need not wait for; several drops
run at once and share their checkpoint.

The helpers (``postgres_admin_url``, ``PostgresServer``) are importable from ``tests.conftest``.
"""

from __future__ import annotations

import gc
import os
import secrets
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import settings as hypothesis_settings
from pytest import ParameterSet
from sqlalchemy.engine import URL, make_url

from service.db.migrations import upgrade
from service.db.session import Database
from service.ledger import tenancy
from service.server_secrets import KEY_HASH_SECRET_FILE

POSTGRES_ENV = "LEDGER_TEST_POSTGRES_URL"


def postgres_admin_url() -> URL | None:
    """The server URL from ``LEDGER_TEST_POSTGRES_URL`` (``None`` when unset)."""
    raw = os.environ.get(POSTGRES_ENV, "").strip()
    return make_url(raw) if raw else None


def require_postgres() -> URL:
    """The server URL, or skip (fail when ``CI`` is set) when there is none."""
    url = postgres_admin_url()
    if url is None:
        message = f"{POSTGRES_ENV} is not set: no PostgreSQL server to test against"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure)")
        pytest.skip(message)
    return url


class PostgresServer:
    """Creates and drops uniquely named databases on one PostgreSQL server."""

    DROPPERS = 8  # each holds a connection for the session (PostgreSQL allows 100 by default)

    def __init__(self, admin_url: URL) -> None:
        import psycopg

        self.admin_url = admin_url
        self.prefix = f"ledger_test_{secrets.token_hex(6)}"
        self._counter = 0
        self._created: set[str] = set()
        self._dsn = admin_url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._admin = psycopg.connect(self._dsn, autocommit=True)
        self._droppers: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._thread_connections: list[Any] = []

    def url(self, name: str) -> URL:
        return self.admin_url.set(drivername="postgresql+psycopg", database=name)

    def create(self, *, template: str | None = None) -> str:
        self._counter += 1
        name = f"{self.prefix}_{self._counter}"
        sql = f'CREATE DATABASE "{name}"'
        if template is not None:
            sql += f' TEMPLATE "{template}"'
        self._admin.execute(sql)
        self._created.add(name)
        return name

    def drop(self, name: str) -> None:
        self._admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self._created.discard(name)

    def drop_later(self, name: str) -> None:
        """Drop ``name`` on a background thread (its own connection); ``close`` waits for them.

        Up to ``DROPPERS`` drops run at once: each ``DROP DATABASE`` waits for a checkpoint, and
        drops that wait together share one (8 databases: 17 s one after another, 1.2 s at once,
        on this 2-core machine under load)."""
        if self._droppers is None:
            self._droppers = ThreadPoolExecutor(max_workers=self.DROPPERS, thread_name_prefix="drop-test-db")
        self._droppers.submit(self._drop_on_own_connection, name)

    def _drop_on_own_connection(self, name: str) -> None:
        import psycopg

        admin = getattr(self._local, "admin", None)
        if admin is None:
            admin = self._local.admin = psycopg.connect(self._dsn, autocommit=True)
            self._thread_connections.append(admin)
        try:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except psycopg.Error:
            return  # close() drops what is left on the main connection
        self._created.discard(name)

    def close(self) -> None:
        if self._droppers is not None:
            self._droppers.shutdown(wait=True)
        for connection in self._thread_connections:
            connection.close()
        for name in sorted(self._created):
            self.drop(name)
        self._admin.close()


@pytest.fixture(scope="session", autouse=True)
def ledger_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``LEDGER_HOME`` of the session (and of every ``ledger`` it starts): a temporary folder, so
    no test writes into the user's ``~/.local/share/privacy-ledger``."""
    home = tmp_path_factory.mktemp("ledger-home")
    before = os.environ.get("LEDGER_HOME")
    os.environ["LEDGER_HOME"] = str(home)
    yield home
    if before is None:
        os.environ.pop("LEDGER_HOME", None)
    else:
        os.environ["LEDGER_HOME"] = before


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer(require_postgres())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_template(postgres_server: PostgresServer) -> str:
    """A PostgreSQL database migrated to head, copied for each test."""
    name = postgres_server.create()
    upgrade(postgres_server.url(name))
    return name


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head, copied for each test."""
    path = tmp_path_factory.mktemp("sqlite-template") / "ledger.db"
    upgrade(f"sqlite:///{path}")
    return path


@dataclass(frozen=True)
class Keys:
    """``keys.get(tenant, scope)``; ``revoked`` is an admin key of ``acme`` that was revoked."""

    by_tenant_scope: dict[tuple[str, str], str]
    revoked: str

    def get(self, tenant: str, scope: str) -> str:
        return self.by_tenant_scope[(tenant, scope)]


def create_keys(db: Database) -> Keys:
    """A key of each scope for ``acme`` and ``rival``, and a revoked admin key of ``acme``."""
    found: dict[tuple[str, str], str] = {}
    for tenant in ("acme", "rival"):
        for scope in ("admin", "trainer", "viewer"):
            found[(tenant, scope)] = tenancy.create_api_key(db, tenant, scope)
    revoked = tenancy.issue_api_key(db, "acme", "admin")
    tenancy.revoke_api_key(db, revoked.id)
    return Keys(found, revoked.key)


def create_tenants(db: Database) -> None:
    """Tenants ``t1`` and ``t2`` (the ledger tests' ``ledger`` fixture)."""
    tenancy.create_tenant(db, "t1")
    tenancy.create_tenant(db, "t2")


FILLINGS: Final[dict[str, Callable[[Database], Any]]] = {
    "template_keys": create_keys,
    "template_tenants": create_tenants,
}
"""What a test's database can be copied with already in it, by the fixture that asks for it.
``database_url`` copies a template filled with every filling the test's fixtures ask for (made
once per session, backend and set of fillings) instead of the empty one: the same rows, made
once, not in every test (eight keys, a transaction and an audit entry each, took ~90 ms a test)."""


@dataclass(frozen=True)
class FilledTemplate:
    """A migrated template with ``FILLINGS`` in it: ``database`` is a SQLite file (its key-hash
    secret beside it) or a PostgreSQL database name (its secret is in the session's ledger home);
    ``contents`` what each filling returned."""

    database: Path | str
    contents: dict[str, Any]


@pytest.fixture(scope="session")
def filled_templates() -> dict[tuple[str, tuple[str, ...]], FilledTemplate]:
    return {}


def filled_template(
    request: pytest.FixtureRequest, backend: str, fillings: tuple[str, ...]
) -> FilledTemplate:
    """The template of ``backend`` with ``fillings`` in it, made on first use."""
    made: dict[tuple[str, tuple[str, ...]], FilledTemplate] = request.getfixturevalue("filled_templates")
    if (backend, fillings) not in made:
        location: Path | str
        if backend == "sqlite":
            folder = request.getfixturevalue("tmp_path_factory").mktemp("sqlite-filled-template")
            location = folder / "ledger.db"
            shutil.copyfile(request.getfixturevalue("sqlite_template"), location)
            url = make_url(f"sqlite:///{location}")
        else:
            server: PostgresServer = request.getfixturevalue("postgres_server")
            location = server.create(template=request.getfixturevalue("postgres_template"))
            url = server.url(location)
        db = Database(url)
        try:
            contents = {name: FILLINGS[name](db) for name in fillings}
        finally:
            db.dispose()  # a PostgreSQL template takes no connections while it is copied
        made[(backend, fillings)] = FilledTemplate(location, contents)
    return made[(backend, fillings)]


def _fillings(request: pytest.FixtureRequest) -> tuple[str, ...]:
    return tuple(name for name in FILLINGS if name in request.fixturenames)


@pytest.fixture
def template_keys(backend: str, request: pytest.FixtureRequest) -> Keys:
    """The keys in the test's database (``FILLINGS``)."""
    keys: Keys = filled_template(request, backend, _fillings(request)).contents["template_keys"]
    return keys


@pytest.fixture
def template_tenants() -> None:
    """Tenants ``t1`` and ``t2`` in the test's database (``FILLINGS``)."""


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    torch = sys.modules.get("torch")  # collection imported it if any collected module needs it
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


SLOW_ONLY_MODULES: Final = ("tests/security/test_schemathesis.py",)
"""Modules whose every test is ``slow`` and whose collection is itself costly: schemathesis
generates its cases while pytest collects, in every xdist process (about half of the fast loop's
collection). The fast loop (``-m "not slow"``, README "Development") does not collect them."""


def fast_loop(config: pytest.Config) -> bool:
    """Whether this run is the fast loop: ``-m "not slow"`` exactly (README "Development")."""
    return (config.getoption("markexpr") or "").split() == ["not", "slow"]


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not fast_loop(config):
        return None
    relative = (
        collection_path.relative_to(config.rootpath).as_posix()
        if collection_path.is_relative_to(config.rootpath)
        else ""
    )
    return True if relative in SLOW_ONLY_MODULES else None


FAST_POSTGRES: Final = (
    # The spend store's SQL: the head read ``FOR UPDATE``, ``INSERT … ON CONFLICT DO NOTHING`` of
    # new states, no overlay write, the statements of a spend counted (test_spend_statements); the
    # compact pass's server-side cursor over task ids and ``COLLATE "C"`` batch order, by the
    # state-class property tests with one rule (the rules are above the store: their SQLite
    # cases and the whole suite run the other three).
    "tests/service/ledger/test_spend_statements.py",
    "tests/service/ledger/test_state_classes.py::test_any_charges_on_any_subsets_match_one_state_per_batch[postgres-sequential]",
    "tests/service/ledger/test_state_classes.py::test_whole_task_charges_on_compact_tasks_match_one_state_per_batch[postgres-sequential]",
    "tests/service/ledger/test_state_classes.py::test_a_whole_task_charge_moves_one_task_pointer[postgres]",
    "tests/service/ledger/test_reservation_membership.py",  # a reservation's batches in "C" order
    # binary COPY of batches and record hashes (the module's budget checks are above the store)
    "tests/service/ledger/test_datasets_batches.py::test_batches_are_disjoint",
    "tests/service/ledger/test_datasets_batches.py::test_concurrent_overlapping_batches_one_wins",
    "tests/service/ledger/test_datasets_batches.py::test_stored_records_are_what_was_sent",
    # Races and their isolation, which differ by server: row locks against SQLite's BEGIN
    # IMMEDIATE, a failed statement aborting PostgreSQL's whole transaction (group commit), two
    # processes' heads, constraint names translated to domain errors.
    "tests/service/ledger/test_concurrency.py",
    "tests/service/ledger/test_group_commit.py",
    "tests/service/ledger/test_spend_known.py",
    "tests/service/ledger/test_database.py",
)
"""The PostgreSQL cases of ``backend`` tests that the fast loop (``-m "not slow"``) runs too (test
ids or their prefixes): the ledger's PostgreSQL-only SQL paths and the races, nothing else. Every
other PostgreSQL case is marked ``slow`` here: its SQLite case runs the same code above the
database, the cases kept here run the PostgreSQL statements beneath it, and the whole suite (CI)
runs every case on both."""


FAST_LOOP_PROFILE: Final = "fast-loop"
hypothesis_settings.register_profile(FAST_LOOP_PROFILE, max_examples=5)
"""The fast loop's hypothesis profile, loaded only there (``pytest_configure``); the whole suite
runs on hypothesis' default profile and each test's own ``@settings``. In the fast loop a property
test runs at most the profile's ``max_examples`` (``_cap_examples``): the loop is there to catch a
break in the code it calls, which the first examples do (hypothesis tries its simplest and
boundary cases first, and replays a failure it saved); the search for rare counterexamples, with
each test's full count, is the whole suite's."""


def fast_loop_sample(cases: Sequence[Any], *, keep: int = 3) -> list[Any]:
    """The cases of a costly parametrised grid (each a tuple of the arguments, or a
    ``pytest.param``) with all but ``keep`` of them marked ``slow``: the fast loop runs the first,
    the last and cases evenly between (a sample that still crosses the grid's corners); the whole
    suite runs every case."""
    last = len(cases) - 1
    sampled = {round(i * last / (keep - 1)) for i in range(keep)} if keep > 1 else {0}
    marked: list[Any] = []
    for index, case in enumerate(cases):
        if index in sampled:
            marked.append(case)
        elif isinstance(case, ParameterSet):
            marked.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id))
        else:
            marked.append(pytest.param(*case, marks=pytest.mark.slow))
    return marked


def pytest_configure(config: pytest.Config) -> None:
    if fast_loop(config):
        hypothesis_settings.load_profile(FAST_LOOP_PROFILE)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """At the very end of the run, the objects the tests left behind are frozen out of the garbage
    collector (``gc.freeze``): the interpreter's exit would otherwise walk them all, ~10⁶ objects,
    in several full collections — 4 to 8 s at the end of each xdist worker, the last of it while
    the whole run waits. Nothing runs after this hook that needs them collected."""
    gc.freeze()


def _cap_examples(items: list[pytest.Item]) -> None:
    """Cap each property test's own ``@settings(max_examples=…)`` at the fast-loop profile's (an
    explicit ``@settings`` takes precedence over a profile, so the profile alone would not)."""
    cap = hypothesis_settings.get_profile(FAST_LOOP_PROFILE).max_examples
    for item in items:
        test = getattr(item, "obj", None)
        chosen = getattr(test, "_hypothesis_internal_use_settings", None)
        if chosen is not None and chosen.max_examples > cap:
            test._hypothesis_internal_use_settings = hypothesis_settings(chosen, max_examples=cap)  # type: ignore[union-attr]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that hold a ``slow`` test run first (the rest keep their order): a long test
    started last would keep one xdist worker busy after the other has finished. A module's tests
    stay together, so a module-scoped fixture is set up once per worker. Then the PostgreSQL
    cases outside ``FAST_POSTGRES`` are marked ``slow`` (after the sort: they do not move their
    module to the front), and in the fast loop property tests are capped (``_cap_examples``)."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_modules)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("backend") != "postgres":
            continue
        if not item.nodeid.startswith(FAST_POSTGRES):
            item.add_marker(pytest.mark.slow)
    if fast_loop(config):
        _cap_examples(items)


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[URL]:
    """A fresh database at the newest schema revision, on ``backend``; holding the keys of
    ``template_keys`` where the test asks for them."""
    fillings = _fillings(request)
    filled = filled_template(request, backend, fillings) if fillings else None
    if backend == "sqlite":
        path = tmp_path / "ledger.db"
        if filled is not None:
            template = Path(filled.database)
            secret = template.parent / KEY_HASH_SECRET_FILE
            if secret.exists():
                shutil.copyfile(secret, tmp_path / KEY_HASH_SECRET_FILE)
        else:
            template = request.getfixturevalue("sqlite_template")
        shutil.copyfile(template, path)
        yield make_url(f"sqlite:///{path}")
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = server.create(
        template=str(filled.database) if filled is not None else request.getfixturevalue("postgres_template")
    )
    try:
        yield server.url(name)
    finally:
        server.drop_later(name)


@pytest.fixture
def empty_database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[URL]:
    """A fresh database with no schema at all, on ``backend``."""
    if backend == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'empty.db'}")
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = server.create()
    try:
        yield server.url(name)
    finally:
        server.drop(name)


@pytest.fixture
def db(database_url: URL) -> Iterator[Database]:
    database = Database(database_url, pool_size=20, max_overflow=10)
    try:
        yield database
    finally:
        database.dispose()
