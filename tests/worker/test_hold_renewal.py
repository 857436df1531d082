"""The worker keeps its job's hold alive (``service.worker.worker``, "Holds"): a job that runs
longer than the reservation's TTL — here its data source takes three TTLs to read, after the
reserve — is renewed by the heartbeat (``reservation.extended`` in the audit log) and commits;
the same job on a worker that renews nothing would end ``reservation_expired``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select

pytest.importorskip("torch")

from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import jobs, spent
from service.ledger.jobs.answers import JobAnswer
from service.training.data import LoadedData, load_data
from service.worker.worker import Worker
from tests.worker.digits_world import digits_dataset, reservation

pytestmark = pytest.mark.slow

TTL_S = 1.5


def _slow_digits(uri: str, tenant_id: str) -> LoadedData:
    time.sleep(3 * TTL_S)  # a slow source, read after the reserve: the hold outlives its TTL
    return load_data(uri)


def _run(db: Database, tmp_path: Path, *, ttl_s: float) -> tuple[JobAnswer, str]:
    world = digits_dataset(db, epsilon="10")
    job_id = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.5, "sampling_probability": 0.02, "steps": 20, "hidden": 8},
    ).id
    # The job's lease is the worker's own (a heartbeat every lease_s / 3 renews it and the hold);
    # at 0.6 s a heartbeat late by half a second on a loaded machine gave the job up, unfinished.
    worker = Worker(
        db, artifact_dir=tmp_path / "artifacts", reservation_ttl_s=ttl_s, lease_s=1.5, loader=_slow_digits
    )
    assert worker.run_once() == job_id
    return jobs.queue.get_job(db, "acme", job_id).job, world.dataset_id


def test_a_job_longer_than_its_holds_ttl_renews_it_and_commits(db: Database, tmp_path: Path) -> None:
    job, dataset_id = _run(db, tmp_path, ttl_s=TTL_S)
    assert job.status == "succeeded", job.error
    assert job.reservation_id is not None
    held = reservation(db, job.reservation_id)
    assert held.status == "committed"
    assert (held.expires_at - held.created_at).total_seconds() > 2 * TTL_S  # renewed past its TTL
    with db.session(readonly=True) as session:
        renewals = session.scalars(
            select(AuditEntry.payload).where(AuditEntry.event_type == "reservation.extended")
        ).all()
    assert len(renewals) >= 2 and all(p["reservation_id"] == held.id for p in renewals)
    assert spent.get_spend(db, "acme", dataset_id).to_json()["reservations_open"] == 0


def test_without_renewal_the_same_job_loses_its_hold(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fault the renewal prevents, produced for real: the heartbeat renews nothing.
    monkeypatch.setattr(Worker, "_renew_hold", lambda self, job, hold, sent, last: last)
    job, _ = _run(db, tmp_path, ttl_s=TTL_S)
    assert job.status == "failed"
    assert "expired" in str(job.error)
