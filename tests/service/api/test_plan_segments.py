"""Plan segments over HTTP, on SQLite and PostgreSQL: the user trial (a used-up plan, its
leftover spent by a second segment), segment prices against prv-accountant itself, what a client
may not do (refusals change nothing), concurrent declarations, a stale cached budget, and
``ledger check --bundle`` recomputing the segments offline."""

from __future__ import annotations

import json
import threading
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism
from sqlalchemy.engine import URL

from accountant.certificates import verify
from service.cli import main
from service.client import LedgerClient, LedgerError
from service.commands.export import bundle_hash
from service.db.session import Database
from service.ledger import batches as batch_ledger
from service.ledger import datasets, plan_segments, tenancy
from service.ledger.errors import ChargeRefused, InvalidInput
from service.ledger.reservations import parse_event
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api
from tests.service.live_server import serve, settings_for

warnings.filterwarnings("ignore", module="prv_accountant")


def dpsgd(q: float, sigma: float, steps: int) -> dict[str, Any]:
    return {
        "kind": "self_composed",
        "count": steps,
        "event": {
            "kind": "poisson_sampled",
            "sampling_probability": q,
            "event": {"kind": "gaussian", "noise_multiplier": sigma},
        },
    }


FIRST, SECOND = dpsgd(0.01, 1.1, 500), dpsgd(0.01, 1.5, 300)
BUDGET = {
    "rule": "sequential",
    "epsilon": "2",
    "delta": "1e-5",
    "accountant": "prv",
    "plan": [FIRST],
    "plan_delta": "5e-6",
}


def prv_library_upper(q: float, sigma: float, steps: int, delta: float) -> tuple[float, float]:
    accountant = PRVAccountant(
        PoissonSubsampledGaussianMechanism(q, sigma),
        max_self_compositions=steps,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, upper = accountant.compute_epsilon(delta, steps)
    return lower, upper


def declare(api: Api, dataset: str, body: dict[str, Any], status: int | None = 201, **headers: str) -> Any:
    return api.call("POST", f"/v1/datasets/{dataset}/plan-segments", body, status, **headers)


def certificate(api: Api, certificate_id: str) -> dict[str, Any]:
    body: dict[str, Any] = api.call("GET", f"/v1/certificates/{certificate_id}", status=200).json()[
        "certificate"
    ]
    return body


def test_the_user_trial_a_used_up_plan_then_its_leftover_spent_by_a_second_segment(
    client: TestClient, keys: Keys
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGET, 2)
    plan_epsilon = Decimal(
        admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]["plan_epsilon"]
    )
    held = trainer.reserve(dataset, batches, FIRST).json()
    first = trainer.commit(held["id"]).json()["certificate"]
    refused = trainer.reserve(dataset, batches, SECOND, 409).json()
    assert refused["error"] == "outside_plan" and "declare a new plan segment" in refused["message"]
    assert Decimal(admin.spend(dataset)["epsilon_spent"]) == plan_epsilon

    segment = declare(admin, dataset, {"plan": [SECOND], "delta": "5e-6"}).json()
    lower, upper = prv_library_upper(0.01, 1.5, 300, 5e-6)
    assert lower <= float(segment["epsilon"]) <= upper  # priced by the tight engine (issue 25 §4)
    assert segment["index"] == 1 and segment["delta"] == "0.000005" and segment["closed_batches"] == 2
    assert "Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6" in segment["theorem"]
    spent = plan_epsilon + Decimal(segment["epsilon"])
    assert Decimal(segment["declared"]["epsilon"]) == spent and Decimal(
        segment["declared"]["delta"]
    ) == Decimal("1e-5")
    assert (
        Decimal(segment["left"]["epsilon"]) == Decimal(2) - spent and Decimal(segment["left"]["delta"]) == 0
    )
    budget = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]
    assert [s["epsilon"] for s in budget["segments"]] == [segment["epsilon"]]

    held = trainer.reserve(dataset, batches, SECOND).json()
    second = trainer.commit(held["id"]).json()["certificate"]
    spend = admin.spend(dataset)
    assert Decimal(spend["epsilon_spent"]) == spent <= Decimal(2) and Decimal(
        spend["delta_spent"]
    ) == Decimal("1e-5")
    # Both certificates re-verify offline, each under the budget as it stood when it was issued.
    for issued, segments in ((first, None), (second, 1)):
        body = certificate(admin, issued["id"])
        assert verify(body).ok
        assert len(body["inputs"]["budget"].get("segments", [])) == (segments or 0)
    assert "Rogers" in certificate(admin, second["id"])["theorem"]
    # The closed segment never runs again; the open one is used up too.
    for event in (FIRST, SECOND):
        assert trainer.reserve(dataset, batches, event, 409).json()["error"] == "outside_plan"
    assert admin.audit()["ok"] is True


def test_refused_declarations_name_the_field_and_change_nothing(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    rival = Api(client, keys.get("rival", "admin"))
    dataset, batches = admin.dataset(BUDGET, 1)
    basic, _ = admin.dataset({"rule": "sequential", "epsilon": "1", "accountant": "basic"}, 1)
    whole, _ = admin.dataset({**BUDGET, "plan_delta": None}, 1)

    def ledger() -> Any:
        return admin.call("GET", f"/v1/datasets/{dataset}", status=200).json(), admin.audit()

    before = ledger()
    cases: list[tuple[Api, str, dict[str, Any], int, str]] = [
        (admin, dataset, {"plan": [SECOND], "delta": "6e-6"}, 422, "delta"),  # δ shares beyond δ
        (admin, dataset, {"plan": [SECOND], "delta": "0"}, 422, "delta"),
        (admin, dataset, {"plan": [dpsgd(0.01, 0.8, 2000)], "delta": "5e-6"}, 422, "plan"),  # ε beyond
        (admin, dataset, {"plan": [{"kind": "gaussian", "noise_multiplier": -1}], "delta": "5e-6"}, 422, ""),
        (admin, dataset, {"plan": [], "delta": "5e-6"}, 422, ""),
        (
            admin,
            dataset,
            {"plan": [SECOND], "delta": "5e-6", "epsilon": "0.1"},
            422,
            "",
        ),  # no ε from a client
        (admin, basic, {"plan": [SECOND], "delta": "5e-6"}, 422, "plan"),  # not a prv plan budget
        (admin, whole, {"plan": [SECOND], "delta": "1e-7"}, 422, "delta"),  # its plan holds all of δ
        (trainer, dataset, {"plan": [SECOND], "delta": "5e-6"}, 403, ""),
        (rival, dataset, {"plan": [SECOND], "delta": "5e-6"}, 404, ""),
    ]
    for api, target, body, status, field in cases:
        answer = declare(api, target, body, None)
        assert answer.status_code == status, (body, answer.text)
        if field:
            assert answer.json()["field"] == field and field in answer.json()["message"], answer.text
    assert ledger() == before

    # Declared while a reservation is open: refused, nothing changes; after the abort it is taken.
    held = trainer.reserve(dataset, batches, FIRST).json()
    pending = declare(admin, dataset, {"plan": [SECOND], "delta": "5e-6"}, 409).json()
    assert pending["error"] == "plan_step_pending"
    assert admin.call("GET", f"/v1/datasets/{dataset}", status=200).json() == before[0]
    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", None, 200)
    key = {"Idempotency-Key": "segment-one"}
    taken = declare(admin, dataset, {"plan": [SECOND], "delta": "5e-6"}, **key).json()
    # The abort charged the reserved plan entry (issue 24 §2): the batch ran some of the first
    # plan, so closing it charges the batch the whole first segment.
    assert taken["closed_batches"] == 1
    # A retry with the same key is answered as before and declares nothing more; another body is not.
    assert declare(admin, dataset, {"plan": [SECOND], "delta": "5e-6"}, **key).json() == taken
    other = declare(admin, dataset, {"plan": [SECOND], "delta": "4e-6"}, 409, **key).json()
    assert other["error"] == "idempotency_conflict"
    budget = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]
    assert len(budget["segments"]) == 1
    assert Decimal(admin.spend(dataset)["epsilon_spent"]) > 0
    trainer.reserve(dataset, batches, FIRST, 409)  # the first plan is closed


def test_a_plan_over_the_most_events_is_refused_quoting_its_json_as_sent(db: Database) -> None:
    """The route checks the body's plan as sent (``check_plan_size``) before its parsed events
    reach the ledger, so the 422's message quotes the client's JSON (``1``, not the parsed
    event's ``1.0``); the ledger refuses the same plan given parsed, quoting its documents."""
    sent = [{"kind": "pure_dp", "epsilon": 1}] * (plan_segments.MAX_PLAN_EVENTS + 1)
    with pytest.raises(InvalidInput) as as_sent:
        plan_segments.check_plan_size(sent)
    assert as_sent.value.field == "plan"
    most = plan_segments.MAX_PLAN_EVENTS
    found = "Found [{'kind': 'pure_dp', 'epsilon': 1}, "
    assert as_sent.value.message.startswith(f"plan must be a list of 1 to {most} events. {found}")
    plan_segments.check_plan_size(sent[:1])  # within bounds: no refusal
    tenancy.create_tenant(db, "acme")
    dataset = datasets.create_dataset(db, "acme", name="long", budget=BUDGET).id
    parsed = [parse_event(sent[0])] * len(sent)
    with pytest.raises(InvalidInput) as given_parsed:
        plan_segments.declare_segment(db, "acme", dataset, plan=parsed, delta="1e-7")
    assert given_parsed.value.field == "plan" and "'epsilon': 1.0}" in given_parsed.value.message


def test_concurrent_declarations_take_what_is_left_once(database_url: URL, db: Database) -> None:
    """Two declarations racing from two connection pools (no shared group commit): both ask for
    all the δ that is left; the ledger head lock orders them, and exactly one is taken."""
    tenancy.create_tenant(db, "acme")
    dataset = datasets.create_dataset(db, "acme", name="race", budget=BUDGET).id
    task = batch_ledger.create_task(db, "acme", dataset, name="t")
    batch_ledger.create_batches(db, "acme", dataset, task.id, batches=[{"name": "b", "records": ["r"]}])
    pools = [Database(database_url), Database(database_url)]
    outcomes: list[object] = []
    start = threading.Barrier(2)

    def race(pool: Database) -> None:
        start.wait()
        try:
            outcomes.append(
                plan_segments.declare_segment(
                    pool, "acme", dataset, plan=[parse_event(SECOND)], delta="5e-6"
                ).to_json()
            )
        except (InvalidInput, ChargeRefused) as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=race, args=(pool,)) for pool in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pool in pools:
        pool.dispose()
    taken = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, InvalidInput)]
    assert len(taken) == 1 and len(refused) == 1, outcomes
    assert refused[0].field == "delta"
    stored = datasets.get_dataset(db, "acme", dataset).budget
    assert len(stored["segments"]) == 1


@pytest.mark.slow
def test_a_process_with_the_budget_cached_before_a_declaration_reads_it_again(
    client: TestClient, keys: Keys
) -> None:
    """Another process cached the budget before the segment was declared: its next spend reads
    the head's segment count and the budget again, so it never prices against a closed plan."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGET, 1)
    trainer.commit(trainer.reserve(dataset, batches, FIRST).json()["id"])
    stale = datasets.cached_budget(dataset, lambda: None)  # what this process cached
    declare(admin, dataset, {"plan": [SECOND], "delta": "5e-6"})
    datasets._budgets._items[dataset] = stale  # as another process would still hold it
    refused = trainer.reserve(dataset, batches, FIRST, 409).json()
    assert refused["error"] == "outside_plan" and "plan segment 1" in refused["message"]
    trainer.commit(trainer.reserve(dataset, batches, SECOND).json()["id"])
    quote = admin.call(
        "POST", f"/v1/datasets/{dataset}/quote", {"event": SECOND, "batches": batches}, 200
    ).json()
    assert quote["admitted"] is False


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_ledger_check_recomputes_the_segments_from_the_bundle(
    database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = settings_for(database_url, tmp_path / "artifacts")
    admin_key = tenancy.create_api_key(db, "acme", "admin")
    viewer_key = tenancy.create_api_key(db, "acme", "viewer")
    small = dpsgd(0.01, 3.0, 100)
    with serve(settings, db) as url, LedgerClient(url, admin_key) as client:
        ds = client.create_dataset(
            "d", rule="sequential", epsilon=2, delta="1e-5", accountant="prv", plan=[FIRST], plan_delta="3e-6"
        )
        task = client.create_task(ds["id"], "t")
        batch = client.create_batches(ds["id"], task["id"], [{"name": "b", "records": ["r"]}])["data"][0][
            "id"
        ]
        with client.release_gate(ds["id"], [batch], FIRST, model="m", version=1):
            pass
        assert client.declare_plan_segment(ds["id"], [SECOND], delta="3e-6")["index"] == 1
        with client.release_gate(ds["id"], [batch], SECOND, model="m", version=2):
            pass
        assert client.declare_plan_segment(ds["id"], [small], delta="3e-6")["index"] == 2  # not run
        with pytest.raises(LedgerError) as info:
            client.declare_plan_segment(ds["id"], [small], delta="2e-6")  # 1e-6 of δ is left
        assert "delta" in str(info.value)
        path = tmp_path / "bundle.json"
        assert (
            main(["export", "--url", url, "--key", viewer_key, "--dataset", ds["id"], "-o", str(path)]) == 0
        )
    capsys.readouterr()
    # (the bundle's own signer: exit 0 only with the explicit flag, issue 24 §1)
    assert main(["check", "--bundle", str(path), "--json", "--allow-unverified-signer"]) == 0, (
        capsys.readouterr().out
    )
    report = json.loads(capsys.readouterr().out)
    assert all(c["ok"] for c in report["checks"]), report
    original = json.loads(path.read_text())

    def checked(bundle: dict[str, Any]) -> dict[str, bool]:
        bundle["bundle_hash"] = bundle_hash(bundle)
        path.write_text(json.dumps(bundle))
        assert main(["check", "--bundle", str(path), "--json", "--allow-unverified-signer"]) == 1
        return {c["name"]: c["ok"] for c in json.loads(capsys.readouterr().out)["checks"]}

    # A segment that claims less ε than PRV gives its plan is recomputed offline.
    lied = json.loads(json.dumps(original))
    lied["dataset"]["budget"]["segments"][0]["epsilon"] = "0.01"
    assert checked(lied)["budget"] is False
    # A declared segment left out of the exported budget: the audit chain recorded it.
    hidden = json.loads(json.dumps(original))
    hidden["dataset"]["budget"]["segments"] = hidden["dataset"]["budget"]["segments"][:1]
    found = checked(hidden)
    assert found["audit chain"] is False and found["certificates"] is True


def test_an_entry_of_prv_epsilon_zero_is_charged_and_certified_the_segments_delta(
    client: TestClient, keys: Keys
) -> None:
    """Issue 24 §6: 100 steps at q = 1e-6, σ = 0.001 cost PRV ε 0 at δ = 1e-4 and are
    (0, ≈1e-4)-DP; the commit charged and certified (0, 0), signed, and verify said ok."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    nearly_free = dpsgd(1e-6, 0.001, 100)
    budget = {"rule": "sequential", "epsilon": "1", "delta": "1e-4", "accountant": "prv"}
    dataset, batches = admin.dataset({**budget, "plan": [nearly_free]}, 2)
    held = trainer.reserve(dataset, batches, nearly_free).json()
    issued = trainer.commit(held["id"]).json()["certificate"]
    body = certificate(admin, issued["id"])
    assert (body["result"]["epsilon"], body["result"]["delta"]) == ("0", "0.0001")
    assert body["result"]["charge"] == {"epsilon": "0", "delta": "0.0001"}
    assert verify(body).ok, verify(body).reason
    spend = admin.spend(dataset)
    assert (Decimal(spend["epsilon_spent"]), Decimal(spend["delta_spent"])) == (0, Decimal("1e-4"))
