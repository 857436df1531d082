"""Issue 28 §2 over HTTP, on both databases: a hold can be renewed, within a bound, audited.

``POST /v1/reservations/{id}/extend {ttl_s}`` holds an open reservation until
``max(expires_at, now + ttl_s)``, at most ``LEDGER_RESERVATION_MAX_LIFETIME_S`` after its
creation. Attacked: another tenant's reservation, a committed, an aborted and an expired one, a
ttl beyond the bound (in one call, and by repeats), repeats with and without an Idempotency-Key.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import FastAPI

from service.app import create_app
from service.db.session import Database
from service.settings import Settings
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import SEQUENTIAL, Api, pure

MAX_LIFETIME_S = 100.0


@pytest.fixture
def app(settings: Settings, db: Database) -> FastAPI:
    return create_app(
        settings.model_copy(update={"reservation_ttl_s": 60.0, "reservation_max_lifetime_s": MAX_LIFETIME_S}),
        database=db,
    )


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _extend(api: Api, reservation: str, ttl_s: Any, status: int | None = 200, **headers: str) -> Any:
    return api.call("POST", f"/v1/reservations/{reservation}/extend", {"ttl_s": ttl_s}, status, **headers)


def _extensions(api: Api, dataset: str) -> list[dict[str, Any]]:
    entries = api.call("GET", f"/v1/datasets/{dataset}/audit", status=200).json()["data"]
    return [e["payload"] for e in entries if e["event_type"] == "reservation.extended"]


def test_extend_renews_within_the_bound_and_is_audited(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(SEQUENTIAL)
    # 3 s: the extend below must come before the first expiry (1 s was missed once, on a loaded
    # machine, between the reserve's answer and the extend)
    held = trainer.reserve(dataset, batches, pure(0.25), ttl_s=3).json()
    created, first = _at(held["created_at"]), _at(held["expires_at"])

    asked = datetime.now(UTC)
    extended = _extend(trainer, held["id"], 60).json()
    assert extended["status"] == "reserved" and extended["cost"] == held["cost"]
    assert 59 <= (_at(extended["expires_at"]) - asked).total_seconds() <= 61  # 60 s from now
    (entry,) = _extensions(admin, dataset)
    assert (entry["reservation_id"], entry["ttl_s"], entry["expires_at"]) == (
        held["id"],
        60,
        extended["expires_at"],
    )
    # past the first expiry: the extended hold is still open
    time.sleep(max(0.0, (first - datetime.now(UTC)).total_seconds()) + 0.2)
    assert trainer.call("GET", f"/v1/reservations/{held['id']}", status=200).json()["status"] == "reserved"

    # A shorter heartbeat never shortens the hold, and changes (and audits) nothing.
    again = _extend(trainer, held["id"], 5).json()
    assert again["expires_at"] == extended["expires_at"] and len(_extensions(admin, dataset)) == 1

    # Beyond the maximum lifetime from creation: refused, naming ttl_s and how far it may go.
    refused = _extend(trainer, held["id"], MAX_LIFETIME_S, status=409).json()
    assert (refused["error"], refused["reason"], refused["field"]) == (
        "reservation_lifetime_exceeded",
        "reservation_lifetime_exceeded",
        "ttl_s",
    )
    assert (_at(refused["latest_expires_at"]) - created).total_seconds() == MAX_LIFETIME_S
    assert _extend(trainer, held["id"], MAX_LIFETIME_S + 1, status=409).json()["field"] == "ttl_s"
    for bad in (0, -1, "soon", None, True):
        assert _extend(trainer, held["id"], bad, status=422).json()["field"] == "ttl_s", bad
    state = trainer.call("GET", f"/v1/reservations/{held['id']}", status=200).json()
    assert state["expires_at"] == extended["expires_at"]

    # Another tenant's reservation does not exist for it; a viewer may not extend.
    assert (
        _extend(Api(client, keys.get("rival", "trainer")), held["id"], 60, status=404).json()["error"]
        == "not_found"
    )
    assert _extend(Api(client, keys.get("acme", "viewer")), held["id"], 60, status=403)
    assert _extend(trainer, "res_nosuch", 60, status=404)

    trainer.commit(held["id"])
    closed = _extend(trainer, held["id"], 60, status=409).json()
    assert (closed["reason"], closed["status"]) == ("reservation_closed", "committed")
    assert len(_extensions(admin, dataset)) == 1
    assert admin.audit()["ok"]


def test_extend_replays_and_refuses_closed_holds(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(SEQUENTIAL, batches=3)

    held = trainer.reserve(dataset, batches[:1], pure(0.1), ttl_s=5).json()
    first = _extend(trainer, held["id"], 30, **{"Idempotency-Key": "beat-1"}).json()
    replay = _extend(trainer, held["id"], 30, **{"Idempotency-Key": "beat-1"}).json()
    assert replay["expires_at"] == first["expires_at"] and len(_extensions(admin, dataset)) == 1
    other = _extend(trainer, held["id"], 40, status=409, **{"Idempotency-Key": "beat-1"}).json()
    assert other["error"] == "idempotency_conflict"

    aborted = trainer.reserve(dataset, batches[1:2], pure(0.1)).json()
    trainer.call("POST", f"/v1/reservations/{aborted['id']}/abort", status=200)
    answer = _extend(trainer, aborted["id"], 30, status=409).json()
    assert (answer["reason"], answer["status"]) == ("reservation_closed", "aborted")

    # Past its time: the extension expires it (charged, as any expiry) and is refused.
    late = trainer.reserve(dataset, batches[2:], pure(0.1), ttl_s=0.3).json()
    time.sleep(0.5)
    expired = _extend(trainer, late["id"], 30, status=409).json()
    assert expired["reason"] == "reservation_expired" and "charges everything reserved" in expired["message"]
    state = trainer.call("GET", f"/v1/reservations/{late['id']}", status=200).json()
    assert (state["status"], state["committed"]["epsilon"]) == ("expired", "0.1")
    assert _extend(trainer, late["id"], 30, status=409).json()["reason"] == "reservation_expired"
    assert _extensions(admin, dataset) == [
        {
            "reservation_id": held["id"],
            "ttl_s": 30.0,
            "previous_expires_at": held["expires_at"],
            "expires_at": first["expires_at"],
        }
    ]
    assert admin.audit()["ok"]


def test_reserve_ttl_beyond_the_lifetime_is_refused(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(SEQUENTIAL)
    refused = trainer.reserve(dataset, batches, pure(0.1), status=409, ttl_s=MAX_LIFETIME_S + 1).json()
    assert refused["reason"] == "reservation_lifetime_exceeded" and refused["field"] == "ttl_s"
    assert admin.spend(dataset)["epsilon_held"] == "0"
