"""Issue 24 §2 for the built-in worker: a job is charged for what ran, never for less.

The worker holds the data and every output, so it aborts through the in-process-only
``reservations.abort(ran=...)``: a job that failed before any DP-SGD step is refunded; a job that
failed after k steps is charged exactly the k-step prefix of its reserved run (priced as the
ledger prices that event: ``quotes.quote``), with a certificate of ``outcome: "aborted"`` and
release null, and only the steps never begun are returned. Real ledger on both databases, real
torch training on builtin:digits, a real ``ENOTDIR`` from the kernel for the failure.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from sqlalchemy import select

from accountant.certificates import verify
from accountant.exact import to_text
from service.contract.data_roots import DataRoots
from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import certificates, datasets, jobs, quotes, spent
from service.ledger.jobs.answers import JobDetail
from service.ledger.reservations import parse_event
from service.worker.worker import Worker
from tests.worker.digits_world import CountingLoader, digits_dataset, reservation, versions_of


def _job(db: Database, artifacts: Path, **params: Any) -> tuple[str, JobDetail]:
    world = digits_dataset(db, epsilon="10")
    job = jobs.queue.create_job(db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params)
    Worker(db, artifact_dir=artifacts, loader=CountingLoader(), device="cpu").run_once()
    return world.dataset_id, jobs.queue.get_job(db, "acme", str(job.id))


def _audit_payloads(db: Database, dataset_id: str, event_type: str) -> list[dict[str, Any]]:
    query = select(AuditEntry.payload).where(
        AuditEntry.chain == dataset_id, AuditEntry.event_type == event_type
    )
    return [dict(row.payload) for row in db.read_all(query)]


@pytest.mark.slow
def test_a_job_failing_after_k_steps_is_charged_exactly_the_k_step_prefix(
    db: Database, tmp_path: Path
) -> None:
    # Staging the first checkpoint (step 7) fails: the artifact dir's parent is a file (ENOTDIR).
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the artifact dir's parent should be")
    dataset_id, job = _job(
        db, blocker / "artifacts", noise_multiplier=1.5, steps=20, checkpoint_every=7, seed=3
    )
    assert job.job.status == "failed" and job.job.error["error"] == "training_failed", job
    assert versions_of(db, job.job.id) == []
    held = reservation(db, job.job.reservation_id)
    assert held.status == "aborted"
    prefix = {**held.event, "count": 7}  # self_composed(poisson_sampled(gaussian)), 7 of 20 steps
    assert held.event["kind"] == "self_composed" and held.event["count"] == 20
    priced = quotes.quote(db, "acme", dataset_id, event=parse_event(prefix), new_batch=True).quote
    assert priced.epsilon > 0  # from empty
    assert (held.committed_epsilon, held.committed_delta) == (priced.epsilon, priced.delta)
    assert held.committed_epsilon < held.epsilon  # the 13 steps never begun went back
    ledger = spent.get_spend(db, "acme", dataset_id).to_json()
    assert (ledger["epsilon_spent"], ledger["epsilon_held"]) == (to_text(priced.epsilon), "0")
    assert Decimal(jobs.queue.get_job(db, "acme", job.job.id).job.epsilon_committed) == held.committed_epsilon
    (stored,) = certificates.list_certificates(db, "acme", dataset_id)["data"]
    body = stored["certificate"]
    assert (stored["outcome"], stored["release"], body["release"]) == ("aborted", None, None)
    assert body["inputs"]["partial_event"] == prefix and verify(body).ok
    (entry,) = _audit_payloads(db, dataset_id, "reservation.aborted")
    assert (entry["certificate_id"], entry["content_hash"]) == (stored["id"], stored["content_hash"])


def test_a_job_failing_before_reading_data_is_refunded(db: Database, tmp_path: Path) -> None:
    # The dataset's file source was there when its admin set it, and is gone when the job runs.
    root = tmp_path / "data"
    root.mkdir()
    roots = DataRoots({"*": [str(root)]})
    source = root / "gone.npz"
    source.write_bytes(b"")
    world = digits_dataset(db, epsilon="10", source=None)
    datasets.set_data_source(db, "acme", world.dataset_id, data_source=f"file://{source}", data_roots=roots)
    job = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.5, "steps": 5},
    )
    source.unlink()
    Worker(
        db, artifact_dir=tmp_path / "artifacts", loader=CountingLoader(roots=roots), device="cpu"
    ).run_once()
    answer = jobs.queue.get_job(db, "acme", str(job.id))
    assert answer.job.status == "failed" and answer.job.error["error"] == "data_source", answer
    assert reservation(db, answer.job.reservation_id).status == "aborted"
    ledger = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert (ledger["epsilon_spent"], ledger["epsilon_held"]) == ("0", "0")
    assert certificates.list_certificates(db, "acme", world.dataset_id)["count"] == 0
    (entry,) = _audit_payloads(db, world.dataset_id, "reservation.aborted")
    assert "certificate_id" not in entry and entry["committed"]["epsilon"] == "0"
