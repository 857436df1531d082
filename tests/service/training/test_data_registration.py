"""``register_source`` (service.training.data.registration): a source's training records registered
through an admin's ``LedgerClient``, over real HTTP (Starlette's ``TestClient`` transport into
``create_app``) on a real database, then read back from the ledger: the tasks and batches the
client lists, and the batch each record hash was stored under."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from service.app import create_app
from service.client import LedgerClient
from service.contract.data_roots import DataRoots, TenantRoots
from service.db.session import Database
from service.ledger import tenancy
from service.ledger.batches import record_batches, record_hash
from service.settings import Settings
from service.training.data import load_data, register_source

with warnings.catch_warnings():
    # Starlette asks for httpx2 in a deprecation warning; httpx is what the project pins.
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TENANT = "acme"


@pytest.fixture
def roots(tmp_path: Path) -> TenantRoots:
    return DataRoots({TENANT: [str(tmp_path)]}).for_tenant(TENANT)


@pytest.fixture
def admin(database_url: URL, db: Database, tmp_path: Path) -> Iterator[LedgerClient]:
    """An admin's client of the real app on ``db``, whose data roots hold ``tmp_path``."""
    settings = Settings(
        database_url=database_url.render_as_string(hide_password=False),
        artifact_dir=tmp_path / "artifacts",
        data_roots={TENANT: [str(tmp_path)]},
    )
    key = tenancy.create_api_key(db, TENANT, "admin")
    with (
        TestClient(create_app(settings, database=db), raise_server_exceptions=False) as http,
        LedgerClient(str(http.base_url), key, transport=http._transport) as client,
    ):
        yield client


def _csv_source(tmp_path: Path) -> str:
    """Two tasks of training records (three and two, interleaved in the file) and a test record."""
    path = tmp_path / "source.csv"
    rows = [
        ["record_id", "f1", "label", "task", "split"],
        ["r-a", "0.1", "0", "0", "train"],
        ["r-b", "0.2", "1", "1", "train"],
        ["r-c", "0.3", "0", "0", "train"],
        ["held-out", "0.4", "1", "0", "test"],
        ["r-d", "0.5", "1", "1", "train"],
        ["r-e", "0.6", "0", "0", "train"],
    ]
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return f"file://{path}"


def test_the_source_registers_as_one_task_per_task_cut_into_batches_and_reads_back(
    admin: LedgerClient, db: Database, tmp_path: Path, roots: TenantRoots
) -> None:
    uri = _csv_source(tmp_path)
    dataset = admin.create_dataset("csv", rule="sequential", epsilon="1", delta="1e-5", data_source=uri)
    # No source=: the dataset's own data_source, read here, under the given roots.
    tasks: list[dict[str, Any]] = register_source(admin, dataset["id"], batch_size=2, roots=roots)

    source = load_data(uri, roots)
    expected = {f"task-{split.task}": split.record_ids for split in source.train}
    assert [t["name"] for t in tasks] == list(expected) == ["task-0", "task-1"]
    records_of: dict[str, tuple[str, ...]] = {}
    for task in tasks:
        ids = expected[task["name"]]
        chunks = [ids[i : i + 2] for i in range(0, len(ids), 2)]  # source order, the last smaller
        assert [(b["name"], b["size"]) for b in task["batches"]] == [
            (f"{task['name']}/batch-{i:04d}", len(chunk)) for i, chunk in enumerate(chunks)
        ]
        records_of.update({b["id"]: chunk for b, chunk in zip(task["batches"], chunks, strict=True)})

    # What the ledger holds: the tasks and batches its API lists, and each record's batch.
    listed = admin.list_tasks(dataset["id"])
    assert [(t["id"], t["name"]) for t in listed["data"]] == [(t["id"], t["name"]) for t in tasks]
    for task in tasks:
        page = admin.list_batches(dataset["id"], task["id"])
        assert [b["id"] for b in page["data"]] == [b["id"] for b in task["batches"]]
    salt, stored = record_batches(db, dataset["id"])
    assert stored == {record_hash(salt, r): batch for batch, ids in records_of.items() for r in ids}
    assert record_hash(salt, "held-out") not in stored  # test records are not ledgered

    again = register_source(admin, dataset["id"], batch_size=2, roots=roots)  # idempotent
    assert again == tasks and admin.list_tasks(dataset["id"])["count"] == 2


def test_without_a_batch_size_each_task_is_one_batch(
    admin: LedgerClient, tmp_path: Path, roots: TenantRoots
) -> None:
    uri = _csv_source(tmp_path)
    dataset = admin.create_dataset("csv", rule="sequential", epsilon="1", delta="1e-5")  # no source
    tasks: list[dict[str, Any]] = register_source(admin, dataset["id"], source=uri, roots=roots)
    sizes = {f"task-{split.task}": len(split) for split in load_data(uri, roots).train}
    assert {t["name"]: [b["size"] for b in t["batches"]] for t in tasks} == {
        name: [size] for name, size in sizes.items()
    }


@pytest.mark.parametrize("batch_size", [0, True])
def test_a_bad_batch_size_is_refused_before_anything_is_registered(
    admin: LedgerClient, tmp_path: Path, roots: TenantRoots, batch_size: int
) -> None:
    uri = _csv_source(tmp_path)
    dataset = admin.create_dataset("csv", rule="sequential", epsilon="1", delta="1e-5", data_source=uri)
    with pytest.raises(ValueError, match=rf"batch_size must be an integer >= 1\. Found {batch_size!r}\."):
        register_source(admin, dataset["id"], batch_size=batch_size, roots=roots)
    assert admin.list_tasks(dataset["id"])["count"] == 0


def test_a_dataset_without_a_source_needs_one_named(admin: LedgerClient, roots: TenantRoots) -> None:
    dataset = admin.create_dataset("bare", rule="sequential", epsilon="1", delta="1e-5")
    with pytest.raises(ValueError, match="has no data_source; pass source="):
        register_source(admin, dataset["id"], roots=roots)
    assert admin.list_tasks(dataset["id"])["count"] == 0
