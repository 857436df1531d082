"""A transient database error ends a job's attempt, not the job (issue 24 §6: 4 of 34 DP-SGD jobs
failed for good at attempt 1 of 3 on a terminated connection).

The fault is real: the worker's commit of its first checkpoint waits on the dataset's row, which
this test holds locked from its own connection, and that waiting backend is killed with
``pg_terminate_backend`` — the worker's connection is gone in the middle of its commit. The job
goes back to the queue; its next attempt (the same real worker, training for real) succeeds.
``is_transient_error`` is checked on real errors of both databases: a terminated connection and
SQLite busy past its timeout are transient, a constraint violation is not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("torch")

import psycopg
from sqlalchemy import select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError

from service.db.models import Reservation
from service.db.session import Database, is_transient_error
from service.ledger import jobs, tenancy
from service.ledger import model_registry as registry
from service.training.data import LoadedData
from service.worker.worker import Worker
from tests.worker.digits_world import CountingLoader, digits_dataset, staged_files

pytestmark = pytest.mark.slow

POSTGRES_ONLY = pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.postgres)])


def _admin_dsn(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass
class KillTheNextCommit:
    """The worker's loader (the real one), which on its first call — after the reservation, before
    training — locks the dataset's row from another connection and starts a thread that kills
    the first backend of this database found waiting on a lock: the worker's commit."""

    url: URL
    dataset_id: str
    inner: CountingLoader = field(default_factory=CountingLoader)
    killed: list[int] = field(default_factory=list)
    thread: threading.Thread | None = None

    def __call__(self, uri: str, tenant_id: str) -> LoadedData:
        if self.thread is None:
            locker = psycopg.connect(_admin_dsn(self.url))
            locker.execute("SELECT 1 FROM datasets WHERE id = %s FOR UPDATE", (self.dataset_id,))
            self.thread = threading.Thread(target=self._kill_waiter, args=(locker,), daemon=True)
            self.thread.start()
        return self.inner(uri, tenant_id)

    def _kill_waiter(self, locker: psycopg.Connection) -> None:
        try:
            with psycopg.connect(_admin_dsn(self.url), autocommit=True) as admin:
                deadline = time.monotonic() + 120
                while not self.killed and time.monotonic() < deadline:
                    rows = admin.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND pid <> %s",
                        (locker.info.backend_pid,),
                    ).fetchall()
                    for (pid,) in rows:
                        if admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,):
                            self.killed.append(pid)
                    time.sleep(0.02)
        finally:
            locker.rollback()
            locker.close()


@POSTGRES_ONLY
def test_a_terminated_connection_during_a_commit_requeues_the_job_and_the_next_attempt_succeeds(
    database_url: URL, db: Database, tmp_path: Path
) -> None:
    world = digits_dataset(db, epsilon="10")
    job_id = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.5, "steps": 6, "checkpoint_every": 3, "seed": 3},
    ).id
    artifacts = tmp_path / "artifacts"
    loader = KillTheNextCommit(database_url, world.dataset_id)
    worker = Worker(db, artifact_dir=artifacts, loader=loader, device="cpu", lease_s=60)

    assert worker.run_once() == job_id
    assert loader.thread is not None
    loader.thread.join(timeout=30)
    assert loader.killed, "no waiting backend was terminated: the test proved nothing"
    first = jobs.queue.get_job(db, "acme", job_id)
    assert (first.job.status, first.job.attempts) == ("queued", 1), first  # before: failed for good
    with db.session(readonly=True) as session:
        (held,) = session.scalars(select(Reservation).where(Reservation.dataset_id == world.dataset_id)).all()
    assert (held.status, held.commits) == ("aborted", 0)  # the killed commit did not land

    assert worker.run_once() == job_id
    done = jobs.queue.get_job(db, "acme", job_id)
    assert (done.job.status, done.job.attempts) == ("succeeded", 2), done
    versions = registry.list_versions(db, "acme", done.job.model_name).data
    assert [v.step for v in versions] == [3, 6]
    for version in versions:
        body = registry.get_version(db, "acme", done.job.model_name, version.version)
        assert body.certificate["release"]["artifact_sha256"] == version.artifact.sha256
    assert staged_files(artifacts) == []


@POSTGRES_ONLY
def test_a_terminated_postgresql_connection_is_transient_and_a_constraint_violation_is_not(
    database_url: URL, db: Database
) -> None:
    with db.engine.connect() as connection:
        pid = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with psycopg.connect(_admin_dsn(database_url), autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        with pytest.raises(Exception) as terminated:
            connection.execute(text("SELECT 1"))
    assert is_transient_error(terminated.value), repr(terminated.value)

    tenancy.create_api_key(db, "acme", "viewer")
    with pytest.raises(IntegrityError) as duplicate:
        with db.engine.begin() as connection:
            connection.execute(
                text("INSERT INTO tenants (id, created_at) SELECT id, created_at FROM tenants")
            )
    assert not is_transient_error(duplicate.value)


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_busy_past_its_timeout_is_transient(database_url: URL) -> None:
    holder = Database(database_url)
    impatient = Database(database_url, busy_timeout_s=0.05)
    try:
        with holder.session() as session:  # BEGIN IMMEDIATE: the write lock
            session.execute(text("SELECT 1"))
            with pytest.raises(Exception) as locked:
                with impatient.session() as other:
                    other.execute(text("SELECT 1"))
        assert "database is locked" in str(locked.value)
        assert is_transient_error(locked.value)
    finally:
        holder.dispose()
        impatient.dispose()
