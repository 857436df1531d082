"""Charge what the mathematics requires, no more (issue 13 §3), over HTTP on both databases.

Each figure is checked against an independent library (dp-accounting's RDP accountant) for the
same event and δ, never against a number written here.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import dp_accounting
import pytest
from dp_accounting import rdp as dpa_rdp
from scipy.optimize import brentq

from accountant.rdp import DEFAULT_ORDERS
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api


def _dpsgd(q: float, sigma: float, steps: int) -> dict[str, Any]:
    return {
        "kind": "self_composed",
        "count": steps,
        "event": {
            "kind": "poisson_sampled",
            "sampling_probability": q,
            "event": {"kind": "gaussian", "noise_multiplier": sigma},
        },
    }


def _dpa_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's RDP ε on our accountant's order grid (``ledger epsilon --accountant rdp``):
    its default grid stops at order 1024, too low for the small ε of large σ."""
    accountant = dpa_rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    return float(accountant.get_epsilon(delta))


def _quote(api: Api, dataset: str, event: dict[str, Any], **target: Any) -> dict[str, Any]:
    answer: dict[str, Any] = api.call(
        "POST", f"/v1/datasets/{dataset}/quote", {"event": event, **target}, 200
    ).json()
    return answer


def test_a_single_parallel_charge_costs_its_tight_epsilon(client: TestClient, keys: Keys) -> None:
    """The audit's case: q = 0.001235, σ = 8.609, T = 18, δ = 1e-7 cost 7.2× dp-accounting's RDP
    on a parallel/rdp budget (the filter's 20-order grid), then RDP itself (5.2× dp-accounting's
    PLD). Since pricing version 4 (issue 25 §2) it costs its tight ε: ≤ 1.02× dp-accounting's
    pessimistic PLD on a fine grid, a fifth of RDP; and a pure ε costs ε."""
    from dp_accounting.pld import PLDAccountant

    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(
        {"rule": "parallel", "epsilon": "1", "delta": "1e-7", "accountant": "rdp"}, 2
    )
    event = _dpsgd(0.001235, 8.609, 18)
    held = trainer.reserve(dataset, batches[:1], event).json()
    pld = (
        PLDAccountant(value_discretization_interval=1e-5)
        .compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.001235, dp_accounting.GaussianDpEvent(8.609)), 18
            )
        )
        .get_epsilon(1e-7)
    )
    assert 0.99 * pld <= float(held["cost"]["epsilon"]) <= 1.02 * pld
    assert float(held["cost"]["epsilon"]) < _dpa_epsilon(0.001235, 8.609, 18, 1e-7) / 4
    pure = trainer.reserve(dataset, batches[1:], {"kind": "pure_dp", "epsilon": 0.1}).json()
    assert pure["cost"] == {"epsilon": "0.1", "delta": "0"}


@pytest.mark.slow
def test_a_geometric_charge_takes_the_level_its_own_epsilon_fits(client: TestClient, keys: Keys) -> None:
    """Geometric ε = 1, δ = 1e-5: a run whose dp-accounting ε at level 1's δ share (δ/4) is just
    below level 1's allowance (1/4) takes level 1, not level 0: its ε is computed on the full grid."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(
        {"rule": "geometric", "epsilon": "1", "delta": "1e-5", "accountant": "rdp"}
    )
    sigma = 5.0
    steps = 1
    while _dpa_epsilon(0.01, sigma, steps * 2, 1e-5 / 4) < 0.24:
        steps *= 2
    assert _dpa_epsilon(0.01, sigma, steps, 1e-5 / 4) < 0.25
    held = trainer.reserve(dataset, batches, _dpsgd(0.01, sigma, steps)).json()
    assert held["batches"]["classes"][0]["level"] == 1
    assert float(held["batches"]["classes"][0]["naive_epsilon"]) <= 1.02 * _dpa_epsilon(
        0.01, sigma, steps, 1e-5 / 4
    )


def calibrated_sigma(q: float, steps: int, target: float, delta: float) -> float:
    """σ for which dp-accounting's RDP ε (our accountant's grid) is ``target``: Brent's method on
    [0.3, 50] to 1e-6 in σ (about ten evaluations of dp-accounting, where bisection took 40)."""
    return float(brentq(lambda sigma: _dpa_epsilon(q, sigma, steps, delta) - target, 0.3, 50.0, xtol=1e-6))


@pytest.mark.slow
def test_the_renyi_filter_placed_for_the_budget_is_within_ten_percent(client: TestClient, keys: Keys) -> None:
    """A sequential/rdp budget of ε = 8 places its filter's orders and δ weights for (8, 1e-5): a
    DP-SGD run calibrated near the budget (20 epochs at q = 0.01, ε 7.5 by dp-accounting) is
    certified within 1.10× (1.19× on the fixed 20-order grid with equal δ shares).
    ``tests/accountant/test_filter_placement.py`` checks more run shapes."""
    admin = Api(client, keys.get("acme", "admin"))
    dataset, batches = admin.dataset(
        {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
    )
    budget = admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]
    assert len(budget["delta_weights"]) == len(budget["orders"])
    assert sum(Decimal(w) for w in budget["delta_weights"]) <= 1
    sigma = calibrated_sigma(0.01, 2000, 7.5, 1e-5)
    reference = _dpa_epsilon(0.01, sigma, 2000, 1e-5)
    quoted = _quote(admin, dataset, _dpsgd(0.01, sigma, 2000), batches=batches)
    assert reference * (1 - 1e-9) <= float(quoted["cost"]["epsilon"]) <= 1.10 * reference
    # Nothing was held: the spend is as before.
    assert admin.spend(dataset)["epsilon_spent"] == "0"


def test_a_quote_is_what_the_reservation_charges_and_holds_nothing(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    viewer = Api(client, keys.get("acme", "viewer"))
    dataset, batches = admin.dataset(
        {"rule": "sequential", "epsilon": "2", "delta": "1e-5", "accountant": "rdp"}
    )
    event = _dpsgd(0.01, 1.2, 1000)
    fresh = _quote(viewer, dataset, event, new_batch=True)  # asked for: a new batch of this dataset
    on_batch = _quote(viewer, dataset, event, batches=batches)
    assert fresh["cost"] == on_batch["cost"] and fresh["on"] == "new_batch"
    assert [(c["batch_id"], c["batches"]) for c in fresh["classes"]] == [(None, 1)]
    assert on_batch["on"] == "batches" and on_batch["classes"][0]["batch_id"] == batches[0]
    held = trainer.reserve(dataset, batches, event).json()
    assert held["cost"] == on_batch["cost"]
    # Now the batch holds it: a second one does not fit, and the quote says so with numbers.
    again = _quote(viewer, dataset, event, batches=batches)
    assert again["admitted"] is False and again["refused"]["code"] == "budget_exceeded"
    assert again["refused"]["batch_id"] == batches[0]
    trainer.reserve(dataset, batches, event, status=409)
    # Bad input changes nothing and names the field; another tenant's dataset is a 404.
    bad = viewer.call(
        "POST", f"/v1/datasets/{dataset}/quote", {"event": {"kind": "gaussian"}, "new_batch": True}, 422
    ).json()
    assert bad["field"].startswith("event")
    both = {"event": event, "batches": batches, "tasks": ["t"]}
    assert viewer.call("POST", f"/v1/datasets/{dataset}/quote", both, 422).json()["field"] == "batches"
    # Issue 25: a quote without a target priced a new batch and said "admitted" for batches that
    # then got 409s; the target is required (new_batch: true names the new-batch case).
    untargeted = viewer.call("POST", f"/v1/datasets/{dataset}/quote", {"event": event}, 422).json()
    assert untargeted["field"] == "batches"
    for bad, field in (
        ({"new_batch": False}, "new_batch"),
        ({"new_batch": True, "batches": batches}, "batches"),
        ({"batches": batches, "limit": 0}, "limit"),
        ({"batches": batches, "offset": -1}, "offset"),
    ):
        answer = viewer.call("POST", f"/v1/datasets/{dataset}/quote", {"event": event, **bad}, 422).json()
        assert answer["field"] == field, bad
    other = Api(client, keys.get("rival", "viewer"))
    other.call("POST", f"/v1/datasets/{dataset}/quote", {"event": event, "new_batch": True}, 404)
    viewer.call("POST", f"/v1/datasets/{dataset}/quote", {"event": event, "batches": ["nope"]}, 404)


def test_naive_is_never_below_the_ledger_on_a_single_release(client: TestClient, keys: Keys) -> None:
    """The audit's case: naive 1.48 vs the ledger's 1.747 on one release of a filter budget."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    for rule in ("sequential", "lifelong", "parallel"):
        dataset, batches = admin.dataset({"rule": rule, "epsilon": "8", "delta": "1e-5", "accountant": "rdp"})
        held = trainer.reserve(dataset, batches, _dpsgd(0.01, 1.0, 1000)).json()
        trainer.commit(held["id"])
        spend = admin.spend(dataset)
        assert Decimal(spend["naive_sequential_epsilon"]) >= Decimal(spend["epsilon_spent"]) > 0, rule


def test_a_client_cannot_choose_the_filters_delta_weights(client: TestClient, keys: Keys) -> None:
    """The weights are derived from (ε, δ) at creation; a client that sends its own (e.g. all δ on
    one order, with orders of its choosing) is refused, naming the field, and nothing is created."""
    admin = Api(client, keys.get("acme", "admin"))
    before = admin.call("GET", "/v1/datasets", status=200).json()["data"]
    budget = {
        "rule": "sequential",
        "epsilon": "8",
        "delta": "1e-5",
        "accountant": "rdp",
        "orders": [2.0, 4.0],
        "delta_weights": ["1", "0.000001"],
    }
    refused = admin.call("POST", "/v1/datasets", {"name": "d", "budget": budget}, 422).json()
    assert "delta_weights" in refused["field"]
    assert admin.call("GET", "/v1/datasets", status=200).json()["data"] == before


def test_a_quote_says_what_each_accountant_choice_costs(client: TestClient, keys: Keys) -> None:
    """Issue 25 §3: the quote's informational ``accountants`` block prices the event on a new batch
    of a budget with the same rule, ε and δ under basic, rdp, prv (a declared plan) and tight, and
    names the one the budget uses. The Opacus run of the issue (q 1/23, σ 2.03125, 115 steps) on a
    default (tight) sequential budget of (1, 1e-5): tight and prv within 1.02× dp-accounting's
    PLD and not below its optimistic PLD; rdp (the Rényi filter) at least plain RDP; basic has no
    price for a Gaussian. Nothing is held; the same quote again answers the same block."""
    from dp_accounting.pld import PLDAccountant, privacy_loss_distribution

    admin, viewer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "viewer"))
    dataset, batches = admin.dataset({"rule": "sequential", "epsilon": "1", "delta": "1e-5"})
    q, sigma, steps, delta = 1 / 23, 2.03125, 115, 1e-5
    answer = _quote(viewer, dataset, _dpsgd(q, sigma, steps), batches=batches)
    block = answer["accountants"]
    assert block["informational"] is True and block["uses"] == "tight" and "Informational" in block["note"]
    by = block["by_accountant"]
    assert list(by) == ["basic", "rdp", "prv", "tight"]
    assert [name for name, b in by.items() if b["used"]] == ["tight"]
    assert by["tight"]["epsilon"] == answer["cost"]["epsilon"]  # a fresh batch: what it charges
    assert by["basic"]["available"] is False and "gaussian" in by["basic"]["reason"].lower()
    dpa_event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    pld = float(PLDAccountant(value_discretization_interval=1e-3).compose(dpa_event).get_epsilon(delta))
    lower = (
        privacy_loss_distribution.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            value_discretization_interval=1e-3,
            pessimistic_estimate=False,
            use_connect_dots=False,
        )
        .self_compose(steps)
        .get_epsilon_for_delta(delta)
    )
    for name in ("tight", "prv"):
        assert by[name]["available"] is True
        assert lower <= float(by[name]["epsilon"]) <= 1.02 * pld, (name, by[name], pld)
    assert float(by["rdp"]["epsilon"]) >= _dpa_epsilon(q, sigma, steps, delta) * (1 - 1e-9)
    assert by["rdp"]["admitted"] is False and by["tight"]["admitted"] is True  # the point
    assert admin.spend(dataset)["epsilon_spent"] == "0"
    assert _quote(viewer, dataset, _dpsgd(q, sigma, steps), batches=batches)["accountants"] == block
    # A rule that does not take an accountant says why; a pure ε costs ε under every accountant.
    lifelong, lifelong_batches = admin.dataset(
        {"rule": "lifelong", "epsilon": "1", "delta": "1e-5", "accountant": "rdp"}
    )
    pure = _quote(viewer, lifelong, {"kind": "pure_dp", "epsilon": 0.1}, batches=lifelong_batches)
    by = pure["accountants"]["by_accountant"]
    assert by["prv"]["available"] is False and "lifelong" in by["prv"]["reason"]
    assert pure["accountants"]["uses"] == "rdp" and by["rdp"]["used"] is True
    assert by["basic"]["epsilon"] == by["tight"]["epsilon"] == "0.1"


def test_a_quote_without_the_accountants_block_and_a_bad_flag(client: TestClient, keys: Keys) -> None:
    """``accountants: false`` (a calibration quoting many runs) leaves the block out; a flag that is
    not a boolean is a 422 naming it, and nothing is priced."""
    admin = Api(client, keys.get("acme", "admin"))
    dataset, batches = admin.dataset({"rule": "parallel", "epsilon": "1", "delta": "1e-5"})
    event = _dpsgd(0.01, 2.0, 10)
    lean = _quote(admin, dataset, event, batches=batches, accountants=False)
    full = _quote(admin, dataset, event, batches=batches)
    assert lean["accountants"] is None and full["accountants"]["uses"] == "tight"
    assert {k: v for k, v in lean.items() if k != "accountants"} == {
        k: v for k, v in full.items() if k != "accountants"
    }
    bad = admin.call(
        "POST", f"/v1/datasets/{dataset}/quote", {"event": event, "batches": batches, "accountants": "no"}
    )
    assert bad.status_code == 422 and "accountants" in bad.text
