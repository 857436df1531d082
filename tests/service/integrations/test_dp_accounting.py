"""dp-accounting's ``DpEvent`` objects and their JSON form in the ledger, checked against
dp-accounting itself: round trips both ways for every class both libraries share, the ε its
accountants compute for a converted event against ours, strict refusals, and the JSON form
over HTTP (real app, SQLite and PostgreSQL) and through the client (real uvicorn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dp_accounting", reason="the dev extra installs dp-accounting")

import dp_accounting
from sqlalchemy.engine import URL

from accountant import events as ev
from accountant.dp_accounting_form import SHARED
from accountant.registry import make_accountant
from service.client import InvalidInput, LedgerClient
from service.db.session import Database
from service.integrations.dp_accounting import dp_accounting_json, from_dp_accounting, to_dp_accounting
from service.ledger import tenancy
from tests.service.api.conftest import Keys, TestClient, bearer
from tests.service.live_server import serve, settings_for

DPSGD = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 1000
)
THEIRS = [
    dp_accounting.NoOpDpEvent(),
    dp_accounting.NonPrivateDpEvent(),
    dp_accounting.GaussianDpEvent(0.8),
    dp_accounting.LaplaceDpEvent(2.5),
    DPSGD,
    dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(2.0)),
    dp_accounting.ComposedDpEvent([DPSGD, dp_accounting.LaplaceDpEvent(3.0), dp_accounting.NoOpDpEvent()]),
]
OURS = [
    ev.NoOpEvent(),
    ev.NonPrivateEvent(),
    ev.GaussianEvent(0.8),
    ev.LaplaceEvent(2.5),
    ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1)), 1000),
    ev.SampledWithoutReplacementEvent(10, 1000, ev.GaussianEvent(2.0)),
    ev.ComposedEvent(
        (
            ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1)), 1000),
            ev.LaplaceEvent(3.0),
            ev.NoOpEvent(),
        )
    ),
]


def _classes(event: Any) -> set[str]:
    nested = [*getattr(event, "events", []), *([event.event] if hasattr(event, "event") else [])]
    return {type(event).__name__}.union(*(_classes(e) for e in nested))


def test_every_shared_class_is_covered() -> None:
    assert set().union(*(_classes(e) for e in THEIRS)) == set(SHARED)


@pytest.mark.parametrize(("theirs", "ours"), list(zip(THEIRS, OURS, strict=True)))
def test_round_trips_both_ways(theirs: Any, ours: ev.DpEvent) -> None:
    assert from_dp_accounting(theirs) == ours
    assert to_dp_accounting(ours) == theirs
    assert to_dp_accounting(from_dp_accounting(theirs)) == theirs
    assert from_dp_accounting(to_dp_accounting(ours)) == ours
    # the JSON form is dp_accounting's own named tuple: it rebuilds the object there
    assert dp_accounting.DpEvent.from_named_tuple(to_dp_accounting(ours).to_named_tuple()) == theirs
    assert ev.from_json(dp_accounting_json(theirs)) == ours


@pytest.mark.parametrize(
    "theirs",
    [
        DPSGD,
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.3)), 10
        ),
        dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, dp_accounting.GaussianDpEvent(2.0)),
        dp_accounting.ComposedDpEvent([DPSGD, dp_accounting.GaussianDpEvent(5.0)]),
    ],
)
def test_our_epsilon_of_the_converted_event_is_dp_accounting_s(theirs: Any) -> None:
    """The same RDP (Mironov, Talwar & Zhang 2019; Wang et al. 2019 without replacement) on
    orders at least as rich as dp-accounting's; PRV's [lower, upper] holds its PLD ε."""
    delta = 1e-5
    without_replacement = isinstance(theirs, dp_accounting.SampledWithoutReplacementDpEvent)
    relation = dp_accounting.NeighboringRelation
    # dp-accounting accounts sampling without replacement under replace-one only, as the ledger
    # does (accountant.events.neighbouring_relations)
    rdp = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=relation.REPLACE_ONE if without_replacement else relation.ADD_OR_REMOVE_ONE
    )
    rdp.compose(theirs)
    ours = make_accountant("rdp")
    ours.compose(from_dp_accounting(theirs), 1)
    assert ours.get_epsilon(delta).upper <= rdp.get_epsilon(delta) * (1 + 1e-9)
    assert ours.get_epsilon(delta).upper == pytest.approx(rdp.get_epsilon(delta), rel=2e-2)
    if without_replacement:
        return  # dp-accounting's PLD has no sampling without replacement
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(theirs)
    prv = make_accountant("prv")
    prv.compose(from_dp_accounting(theirs), 1)
    bound = prv.get_epsilon(delta)
    assert bound.lower <= pld.get_epsilon(delta) <= bound.upper


def test_what_the_other_library_lacks_is_refused_by_name() -> None:
    nested = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.ZCDpEvent(1.0, 0.1)), 3
    )
    with pytest.raises(ev.EventValidationError) as refused:
        from_dp_accounting(nested)
    assert refused.value.field == "event.event.event.class_name"
    assert "ZCDpEvent" in str(refused.value)
    with pytest.raises(ValueError, match="'output_perturbation' event has no dp_accounting class"):
        to_dp_accounting(ev.ComposedEvent((ev.GaussianEvent(1.0), ev.OutputPerturbationEvent(1.0, 1.0))))
    with pytest.raises(ValueError, match="'approx_dp' event has no dp_accounting class"):
        to_dp_accounting(ev.ApproxDpEvent(1.0, 1e-6))


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"class_name": "GaussianDpEvent", "noise_multiplier": 1.0, "steps": 1000}, "event.steps"),
    ({"class_name": "LaplaceDpEvent", "noise_multiplier": -1.0}, "event.noise_multiplier"),
    (
        {"class_name": "SampledWithoutReplacementDpEvent", "source_dataset_size": 5, "sample_size": 9,
         "event": {"class_name": "NoOpDpEvent"}},
        "event.sample_size",
    ),
    ({"class_name": "SelfComposedDpEvent", "event": {"class_name": "NoOpDpEvent"}}, "event.count"),
    ({"class_name": "GaussianDpEvent", "module_name": "os", "noise_multiplier": 1.0}, "event.module_name"),
    ({"class_name": "UnsupportedDpEvent"}, "event.class_name"),
    (
        {"class_name": "PoissonSampledDpEvent", "sampling_probability": 0.1,
         "event": {"class_name": "GaussianDpEvent", "noise_multiplier": 1.0, "count": 10}},
        "event.event.count",
    ),
]  # fmt: skip


def test_the_json_form_over_http_is_as_strict_as_ours(client: TestClient, keys: Keys) -> None:
    admin = bearer(keys.get("acme", "admin"))
    dataset = client.post(
        "/v1/datasets",
        json={
            "name": "d",
            "budget": {"rule": "sequential", "epsilon": 8, "delta": 1e-5, "accountant": "rdp"},
        },
        headers=admin,
    ).json()
    task = client.post(f"/v1/datasets/{dataset['id']}/tasks", json={"name": "t"}, headers=admin).json()
    client.post(
        f"/v1/datasets/{dataset['id']}/tasks/{task['id']}/batches",
        json={"batches": [{"name": "b", "records": ["r1", "r2"]}]},
        headers=admin,
    )
    reserve = f"/v1/datasets/{dataset['id']}/reservations"
    for body, field in REFUSED:
        answer = client.post(reserve, json={"event": body, "tasks": [task["id"]]}, headers=admin)
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == field
    assert client.get(f"/v1/datasets/{dataset['id']}/spend", headers=admin).json()["reservations_open"] == 0
    # the same run in dp_accounting's form is taken, and stored in the ledger's own form
    held = client.post(
        reserve, json={"event": dp_accounting_json(DPSGD), "tasks": [task["id"]]}, headers=admin
    )
    assert held.status_code == 201, held.text
    # a progressive commit in dp_accounting's form, certified in the ledger's own form
    half = dp_accounting.SelfComposedDpEvent(DPSGD.event, 500)
    answer = client.post(
        f"/v1/reservations/{held.json()['id']}/commit",
        json={"release": {"model": "m", "version": 1}, "event": dp_accounting_json(half)},
        headers=admin,
    )
    assert answer.status_code == 200, answer.text
    inputs = answer.json()["certificate"]["certificate"]["inputs"]
    assert inputs["charge"]["event"] == ev.to_json(from_dp_accounting(DPSGD))
    assert inputs["partial_event"] == ev.to_json(from_dp_accounting(half))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_client_takes_dp_accounting_events(database_url: URL, db: Database, tmp_path: Path) -> None:
    key = tenancy.create_api_key(db, "acme", "admin")
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, key) as ledger,
    ):
        dataset = ledger.create_dataset("d", rule="sequential", epsilon="8", delta="1e-5", accountant="rdp")
        task = ledger.create_task(dataset["id"], "t")
        ledger.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r1"]}])
        quoted = ledger.quote(dataset["id"], DPSGD, tasks=[task["id"]])
        assert (
            quoted["cost"]
            == ledger.quote(dataset["id"], from_dp_accounting(DPSGD), tasks=[task["id"]])["cost"]
        )
        with ledger.release_gate(
            dataset["id"], None, DPSGD, tasks=[task["id"]], model="m", version="1"
        ) as gate:
            pass
        assert gate.certificate is not None
        assert ev.from_json(
            gate.certificate["certificate"]["inputs"]["charge"]["event"]
        ) == from_dp_accounting(DPSGD)
        with pytest.raises(ev.EventValidationError, match=r"event\.class_name"):
            ledger.reserve(dataset["id"], dp_accounting.RandomizedResponseDpEvent(0.5, 2), tasks=[task["id"]])
        with pytest.raises(InvalidInput):  # the JSON form as a mapping is checked by the server
            ledger.reserve(dataset["id"], {"class_name": "GaussianDpEvent"}, tasks=[task["id"]])
        assert ledger.spend(dataset["id"])["reservations_open"] == 0
