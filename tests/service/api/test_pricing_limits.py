"""Pricing is bounded per request, metered per tenant, and never done under the write lock
(security review, issue 12 §2 "one trainer key freezes every tenant's writes").

* A request whose pricing work (event nodes × the budget's orders) is above
  ``LEDGER_MAX_PRICING_WORK`` is refused (422 naming ``event``) before anything is priced or held.
* A tenant that used up its pricing time gets 429 ``rate_limited`` with ``Retry-After``; another
  tenant is not affected.
* While one tenant's costly reservation is being priced, another tenant's write goes through (on
  SQLite the spend transaction is the whole database's write lock: pricing inside it froze every
  tenant's writes for as long as the pricing took).
* ``POST /v1/certificates/{id}/verify`` (a viewer's call, which recomputes every price) is bounded
  and metered the same way.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy.engine import URL

from accountant import events as ev
from accountant.rules import Budget
from service.api.ratelimit import SECONDS_PER_UNIT, PricingRates, SharedPricingRates
from service.app import create_app
from service.db.session import Database
from service.ledger import meters, pricing_limits, tenancy
from service.ledger.errors import RateLimited
from service.settings import Settings
from tests.service.api.conftest import (
    METRICS_TOKEN,
    Keys,
    Server,
    TestClient,
    bearer,
    start_server,
    stop_server,
    url_text,
)
from tests.service.api.test_ledger_over_http import Api
from tests.service.api.world import unique

ORDERS_1000 = [round(float(x), 6) for x in np.linspace(1.1, 256.0, 1000)]
RDP_1000 = {
    "rule": "sequential",
    "epsilon": "1000",
    "delta": "1e-5",
    "accountant": "rdp",
    "orders": ORDERS_1000,
}
RDP = {"rule": "sequential", "epsilon": "1000", "delta": "1e-5", "accountant": "rdp"}
_salt = iter(range(1, 10**9))


def sampled_gaussians(count: int) -> dict[str, Any]:
    """A composed event of ``count`` distinct Poisson-subsampled Gaussians (nothing cached: every
    call makes new noise multipliers), 2·count + 1 event nodes."""
    salt = next(_salt)
    return {
        "kind": "composed",
        "events": [
            {
                "kind": "poisson_sampled",
                "sampling_probability": 0.01,
                "event": {"kind": "gaussian", "noise_multiplier": 1.0 + salt * 1e-6 + i * 1e-3},
            }
            for i in range(count)
        ],
    }


def work_of(budget: dict[str, Any], event: dict[str, Any]) -> int:
    parsed = Budget.create(
        rule=budget["rule"],
        epsilon=budget["epsilon"],
        delta=budget["delta"],
        accountant=budget["accountant"],
        orders=budget.get("orders"),
    )
    return pricing_limits.work(parsed, [ev.from_json(event)])


def app_client(db: Database, database_url: URL, **settings: Any) -> TestClient:
    config = Settings(database_url=url_text(database_url), metrics_token=METRICS_TOKEN, **settings)
    return TestClient(create_app(config, database=db), raise_server_exceptions=False)


def test_a_reservation_above_the_pricing_bound_is_refused_before_it_is_priced(
    client: TestClient, keys: Keys
) -> None:
    """The review's case: 200 subsampled Gaussians on a budget of 1 000 orders (15 s of pricing
    inside the lock before): 422 naming ``event`` at once, nothing held; the commit's event too."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(RDP_1000)
    event = sampled_gaussians(200)
    assert work_of(RDP_1000, event) == 401 * 1000 > pricing_limits.DEFAULT_MAX_WORK
    started = time.monotonic()
    refused = trainer.reserve(dataset, batches, event, status=422).json()
    assert time.monotonic() - started < 5  # refused before pricing (pricing it takes ~15 s)
    assert refused["error"] == "invalid_input" and refused["field"] == "event"
    assert "401 event nodes x 1000" in refused["message"] and "LEDGER_MAX_PRICING_WORK" in refused["message"]
    assert admin.spend(dataset)["epsilon_held"] == "0"

    held = trainer.reserve(dataset, batches, sampled_gaussians(2)).json()
    refused = trainer.commit(held["id"], status=422, event=event).json()
    assert refused["field"] == "event"
    assert trainer.call("GET", f"/v1/reservations/{held['id']}", status=200).json()["status"] == "reserved"


@pytest.mark.slow
def test_a_tenant_out_of_pricing_time_gets_429_and_another_tenant_does_not(
    db: Database, database_url: URL, keys: Keys
) -> None:
    """The bucket holds exactly one request's estimate and refills at 0.001 s/s: after the first
    costly pricing (which used some CPU), the second is refused with Retry-After, nothing held;
    the other tenant's identical request is admitted (its own bucket)."""
    event = sampled_gaussians(20)
    estimate = work_of(RDP, event) * SECONDS_PER_UNIT
    with app_client(db, database_url, pricing_cpu_s_per_s=0.001, pricing_burst_s=estimate) as client:
        acme_admin, acme = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
        rival_admin, rival = (
            Api(client, keys.get("rival", "admin")),
            Api(client, keys.get("rival", "trainer")),
        )
        dataset, batches = acme_admin.dataset(RDP)
        first = acme.reserve(dataset, batches, event).json()
        answer = acme.reserve(dataset, batches, sampled_gaussians(20), status=429)
        body = answer.json()
        assert body["error"] == "rate_limited" and body["retry_after_s"] > 0
        assert int(answer.headers["Retry-After"]) >= 1
        assert acme_admin.spend(dataset)["epsilon_held"] == first["cost"]["epsilon"]  # the first hold only

        other, other_batches = rival_admin.dataset(RDP)
        rival.reserve(other, other_batches, sampled_gaussians(20))
        # A call with nothing to price (a commit without an event) is never metered.
        acme.commit(first["id"])
        assert acme_admin.spend(dataset)["epsilon_spent"] == first["cost"]["epsilon"]


@pytest.mark.slow
def test_repeated_events_are_cached_and_cost_the_bucket_almost_nothing(
    db: Database, database_url: URL, keys: Keys
) -> None:
    """Metering charges the CPU pricing used, not its estimate: the same DP-SGD event reserved 30
    times fits a bucket of three estimates (each repeat is a cache hit). Three, not two: the first
    pricing really costs about one estimate (0.8-1.1x measured here), and every later request
    still takes its whole estimate up front before the near-zero cost is given back, so a bucket
    of exactly two failed whenever the first pricing ran a little over its estimate. Thirty
    uncached pricings would need about thirty."""
    event = sampled_gaussians(20)
    estimate = work_of(RDP, event) * SECONDS_PER_UNIT
    with app_client(db, database_url, pricing_cpu_s_per_s=0.001, pricing_burst_s=3 * estimate) as client:
        admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
        dataset, batches = admin.dataset(RDP)
        for _ in range(30):
            held = trainer.reserve(dataset, batches, event).json()
            trainer.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)


def test_pricing_rates_refill_and_refuse_with_the_wait() -> None:
    now = [0.0]
    rates = PricingRates(rate_s=0.5, burst_s=2.0, clock=lambda: now[0])
    rates.take("acme", 1.5)
    assert rates.tokens("acme") == pytest.approx(0.5)
    with pytest.raises(RateLimited) as refused:
        rates.take("acme", 1.5)
    assert refused.value.retry_after_s == pytest.approx(2.0)  # 1.0 s missing at 0.5 s/s
    assert rates.tokens("rival") == 2.0  # tenants never share a bucket
    now[0] = 2.0
    rates.take("acme", 1.5)  # refilled
    rates.give_back("acme", -3.0)  # a pricing that took longer than estimated
    assert rates.tokens("acme") < 0
    now[0] = 100.0
    assert rates.tokens("acme") == 2.0  # never above the burst
    rates.take("acme", 50.0)  # a request above the burst needs the whole bucket, no more
    assert rates.tokens("acme") == 0.0


@pytest.mark.slow
def test_certificate_verification_is_bounded_and_metered(db: Database, database_url: URL, keys: Keys) -> None:
    """A viewer's verify recomputes the certificate's prices: above the bound it is refused (422
    naming ``certificate_id``: verify it offline), and it draws on the tenant's pricing time."""
    event = sampled_gaussians(20)
    with app_client(db, database_url) as client:
        admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
        dataset, batches = admin.dataset(RDP, batches=3)
        held = trainer.reserve(dataset, batches, event).json()
        certificate = trainer.commit(held["id"]).json()["certificate"]["id"]
        orders = len(admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]["orders"])
    work = (len(ev.walk(ev.from_json(event))) + 1) * orders  # 3 batches in one state: one class
    viewer = keys.get("acme", "viewer")
    path = f"/v1/certificates/{certificate}/verify"
    with app_client(db, database_url, max_pricing_work=work) as client:
        answer = client.post(path, headers=bearer(viewer))
        assert answer.status_code == 200 and answer.json()["ok"] is True, answer.text
    with app_client(db, database_url, max_pricing_work=work - 1) as client:
        refused = client.post(path, headers=bearer(viewer)).json()
        assert refused["error"] == "invalid_input" and refused["field"] == "certificate_id"
        assert "offline" in refused["message"]
    estimate = work * SECONDS_PER_UNIT
    with app_client(db, database_url, pricing_cpu_s_per_s=0.001, pricing_burst_s=estimate) as client:
        assert client.post(path, headers=bearer(viewer)).status_code == 200
        limited = client.post(path, headers=bearer(viewer))
        assert limited.status_code == 429 and limited.json()["error"] == "rate_limited"


@pytest.mark.slow
def test_another_tenants_write_is_not_held_up_while_a_costly_event_is_priced(database_url: URL) -> None:
    """A real ``ledger serve``: tenant acme reserves an event that takes seconds to price (the
    bound raised for the test); while that request is in flight, tenant rival creates a dataset,
    and that write finishes first. Before pricing moved out of the spend transaction, rival's
    write waited on SQLite's write lock for the whole pricing."""
    count = 60  # 121 nodes x 1000 orders: about 2-5 s of pricing
    server: Server = start_server(
        url_text(database_url), env={"LEDGER_MAX_PRICING_WORK": str((2 * count + 1) * 1000)}
    )
    try:
        db = Database(url_text(database_url))
        try:
            acme_key = tenancy.create_api_key(db, "acme", "admin")
            rival_key = tenancy.create_api_key(db, "rival", "admin")
        finally:
            db.dispose()
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            ds = http.post(
                "/v1/datasets", json={"name": unique("ds"), "budget": RDP_1000}, headers=bearer(acme_key)
            ).json()
            task = http.post(
                f"/v1/datasets/{ds['id']}/tasks", json={"name": "t"}, headers=bearer(acme_key)
            ).json()
            batch = http.post(
                f"/v1/datasets/{ds['id']}/tasks/{task['id']}/batches",
                json={"batches": [{"name": "b", "records": ["r1"]}]},
                headers=bearer(acme_key),
            ).json()["data"][0]["id"]

        finished: dict[str, float] = {}
        answers: dict[str, int] = {}

        def costly() -> None:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:
                answer = http.post(
                    f"/v1/datasets/{ds['id']}/reservations",
                    json={"batches": [batch], "event": sampled_gaussians(count)},
                    headers=bearer(acme_key),
                )
            answers["costly"] = answer.status_code
            finished["costly"] = time.monotonic()

        worker = threading.Thread(target=costly)
        worker.start()
        time.sleep(0.5)  # the costly request is being priced now
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            answer = http.post(
                "/v1/datasets", json={"name": unique("ds"), "budget": RDP}, headers=bearer(rival_key)
            )
        answers["write"] = answer.status_code
        finished["write"] = time.monotonic()
        worker.join(timeout=120)
        assert answers == {"costly": 201, "write": 201}
        assert finished["write"] < finished["costly"], "the other tenant's write waited for the pricing"
    finally:
        stop_server(server.process)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_api_processes_on_one_postgres_share_the_tenants_rate(database_url: URL) -> None:
    """Issue 30 §2: two ``ledger serve`` processes on one PostgreSQL database. The bucket holds
    one request's estimate and refills at 0.001 s/s (``LEDGER_RATE_LIMITS`` auto: shared through
    the database). The first costly reservation, on process A, empties it; the next one, on
    process B, is refused with 429, as it would be on A: the configured rate holds in total.
    (Per-process buckets admitted it: B's own bucket was full.) Another tenant is unaffected."""
    estimate = work_of(RDP, sampled_gaussians(20)) * SECONDS_PER_UNIT
    env = {"LEDGER_PRICING_CPU_S_PER_S": "0.001", "LEDGER_PRICING_BURST_S": repr(estimate)}
    servers = [start_server(url_text(database_url), env=env) for _ in range(2)]
    try:
        db = Database(url_text(database_url))
        try:
            keys = {tenant: tenancy.create_api_key(db, tenant, "admin") for tenant in ("acme", "rival")}
        finally:
            db.dispose()
        with (
            httpx.Client(base_url=servers[0].base_url, timeout=60) as first,
            httpx.Client(base_url=servers[1].base_url, timeout=60) as second,
        ):
            on_a, on_b = Api(first, keys["acme"]), Api(second, keys["acme"])  # type: ignore[arg-type]
            dataset, batches = on_a.dataset(RDP)
            held = on_a.reserve(dataset, batches, sampled_gaussians(20)).json()
            refused = on_b.reserve(dataset, batches, sampled_gaussians(20), status=429)
            assert refused.json()["error"] == "rate_limited" and int(refused.headers["Retry-After"]) >= 1
            on_a.reserve(dataset, batches, sampled_gaussians(20), status=429)
            assert on_b.spend(dataset)["epsilon_held"] == held["cost"]["epsilon"]  # the first hold only
            rival = Api(second, keys["rival"])  # type: ignore[arg-type]
            other, other_batches = rival.dataset(RDP)
            rival.reserve(other, other_batches, sampled_gaussians(20))
    finally:
        for server in servers:
            stop_server(server.process)


def test_shared_buckets_hold_the_rate_in_total_and_cached_events_stay_off_the_database(db: Database) -> None:
    """Two processes' ``SharedPricingRates`` on one database (``LEDGER_RATE_LIMITS=database``):
    requests that each use 0.1 s, alternating between them, are admitted for about the burst in
    total (1 s), not for a burst each; a tenant whose events are cached (a 10 ms estimate, a
    microsecond used) is served from its process's float with no withdrawal from the row."""
    first, second = (SharedPricingRates(db, rate_s=1e-9, burst_s=1.0) for _ in range(2))
    admitted = 0.0
    for rates in [first, second] * 10:
        try:
            rates.take("acme", 0.1)
        except RateLimited:
            continue
        rates.give_back("acme", 0.0)  # used all of its estimate
        admitted += 0.1
    assert 0.9 - 1e-9 <= admitted <= 1.0 + 1e-9  # (per-process buckets: 2.0; floats keep < 0.1 each)

    cached = SharedPricingRates(db, rate_s=1e-9, burst_s=1.0)
    cached.take("rival", 0.01)
    cached.give_back("rival", 0.01 - 1e-6)
    row = meters.level(db, "rival", "pricing", rate_s=1e-9, burst_s=1.0, now_s=time.time())
    for _ in range(200):
        cached.take("rival", 0.01)
        cached.give_back("rival", 0.01 - 1e-6)
    assert meters.level(db, "rival", "pricing", rate_s=1e-9, burst_s=1.0, now_s=time.time()) == pytest.approx(
        row
    )
    assert cached.tokens("rival") == pytest.approx(1.0 - 201e-6)  # what the events really used
