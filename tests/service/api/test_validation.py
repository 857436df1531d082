"""Bad input: 422 naming the field (also for schema errors, reshaped), 413 for oversized bodies,
404 for unknown ids — from one table, and none of it changes the ledger."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.db.session import Database
from tests.service.api.conftest import Keys, TestClient, bearer
from tests.service.api.world import PURE, World, make_world

GAUSSIAN = {"kind": "gaussian", "noise_multiplier": 1.1}


@dataclass(frozen=True)
class Bad:
    name: str
    method: str
    path: str
    body: Any  # a JSON value, or raw text (str) sent as is with Content-Type: application/json
    status: int
    field: str | None  # the field the answer must name (422)
    headers: tuple[tuple[str, str], ...] = ()


def dataset(budget: Any, name: Any = "d") -> dict[str, Any]:
    return {"name": name, "budget": budget}


def budget(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


RESERVE = "/v1/datasets/{dataset}/reservations"
COMMIT = "/v1/reservations/{reservation}/commit"
BATCHES = "/v1/datasets/{dataset}/tasks/{task}/batches"

CASES: tuple[Bad, ...] = (
    # datasets and budgets
    Bad(
        "epsilon NaN",
        "POST",
        "/v1/datasets",
        '{"name": "d", "budget": {"rule": "sequential", "epsilon": NaN, "delta": 0, "accountant": "basic"}}',
        422,
        "budget.epsilon",
    ),
    Bad(
        "epsilon Infinity",
        "POST",
        "/v1/datasets",
        '{"name": "d", "budget": {"rule": "sequential", "epsilon": Infinity, "delta": 0, '
        '"accountant": "basic"}}',
        422,
        "budget.epsilon",
    ),
    Bad(
        "epsilon 'inf' string", "POST", "/v1/datasets", dataset(budget(epsilon="inf")), 422, "budget.epsilon"
    ),
    Bad("negative epsilon", "POST", "/v1/datasets", dataset(budget(epsilon=-0.5)), 422, "budget.epsilon"),
    Bad("zero epsilon", "POST", "/v1/datasets", dataset(budget(epsilon=0)), 422, "budget.epsilon"),
    Bad("epsilon as boolean", "POST", "/v1/datasets", dataset(budget(epsilon=True)), 422, "budget.epsilon"),
    Bad("delta = 1", "POST", "/v1/datasets", dataset(budget(delta=1)), 422, "budget.delta"),
    Bad("negative delta", "POST", "/v1/datasets", dataset(budget(delta=-1e-9)), 422, "budget.delta"),
    Bad("unknown rule", "POST", "/v1/datasets", dataset(budget(rule="fancy")), 422, "budget.rule"),
    Bad(
        "unknown accountant",
        "POST",
        "/v1/datasets",
        dataset(budget(accountant="moments")),
        422,
        "budget.accountant",
    ),
    Bad(
        "geometric ratio 1",
        "POST",
        "/v1/datasets",
        dataset(budget(rule="geometric", geometric={"first": 0.5, "ratio": 1})),
        422,
        "budget.geometric.ratio",
    ),
    Bad(
        "geometric series above the budget",
        "POST",
        "/v1/datasets",
        dataset(budget(rule="geometric", epsilon=1, geometric={"first": 0.9, "ratio": 0.5})),
        422,
        "budget.geometric.first",
    ),
    Bad("prv without a plan", "POST", "/v1/datasets", dataset(budget(accountant="prv")), 422, "budget.plan"),
    Bad(
        "bad event in a plan",
        "POST",
        "/v1/datasets",
        dataset(budget(accountant="prv", plan=[GAUSSIAN, {"kind": "gaussian", "noise_multiplier": -1}])),
        422,
        "budget.plan[1].noise_multiplier",
    ),
    Bad("missing budget", "POST", "/v1/datasets", {"name": "d"}, 422, "budget"),
    Bad("empty name", "POST", "/v1/datasets", dataset(budget(), name=""), 422, "name"),
    Bad("unknown field", "POST", "/v1/datasets", {**dataset(budget()), "epsilon": 1}, 422, "epsilon"),
    Bad("not JSON", "POST", "/v1/datasets", '{"name": ', 422, "body"),
    Bad("JSON but not an object", "POST", "/v1/datasets", [1, 2], 422, "body"),
    # batches
    Bad(
        "empty records",
        "POST",
        BATCHES,
        {"batches": [{"name": "b", "records": []}]},
        422,
        "batches[0].records",
    ),
    Bad(
        "float record id",
        "POST",
        BATCHES,
        {"batches": [{"name": "b", "records": [1.5]}]},
        422,
        "batches[0].records[0]",
    ),
    Bad("no batches", "POST", BATCHES, {"batches": []}, 422, "batches"),
    # reservations and events
    Bad(
        "unknown event kind",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "event": {"kind": "telepathy"}},
        422,
        "event.kind",
    ),
    Bad(
        "event epsilon NaN",
        "POST",
        RESERVE,
        '{"batches": ["{batch}"], "event": {"kind": "pure_dp", "epsilon": NaN}}',
        422,
        "event.epsilon",
    ),
    Bad(
        "negative event epsilon",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "event": {"kind": "pure_dp", "epsilon": -1}},
        422,
        "event.epsilon",
    ),
    Bad(
        "q = 0",
        "POST",
        RESERVE,
        {
            "batches": ["{batch}"],
            "event": {"kind": "poisson_sampled", "sampling_probability": 0, "event": GAUSSIAN},
        },
        422,
        "event.sampling_probability",
    ),
    Bad(
        "q > 1",
        "POST",
        RESERVE,
        {
            "batches": ["{batch}"],
            "event": {"kind": "poisson_sampled", "sampling_probability": 1.5, "event": GAUSSIAN},
        },
        422,
        "event.sampling_probability",
    ),
    Bad(
        "nested noise multiplier inf",
        "POST",
        RESERVE,
        '{"batches": ["{batch}"], "event": {"kind": "poisson_sampled", '
        '"sampling_probability": 0.01, "event": {"kind": "gaussian", '
        '"noise_multiplier": Infinity}}}',
        422,
        "event.event.noise_multiplier",
    ),
    Bad(
        "composed event with a bad member",
        "POST",
        RESERVE,
        {
            "batches": ["{batch}"],
            "event": {"kind": "composed", "events": [GAUSSIAN, {"kind": "laplace", "scale": -2}]},
        },
        422,
        "event.events[1].scale",
    ),
    Bad(
        "approx_dp delta 1",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "event": {"kind": "approx_dp", "epsilon": 1, "delta": 1}},
        422,
        "event.delta",
    ),
    Bad(
        "batches and tasks",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "tasks": ["{task}"], "event": PURE},
        422,
        "batches",
    ),
    Bad("neither batches nor tasks", "POST", RESERVE, {"event": PURE}, 422, "batches"),
    Bad("missing event", "POST", RESERVE, {"batches": ["{batch}"]}, 422, "event"),
    Bad(
        "empty noise commitment",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "event": PURE, "noise_commitment": ""},
        422,
        "noise_commitment",
    ),
    Bad("negative ttl", "POST", RESERVE, {"batches": ["{batch}"], "event": PURE, "ttl_s": -1}, 422, "ttl_s"),
    Bad(
        "idempotency key too long",
        "POST",
        RESERVE,
        {"batches": ["{batch}"], "event": PURE},
        422,
        "Idempotency-Key",
        headers=(("Idempotency-Key", "k" * 300),),
    ),
    Bad("unknown batch", "POST", RESERVE, {"batches": ["batch_nope"], "event": PURE}, 404, None),
    Bad(
        "unknown dataset",
        "POST",
        "/v1/datasets/ds_nope/reservations",
        {"batches": ["{batch}"], "event": PURE},
        404,
        None,
    ),
    # commits
    Bad("missing release", "POST", COMMIT, {}, 422, "release"),
    Bad(
        "release version boolean",
        "POST",
        COMMIT,
        {"release": {"model": "m", "version": True}},
        422,
        "release.version",
    ),
    Bad(
        "progressive event invalid",
        "POST",
        COMMIT,
        {"release": {"model": "m", "version": "1"}, "event": {"kind": "laplace", "scale": 0}},
        422,
        "event.scale",
    ),
    Bad(
        "unknown reservation",
        "POST",
        "/v1/reservations/res_nope/commit",
        {"release": {"model": "m", "version": "1"}},
        404,
        None,
    ),
    Bad("unknown certificate", "GET", "/v1/certificates/cert_nope", None, 404, None),
    Bad("unknown route", "GET", "/v1/nothing-here", None, 404, None),
)


def _fill(value: Any, world: World) -> Any:
    if isinstance(value, str):
        return value.replace("{batch}", world.batch).replace("{task}", world.task)
    if isinstance(value, list):
        return [_fill(v, world) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, world) for k, v in value.items()}
    return value


def test_bad_input_is_refused_naming_the_field(client: TestClient, db: Database, keys: Keys) -> None:
    world = make_world(db, "acme")
    admin = bearer(keys.get("acme", "admin"))
    before = _snapshot(client, admin, world)
    mismatches = []
    for case in CASES:
        path = case.path.format(**world.ids())
        headers = {**admin, "Content-Type": "application/json", **dict(case.headers)}
        body = _fill(case.body, world)
        content = body if isinstance(body, str) else (None if body is None else json.dumps(body))
        answer = client.request(case.method, path, content=content, headers=headers)
        problem = _check(case, answer)
        if problem:
            mismatches.append(f"{case.name}: {problem}")
    assert not mismatches, "\n".join(mismatches)
    assert _snapshot(client, admin, world) == before, "a refused call changed the ledger"


def _check(case: Bad, answer: Any) -> str:
    if answer.status_code != case.status:
        return f"expected {case.status}, got {answer.status_code}: {answer.text[:400]}"
    body = answer.json()
    if not isinstance(body.get("error"), str) or not isinstance(body.get("message"), str):
        return f"not an error body: {body}"
    if case.status == 422:
        if body["error"] != "invalid_input":
            return f"error code {body['error']}"
        if body.get("field") != case.field:
            return f"field {body.get('field')!r}, expected {case.field!r}: {body['message']}"
        if case.field not in body["message"] and case.field != "body":
            return f"message does not name {case.field!r}: {body['message']}"
    if case.status == 404 and body["error"] != "not_found":
        return f"error code {body['error']}"
    return ""


def _snapshot(client: TestClient, headers: dict[str, str], world: World) -> Any:
    spend = client.get(f"/v1/datasets/{world.dataset}/spend", headers=headers).json()
    audit = client.get("/v1/audit/verify", headers=headers).json()
    listed = client.get("/v1/datasets", headers=headers).json()
    assert audit["ok"], audit
    return spend, audit["entries"], listed["count"]


def test_oversized_body_is_413_before_parsing(client: TestClient, keys: Keys) -> None:
    admin = bearer(keys.get("acme", "admin"))
    limit = client.app.state.settings.max_body_bytes  # type: ignore[attr-defined]
    records = [f"record-{i:08d}" for i in range(limit // 10)]
    body = json.dumps({"batches": [{"name": "huge", "records": records}]})
    assert len(body) > limit
    answer = client.post(
        "/v1/datasets/ds_any/tasks/task_any/batches",
        content=body,
        headers={**admin, "Content-Type": "application/json"},
    )
    assert answer.status_code == 413
    assert answer.json()["error"] == "payload_too_large"
    assert answer.json()["limit"] == limit

    # Without a Content-Length (chunked), the limit still holds.
    def chunks() -> Any:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536].encode()

    answer = client.post(
        "/v1/datasets/ds_any/tasks/task_any/batches",
        content=chunks(),
        headers={**admin, "Content-Type": "application/json"},
    )
    assert answer.status_code == 413
    assert answer.json()["error"] == "payload_too_large"
