"""Every route × scope × tenant, from one table: allowed, or refused as docs/ARCHITECTURE.md says.

Scopes nest (admin ⊇ trainer ⊇ viewer). No key or a revoked key → 401; a scope below the route's
→ 403 (decided before any lookup, so it leaks nothing); another tenant's object → 404, exactly as
an unknown id. Objects belong to tenant ``acme``; the caller is ``acme`` (own) or ``rival``
(foreign).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.app import create_app
from service.db.session import Database
from service.ledger import datasets, tenancy
from service.settings import Settings
from tests.service.api.conftest import Keys, TestClient, bearer
from tests.service.api.world import PURE, World, make_world, sequential_budget, unique

RANK = {"viewer": 0, "trainer": 1, "admin": 2}
CALLERS = ("admin", "trainer", "viewer", "none", "revoked")
TENANTS = ("own", "foreign")

Body = Callable[[World], dict[str, Any]] | None


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # placeholders: {dataset} {task} {batch} {reservation} {certificate}
    scope: str  # the least scope allowed
    ok: int  # status when allowed
    body: Body = None
    query: dict[str, str] = field(default_factory=dict)

    @property
    def mutates(self) -> bool:
        return self.method != "GET"

    @property
    def names_object(self) -> bool:
        return "{" in self.path or bool(self.query)


ROUTES: tuple[Route, ...] = (
    Route(
        "POST", "/v1/datasets", "admin", 201, lambda w: {"name": unique("ds"), "budget": sequential_budget()}
    ),
    Route("GET", "/v1/datasets", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}", "viewer", 200),
    Route(
        "PUT", "/v1/datasets/{dataset}/data-source", "admin", 200, lambda w: {"data_source": "builtin:digits"}
    ),
    Route("POST", "/v1/datasets/{dataset}/tasks", "admin", 201, lambda w: {"name": unique("t")}),
    Route("GET", "/v1/datasets/{dataset}/tasks", "viewer", 200),
    Route(
        "POST",
        "/v1/datasets/{dataset}/tasks/{task}/batches",
        "admin",
        201,
        lambda w: {"batches": [{"name": unique("b"), "records": [unique("r")]}]},
    ),
    Route("GET", "/v1/datasets/{dataset}/tasks/{task}/batches", "viewer", 200),
    Route(
        "POST",
        "/v1/datasets/{dataset}/reservations",
        "trainer",
        201,
        lambda w: {"batches": [w.batch], "event": PURE},
    ),
    Route(
        "POST", "/v1/datasets/{dataset}/quote", "viewer", 200, lambda w: {"batches": [w.batch], "event": PURE}
    ),
    Route("GET", "/v1/reservations/{reservation}", "viewer", 200),
    Route("GET", "/v1/reservations/{reservation}/batches", "viewer", 200),
    Route(
        "POST",
        "/v1/reservations/{reservation}/commit",
        "trainer",
        200,
        lambda w: {"release": {"model": "m", "version": unique("v")}},
    ),
    Route("POST", "/v1/reservations/{reservation}/abort", "trainer", 200),
    Route("POST", "/v1/reservations/{reservation}/extend", "trainer", 200, lambda w: {"ttl_s": 60}),
    # the world's batch is charged: its deletion (and its task's) is refused, 409 `charged`
    Route("DELETE", "/v1/datasets/{dataset}/tasks/{task}", "admin", 409),
    Route("DELETE", "/v1/datasets/{dataset}/tasks/{task}/batches/{batch}", "admin", 409),
    # the world holds an open reservation: archiving is refused (409 `dataset_in_use`); the world's
    # dataset is active, so unarchiving it changes nothing (200)
    Route("POST", "/v1/datasets/{dataset}/archive", "admin", 409),
    Route("POST", "/v1/datasets/{dataset}/unarchive", "admin", 200),
    Route("GET", "/v1/datasets/{dataset}/spend", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}/certificates", "viewer", 200),
    Route("GET", "/v1/certificates/{certificate}", "viewer", 200),
    Route("GET", "/v1/audit/verify", "viewer", 200),
    Route("GET", "/v1/audit/verify", "viewer", 200, query={"dataset_id": "{dataset}"}),
    # dashboard reads and the audit export (service/api/dashboard.py, audit_export.py)
    Route("GET", "/v1/spend", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}/audit", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}/batch-spend", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}/releases", "viewer", 200),
    Route("GET", "/v1/datasets/{dataset}/epsilon-history", "viewer", 200),
    Route("POST", "/v1/certificates/{certificate}/verify", "viewer", 200),
    # The world's budget is sequential/basic: an allowed declaration reaches the ledger and is
    # refused there (422 naming `plan`); the declared path is tests/service/api/test_plan_segments.py.
    Route(
        "POST",
        "/v1/datasets/{dataset}/plan-segments",
        "admin",
        422,
        lambda w: {"plan": [PURE], "delta": "1e-6"},
    ),
)

# Routes of the training worker and the model registry: their objects (jobs, published model
# versions) are made by the worker, so their rows belong with those tests. Listed here so the
# coverage check below still fails for any other route missing from the table.
TABLED_ELSEWHERE = ("/v1/jobs", "/v1/models")


def expected_status(route: Route, caller: str, tenant: str) -> int:
    if caller in ("none", "revoked"):
        return 401
    if RANK[caller] < RANK[route.scope]:
        return 403
    if tenant == "foreign" and route.names_object:
        return 404
    return route.ok


def test_the_table_covers_every_v1_route() -> None:
    app = create_app(Settings(database_url="sqlite:///unused.db"))  # the schema needs no database
    served = {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/v1/") and not path.startswith(TABLED_ELSEWHERE)
        for method in operations
    }
    placeholders = {
        "{dataset}": "{dataset_id}",
        "{task}": "{task_id}",
        "{batch}": "{batch_id}",
        "{reservation}": "{reservation_id}",
        "{certificate}": "{certificate_id}",
    }
    tabled = set()
    for route in ROUTES:
        path = route.path
        for short, name in placeholders.items():
            path = path.replace(short, name)
        tabled.add((route.method, path))
    assert served == tabled


def test_every_route_scope_and_tenant(client: TestClient, db: Database, keys: Keys) -> None:
    shared = make_world(db, "acme")
    mismatches: list[str] = []
    cases = 0
    for route in ROUTES:
        for caller in CALLERS:
            for tenant in TENANTS:
                expected = expected_status(route, caller, tenant)
                # A call that succeeds changes state: give it objects of its own.
                world = make_world(db, "acme") if route.mutates and expected < 300 else shared
                headers = _headers(keys, caller, tenant)
                path = route.path.format(**world.ids())
                query = {k: v.format(**world.ids()) for k, v in route.query.items()}
                body = route.body(world) if route.body is not None else None
                answer = client.request(route.method, path, json=body, params=query, headers=headers)
                cases += 1
                problem = _check(route, caller, tenant, expected, answer, world)
                if problem:
                    mismatches.append(
                        f"{route.method} {route.path} {query or ''} [{caller}/{tenant}]: {problem}"
                    )
    assert cases == len(ROUTES) * len(CALLERS) * len(TENANTS)
    assert not mismatches, "\n".join(mismatches)
    # the refused calls ran on the shared world: none of them set its dataset's data source
    assert datasets.get_dataset(db, "acme", shared.dataset).data_source is None


def _headers(keys: Keys, caller: str, tenant: str) -> dict[str, str]:
    if caller == "none":
        return {}
    if caller == "revoked":
        return bearer(keys.revoked)
    return bearer(keys.get("acme" if tenant == "own" else "rival", caller))


def _check(route: Route, caller: str, tenant: str, expected: int, answer: Any, world: World) -> str:
    if answer.status_code != expected:
        return f"expected {expected}, got {answer.status_code} {answer.text[:300]}"
    body = answer.json()
    if expected >= 400:
        code = {
            401: "unauthorized",
            403: "forbidden",
            404: "not_found",
            409: "conflict",
            422: "invalid_input",
        }[expected]
        if body.get("error") != code or not body.get("message"):
            return f"error body {body}"
        if expected == 401 and answer.headers.get("www-authenticate") != "Bearer":
            return "401 without WWW-Authenticate: Bearer"
        return ""
    # Allowed lists must still show nothing of another tenant.
    if route.path == "/v1/datasets" and route.method == "GET":
        ids = {d["id"] for d in body["data"]}
        if tenant == "foreign" and world.dataset in ids:
            return "another tenant's dataset is listed"
        if tenant == "own" and world.dataset not in ids:
            return "own dataset missing from the list"
    return ""


def test_auth_cache_reuses_a_lookup_for_its_ttl_only(settings: Settings, db: Database) -> None:
    """``LEDGER_AUTH_CACHE_TTL_S``: off by default (a revocation bites at once, as the table
    above checks); when set, a revoked key keeps working in this process until the TTL ends."""
    issued = tenancy.issue_api_key(db, "acme", "viewer")
    cached = create_app(settings.model_copy(update={"auth_cache_ttl_s": 0.5}), database=db)
    with TestClient(cached) as client:
        headers = bearer(issued.key)
        assert client.get("/v1/datasets", headers=headers).status_code == 200
        tenancy.revoke_api_key(db, issued.id)
        assert client.get("/v1/datasets", headers=headers).status_code == 200
        time.sleep(0.6)
        assert client.get("/v1/datasets", headers=headers).status_code == 401
        assert client.get("/v1/datasets", headers=bearer("pl_unknown")).status_code == 401
