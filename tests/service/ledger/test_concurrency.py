"""Concurrent spends on both databases: no lost update, no batch above budget, no double charge.

Threads are spread over several ``Database`` objects (separate engines and pools, as separate
API processes would have): within one, concurrent spends on a dataset are combined into group
transactions; across them, they serialise on the dataset's ledger head in the database
(``SELECT … FOR UPDATE`` / ``BEGIN IMMEDIATE``). Both paths run here.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest

from service.db.session import Database
from service.ledger import audit, batches, reservations, spent
from service.ledger.errors import BudgetExceeded, LedgerError
from service.ledger.reservations import parse_event
from tests.service.ledger.conftest import MakeDataset

BASIC = {"rule": "sequential", "epsilon": 1.0, "delta": 1e-5, "accountant": "basic"}
PROCESSES = 4


@pytest.fixture
def processes(ledger: Database) -> Iterator[list[Database]]:
    """``ledger`` and three more ``Database`` objects on the same database."""
    others = [Database(ledger.url, pool_size=10, max_overflow=5) for _ in range(PROCESSES - 1)]
    try:
        yield [ledger, *others]
    finally:
        for other in others:
            other.dispose()


def run_concurrently(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` for i < count in ``count`` threads started together; results or errors."""
    results: list[Any] = [None] * count
    barrier = threading.Barrier(count)

    def target(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # collected and asserted on by the caller
            results[i] = exc

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_150_concurrent_charges_of_a_hundredth(
    ledger: Database, processes: list[Database], make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC)

    def reserve_and_commit(i: int) -> str:
        db = processes[i % PROCESSES]
        r = reservations.reserve(
            db, "t1", ds.id, batch_ids=ds.all_batches, event=parse_event({"kind": "pure_dp", "epsilon": 0.01})
        ).to_json()
        reservations.commit(db, "t1", r["id"], release={"model": "m", "version": i})
        return "committed"

    results = run_concurrently(150, reserve_and_commit)
    outcomes = Counter(r if isinstance(r, str) else type(r).__name__ for r in results)
    assert outcomes == {"committed": 100, "BudgetExceeded": 50}, results
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["epsilon_held"]) == ("1", "0")
    assert (answer["charges_committed"], answer["reservations_open"]) == (100, 0)
    assert audit.verify(ledger).ok


@pytest.mark.slow
def test_multi_batch_reservations_are_all_or_nothing_under_concurrency(
    ledger: Database, processes: list[Database], make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC, tasks=[4])
    pool = ds.all_batches
    plans = [random.Random(i).sample(pool, random.Random(i + 1000).choice([1, 2, 3])) for i in range(60)]

    def work(i: int) -> tuple[list[str], str]:
        db = processes[i % PROCESSES]
        r = reservations.reserve(
            db, "t1", ds.id, batch_ids=plans[i], event=parse_event({"kind": "pure_dp", "epsilon": 0.1})
        ).to_json()
        if i % 5 == 0:
            reservations.abort(db, "t1", r["id"])
            return plans[i], "aborted"
        reservations.commit(db, "t1", r["id"], release={"model": "m", "version": i})
        return plans[i], "committed"

    results = run_concurrently(60, work)
    unexpected = [r for r in results if isinstance(r, Exception) and not isinstance(r, BudgetExceeded)]
    assert not unexpected, unexpected
    committed_reads: Counter[str] = Counter()
    for r in results:
        if isinstance(r, tuple):  # committed or aborted: an abort charges the whole reservation
            committed_reads.update(r[0])
    listed = {b.id: b for b in batches.list_batches(ledger, "t1", ds.id).data}
    for batch_id in pool:
        used = listed[batch_id].spend
        assert used.epsilon_spent <= 1  # no batch ever above budget
        assert used.epsilon_spent == Decimal("0.1") * committed_reads[batch_id]  # every settled charge
        assert used.epsilon_held == 0
    assert any(isinstance(r, BudgetExceeded) for r in results)  # the budget was contended
    answer = spent.get_spend(ledger, "t1", ds.id).spent
    assert answer.epsilon_spent == max(b.spend.epsilon_spent for b in listed.values())
    assert audit.verify(ledger).ok


def test_concurrent_retries_with_one_idempotency_key_charge_once(
    ledger: Database, processes: list[Database], make_dataset: MakeDataset
) -> None:
    ds = make_dataset(BASIC)

    def retry(i: int) -> dict[str, Any]:
        return reservations.reserve(
            processes[i % PROCESSES],
            "t1",
            ds.id,
            batch_ids=ds.all_batches,
            event=parse_event({"kind": "pure_dp", "epsilon": 0.2}),
            idempotency_key="same-key",
        ).to_json()

    results = run_concurrently(12, retry)
    assert not [r for r in results if isinstance(r, LedgerError | Exception)], results
    assert len({r["id"] for r in results}) == 1
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_held"], answer["reservations_open"]) == ("0.2", 1)

    def commit_retry(i: int) -> dict[str, Any]:
        return reservations.commit(
            processes[i % PROCESSES],
            "t1",
            results[0]["id"],
            release={"model": "m", "version": 1},
            idempotency_key="c",
        ).to_json()

    commits = run_concurrently(8, commit_retry)
    assert not [c for c in commits if isinstance(c, Exception)], commits
    assert len({c["certificate"]["id"] for c in commits}) == 1
    answer = spent.get_spend(ledger, "t1", ds.id).to_json()
    assert (answer["epsilon_spent"], answer["charges_committed"]) == ("0.2", 1)
