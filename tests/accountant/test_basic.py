"""The basic accountant: exact sums of pure and approximate DP (basic composition)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant.basic import BasicAccountant, epsilon_delta
from accountant.errors import InvalidArgumentError, UnsupportedEventError
from accountant.mechanisms import l2dp_ml_epsilon

L2DP = ev.FunctionalMechanismL2DPEvent(
    epsilon1=0.5,
    epsilon2=0.25,
    input_dim=20,
    hidden_units=8,
    output_hidden_units=4,
    batch_size=100,
    theta1_norm_bound=1.0,
)


def test_pure_and_approx_dp_are_summed() -> None:
    acc = BasicAccountant()
    acc.compose(ev.PureDpEvent(0.5)).compose(ev.ApproxDpEvent(1.0, 1e-6), 3)
    bound = acc.get_epsilon(1e-5)
    assert bound.upper == bound.estimate == 3.5
    assert bound.lower == 0.0  # the sum is an upper bound only (issue 25: it was above exact ones)
    assert bound.method == "basic"
    assert acc.delta_spent == pytest.approx(3e-6)


def test_hundred_charges_of_a_hundredth_sum_exactly_and_round_up() -> None:
    acc = BasicAccountant()
    for _ in range(100):
        acc.compose(ev.PureDpEvent(0.01))
    # The float 0.01 is slightly above one hundredth; the exact sum of the floats is above 1.0,
    # so the result rounds up to the next float — never down to 1.0 by float drift.
    exact = 100 * Fraction(0.01)
    upper = acc.get_epsilon(0.0).upper
    assert Fraction(upper) >= exact
    assert Fraction(math.nextafter(upper, 0.0)) < exact


def test_laplace_is_one_over_scale() -> None:
    assert epsilon_delta(ev.LaplaceEvent(scale=4.0)) == (0.25, 0.0)
    eps, _ = epsilon_delta(ev.LaplaceEvent(scale=3.0))
    assert Fraction(eps) >= Fraction(1, 3) and eps == pytest.approx(1 / 3)


def test_self_composed_multiplies_even_for_10_to_the_18() -> None:
    event = ev.SelfComposedEvent(event=ev.PureDpEvent(0.5), count=10**18)
    assert epsilon_delta(event) == (5e17, 0.0)
    acc = BasicAccountant().compose(ev.ApproxDpEvent(1e-3, 1e-30), count=10**18)
    assert acc.epsilon_spent == pytest.approx(1e15)
    assert acc.delta_spent == pytest.approx(1e-12)
    capped = BasicAccountant().compose(ev.ApproxDpEvent(1.0, 1e-3), count=10**18)
    assert capped.delta_spent == 1.0  # δ sums are capped at 1


def test_paper_events() -> None:
    eps = l2dp_ml_epsilon(
        epsilon1=0.5,
        epsilon2=0.25,
        input_dim=20,
        hidden_units=8,
        batch_size=100,
        theta1_norm_bound=1.0,
    )
    assert epsilon_delta(L2DP) == (eps, 0.0)
    assert epsilon_delta(ev.OutputPerturbationEvent(l2_sensitivity=0.2, epsilon=0.7)) == (0.7, 0.0)


def test_non_private_is_infinite_not_an_exception() -> None:
    acc = BasicAccountant().compose(ev.ComposedEvent((ev.PureDpEvent(1.0), ev.NonPrivateEvent())))
    assert acc.get_epsilon(1e-5).upper == math.inf
    assert acc.get_delta(10.0) == 1.0
    assert epsilon_delta(ev.NonPrivateEvent())[0] == math.inf


def test_no_op_costs_nothing() -> None:
    acc = BasicAccountant().compose(ev.NoOpEvent(), count=10**18)
    assert acc.get_epsilon(0.0).upper == 0.0
    assert acc.get_delta(0.0) == 0.0


@pytest.mark.parametrize(
    ("event", "innermost"),
    [
        (ev.GaussianEvent(1.0), "gaussian"),
        (ev.AdaptiveGaussianEvent(noise_multiplier=1.0), "adaptive_gaussian"),
        (ev.PoissonSampledEvent(0.1, ev.PureDpEvent(1.0)), "poisson_sampled"),
        (ev.SampledWithoutReplacementEvent(10, 100, ev.LaplaceEvent(1.0)), "sampled_without_replacement"),
        (
            ev.ComposedEvent(
                (
                    ev.PureDpEvent(1.0),
                    ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, ev.GaussianEvent(1.0)), 5),
                )
            ),
            "gaussian",
        ),
    ],
)
def test_unsupported_events_raise_naming_the_innermost(event: ev.DpEvent, innermost: str) -> None:
    acc = BasicAccountant()
    assert not acc.supports(event)
    with pytest.raises(UnsupportedEventError) as info:
        acc.compose(event)
    assert info.value.event.kind == innermost
    assert repr(innermost) in str(info.value)
    assert acc.get_epsilon(0.0).upper == 0.0  # a refused event changes nothing
    with pytest.raises(UnsupportedEventError):
        epsilon_delta(event)


def test_delta_below_the_summed_delta_gives_infinity() -> None:
    acc = BasicAccountant().compose(ev.ApproxDpEvent(1.0, 1e-5), 2)
    assert acc.get_epsilon(2e-5).upper == 2.0
    low = acc.get_epsilon(1e-5)
    assert low.upper == math.inf and "below the summed delta" in low.note


def test_get_delta() -> None:
    acc = BasicAccountant().compose(ev.ApproxDpEvent(1.0, 1e-6), 2)
    assert acc.get_delta(2.0) == pytest.approx(2e-6)
    assert acc.get_delta(1.999) == 1.0
    assert acc.get_delta(math.inf) == 0.0


@pytest.mark.parametrize("delta", [math.nan, -0.1, 1.0, math.inf])
def test_bad_delta_names_the_field(delta: float) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BasicAccountant().get_epsilon(delta)
    assert info.value.field == "delta"


@pytest.mark.parametrize("count", [-1, 10**18 + 1, 1.5, True])
def test_bad_count_names_the_field(count: object) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BasicAccountant().compose(ev.PureDpEvent(1.0), count)  # type: ignore[arg-type]
    assert info.value.field == "count"


_pure = st.floats(0, 5, allow_subnormal=False).map(ev.PureDpEvent)
_approx = st.tuples(st.floats(0, 5, allow_subnormal=False), st.floats(0, 1e-4)).map(
    lambda t: ev.ApproxDpEvent(*t)
)
_laplace = st.floats(0.05, 100).map(ev.LaplaceEvent)
_leaf = st.one_of(_pure, _approx, _laplace, st.just(ev.NoOpEvent()))
_event = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 10**6)).map(lambda t: ev.SelfComposedEvent(*t)),
        st.lists(inner, max_size=4).map(lambda xs: ev.ComposedEvent(tuple(xs))),
    ),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(event=_event, count=st.integers(0, 1000))
def test_composing_equals_the_exact_sum_rounded_up(event: ev.DpEvent, count: int) -> None:
    eps, delta = epsilon_delta(event)
    acc = BasicAccountant().compose(event, count)
    if count == 0:
        assert acc.epsilon_spent == 0.0
        return
    assert acc.epsilon_spent >= eps * count * (1 - 1e-15)
    assert acc.epsilon_spent == pytest.approx(eps * count, rel=1e-12, abs=1e-300)
    before = acc.epsilon_spent
    assert acc.compose(event).epsilon_spent >= before  # monotone in count
    assert delta <= 1.0
