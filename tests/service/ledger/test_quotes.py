"""Quotes priced per state class, bounded and paged (issue 24 §5), with a required target (issue 25).

``POST /quote`` priced every batch: over 100 000 batches in one state, 8.4 s and an 11.9 MB answer
for a viewer key. A quote now prices once per distinct state, as a reservation decides, and lists
the classes a page at a time. No timing asserts: the number of ``rules.reserve`` calls and the
answer's size are what must not grow with the batches. Real SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from accountant import events as ev
from accountant import rules
from accountant.calibration import calibrate_to_price
from service.db.session import Database
from service.ledger import batches, datasets, pricing_limits, quotes, reservations
from service.ledger.errors import InvalidInput, NotFound
from service.ledger.reservations import parse_event
from service.ledger.spending.store import dataset_budget

BASIC = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
MANY = 10_000
_versions = itertools.count(1)
_names = itertools.count(1)  # dataset names are unique per tenant


def _dataset(db: Database, count: int, budget: dict[str, Any] = BASIC) -> tuple[str, list[str]]:
    """A dataset of ``count`` one-record batches in one task, every batch in the empty state."""
    ds = datasets.create_dataset(db, "t1", name=f"d{next(_names)}", budget=budget).id
    task = batches.create_task(db, "t1", ds, name="task").id
    made = batches.create_batches(
        db, "t1", ds, task, batches=[{"name": f"b{i}", "records": [f"r{i}"]} for i in range(count)]
    )
    return ds, [row.id for row in made.data]


def _spend(db: Database, ds: str, batch_ids: list[str], epsilon: str) -> None:
    held = reservations.reserve(
        db, "t1", ds, event=parse_event({"kind": "pure_dp", "epsilon": float(epsilon)}), batch_ids=batch_ids
    ).to_json()
    reservations.commit(db, "t1", held["id"], release={"model": "m", "version": next(_versions)})


@pytest.fixture
def pricings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times ``rules.reserve`` prices a charge (the real function, counted)."""
    calls: list[int] = []
    real: Callable[..., Any] = rules.reserve

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rules, "reserve", counted)
    return calls


def test_a_quote_prices_once_per_state_class_and_its_answer_does_not_grow_with_the_batches(
    ledger: Database, pricings: list[int]
) -> None:
    ds, ids = _dataset(ledger, MANY)
    _spend(ledger, ds, ids[:3], "0.5")  # a second class: 3 batches with 0.5 spent
    small, small_ids = _dataset(ledger, 10)
    _spend(ledger, small, small_ids[:3], "0.5")
    event = {"kind": "pure_dp", "epsilon": 0.6}
    pricings.clear()
    answer = quotes.quote(
        ledger, "t1", ds, event=parse_event(event), batch_ids=ids, accountants=False
    ).to_json()
    assert len(pricings) == 2  # once per class, not once per batch (was 10 000)
    assert answer["accountants"] is None
    # The informational block prices the event once per accountant whatever the batches, and a
    # repeat of it is memoized.
    pricings.clear()
    with_block = quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=ids).to_json()
    assert 2 <= len(pricings) <= 2 + len(rules.ACCOUNTANTS)
    pricings.clear()
    assert quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=ids).to_json() == with_block
    assert len(pricings) == 2
    answer = with_block
    assert answer["totals"] == {
        "batches": MANY,
        "classes": 2,
        "admitted_batches": MANY - 3,
        "refused_batches": 3,
    }
    assert answer["admitted"] is False and answer["refused"]["code"] == "budget_exceeded"
    by_sample = {c["batch_id"]: c for c in answer["classes"]}
    spent = min(ids[:3])
    assert by_sample[spent]["batches"] == 3 and by_sample[spent]["admitted"] is False
    assert by_sample[spent]["epsilon"] == "0.6" and by_sample[spent]["refused"]["batch_id"] == spent
    fresh = min(ids[3:])
    assert by_sample[fresh] == {
        "batches": MANY - 3,
        "batch_id": fresh,
        "admitted": True,
        "epsilon": "0.6",
        "delta": "0",
        "naive_epsilon": "0.6",
        "refused": None,
    }
    # The same quote on 10 batches is the same size, give or take the ids and counts' digits.
    small_answer = quotes.quote(ledger, "t1", small, event=parse_event(event), batch_ids=small_ids).to_json()
    assert abs(len(json.dumps(answer)) - len(json.dumps(small_answer))) < 50
    # By tasks: the same classes, the same single pricing per class.
    pricings.clear()
    task_id = batches.list_tasks(ledger, "t1", ds).data[0].id
    by_task = quotes.quote(
        ledger, "t1", ds, event=parse_event(event), task_ids=[task_id], accountants=False
    ).to_json()
    assert len(pricings) == 2 and by_task["on"] == "tasks" and by_task["totals"] == answer["totals"]


def test_classes_are_paged_and_the_totals_cover_every_page(ledger: Database) -> None:
    ds, ids = _dataset(ledger, 12)
    for i, epsilon in enumerate(("0.1", "0.2", "0.3", "0.4")):  # four more states, one batch each
        _spend(ledger, ds, [ids[i]], epsilon)
    event = {"kind": "pure_dp", "epsilon": 0.75}
    pages, offset = [], 0
    while offset is not None:
        page = quotes.quote(
            ledger, "t1", ds, event=parse_event(event), batch_ids=ids, limit=2, offset=offset
        ).to_json()
        assert len(page["classes"]) <= 2
        pages.extend(page["classes"])
        offset = page["next_offset"]
    assert page["totals"] == {"batches": 12, "classes": 5, "admitted_batches": 10, "refused_batches": 2}
    assert sorted(c["batch_id"] for c in pages) == sorted([*ids[:4], min(ids[4:])])
    assert sum(c["batches"] for c in pages) == 12
    assert [c["admitted"] for c in pages].count(False) == 2
    for bad in ({"limit": 0}, {"limit": quotes.MAX_CLASSES_PER_PAGE + 1}, {"offset": -1}, {"limit": True}):
        with pytest.raises(InvalidInput) as caught:
            quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=ids, **bad)
        assert caught.value.field == next(iter(bad))


def test_a_quote_names_its_target_and_refuses_none(ledger: Database) -> None:
    """Issue 25: no ``batches`` or ``tasks`` priced a new batch silently; now the target is
    required and the new batch is asked for by name."""
    ds, ids = _dataset(ledger, 2)
    _spend(ledger, ds, ids, "1")  # every batch is spent
    event = {"kind": "pure_dp", "epsilon": 0.5}
    with pytest.raises(InvalidInput) as caught:
        quotes.quote(ledger, "t1", ds, event=parse_event(event))
    assert caught.value.field == "batches"
    with pytest.raises(InvalidInput):
        quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=ids, new_batch=True)
    fresh = quotes.quote(ledger, "t1", ds, event=parse_event(event), new_batch=True).to_json()
    assert fresh["on"] == "new_batch" and fresh["admitted"] is True
    assert [(c["batch_id"], c["batches"]) for c in fresh["classes"]] == [(None, 1)]
    real = quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=ids).to_json()
    assert real["admitted"] is False and real["totals"]["refused_batches"] == 2
    with pytest.raises(NotFound) as missing:
        quotes.quote(ledger, "t1", ds, event=parse_event(event), batch_ids=[ids[0], "b_nope"])
    assert "b_nope" in str(missing.value)
    with pytest.raises(NotFound):
        quotes.quote(ledger, "t1", ds, event=parse_event(event), task_ids=["t_nope"])
    with pytest.raises(NotFound):
        quotes.quote(ledger, "t2", ds, event=parse_event(event), new_batch=True)


class RecordingMeter:
    def __init__(self) -> None:
        self.admitted: list[int] = []

    def admit(self, work: int) -> None:
        self.admitted.append(work)

    def spent(self, work: int, cpu_s: float) -> None:
        pass


def test_a_quote_is_metered_by_its_work_per_class(ledger: Database) -> None:
    budget = {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
    ds, ids = _dataset(ledger, 50, budget)
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.0)), 100)
    budget_of = dataset_budget(ledger, ds)[1]
    meter = RecordingMeter()
    quotes.quote(
        ledger,
        "t1",
        ds,
        event=parse_event(ev.to_json(event)),
        batch_ids=ids,
        policy=pricing_limits.Policy(meter=meter),
    )
    one_class = pricing_limits.work(budget_of, [event]) + pricing_limits.orders_of(budget_of)
    # then the informational block: the event's work under each accountant's fresh budget
    block = sum(
        pricing_limits.work(quotes._alternative(budget_of, name, event), [event])
        for name in rules.ACCOUNTANTS
    )
    assert meter.admitted == [one_class, block]
    with pytest.raises(InvalidInput) as caught:  # the event's own work is still bounded
        quotes.quote(
            ledger,
            "t1",
            ds,
            event=parse_event(ev.to_json(event)),
            batch_ids=ids,
            policy=pricing_limits.Policy(max_work=1),
        )
    assert caught.value.field == "event"


def test_a_calibration_prices_each_sigma_once_per_class(ledger: Database, pricings: list[int]) -> None:
    """The worker's calibration (``DatasetPrices``, every batch of the dataset) walked every batch
    on every σ it tried; now once per class."""
    budget = {"rule": "sequential", "epsilon": "4", "delta": "1e-5", "accountant": "rdp"}
    ds, ids = _dataset(ledger, MANY, budget)
    _spend(ledger, ds, ids[:5], "0.5")
    prices = quotes.DatasetPrices(ledger, "t1", ds)
    tried: list[float] = []

    def make(sigma: float) -> ev.DpEvent:
        tried.append(sigma)
        return ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(sigma)), 500)

    pricings.clear()
    sigma = calibrate_to_price(make, start=1.0, target_epsilon=2.0, price=prices.price)
    assert len(tried) > 3 and len(pricings) == 2 * len(tried)
    assert prices.price(make(sigma)) <= Decimal(2) < prices.price(make(round(sigma - 1e-4, 4)))


def test_staged_prices_meet_each_charge_with_the_states_the_earlier_ones_leave(
    ledger: Database, pricings: list[int]
) -> None:
    """``StagedPrices`` (the gate's check of a staged run before it reserves): charges in turn,
    each on the states the earlier ones leave — two pure-ε 0.4 charges on a batch fit a basic
    sequential ε = 1, three do not; the first refused one is named, with its batch; a parallel
    budget refuses a re-read. Priced once per class of batches read by the same stages, and the
    ledger is left as it was."""
    ds, ids = _dataset(ledger, 6)
    _spend(ledger, ds, ids[:2], "0.3")  # ids[0:2] start at 0.3 spent

    def charges(*epsilons: float) -> list[rules.Charge]:
        return [rules.Charge(ev.PureDpEvent(e), None) for e in epsilons]

    two = quotes.StagedPrices(ledger, "t1", ds, [ids[2:], ids[3:]])
    pricings.clear()
    assert two.refusal(charges(0.4, 0.4)) is None
    assert len(pricings) == 3  # classes: ids[2] (1 charge), ids[3:] (2 charges); not one per batch
    assert two.refusal(charges(0.4, 0.7)) is not None  # the same stages, other events
    three = quotes.StagedPrices(ledger, "t1", ds, [ids[2:], ids[3:], ids[5:]])
    refused = three.refusal(charges(0.4, 0.4, 0.4))
    assert refused is not None and refused.index == 2
    assert refused.refusal.code == "budget_exceeded" and refused.refusal.details["batch_id"] == ids[5]
    # the earlier spend counts: 0.3 + 0.4 + 0.4 > 1 on ids[1], refused at the second charge
    refused = quotes.StagedPrices(ledger, "t1", ds, [ids[:2], ids[1:2]]).refusal(charges(0.4, 0.4))
    assert refused is not None and refused.index == 1 and refused.refusal.details["batch_id"] == ids[1]
    with pytest.raises(NotFound):
        quotes.StagedPrices(ledger, "t1", ds, [["no-such-batch"]]).refusal(charges(0.1))
    assert quotes.quote(
        ledger, "t1", ds, event=parse_event({"kind": "pure_dp", "epsilon": 0.7}), batch_ids=ids[:1]
    ).quote.admitted  # nothing was held or spent by asking

    parallel, pids = _dataset(
        ledger, 2, {"rule": "parallel", "epsilon": "1", "delta": "0", "accountant": "basic"}
    )
    again = quotes.StagedPrices(ledger, "t1", parallel, [pids, pids[:1]]).refusal(charges(0.5, 0.1))
    assert again is not None and again.index == 1 and again.refusal.code == "batch_already_read"
