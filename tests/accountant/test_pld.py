"""The one-pass PLD composition of many distinct mechanisms (``accountant.pld``, pricing version 5),
checked against dp-accounting's own PLDs: each mechanism's pmf bit for bit, the composition
between dp-accounting's optimistic (a lower bound on the true ε) and pessimistic (an upper
bound) compositions on the same grid."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from accountant import events as ev
from accountant import pld
from accountant import prv as prv_module
from accountant import rules as R
from accountant.prv.variables import prvs_of
from accountant.rules.prices import tight_epsilon


def _dp_sgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


@pytest.mark.parametrize(
    ("sigma", "q", "h"),
    [(1.0, 0.01, 1e-3), (0.8, 0.02, 2**-10), (2.0, 0.001, 2**-12), (0.5, 0.3, 2**-8), (5.0, 1.0, 1e-3)],
)
def test_each_gaussian_pmf_is_dp_accountings_bit_for_bit(sigma: float, q: float, h: float) -> None:
    """The vectorised construction is dp-accounting's ``from_gaussian_mechanism`` (pessimistic,
    connect-the-dots), both directions: same grid, same infinity mass, same probabilities."""
    reference = pld_lib.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=h, pessimistic_estimate=True
    )
    directions = [(False, reference._pmf_remove)] + ([(True, reference._pmf_add)] if q < 1 else [])
    for add, pmf in directions:
        dense = pmf.to_dense_pmf()
        ours = pld._gaussian_pmf(sigma, q, add, h)
        assert ours is not None
        assert ours.lower == dense._lower_loss
        assert ours.infinity == dense._infinity_mass
        assert np.array_equal(ours.probs, np.asarray(dense._probs)), (
            add,
            np.max(np.abs(ours.probs - dense._probs)),
        )


# Six distinct mechanisms: three DP-SGD runs, a Gaussian, a Laplace repeated, another run.
MIXTURE = [
    (("sg", 0.01, 1.1), 60),
    (("sg", 0.02, 1.6), 40),
    (("sg", 0.005, 0.9), 80),
    (("g", 1.0, 8.0), 3),
    (("lap", 1.0, 40.0), 5),
    (("sg", 0.05, 2.5), 20),
]


def _reference(h: float, delta: float, pessimistic: bool) -> float:
    """dp-accounting's composition of MIXTURE, one convolution at a time."""
    composed = None
    dots = pessimistic  # connect-the-dots is pessimistic only; optimistic: privacy buckets
    for (kind, q, scale), count in MIXTURE:
        if kind == "lap":
            one = pld_lib.from_laplace_mechanism(
                scale,
                value_discretization_interval=h,
                pessimistic_estimate=pessimistic,
                use_connect_dots=dots,
            )
        else:
            one = pld_lib.from_gaussian_mechanism(
                scale,
                sampling_prob=q,
                value_discretization_interval=h,
                pessimistic_estimate=pessimistic,
                use_connect_dots=dots,
            )
        one = one.self_compose(count)
        composed = one if composed is None else composed.compose(one)
    assert composed is not None
    return float(composed.get_epsilon_for_delta(delta))


def _mixture_event() -> ev.DpEvent:
    parts: list[ev.DpEvent] = []
    for (kind, q, scale), count in MIXTURE:
        if kind == "sg":
            parts.append(_dp_sgd(q, scale, count))
        elif kind == "g":
            parts.append(ev.SelfComposedEvent(ev.GaussianEvent(scale), count))
        else:
            parts.append(ev.SelfComposedEvent(ev.LaplaceEvent(scale), count))
    return ev.ComposedEvent(tuple(parts))


@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_a_heterogeneous_composition_lies_between_dp_accountings_optimistic_and_pessimistic_plds(
    delta: float,
) -> None:
    """On the same grid: never below dp-accounting's optimistic PLD (a lower bound on the true
    ε, sound at these ε), and at most 0.1% above its pessimistic PLD (an independent upper bound
    that truncates its tails at 1e-15 where ours pays 2τ = 2e-4·δ and the round-off in δ)."""
    h = 2**-10
    components = prvs_of(_mixture_event()).components
    assert len(components) == 6
    ours = pld.composed_epsilon(components, delta, h)
    lower = _reference(h, delta, pessimistic=False)
    upper = _reference(h, delta, pessimistic=True)
    assert ours is not None
    assert lower <= ours <= upper * 1.001, (lower, ours, upper)


def test_the_tight_engine_prices_many_distinct_mechanisms_by_the_pld_since_pricing_version_5() -> None:
    """Engine 2 (pricing version 5) answers by the PLD, no higher than engine 1's PRV (pricing
    version 4, which a replayed certificate still gets), and not below the optimistic PLD."""
    event = _mixture_event()
    new = prv_module.tight_epsilon(event, 1e-5)
    old = prv_module.tight_epsilon(event, 1e-5, engine=1)
    assert new.method == "pld" and old.method == "prv"
    assert _reference(2**-10, 1e-5, pessimistic=False) <= new.upper < old.upper
    with R.pricing_version(4):
        v4 = tight_epsilon(event, Decimal("1e-5"))
    v5 = tight_epsilon(event, Decimal("1e-5"))
    assert v5 < v4
    assert v4 >= Decimal(repr(old.upper)) and v5 >= Decimal(repr(new.upper))


def test_a_bad_engine_is_refused() -> None:
    with pytest.raises(Exception, match="engine"):
        prv_module.tight_epsilon(ev.GaussianEvent(1.0), 1e-5, engine=7)


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (2.0, 1.0), (0.7, 0.5)])
def test_the_gaussian_pld_is_dp_accountings_object_bit_for_bit(sigma: float, q: float) -> None:
    """``gaussian_pld`` (what the tight engine composes for up to 4 distinct mechanisms) gives
    dp-accounting's ``from_gaussian_mechanism`` ε and δ exactly, composed too."""
    ours = pld.gaussian_pld(sigma, q, 2**-10)
    reference = pld_lib.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=2**-10, pessimistic_estimate=True
    )
    assert ours is not None
    for delta in (1e-3, 1e-6):
        assert ours.get_epsilon_for_delta(delta) == reference.get_epsilon_for_delta(delta)
    assert ours.self_compose(30).get_epsilon_for_delta(1e-5) == reference.self_compose(
        30
    ).get_epsilon_for_delta(1e-5)
