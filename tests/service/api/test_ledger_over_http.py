"""The ledger through HTTP API v1: reserve → commit / abort / expire, refusals that change
nothing, idempotent retries, certificates, health and metrics."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from accountant.certificates import verify as verify_certificate
from service.app import create_app
from service.db.session import Database
from service.settings import Settings
from tests.service.api.conftest import METRICS_TOKEN, Keys, TestClient, bearer
from tests.service.api.world import unique

JSON = {"Content-Type": "application/json"}


def pure(epsilon: float | str) -> dict[str, Any]:
    return {"kind": "pure_dp", "epsilon": epsilon}


class Api:
    """A tenant's admin session on the test client."""

    def __init__(self, client: TestClient, key: str) -> None:
        self.client = client
        self.headers = bearer(key)

    def call(
        self, method: str, path: str, body: Any = None, status: int | None = None, **headers: str
    ) -> Any:
        answer = self.client.request(method, path, json=body, headers={**self.headers, **headers})
        if status is not None:
            assert answer.status_code == status, answer.text
        return answer

    def dataset(self, budget: dict[str, Any], batches: int = 1) -> tuple[str, list[str]]:
        ds = self.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": budget}, 201)
        task = self.call("POST", f"/v1/datasets/{ds.json()['id']}/tasks", {"name": "t"}, 201)
        created = self.call(
            "POST",
            f"/v1/datasets/{ds.json()['id']}/tasks/{task.json()['id']}/batches",
            {"batches": [{"name": f"b{i}", "records": [unique("r")]} for i in range(batches)]},
            201,
        )
        return ds.json()["id"], [b["id"] for b in created.json()["data"]]

    def reserve(
        self, dataset: str, batches: list[str], event: dict[str, Any], status: int | None = 201, **extra: Any
    ) -> Any:
        return self.call(
            "POST",
            f"/v1/datasets/{dataset}/reservations",
            {"batches": batches, "event": event, **extra},
            status,
        )

    def commit(self, reservation: str, status: int | None = 200, **body: Any) -> Any:
        body.setdefault("release", {"model": "m", "version": unique("v")})
        return self.call("POST", f"/v1/reservations/{reservation}/commit", body, status)

    def spend(self, dataset: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.call("GET", f"/v1/datasets/{dataset}/spend", status=200).json()
        return answer

    def audit(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.call("GET", "/v1/audit/verify", status=200).json()
        return answer


SEQUENTIAL = {"rule": "sequential", "epsilon": "1.0", "delta": "0", "accountant": "basic"}


def test_reserve_commit_spend_and_certificates(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "trainer"))
    admin = Api(client, keys.get("acme", "admin"))
    dataset, batches = admin.dataset(SEQUENTIAL, batches=2)
    held = api.reserve(dataset, batches, pure(0.25)).json()
    assert held["status"] == "reserved"
    assert held["cost"] == {"epsilon": "0.25", "delta": "0"}
    assert held["expires_at"]
    assert api.spend(dataset)["epsilon_held"] == "0.25"

    committed = api.commit(held["id"], release={"model": "clf", "version": 1}).json()
    certificate = committed["certificate"]
    assert committed["reservation"]["status"] == "committed"
    assert certificate["release"] == {"model": "clf", "version": 1}
    assert verify_certificate(certificate["certificate"]).ok

    spend = api.spend(dataset)
    assert spend["epsilon_spent"] == "0.25"
    assert spend["epsilon_remaining"] == "0.75"
    assert spend["naive_sequential_epsilon"] == "0.25"
    assert spend["tasks"][0]["epsilon_spent"] == "0.25"

    listed = api.call("GET", f"/v1/datasets/{dataset}/certificates", status=200).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == certificate["id"]
    fetched = api.call("GET", f"/v1/certificates/{certificate['id']}", status=200).json()
    assert fetched["certificate"] == certificate["certificate"]
    assert verify_certificate(fetched["certificate"]).ok

    # Another tenant sees none of it.
    rival = Api(client, keys.get("rival", "admin"))
    rival.call("GET", f"/v1/certificates/{certificate['id']}", status=404)
    rival.call("GET", f"/v1/datasets/{dataset}/spend", status=404)
    audit = api.audit()
    assert audit["ok"] and audit["entries"] > 0


def test_budget_exceeded_is_409_with_remaining_and_requested_and_changes_nothing(
    client: TestClient, keys: Keys
) -> None:
    api = Api(client, keys.get("acme", "admin"))
    dataset, batches = api.dataset(SEQUENTIAL)
    api.commit(api.reserve(dataset, batches, pure(0.9)).json()["id"])
    before = (api.spend(dataset), api.audit()["entries"])

    refused = api.reserve(dataset, batches, pure(0.2), status=409).json()
    assert refused["error"] == "budget_exceeded"
    assert refused["remaining"]["epsilon"] == "0.1"
    assert refused["requested"]["epsilon"] == "0.2"
    assert "message" in refused
    # Other refusals on the same dataset: invalid, foreign, unauthorised, forbidden.
    api.reserve(dataset, batches, pure(-1), status=422)
    Api(client, keys.get("rival", "admin")).reserve(dataset, batches, pure(0.01), status=404)
    Api(client, keys.revoked).reserve(dataset, batches, pure(0.01), status=401)
    Api(client, keys.get("acme", "viewer")).reserve(dataset, batches, pure(0.01), status=403)

    assert (api.spend(dataset), api.audit()["entries"]) == before
    # Exactly the rest still fits: 0.9 + 0.1 = 1.0 with no float drift.
    api.commit(api.reserve(dataset, batches, pure(0.1)).json()["id"])
    assert api.spend(dataset)["epsilon_spent"] == "1"


def test_refused_rule_charges_are_409_with_their_code(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "admin"))
    parallel, batches = api.dataset({"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"})
    api.commit(api.reserve(parallel, batches, pure(0.5)).json()["id"])
    second = api.reserve(parallel, batches, pure(0.1), status=409).json()
    assert second["error"] == "batch_already_read"
    assert second["batch_id"] == batches[0]

    geometric, batches = api.dataset(
        {
            "rule": "geometric",
            "epsilon": "1",
            "delta": "0",
            "accountant": "basic",
            "geometric": {"first": "0.5", "ratio": "0.5"},
        }
    )
    too_big = api.reserve(geometric, batches, pure(0.6), status=409).json()
    assert too_big["error"] in ("no_geometric_level", "budget_exceeded")


def test_idempotent_retries_charge_once(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "trainer"))
    dataset, batches = Api(client, keys.get("acme", "admin")).dataset(SEQUENTIAL)
    body = {"batches": batches, "event": pure(0.3)}
    path = f"/v1/datasets/{dataset}/reservations"
    first = api.call("POST", path, body, 201, **{"Idempotency-Key": "reserve-1"}).json()
    again = api.call("POST", path, body, 201, **{"Idempotency-Key": "reserve-1"}).json()
    assert again == first
    assert api.spend(dataset)["epsilon_held"] == "0.3"

    commit_body = {"release": {"model": "m", "version": "7"}}
    commit_path = f"/v1/reservations/{first['id']}/commit"
    one = api.call("POST", commit_path, commit_body, 200, **{"Idempotency-Key": "commit-1"})
    two = api.call("POST", commit_path, commit_body, 200, **{"Idempotency-Key": "commit-1"})
    assert one.json() == two.json()
    spend = api.spend(dataset)
    assert spend["epsilon_spent"] == "0.3" and spend["charges_committed"] == 1

    # The same key for a different request is a conflict, and charges nothing.
    other = api.call(
        "POST", path, {"batches": batches, "event": pure(0.4)}, 409, **{"Idempotency-Key": "reserve-1"}
    ).json()
    assert other["error"] == "idempotency_conflict"
    assert api.spend(dataset)["epsilon_held"] == "0"


def test_progressive_commit_then_abort_charges_the_whole_run(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "trainer"))
    dataset, batches = Api(client, keys.get("acme", "admin")).dataset(SEQUENTIAL)

    def steps(n: int) -> dict[str, Any]:
        return {"kind": "self_composed", "count": n, "event": pure(0.1)}

    held = api.reserve(dataset, batches, steps(5)).json()
    api.commit(held["id"], event=steps(2))
    api.commit(held["id"], event=steps(3))
    spend = api.spend(dataset)
    assert spend["epsilon_spent"] == "0.3" and spend["epsilon_held"] == "0.2"
    aborted = api.call("POST", f"/v1/reservations/{held['id']}/abort", status=200).json()
    assert aborted["status"] == "aborted" and aborted["committed"]["epsilon"] == "0.5"
    spend = api.spend(dataset)  # what could have run: all 5 steps (issue 24 §2)
    assert spend["epsilon_spent"] == "0.5" and spend["epsilon_held"] == "0"
    # A commit of more than was reserved is refused.
    held = api.reserve(dataset, batches, steps(1)).json()
    assert api.commit(held["id"], event=steps(2), status=409).json()["error"] == "commit_not_prefix"


def test_expired_reservations_are_charged_in_the_background(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "trainer"))
    dataset, batches = Api(client, keys.get("acme", "admin")).dataset(SEQUENTIAL)
    held = api.reserve(dataset, batches, pure(0.9), ttl_s=0.3).json()
    assert api.spend(dataset)["epsilon_held"] == "0.9"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the sweep runs every 0.2 s in these tests
        state = api.call("GET", f"/v1/reservations/{held['id']}", status=200).json()
        if state["status"] == "expired":
            break
        time.sleep(0.1)
    assert state["status"] == "expired"
    spend = api.spend(dataset)  # the holder could have read the data: charged, not freed
    assert spend["epsilon_held"] == "0" and spend["epsilon_spent"] == "0.9"
    late = api.commit(held["id"], status=409).json()
    assert late["error"] == "reservation_expired"
    assert api.spend(dataset)["epsilon_spent"] == "0.9"
    assert api.spend(dataset)["last_release"] is None
    metrics = client.get("/metrics", headers=bearer(METRICS_TOKEN)).text
    assert "ledger_reservations_expired_total 1" in metrics


def test_healthz_checks_the_database(client: TestClient, tmp_path: Any) -> None:
    answer = client.get("/healthz")
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "database": "ok"}
    broken = create_app(
        Settings(database_url=f"sqlite:///{tmp_path}/missing/dir/ledger.db", expiry_sweep_interval_s=60)
    )
    with TestClient(broken) as unreachable:
        down = unreachable.get("/healthz")
    assert down.status_code == 503
    assert down.json()["database"] == "unreachable"


def test_metrics_in_prometheus_text_format(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "admin"))
    dataset, batches = api.dataset(SEQUENTIAL)
    api.commit(api.reserve(dataset, batches, pure(0.6)).json()["id"])
    api.reserve(dataset, batches, pure(0.6), status=409)
    api.reserve(dataset, batches, pure(0.1))  # stays open
    answer = client.get("/metrics", headers=bearer(METRICS_TOKEN))
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = answer.text
    for line in (
        "# TYPE ledger_commits_total counter",
        "ledger_commits_total 1",
        "ledger_reservations_total 2",
        'ledger_refusals_total{code="budget_exceeded"} 1',
        "# TYPE ledger_http_request_duration_seconds histogram",
        'ledger_http_request_duration_seconds_bucket{method="POST",'
        'route="/v1/reservations/{reservation_id}/commit",le="+Inf"} 1',
        'ledger_http_requests_total{method="POST",'
        'route="/v1/datasets/{dataset_id}/reservations",status="409"} 1',
        "ledger_open_reservations 1",
        "# TYPE ledger_reservation_age_seconds histogram",
        'ledger_reservation_age_seconds_count{outcome="committed"} 1',
    ):
        assert line in text, line
    assert "ledger_oldest_open_reservation_age_seconds " in text
    # Every sample line is "name{labels} value".
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_and_labels, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))
            assert name_and_labels.startswith("ledger_")


def test_openapi_and_docs(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert "/v1/datasets" in spec["paths"]
    schemas = spec["components"]["schemas"]
    for name in (
        "DatasetCreate",
        "DatasetPublic",
        "DatasetsPublic",
        "ReservationCreate",
        "ReservationPublic",
        "CommitRequest",
        "SpendPublic",
        "CertificatePublic",
    ):
        assert name in schemas, name
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    # Swagger UI's files are served by this app (vendored), never from a CDN.
    assert "https://" not in docs.text and "/static/vendor/swagger-ui/swagger-ui-bundle.js" in docs.text
    assert "default-src 'none'" in docs.headers["content-security-policy"]
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert client.get(f"/static/vendor/swagger-ui/{asset}").status_code == 200


def test_the_documented_range_of_rdp_orders_is_the_one_enforced(client: TestClient, keys: Keys) -> None:
    """Found by schemathesis: an order above 2^20 was schema-valid but refused. The document now
    states the accountant's bound, so a valid order at the bound is accepted and one above it is
    refused naming the field."""
    from accountant.rdp import MAX_ORDER

    spec = client.get("/openapi.json").json()
    budget = spec["components"]["schemas"]["BudgetCreate"]
    items = budget["properties"]["orders"]["anyOf"][0]["items"]
    assert items["maximum"] == MAX_ORDER and items["exclusiveMinimum"] == 1
    admin = bearer(keys.get("acme", "admin"))
    for orders, status in (([2.0, MAX_ORDER], 201), ([2.0, MAX_ORDER * 1.5], 422)):
        body = {
            "name": f"d{status}",
            "budget": {
                "rule": "sequential",
                "epsilon": 1,
                "delta": "1e-5",
                "accountant": "rdp",
                "orders": orders,
            },
        }
        answer = client.post("/v1/datasets", json=body, headers=admin)
        assert answer.status_code == status, answer.text
        if status == 422:
            assert answer.json()["field"] == "budget.orders[1]"


def test_app_opens_its_own_database(settings: Settings, db: Database, keys: Keys) -> None:
    """Without ``database=``, the app opens ``settings.database_url`` itself (as uvicorn runs)."""
    app: FastAPI = create_app(settings)
    with TestClient(app) as own:
        answer = own.get("/v1/datasets", headers=bearer(keys.get("acme", "viewer")))
    assert answer.status_code == 200
