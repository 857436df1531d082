"""Issue 24 §2 over HTTP, on both databases: looking at the data and aborting is not free.

Before: on ``sequential``, ``parallel`` and ``lifelong`` budgets of ε = 1, twenty reservations of
ε = 1, each aborted (or left to expire), left spend 0 and held 0, and a final commit still
certified ε = 1 — a trainer that trains, looks, aborts and retries learned about k·ε from k runs,
and an abort freed ``parallel``'s single read and ``lifelong``'s single noise draw. Now an abort
or an expiry settles the whole reserved event with a certificate (``release: null``, ``outcome:
"aborted"`` / ``"expired"``): the first one spends the budget and every later reservation is
refused. Aborts are idempotent (charged once), and another tenant's key cannot abort.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from accountant.certificates import verify
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api, pure

BUDGETS = {
    rule: {"rule": rule, "epsilon": "1", "delta": "0", "accountant": "basic"}
    for rule in ("sequential", "parallel", "lifelong")
}
# What the second reservation is refused with, once the first one's abort spent the budget.
REFUSED = {"sequential": "budget_exceeded", "parallel": "batch_already_read", "lifelong": "budget_exceeded"}


def _close(api: Api, reservation_id: str, how: str) -> None:
    if how == "abort":
        api.call("POST", f"/v1/reservations/{reservation_id}/abort", status=200)
    else:  # left to expire: its 0.2 s TTL passes; the next spend transaction expires it first
        time.sleep(0.4)


# sequential's twenty aborted looks: seconds of pricing; outside the fast loop (README, Development).
@pytest.mark.parametrize(
    ("rule", "how"),
    [
        pytest.param(rule, how, marks=pytest.mark.slow)
        if (rule, how) == ("sequential", "abort")
        else (rule, how)
        for rule in sorted(BUDGETS)
        for how in ("abort", "expire")
    ],
)
def test_twenty_looks_and_aborts_cost_the_budget_once(
    client: TestClient, keys: Keys, rule: str, how: str
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGETS[rule])
    granted: list[str] = []
    refusals: list[str] = []
    for attempt in range(20):
        # lifelong: each retry draws fresh noise (its own commitment), as a retrier would
        extra: dict[str, Any] = {"noise_commitment": f"draw-{attempt}"} if rule == "lifelong" else {}
        ttl_s = 0.2 if how == "expire" else 60
        answer = trainer.reserve(dataset, batches, pure(1), status=None, ttl_s=ttl_s, **extra)
        if answer.status_code == 201:
            granted.append(answer.json()["id"])
            _close(trainer, granted[-1], how)
        else:
            assert answer.status_code == 409, answer.text
            refusals.append(answer.json()["error"])
    assert len(granted) == 1 and set(refusals) == {REFUSED[rule]}, (granted, refusals)
    state = trainer.call("GET", f"/v1/reservations/{granted[0]}", status=200).json()
    assert state["status"] == ("aborted" if how == "abort" else "expired")
    assert state["committed"]["epsilon"] == "1"
    spend = admin.spend(dataset)
    assert (spend["epsilon_spent"], spend["epsilon_held"], spend["last_release"]) == ("1", "0", None)
    (certificate,) = admin.call("GET", f"/v1/datasets/{dataset}/certificates", status=200).json()["data"]
    body = certificate["certificate"]
    outcome = "aborted" if how == "abort" else "expired"
    assert (certificate["outcome"], certificate["release"], body["outcome"], body["release"]) == (
        outcome,
        None,
        outcome,
        None,
    )
    assert body["result"]["charge"]["epsilon"] == "1" and verify(body).ok
    checked = admin.call("POST", f"/v1/certificates/{certificate['id']}/verify", status=200).json()
    assert checked["ok"], checked
    assert admin.audit()["ok"]


def test_lifelong_abort_uses_the_noise_draw(client: TestClient, keys: Keys) -> None:
    """The aborted run's noise was drawn and may have been looked at: it is committed, so a
    replay of it is free (post-processing) and fresh noise is a new charge that no longer fits."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGETS["lifelong"])
    first = trainer.reserve(dataset, batches, pure(1), noise_commitment="c").json()
    trainer.call("POST", f"/v1/reservations/{first['id']}/abort", status=200)
    assert admin.spend(dataset)["epsilon_spent"] == "1"
    fresh = trainer.reserve(dataset, batches, pure(1), noise_commitment="d", status=409).json()
    assert fresh["error"] == "budget_exceeded"
    replay = trainer.reserve(dataset, batches, pure(1), noise_commitment="c").json()
    assert replay["cost"]["epsilon"] == "0"
    trainer.commit(replay["id"])
    assert admin.spend(dataset)["epsilon_spent"] == "1"


def test_abort_is_idempotent_and_charged_once(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGETS["sequential"])
    held = trainer.reserve(dataset, batches, pure(0.3)).json()
    path = f"/v1/reservations/{held['id']}/abort"
    first = trainer.call("POST", path, status=200).json()
    assert trainer.call("POST", path, status=200).json() == first
    keyed = trainer.call("POST", path, status=200, **{"Idempotency-Key": "abort-1"}).json()
    assert trainer.call("POST", path, status=200, **{"Idempotency-Key": "abort-1"}).json() == keyed == first
    assert first["status"] == "aborted" and first["committed"]["epsilon"] == "0.3"
    assert admin.spend(dataset)["epsilon_spent"] == "0.3"
    assert admin.call("GET", f"/v1/datasets/{dataset}/certificates", status=200).json()["count"] == 1
    assert trainer.commit(held["id"], status=409).json()["reason"] == "reservation_closed"
    assert admin.spend(dataset)["epsilon_spent"] == "0.3"


def test_another_tenant_cannot_abort(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    rival = Api(client, keys.get("rival", "trainer"))
    dataset, batches = admin.dataset(BUDGETS["sequential"])
    held = trainer.reserve(dataset, batches, pure(0.4)).json()
    answer = rival.call("POST", f"/v1/reservations/{held['id']}/abort", status=404).json()
    assert answer["error"] == "not_found"
    assert trainer.call("GET", f"/v1/reservations/{held['id']}", status=200).json()["status"] == "reserved"
    spend = admin.spend(dataset)
    assert (spend["epsilon_spent"], spend["epsilon_held"]) == ("0", "0.4")
    viewer = Api(client, keys.get("acme", "viewer"))
    viewer.call("POST", f"/v1/reservations/{held['id']}/abort", status=403)
    assert admin.spend(dataset)["epsilon_spent"] == "0"


def test_no_http_caller_can_say_what_ran(client: TestClient, keys: Keys) -> None:
    """Only the in-process worker says what ran (``reservations.abort(ran=...)``): an admin key
    that sends a body claiming nothing ran, or a short run, is charged the whole reservation."""
    admin = Api(client, keys.get("acme", "admin"))
    dataset, batches = admin.dataset({**BUDGETS["sequential"], "epsilon": "2"})
    run = {"kind": "self_composed", "count": 10, "event": pure(0.05)}
    for claim in ({"ran": None}, {"ran": {"event": {**run, "count": 1}}}, {"event": {**run, "count": 1}}):
        held = admin.reserve(dataset, batches, run).json()
        answer = admin.call("POST", f"/v1/reservations/{held['id']}/abort", claim)
        assert answer.status_code in (200, 422), answer.text
        if answer.status_code == 422:  # refused outright: then a plain abort
            answer = admin.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)
        assert answer.json()["committed"]["epsilon"] == "0.5", claim
    assert admin.spend(dataset)["epsilon_spent"] == "1.5"
