"""accountant.rdp: RDP curves of every event kind, conversions, the accountant and its edge cases.

Independent oracles: closed forms (Gaussian, Laplace, pure DP), multi-precision evaluation of the
sampled Gaussian's A_α with mpmath (the finite sum at integer orders, numerical integration at
fractional ones), and dp-accounting's implementations of the same theorems.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant.base import EpsilonBound
from accountant.errors import InvalidArgumentError, UnsupportedEventError
from accountant.mechanisms import l2dp_ml_epsilon
from accountant.rdp import (
    DEFAULT_ORDERS,
    RdpAccountant,
    compute_rdp,
    rdp_to_delta,
    rdp_to_epsilon,
)
from accountant.registry import make_accountant
from tests.conftest import fast_loop_sample

ORDERS = np.asarray(DEFAULT_ORDERS)
# Hypothesis examples each compute a few curves (~3 ms each): keep the counts small.
FAST = settings(max_examples=25, deadline=None)


def poisson(q: float, sigma: float, steps: int = 1) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def epsilon(event: ev.DpEvent, delta: float = 1e-5) -> float:
    return RdpAccountant().compose(event).get_epsilon(delta).upper


# ---------------------------------------------------------------------------------------------
# Orders
# ---------------------------------------------------------------------------------------------


def test_default_orders_contain_dp_accountings_defaults_and_fractional_orders() -> None:
    assert set(dpa_rdp.DEFAULT_RDP_ORDERS) <= set(DEFAULT_ORDERS)
    assert list(DEFAULT_ORDERS) == sorted(set(DEFAULT_ORDERS))
    assert any(not float(a).is_integer() for a in DEFAULT_ORDERS)
    assert min(DEFAULT_ORDERS) > 1


@pytest.mark.parametrize(
    ("orders", "field"),
    [
        ([], "orders"),
        ([2.0, 1.0], "orders[1]"),
        ([math.nan], "orders[0]"),
        ([0.5], "orders[0]"),
        ([math.inf], "orders[0]"),
        ([2.0**21], "orders[0]"),
        ([True], "orders[0]"),
    ],
)
def test_bad_orders_are_named(orders: list[float], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        compute_rdp(ev.GaussianEvent(1.0), orders)
    assert info.value.field == field
    with pytest.raises(InvalidArgumentError):
        RdpAccountant(orders=orders)


# ---------------------------------------------------------------------------------------------
# Curves of unsampled mechanisms: closed forms
# ---------------------------------------------------------------------------------------------


def test_gaussian_is_alpha_over_two_sigma_squared() -> None:
    for sigma in (0.5, 1.0, 4.530877117):
        np.testing.assert_allclose(
            compute_rdp(ev.GaussianEvent(sigma), DEFAULT_ORDERS), ORDERS / (2 * sigma**2), rtol=1e-15
        )
    # AdaDp's adaptive noise is accounted as a Gaussian with its σ* (Lemma 1).
    np.testing.assert_array_equal(
        compute_rdp(ev.AdaptiveGaussianEvent(0.9, (12.0, 6.0), (17.0, 8.5)), DEFAULT_ORDERS),
        compute_rdp(ev.GaussianEvent(0.9), DEFAULT_ORDERS),
    )


def _laplace_printed(alpha: float, eps: float) -> float:
    """Mironov 2017, Prop. 6 exactly as printed."""
    return math.log(
        alpha / (2 * alpha - 1) * math.exp((alpha - 1) * eps)
        + (alpha - 1) / (2 * alpha - 1) * math.exp(-alpha * eps)
    ) / (alpha - 1)


def test_laplace_matches_mironov_proposition_6() -> None:
    for scale in (0.1, 0.5, 1.0, 3.0):
        eps = 1 / scale
        curve = compute_rdp(ev.LaplaceEvent(scale), DEFAULT_ORDERS[:150])
        expected = [_laplace_printed(a, eps) for a in DEFAULT_ORDERS[:150]]
        np.testing.assert_allclose(curve, expected, rtol=1e-12)
        assert np.all(curve <= eps) and np.all(curve <= ORDERS[:150] * eps**2 / 2 * (1 + 1e-12))


def test_laplace_is_accurate_where_the_printed_form_cancels() -> None:
    # ε = 1e-9: the printed form loses every digit; the curve is αε²/2·(1 − O(ε)).
    eps = 1e-9
    curve = compute_rdp(ev.LaplaceEvent(1 / eps), DEFAULT_ORDERS)
    np.testing.assert_allclose(curve, ORDERS * eps**2 / 2, rtol=1e-6)
    # ε = 1e6: ρ(α) → ε + log(α/(2α−1))/(α−1).
    big = compute_rdp(ev.LaplaceEvent(1e-6), [2.0, 64.0])
    np.testing.assert_allclose(big, [1e6 + math.log(2 / 3), 1e6 + math.log(64 / 127) / 63], rtol=1e-15)


def test_pure_dp_events_use_min_of_epsilon_and_bun_steinke() -> None:
    l2dp = ev.FunctionalMechanismL2DPEvent(
        epsilon1=0.5,
        epsilon2=0.25,
        input_dim=20,
        hidden_units=8,
        output_hidden_units=4,
        batch_size=100,
        theta1_norm_bound=1.0,
    )
    l2dp_eps = l2dp_ml_epsilon(
        epsilon1=0.5,
        epsilon2=0.25,
        input_dim=20,
        hidden_units=8,
        batch_size=100,
        theta1_norm_bound=1.0,
    )
    cases = [
        (ev.PureDpEvent(0.3), 0.3),
        (ev.ApproxDpEvent(0.3, 0.0), 0.3),  # δ = 0 is pure DP
        (ev.OutputPerturbationEvent(l2_sensitivity=0.1, epsilon=2.0), 2.0),
        (l2dp, l2dp_eps),
    ]
    for event, eps in cases:
        np.testing.assert_allclose(
            compute_rdp(event, DEFAULT_ORDERS), np.minimum(eps, ORDERS * eps**2 / 2), rtol=1e-15
        )
    np.testing.assert_array_equal(compute_rdp(ev.PureDpEvent(0.0), DEFAULT_ORDERS), 0.0)


def test_no_op_is_zero_and_non_private_is_infinite() -> None:
    np.testing.assert_array_equal(compute_rdp(ev.NoOpEvent(), DEFAULT_ORDERS), 0.0)
    np.testing.assert_array_equal(compute_rdp(ev.NonPrivateEvent(), DEFAULT_ORDERS), np.inf)
    acc = RdpAccountant().compose(ev.NonPrivateEvent())
    assert acc.get_epsilon(1e-5).upper == math.inf
    assert acc.get_delta(10.0) == 1.0


# ---------------------------------------------------------------------------------------------
# Poisson-sampled Gaussian: exact, against multi-precision A_α
# ---------------------------------------------------------------------------------------------


def _rdp_multiprecision(q: float, sigma: float, alpha: float) -> float:
    """ρ(α) of the Poisson-sampled Gaussian from A_α at 50 digits (Mironov, Talwar, Zhang 2019):
    the finite binomial sum at integer α, numerical integration of
    E_{z∼N(0,σ²)}[(1 − q + q·e^{(2z−1)/(2σ²)})^α] at fractional α."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(50):
        q_, s_, a_ = (mpmath.mpf(v) for v in (q, sigma, alpha))
        if float(alpha).is_integer():
            n = int(alpha)
            a_alpha = mpmath.fsum(
                mpmath.binomial(n, i) * q_**i * (1 - q_) ** (n - i) * mpmath.exp((i * i - i) / (2 * s_**2))
                for i in range(n + 1)
            )
        else:
            z0 = s_**2 * mpmath.log(1 / q_ - 1) + mpmath.mpf(1) / 2

            def integrand(z: Any) -> Any:
                ratio = (1 - q_) + q_ * mpmath.exp((2 * z - 1) / (2 * s_**2))
                return mpmath.npdf(z, 0, s_) * ratio**a_

            points = sorted({mpmath.mpf(0), mpmath.mpf(1) / 2, z0, a_})
            a_alpha = mpmath.quad(integrand, [-mpmath.inf, *points, mpmath.inf], maxdegree=10)
        return float(mpmath.log(a_alpha) / (a_ - 1))


# (q, σ, α): dp-accounting's own multi-precision cases plus ours (Opacus's α = 3.9, q = 0.5,
# q near 1, α near 1, the A_α − 1 < rounding regime).
MULTIPRECISION_CASES = [
    (1e-7, 0.1, 1.01),
    (1e-6, 0.1, 256),
    (1e-6, 1.0, 27),
    (1e-4, 1.0, 1.5),
    (1e-3, 1.0, 2),
    (0.01, 10.0, 20),
    (0.1, 100.0, 20.5),
    (0.99, 0.1, 256),
    (0.999, 100.0, 256.1),
    (1e-12, 1.0, 2.5),
    (0.5, 4.0, 1.5),
    (0.04, 1.5, 3.9),
    (1e-3, 0.6, 1.01),
    (0.3, 0.7, 7.3),
]


@pytest.mark.parametrize(("q", "sigma", "alpha"), fast_loop_sample(MULTIPRECISION_CASES))
def test_poisson_gaussian_is_exact_upper_bound(q: float, sigma: float, alpha: float) -> None:
    exact = _rdp_multiprecision(q, sigma, alpha)
    ours = float(compute_rdp(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), [alpha])[0])
    # Never below the exact value (only float rounding of the oracle's last digit allowed) ...
    assert ours >= exact * (1 - 1e-13)
    # ... and above it by at most the working precision of log A_α = (α−1)ρ(α): 1e-9 relative,
    # or 1e-13 absolute where A_α − 1 is itself near the rounding of 1 (tiny q, huge σ).
    assert (alpha - 1) * (ours - exact) <= 1e-9 * (alpha - 1) * exact + 1e-13


def test_poisson_gaussian_matches_dp_accounting_at_integer_orders() -> None:
    integer_orders = [a for a in DEFAULT_ORDERS if float(a).is_integer() and a <= 1024]
    for q, sigma in [(0.01, 1.1), (0.1, 0.8), (0.5, 2.0), (0.9, 0.6), (1e-3, 4.0)]:
        ours = compute_rdp(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), integer_orders)
        theirs = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, integer_orders)
        np.testing.assert_allclose(ours, theirs, rtol=1e-10)


def test_tiny_sampling_probability_keeps_every_digit() -> None:
    # q = 1e-12: A_α − 1 ≈ C(α,2)q²(e^{1/σ²} − 1) ≈ 1e-24 is lost by the textbook sum (which
    # rounds to ρ = 0, an under-report); the rewritten sum keeps it: ρ ≈ αq²(e^{1/σ²}−1)/2.
    q, sigma = 1e-12, 1.0
    integer_orders = [2.0, 3.0, 10.0]  # (at α = 63 the i = 63 term, q⁶³e^{63·62/2}, dominates)
    curve = compute_rdp(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), integer_orders)
    leading = np.asarray(integer_orders) * q**2 * math.expm1(1 / sigma**2) / 2
    np.testing.assert_allclose(curve, leading, rtol=1e-9)


def test_sampling_probability_one_is_the_inner_event() -> None:
    for inner in (ev.GaussianEvent(1.3), ev.LaplaceEvent(2.0), ev.PureDpEvent(0.4)):
        np.testing.assert_array_equal(
            compute_rdp(ev.PoissonSampledEvent(1.0, inner), DEFAULT_ORDERS),
            compute_rdp(inner, DEFAULT_ORDERS),
        )
        np.testing.assert_array_equal(
            compute_rdp(ev.SampledWithoutReplacementEvent(7, 7, inner), DEFAULT_ORDERS),
            compute_rdp(inner, DEFAULT_ORDERS),
        )


def test_composed_gaussians_inside_a_sample_are_one_gaussian() -> None:
    inner = ev.ComposedEvent((ev.GaussianEvent(2.0), ev.SelfComposedEvent(ev.GaussianEvent(4.0), 4)))
    # 1/σ² = 1/4 + 4/16 = 1/2: one Gaussian with σ = √2.
    np.testing.assert_allclose(
        compute_rdp(ev.PoissonSampledEvent(0.1, inner), DEFAULT_ORDERS),
        compute_rdp(ev.PoissonSampledEvent(0.1, ev.GaussianEvent(math.sqrt(2))), DEFAULT_ORDERS),
        rtol=1e-12,
    )


# ---------------------------------------------------------------------------------------------
# Sampling without replacement: Wang–Balle–Kasiviswanathan Thm. 27
# ---------------------------------------------------------------------------------------------


def test_without_replacement_matches_dp_accountings_wbk_bound() -> None:
    for m, n, sigma in [(600, 60000, 0.9), (1, 100, 2.0), (300, 1000, 1.0)]:
        orders = list(range(2, 65))
        ours = compute_rdp(ev.SampledWithoutReplacementEvent(m, n, ev.GaussianEvent(sigma)), orders)
        theirs = [dpa_rdp._compute_rdp_sample_wor_gaussian_scalar(m / n, sigma, a) for a in orders]
        np.testing.assert_allclose(ours, theirs, rtol=1e-9)


def test_without_replacement_fractional_order_takes_the_next_integer() -> None:
    event = ev.SampledWithoutReplacementEvent(600, 60000, ev.GaussianEvent(0.9))
    at = dict(zip([4.2, 5.0, 5.5, 6.0], compute_rdp(event, [4.2, 5.0, 5.5, 6.0]), strict=True))
    assert at[4.2] == at[5.0] and at[5.5] == at[6.0]


def test_without_replacement_never_exceeds_the_unsampled_gaussian() -> None:
    for sigma in (1e-3, 0.1, 1.0, 1e3):
        wor = compute_rdp(
            ev.SampledWithoutReplacementEvent(1, 10**9, ev.GaussianEvent(sigma)), DEFAULT_ORDERS
        )
        assert np.all(wor <= compute_rdp(ev.GaussianEvent(sigma), DEFAULT_ORDERS))


# ---------------------------------------------------------------------------------------------
# Unsupported events: a typed error naming the innermost event
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (ev.ApproxDpEvent(1.0, 1e-6), "approx_dp"),
        (ev.ComposedEvent((ev.GaussianEvent(1.0), ev.ApproxDpEvent(1.0, 1e-6))), "approx_dp"),
        (ev.PoissonSampledEvent(0.1, ev.LaplaceEvent(1.0)), "laplace"),
        (
            ev.PoissonSampledEvent(0.1, ev.ComposedEvent((ev.GaussianEvent(1.0), ev.PureDpEvent(0.1)))),
            "pure_dp",
        ),
        (ev.SampledWithoutReplacementEvent(1, 10, ev.PureDpEvent(0.5)), "pure_dp"),
        (ev.PoissonSampledEvent(0.1, ev.PoissonSampledEvent(0.5, ev.GaussianEvent(1.0))), "poisson_sampled"),
        (
            ev.SelfComposedEvent(ev.PoissonSampledEvent(0.2, ev.OutputPerturbationEvent(1.0, 1.0)), 10),
            "output_perturbation",
        ),
        # The dry run checks the structure, whatever the count (as dp-accounting does).
        (ev.SelfComposedEvent(ev.ApproxDpEvent(1.0, 1e-3), 0), "approx_dp"),
    ],
)
def test_unsupported_events_raise_naming_the_inner_event(event: ev.DpEvent, kind: str) -> None:
    acc = RdpAccountant()
    assert not acc.supports(event)
    with pytest.raises(UnsupportedEventError) as info:
        acc.compose(event)
    assert info.value.event.kind == kind
    assert info.value.accountant == "rdp"
    assert kind in str(info.value)
    np.testing.assert_array_equal(acc.rdp, 0.0)  # a refused event changes nothing
    with pytest.raises(UnsupportedEventError):
        compute_rdp(event, DEFAULT_ORDERS)


SUPPORTED = [
    ev.NoOpEvent(),
    ev.NonPrivateEvent(),
    ev.GaussianEvent(1.0),
    ev.LaplaceEvent(1.0),
    ev.PureDpEvent(1.0),
    ev.ApproxDpEvent(1.0, 0.0),
    ev.OutputPerturbationEvent(1.0, 1.0),
    ev.AdaptiveGaussianEvent(1.0),
    poisson(0.01, 1.0, 100),
    ev.SampledWithoutReplacementEvent(10, 1000, ev.GaussianEvent(1.0)),
    ev.PoissonSampledEvent(0.5, ev.NonPrivateEvent()),
    ev.PoissonSampledEvent(0.5, ev.NoOpEvent()),
    ev.PoissonSampledEvent(1.0, ev.LaplaceEvent(2.0)),
    ev.ComposedEvent((poisson(0.1, 2.0, 10), ev.LaplaceEvent(3.0), ev.NoOpEvent())),
]


@pytest.mark.parametrize("event", SUPPORTED, ids=lambda e: e.kind)
def test_dry_run_agrees_with_the_update(event: ev.DpEvent) -> None:
    acc = RdpAccountant()
    assert acc.supports(event)
    acc.compose(event)
    curve = acc.rdp
    assert not np.isnan(curve).any() and np.all(curve >= 0)


def test_sampled_non_private_is_infinite_and_sampled_no_op_is_zero() -> None:
    np.testing.assert_array_equal(
        compute_rdp(ev.PoissonSampledEvent(0.5, ev.NonPrivateEvent()), [2.0]), np.inf
    )
    np.testing.assert_array_equal(compute_rdp(ev.PoissonSampledEvent(0.5, ev.NoOpEvent()), [2.0]), 0.0)


# ---------------------------------------------------------------------------------------------
# Composition and counts
# ---------------------------------------------------------------------------------------------


def test_composition_sums_and_self_composition_multiplies() -> None:
    a, b = poisson(0.02, 1.1), ev.LaplaceEvent(4.0)
    curve_a, curve_b = compute_rdp(a, DEFAULT_ORDERS), compute_rdp(b, DEFAULT_ORDERS)
    np.testing.assert_allclose(
        compute_rdp(ev.ComposedEvent((a, b, a)), DEFAULT_ORDERS), 2 * curve_a + curve_b
    )
    np.testing.assert_allclose(compute_rdp(ev.SelfComposedEvent(a, 7), DEFAULT_ORDERS), 7 * curve_a)
    via_count = RdpAccountant().compose(a, 7).rdp
    np.testing.assert_allclose(via_count, 7 * curve_a)
    chained = RdpAccountant().compose(a, 3).compose(ev.SelfComposedEvent(a, 2), 2).rdp
    np.testing.assert_allclose(chained, 7 * curve_a)


def test_zero_count_costs_nothing_even_for_a_non_private_event() -> None:
    np.testing.assert_array_equal(
        compute_rdp(ev.SelfComposedEvent(ev.NonPrivateEvent(), 0), DEFAULT_ORDERS), 0.0
    )
    np.testing.assert_array_equal(RdpAccountant().compose(ev.NonPrivateEvent(), 0).rdp, 0.0)


def test_counts_of_10_to_the_18_are_answered_in_bounded_time() -> None:
    start = time.perf_counter()
    huge = ev.SelfComposedEvent(poisson(1e-6, 3.0), ev.MAX_COUNT)
    curve = compute_rdp(huge, DEFAULT_ORDERS)
    np.testing.assert_allclose(curve, 1e18 * compute_rdp(poisson(1e-6, 3.0), DEFAULT_ORDERS), rtol=1e-15)
    nested = ev.SelfComposedEvent(ev.SelfComposedEvent(ev.GaussianEvent(1e-6), ev.MAX_COUNT), ev.MAX_COUNT)
    overflowing = ev.SelfComposedEvent(
        ev.SelfComposedEvent(ev.GaussianEvent(1e-150), ev.MAX_COUNT), ev.MAX_COUNT
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning: overflow to ∞ is a valid bound
        nested_curve = compute_rdp(nested, DEFAULT_ORDERS)
        overflow_curve = compute_rdp(overflowing, DEFAULT_ORDERS)
        bound = RdpAccountant().compose(huge, ev.MAX_COUNT).get_epsilon(1e-5)
    np.testing.assert_allclose(nested_curve, 1e36 * ORDERS / (2 * 1e-12), rtol=1e-15)
    assert np.all(overflow_curve == np.inf)
    assert bound.upper > 0 and not math.isnan(bound.upper)
    assert time.perf_counter() - start < 2.0


def test_accountant_rejects_bad_counts() -> None:
    for count in (-1, 10**18 + 1, 1.5, True):
        with pytest.raises(InvalidArgumentError) as info:
            RdpAccountant().compose(ev.GaussianEvent(1.0), count)  # type: ignore[arg-type]
        assert info.value.field == "count"


# ---------------------------------------------------------------------------------------------
# Extreme parameters: a correct bound, never NaN, never negative
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [1e-300, 1e-12, 1e-3, 0.5, 1 - 1e-12, 1.0])
@pytest.mark.parametrize("sigma", [1e-6, 0.1, 1.0, 1e6])
def test_extreme_parameters_give_finite_ordered_bounds(q: float, sigma: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampled = compute_rdp(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), DEFAULT_ORDERS)
        m = max(1, round(q * 10**18))
        wor = compute_rdp(
            ev.SampledWithoutReplacementEvent(m, 10**18, ev.GaussianEvent(sigma)), DEFAULT_ORDERS
        )
        gaussian = compute_rdp(ev.GaussianEvent(sigma), DEFAULT_ORDERS)
        for curve in (sampled, wor):
            assert np.all(np.isfinite(curve)) and np.all(curve > 0)
            assert np.all(curve <= gaussian)  # sampling never hurts
            assert np.all(np.diff(curve) >= 0)  # RDP is non-decreasing in α
            eps, order = rdp_to_epsilon(curve, DEFAULT_ORDERS, 1e-5)
            assert 0 <= eps < math.inf and order in DEFAULT_ORDERS


# ---------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------


def test_classic_and_improved_conversions_by_hand() -> None:
    orders = [2.0, 8.0, 32.0]
    rdp = [0.5, 1.0, 3.0]
    classic = [r + math.log(1 / 1e-5) / (a - 1) for r, a in zip(rdp, orders, strict=True)]
    improved = [
        r + math.log((a - 1) / a) - (math.log(1e-5) + math.log(a)) / (a - 1)
        for r, a in zip(rdp, orders, strict=True)
    ]
    assert rdp_to_epsilon(rdp, orders, 1e-5, conversion="classic") == pytest.approx(
        (min(classic), 8.0), rel=1e-15
    )
    assert rdp_to_epsilon(rdp, orders, 1e-5) == pytest.approx((min(improved), 8.0), rel=1e-15)


def test_improved_conversion_on_dp_accountings_pure_dp_case() -> None:
    # dp-accounting's test_compute_epsilon_delta_pure_dp: a constant curve 1.1 on orders 2..32.
    orders = list(range(2, 33))
    eps, order = rdp_to_epsilon([1.1] * len(orders), orders, 1e-5)
    assert eps == pytest.approx(1.32783806176, abs=1e-10) and order == 32
    delta, order = rdp_to_delta([1.1] * len(orders), orders, 1.32783806176)
    assert delta == pytest.approx(1e-5, rel=1e-9) and order == 32


def test_conversions_are_inverse_bounds() -> None:
    curve = compute_rdp(poisson(0.01, 1.1, 5000), DEFAULT_ORDERS)
    for conversion in ("improved", "classic"):
        for delta in (1e-3, 1e-5, 1e-9):
            eps, _ = rdp_to_epsilon(curve, DEFAULT_ORDERS, delta, conversion=conversion)
            back, _ = rdp_to_delta(curve, DEFAULT_ORDERS, eps, conversion=conversion)
            assert back <= delta * (1 + 1e-9)
    improved = rdp_to_epsilon(curve, DEFAULT_ORDERS, 1e-5)[0]
    assert improved < rdp_to_epsilon(curve, DEFAULT_ORDERS, 1e-5, conversion="classic")[0]


def test_delta_zero_and_tiny_curves() -> None:
    assert rdp_to_epsilon([0.0, 0.0], [2.0, 3.0], 0.0) == (0.0, 2.0)
    assert rdp_to_epsilon([1e-9, 1e-9], [2.0, 3.0], 0.0)[0] == math.inf
    # Total variation ≤ √(1 − e^{−ρ}) ≤ δ: already (0, δ)-DP.
    assert rdp_to_epsilon([1e-14], [2.0], 1e-5)[0] == 0.0
    assert rdp_to_delta([1e-14], [2.0], 0.0)[0] == pytest.approx(1e-7, rel=1e-6)
    assert rdp_to_delta([1.0], [2.0], math.inf) == (0.0, 2.0)
    assert rdp_to_delta([math.inf], [2.0], 5.0) == (1.0, 2.0)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: rdp_to_epsilon([1.0], [2.0, 3.0], 1e-5), "rdp"),
        (lambda: rdp_to_epsilon([-1.0], [2.0], 1e-5), "rdp[0]"),
        (lambda: rdp_to_epsilon([math.nan], [2.0], 1e-5), "rdp[0]"),
        (lambda: rdp_to_epsilon([1.0], [1.0], 1e-5), "orders[0]"),
        (lambda: rdp_to_epsilon([1.0], [2.0], 1.0), "delta"),
        (lambda: rdp_to_epsilon([1.0], [2.0], math.nan), "delta"),
        (lambda: rdp_to_epsilon([1.0], [2.0], 1e-5, conversion="tight"), "conversion"),
        (lambda: rdp_to_delta([1.0], [2.0], -1.0), "epsilon"),
        (lambda: RdpAccountant(conversion="exact"), "conversion"),
        (lambda: RdpAccountant().get_epsilon(-0.5), "delta"),
        (lambda: RdpAccountant().get_delta(math.nan), "epsilon"),
    ],
)
def test_bad_arguments_are_named(call: Callable[[], object], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        call()
    assert info.value.field == field


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------


def test_accountant_is_registered_and_answers_with_an_upper_bound_only() -> None:
    acc = make_accountant("rdp")
    assert isinstance(acc, RdpAccountant) and acc.name == "rdp"
    assert acc.orders == DEFAULT_ORDERS and acc.conversion == "improved"
    assert acc.compose(poisson(0.04, 1.5), 2250) is acc
    bound = acc.get_epsilon(1e-5)
    assert isinstance(bound, EpsilonBound)
    assert bound.lower == 0.0 and bound.estimate == bound.upper and bound.method == "rdp"
    assert bound.details["order"] in DEFAULT_ORDERS
    expected = rdp_to_epsilon(compute_rdp(poisson(0.04, 1.5, 2250), DEFAULT_ORDERS), DEFAULT_ORDERS, 1e-5)
    assert (bound.upper, bound.details["order"]) == expected
    assert acc.get_delta(bound.upper) <= 1e-5 * (1 + 1e-9)


def test_empty_accountant_spends_nothing() -> None:
    acc = RdpAccountant()
    assert acc.get_epsilon(0.0).upper == 0.0
    assert acc.get_delta(0.0) == 0.0


def test_classic_accountant_uses_the_classic_conversion() -> None:
    acc = RdpAccountant(orders=[2.0, 4.0, 8.0], conversion="classic").compose(ev.GaussianEvent(2.0))
    rdp = [a / 8 for a in (2.0, 4.0, 8.0)]
    assert acc.get_epsilon(1e-5).upper == rdp_to_epsilon(rdp, [2.0, 4.0, 8.0], 1e-5, conversion="classic")[0]


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

probabilities = st.floats(min_value=1e-12, max_value=1.0)
noise = st.floats(min_value=0.3, max_value=50.0)
step_counts = st.integers(min_value=1, max_value=10**6)
# ε of two nearby parameter sets comes from independently rounded curves; the ordering holds up
# to that rounding (and the fractional orders' rounding allowance): 1e-9 relative.
ROUNDING = 1e-9


@FAST
@given(
    q=probabilities,
    sigma=st.floats(min_value=1e-4, max_value=1e4),
    alpha_index=st.integers(0, len(ORDERS) - 1),
)
def test_curve_is_non_negative_finite_and_below_the_gaussian(
    q: float, sigma: float, alpha_index: int
) -> None:
    curve = compute_rdp(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), DEFAULT_ORDERS)
    assert np.all(np.isfinite(curve)) and np.all(curve >= 0)
    assert curve[alpha_index] <= ORDERS[alpha_index] / (2 * sigma**2)


@FAST
@given(q=probabilities, sigma=noise, factor=st.floats(min_value=1.0001, max_value=10.0), steps=step_counts)
def test_epsilon_decreases_with_noise(q: float, sigma: float, factor: float, steps: int) -> None:
    assert epsilon(poisson(q, sigma * factor, steps)) <= epsilon(poisson(q, sigma, steps)) * (1 + ROUNDING)


@FAST
@given(q=probabilities, factor=st.floats(min_value=1.0001, max_value=100.0), sigma=noise, steps=step_counts)
def test_epsilon_increases_with_sampling_probability(
    q: float, factor: float, sigma: float, steps: int
) -> None:
    larger = min(1.0, q * factor)
    assert epsilon(poisson(q, sigma, steps)) <= epsilon(poisson(larger, sigma, steps)) * (1 + ROUNDING)


@FAST
@given(q=probabilities, sigma=noise, steps=step_counts, more=st.integers(min_value=1, max_value=10**6))
def test_epsilon_increases_with_steps(q: float, sigma: float, steps: int, more: int) -> None:
    assert epsilon(poisson(q, sigma, steps)) <= epsilon(poisson(q, sigma, steps + more)) * (1 + ROUNDING)
