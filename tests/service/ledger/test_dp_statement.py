"""The DP statement of a version whose certificate was issued before version 3 (issue 24 §3–4):
the stored certificate still verifies as issued, and the statement derives the same valid
guarantee from its records that a version-3 certificate states — never the prefix a checkpoint
certified, never a Rényi filter's progress — with the theorem written from the budget's
parameters."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from accountant import events as ev
from accountant import rules as R
from accountant.certificates import BatchSet, ClassRecord, batch_set_hash, content_hash, issue, verify
from accountant.rules import BatchState, Budget, Charge
from service.ledger.dp_statement import dp_statement, guarantee_of

DELTA = Decimal("1e-5")


def dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def issued_as_version_2(budget: Budget, charge: Charge, partial: ev.DpEvent | None) -> dict[str, Any]:
    """A one-batch commit certified as the ledger did before version 3 (pricing 2, the fixed
    theorem text, no guarantee in the result), wrapped as the service stores it."""
    with R.pricing_version(2):
        admission = R.reserve(budget, BatchState.empty(), charge)
        settled = R.commit(budget, admission.state, charge, admission.cost, None, partial)
        record = ClassRecord(
            0, 1, BatchState.empty(), admission.cost, admission.state, None, settled.state, settled.committed
        )
        body = issue(
            budget=budget, charge=charge, classes=[record], batch_set=BatchSet(1, batch_set_hash([("b", 0)])),
            reservation_id="r", release={"model": "m", "version": 1}, partial_event=partial,
            issued_at="2026-11-01T00:00:00Z",
        )  # fmt: skip
    old = copy.deepcopy(body)
    old["version"], old["theorem"] = 2, R.theorem(budget)
    del old["result"]["guarantee"], old["result"]["budget_share"]
    old["hash"] = content_hash(old)
    assert verify(old).ok, verify(old).reason
    return {"id": "cert-1", "certificate": old}


def test_a_version_2_checkpoint_of_a_plan_states_the_whole_segment() -> None:
    run = dpsgd(0.01, 1.1, 400)
    # A version 2 certificate was issued on a budget stored before issue 25 §4: its plan by PRV.
    created = Budget.create(rule="sequential", epsilon=4, delta=DELTA, accountant="prv", plan=[run]).to_json()
    budget = Budget.from_json({k: v for k, v in created.items() if k not in ("plan_pricing", "plan_epsilon")})
    stored = issued_as_version_2(budget, Charge(run), dpsgd(0.01, 1.1, 100))
    assert budget.plan_epsilon is not None
    assert Decimal(stored["certificate"]["result"]["epsilon"]) < budget.plan_epsilon  # the prefix
    assert guarantee_of(stored["certificate"]) == (str(budget.plan_epsilon), "0.00001")
    statement = dp_statement(stored, job=None, model_spec=None)
    assert statement["version"] == 2
    assert statement["guarantee"]["epsilon"] == str(budget.plan_epsilon)
    assert statement["budget_share"]["epsilon"] == stored["certificate"]["result"]["charge"]["epsilon"]
    assert statement["run_alone"]["epsilon"] == statement["release"]["epsilon"]  # the whole reserved run
    assert Decimal(statement["run_alone"]["epsilon"]) <= budget.plan_epsilon


def test_a_version_2_filter_release_states_the_filter_budget_and_the_actual_delta_split() -> None:
    budget = Budget.create(rule="sequential", epsilon=8, delta=DELTA, accountant="rdp")
    stored = issued_as_version_2(budget, Charge(dpsgd(0.0445, 1.3, 23)), None)
    assert "split equally" in stored["certificate"]["theorem"]  # what version 2 cited
    statement = dp_statement(stored, job=None, model_spec=None)
    assert (statement["guarantee"]["epsilon"], statement["guarantee"]["delta"]) == ("8", "0.00001")
    assert Decimal(stored["certificate"]["result"]["epsilon"]) < 8  # the filter's progress
    assert "equally" not in statement["accounting"]["theorem"]
    assert "in proportion to the weights" in statement["accounting"]["theorem"]
    assert statement["run_alone"]["accountant"] == "prv (upper bound)"
    assert "NOT a DP guarantee" in statement["budget_share"]["scope"]
