"""Issue 24 §3–4 on data charged before pricing version 3, on SQLite and PostgreSQL: the
dataset-level and task-level ``guarantee`` of the spend views is valid for it too.

Under pricing 2 a checkpoint of a declared plan segment stored the prefix's ε until the segment
closed, and a ``parallel`` progressive commit on ``rdp`` stored the prefix for good. The commits
here run through the ledger inside ``accountant.rules.pricing_version(2)`` (the replay context),
so the rows hold what the old code wrote; every spend view must still state the guarantee the
batch and the certificate state: the whole segment, the whole reserved run.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from accountant import rules as R
from service.db.session import Database
from service.ledger import reservations, spend, views
from service.ledger.dp_statement import guarantee_of
from service.ledger.reservations import parse_event
from tests.service.api.test_plan_segments import dpsgd
from tests.service.ledger.conftest import MakeDataset

RUN = dpsgd(0.01, 1.1, 100)
PREFIX = dpsgd(0.01, 1.1, 50)


def _commit_prefix_under_pricing_2(ledger: Database, dataset: str, batch_ids: list[str]) -> dict[str, Any]:
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
    answer = spend.get_spend(ledger, "t1", dataset)
    summary = next(d for d in views.spend_summaries(ledger, "t1")["data"] if d["id"] == dataset)
    operator = next(d for d in views.every_dataset_spend(ledger) if d["id"] == dataset)
    page = views.batch_spend(ledger, "t1", dataset)
    return [
        {k: answer["guarantee"][k] for k in ("epsilon", "delta")},
        summary["guarantee"],
        operator["guarantee"],
        page["guarantee"],
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
    assert spend.get_spend(ledger, "t1", layout.id)["epsilon_spent"] == prefix  # the stored prefix
    page = views.batch_spend(ledger, "t1", layout.id)["data"]
    assert [b["guarantee"] for b in page[:2]] == [{"epsilon": whole, "delta": "0.00001"}] * 2
    assert _every_view(ledger, layout.id) == [{"epsilon": whole, "delta": "0.00001"}] * 5
    untouched = spend.get_spend(ledger, "t1", layout.id)["tasks"][1]
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
    assert spend.get_spend(ledger, "t1", layout.id)["epsilon_spent"] == prefix  # the stored prefix
    page = views.batch_spend(ledger, "t1", layout.id)["data"]
    assert [b["guarantee"] for b in page] == [{"epsilon": whole, "delta": "0.00001"}] * 2 + [
        {"epsilon": "0", "delta": "0"}
    ]
    assert _every_view(ledger, layout.id) == [{"epsilon": whole, "delta": "0.00001"}] * 5
