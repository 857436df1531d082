"""Jobs (service.ledger.jobs): validation, the one-statement claim, leases, heartbeats, cancel,
retries, and the data source a job reads (its dataset's, when it runs) — on real SQLite and
PostgreSQL databases. No torch, except for the one job here that trains (to show which source
it read)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from service.db.base import utcnow
from service.db.session import Database
from service.ledger import datasets, jobs
from service.ledger.errors import Conflict, InvalidInput, NotFound
from service.training.data import load_data
from service.worker.worker import Worker
from tests.worker.digits_world import (
    DIGITS,
    CountingLoader,
    budget,
    claim_concurrently,
    digits_dataset,
    digits_train_ids,
    job_row,
    versions_of,
)

PARAMS: dict[str, Any] = {"noise_multiplier": 1.0, "steps": 10}


def _dataset(db: Database, tenant: str = "acme") -> str:
    return digits_dataset(db, tenant, records=[f"r{i}" for i in range(8)]).dataset_id


def _job(db: Database, dataset_id: str, tenant: str = "acme", **params: Any) -> str:
    answer = jobs.queue.create_job(
        db, tenant, dataset_id=dataset_id, algorithm="dp_sgd", params={**PARAMS, **params}
    )
    return str(answer.id)


# ---------------------------------------------------------------------------------------------
# Creation
# ---------------------------------------------------------------------------------------------


def test_create_queues_a_job(db: Database) -> None:
    dataset_id = _dataset(db)
    answer = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="adadp", params=PARAMS)
    assert answer.status == "queued"
    assert (answer.progress_step, answer.progress_total) == (0, None)
    assert answer.epsilon_committed == 0 and answer.delta_committed == 0
    assert answer.model_name == f"adadp-{answer.id}"  # unique per job
    assert answer.attempts == 0 and answer.versions == ()
    assert jobs.queue.get_job(db, "acme", answer.id).job.id == answer.id


@pytest.mark.parametrize(
    ("algorithm", "params", "field"),
    [
        ("sgd", PARAMS, "algorithm"),
        # A job never names its data, not even the source its dataset has: the dataset's is read.
        ("dp_sgd", {**PARAMS, "data_source": DIGITS}, "params.data_source"),
        ("dp_sgd", {**PARAMS, "data_source": "http://example.com/x.csv"}, "params.data_source"),
        ("dp_sgd", {**PARAMS, "data_source": "builtin:mnist"}, "params.data_source"),
        ("dp_sgd", {**PARAMS, "model_name": "../../etc"}, "params.model_name"),
        ("dp_sgd", ["not", "an", "object"], "params"),
    ],
)
def test_invalid_jobs_name_the_field_and_change_nothing(
    db: Database, algorithm: str, params: Any, field: str
) -> None:
    dataset_id = _dataset(db)
    with pytest.raises(InvalidInput) as info:
        jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm=algorithm, params=params)
    assert info.value.field == field
    assert jobs.queue.list_jobs(db, "acme").count == 0


def test_a_job_on_a_dataset_without_a_source_or_batches_is_refused_naming_the_dataset(db: Database) -> None:
    """The source belongs to the dataset: a job on one without a source (or without batches)
    could never run, so it is refused at submit naming ``dataset_id``, and nothing is stored."""
    unsourced = digits_dataset(db, records=[f"r{i}" for i in range(8)], source=None).dataset_id
    with pytest.raises(InvalidInput) as info:
        jobs.queue.create_job(db, "acme", dataset_id=unsourced, algorithm="dp_sgd", params=PARAMS)
    assert info.value.field == "dataset_id"
    assert "has no data source" in info.value.message and "data-source" in info.value.message
    empty = datasets.create_dataset(db, "acme", name="no-batches", budget=budget(), data_source=DIGITS).id
    with pytest.raises(InvalidInput) as info:
        jobs.queue.create_job(db, "acme", dataset_id=empty, algorithm="dp_sgd", params=PARAMS)
    assert info.value.field == "dataset_id" and "has no batches" in info.value.message
    assert jobs.queue.list_jobs(db, "acme").count == 0
    datasets.set_data_source(db, "acme", unsourced, data_source=DIGITS)  # an admin sets it: accepted
    assert jobs.queue.create_job(db, "acme", dataset_id=unsourced, algorithm="dp_sgd", params=PARAMS).id


def test_another_tenants_dataset_and_job_are_not_found(db: Database) -> None:
    dataset_id = _dataset(db, "acme")
    job_id = _job(db, dataset_id)
    digits_dataset(db, "rival", records=["x"], n_batches=1)
    with pytest.raises(NotFound):
        jobs.queue.create_job(db, "rival", dataset_id=dataset_id, algorithm="dp_sgd", params=PARAMS)
    with pytest.raises(NotFound):
        jobs.queue.get_job(db, "rival", job_id)
    with pytest.raises(NotFound):
        jobs.queue.cancel_job(db, "rival", job_id)
    assert jobs.queue.list_jobs(db, "rival").count == 0


def test_create_is_idempotent_with_a_key(db: Database) -> None:
    dataset_id = _dataset(db)
    first = jobs.queue.create_job(
        db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params=PARAMS, idempotency_key="k1"
    )
    again = jobs.queue.create_job(
        db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params=PARAMS, idempotency_key="k1"
    )
    assert again.id == first.id
    assert jobs.queue.list_jobs(db, "acme").count == 1


# ---------------------------------------------------------------------------------------------
# Claim, lease, heartbeat
# ---------------------------------------------------------------------------------------------


def test_claim_takes_the_oldest_queued_job_once(db: Database) -> None:
    dataset_id = _dataset(db)
    first, second = _job(db, dataset_id), _job(db, dataset_id)
    a = jobs.leases.claim(db, "worker-a", 30)
    b = jobs.leases.claim(db, "worker-b", 30)
    assert a is not None and b is not None
    assert (a.id, b.id) == (first, second)
    assert a.attempt == 1 and a.params == PARAMS and a.model_name == f"dp_sgd-{a.id}"
    assert jobs.leases.claim(db, "worker-c", 30) is None
    row = job_row(db, first)
    assert row.status == "running" and row.lease_owner == "worker-a" and row.started_at is not None


def test_the_claim_is_one_statement(db: Database) -> None:
    """procrastinate's shape: one UPDATE … WHERE id = (SELECT … FROM jobs AS candidate … FOR UPDATE
    OF candidate SKIP LOCKED) RETURNING (the fair order's subqueries read other rows of jobs: only
    the candidate row is locked)."""
    _job(db, _dataset(db))
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "jobs" in statement:
            statements.append(" ".join(statement.split()))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        assert jobs.leases.claim(db, "worker-a", 30) is not None
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    assert len(statements) == 1
    sql = statements[0].upper()
    assert sql.startswith("UPDATE JOBS SET") and "RETURNING" in sql
    if db.is_postgresql:
        assert "FOR UPDATE OF CANDIDATE SKIP LOCKED" in sql


def test_concurrent_claims_never_hand_one_job_to_two_workers(db: Database) -> None:
    dataset_id = _dataset(db)
    created = {_job(db, dataset_id) for _ in range(24)}
    claimed = claim_concurrently(db, 8)
    assert Counter(claimed) == Counter(created)  # every job exactly once


def test_an_expired_lease_is_claimed_again_and_the_old_owner_is_locked_out(db: Database) -> None:
    job_id = _job(db, _dataset(db))
    now = utcnow()
    a = jobs.leases.claim(db, "worker-a", 5, now=now)
    assert a is not None
    jobs.leases.heartbeat(db, a.lease, 5, progress_step=3, now=now + timedelta(seconds=1))
    assert jobs.leases.claim(db, "worker-b", 5, now=now + timedelta(seconds=4)) is None  # extended to 6 s
    b = jobs.leases.claim(db, "worker-b", 5, now=now + timedelta(seconds=7))
    assert b is not None and b.id == job_id and b.attempt == 2
    with pytest.raises(jobs.leases.LeaseLost):
        jobs.leases.heartbeat(db, a.lease, 5)
    assert not jobs.leases.ended_under(db, a.lease)  # a's lease was lost: b claimed the job
    assert not jobs.leases.ended_under(db, b.lease)  # still running under b
    with pytest.raises(jobs.leases.LeaseLost):
        jobs.leases.record_progress(db, a.lease, step=4)
    with pytest.raises(jobs.leases.LeaseLost):
        jobs.leases.finish(db, a.lease, "succeeded")
    jobs.leases.finish(db, b.lease, "failed", error={"error": "x", "message": "y"})
    row = job_row(db, job_id)
    assert row.status == "failed" and row.lease_owner is None and row.attempts == 2
    assert row.progress_step == 3
    with pytest.raises(jobs.leases.LeaseLost):  # a beat that races the end of its own job ...
        jobs.leases.heartbeat(db, b.lease, 5)
    assert jobs.leases.ended_under(db, b.lease)  # ... is told apart from a lost lease


def test_a_job_whose_workers_keep_dying_fails_after_max_attempts(db: Database, tmp_path: Path) -> None:
    job_id = _job(db, _dataset(db))
    now = utcnow() - timedelta(hours=1)
    for attempt in range(jobs.queue.DEFAULT_MAX_ATTEMPTS):  # each claimer dies: its lease just expires
        claimed = jobs.leases.claim(db, f"dead-{attempt}", 1, now=now + timedelta(seconds=10 * attempt))
        assert claimed is not None and claimed.attempt == attempt + 1
    worker = Worker(db, artifact_dir=tmp_path, lease_s=30)
    assert worker.run_once() == job_id
    answer = jobs.queue.get_job(db, "acme", job_id)
    assert answer.job.status == "failed" and answer.job.error["error"] == "attempts_exhausted"
    assert answer.job.attempts == jobs.queue.DEFAULT_MAX_ATTEMPTS + 1


# ---------------------------------------------------------------------------------------------
# Cancel
# ---------------------------------------------------------------------------------------------


def test_cancel_a_queued_job_ends_it_at_once(db: Database) -> None:
    job_id = _job(db, _dataset(db))
    answer = jobs.queue.cancel_job(db, "acme", job_id)
    assert answer.job.status == "cancelled" and answer.job.finished_at is not None
    assert jobs.leases.claim(db, "worker-a", 30) is None
    assert jobs.queue.cancel_job(db, "acme", job_id).job.status == "cancelled"  # idempotent


def test_cancel_a_running_job_is_seen_by_its_heartbeat(db: Database) -> None:
    job_id = _job(db, _dataset(db))
    claimed = jobs.leases.claim(db, "worker-a", 30)
    assert claimed is not None
    assert jobs.leases.heartbeat(db, claimed.lease, 30).cancel_requested is False
    answer = jobs.queue.cancel_job(db, "acme", job_id)
    assert answer.job.status == "running" and answer.job.cancel_requested is True
    assert jobs.leases.heartbeat(db, claimed.lease, 30).cancel_requested is True
    jobs.leases.finish(db, claimed.lease, "cancelled")
    assert jobs.queue.get_job(db, "acme", job_id).job.status == "cancelled"


def test_a_cancel_requested_while_the_worker_is_dead_is_honoured_by_the_next_claim(
    db: Database, tmp_path: Path
) -> None:
    job_id = _job(db, _dataset(db))
    assert jobs.leases.claim(db, "dead", 1, now=utcnow() - timedelta(minutes=5)) is not None
    jobs.queue.cancel_job(db, "acme", job_id)
    assert Worker(db, artifact_dir=tmp_path).run_once() == job_id
    assert jobs.queue.get_job(db, "acme", job_id).job.status == "cancelled"


def test_a_finished_job_cannot_be_cancelled(db: Database) -> None:
    job_id = _job(db, _dataset(db))
    claimed = jobs.leases.claim(db, "worker-a", 30)
    assert claimed is not None
    jobs.leases.finish(db, claimed.lease, "succeeded")
    with pytest.raises(Conflict) as info:
        jobs.queue.cancel_job(db, "acme", job_id)
    assert info.value.reason == "job_finished"


def test_a_shut_down_worker_hands_its_job_back(db: Database) -> None:
    job_id = _job(db, _dataset(db))
    claimed = jobs.leases.claim(db, "worker-a", 30)
    assert claimed is not None
    jobs.leases.release(db, claimed.lease)
    again = jobs.leases.claim(db, "worker-b", 30)
    assert again is not None and again.id == job_id and again.attempt == 2


# ---------------------------------------------------------------------------------------------
# The data source: the dataset's, read when the job runs
# ---------------------------------------------------------------------------------------------


def test_a_queued_job_reads_the_source_its_dataset_has_when_it_runs(db: Database, tmp_path: Path) -> None:
    """An admin replaces the source of a dataset that has a job queued: the worker reads the
    dataset's source when the job runs, so the job trains on the new one. The old one holds
    other records than the dataset's batches: a job that read it would fail before training."""
    pytest.importorskip("torch")
    old = "builtin:stream?blocks=1&block_size=8"
    assert set(load_data(old).record_ids).isdisjoint(digits_train_ids())
    world = digits_dataset(db, epsilon="10", source=old)
    job_id = _job(db, world.dataset_id)
    datasets.set_data_source(db, "acme", world.dataset_id, data_source=DIGITS)
    loader = CountingLoader()
    assert Worker(db, artifact_dir=tmp_path, loader=loader, device="cpu").run_once() == job_id
    assert loader.opened == [DIGITS]
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert (job.job.progress_step, job.job.progress_total) == (10, 10)
    assert [v.version for v in versions_of(db, job_id)] == [1]
