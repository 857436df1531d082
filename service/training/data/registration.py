"""Registering a source's training records with a ledger, through a ``LedgerClient``: one task per
task of the source, its records cut into batches (the client itself imports no training code).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from service.contract.data_roots import TenantRoots
from service.training.data.loading import load_data

if TYPE_CHECKING:
    from service.client import LedgerClient


def register_source(
    client: LedgerClient,
    dataset_id: str | int,
    *,
    source: str | None = None,
    batch_size: int | None = None,
    roots: TenantRoots | None = None,
) -> list[dict[str, object]]:
    """Register the training records of a data source as the dataset's tasks and batches,
    through ``client`` (an admin's ``LedgerClient``): one task per task of the source
    (``task-0``, ``task-1``, ...), its records in source order cut into batches of ``batch_size``
    (default: one batch per task), named ``task-<t>/batch-<i>``. Answers ``[{id, name, batches:
    [{id, name, size}]}]``.

    ``source``: the URI (default: the dataset's ``data_source``), read *here*, by this process:
    ``builtin:`` sources need numpy and scikit-learn, a ``file://`` source the ``roots`` it lies
    under. The record ids of the built-in sources are public (``digits-0000`` ...
    ``digits-1796``, ``stream-0000000`` ...; ``service.contract.data_sources``); a job's run reserves on every
    batch and checks that the source's training records are exactly the batches' records.
    Idempotency keys are derived from the dataset, the source and the task, so running it again
    after a failure creates nothing twice. Here, not on ``LedgerClient``: it reads the data, and
    the client imports no training code."""
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1. Found {batch_size!r}.")
    uri = source if source is not None else client.get_dataset(dataset_id).get("data_source")
    if not uri:
        raise ValueError(f"dataset {dataset_id!r} has no data_source; pass source=.")
    data = load_data(str(uri), roots)
    run = hashlib.sha256(f"{dataset_id}\n{uri}".encode()).hexdigest()[:24]
    out: list[dict[str, object]] = []
    for split in data.train:
        if not len(split):
            continue
        records = list(split.record_ids)
        size = batch_size or len(records)
        name = f"task-{split.task}"
        task = client.create_task(dataset_id, name, idempotency_key=f"register:{run}:{name}")
        batches = [
            {"name": f"{name}/batch-{i // size:04d}", "records": records[i : i + size]}
            for i in range(0, len(records), size)
        ]
        created = client.create_batches(
            dataset_id, task["id"], batches, idempotency_key=f"register:{run}:{name}:batches"
        )
        out.append({"id": task["id"], "name": name, "batches": created["data"]})
    return out
