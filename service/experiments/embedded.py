"""The ledger an experiment runs against: a database (by default a fresh SQLite file in the
experiment's output folder), migrated, one tenant, and an in-process worker that runs each job
through the release gate exactly as ``ledger serve`` / ``ledger worker`` do.

``register_source`` plays the data owner: it reads the source's training record ids (ids only,
as a client does before queuing jobs on that source) and registers one ledger task per source
task, cut into fixed batches. ``run_job`` queues a job and runs it to its end; its answer holds
the job, its published versions with their metrics, and the dataset's spend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.db.migrations import upgrade
from service.db.session import Database
from service.ledger import batches, datasets, jobs, spent, tenancy
from service.ledger import model_registry as registry
from service.ledger.errors import NotFound
from service.ledger.jobs.answers import JobAnswer
from service.ledger.spent import DatasetSpend
from service.worker.worker import Worker

TENANT = "experiments"


@dataclass(frozen=True)
class RegisteredTask:
    id: str
    name: str
    batch_ids: tuple[str, ...]


@dataclass(frozen=True)
class RegisteredDataset:
    id: str
    uri: str
    tasks: tuple[RegisteredTask, ...]

    @property
    def batch_ids(self) -> tuple[str, ...]:
        return tuple(b for t in self.tasks for b in t.batch_ids)


@dataclass(frozen=True)
class JobResult:
    """A finished job: its answer (``jobs.queue.get_job``'s ``job``), its versions (oldest first,
    with metrics and certificate ids) and its dataset's spend after it (``spent.get_spend``)."""

    job: JobAnswer
    versions: list[registry.Version]
    spend: DatasetSpend

    @property
    def status(self) -> str:
        return self.job.status


class EmbeddedLedger:
    """A ledger and an in-process worker for one experiment (module docstring)."""

    def __init__(self, out_dir: Path, *, database_url: str | None = None, device: str | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.url = database_url or f"sqlite:///{(out_dir / 'ledger.db').resolve()}"
        upgrade(self.url)
        self.db = Database(self.url)
        tenancy.create_api_key(self.db, TENANT, "viewer")  # makes sure the tenant exists
        self.worker = Worker(self.db, artifact_dir=out_dir / "artifacts", device=device)

    def close(self) -> None:
        self.db.dispose()

    def __enter__(self) -> EmbeddedLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register_source(
        self,
        uri: str,
        *,
        name: str,
        budget: Mapping[str, Any],
        batch_size: int,
        task_order: Sequence[int] | None = None,
    ) -> RegisteredDataset:
        """A dataset with ``budget`` whose ledger tasks are the source's tasks (in ``task_order``,
        default the source's), each cut into batches of ``batch_size`` records in source order
        (the last one may be smaller)."""
        from service.training.data import load_data

        source = load_data(uri)
        dataset = datasets.create_dataset(self.db, TENANT, name=name, budget=budget, data_source=uri)
        splits = {split.task: split for split in source.train if len(split)}
        order = list(task_order) if task_order is not None else sorted(splits)
        registered = []
        for index in order:
            ids = splits[index].record_ids
            task = batches.create_task(self.db, TENANT, dataset.id, name=f"task-{index}")
            chunks = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
            created = batches.create_batches(
                self.db,
                TENANT,
                dataset.id,
                task.id,
                batches=[{"name": f"t{index}-b{i}", "records": list(c)} for i, c in enumerate(chunks)],
            )
            registered.append(RegisteredTask(task.id, task.name, tuple(b.id for b in created.data)))
        return RegisteredDataset(dataset.id, uri, tuple(registered))

    def run_job(
        self, dataset: RegisteredDataset, algorithm: str, params: Mapping[str, Any], *, model_name: str
    ) -> JobResult:
        """Queue ``algorithm`` on the dataset and run it (in this process) to its end."""
        job = jobs.queue.create_job(
            self.db,
            TENANT,
            dataset_id=dataset.id,
            algorithm=algorithm,
            params={"model_name": model_name, **params},
        )
        while self.worker.run_once() is not None:
            pass
        answer = jobs.queue.get_job(self.db, TENANT, job.id)
        return JobResult(answer.job, self.versions(model_name), spent.get_spend(self.db, TENANT, dataset.id))

    def versions(self, model_name: str) -> list[registry.Version]:
        """Every published version of ``model_name``, oldest first (none: ``[]``)."""
        found: list[registry.Version] = []
        while True:
            try:
                page = registry.list_versions(
                    self.db, TENANT, model_name, limit=registry.MAX_PAGE, offset=len(found)
                ).data
            except NotFound:
                return found
            found.extend(page)
            if len(page) < registry.MAX_PAGE:
                return found

    def spend(self, dataset: RegisteredDataset) -> DatasetSpend:
        return spent.get_spend(self.db, TENANT, dataset.id)


__all__ = ["TENANT", "EmbeddedLedger", "JobResult", "RegisteredDataset", "RegisteredTask"]
