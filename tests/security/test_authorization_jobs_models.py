"""The authorisation matrix for the routes tests/service/api/test_authorization.py leaves to others
(``TABLED_ELSEWHERE``: ``/v1/jobs``, ``/v1/models``): every route × caller (admin, trainer,
viewer, none, revoked) × tenant (own, foreign), from one table, with the same rules — no or a
revoked key → 401, a scope below the route's → 403, another tenant's object → 404.

Objects are real: a queued job (``jobs.queue.create_job``, on a dataset whose data source an admin set)
and a published model version (staged, committed through the ledger and published by the
registry, with a real artifact file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from service.app import create_app
from service.db.session import Database
from service.ledger import datasets, jobs, reservations
from service.ledger import model_registry as registry
from service.ledger.reservations import parse_event
from service.settings import Settings
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_authorization import CALLERS, RANK, TENANTS, _check, _headers
from tests.service.api.world import PURE, World, make_world, unique


@dataclass(frozen=True)
class Objects:
    world: World
    job: str
    model: str
    version: int

    def ids(self) -> dict[str, Any]:
        return {**self.world.ids(), "job": self.job, "model": self.model, "version": self.version}


@dataclass(frozen=True)
class Row:
    method: str
    path: str
    scope: str
    ok: int
    body: Callable[[Objects], dict[str, Any]] | None = None
    foreign: int = 404  # a foreign caller with enough scope
    fresh: bool = False  # an allowed call changes the object: give it its own


ROWS: tuple[Row, ...] = (
    Row(
        "POST",
        "/v1/jobs",
        "trainer",
        201,
        lambda o: {
            "dataset_id": o.world.dataset,
            "algorithm": "dp_sgd",
            "params": {"noise_multiplier": 1.0, "steps": 1},
        },
    ),
    Row("GET", "/v1/jobs", "viewer", 200, foreign=200),
    Row("GET", "/v1/jobs/{job}", "viewer", 200),
    Row("POST", "/v1/jobs/{job}/cancel", "trainer", 200, fresh=True),
    Row("GET", "/v1/models", "viewer", 200, foreign=-2),
    Row("GET", "/v1/models/{model}/versions", "viewer", 200, foreign=-1),
    Row("GET", "/v1/models/{model}/versions/{version}", "viewer", 200),
    Row("GET", "/v1/models/{model}/versions/{version}/artifact", "viewer", 200),
    # registering needs a certificate and bytes (tests/service/api/test_external_models.py, which
    # also sends another tenant's certificate): here, without them, past the key and scope, 422
    Row("PUT", "/v1/models/{model}/versions/{version}", "trainer", 422, foreign=422),
)


def _expected(row: Row, caller: str, tenant: str) -> int:
    if caller in ("none", "revoked"):
        return 401
    if RANK[caller] < RANK[row.scope]:
        return 403
    if tenant == "foreign":
        return row.foreign
    return row.ok


def _objects(db: Database, artifacts: Path) -> Objects:
    world = make_world(db, "acme")
    datasets.set_data_source(db, "acme", world.dataset, data_source="builtin:digits")  # (the admin's)
    job = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.0, "steps": 1},
    )
    model = unique("model")
    version = registry.next_version(db, "acme", model)
    staged = registry.stage(
        artifacts,
        tenant_id="acme",
        name=model,
        version=version,
        job_id=str(job.id),
        attempt=1,
        dataset_id=world.dataset,
        step=1,
        metrics={},
        fmt="torch",
        write=lambda handle: handle.write(b"weights"),
    )
    held = reservations.reserve(
        db, "acme", world.dataset, event=parse_event(PURE), batch_ids=[world.batch]
    ).to_json()
    answer = reservations.commit(
        db, "acme", held["id"], release={"model": model, "version": version}
    ).to_json()
    registry.publish(db, artifacts, staged, certificate_id=answer["certificate"]["id"])
    return Objects(world, str(job.id), model, version)


@pytest.fixture
def registry_app(settings: Settings, db: Database, tmp_path: Path) -> FastAPI:
    return create_app(settings.model_copy(update={"artifact_dir": tmp_path / "artifacts"}), database=db)


@pytest.fixture
def registry_client(registry_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(registry_app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_table_covers_every_jobs_and_models_route(registry_app: FastAPI) -> None:
    served = {
        (method.upper(), path)
        for path, operations in registry_app.openapi()["paths"].items()
        if path.startswith(("/v1/jobs", "/v1/models"))
        for method in operations
    }
    names = {"{job}": "{job_id}", "{model}": "{name}"}
    tabled = set()
    for row in ROWS:
        path = row.path
        for short, name in names.items():
            path = path.replace(short, name)
        tabled.add((row.method, path))
    assert served == tabled


def test_every_jobs_and_models_route_scope_and_tenant(
    registry_client: TestClient, db: Database, keys: Keys, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    shared = _objects(db, artifacts)
    mismatches: list[str] = []
    for row in ROWS:
        for caller in CALLERS:
            for tenant in TENANTS:
                expected = _expected(row, caller, tenant)
                objects = _objects(db, artifacts) if row.fresh and expected < 300 else shared
                path = row.path.format(**objects.ids())
                body = row.body(objects) if row.body is not None else None
                answer = registry_client.request(
                    row.method, path, json=body, headers=_headers(keys, caller, tenant)
                )
                if expected == -1:  # a listing of a name the caller's tenant does not have
                    problem = "" if answer.status_code in (200, 404) else f"got {answer.status_code}"
                    if answer.status_code == 200 and answer.json().get("data"):
                        problem = "another tenant's versions are listed"
                elif expected == -2 or (row.path == "/v1/models" and expected == 200):
                    names = (
                        {m["name"] for m in answer.json().get("data", [])}
                        if answer.status_code == 200
                        else None
                    )
                    problem = "" if answer.status_code == 200 else f"got {answer.status_code}"
                    if expected == -2 and names and shared.model in names:
                        problem = "another tenant's model is listed"
                    if expected == 200 and names is not None and shared.model not in names:
                        problem = "own model missing from the list"
                elif row.path == "/v1/jobs" and row.method == "GET" and expected == 200:
                    problem = "" if answer.status_code == 200 else f"got {answer.status_code}"
                    ids = {j["id"] for j in answer.json().get("data", [])} if not problem else set()
                    if tenant == "foreign" and shared.job in ids:
                        problem = "another tenant's job is listed"
                    if tenant == "own" and shared.job not in ids:
                        problem = "own job missing from the list"
                elif row.path.endswith("/artifact") and expected == 200:
                    problem = (
                        ""
                        if answer.status_code == 200 and answer.content == b"weights"
                        else f"got {answer.status_code} {answer.content[:100]!r}"
                    )
                else:
                    problem = _check(row, caller, tenant, expected, answer, objects.world)  # type: ignore[arg-type]
                if problem:
                    mismatches.append(f"{row.method} {row.path} [{caller}/{tenant}]: {problem}")
    assert not mismatches, "\n".join(mismatches)
