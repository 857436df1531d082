"""Issue 28 §7 over HTTP, on both databases: a dataset is archived, never erased.

``POST /v1/datasets/{id}/archive`` (admin) makes a dataset — charged or not — refuse new work
(reservations, plan segments, jobs, quotes, tasks, batches: 409 ``dataset_archived`` naming it)
and hides it from the default list, while everything it certified still verifies and exports
(``ledger check``'s bundle, recomputed here); ``.../unarchive`` makes it active again as it was.
Attacked: a viewer or trainer key (403), another tenant's id (404), repeats (nothing appended),
an open reservation (409 ``dataset_in_use``), a misspelt list filter (422).
"""

from __future__ import annotations

from typing import Any

from accountant.certificates import verify as verify_certificate
from service.client import LedgerClient
from service.commands.export import collect
from service.verification.bundle import evaluate
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api, pure, unique


def _kinds(admin: Api, dataset: str) -> list[str]:
    entries = admin.call("GET", f"/v1/datasets/{dataset}/audit", status=200).json()["data"]
    return [e["event_type"] for e in entries]


def _archived(answer: Any, dataset: str) -> None:
    body = answer.json()
    assert (body["error"], body["reason"], body["dataset_id"]) == ("conflict", "dataset_archived", dataset)
    assert dataset in body["message"]


def test_an_archived_dataset_refuses_new_work_and_its_certificates_still_verify(
    client: TestClient, keys: Keys
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    body = {"name": unique("ds"), "budget": budget, "data_source": "builtin:digits"}
    dataset = admin.call("POST", "/v1/datasets", body, 201).json()["id"]
    task = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t"}, 201).json()["id"]
    created = admin.call(
        "POST",
        f"/v1/datasets/{dataset}/tasks/{task}/batches",
        {"batches": [{"name": "b", "records": [unique("r")]}]},
        201,
    ).json()["data"]
    batch = created[0]["id"]
    other = admin.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": budget}, 201).json()["id"]
    certificate = admin.commit(trainer.reserve(dataset, [batch], pure(0.25)).json()["id"]).json()
    held = trainer.reserve(dataset, [batch], pure(0.25)).json()
    archive = f"/v1/datasets/{dataset}/archive"

    # Who may not: a viewer and a trainer (403), another tenant (404, as for any id of it).
    Api(client, keys.get("acme", "viewer")).call("POST", archive, status=403)
    trainer.call("POST", archive, status=403)
    assert (
        Api(client, keys.get("rival", "admin")).call("POST", archive, status=404).json()["error"]
        == "not_found"
    )
    # Not while a reservation is open: what was admitted must be able to settle.
    assert admin.call("POST", archive, status=409).json()["reason"] == "dataset_in_use"
    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)
    before = admin.spend(dataset)

    archived = admin.call("POST", archive, status=200).json()
    assert archived["id"] == dataset and archived["archived_at"]
    assert admin.call("POST", archive, status=200).json() == archived  # a repeat changes nothing
    assert _kinds(admin, dataset).count("dataset.archived") == 1

    # Every kind of new work is refused, naming the dataset; nothing changed.
    _archived(trainer.reserve(dataset, [batch], pure(0.1), status=409), dataset)
    quote = {"event": pure(0.1), "new_batch": True}
    _archived(trainer.call("POST", f"/v1/datasets/{dataset}/quote", quote, 409), dataset)
    job = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": {"noise_multiplier": 1.0, "steps": 2}}
    _archived(trainer.call("POST", "/v1/jobs", job, 409), dataset)
    _archived(admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t2"}, 409), dataset)
    more = {"batches": [{"name": "b2", "records": [unique("r")]}]}
    _archived(admin.call("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", more, 409), dataset)
    assert admin.spend(dataset) == before  # archiving never frees budget nor changes spend

    # Hidden from the default list, shown on request, still readable by id and by name.
    def listed(query: str = "") -> list[str]:
        return [d["id"] for d in admin.call("GET", f"/v1/datasets{query}", status=200).json()["data"]]

    assert listed() == [other] and listed("?archived=true") == [dataset]
    assert listed("?archived=all") == [dataset, other]
    assert listed(f"?name={archived['name']}") == [dataset]
    assert admin.call("GET", "/v1/datasets?archived=yes", status=422).json()["field"] == "archived"
    assert (
        admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["archived_at"]
        == archived["archived_at"]
    )

    # Everything it certified still verifies, and its exported bundle passes every check.
    stored = admin.call("GET", f"/v1/datasets/{dataset}/certificates", status=200).json()["data"]
    assert {c["id"] for c in stored} >= {certificate["certificate"]["id"]}
    assert all(verify_certificate(c["certificate"]).ok for c in stored)
    with LedgerClient(
        str(client.base_url), keys.get("acme", "viewer"), transport=client._transport
    ) as ledger:
        bundle = collect(ledger, dataset)
    report = evaluate(bundle, mode="online", source="test")
    assert report.ok, report
    assert admin.audit()["ok"]

    # Unarchived, it is what it was: the rest of the budget is there, no more.
    assert admin.call("POST", f"/v1/datasets/{dataset}/unarchive", status=200).json()["archived_at"] is None
    assert admin.call("POST", f"/v1/datasets/{dataset}/unarchive", status=200).json()["archived_at"] is None
    assert _kinds(admin, dataset).count("dataset.unarchived") == 1
    assert trainer.reserve(dataset, [batch], pure(0.8), status=409).json()["error"] == "budget_exceeded"
    trainer.reserve(dataset, [batch], pure(0.5))
