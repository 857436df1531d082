"""kill -9 of ``ledger serve`` in the middle of a charge over a task of ``BATCHES`` batches
(issue 26: "kill -9 during a 10⁶-batch charge"), SQLite and PostgreSQL.

One task of ``BATCHES`` one-record batches (created through the ledger's functions, then laid
out with a pointer per batch, as a task from before compact tasks: new batches are born compact),
then, over HTTP with an ``Idempotency-Key``:

1. the **first whole-task reserve** — the charge that makes the task compact: a pass over
   every batch id (the selection and the batch-set hash, ~80% of its ~1 s here), then
   ``UPDATE batches SET state_id = NULL`` over every batch and the task's pointer set — is
   SIGKILLed while it reads; its retry (same key) is killed as it writes (PostgreSQL: in or
   just after the UPDATE of the pointers; SQLite: as its pages go into the WAL at commit);
   the next retry goes through;
2. after undisturbed calibration charges, a **commit on the compact task** (it moves the
   task's pointer only, a few ms), killed a random fraction of the calibrated window after its
   transaction is seen (tried again on a fresh whole-task reservation, up to
   ``COMMIT_ATTEMPTS`` times, until one kill lands inside the transaction).

The server's transaction is observed, not guessed (``SqliteProbe``, ``PostgresProbe``): SQLite's
WAL write lock held by the server process (``/proc/locks``) and the bytes it has written since
(``/proc/<pid>/io``); on PostgreSQL a backend of the test's database with a transaction id, and
its ``RowExclusiveLock`` on the table written. Each kill must find the transaction still open
just before SIGKILL, and the client must get no answer.

After each kill (PostgreSQL: once the dead server's backends are gone), before any restart,
the database holds either nothing of the charge — no reservation / no certificate, every
batch's effective state (``COALESCE(batches.state_id, tasks.state_id)``) as before, the
idempotency key unused — or all of it; the task is never half compact (its pointer set and no
batch pointer, or no task pointer and every batch pointer set); the audit chains verify. After
the restart the same request with the same key answers once and charges once (a second retry
replays the same answer; the spend is each charge once); the commit's certificate verifies and
``check_batch_set`` accepts the reservation's paged batch list.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import URL

from accountant.certificates import check_batch_set, verify
from service.db.models import Batch, Task
from service.db.session import Database
from service.ledger import audit, batches
from service.ledger.spending.store import EFFECTIVE_STATE
from service.ledger.tenancy import DEFAULT_TENANT
from tests.faults.harness import HEADERS
from tests.service.api.conftest import Server, start_server, stop_server, url_text

pytestmark = pytest.mark.slow

BATCHES = 200_000  # a first whole-task reserve of ~1 s on this machine (both databases)
PER_REQUEST = 10_000  # batches per create_batches call (the API's limit)
EPSILON, CALIBRATION_EPSILON = Decimal("0.5"), Decimal("0.25")
EVENT = {"kind": "pure_dp", "epsilon": float(EPSILON)}
CALIBRATION_EVENT = {"kind": "pure_dp", "epsilon": float(CALIBRATION_EPSILON)}
COMMIT_ATTEMPTS = 5  # commits tried until one is killed inside its transaction
SQLITE_WAL_WRITE_LOCK = 120  # the -shm byte a writer locks (sqlite3.c: WALINDEX_LOCK_OFFSET)


# ---- seeing the server's transaction ------------------------------------------------------------


class SqliteProbe:
    """The server's SQLite transaction, seen from outside without taking a lock (so the
    server's timing is untouched): ``open`` while the server process holds the WAL write lock
    (the ledger begins every write transaction with ``BEGIN IMMEDIATE``; ``/proc/locks``);
    ``writing`` once, with that lock still held, the process has written since the lock was
    first seen (``wchar`` of ``/proc/<pid>/io``: SQLite writes a transaction's pages into the
    WAL at its commit, or when its page cache spills)."""

    def __init__(self, url: URL) -> None:
        assert url.database is not None
        self.inode = os.stat(url.database + "-shm").st_ino
        self.pid = 0

    def watch(self, pid: int) -> None:
        self.pid = pid

    def open(self) -> bool:
        with open("/proc/locks") as locks:
            for line in locks:
                fields = line.split()
                # "1: POSIX ADVISORY WRITE <pid> <maj:min:inode> <start> <end>"; "->" marks a waiter
                if len(fields) != 8 or fields[1] != "POSIX" or fields[3] != "WRITE":
                    continue
                if int(fields[4]) == self.pid and int(fields[5].rsplit(":", 1)[1]) == self.inode:
                    if int(fields[6]) <= SQLITE_WAL_WRITE_LOCK <= int(fields[7]):
                        return True
        return False

    def writing(self) -> Probe:
        baseline: list[int] = []

        def seen() -> bool:
            if not self.open():
                baseline.clear()
                return False
            written = self._written()
            if not baseline:
                baseline.append(written)
            return written > baseline[0]

        return seen

    def _written(self) -> int:
        with open(f"/proc/{self.pid}/io") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
        raise AssertionError("no wchar in /proc/<pid>/io")

    def close(self) -> None:
        pass


class PostgresProbe:
    """The server's PostgreSQL transaction, from a connection of the test's own: ``open`` while
    a backend of the test's database (every other one is the server's) has a transaction with
    an id (it locked or wrote rows: the ledger head is locked ``FOR UPDATE`` first); ``writes(table)``
    while such a transaction holds a ``RowExclusiveLock`` on ``table`` (an UPDATE or INSERT on
    it ran or is running)."""

    def __init__(self, url: URL) -> None:
        import psycopg

        self.dbname = url.database
        dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self.connection = psycopg.connect(dsn, autocommit=True)

    def watch(self, pid: int) -> None:
        pass

    def open(self) -> bool:
        return (
            self._count(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                "AND backend_xid IS NOT NULL",
                (self.dbname,),
            )
            > 0
        )

    def writes(self, table: str) -> Probe:
        return lambda: (
            self._count(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE a.datname = %s AND a.pid <> pg_backend_pid() AND l.locktype = 'relation' "
                "AND l.relation = %s::regclass AND l.mode = 'RowExclusiveLock' AND a.xact_start IS NOT NULL",
                (self.dbname, table),
            )
            > 0
        )

    def backends(self) -> int:
        """The other backends connected to the test's database (the server's)."""
        return self._count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (self.dbname,),
        )

    def _count(self, query: str, params: tuple[Any, ...]) -> int:
        row = self.connection.execute(query, params).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.connection.close()


Probe = Callable[[], bool]


@dataclass
class Kill:
    """What a doomed request saw: ``answer`` (a status code) or ``lost`` (no answer)."""

    answer: int | None = None
    body: Any = None  # the answer's JSON
    lost: bool = False
    seen_open: bool = False  # the trigger held (and the server was killed)
    open_at_kill: bool = False  # the transaction was still open just before SIGKILL
    waited_s: float = 0.0  # from the trigger to the kill

    @property
    def inside(self) -> bool:
        """Killed inside the request's transaction: seen open just before, and no answer."""
        return self.lost and self.open_at_kill

    def describe(self) -> str:
        if not self.seen_open:
            return f"answered {self.answer} before the trigger: not killed"
        where = "inside its transaction" if self.open_at_kill else "after its transaction"
        answered = "no answer" if self.lost else f"answered {self.answer} first"
        return f"killed {self.waited_s * 1e3:.1f} ms after the trigger, {where}, {answered}"


def kill_during(
    server: Server,
    seen: Probe,
    still_open: Probe,
    send: Callable[[httpx.Client], httpx.Response],
    delay_s: float,
) -> Kill:
    """Send one request; SIGKILL the server ``delay_s`` after ``seen`` first holds (unless the
    request was answered first), noting whether ``still_open`` held just before the kill."""
    outcome = Kill()
    done = threading.Event()

    def request() -> None:
        try:
            with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
                answer = send(http)
                outcome.answer = answer.status_code
                outcome.body = answer.json() if answer.status_code == 200 else answer.text
        except httpx.TransportError:
            outcome.lost = True
        finally:
            done.set()

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        if seen():
            outcome.seen_open = True
            seen_at = time.monotonic()
            if delay_s > 0:
                done.wait(delay_s)
            outcome.open_at_kill = not done.is_set() and bool(still_open())
            os.kill(server.process.pid, signal.SIGKILL)
            outcome.waited_s = time.monotonic() - seen_at
            break
    thread.join(timeout=60)
    if outcome.seen_open:
        server.process.wait(timeout=30)
    return outcome


def open_window(server: Server, probe: Probe, send: Callable[[httpx.Client], httpx.Response]) -> float:
    """Send one request undisturbed; how long ``probe`` held (seconds)."""
    done = threading.Event()
    answers: list[httpx.Response] = []

    def request() -> None:
        try:
            with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
                answers.append(send(http))
        finally:
            done.set()  # a failed request ends the watch too (the assertion below reports it)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    first = last = None
    while not done.is_set():
        if probe():
            now = time.monotonic()
            first = first if first is not None else now
            last = now
    thread.join()
    assert answers and answers[0].status_code in (200, 201), answers[0].text if answers else None
    return (last - first) if first is not None and last is not None else 0.0


# ---- what the database holds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    states: dict[str, int]  # effective state id -> how many of the dataset's batches are in it
    task_state: str | None
    own_pointers: int  # batches of the task with a pointer of their own
    reservations: dict[str, str]  # id -> status
    certificates: int
    keys: set[str]  # idempotency keys stored
    epsilon_spent: Decimal
    charges_committed: int


def stored(db: Database, dataset: str, task: str) -> Stored:
    with db.session(readonly=True) as session:
        states = dict(
            session.execute(
                select(EFFECTIVE_STATE, func.count())
                .where(Batch.dataset_id == dataset)
                .group_by(EFFECTIVE_STATE)
            ).all()
        )
        task_state = session.scalar(select(Task.state_id).where(Task.id == task))
        own = session.scalar(
            text("SELECT count(*) FROM batches WHERE task_id = :t AND state_id IS NOT NULL"), {"t": task}
        )
        reservations: dict[str, str] = dict(
            session.execute(
                text("SELECT id, status FROM reservations WHERE dataset_id = :d"), {"d": dataset}
            ).all()
        )
        certificates = session.scalar(
            text("SELECT count(*) FROM certificates WHERE dataset_id = :d"), {"d": dataset}
        )
        keys = set(session.scalars(text("SELECT key FROM idempotency_keys")).all())
        head = session.execute(
            text("SELECT epsilon_spent, charges_committed FROM datasets WHERE id = :d"), {"d": dataset}
        ).one()
    return Stored(
        states,
        task_state,
        int(own or 0),
        reservations,
        int(certificates or 0),
        keys,
        Decimal(head.epsilon_spent),
        int(head.charges_committed),
    )


def assert_task_whole(s: Stored) -> None:
    """Compact (the task's pointer, no batch's) or not (every batch's, not the task's)."""
    assert (s.task_state is not None and s.own_pointers == 0) or (
        s.task_state is None and s.own_pointers == BATCHES
    ), (s.task_state, s.own_pointers)


def wait_for_dead_backends(probe: Probe, db: Database) -> None:
    """PostgreSQL: the killed server's backends end once they find its socket closed (a
    statement running then finishes first, and its transaction rolls back). The test's own
    pooled connection is closed first, so that every other backend is the server's."""
    if isinstance(probe, PostgresProbe):
        db.dispose()
        deadline = time.monotonic() + 60
        while probe.backends() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.backends() == 0, "the killed server's backends did not end"


def chains_verify(db: Database) -> None:
    checked = audit.verify(db)
    assert checked.ok, checked


# ---- the test ------------------------------------------------------------------------------------


def _create(db: Database, base_url: str) -> tuple[str, str, set[str]]:
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=60) as http:
        made = http.post(
            "/v1/datasets",
            json={
                "name": f"kill-charge-{time.time_ns()}",
                "budget": {"rule": "sequential", "epsilon": "1000", "delta": "0", "accountant": "basic"},
            },
        )
        made.raise_for_status()
        dataset = made.json()["id"]
        made = http.post(f"/v1/datasets/{dataset}/tasks", json={"name": "large"})
        made.raise_for_status()
        task = made.json()["id"]
    ids: set[str] = set()
    for start in range(0, BATCHES, PER_REQUEST):
        created = batches.create_batches(
            db,
            DEFAULT_TENANT,
            dataset,
            task,
            batches=[
                {"name": f"b{i}", "records": [f"r{i}"]}
                for i in range(start, min(BATCHES, start + PER_REQUEST))
            ],
        )
        ids.update(b.id for b in created.data)
    # Batches are born compact (their task holds the empty state). The charge under test is the
    # one that makes a task compact, so the task is laid out as a ledger from before compact
    # tasks holds it — a pointer per batch, as migration 7c1e5a9d3b20 leaves existing tasks —
    # before any spend (the server has read nothing of this dataset's batches yet).
    with db.session() as session:
        state = session.scalar(select(Task.state_id).where(Task.id == task))
        assert state is not None, "batches created into a new task are born compact"
        session.execute(update(Batch).where(Batch.task_id == task).values(state_id=state))
        session.execute(update(Task).where(Task.id == task).values(state_id=None))
    return dataset, task, ids


def _listed(base_url: str, reservation: str) -> list[tuple[str, int]]:
    members: list[tuple[str, int]] = []
    after: str | None = None
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=60) as http:
        while True:
            params: dict[str, Any] = {"limit": 10_000, **({"after": after} if after else {})}
            page = http.get(f"/v1/reservations/{reservation}/batches", params=params)
            page.raise_for_status()
            body = page.json()
            members += [(item["id"], item["class"]) for item in body["data"]]
            after = body["next"]
            if after is None:
                return members


def test_kill_9_during_a_large_charge_charges_once(database_url: URL) -> None:
    url = url_text(database_url)
    rng = random.Random(26)
    env = {"LEDGER_RESERVATION_TTL_S": "600"}
    db = Database(database_url, pool_size=1, max_overflow=0)
    server = start_server(url, env=env)
    probe: Any = None
    try:
        dataset, task, batch_ids = _create(db, server.base_url)
        postgres = database_url.get_backend_name() == "postgresql"
        probe = PostgresProbe(database_url) if postgres else SqliteProbe(database_url)
        probe.watch(server.process.pid)

        # 1. The first whole-task reserve, killed while it reads and prices (a pass over every
        # batch id, ~80% of its time, before any write), then its retry killed as it writes
        # (PostgreSQL: inside or just after the UPDATE of every batch pointer; SQLite: as its
        # pages go into the WAL at commit).
        before = stored(db, dataset, task)
        assert list(before.states.values()) == [BATCHES]  # every batch in one state
        assert_task_whole(before)
        reserve_key = f"reserve-{time.time_ns()}"

        def reserve(http: httpx.Client) -> httpx.Response:
            return http.post(
                f"/v1/datasets/{dataset}/reservations",
                json={"tasks": [task], "event": EVENT},
                headers={"Idempotency-Key": reserve_key},
            )

        writing = probe.writes("batches") if postgres else probe.writing()
        stages = [("reading", probe.open, rng.uniform(0.1, 0.3)), ("writing", writing, 0.0)]
        landed_reserve = False
        for stage, trigger, delay_s in stages:
            kill = kill_during(server, trigger, probe.open, reserve, delay_s)
            assert kill.inside, (stage, kill.describe())
            wait_for_dead_backends(probe, db)
            after = stored(db, dataset, task)
            assert_task_whole(after)
            landed_reserve = bool(after.reservations)
            if not landed_reserve:  # nothing of it
                assert after.states == before.states and after.task_state is None, "half a reserve landed"
                assert reserve_key not in after.keys
            else:  # all of it
                assert len(after.reservations) == 1 and reserve_key in after.keys
                assert list(after.states.values()) == [BATCHES] and after.states != before.states
                assert after.task_state is not None
            chains_verify(db)
            print(f"whole-task reserve ({stage}): {kill.describe()}; landed {landed_reserve}")
            server = start_server(url, env=env)
            probe.watch(server.process.pid)
            if landed_reserve:
                break

        with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            started = time.monotonic()
            first = reserve(http)
            retried_s = time.monotonic() - started
            again = reserve(http)
        assert first.status_code == 201 and again.status_code == 201, (first.text, again.text)
        held = first.json()
        assert again.json()["id"] == held["id"]
        if landed_reserve:
            assert list(after.reservations) == [held["id"]]
        now = stored(db, dataset, task)
        assert list(now.reservations) == [held["id"]] and now.reservations[held["id"]] == "reserved"
        assert Decimal(held["cost"]["epsilon"]) == EPSILON and held["batches"]["count"] == BATCHES
        assert now.task_state is not None and now.own_pointers == 0  # compact now
        assert now.states == {now.task_state: BATCHES}
        print(f"the retried reserve: {retried_s:.2f} s ({'a replay' if landed_reserve else 'the charge'})")

        # 2. A commit on the compact task, killed while its transaction is open. First
        # undisturbed whole-task charges, to learn how long a commit's transaction stays open
        # (a few ms: the probe may miss one).
        trigger = probe.writes("tasks") if postgres else probe.open
        calibrations: list[str] = []
        window = 0.0
        while window == 0.0 and len(calibrations) < COMMIT_ATTEMPTS:
            with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
                made = http.post(
                    f"/v1/datasets/{dataset}/reservations", json={"tasks": [task], "event": CALIBRATION_EVENT}
                )
                assert made.status_code == 201, made.text
            calibrations.append(made.json()["id"])
            window = open_window(
                server,
                trigger,
                lambda http: http.post(
                    f"/v1/reservations/{calibrations[-1]}/commit",
                    json={"release": {"model": "m", "version": f"c{len(calibrations)}"}},
                ),
            )
        assert window > 0, f"the probe saw none of {len(calibrations)} commits' transactions"
        certificates: dict[str, dict[str, Any]] = {}  # reservation -> its certificate, as answered
        target = held["id"]
        for attempt in range(COMMIT_ATTEMPTS):
            if attempt:  # the last kill came after the commit's transaction: one more whole-task charge
                with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
                    made = http.post(
                        f"/v1/datasets/{dataset}/reservations", json={"tasks": [task], "event": EVENT}
                    )
                    assert made.status_code == 201, made.text
                target = made.json()["id"]
            before = stored(db, dataset, task)
            commit_key = f"commit-{time.time_ns()}"

            def commit(
                http: httpx.Client, target: str = target, key: str = commit_key, version: str = f"v{attempt}"
            ) -> httpx.Response:
                return http.post(
                    f"/v1/reservations/{target}/commit",
                    json={"release": {"model": "m", "version": version}},
                    headers={"Idempotency-Key": key},
                )

            kill = kill_during(server, trigger, probe.open, commit, rng.uniform(0.05, 0.5) * window)
            if kill.seen_open:  # killed (maybe after the answer: a busy machine)
                wait_for_dead_backends(probe, db)
            after = stored(db, dataset, task)
            assert_task_whole(after)
            assert after.task_state is not None  # a commit on whole compact tasks never materialises
            landed = after.reservations[target] == "committed"
            if kill.answer is not None:
                assert kill.answer == 200 and landed, kill
            if not landed:
                assert after.reservations[target] == "reserved"
                assert after.states == before.states and after.task_state == before.task_state
                assert (
                    after.certificates == before.certificates and after.epsilon_spent == before.epsilon_spent
                )
                assert commit_key not in after.keys
            else:
                assert commit_key in after.keys and after.certificates == before.certificates + 1
                assert after.task_state != before.task_state
                assert after.states == {after.task_state: BATCHES}
            chains_verify(db)
            print(f"commit (open ~{window * 1e3:.1f} ms): {kill.describe()}; landed {landed}")

            if kill.seen_open:
                server = start_server(url, env=env)
                probe.watch(server.process.pid)
            with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
                first, again = commit(http), commit(http)
            assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
            certificates[target] = first.json()["certificate"]
            assert again.json()["certificate"]["id"] == certificates[target]["id"]
            if kill.body is not None:
                assert kill.body["certificate"]["id"] == certificates[target]["id"]
            if kill.inside:
                break
        assert kill.inside, f"no commit was killed inside its transaction in {COMMIT_ATTEMPTS} tries"
        now = stored(db, dataset, task)
        assert now.reservations == {r: "committed" for r in [*calibrations, *certificates]}
        assert now.certificates == now.charges_committed == len(certificates) + len(calibrations)
        charged = EPSILON * len(certificates) + CALIBRATION_EPSILON * len(calibrations)
        assert now.epsilon_spent == charged  # each charge once
        assert now.task_state is not None and now.states == {now.task_state: BATCHES}
        issued = certificates[held["id"]]
        body = issued["certificate"]
        assert verify(body).ok, verify(body)
        listed = _listed(server.base_url, held["id"])
        assert len(listed) == BATCHES and {b for b, _ in listed} == batch_ids
        assert check_batch_set(body, listed).ok
        chains_verify(db)
    finally:
        stop_server(server.process)
        if probe is not None:
            probe.close()
        db.dispose()
