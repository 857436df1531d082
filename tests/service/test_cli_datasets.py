"""``ledger datasets archive|unarchive NAME_OR_ID`` against a real server (uvicorn on TCP): by
name and by id, idempotent, and every refusal a one-line error naming what was wrong (an unknown
name, a viewer key, an open hold, no URL), exit 2, nothing changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from service.cli import main as cli_main
from service.client import LedgerClient
from service.db.session import Database
from service.ledger import tenancy
from tests.service.live_server import serve, settings_for

PURE = {"kind": "laplace", "scale": 4.0}


@pytest.fixture
def world(database_url: URL, db: Database, tmp_path: Path) -> Iterator[dict[str, Any]]:
    keys = {
        "admin": tenancy.create_api_key(db, "acme", "admin"),
        "viewer": tenancy.create_api_key(db, "acme", "viewer"),
    }
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, keys["admin"], retries=0) as ledger,
    ):
        dataset = ledger.create_dataset(
            "cli-archive", rule="sequential", epsilon="1", delta="0", accountant="basic"
        )
        yield {"url": url, "keys": keys, "ledger": ledger, "dataset": dataset}


def _run(world: dict[str, Any], capsys: Any, *args: str, key: str = "admin") -> tuple[int, str, str]:
    code = cli_main(["datasets", *args[:1], "--url", world["url"], "--key", world["keys"][key], *args[1:]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("backend", ["sqlite"])
def test_archive_and_unarchive_by_name_or_id(world: dict[str, Any], capsys: Any) -> None:
    ledger: LedgerClient = world["ledger"]
    dataset_id = world["dataset"]["id"]
    code, out, err = _run(world, capsys, "archive", "cli-archive")
    assert code == 0, err
    assert out.startswith(f"archived {dataset_id} (cli-archive) at ")
    assert ledger.get_dataset(dataset_id)["archived_at"] is not None
    assert ledger.list_datasets()["count"] == 0  # gone from the default list
    entries = [e["event_type"] for e in ledger.iter_audit_entries(dataset_id)]
    # again: the same answer, nothing appended to the audit chain
    code, again, _ = _run(world, capsys, "archive", dataset_id)
    assert code == 0 and again == out
    assert [e["event_type"] for e in ledger.iter_audit_entries(dataset_id)] == entries
    assert entries.count("dataset.archived") == 1

    code, out, err = _run(world, capsys, "unarchive", "cli-archive", "--json")  # found by name while archived
    assert code == 0, err
    assert '"archived_at": null' in out and dataset_id in out
    assert ledger.get_dataset(dataset_id)["archived_at"] is None


@pytest.mark.parametrize("backend", ["sqlite"])
def test_refusals_are_one_line_and_change_nothing(world: dict[str, Any], capsys: Any) -> None:
    ledger: LedgerClient = world["ledger"]
    dataset_id = world["dataset"]["id"]
    code, _, err = _run(world, capsys, "archive", "cli-archiv")  # misspelt
    assert code == 2 and "'cli-archiv'" in err and "no dataset" in err, err
    code, _, err = _run(world, capsys, "archive", "cli-archive", key="viewer")
    assert code == 2 and "admin" in err, err
    task = ledger.create_task(dataset_id, "t")
    batches = ledger.create_batches(dataset_id, task["id"], [{"name": "b", "records": ["r0"]}])["data"]
    held = ledger.reserve(dataset_id, PURE, batches=[batches[0]["id"]])
    code, _, err = _run(world, capsys, "archive", "cli-archive")
    assert code == 2 and "1 open reservation" in err and dataset_id in err, err
    ledger.abort(held["id"])
    assert ledger.get_dataset(dataset_id)["archived_at"] is None
    code = cli_main(["datasets", "archive", "--url", "", "--key", "k", "cli-archive"])
    assert code == 2 and "--url" in capsys.readouterr().err
