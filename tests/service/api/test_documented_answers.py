"""The models a route documents are a real check of what it answers, on both databases.

Most JSON routes answer through their ``response_model``: FastAPI validates every answer against
it. The hot routes (reserve, commit, abort, spend) and ``POST /v1/jobs`` skip it (``json_answer``, see
``service.api.responses``) and only document their model in ``responses=``; here each of them is
driven through real HTTP for every status it documents, and its answer is checked against the
model it documents, with nothing undocumented allowed: an answer that grows, loses or renames a
field, or reorders its fields, fails. The answers of the routes that do have a ``response_model``
are held to the same standard (their models allow extra fields, so FastAPI alone would not notice
one). And every JSON route must either have a ``response_model`` or document a model for its
success status, so that a new route cannot skip the check.

Error bodies are checked against ``ErrorBody`` (``error`` and ``message``), whose contract lets
an error carry the details it names (``field``, ``reason``, ``remaining``, ...).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pkgutil
from typing import Any

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel

import service.api
from service.api.schemas import ErrorBody
from service.db.session import Database
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api, pure, unique

APP_ROUTES = {"/healthz", "/metrics"}  # declared on the app itself (service.app), not a JSON answer


def _routers() -> dict[str, APIRouter]:
    found = {}
    for info in pkgutil.iter_modules(service.api.__path__):
        router = getattr(importlib.import_module(f"service.api.{info.name}"), "router", None)
        if isinstance(router, APIRouter):
            found[info.name] = router
    return found


def _api_routes() -> list[APIRoute]:
    # FastAPI wraps the routes of an included router, so the app's own list does not show them.
    return [r for router in _routers().values() for r in router.routes if isinstance(r, APIRoute)]


def _route(method: str, path: str) -> APIRoute:
    (route,) = [r for r in _api_routes() if r.path == path and method in r.methods]
    return route


def _documented(method: str, path: str, status: int) -> type[BaseModel]:
    """The model the route declares for ``status``: its ``response_model`` for its own status,
    else the ``model`` of its ``responses`` entry."""
    route = _route(method, path)
    if status == (route.status_code or 200) and route.response_model is not None:
        model = route.response_model
    else:
        model = route.responses[status]["model"]
    assert isinstance(model, type) and issubclass(model, BaseModel), (method, path, status)
    return model


def _nothing_undocumented(value: Any, where: str) -> None:
    if isinstance(value, BaseModel):
        extra = value.model_extra or {}
        assert not extra, f"{where}: fields {sorted(extra)} are not in {type(value).__name__}"
        for name in type(value).model_fields:
            _nothing_undocumented(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _nothing_undocumented(item, f"{where}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _nothing_undocumented(item, f"{where}.{key}")


def checked(
    api: Api,
    method: str,
    path: str,
    route: str,
    body: Any = None,
    status: int = 200,
    *,
    replay: bool = False,
    **headers: str,
) -> Any:
    """Call ``path`` (an instance of the route ``route``), expect ``status``, and hold the answer
    to the model the route documents for it; the answer's JSON. ``replay``: an idempotent retry
    whose answer is a stored one, whose keys come back in the canonical (sorted) order the
    database stores them in: its fields are checked, not their order."""
    response = api.call(method, path, body, status, **headers)
    return holds(_documented(method, route, status), response.json(), replay=replay)


def holds(model: type[BaseModel], answer: Any, *, replay: bool = False) -> Any:
    """``answer``, checked against ``model`` (see ``checked``)."""
    parsed = model.model_validate(answer)
    if model is ErrorBody:
        return answer
    _nothing_undocumented(parsed, model.__name__)
    # Nothing lost that the model knows (an optional field the answer has stays set), and the
    # model's order is the answer's.
    dumped = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if replay:
        assert dumped == answer
    else:
        assert json.dumps(dumped) == json.dumps(answer), f"{model.__name__} is not the answer's order"
    return answer


RESERVE = "/v1/datasets/{dataset_id}/reservations"
COMMIT = "/v1/reservations/{reservation_id}/commit"
ABORT = "/v1/reservations/{reservation_id}/abort"
GEOMETRIC = {
    "rule": "geometric",
    "epsilon": "4",
    "delta": "0",
    "accountant": "basic",
    "geometric": {"first": "0.5", "ratio": "0.5"},
}
LIFELONG = {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"}
SEQUENTIAL = {"rule": "sequential", "epsilon": "1", "delta": "0.00001", "accountant": "basic"}


def test_every_json_route_checks_or_documents_its_answer(client: TestClient) -> None:
    routes = _api_routes()
    paths = {r.path for r in routes}
    # every route of the app is a route of a service.api router, so the walk below sees it
    assert set(client.app.openapi()["paths"]) - APP_ROUTES <= paths  # type: ignore[attr-defined]
    skipping = []
    for route in routes:
        response_class = getattr(route.response_class, "value", route.response_class)
        if not issubclass(response_class, JSONResponse) or route.response_model is not None:
            continue  # a file, or checked by FastAPI on every answer
        status = route.status_code or 200
        documented = route.responses.get(status, {}).get("model")
        assert isinstance(documented, type) and issubclass(documented, BaseModel), (
            f"{sorted(route.methods)} {route.path} has no response_model and documents no model "
            f"for its {status}"
        )
        skipping.append((route.path, status))
    # the hot path skips the check (service.api.responses): its documented models are tested here
    assert {(RESERVE, 201), (COMMIT, 200), (ABORT, 200), ("/v1/jobs", 201)} <= set(skipping)


def test_the_hot_routes_answer_their_documented_models(client: TestClient, keys: Keys, db: Database) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(SEQUENTIAL, batches=3)
    reserve = f"/v1/datasets/{dataset}/reservations"
    held = checked(trainer, "POST", reserve, RESERVE, {"batches": batches[:2], "event": pure(0.25)}, 201)
    # an idempotent retry answers the reservation as it is now
    body = {"batches": [batches[2]], "event": pure(0.25), "noise_commitment": "n1"}
    first = checked(trainer, "POST", reserve, RESERVE, body, 201, **{"Idempotency-Key": "k1"})
    again = checked(trainer, "POST", reserve, RESERVE, body, 201, replay=True, **{"Idempotency-Key": "k1"})
    assert again == first
    refused = checked(trainer, "POST", reserve, RESERVE, {"batches": batches, "event": pure(5)}, 409)
    assert refused["error"] == "budget_exceeded" and refused["remaining"]["epsilon"] == "0.75"
    invalid = checked(trainer, "POST", reserve, RESERVE, {"batches": batches, "event": pure(-1)}, 422)
    assert invalid["field"] == "event.epsilon"
    unknown = "/v1/datasets/ds_0123456789abcdef01234567/reservations"
    assert checked(trainer, "POST", unknown, RESERVE, {"batches": batches, "event": pure(1)}, 404)

    commit = f"/v1/reservations/{held['id']}/commit"
    release = {"model": "m", "version": 1, "artifact_sha256": "ab" * 32}
    key = {"Idempotency-Key": "c1"}
    done = checked(trainer, "POST", commit, COMMIT, {"release": release}, 200, **key)
    assert done["reservation"]["status"] == "committed" and done["certificate"]["release"] == release
    assert checked(trainer, "POST", commit, COMMIT, {"release": release}, 200, replay=True, **key) == done
    closed = checked(trainer, "POST", commit, COMMIT, {"release": {"model": "m", "version": 2}}, 409)
    assert closed["error"] == "conflict"
    assert (
        checked(trainer, "POST", commit, COMMIT, {"release": {"model": "m"}}, 422)["field"]
        == "release.version"
    )
    assert checked(trainer, "POST", "/v1/reservations/res_0/commit", COMMIT, {"release": release}, 404)

    abort = f"/v1/reservations/{first['id']}/abort"
    aborted = checked(trainer, "POST", abort, ABORT, None, 200)
    assert aborted["status"] == "aborted"
    checked(trainer, "POST", f"/v1/reservations/{held['id']}/abort", ABORT, None, 409)
    checked(trainer, "POST", "/v1/reservations/res_0/abort", ABORT, None, 404)


def test_reservation_classes_with_a_level_and_a_replay_are_documented(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    geometric, batches = admin.dataset(GEOMETRIC)
    body = {"batches": batches, "event": pure(0.5)}
    leveled = checked(trainer, "POST", f"/v1/datasets/{geometric}/reservations", RESERVE, body, 201)
    assert leveled["batches"]["classes"][0]["level"] == 0
    lifelong, batches = admin.dataset(LIFELONG)
    body = {"batches": batches, "event": pure(1), "noise_commitment": "c"}
    drawn = checked(trainer, "POST", f"/v1/datasets/{lifelong}/reservations", RESERVE, body, 201)
    checked(
        trainer,
        "POST",
        f"/v1/reservations/{drawn['id']}/commit",
        COMMIT,
        {"release": {"model": "m", "version": 1}},
    )
    replay = checked(trainer, "POST", f"/v1/datasets/{lifelong}/reservations", RESERVE, body, 201)
    assert replay["batches"]["classes"][0]["replay"] is True


def _job_dataset(admin: Api) -> str:
    body = {"name": unique("ds"), "budget": SEQUENTIAL, "data_source": "builtin:digits"}
    dataset: str = admin.call("POST", "/v1/datasets", body, 201).json()["id"]
    task = admin.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t"}, 201).json()["id"]
    records = {"batches": [{"name": "b", "records": ["r0", "r1", "r2", "r3"]}]}
    admin.call("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", records, 201)
    return dataset


def test_a_queued_job_answers_its_documented_model(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, other = _job_dataset(admin), _job_dataset(admin)
    params = {"noise_multiplier": 1.0, "steps": 5, "learning_rate": 1e-05, "model_name": "shared"}
    job = {"dataset_id": dataset, "algorithm": "dp_sgd", "params": params}
    queued = checked(trainer, "POST", "/v1/jobs", "/v1/jobs", job, 201, **{"Idempotency-Key": "j1"})
    assert queued["status"] == "queued" and queued["params"] == params
    again = checked(
        trainer, "POST", "/v1/jobs", "/v1/jobs", job, 201, replay=True, **{"Idempotency-Key": "j1"}
    )
    assert again == queued
    taken = checked(trainer, "POST", "/v1/jobs", "/v1/jobs", {**job, "dataset_id": other}, 409)
    assert taken["reason"] == "model_name_taken"
    invalid = checked(trainer, "POST", "/v1/jobs", "/v1/jobs", {**job, "params": {"steps": 5}}, 422)
    assert invalid["field"].startswith("params.")
    missing = {**job, "dataset_id": "ds_0123456789abcdef01234567"}
    assert checked(trainer, "POST", "/v1/jobs", "/v1/jobs", missing, 404)["error"] == "not_found"


def test_the_routes_fastapi_checks_answer_nothing_their_models_leave_out(
    client: TestClient, keys: Keys
) -> None:
    """Their models allow extra fields (``_Public``): FastAPI passes a field the model does not
    name, so this holds their answers to the model as strictly as the hot routes'."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    geometric, batches = admin.dataset(GEOMETRIC)
    held = trainer.reserve(geometric, batches, pure(0.5)).json()
    trainer.commit(held["id"], release={"model": "g", "version": 1})
    spend = checked(trainer, "GET", f"/v1/datasets/{geometric}/spend", "/v1/datasets/{dataset_id}/spend")
    assert spend["geometric"] == {"first": "0.5", "ratio": "0.5", "infinite_horizon_bound": "1"}
    audit = "/v1/datasets/{dataset_id}/audit"
    page = checked(trainer, "GET", f"/v1/datasets/{geometric}/audit?after=1&limit=2", audit)
    assert [e["chain_seq"] for e in page["data"]] == [2, 3] and page["next_after"] == 3

    dataset = _job_dataset(admin)
    params = {"noise_multiplier": 1.0, "steps": 5, "learning_rate": 1e-05}
    job = trainer.call(
        "POST", "/v1/jobs", {"dataset_id": dataset, "algorithm": "dp_sgd", "params": params}, 201
    )
    job_id = job.json()["id"]
    listed = checked(trainer, "GET", f"/v1/jobs?dataset_id={dataset}", "/v1/jobs")
    assert [j["id"] for j in listed["data"]] == [job_id] and "metric_history" not in listed["data"][0]
    assert checked(trainer, "GET", f"/v1/jobs/{job_id}", "/v1/jobs/{job_id}")["metric_history"] is None
    cancelled = checked(trainer, "POST", f"/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/cancel")
    assert cancelled["status"] == "cancelled"

    # a version trained outside, registered under its release's certificate
    weights = b"weights of ext v1" * 4
    sha256 = hashlib.sha256(weights).hexdigest()
    (task,) = admin.call("GET", f"/v1/datasets/{dataset}/tasks", status=200).json()["data"]
    reserved = trainer.call(
        "POST", f"/v1/datasets/{dataset}/reservations", {"tasks": [task["id"]], "event": pure(0.1)}, 201
    )
    release = {"model": "ext", "version": 1, "artifact_sha256": sha256}
    certificate = trainer.commit(reserved.json()["id"], release=release).json()["certificate"]["id"]
    query = {
        "certificate_id": certificate,
        "sha256": sha256,
        "architecture": "MLP 64-32",
        "preprocessing": "pixels / 16",
        "metrics": json.dumps({"accuracy": 0.5, "loss": 2e-05}),
    }
    put = "/v1/models/{name}/versions/{version}"
    for status in (201, 200):  # registered, then registered before with these bytes
        answer = client.put(
            "/v1/models/ext/versions/1", params=query, content=weights, headers=trainer.headers
        )
        assert answer.status_code == status, answer.text
        assert holds(_documented("PUT", put, status), answer.json())["origin"] == "external"
    assert checked(trainer, "GET", "/v1/models", "/v1/models")["data"][0]["external_versions"] == 1
    versions = checked(trainer, "GET", "/v1/models/ext/versions", "/v1/models/{name}/versions")
    assert versions["data"][0]["guarantee"] == {"epsilon": "0.1", "delta": "0.00001"}  # the budget's δ
    detail = checked(trainer, "GET", "/v1/models/ext/versions/1", put)
    assert detail["certificate"]["id"] == certificate and "privacy_audit" not in detail
