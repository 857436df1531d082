"""Issue 28 §7 over HTTP, on both databases: what was never charged can be undone, audited; what
was charged or held never can.

``DELETE /v1/datasets/{id}/tasks/{task}`` and ``.../batches/{batch}`` remove a task or a batch
none of whose batches left the empty state (no charge, no hold: no certificate or spend refers to
it), with its records, so they can be registered again; each deletion is appended to the
dataset's audit chain. Attacked: a charged batch and its task (409 ``charged``), a dataset a job
is queued on (409 ``dataset_in_use``), another tenant's objects (404), a trainer key (403),
repeats (404 the second time, or the first answer under the same Idempotency-Key).
"""

from __future__ import annotations

from typing import Any

from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api, pure, unique


def _batches(admin: Api, dataset: str, task: str, records: list[list[str]]) -> list[str]:
    body = {"batches": [{"name": unique("b"), "records": r} for r in records]}
    created = admin.call("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", body, 201).json()["data"]
    return [b["id"] for b in created]


def _entries(admin: Api, dataset: str, kind: str) -> list[dict[str, Any]]:
    entries = admin.call("GET", f"/v1/datasets/{dataset}/audit", status=200).json()["data"]
    return [e["payload"] for e in entries if e["event_type"] == kind]


def test_uncharged_tasks_and_batches_are_deleted_and_charged_ones_never(
    client: TestClient, keys: Keys
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    body = {"name": unique("ds"), "budget": budget, "data_source": "builtin:digits"}
    dataset = admin.call("POST", "/v1/datasets", body, 201).json()["id"]
    task = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t"}, 201).json()["id"]
    empty = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "left empty"}, 201).json()["id"]
    wrong, charged, last = _batches(admin, dataset, task, [["r1", "r2"], ["r3"], ["r4"]])
    base = f"/v1/datasets/{dataset}/tasks/{task}"

    # Another tenant's objects do not exist for it; a trainer may not delete.
    rival = Api(client, keys.get("rival", "admin"))
    assert rival.call("DELETE", f"{base}/batches/{wrong}", status=404).json()["error"] == "not_found"
    trainer.call("DELETE", f"{base}/batches/{wrong}", status=403)

    deleted = admin.call(
        "DELETE", f"{base}/batches/{wrong}", status=200, **{"Idempotency-Key": "del-1"}
    ).json()
    assert deleted == {
        "deleted": {"id": wrong, "task_id": task, "name": deleted["deleted"]["name"], "size": 2}
    }
    again = admin.call("DELETE", f"{base}/batches/{wrong}", status=200, **{"Idempotency-Key": "del-1"}).json()
    assert again == deleted  # the first answer, nothing more deleted
    assert admin.call("DELETE", f"{base}/batches/{wrong}", status=404).json()["resource"] == "batch"
    assert _entries(admin, dataset, "batch.deleted") == [deleted["deleted"]]
    # Its records are free again, and a new batch takes a new position (none reused).
    (again_id,) = _batches(admin, dataset, task, [["r1", "r2"]])
    listed = admin.call("GET", f"{base}/batches", status=200).json()["data"]
    assert [(b["id"], b["position"]) for b in listed] == [(charged, 1), (last, 2), (again_id, 3)]

    # A charged batch (an abort charges what could have run) and its task: never.
    held = trainer.reserve(dataset, [charged], pure(0.5)).json()
    refused = admin.call("DELETE", f"{base}/batches/{charged}", status=409).json()
    assert (refused["reason"], refused["batch_id"]) == ("charged", charged)
    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)
    for path in (f"{base}/batches/{charged}", base):
        refused = admin.call("DELETE", path, status=409).json()
        assert (refused["reason"], refused["batch_id"]) == ("charged", charged), path
    assert admin.call("GET", f"{base}/batches", status=200).json()["count"] == 3

    # While a job is queued on the dataset nothing is deleted (its plan reads every batch).
    job = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": {"noise_multiplier": 1.0, "steps": 2}}
    queued = trainer.call("POST", "/v1/jobs", job, 201).json()
    busy = admin.call("DELETE", f"/v1/datasets/{dataset}/tasks/{empty}", status=409).json()
    assert (busy["reason"], busy["job_id"]) == ("dataset_in_use", queued["id"])
    trainer.call("POST", f"/v1/jobs/{queued['id']}/cancel", status=200)

    gone = admin.call("DELETE", f"/v1/datasets/{dataset}/tasks/{empty}", status=200).json()
    assert gone == {"deleted": {"id": empty, "name": "left empty", "batches": 0, "records": 0}}
    tasks = admin.call("GET", f"/v1/datasets/{dataset}/tasks", status=200).json()["data"]
    assert [t["id"] for t in tasks] == [task]
    assert (
        admin.call("DELETE", f"/v1/datasets/{dataset}/tasks/{empty}", status=404).json()["resource"] == "task"
    )
    assert _entries(admin, dataset, "task.deleted") == [gone["deleted"]]
    spend = admin.spend(dataset)
    assert spend["epsilon_spent"] == "0.5" and [t["id"] for t in spend["tasks"]] == [task]
    assert admin.audit()["ok"]
