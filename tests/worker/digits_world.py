"""Datasets for the gate and worker tests, made through the ledger's own operations (no mocks).

``digits_dataset`` registers the training records of ``builtin:digits`` (scikit-learn's bundled
8×8 digits, record ids ``digits-NNNN``) as a dataset's batches, and that source as the dataset's
own (an admin's call), exactly as a client would before it queues a job on the dataset.
``CountingLoader`` is the worker's real loader (``gate.SourceLoader`` over the given data roots),
counting calls, so a test can prove that a refused job never opened its data source.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from service.client import LedgerClient
from service.contract.data_roots import DataRoots
from service.db.models import Job, ModelVersion, Reservation
from service.db.session import Database
from service.ledger import batches, datasets, tenancy
from service.training.data import LoadedData, load_data
from service.worker.gate import SourceLoader

DIGITS = "builtin:digits"
_serial = itertools.count(1)


@functools.cache
def digits_train_ids() -> tuple[str, ...]:
    """The training record ids of ``builtin:digits`` (the test harness reads them; the worker
    reads the source only after its reservation)."""
    return load_data(DIGITS).record_ids


def budget(epsilon: str = "3", delta: str = "1e-5") -> dict[str, Any]:
    return {"rule": "sequential", "epsilon": epsilon, "delta": delta, "accountant": "rdp"}


@dataclass(frozen=True)
class DigitsDataset:
    tenant: str
    dataset_id: str
    batch_ids: tuple[str, ...]


def digits_dataset(
    db: Database,
    tenant: str = "acme",
    *,
    epsilon: str = "3",
    delta: str = "1e-5",
    n_batches: int = 2,
    records: Sequence[str] | None = None,
    source: str | None = DIGITS,
) -> DigitsDataset:
    """A sequential/RDP dataset whose batches hold ``records`` (default: every digits training
    id), reading ``source`` (default ``builtin:digits``; ``None``: no source set)."""
    tenancy.create_api_key(db, tenant, "viewer")  # makes sure the tenant exists
    ids = list(records if records is not None else digits_train_ids())
    dataset = datasets.create_dataset(
        db, tenant, name=f"digits-{next(_serial)}", budget=budget(epsilon, delta), data_source=source
    )
    task = batches.create_task(db, tenant, dataset.id, name="all")
    size = -(-len(ids) // n_batches)
    created = batches.create_batches(
        db,
        tenant,
        dataset.id,
        task.id,
        batches=[{"name": f"b{i}", "records": ids[i * size : (i + 1) * size]} for i in range(n_batches)],
    )
    return DigitsDataset(tenant, dataset.id, tuple(b.id for b in created.data))


def task_dataset(
    db: Database,
    budget: Mapping[str, Any],
    per_task: Sequence[Sequence[str]],
    *,
    batch_size: int | None = None,
    name: str = "tasks",
    tenant: str = "acme",
    source: str | None = None,
    data_roots: DataRoots | None = None,
) -> tuple[str, list[str]]:
    """A dataset with one ledger task ``t<i>`` per list of ``per_task``, cut into batches of
    ``batch_size`` records (default: two halves), reading ``source`` (checked against
    ``data_roots``; ``None``: no source set). Returns the dataset id and the task ids."""
    tenancy.create_api_key(db, tenant, "viewer")  # makes sure the tenant exists
    dataset = datasets.create_dataset(
        db,
        tenant,
        name=f"{name}-{next(_serial)}",
        budget=budget,
        data_source=source,
        data_roots=data_roots,
    )
    task_ids = []
    for index, ids in enumerate(per_task):
        size = batch_size or -(-len(ids) // 2)
        task = batches.create_task(db, tenant, dataset.id, name=f"t{index}")
        batches.create_batches(
            db,
            tenant,
            dataset.id,
            task.id,
            batches=[
                {"name": f"t{index}b{i}", "records": list(ids[i : i + size])}
                for i in range(0, len(ids), size)
            ],
        )
        task_ids.append(task.id)
    return dataset.id, task_ids


def source_tasks(uri: str) -> list[list[str]]:
    """The training record ids of each task of the source ``uri``."""
    return [list(split.record_ids) for split in load_data(uri).train]


@dataclass
class CountingLoader:
    """The worker's real loader (``SourceLoader`` over ``roots``), counting the sources it opened."""

    opened: list[str] = field(default_factory=list)
    delay_s: float = 0.0
    roots: DataRoots = field(default_factory=DataRoots)

    def __call__(self, uri: str, tenant_id: str) -> LoadedData:
        self.opened.append(uri)
        if self.delay_s:
            import time

            time.sleep(self.delay_s)
        return SourceLoader(self.roots)(uri, tenant_id)


def staged_files(artifact_dir: Path) -> list[str]:
    folder = artifact_dir / ".staging"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def versions_of(db: Database, job_id: str) -> list[ModelVersion]:
    with db.session(readonly=True) as session:
        return list(
            session.scalars(
                select(ModelVersion).where(ModelVersion.job_id == job_id).order_by(ModelVersion.version)
            )
        )


def reservation(db: Database, reservation_id: str) -> Reservation:
    with db.session(readonly=True) as session:
        row = session.get(Reservation, reservation_id)
        assert row is not None
        return row


def job_row(db: Database, job_id: str) -> Job:
    with db.session(readonly=True) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def claim_concurrently(db: Database, workers: int) -> list[str]:
    """Ids of the jobs ``workers`` threads claim, started together, until none is left (each
    claim a separate worker id); raises the first error a claimer met."""
    import threading

    from service.ledger import jobs

    claimed: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers)
    lock = threading.Lock()

    def claimer(n: int) -> None:
        try:
            barrier.wait()
            while (job := jobs.leases.claim(db, f"worker-{n}", 30)) is not None:
                with lock:
                    claimed.append(job.id)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return claimed


def client_for(url: str, key: str) -> LedgerClient:
    """A client of the test server that retries quickly."""
    return LedgerClient(url, key, timeout=30.0, backoff_s=0.01)


def finished_job(client: LedgerClient, job_id: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """The job once it has ended (succeeded, failed or cancelled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get_job(job_id)
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")
