"""Group commit: spends combined into one transaction decide one after the other, a refused one
changes nothing, and a failure of the group transaction is isolated to the spend that caused it.

These tests build groups directly (``spending.ENGINE.run_group``) so their composition is exact.
"""

from __future__ import annotations

from datetime import UTC, datetime

from service.db.session import Database
from service.ledger import audit, idempotency, reservations, spent
from service.ledger.errors import BudgetExceeded, Conflict, IdempotencyConflict, ReleaseExists
from service.ledger.reservations import parse_event
from service.ledger.spending import ENGINE, requests
from service.ledger.spending.answers import Reservation
from service.ledger.spending.requests import AbortParams, CommitParams, Op, Request, ReserveParams
from service.verification.signing import SigningKey
from tests.service.ledger.conftest import MakeDataset

BASIC = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}


def _reserve_op(ds: str, batch_ids: list[str], epsilon: float, key: str | None = None) -> Op:
    event = requests.parse_event({"kind": "pure_dp", "epsilon": epsilon})
    params = ReserveParams(
        "batches",
        batch_ids,
        requests.charge(event, None),
        {"kind": "pure_dp", "epsilon": epsilon},
        requests.ttl(3600),
    )
    op = Request("reserve", "t1", ds, datetime.now(UTC), params)
    request = {
        "dataset_id": ds,
        "batches": batch_ids,
        "event": params.event_document,
        "noise_commitment": None,
    }
    return Op(requests.keyed(op, key, request))


_SIGNER = SigningKey.generate()  # the server's key in ledger serve; any key will do here


def _commit_op(ds: str, reservation_id: str, version: int) -> Op:
    release = {"model": "m", "version": version}
    return Op(
        Request(
            "commit",
            "t1",
            ds,
            datetime.now(UTC),
            CommitParams(reservation_id, "m", str(version), release, None, None, _SIGNER),
        )
    )


def reservation_id(op: Op) -> str:
    assert isinstance(op.response, Reservation)
    return op.response.id


def test_a_group_decides_in_order_and_isolates_refusals(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC, tasks=[2])
    a, b = ds.all_batches
    ops = [
        _reserve_op(ds.id, [a], 0.6),
        _reserve_op(ds.id, [a, b], 0.5),  # a: 0.6 + 0.5 > 1 → refused, b untouched
        _reserve_op(ds.id, [b], 0.9),
        _reserve_op(ds.id, [a], 0.4),  # fits exactly after the first
    ]
    ENGINE.run_group(ledger, ds.id, ops)
    assert [type(op.error).__name__ if op.error else "ok" for op in ops] == [
        "ok",
        "BudgetExceeded",
        "ok",
        "ok",
    ]
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_held"], answer["reservations_open"]) == ("1.9", 3)
    commits = [_commit_op(ds.id, reservation_id(ops[i]), i) for i in (0, 2, 3)]
    commits.append(_commit_op(ds.id, reservation_id(ops[0]), 9))  # twice
    ENGINE.run_group(ledger, ds.id, commits)
    assert [type(op.error).__name__ if op.error else "ok" for op in commits] == ["ok", "ok", "ok", "Conflict"]
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"], answer["charges_committed"]) == ("1", "0", 3)
    assert audit.verify(ledger).ok


def test_a_retry_inside_a_group_gets_the_first_answer(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    ops = [
        _reserve_op(ds.id, ds.all_batches, 0.3, key="k"),
        _reserve_op(ds.id, ds.all_batches, 0.3, key="k"),
        _reserve_op(ds.id, ds.all_batches, 0.4, key="k"),  # same key, another request
    ]
    ENGINE.run_group(ledger, ds.id, ops)
    assert ops[0].response is not None and ops[1].response is not None
    assert ops[0].response.to_json() == ops[1].response.to_json()
    assert isinstance(ops[2].error, IdempotencyConflict)
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_held"] == "0.3"


def test_a_failed_group_is_retried_spend_by_spend(ledger: Database, make_dataset: MakeDataset) -> None:
    """A constraint the group does not check in advance (a release that exists: the group leaves
    it to the unique constraint, as it must for another process's release of the same version)
    fails the group's transaction; each spend is then run alone, with the release checked, and
    only the offender is refused, by name."""
    ds = make_dataset(BASIC)
    other = make_dataset(BASIC)
    held = reservations.reserve(
        ledger,
        "t1",
        other.id,
        batch_ids=other.all_batches,
        event=parse_event({"kind": "pure_dp", "epsilon": 0.1}),
    ).to_json()
    reservations.commit(ledger, "t1", held["id"], release={"model": "m", "version": 1})
    first = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event({"kind": "pure_dp", "epsilon": 0.1})
    ).to_json()
    second = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event({"kind": "pure_dp", "epsilon": 0.2})
    ).to_json()
    ops = [_commit_op(ds.id, first["id"], 1), _commit_op(ds.id, second["id"], 2)]
    ENGINE.run_group(ledger, ds.id, ops)
    assert isinstance(ops[0].error, ReleaseExists) and "'m' version '1'" in str(ops[0].error)
    assert ops[1].error is None and ops[1].response is not None
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"]) == ("0.2", "0.1")
    assert audit.verify(ledger).ok


def test_abort_and_commit_of_one_reservation_in_one_group(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC)
    r = reservations.reserve(
        ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event({"kind": "pure_dp", "epsilon": 0.5})
    ).to_json()
    ops = [
        Op(Request("abort", "t1", ds.id, datetime.now(UTC), AbortParams(r["id"]))),
        _commit_op(ds.id, r["id"], 1),
    ]
    ENGINE.run_group(ledger, ds.id, ops)
    assert isinstance(ops[0].response, Reservation) and ops[0].response.status == "aborted"
    assert isinstance(ops[1].error, Conflict)
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    # The abort settles the whole reservation (issue 24 §2); the commit after it releases nothing.
    assert (answer["epsilon_spent"], answer["epsilon_held"], answer["reservations_open"]) == ("0.5", "0", 0)
    assert answer["last_release"] is None


def test_budget_exceeded_in_a_group_reports_numbers(ledger: Database, make_dataset: MakeDataset) -> None:
    ds = make_dataset(BASIC)
    ops = [_reserve_op(ds.id, ds.all_batches, 0.7), _reserve_op(ds.id, ds.all_batches, 0.7)]
    ENGINE.run_group(ledger, ds.id, ops)
    error = ops[1].error
    assert isinstance(error, BudgetExceeded)
    assert error.requested["epsilon"] == "0.7" and error.remaining["epsilon"] == "0.3"
    assert idempotency.request_hash("reserve", {"x": 1}) != idempotency.request_hash("commit", {"x": 1})
