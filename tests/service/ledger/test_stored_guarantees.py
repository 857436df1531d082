"""Issue 24 §3–4 on data charged before pricing version 3, on SQLite and PostgreSQL: the
dataset-level and task-level ``guarantee`` of the spend views is valid for it too.

Under pricing 2 a checkpoint of a declared plan segment stored the prefix's ε until the segment
closed, and a ``parallel`` progressive commit on ``rdp`` stored the prefix for good. The commits
here run through the ledger inside ``accountant.rules.pricing_version(2)`` (the replay context),
so the rows hold what the old code wrote, on a dataset marked as one that existed before version 3
(``Dataset.priced_before_v3``, as migration ``5d2a8c4e1f63`` marks every dataset it finds); every
spend view must still state the guarantee the batch and the certificate state: the whole segment,
the whole reserved run. A dataset created since is read from its aggregates alone: the spend read
of a ``parallel`` dataset issues two statements, none over batches or reservations.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import update

from accountant import rules as R
from service.db.models import Dataset
from service.db.session import Database
from service.ledger import reservations, spent, views
from service.ledger.dp_statement import guarantee_of
from service.ledger.reservations import parse_event
from service.ledger.spending.answers import EpsilonDelta
from tests.service.api.test_plan_segments import dpsgd
from tests.service.ledger.conftest import MakeDataset
from tests.service.ledger.test_spend_statements import statements

RUN = dpsgd(0.01, 1.1, 100)
PREFIX = dpsgd(0.01, 1.1, 50)


def _commit_prefix_under_pricing_2(ledger: Database, dataset: str, batch_ids: list[str]) -> dict[str, Any]:
    with ledger.session() as session:  # as the migration marks a dataset that existed before
        session.execute(update(Dataset).where(Dataset.id == dataset).values(priced_before_v3=True))
    # Reserved and committed under pricing 2, as such a run was (a reservation priced under
    # version 4 holds its tight ε, which can be below version 2's RDP price of the prefix).
    with R.pricing_version(2):
        held = reservations.reserve(
            ledger, "t1", dataset, batch_ids=batch_ids, event=parse_event(RUN)
        ).to_json()
        answer = reservations.commit(
            ledger, "t1", held["id"], release={"model": dataset, "version": 1}, event=parse_event(PREFIX)
        ).to_json()
    certificate: dict[str, Any] = answer["certificate"]["certificate"]
    assert certificate["pricing"] == 2
    return certificate


def _every_view(ledger: Database, dataset: str) -> list[dict[str, str]]:
    """The dataset-level guarantee as each view states it, and each task's."""
    answer = spent.get_spend(ledger, "t1", dataset).to_json()
    summary = next(d for d in views.spend_summaries(ledger, "t1").to_json()["data"] if d["id"] == dataset)
    operator = next(s for s in spent.every_dataset_spend(ledger) if s.dataset_id == dataset)
    page = views.batch_spend(ledger, "t1", dataset)
    return [
        {k: answer["guarantee"][k] for k in ("epsilon", "delta")},
        summary["guarantee"],
        operator.guarantee.to_json(),
        page.spent.guarantee.to_json(),
        answer["tasks"][0]["guarantee"],
    ]


def test_a_plan_segment_half_run_under_pricing_2_states_the_whole_segment(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    budget = {"rule": "sequential", "epsilon": "4", "delta": "1e-5", "accountant": "prv", "plan": [RUN] * 4}
    layout = make_dataset(budget, tasks=[2, 1])
    certificate = _commit_prefix_under_pricing_2(ledger, layout.id, layout.batches[0])
    prefix = certificate["result"]["epsilon"]
    whole, _ = guarantee_of(certificate)  # the statement's guarantee: the whole open segment
    assert Decimal(prefix) < Decimal(whole)
    assert spent.get_spend(ledger, "t1", layout.id).to_json()["epsilon_spent"] == prefix  # the stored prefix
    page = views.batch_spend(ledger, "t1", layout.id).data
    assert [b.guarantee for b in page[:2]] == [EpsilonDelta(Decimal(whole), Decimal("0.00001"))] * 2
    assert _every_view(ledger, layout.id) == [{"epsilon": whole, "delta": "0.00001"}] * 5
    untouched = spent.get_spend(ledger, "t1", layout.id).to_json()["tasks"][1]
    assert untouched["guarantee"] == {"epsilon": "0", "delta": "0"}  # nothing ran on task 2


def test_a_parallel_checkpoint_committed_under_pricing_2_states_the_whole_reserved_run(
    ledger: Database, make_dataset: MakeDataset
) -> None:
    budget = {"rule": "parallel", "epsilon": "4", "delta": "1e-5", "accountant": "rdp"}
    layout = make_dataset(budget, tasks=[2, 1])
    certificate = _commit_prefix_under_pricing_2(ledger, layout.id, layout.batches[0])
    prefix, whole = certificate["result"]["epsilon"], certificate["result"]["guarantee"]["epsilon"]
    assert Decimal(prefix) < Decimal(whole)
    held = reservations.get_reservation(ledger, "t1", certificate["reservation_id"]).to_json()
    assert held["cost"]["epsilon"] == whole  # the whole reserved run
    assert spent.get_spend(ledger, "t1", layout.id).to_json()["epsilon_spent"] == prefix  # the stored prefix
    page = views.batch_spend(ledger, "t1", layout.id).data
    assert [b.guarantee for b in page] == [EpsilonDelta(Decimal(whole), Decimal("0.00001"))] * 2 + [
        EpsilonDelta(Decimal(0), Decimal(0))
    ]
    assert _every_view(ledger, layout.id) == [{"epsilon": whole, "delta": "0.00001"}] * 5


@pytest.mark.parametrize(
    "budget",
    [
        {"rule": "parallel", "epsilon": "4", "delta": "1e-5", "accountant": "rdp"},
        {"rule": "parallel", "epsilon": "4", "delta": "1e-5", "accountant": "tight"},
        {"rule": "sequential", "epsilon": "4", "delta": "1e-5", "accountant": "prv", "plan": [RUN] * 4},
    ],
)
def test_a_dataset_created_since_pricing_3_is_read_from_its_aggregates(
    ledger: Database, make_dataset: MakeDataset, budget: dict[str, Any]
) -> None:
    """No batch, membership or reservation row is read for the spend of a dataset created since
    pricing version 3 (its stored spend is the whole run's); the guarantee is the aggregates'."""
    layout = make_dataset(budget, tasks=[2, 1])
    held = reservations.reserve(ledger, "t1", layout.id, batch_ids=layout.batches[0], event=parse_event(RUN))
    answer = reservations.commit(
        ledger, "t1", held.id, release={"model": layout.id, "version": 1}, event=parse_event(PREFIX)
    ).to_json()
    certificate = answer["certificate"]["certificate"]
    whole, _ = guarantee_of(certificate)
    with statements(ledger) as seen:
        answer = spent.get_spend(ledger, "t1", layout.id).to_json()
    listing = "\n".join(seen)
    assert len(seen) <= 2, listing
    assert not [s for s in seen if "batches" in s or "reservation" in s], listing
    assert Decimal(answer["guarantee"]["epsilon"]) >= Decimal(whole)
    assert _every_view(ledger, layout.id)[0] == {k: answer["guarantee"][k] for k in ("epsilon", "delta")}
