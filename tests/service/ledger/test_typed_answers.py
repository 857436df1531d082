"""The spend transactions answer typed values (``spending.answers``): Decimal amounts and
datetimes for in-process callers, one ``to_json`` for the edge. The wire form is what it was, the
stored answer of an idempotency key is that wire form, and a replay answers the stored answer
verbatim (whatever server version wrote it) with the reservation as it is now."""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal

from sqlalchemy import select, update

from service.db.models import IdempotencyKey
from service.db.session import Database
from service.ledger import reservations
from service.ledger.certificates import IssuedCertificate
from service.ledger.reservations import Commit, Reservation, parse_event
from tests.service.ledger.conftest import MakeDataset

BASIC = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
RDP = {"rule": "sequential", "epsilon": 10.0, "delta": 1e-5, "accountant": "rdp"}
GEOMETRIC = {
    "rule": "geometric",
    "epsilon": 1.0,
    "delta": 1e-5,
    "accountant": "basic",
    "geometric": {"first": 0.5, "ratio": 0.5},
}
DPSGD = {
    "kind": "self_composed",
    "count": 4,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.01,
        "event": {"kind": "gaussian", "noise_multiplier": 1.1},
    },
}


def _same_wire_form(answer: Reservation | Commit) -> None:
    """``answer`` parsed back from its wire form is equal to it, and serialises to the same bytes."""
    wire = answer.to_json()
    again = (
        Reservation.from_json(wire)
        if isinstance(answer, Reservation)
        else Commit(
            IssuedCertificate.from_json(wire["certificate"]), Reservation.from_json(wire["reservation"])
        )
    )
    assert again == answer
    assert json.dumps(again.to_json()) == json.dumps(wire)


def test_answers_are_typed_and_their_wire_form_round_trips(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    ds = make_dataset(RDP, tasks=[2])
    held = reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(DPSGD))
    assert isinstance(held.cost.epsilon, Decimal) and held.cost.epsilon > 0
    assert isinstance(held.expires_at, datetime) and held.closed_at is None
    assert (held.status, held.batches, held.commits) == ("reserved", 2, 0)
    assert [c.batches for c in held.classes] == [2]
    _same_wire_form(held)
    # A progressive commit of half the steps: the reservation stays open with what it committed.
    half = {**DPSGD, "count": 2}
    step = reservations.commit(
        ledger, "t1", held.id, release={"model": "m", "version": 1}, event=parse_event(half)
    )
    assert step.reservation.status == "reserved" and step.reservation.commits == 1
    assert Decimal(0) < step.reservation.committed.epsilon < held.cost.epsilon
    assert step.certificate.reservation_id == held.id and step.certificate.outcome == "released"
    assert step.certificate.content_hash == step.certificate.document["hash"]
    assert step.certificate.release == {"model": "m", "version": 1}
    _same_wire_form(step)
    aborted = reservations.abort(ledger, "t1", held.id)
    assert aborted.status == "aborted" and aborted.committed.epsilon == held.cost.epsilon
    assert aborted.closed_at is not None
    _same_wire_form(aborted)
    assert reservations.get_reservation(ledger, "t1", held.id) == aborted


def test_a_geometric_class_states_its_level(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(GEOMETRIC)
    held = reservations.reserve(
        ledger,
        "t1",
        ds.id,
        batch_ids=ds.all_batches,
        event=parse_event({"kind": "pure_dp", "epsilon": 0.125}),
    )
    (only,) = held.classes
    assert only.level is not None and held.to_json()["batches"]["classes"][0]["level"] == only.level
    _same_wire_form(held)


def _stored(ledger: Database, key: str) -> dict[str, object]:
    with ledger.session(readonly=True) as session:
        return session.execute(select(IdempotencyKey.response).where(IdempotencyKey.key == key)).scalar_one()


def test_a_keyed_answer_is_stored_as_its_wire_form_and_replayed_verbatim(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC)
    event = {"kind": "pure_dp", "epsilon": 0.3}
    held = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(event), idempotency_key="r-1"
    )
    assert _stored(ledger, "r-1") == held.to_json()
    first = reservations.commit(
        ledger, "t1", held.id, release={"model": "m", "version": 1}, idempotency_key="c-1"
    )
    assert _stored(ledger, "c-1") == first.to_json()
    # A stored answer another server version wrote (no ``outcome``, a field this one does not
    # know) is replayed as it was stored, with the reservation as it is now.
    older = first.to_json()
    del older["certificate"]["outcome"]
    older["note"] = "written by an older server"
    with ledger.session() as session:
        session.execute(update(IdempotencyKey).where(IdempotencyKey.key == "c-1").values(response=older))
    again = reservations.commit(
        ledger, "t1", held.id, release={"model": "m", "version": 1}, idempotency_key="c-1"
    )
    assert again.to_json() == {**older, "reservation": first.reservation.to_json()}
    assert "outcome" not in again.to_json()["certificate"]
    assert again.certificate.id == first.certificate.id
    assert again.reservation == first.reservation and again.reservation.committed.epsilon == Decimal("0.3")
    # A replayed reservation is the reservation as it is now: committed.
    replayed = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(event), idempotency_key="r-1"
    )
    assert replayed == first.reservation and replayed.status == "committed"
