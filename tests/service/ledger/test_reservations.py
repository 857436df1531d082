"""Reserve → commit / abort / expire on both databases: exact arithmetic, idempotency,
all-or-nothing, expiry, certificates, input errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select

from accountant import certificates as offline
from accountant import events as ev
from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import audit, certificates, reservations, spent
from service.ledger.errors import (
    BudgetExceeded,
    ChargeRefused,
    Conflict,
    IdempotencyConflict,
    InvalidInput,
    NotFound,
    ReservationExpired,
)
from service.ledger.reservations import parse_event
from tests.service.ledger.conftest import MakeDataset

BASIC = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
L2DP = {
    "kind": "l2dp_ml_functional",
    "epsilon1": 0.4,
    "epsilon2": 2.0,
    "input_dim": 4,
    "hidden_units": 3,
    "output_hidden_units": 3,
    "batch_size": 80,
    "theta1_norm_bound": 2.0,
    "analysis": "sound",
}


def pure(epsilon: float) -> dict[str, object]:
    return {"kind": "pure_dp", "epsilon": epsilon}


def release(version: int, model: str = "m") -> dict[str, object]:
    return {"model": model, "version": version}


def test_hundred_charges_of_a_hundredth_fill_one_exactly(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    batch = ds.all_batches
    for i in range(100):
        r = reservations.reserve(
            ledger, "t1", ds.id, batch_ids=batch, event=parse_event(pure(0.01))
        ).to_json()
        reservations.commit(ledger, "t1", r["id"], release=release(i))
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert answer["epsilon_spent"] == "1" and answer["epsilon_remaining"] == "0"
    with pytest.raises(BudgetExceeded) as info:
        reservations.reserve(ledger, "t1", ds.id, batch_ids=batch, event=parse_event(pure(0.01)))
    assert info.value.status == 409
    assert info.value.requested["epsilon"] == "0.01"
    assert Decimal(info.value.remaining["epsilon"]) == 0
    assert info.value.batch_id == batch[0]


def test_commit_returns_a_certificate_that_verifies_offline(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC, tasks=[2])
    r = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.25))
    ).to_json()
    assert r["status"] == "reserved" and r["cost"] == {"epsilon": "0.25", "delta": "0"}
    answer = reservations.commit(ledger, "t1", r["id"], release=release(1)).to_json()
    cert = answer["certificate"]
    assert offline.verify(cert["certificate"]).ok
    assert cert["content_hash"] == cert["certificate"]["hash"]
    assert cert["release"] == {"model": "m", "version": 1}
    assert certificates.get_certificate(ledger, "t1", cert["id"]) == cert
    assert certificates.list_certificates(ledger, "t1", ds.id) == {"data": [cert], "count": 1}
    assert certificates.verify_stored(ledger, "t1", cert["id"])["ok"]
    with pytest.raises(NotFound):
        certificates.get_certificate(ledger, "t2", cert["id"])
    with pytest.raises(NotFound):
        certificates.list_certificates(ledger, "t2", ds.id)
    # The reservation is closed: a second commit or an abort is a conflict.
    with pytest.raises(Conflict) as conflict:
        reservations.commit(ledger, "t1", r["id"], release=release(2))
    assert conflict.value.reason == "reservation_closed"
    with pytest.raises(Conflict):
        reservations.abort(ledger, "t1", r["id"])
    assert audit.verify(ledger).ok


def test_a_release_is_recorded_once(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    first = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.1))
    ).to_json()
    reservations.commit(ledger, "t1", first["id"], release=release(7))
    second = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.1))
    ).to_json()
    with pytest.raises(Conflict) as info:
        reservations.commit(ledger, "t1", second["id"], release=release(7))
    assert info.value.reason == "release_exists"
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_spent"] == "0.1"  # nothing changed
    assert reservations.get_reservation(ledger, "t1", second["id"]).to_json()["status"] == "reserved"


def test_abort_charges_the_whole_reservation(ledger: Database, make_dataset: MakeDataset) -> None:
    # Issue 24 §2: an abort no longer returns the hold; it is a final charge with no release.
    ds = make_dataset(BASIC)
    r = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.9))
    ).to_json()
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_held"] == "0.9"
    with pytest.raises(BudgetExceeded):
        reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.2)))
    aborted = reservations.abort(ledger, "t1", r["id"]).to_json()
    assert aborted["status"] == "aborted" and aborted["committed"]["epsilon"] == "0.9"
    assert reservations.abort(ledger, "t1", r["id"]).to_json() == aborted  # charged once
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_held"], answer["epsilon_spent"], answer["reservations_open"]) == ("0", "0.9", 0)
    assert answer["last_release"] is None  # nothing was released
    with pytest.raises(BudgetExceeded):
        reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.2)))
    (stored,) = certificates.list_certificates(ledger, "t1", ds.id)["data"]
    body = stored["certificate"]
    assert (stored["release"], stored["outcome"], body["release"], body["outcome"]) == (
        None,
        "aborted",
        None,
        "aborted",
    )
    assert body["result"]["charge"]["epsilon"] == "0.9" and offline.verify(body).ok
    assert certificates.verify_stored(ledger, "t1", stored["id"])["ok"]
    assert certificates.get_certificate(ledger, "t1", stored["id"]) == stored
    entry = _audit_entry(ledger, ds.id, "reservation.aborted")
    assert (entry["certificate_id"], entry["content_hash"]) == (stored["id"], stored["content_hash"])
    assert audit.verify(ledger).ok


def _audit_entry(db: Database, dataset_id: str, event_type: str) -> dict[str, Any]:
    """The payload of the dataset's only audit entry of ``event_type``."""
    query = select(AuditEntry.payload).where(
        AuditEntry.chain == dataset_id, AuditEntry.event_type == event_type
    )
    (payload,) = db.read_all(query)
    return dict(payload.payload)


def test_the_workers_abort_charges_what_ran(ledger: Database, make_dataset: MakeDataset) -> None:
    # In-process only (the built-in worker): nothing read is refunded, a prefix that ran is charged.
    ds = make_dataset(BASIC)
    run = {"kind": "self_composed", "count": 10, "event": pure(0.05)}
    unread = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(run)
    ).to_json()
    refunded = reservations.abort(ledger, "t1", unread["id"], ran=reservations.Ran(None)).to_json()
    assert (refunded["status"], refunded["committed"]["epsilon"]) == ("aborted", "0")
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_spent"] == "0"
    assert certificates.list_certificates(ledger, "t1", ds.id)["count"] == 0
    assert "certificate_id" not in _audit_entry(ledger, ds.id, "reservation.aborted")
    three = reservations.parse_event({"kind": "self_composed", "count": 3, "event": pure(0.05)})
    r = reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(run)).to_json()
    aborted = reservations.abort(ledger, "t1", r["id"], ran=reservations.Ran(three)).to_json()
    assert aborted["committed"]["epsilon"] == "0.15"
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"]) == ("0.15", "0")
    (stored,) = certificates.list_certificates(ledger, "t1", ds.id)["data"]
    assert (stored["outcome"], stored["certificate"]["result"]["charge"]["epsilon"]) == ("aborted", "0.15")
    assert offline.verify(stored["certificate"]).ok
    # What ran must be the reserved run cut short: anything else is refused and stays open.
    other = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(run)
    ).to_json()
    with pytest.raises(ChargeRefused):
        reservations.abort(
            ledger, "t1", other["id"], ran=reservations.Ran(reservations.parse_event(pure(0.01)))
        )
    assert reservations.get_reservation(ledger, "t1", other["id"]).to_json()["status"] == "reserved"
    assert audit.verify(ledger).ok


def test_progressive_commits_then_abort(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    run = {"kind": "self_composed", "count": 10, "event": pure(0.05)}
    r = reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(run)).to_json()
    assert r["cost"]["epsilon"] == "0.5"
    step = reservations.commit(
        ledger,
        "t1",
        r["id"],
        release=release(1),
        event=parse_event({"kind": "self_composed", "count": 4, "event": pure(0.05)}),
    ).to_json()
    assert step["reservation"]["status"] == "reserved"
    assert step["reservation"]["committed"]["epsilon"] == "0.2"
    assert offline.verify(step["certificate"]["certificate"]).ok
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_spent"] == "0.2"
    with pytest.raises((ChargeRefused, InvalidInput)):  # more than reserved
        reservations.commit(
            ledger,
            "t1",
            r["id"],
            release=release(2),
            event=parse_event({"kind": "self_composed", "count": 11, "event": pure(0.05)}),
        )
    aborted = reservations.abort(ledger, "t1", r["id"]).to_json()
    # What could have run is the whole reserved run, whatever the progressive commits said.
    assert aborted["committed"]["epsilon"] == "0.5"
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"]) == ("0.5", "0")
    with pytest.raises(BudgetExceeded):
        reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.8)))
    reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.5)))
    last = certificates.list_certificates(ledger, "t1", ds.id)["data"][-1]
    assert (last["outcome"], last["certificate"]["inputs"]["previous_partial_event"]["count"]) == (
        "aborted",
        4,
    )
    assert offline.verify(last["certificate"]).ok
    assert audit.verify(ledger).ok


def test_idempotent_retries_charge_once(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    kwargs = {"batch_ids": ds.all_batches, "event": parse_event(pure(0.3)), "idempotency_key": "run-1"}
    first = reservations.reserve(ledger, "t1", ds.id, **kwargs).to_json()
    assert reservations.reserve(ledger, "t1", ds.id, **kwargs).to_json() == first
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_held"] == "0.3"
    with pytest.raises(IdempotencyConflict):
        reservations.reserve(ledger, "t1", ds.id, **{**kwargs, "event": parse_event(pure(0.4))})
    committed = reservations.commit(
        ledger, "t1", first["id"], release=release(1), idempotency_key="c-1"
    ).to_json()
    again = reservations.commit(
        ledger, "t1", first["id"], release=release(1), idempotency_key="c-1"
    ).to_json()
    assert again == committed
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["charges_committed"]) == ("0.3", 1)
    assert certificates.list_certificates(ledger, "t1", ds.id)["count"] == 1


def test_refused_reservation_is_all_or_nothing(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC, tasks=[3])
    a, b, c = ds.all_batches
    r = reservations.reserve(ledger, "t1", ds.id, batch_ids=[b], event=parse_event(pure(0.8))).to_json()
    reservations.commit(ledger, "t1", r["id"], release=release(1))
    before = (spent.get_spend(ledger, "t1", ds.id).to_json(), audit.verify(ledger).entries)
    with pytest.raises(BudgetExceeded) as info:
        reservations.reserve(ledger, "t1", ds.id, batch_ids=[a, b, c], event=parse_event(pure(0.3)))
    assert info.value.batch_id == b
    assert (spent.get_spend(ledger, "t1", ds.id).to_json(), audit.verify(ledger).entries) == before
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_held"], answer["reservations_open"]) == ("0", 0)
    reservations.reserve(
        ledger, "t1", ds.id, batch_ids=[a, c], event=parse_event(pure(1.0))
    )  # a, c untouched


def test_expired_reservation_is_charged_and_cannot_be_committed(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC)
    t0 = datetime.now(UTC)
    crashed = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.6)), ttl_s=60, now=t0
    ).to_json()
    with pytest.raises(BudgetExceeded):
        reservations.reserve(
            ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.6)), now=t0
        )
    # Past the TTL, the next spend transaction expires the crashed client's hold first, and
    # charges it: the crashed client could have read the data (issue 24 §2).
    later = t0 + timedelta(seconds=61)
    with pytest.raises(BudgetExceeded):
        reservations.reserve(
            ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.6)), now=later
        )
    assert reservations.get_reservation(ledger, "t1", crashed["id"]).to_json()["status"] == "expired"
    fresh = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.4)), now=later
    ).to_json()
    with pytest.raises(ReservationExpired):
        reservations.commit(ledger, "t1", crashed["id"], release=release(1), now=later)
    reservations.commit(ledger, "t1", fresh["id"], release=release(2), now=later)
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"], answer["reservations_open"]) == ("1", "0", 0)
    expired = [
        c for c in certificates.list_certificates(ledger, "t1", ds.id)["data"] if c["outcome"] == "expired"
    ]
    assert (
        len(expired) == 1 and expired[0]["release"] is None and offline.verify(expired[0]["certificate"]).ok
    )
    entry = _audit_entry(ledger, ds.id, "reservation.expired")
    assert (entry["certificate_id"], entry["content_hash"]) == (expired[0]["id"], expired[0]["content_hash"])
    assert audit.verify(ledger).ok


def test_late_commit_expires_and_is_refused(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    t0 = datetime.now(UTC)
    r = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.5)), ttl_s=10, now=t0
    ).to_json()
    with pytest.raises(ReservationExpired):
        reservations.commit(ledger, "t1", r["id"], release=release(1), now=t0 + timedelta(seconds=11))
    # The expiry was stored although the commit failed: the hold is spent, nothing released.
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"], answer["last_release"]) == ("0.5", "0", None)
    assert reservations.get_reservation(ledger, "t1", r["id"]).to_json()["status"] == "expired"
    assert reservations.abort(ledger, "t1", r["id"]).to_json()["status"] == "expired"


def test_expiry_sweep(ledger: Database, make_dataset: MakeDataset) -> None:
    first = make_dataset(BASIC)
    second = make_dataset(BASIC)
    t0 = datetime.now(UTC)
    for ds in (first, second):
        for _ in range(3):
            reservations.reserve(
                ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(0.1)), ttl_s=5, now=t0
            )
    kept = reservations.reserve(
        ledger, "t1", first.id, batch_ids=first.all_batches, event=parse_event(pure(0.1)), ttl_s=100, now=t0
    ).to_json()
    assert reservations.expire_due(ledger, now=t0 + timedelta(seconds=4)).to_json() == {"expired": 0}
    assert reservations.expire_due(ledger, now=t0 + timedelta(seconds=6)).to_json() == {"expired": 6}
    assert reservations.expire_due(ledger, now=t0 + timedelta(seconds=7)).to_json() == {"expired": 0}
    assert spent.get_spend(ledger, "t1", first.id).to_json()["epsilon_held"] == "0.1"
    assert spent.get_spend(ledger, "t1", second.id).to_json()["epsilon_held"] == "0"
    assert reservations.get_reservation(ledger, "t1", kept["id"]).to_json()["status"] == "reserved"
    assert audit.verify(ledger).ok


def test_input_errors_name_the_field(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    batch = ds.all_batches
    bad_events: list[tuple[object, str]] = [
        ({"kind": "pure_dp", "epsilon": float("nan")}, "event.epsilon"),
        ({"kind": "laplace", "scale": -1}, "event.scale"),
        ({"kind": "magic"}, "event.kind"),
        (
            {
                "kind": "poisson_sampled",
                "sampling_probability": 1.5,
                "event": {"kind": "gaussian", "noise_multiplier": 1},
            },
            "event.sampling_probability",
        ),
    ]
    for document, field in bad_events:
        with pytest.raises(InvalidInput) as info:
            reservations.parse_event(document)
        assert info.value.field == field, document
    # An event built in-process is checked as a new charge too: Thm. 2 as printed is refused.
    unsound = ev.from_json({**L2DP, "analysis": "paper"})  # parsed as a stored event would be
    with pytest.raises(InvalidInput) as info:
        reservations.reserve(ledger, "t1", ds.id, batch_ids=batch, event=unsound)
    assert info.value.field == "event.analysis"
    with pytest.raises(InvalidInput) as info:
        reservations.reserve(ledger, "t1", ds.id, batch_ids=batch, event=L2DP)  # type: ignore[arg-type]
    assert info.value.field == "event"  # JSON is not an event: the caller parses it
    event = reservations.parse_event(pure(0.1))
    cases: list[tuple[dict[str, object], str]] = [
        ({"batch_ids": [], "event": event}, "batches"),
        ({"batch_ids": [batch[0], batch[0]], "event": event}, "batches[1]"),
        ({"event": event}, "batches"),
        ({"batch_ids": batch, "event": event, "ttl_s": 0}, "ttl_s"),
        ({"batch_ids": batch, "event": event, "idempotency_key": ""}, "Idempotency-Key"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidInput) as info:
            reservations.reserve(ledger, "t1", ds.id, **kwargs)  # type: ignore[arg-type]
        assert info.value.field == field, kwargs
    # Gaussian noise cannot be accounted by 'basic' (pure/approx DP sums): 422, naming the event.
    with pytest.raises(InvalidInput) as info:
        reservations.reserve(
            ledger,
            "t1",
            ds.id,
            batch_ids=batch,
            event=parse_event({"kind": "gaussian", "noise_multiplier": 1.0}),
        )
    assert info.value.field == "event"
    with pytest.raises(NotFound):
        reservations.reserve(ledger, "t1", ds.id, batch_ids=["batch_nope"], event=parse_event(pure(0.1)))
    with pytest.raises(NotFound):
        reservations.reserve(ledger, "t2", ds.id, batch_ids=batch, event=parse_event(pure(0.1)))
    other = make_dataset(BASIC)
    with pytest.raises(NotFound):  # a batch of another dataset
        reservations.reserve(ledger, "t1", ds.id, batch_ids=other.all_batches, event=parse_event(pure(0.1)))
    r = reservations.reserve(ledger, "t1", ds.id, batch_ids=batch, event=parse_event(pure(0.1))).to_json()
    for bad, field in [
        ({"model": "", "version": 1}, "release.model"),
        ({"model": "m"}, "release.version"),
        ("v1", "release"),
    ]:
        with pytest.raises(InvalidInput) as info:
            reservations.commit(ledger, "t1", r["id"], release=bad)  # type: ignore[arg-type]
        assert info.value.field == field
    with pytest.raises(NotFound):
        reservations.commit(ledger, "t2", r["id"], release=release(1))
    with pytest.raises(NotFound):
        reservations.abort(ledger, "t2", r["id"])
    with pytest.raises(NotFound):
        reservations.get_reservation(ledger, "t2", r["id"])
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_held"], answer["reservations_open"]) == ("0.1", 1)
    with pytest.raises(NotFound):
        spent.get_spend(ledger, "t2", ds.id).to_json()


def test_reserve_by_tasks(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC, tasks=[2, 3])
    r = reservations.reserve(
        ledger, "t1", ds.id, task_ids=[ds.tasks[1]], event=parse_event(pure(0.2))
    ).to_json()
    assert r["batches"]["count"] == len(ds.batches[1])
    assert sorted(b for b, _ in reservations.all_batches(ledger, "t1", r["id"])) == sorted(ds.batches[1])
    reservations.commit(ledger, "t1", r["id"], release=release(1))
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert [t["epsilon_spent"] for t in answer["tasks"]] == ["0", "0.2"]
    with pytest.raises(NotFound):
        reservations.reserve(ledger, "t1", ds.id, task_ids=["task_nope"], event=parse_event(pure(0.1)))
