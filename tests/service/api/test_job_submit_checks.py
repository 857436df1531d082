"""Issue 28 §5 and §8 over HTTP, on both databases: mistakes a job would meet in the worker are
refused at ``POST /v1/jobs``, naming the field, and nothing is queued.

* §8: a job on a ``parallel`` dataset whose batches a reservation read already used to be
  accepted and then fail in the worker (``batch_already_read``); now 409 at submit, naming the
  batches read and the field.
* §5: a job's ``params.delta`` other than its budget's δ was used to calibrate σ while the ledger
  certified at the budget's: now 422 ``params.delta``. The budget's own δ (or none) is accepted.
"""

from __future__ import annotations

from typing import Any

from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api, pure, unique


def _dataset(admin: Api, budget: dict[str, Any], batches: int = 3) -> tuple[str, list[str]]:
    body = {"name": unique("ds"), "budget": budget, "data_source": "builtin:digits"}
    dataset = admin.call("POST", "/v1/datasets", body, 201).json()["id"]
    task = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t"}, 201).json()["id"]
    records = [{"name": f"b{i}", "records": [f"r{i}-{j}" for j in range(4)]} for i in range(batches)]
    created = admin.call("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", {"batches": records}, 201)
    return dataset, [b["id"] for b in created.json()["data"]]


def _jobs(api: Api, dataset: str) -> int:
    count: int = api.call("GET", f"/v1/jobs?dataset_id={dataset}", status=200).json()["count"]
    return count


def test_a_parallel_job_on_batches_already_read_is_refused_at_submit(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "parallel", "epsilon": "4", "delta": "1e-5", "accountant": "rdp"}
    dataset, batches = _dataset(admin, budget)
    job = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": {"noise_multiplier": 1.0, "steps": 5}}
    accepted = trainer.call("POST", "/v1/jobs", job, 201).json()
    trainer.call("POST", f"/v1/jobs/{accepted['id']}/cancel", status=200)

    held = trainer.reserve(dataset, batches[1:2], pure(0.5)).json()
    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)  # read: charged
    refused = trainer.call("POST", "/v1/jobs", job, 409).json()
    assert (refused["error"], refused["field"], refused["batches"], refused["batches_read"]) == (
        "batch_already_read",
        "dataset_id",
        [batches[1]],
        1,
    )
    assert batches[1] in refused["message"] and "parallel" in refused["message"]
    assert _jobs(trainer, dataset) == 1  # only the cancelled one

    # Another tenant's dataset is not found, never described.
    other = Api(client, keys.get("rival", "trainer")).call("POST", "/v1/jobs", job, 404).json()
    assert other["error"] == "not_found"


def test_a_job_delta_other_than_the_budgets_is_refused(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "4", "delta": "1e-5", "accountant": "rdp"}
    dataset, _ = _dataset(admin, budget)
    params = {"target_epsilon": 1.0, "epochs": 1}
    for delta in (1e-3, 1e-6, 1.0000001e-5):
        body = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": {**params, "delta": delta}}
        refused = trainer.call("POST", "/v1/jobs", body, 422).json()
        assert refused["field"] == "params.delta" and "budget delta, 0.00001" in refused["message"], refused
    assert _jobs(trainer, dataset) == 0
    for extra in ({"delta": 1e-5}, {"delta": 0.00001}, {}):
        body = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": {**params, **extra}}
        trainer.call("POST", "/v1/jobs", body, 201)
    assert _jobs(trainer, dataset) == 3


def test_a_delta_of_at_least_one_over_n_is_warned_of(client: TestClient, keys: Keys) -> None:
    """§5: δ = 0.01 for 1 437 records was accepted silently. The dataset's answer (and the list)
    carries the records registered and a warning naming ``budget.delta`` once δ·N ≥ 1."""
    admin = Api(client, keys.get("acme", "admin"))
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0.01", "accountant": "rdp"}
    dataset, _ = _dataset(admin, budget, batches=24)  # 96 records: δ·N = 0.96, no warning yet
    answer = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()
    assert (answer["records"], answer["warnings"]) == (96, [])
    task = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "more"}, 201).json()["id"]
    more = {"batches": [{"name": "b", "records": [f"more-{j}" for j in range(4)]}]}
    admin.call("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", more, 201)  # 100: δ·N = 1
    answer = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()
    (warning,) = answer["warnings"]
    assert (answer["records"], warning["code"], warning["field"]) == (
        100,
        "delta_not_below_one_over_n",
        "budget.delta",
    )
    assert "0.01" in warning["message"] and "100 records" in warning["message"]
    listed = {d["id"]: d for d in admin.call("GET", "/v1/datasets", status=200).json()["data"]}
    assert listed[dataset]["warnings"] == answer["warnings"]
    pure_dp = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    pure_id = _dataset(admin, pure_dp)[0]
    assert admin.call("GET", f"/v1/datasets/{pure_id}", status=200).json()["warnings"] == []
