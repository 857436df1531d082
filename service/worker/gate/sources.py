"""The dataset's data source: loaded only once a reservation is granted, and checked against the
ledger's batches before any training (``service.worker.gate``, step 2).

Why its own module: the source is the one thing the gate reads that holds private data. Which
source (the dataset's, set by an admin of its tenant; never a job's params), through which data
roots, and the check that its training records are exactly the ledger's (compared as stored:
HMAC-SHA256 with the dataset's salt; errors give counts and batch ids, never a record id) are
decided here, for the one-reservation and the staged runs alike.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from service.db.session import Database
from service.ledger import datasets
from service.ledger.batches import record_batches, record_hash, task_layout
from service.training.stages import LedgerBatch, LedgerTask
from service.worker.gate.attempt import Run, fail
from service.worker.gate.failures import failure_log, job_error

if TYPE_CHECKING:
    from service.contract.data_roots import DataRoots
    from service.training.data import LoadedData

logger = logging.getLogger("service.worker.gate")  # one logger for the whole gate, as before its split

Loader = Callable[[str, str], "LoadedData"]
"""``loader(uri, tenant_id)``: the records of the dataset's source, read within the tenant's
data roots (``SourceLoader``)."""

SOURCE_FIELD: Final = "data_source"  # the dataset's (errors of a job's source name it)
_SAMPLE: Final = 5  # how many source task indices an error names


@dataclass(frozen=True)
class SourceLoader:
    """The worker's loader: ``load_data(uri, roots.for_tenant(tenant_id))``."""

    roots: DataRoots

    def __call__(self, uri: str, tenant_id: str) -> LoadedData:
        from service.training.data import load_data

        return load_data(uri, self.roots.for_tenant(tenant_id))


def default_loader(uri: str, tenant_id: str) -> LoadedData:
    """``SourceLoader`` over the data roots of the environment's settings (``ledger worker``,
    ``ledger serve``); an app built with explicit settings passes its own ``SourceLoader``."""
    from service.contract.data_roots import DataRoots
    from service.settings import Settings

    return SourceLoader(DataRoots.of(Settings()))(uri, tenant_id)


def ledger_tasks(db: Database, dataset_id: str) -> list[LedgerTask]:
    """The dataset's tasks in creation order, each with its batches in position order; a task
    without batches is left out."""
    return [
        LedgerTask(
            t.id, i, t.name, tuple(LedgerBatch(b, t.id, position, size) for b, position, size in t.batches)
        )
        for i, t in enumerate(t for t in task_layout(db, dataset_id) if t.batches)
    ]


def check_source_records(db: Database, dataset_id: str, data: LoadedData) -> dict[str, list[str]]:
    """The source's training record ids of each ledger batch (``{batch id: [record id, ...]}``).

    Raises ``RecordMismatchError`` unless the source's training record ids are exactly the records
    of the dataset's batches (compared as stored: HMAC-SHA256 with the dataset's salt)."""
    from service.training.data import RecordMismatchError

    salt, in_ledger = record_batches(db, dataset_id)
    seen: dict[bytes, str] = {}
    unexpected = 0
    duplicated = 0
    of_batch: dict[str, list[str]] = {}
    for record_id in data.record_ids:
        digest = record_hash(salt, str(record_id))
        if digest in seen:
            duplicated += 1
            continue
        seen[digest] = record_id
        if digest not in in_ledger:
            unexpected += 1
        else:
            of_batch.setdefault(in_ledger[digest], []).append(record_id)
    # Counts and batch ids only: naming the ids let a trainer learn them from the error.
    lacking = Counter(batch for digest, batch in in_ledger.items() if digest not in seen)
    if lacking or unexpected or duplicated:
        raise RecordMismatchError(
            data.uri,
            missing=sum(lacking.values()),
            unexpected=unexpected,
            duplicated=duplicated,
            missing_batches=lacking,
        )
    return of_batch


def check_source_tasks(
    data: LoadedData, tasks: Sequence[LedgerTask], of_batch: Mapping[str, list[str]]
) -> None:
    """Raise ``DataSourceError`` unless every ledger task holds exactly the records of one task
    of the source, each source task matched once (a staged run reads task by task)."""
    from service.contract.data_sources import DataSourceError

    source_task = {r: split.task for split in data.train for r in split.record_ids}
    sizes = {split.task: len(split) for split in data.train if len(split)}
    matched: dict[int, str] = {}
    for task in tasks:
        records = [r for batch_id in task.batch_ids for r in of_batch.get(batch_id, ())]
        found = {source_task[r] for r in records}
        if len(found) != 1 or sizes[min(found)] != len(records) or min(found) in matched:
            raise DataSourceError(
                f"{data.uri}: the records of the ledger's task {task.name!r} are not exactly one "
                f"task of the source (they come from source task(s) {sorted(found)[:_SAMPLE]})."
            )
        matched[min(found)] = task.id
    if len(matched) != len(sizes):
        raise DataSourceError(
            f"{data.uri}: source tasks {sorted(set(sizes) - set(matched))[:_SAMPLE]} have no ledger task."
        )


def load_checked(run: Run, loader: Loader) -> tuple[LoadedData, dict[str, list[str]]]:
    """Load the dataset's data source (call only once a reservation is granted) and check it
    against the ledger's batches; a bad source fails the job. Returns the data and each batch's
    records. The job's own params are not consulted: the source belongs to the dataset."""
    from service.contract.data_sources import DataSourceError

    uri = datasets.data_source(run.db, run.job.tenant_id, run.job.dataset_id)
    if uri is None:
        message = (
            f"dataset {run.job.dataset_id!r} has no data source: an admin sets it with "
            "PUT /v1/datasets/{id}/data-source."
        )
        raise fail(run, job_error("data_source", message, field=SOURCE_FIELD))
    try:
        data = loader(uri, run.job.tenant_id)
        run.record_ids = frozenset(data.record_ids)
        return data, check_source_records(run.db, run.job.dataset_id, data)
    except DataSourceError as exc:  # its messages carry no cell and no record id
        code = "record_mismatch" if type(exc).__name__ == "RecordMismatchError" else "data_source"
        raise fail(run, job_error(code, str(exc), field=SOURCE_FIELD)) from None
    except (OSError, ImportError, ValueError) as exc:  # unreadable file, loader dependency missing
        # the type only: a library's message may quote what it read
        logger.error("job %s: could not load its data source: %s", run.job.id, failure_log(exc, ()))
        message = f"could not load the data source ({type(exc).__name__})."
        raise fail(run, job_error("data_source", message, field=SOURCE_FIELD)) from None


__all__ = [
    "SOURCE_FIELD",
    "Loader",
    "SourceLoader",
    "check_source_records",
    "check_source_tasks",
    "default_loader",
    "ledger_tasks",
    "load_checked",
]
