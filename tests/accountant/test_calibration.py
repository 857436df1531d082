"""accountant.calibration: the smallest σ on the 1e-4 grid whose ε upper bound meets the target."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant import events as ev
from accountant.calibration import MAX_NOISE_MULTIPLIER, calibrate_noise_multiplier
from accountant.errors import InvalidArgumentError
from accountant.registry import make_accountant


def upper(sigma: float, *, q: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    event = ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma))
    return make_accountant(accountant).compose(event, steps).get_epsilon(delta).upper


def previous_grid_point(sigma: float, resolution: float = 1e-4) -> float:
    return float(Decimal(repr(sigma)) - Decimal(repr(resolution)))


def assert_smallest_on_grid(
    sigma: float, *, target: float, q: float, steps: int, delta: float, accountant: str = "rdp"
) -> None:
    assert Decimal(repr(sigma)) % Decimal("0.0001") == 0  # on the grid k·1e-4
    assert upper(sigma, q=q, steps=steps, delta=delta, accountant=accountant) <= target  # never over
    if sigma > 1e-4:
        below = previous_grid_point(sigma)
        assert upper(below, q=q, steps=steps, delta=delta, accountant=accountant) > target


def test_tf_privacy_mnist_setting() -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=2.92, delta=1e-5, sampling_probability=256 / 60000, steps=14063
    )
    # The improved conversion needs less noise than the published σ = 1.12 (classic conversion).
    assert sigma == 1.0291
    assert_smallest_on_grid(sigma, target=2.92, q=256 / 60000, steps=14063, delta=1e-5)


def test_single_gaussian_release() -> None:
    sigma = calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-6, sampling_probability=1.0, steps=1)
    assert_smallest_on_grid(sigma, target=1.0, q=1.0, steps=1, delta=1e-6)
    assert 4.5 < sigma < 4.6  # dp-accounting's (1, 1e-6) Gaussian has σ = 4.530877117


def test_large_targets_reach_the_smallest_grid_point() -> None:
    assert calibrate_noise_multiplier(
        target_epsilon=1e12, delta=1e-5, sampling_probability=1.0, steps=1
    ) == pytest.approx(1e-4)


def test_coarser_resolution() -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=1.0, delta=1e-5, sampling_probability=0.01, steps=10_000, resolution=0.01
    )
    assert Decimal(repr(sigma)) % Decimal("0.01") == 0
    assert upper(sigma, q=0.01, steps=10_000, delta=1e-5) <= 1.0
    assert upper(sigma - 0.01, q=0.01, steps=10_000, delta=1e-5) > 1.0


def test_prv_accountant_by_name() -> None:
    pytest.importorskip("prv_accountant")
    sigma = calibrate_noise_multiplier(
        target_epsilon=2.0, delta=1e-5, sampling_probability=0.01, steps=100, accountant="prv"
    )
    assert_smallest_on_grid(sigma, target=2.0, q=0.01, steps=100, delta=1e-5, accountant="prv")
    # The tight accountant needs less noise than RDP for the same target.
    rdp_sigma = calibrate_noise_multiplier(
        target_epsilon=2.0, delta=1e-5, sampling_probability=0.01, steps=100
    )
    assert sigma <= rdp_sigma


def test_unreachable_target_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        calibrate_noise_multiplier(target_epsilon=1e-3, delta=1e-5, sampling_probability=1.0, steps=10**18)
    assert info.value.field == "target_epsilon"
    assert f"{MAX_NOISE_MULTIPLIER:g}" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": math.nan}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"sampling_probability": 0.0}, "sampling_probability"),
        ({"sampling_probability": 1.5}, "sampling_probability"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"resolution": 0.0}, "resolution"),
        ({"resolution": math.nan}, "resolution"),
        ({"accountant": "moments"}, "accountant"),
    ],
)
def test_bad_arguments_are_named(overrides: dict[str, object], field: str) -> None:
    arguments: dict[str, object] = {
        "target_epsilon": 1.0,
        "delta": 1e-5,
        "sampling_probability": 0.01,
        "steps": 100,
    }
    arguments.update(overrides)
    with pytest.raises(InvalidArgumentError) as info:
        calibrate_noise_multiplier(**arguments)  # type: ignore[arg-type]
    assert info.value.field == field


@settings(max_examples=12, deadline=None)
@given(
    target=st.floats(min_value=0.05, max_value=50.0),
    delta=st.sampled_from([1e-5, 1e-6, 1e-8]),
    q=st.floats(min_value=1e-4, max_value=1.0),
    steps=st.integers(min_value=1, max_value=100_000),
)
def test_calibration_never_overshoots_and_is_the_smallest_grid_point(
    target: float, delta: float, q: float, steps: int
) -> None:
    sigma = calibrate_noise_multiplier(
        target_epsilon=target, delta=delta, sampling_probability=q, steps=steps
    )
    assert_smallest_on_grid(sigma, target=target, q=q, steps=steps, delta=delta)
