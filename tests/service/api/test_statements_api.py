"""Issue 24 §3–4 over HTTP, on SQLite and PostgreSQL: what the API states after releases is a
valid bound for what it names.

* A trainer runs a declared plan segment in chunks with checkpoints, sees its loss and stops
  early: every checkpoint certificate, the spend, the batch spend and the release timeline state
  the segment's whole ε (the prefix's is no guarantee under adaptive stopping).
* On a Rényi filter budget the spend's ``guarantee`` is the filter's budget, and its
  ``epsilon_spent`` says it is a budget share.
"""

from __future__ import annotations

import warnings
from decimal import Decimal
from typing import Any

from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

from accountant.certificates import verify
from accountant.rules import PRICING_VERSION
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api
from tests.service.api.test_plan_segments import dpsgd

warnings.filterwarnings("ignore", module="prv_accountant")

CHUNK = dpsgd(0.01, 1.1, 100)


def loss_after(steps: int) -> float:
    """What the trainer sees after ``steps`` (a stand-in for the released model's loss)."""
    return 2.0 / (1 + steps / 100)


def test_a_segment_stopped_early_on_its_loss_states_the_whole_segment_everywhere(
    client: TestClient, keys: Keys
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {
        "rule": "sequential",
        "epsilon": "4",
        "delta": "1e-5",
        "accountant": "prv",
        "plan": [CHUNK] * 4,
        "plan_delta": "5e-6",
    }
    dataset, batches = admin.dataset(budget, 2)
    whole = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]["plan_epsilon"]

    certificates: list[dict[str, Any]] = []
    steps = 0
    stopped = False
    while not stopped:
        held = trainer.reserve(dataset, batches, CHUNK).json()
        for checkpoint in (50, 100):  # a checkpoint halfway through each chunk, then its end
            steps += 50
            event = dpsgd(0.01, 1.1, checkpoint) if checkpoint < 100 else None
            body = {} if event is None else {"event": event}
            certificates.append(trainer.commit(held["id"], **body).json()["certificate"])
            if loss_after(steps) < 0.85:  # seen on the checkpoint: stop here
                stopped = True
                if event is not None:
                    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", {}, 200)
                break
    assert steps == 150 and len(certificates) == 3  # stopped early, halfway through chunk 2

    for stored in certificates:
        body = stored["certificate"]
        assert verify(body).ok and body["version"] == 3 and body["pricing"] == PRICING_VERSION
        assert body["result"]["guarantee"] == {
            "epsilon": whole,
            "delta": "0.00001",
        }  # the budget's δ: segments are chosen adaptively
        assert body["result"]["epsilon"] == whole  # the checkpoint's spend: the whole segment
        assert "charged whole" in body["theorem"]
    spend = admin.spend(dataset)
    assert spend["epsilon_spent"] == whole and spend["guarantee"]["epsilon"] == whole
    assert "guarantee" in spend["epsilon_spent_is"]
    page = admin.call("GET", f"/v1/datasets/{dataset}/batch-spend", status=200).json()
    assert [b["guarantee"] for b in page["data"]] == [{"epsilon": whole, "delta": "0.00001"}] * 2
    releases = admin.call("GET", f"/v1/datasets/{dataset}/releases", status=200).json()["data"]
    assert {r["guarantee"]["epsilon"] for r in releases} == {whole}
    assert all(r["budget_share"] == r["charge"] for r in releases)

    # The whole segment (400 steps) against prv-accountant: never below its lower bound.
    library = PRVAccountant(
        PoissonSubsampledGaussianMechanism(0.01, 1.1),
        max_self_compositions=400,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, _ = library.compute_epsilon(5e-6, 400)
    assert float(whole) >= lower


def test_a_filter_budget_states_its_budget_as_the_guarantee_and_its_progress_as_a_share(
    client: TestClient, keys: Keys
) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(
        {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
    )
    before = admin.spend(dataset)
    assert before["guarantee"] == {"epsilon": "0", "delta": "0", "covers": before["guarantee"]["covers"]}
    held = trainer.reserve(dataset, batches, dpsgd(0.0445, 1.3, 23)).json()
    certificate = trainer.commit(held["id"]).json()["certificate"]["certificate"]
    spend = admin.spend(dataset)
    assert spend["guarantee"]["epsilon"] == "8" and spend["guarantee"]["delta"] == "0.00001"
    assert "Feldman & Zrnic 2021" in spend["guarantee"]["covers"]
    assert 0 < Decimal(spend["epsilon_spent"]) < 8 and "not a DP guarantee" in spend["epsilon_spent_is"]
    assert certificate["result"]["guarantee"] == {"epsilon": "8", "delta": "0.00001"}
    assert (
        "equally" not in certificate["theorem"] and "in proportion to the weights" in certificate["theorem"]
    )
    summary = next(d for d in admin.call("GET", "/v1/spend", status=200).json()["data"] if d["id"] == dataset)
    assert summary["guarantee"] == {"epsilon": "8", "delta": "0.00001"}
