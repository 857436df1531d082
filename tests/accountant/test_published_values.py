"""Published (ε, δ) values reproduced by accountant.rdp, each with the orders and conversion its
source used and a tolerance set by the digits the source published.

* TF Privacy MNIST tutorial: q = 256/60000, σ = 1.12, 60 epochs (14063 steps), δ = 1e-5 → 2.92;
  classic conversion, TF Privacy's orders.
* Abadi et al. 2016: q = 0.01, σ = 4, 100 / 400 epochs, δ = 1e-5 → 1.26 / 2.55 with the moments
  accountant; RDP with the classic conversion over dp-accounting's default orders → 1.259 / 2.574.
* Opacus's RDP accountant test: q = 0.04, σ = 1.5, 2250 steps, δ = 1e-5 → 7.32911117; Opacus's
  ``get_privacy_spent`` is the improved conversion (Balle et al. 2020, Thm. 21) over its
  ``RDPAccountant.DEFAULT_ALPHAS`` (1.1, ..., 10.9, 12, ..., 63).
* dp-accounting's RDP test: one Gaussian step, σ = 4.530877117, δ = 1e-6 → 1.0 (the tight PRV/PLD
  value is 0.927); improved conversion, orders 1.001, ..., 99.999.
* AdaDp (adaptive noise), Sec. III-C: q = 600/60000, σ* = 0.9, T = 1800, δ = 1e-5 → ≈ 4.0 at α = 6
  (exact Poisson RDP: 4.0153); classic conversion, integer orders 2..64. Its Theorem 1 as printed
  (sampling without replacement, WBK Thm. 27) gives ≈ 6.42.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # type: ignore[import-untyped]

from accountant import events as ev
from accountant.rdp import DEFAULT_ORDERS, RdpAccountant, compute_rdp, rdp_to_delta, rdp_to_epsilon

# TF Privacy's compute_dp_sgd_privacy orders; Opacus's RDPAccountant.DEFAULT_ALPHAS is the same list.
TF_PRIVACY_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
OPACUS_ORDERS = TF_PRIVACY_ORDERS
ADADP_ORDERS = [float(a) for a in range(2, 65)]  # AdaDp Sec. IV: "we select α's from {2, 3, ..., 64}"


def dp_sgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def epsilon_at(
    event: ev.DpEvent, orders: Sequence[float], delta: float, conversion: str
) -> tuple[float, float]:
    return rdp_to_epsilon(compute_rdp(event, orders), orders, delta, conversion=conversion)


def test_tf_privacy_mnist() -> None:
    # 60 epochs of 60000 examples in lots of 256: ceil(60·60000/256) = 14063 steps, as TF
    # Privacy's compute_dp_sgd_privacy counts them.
    eps, order = epsilon_at(dp_sgd(256 / 60000, 1.12, 14063), TF_PRIVACY_ORDERS, 1e-5, "classic")
    assert abs(eps - 2.92) <= 0.005  # published to two decimals
    assert eps == pytest.approx(2.922345396, abs=1e-9)
    assert order == 9.1


@pytest.mark.parametrize(("epochs", "published"), [(100, 1.259), (400, 2.574)])
def test_abadi_et_al_2016(epochs: int, published: float) -> None:
    # q = L/N = 0.01, so an epoch is 100 steps. The paper's moments accountant gave 1.26 and 2.55;
    # RDP with the classic conversion over dp-accounting's default orders gives these.
    eps, _ = epsilon_at(dp_sgd(0.01, 4.0, 100 * epochs), list(dpa_rdp.DEFAULT_RDP_ORDERS), 1e-5, "classic")
    assert abs(eps - published) <= 0.0005  # published to three decimals


def test_opacus_rdp_accountant() -> None:
    # Opacus's test: RDPAccountant, 2250 steps of q = 0.04, σ = 1.5; get_epsilon(1e-5) uses the
    # improved conversion eps = rdp − (log δ + log α)/(α−1) + log((α−1)/α) over DEFAULT_ALPHAS.
    eps, order = epsilon_at(dp_sgd(0.04, 1.5, 2250), OPACUS_ORDERS, 1e-5, "improved")
    assert abs(eps - 7.32911117) <= 5e-9  # published to eight decimals
    assert order == 3.9  # a fractional order: the exact fractional formula is exercised


def test_dp_accounting_gaussian() -> None:
    # dp-accounting's test_compute_epsilon_delta_gaussian: σ chosen to give exactly (1, 1e-6)-DP
    # under the improved conversion with orders 1.001 ... 99.999 (1.000 itself is not an RDP order).
    orders = [0.001 * i for i in range(1001, 100000)]
    acc = RdpAccountant(orders=orders).compose(ev.GaussianEvent(4.530877117))
    assert abs(acc.get_epsilon(1e-6).upper - 1.0) <= 5e-8  # assertAlmostEqual's 7 places
    assert acc.get_delta(1.0) == pytest.approx(1e-6, rel=1e-6)
    # With the default grid the best order is 22: a hair above 1.
    default = RdpAccountant().compose(ev.GaussianEvent(4.530877117)).get_epsilon(1e-6)
    assert default.upper == pytest.approx(1.0000002896, abs=1e-10) and default.details["order"] == 22.0
    # RDP cannot reach the tight value (0.927 by PRV/PLD): it is an upper bound above it.
    assert default.upper > 0.927


def test_adadp_worked_example_is_the_exact_poisson_value() -> None:
    # AdaDp: lots of L = 600 out of N = 60000, σ* = 0.9, T = 1800 steps, δ = 1e-5: "(4.0, 1e-5)-DP
    # at the optimal α = 6". That is the exact Poisson-subsampled Gaussian RDP (Mironov, Talwar,
    # Zhang 2019) with the classic conversion over integer orders.
    eps, order = epsilon_at(dp_sgd(600 / 60000, 0.9, 1800), ADADP_ORDERS, 1e-5, "classic")
    assert abs(eps - 4.0153) <= 5e-5  # the value to four decimals
    assert order == 6.0
    assert round(eps, 1) == 4.0  # the paper's printed digits


def test_adadp_theorem_1_as_printed_is_the_without_replacement_bound() -> None:
    # AdaDp's Theorem 1 prints Wang–Balle–Kasiviswanathan's sampling-without-replacement bound
    # (Thm. 27); on the same example it gives ≈ 6.42 (at α = 5), not 4.0.
    event = ev.SelfComposedEvent(ev.SampledWithoutReplacementEvent(600, 60000, ev.GaussianEvent(0.9)), 1800)
    eps, order = epsilon_at(event, ADADP_ORDERS, 1e-5, "classic")
    assert abs(eps - 6.4177) <= 5e-5
    assert order == 5.0
    # dp-accounting's implementation of the same theorem agrees.
    theirs = [1800 * dpa_rdp._compute_rdp_sample_wor_gaussian_scalar(0.01, 0.9, a) for a in ADADP_ORDERS]
    assert eps == pytest.approx(rdp_to_epsilon(theirs, ADADP_ORDERS, 1e-5, conversion="classic")[0], rel=1e-9)


def test_adadp_misreading_of_b_would_under_report() -> None:
    # One literal reading of AdaDp's B(l) drops its exponential, so that the q²C(α,2) coefficient
    # is 1/σ² and B(l) = 0 for l > 2. At α = 6 that gives ≈ 2.97 — below the exact Poisson value
    # (4.0153 there), so it is not a valid bound. Shown here so no one "fixes" the accountant to it.
    q, sigma, steps, alpha = 0.01, 0.9, 1800, 6
    misread = steps * math.log1p(q**2 * math.comb(alpha, 2) / sigma**2) / (alpha - 1)
    misread_eps = misread + math.log(1e5) / (alpha - 1)
    assert abs(misread_eps - 2.97) <= 0.005
    exact = compute_rdp(dp_sgd(q, sigma, steps), [float(alpha)])[0]
    assert misread < exact
    assert exact + math.log(1e5) / (alpha - 1) == pytest.approx(4.0153, abs=5e-5)


def test_default_accountant_improves_on_the_published_conversions() -> None:
    # The ledger's default (improved conversion, the richer default grid) is never worse.
    for event, published in [(dp_sgd(256 / 60000, 1.12, 14063), 2.92), (dp_sgd(0.01, 0.9, 1800), 4.0153)]:
        improved = RdpAccountant().compose(event).get_epsilon(1e-5).upper
        assert improved < published
        delta, _ = rdp_to_delta(compute_rdp(event, DEFAULT_ORDERS), DEFAULT_ORDERS, improved)
        assert delta <= 1e-5 * (1 + 1e-9)
