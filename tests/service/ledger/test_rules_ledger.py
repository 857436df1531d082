"""The four composition rules through the ledger, on both databases (issue 3's scenarios)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accountant import certificates as offline
from accountant.exact import exact_sub
from service.db.session import Database
from service.ledger import audit, reservations, spent
from service.ledger.errors import BudgetExceeded, ChargeRefused, LedgerError
from service.ledger.reservations import parse_event
from tests.service.ledger.conftest import MakeDataset


def pure(epsilon: float) -> dict[str, object]:
    return {"kind": "pure_dp", "epsilon": epsilon}


def dp_sgd(steps: int, noise_multiplier: float = 2.0, q: float = 0.01) -> dict[str, object]:
    return {
        "kind": "self_composed",
        "count": steps,
        "event": {
            "kind": "poisson_sampled",
            "sampling_probability": q,
            "event": {"kind": "gaussian", "noise_multiplier": noise_multiplier},
        },
    }


class Releases:
    """Consecutive release versions of one model."""

    def __init__(self) -> None:
        self.version = 0

    def next(self) -> dict[str, object]:
        self.version += 1
        return {"model": "m", "version": self.version}


def charge(
    db: Database,
    dataset: str,
    batch_ids: list[str],
    event: dict[str, object],
    releases: Releases,
    commitment: str | None = None,
) -> dict[str, object]:
    r = reservations.reserve(
        db, "t1", dataset, batch_ids=batch_ids, event=parse_event(event), noise_commitment=commitment
    ).to_json()
    answer = reservations.commit(db, "t1", r["id"], release=releases.next()).to_json()
    assert offline.verify(answer["certificate"]["certificate"]).ok
    return answer


def test_lifelong_spend_stays_flat_while_naive_grows(ledger: Database, make_dataset: MakeDataset) -> None:
    """L2DP-ML Thm. 2 vs Thm. 1: 20 tasks × 2 batches, each perturbed once with a noise commitment;
    the first task's batches are replayed (same commitment) at every later task."""
    budget = {"rule": "lifelong", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
    ds = make_dataset(budget, tasks=[2] * 20)
    releases = Releases()
    event = pure(0.6)
    for t in range(20):
        charge(ledger, ds.id, ds.batches[t], event, releases, commitment=f"noise-{t}")
        if t > 0:
            replay = charge(ledger, ds.id, ds.batches[0], event, releases, commitment="noise-0")
            assert replay["reservation"]["cost"]["epsilon"] == "0"
        answer = spent.get_spend(ledger, "t1", ds.id).to_json()
        assert answer["epsilon_spent"] == "0.6", t
        assert Decimal(answer["naive_sequential_epsilon"]) == Decimal("0.6") * (t + 1)
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert answer["naive_sequential_epsilon"] == "12"  # 20 × 0.6, while the ledger's ε is 0.6
    assert [t["epsilon_spent"] for t in answer["tasks"]] == ["0.6"] * 20
    # Fresh noise on a spent batch is a new charge, composed sequentially: it does not fit.
    with pytest.raises(BudgetExceeded):
        reservations.reserve(
            ledger, "t1", ds.id, batch_ids=ds.batches[0], event=parse_event(event), noise_commitment="fresh"
        )
    # The same commitment with another event is not a replay of that noise.
    with pytest.raises(LedgerError) as info:
        reservations.reserve(
            ledger,
            "t1",
            ds.id,
            batch_ids=ds.batches[0],
            event=parse_event(pure(0.1)),
            noise_commitment="noise-0",
        )
    assert info.value.status == 409
    assert audit.verify(ledger).ok


def test_geometric_levels(ledger: Database, make_dataset: MakeDataset) -> None:
    """Continual release: ε = 1, first = 0.5, ratio = 0.5 → 40 levels of one block admitted."""
    budget = {
        "rule": "geometric",
        "epsilon": 1.0,
        "delta": 1e-5,
        "accountant": "basic",
        "geometric": {"first": 0.5, "ratio": 0.5},
    }
    ds = make_dataset(budget)
    releases = Releases()
    for k in range(40):
        answer = charge(ledger, ds.id, ds.all_batches, pure(0.5 ** (k + 1)), releases)
        assert answer["certificate"]["certificate"]["result"]["levels"] == [k]  # one class: the batch
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert Decimal(answer["epsilon_spent"]) <= 1
    assert Decimal(answer["epsilon_spent"]) == exact_sub(Decimal(1), Decimal(0.5**40))  # 1 - 2^-40
    assert answer["geometric"]["infinite_horizon_bound"] == "1"
    for refused in (0.5, 0.6):  # a used level; above `first`
        with pytest.raises(LedgerError) as info:
            reservations.reserve(
                ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(pure(refused))
            )
        assert info.value.status == 409
    assert spent.get_spend(ledger, "t1", ds.id).to_json()["epsilon_spent"] == answer["epsilon_spent"]


def test_parallel_takes_the_max_and_refuses_a_second_read(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    budget = {"rule": "parallel", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
    ds = make_dataset(budget, tasks=[1, 1])
    releases = Releases()
    charge(ledger, ds.id, ds.batches[0], pure(0.3), releases)
    charge(ledger, ds.id, ds.batches[1], pure(0.5), releases)
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert answer["epsilon_spent"] == "0.5"  # the maximum over disjoint tasks, not 0.8
    assert [t["epsilon_spent"] for t in answer["tasks"]] == ["0.3", "0.5"]
    with pytest.raises(ChargeRefused) as info:
        reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.batches[0], event=parse_event(pure(0.01)))
    assert info.value.code == "batch_already_read" and info.value.status == 409


def test_sequential_rdp_admits_until_the_filter_says_no(ledger: Database, make_dataset: MakeDataset) -> None:
    budget = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "rdp"}
    ds = make_dataset(budget)
    releases = Releases()
    admitted = 0
    with pytest.raises(BudgetExceeded):
        for _ in range(200):
            charge(ledger, ds.id, ds.all_batches, dp_sgd(100), releases)
            admitted += 1
    assert admitted >= 2
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert 0 < Decimal(answer["epsilon_spent"]) <= 1
    assert answer["charges_committed"] == admitted


def test_prv_admits_the_declared_plan_step_by_step_and_nothing_else(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    plan = [dp_sgd(100), dp_sgd(50), dp_sgd(100)]
    budget = {"rule": "sequential", "epsilon": 2.0, "delta": 1e-5, "accountant": "prv", "plan": plan}
    ds = make_dataset(budget)
    releases = Releases()

    def refused(event: dict[str, object]) -> None:
        with pytest.raises(LedgerError) as info:
            reservations.reserve(ledger, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event(event))
        assert info.value.status == 409

    refused(plan[1])  # out of order
    refused(dp_sgd(100, noise_multiplier=1.0))  # not in the plan
    spent_after = []
    for step in plan:
        charge(ledger, ds.id, ds.all_batches, step, releases)
        answer = spent.get_spend(ledger, "t1", ds.id).to_json()
        spent_after.append(Decimal(answer["epsilon_spent"]))
        assert answer["guarantee"]["epsilon"] == answer["epsilon_spent"]
    # The whole declared plan from its first entry on (pricing version 3, issue 24 §4): a trainer
    # may stop after any entry because of what it saw, and only the whole plan's ε bounds that.
    assert 0 < spent_after[0] == spent_after[1] == spent_after[2] <= 2
    refused(plan[0])  # the plan is used up
