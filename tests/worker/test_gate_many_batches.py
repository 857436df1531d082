"""Issue 24 §5 (finding 3): the worker reserved a job's run by a list of batch ids, which the
ledger caps at 10 000 (``MAX_IDS_PER_REQUEST``), so a job on a dataset of more batches failed
after calibrating ("batches must hold at most 10000 ids"). It now prices and reserves by task
(up to 2 000 000 batches). Real ledger on SQLite and PostgreSQL, real worker, real torch training
on a generated ``builtin:stream`` of 10 001 one-record batches (kept small: one step)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

pytest.importorskip("torch")

from accountant import events as ev
from service.db.models import Reservation
from service.db.session import Database
from service.ledger import batches, datasets, jobs, quotes, tenancy
from service.ledger.spending.requests import MAX_IDS_PER_REQUEST
from service.training.data import load_data
from service.worker.worker import Worker
from tests.worker.digits_world import CountingLoader, budget, reservation

N_BATCHES = MAX_IDS_PER_REQUEST + 1
SOURCE = f"builtin:stream?blocks={N_BATCHES}&block_size=1&dim=4"


def many_batches(db: Database) -> tuple[str, str]:
    """A dataset reading ``SOURCE`` with one task of ``N_BATCHES`` one-record batches."""
    tenancy.create_api_key(db, "acme", "viewer")
    dataset = datasets.create_dataset(db, "acme", name="stream", budget=budget("3"), data_source=SOURCE)
    task = batches.create_task(db, "acme", dataset.id, name="all")
    ids = load_data(SOURCE).record_ids
    assert len(ids) == N_BATCHES
    for start in range(0, N_BATCHES, MAX_IDS_PER_REQUEST):  # at most 10 000 batches a request
        chunk = ids[start : start + MAX_IDS_PER_REQUEST]
        batches.create_batches(
            db,
            "acme",
            dataset.id,
            task.id,
            batches=[{"name": f"b{start + i}", "records": [r]} for i, r in enumerate(chunk)],
        )
    return str(dataset.id), str(task.id)


@pytest.mark.slow
def test_a_dataset_of_more_than_10000_batches_is_reserved_by_task(db: Database, tmp_path: Path) -> None:
    dataset_id, _ = many_batches(db)
    # the calibration's prices (target_epsilon) cover every batch, by state class, not by ids
    prices = quotes.DatasetPrices(db, "acme", dataset_id)
    assert prices.price(ev.GaussianEvent(5.0)) > 0

    loader = CountingLoader()
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=loader, device="cpu")
    params = {"noise_multiplier": 5.0, "steps": 1, "seed": 1}
    job_id = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params=params).id
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert loader.opened == [SOURCE]
    held = reservation(db, job.job.reservation_id)
    assert held.status == "committed" and held.batches == N_BATCHES  # every batch is charged
    assert Decimal(job.job.epsilon_committed) > 0


@pytest.mark.slow
def test_a_staged_stage_of_more_than_10000_batches_is_reserved_by_its_task(
    db: Database, tmp_path: Path
) -> None:
    """A staged job (NaiveGaussian: one stage per task) whose one stage reads a whole task of
    10 001 batches: reserved by task (it failed "batches must hold at most 10000 ids"), every
    batch of the stage held, committed and released."""
    dataset_id, _ = many_batches(db)
    loader = CountingLoader()
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=loader, device="cpu")
    params = {"noise_multiplier": 5.0, "sampling_probability": 0.0002, "seed": 1}
    job_id = jobs.queue.create_job(
        db, "acme", dataset_id=dataset_id, algorithm="naive_gaussian", params=params
    ).id
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert loader.opened == [SOURCE]
    with db.session(readonly=True) as session:
        held = session.scalars(select(Reservation).where(Reservation.dataset_id == dataset_id)).all()
    assert [(r.status, r.batches) for r in held] == [("committed", N_BATCHES)]
    assert Decimal(job.job.epsilon_committed) > 0
