"""The dashboard's read endpoints (``service.api.dashboard`` over ``service.ledger.views``), on
both backends: their numbers agree with ``GET /v1/datasets/{id}/spend`` and the certificates,
they page, they keep tenants apart; and the dashboard's files are served with a strict CSP."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from service.api import schemas
from service.db.session import Database
from service.ledger import batches, datasets, reservations, tenancy, views
from service.ledger.reservations import parse_event
from tests.service.api.conftest import Keys, TestClient, bearer
from tests.service.api.world import unique


def _pure(epsilon: float) -> dict[str, Any]:
    return {"kind": "pure_dp", "epsilon": epsilon}


def _spend(
    db: Database,
    tenant: str,
    dataset: str,
    batch_ids: list[str],
    epsilon: float,
    *,
    commitment: str | None = None,
    commit: bool = True,
) -> dict[str, Any]:
    held = reservations.reserve(
        db,
        tenant,
        dataset,
        event=parse_event(_pure(epsilon)),
        batch_ids=batch_ids,
        noise_commitment=commitment,
    ).to_json()
    if not commit:
        return held
    return reservations.commit(
        db, tenant, held["id"], release={"model": "m", "version": unique("v")}
    ).to_json()


def _dataset(
    db: Database, tenant: str, budget: dict[str, Any], tasks: list[int]
) -> tuple[str, list[list[str]]]:
    dataset = datasets.create_dataset(db, tenant, name=unique("ds"), budget=budget).id
    ids: list[list[str]] = []
    for size in tasks:
        task = batches.create_task(db, tenant, dataset, name=unique("task")).id
        created = batches.create_batches(
            db,
            tenant,
            dataset,
            task,
            batches=[{"name": unique("b"), "records": [unique("r")]} for _ in range(size)],
        )
        ids.append([b.id for b in created.data])
    return dataset, ids


def test_spend_summaries_equal_each_datasets_spend(client: TestClient, db: Database, keys: Keys) -> None:
    admin = keys.get("acme", "admin")
    first, (task_batches,) = _dataset(
        db, "acme", {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"}, [2]
    )
    _spend(db, "acme", first, task_batches, 0.7)
    _spend(db, "acme", first, task_batches[:1], 0.2, commit=False)
    _dataset(db, "acme", {"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"}, [1])
    _dataset(db, "rival", {"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"}, [1])

    viewer = bearer(keys.get("acme", "viewer"))
    answer = client.get("/v1/spend", headers=viewer)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == 2  # the rival's dataset is not listed
    for item in body["data"]:
        spend = client.get(f"/v1/datasets/{item['id']}/spend", headers=bearer(admin)).json()
        for key in (
            "rule",
            "epsilon_budget",
            "epsilon_spent",
            "epsilon_remaining",
            "epsilon_held",
            "naive_sequential_epsilon",
            "last_release",
        ):
            assert item[key] == spend[key], key
    summary = body["data"][0]
    shown = (summary["epsilon_spent"], summary["epsilon_held"], summary["epsilon_remaining"])
    assert shown == ("0.7", "0.2", "2.3")
    assert summary["last_release"]["model"] == "m" and summary["last_release_at"]

    paged = client.get("/v1/spend?limit=1&offset=1", headers=viewer).json()
    assert paged["count"] == 2 and [d["id"] for d in paged["data"]] == [body["data"][1]["id"]]
    assert client.get("/v1/spend?limit=0", headers=viewer).status_code == 422
    assert client.get("/v1/spend").status_code == 401


def test_batch_spend_pages_in_task_order_with_geometric_levels(
    client: TestClient, db: Database, keys: Keys
) -> None:
    dataset, (blocks, more) = _dataset(
        db,
        "acme",
        {
            "rule": "geometric",
            "epsilon": "1",
            "delta": "0",
            "accountant": "basic",
            "geometric": {"first": "0.5", "ratio": "0.5"},
        },
        [3, 2],
    )
    for epsilon in (0.5, 0.25, 0.1):  # best fit: levels 0, 1, 2
        _spend(db, "acme", dataset, [blocks[0]], epsilon)
    _spend(db, "acme", dataset, [blocks[1]], 0.2)  # level 1
    _spend(db, "acme", dataset, [more[0]], 0.06, commit=False)  # level 3, held
    viewer = bearer(keys.get("acme", "viewer"))

    page = client.get(f"/v1/datasets/{dataset}/batch-spend?limit=4", headers=viewer).json()
    assert page["count"] == 5 and page["limit"] == 4 and page["offset"] == 0
    assert [b["id"] for b in page["data"]] == [*blocks, more[0]]
    assert [b["levels"] for b in page["data"]] == [[0, 1, 2], [1], [], [3]]
    # A charge takes its level's whole allowance first·ratioᵏ.
    assert [b["epsilon_spent"] for b in page["data"]] == ["0.875", "0.25", "0", "0"]
    assert page["data"][3]["epsilon_held"] == "0.0625"
    assert page["data"][0]["reads"] == 3
    assert page["geometric"]["allowances"] == {"0": "0.5", "1": "0.25", "2": "0.125", "3": "0.0625"}
    assert page["geometric"]["infinite_horizon_bound"] == "1"

    rest = client.get(f"/v1/datasets/{dataset}/batch-spend?limit=4&offset=4", headers=viewer).json()
    assert [b["id"] for b in rest["data"]] == [more[1]]
    # The task-level view agrees with the per-batch one.
    for batch in page["data"][:3]:
        listed = client.get(f"/v1/datasets/{dataset}/tasks/{batch['task_id']}/batches", headers=viewer).json()
        same = next(b for b in listed["data"] if b["id"] == batch["id"])
        assert same["epsilon_spent"] == batch["epsilon_spent"]
    rival = bearer(keys.get("rival", "viewer"))
    assert client.get(f"/v1/datasets/{dataset}/batch-spend", headers=rival).status_code == 404


def test_releases_and_lifelong_history(client: TestClient, db: Database, keys: Keys) -> None:
    tasks = 5
    dataset, task_batches = _dataset(
        db, "acme", {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"}, [1] * tasks
    )
    memory = task_batches[0][0]
    _spend(db, "acme", dataset, [memory], 0.4, commitment="perturbation")
    for k in range(1, tasks):  # task k reads its own batch and replays task 1's episodic memory
        _spend(db, "acme", dataset, [task_batches[k][0], memory], 0.4, commitment="perturbation")
    viewer = bearer(keys.get("acme", "viewer"))

    history = client.get(f"/v1/datasets/{dataset}/epsilon-history", headers=viewer).json()
    assert history["tasks"] == tasks and history["releases"] == tasks and history["count"] == tasks
    assert [p["task_index"] for p in history["data"]] == [1, 2, 3, 4, 5]
    assert [p["epsilon"] for p in history["data"]] == ["0.4"] * tasks  # the ledger's ε stays flat
    assert [p["naive_sequential_epsilon"] for p in history["data"]] == ["0.4", "0.8", "1.2", "1.6", "2"]
    spend = client.get(f"/v1/datasets/{dataset}/spend", headers=viewer).json()
    last = history["data"][-1]
    assert (last["epsilon"], last["naive_sequential_epsilon"]) == (
        spend["epsilon_spent"],
        spend["naive_sequential_epsilon"],
    )
    page = client.get(f"/v1/datasets/{dataset}/epsilon-history?limit=2&offset=3", headers=viewer).json()
    assert [p["task_index"] for p in page["data"]] == [4, 5]

    releases = client.get(f"/v1/datasets/{dataset}/releases?limit=3", headers=viewer).json()
    assert releases["count"] == tasks and len(releases["data"]) == 3
    certificates = client.get(f"/v1/datasets/{dataset}/certificates", headers=viewer).json()["data"]
    newest = certificates[::-1][:3]
    for item, stored in zip(releases["data"], newest, strict=True):
        body = stored["certificate"]
        assert item["certificate_id"] == stored["id"]
        assert (item["model"], item["version"]) == (stored["release"]["model"], stored["release"]["version"])
        assert item["epsilon"] == body["result"]["epsilon"]
        assert item["naive_epsilon"] == body["result"]["naive_epsilon"]
        assert item["charge"] == body["result"]["charge"]
        assert item["theorem"] == body["theorem"]
        assert item["within_budget"] is True
    assert releases["data"][0]["naive_epsilon"] == "2"


def _undocumented(value: Any, path: str = "") -> list[str]:
    """The fields of a validated answer that its model does not declare (``extra="allow"``)."""
    if isinstance(value, BaseModel):
        found = [f"{path}.{k}" for k in value.model_extra or {}]
        for name in type(value).model_fields:
            found += _undocumented(getattr(value, name), f"{path}.{name}")
        return found
    if isinstance(value, list):
        return [f for i, item in enumerate(value) for f in _undocumented(item, f"{path}[{i}]")]
    return []


def test_the_dashboard_pages_answer_their_views_bytes_through_documented_models(
    client: TestClient, db: Database, keys: Keys
) -> None:
    """The four pages answer through their ``response_model``: the bytes are their ledger view's
    ``to_json()`` as the fast path would send it, and the model declares every field (nested
    too), in the view's order; optional fields the view leaves out (``geometric``, its
    ``copies`` / ``single``) stay out, nulls stay null."""
    geometric = {"first": "0.5", "ratio": "0.5", "copies": 2, "single": "0.6"}
    budget = {"rule": "geometric", "epsilon": "3", "delta": "0", "accountant": "basic"}
    budget["geometric"] = geometric
    dataset, (blocks,) = _dataset(db, "acme", budget, [3])
    _spend(db, "acme", dataset, [blocks[0]], 0.5)
    _spend(db, "acme", dataset, [blocks[1]], 0.6)
    _spend(db, "acme", dataset, [blocks[2]], 0.2, commit=False)
    plain, (others,) = _dataset(
        db, "acme", {"rule": "sequential", "epsilon": "2", "delta": "1e-5", "accountant": "basic"}, [2]
    )
    _spend(db, "acme", plain, others, 0.3)
    _dataset(db, "acme", {"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"}, [1])
    viewer = bearer(keys.get("acme", "viewer"))
    pages: list[tuple[str, type[BaseModel], dict[str, Any]]] = [
        ("/v1/spend", schemas.SpendSummariesPublic, views.spend_summaries(db, "acme").to_json())
    ]
    for ds in (dataset, plain):
        pages += [
            (
                f"/v1/datasets/{ds}/batch-spend",
                schemas.BatchSpendPagePublic,
                views.batch_spend(db, "acme", ds).to_json(),
            ),
            (f"/v1/datasets/{ds}/releases", schemas.ReleasesPublic, views.releases(db, "acme", ds).to_json()),
            (
                f"/v1/datasets/{ds}/epsilon-history",
                schemas.EpsilonHistoryPublic,
                views.epsilon_history(db, "acme", ds).to_json(),
            ),
        ]
    for path, model, view in pages:
        answer = client.get(path, headers=viewer)
        assert answer.status_code == 200, answer.text
        assert answer.content == JSONResponse(content=view).body, path
        assert _undocumented(model.model_validate(answer.json())) == [], path
    shown = client.get(f"/v1/datasets/{dataset}/batch-spend", headers=viewer).json()
    assert list(shown["geometric"]) == [
        "first",
        "ratio",
        "copies",
        "single",
        "infinite_horizon_bound",
        "allowances",
    ]
    assert "geometric" not in client.get(f"/v1/datasets/{plain}/batch-spend", headers=viewer).json()
    listed = client.get("/v1/spend", headers=viewer).json()["data"]
    assert [d["last_release"] is None for d in listed] == [False, False, True]


def test_verify_a_stored_certificate_on_the_server(client: TestClient, db: Database, keys: Keys) -> None:
    dataset, (task_batches,) = _dataset(
        db, "acme", {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"}, [1]
    )
    certificate = _spend(db, "acme", dataset, task_batches, 0.5)["certificate"]["id"]
    viewer = bearer(keys.get("acme", "viewer"))
    answer = client.post(f"/v1/certificates/{certificate}/verify", headers=viewer)
    assert answer.status_code == 200, answer.text
    assert answer.json()["ok"] is True and answer.json()["certificate_id"] == certificate
    assert (
        client.post(
            f"/v1/certificates/{certificate}/verify", headers=bearer(keys.get("rival", "viewer"))
        ).status_code
        == 404
    )
    assert client.post("/v1/certificates/cert_nope/verify", headers=viewer).status_code == 404


def test_the_dashboard_is_served_with_local_assets_only(client: TestClient) -> None:
    index = client.get("/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    policy = index.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    html = index.text
    assert "/static/app.js" in html and "/static/style.css" in html
    assert "http://" not in html and "https://" not in html  # nothing from another origin
    for asset in ("/static/app.js", "/static/style.css"):
        answer = client.get(asset)
        assert answer.status_code == 200, asset
        assert "http://" not in answer.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in answer.text
    assert "localStorage.setItem" not in client.get("/static/app.js").text
    assert "document.cookie" not in client.get("/static/app.js").text
    assert client.get("/static/nothing.js").status_code == 404


def test_revoked_viewer_key_is_refused_by_dashboard_endpoints(client: TestClient, db: Database) -> None:
    issued = tenancy.issue_api_key(db, "acme", "viewer")
    headers = bearer(issued.key)
    assert client.get("/v1/spend", headers=headers).status_code == 200
    tenancy.revoke_api_key(db, issued.id)
    assert client.get("/v1/spend", headers=headers).status_code == 401


def test_each_release_states_what_was_held_when_it_was_certified(client: TestClient, keys: Keys) -> None:
    """``held_at_release`` rebuilds the dataset head's ``epsilon_held`` as it was at each release:
    it must equal what ``/spend`` answered live right after that release — across a progressive
    commit (a partial charge), a second open hold, an abort, an expiry and a final commit."""
    from tests.service.api.test_ledger_over_http import Api

    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "5", "delta": "0", "accountant": "basic"}
    dataset, batch_ids = admin.dataset(budget)
    steps = lambda n: {"kind": "self_composed", "count": n, "event": {"kind": "pure_dp", "epsilon": 0.001}}  # noqa: E731
    run = trainer.reserve(dataset, batch_ids, steps(500)).json()
    other = trainer.reserve(dataset, batch_ids, _pure(0.25)).json()
    live: dict[str, str] = {}

    def released(certificate: dict[str, Any]) -> None:
        live[certificate["certificate"]["id"]] = admin.spend(dataset)["epsilon_held"]

    released(trainer.commit(run["id"], event=steps(300)).json())  # holds 0.2 + 0.25
    third = trainer.reserve(dataset, batch_ids, _pure(0.5)).json()
    released(trainer.commit(other["id"]).json())  # holds 0.2 + 0.5
    trainer.call("POST", f"/v1/reservations/{third['id']}/abort", {}, 200)
    trainer.reserve(dataset, batch_ids, _pure(0.125), ttl_s=0.2)  # expires before the next release
    time.sleep(0.3)
    released(trainer.commit(run["id"]).json())  # holds nothing
    assert list(live.values()) == ["0.45", "0.7", "0"]
    answer = admin.call("GET", f"/v1/datasets/{dataset}/releases", status=200).json()
    assert {r["certificate_id"]: r["held_at_release"]["epsilon"] for r in answer["data"]} == live
