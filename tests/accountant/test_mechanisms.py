"""The papers' formulas (accountant.mechanisms): values, rounding direction, validation, sampling."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from accountant import mechanisms as mech
from accountant.errors import InvalidArgumentError
from accountant.events import OutputPerturbationEvent

# ---------------------------------------------------------------------------------------------
# L2DP-ML, Theorem 2
# ---------------------------------------------------------------------------------------------


def test_l2dp_ml_epsilon_matches_theorem_2_by_hand() -> None:
    # d = 784, |h1| = 100 → Δ_R = 784·102 = 79968; |B| = 1000, ‖θ̄1‖ = 2:
    # γx = 79.968, γ = 2·79968/(1000·2) = 79.968; ε = 1 + 1/79.968 + 1/79.968 + 0.5.
    eps = mech.l2dp_ml_epsilon(
        epsilon1=1.0,
        epsilon2=0.5,
        input_dim=784,
        hidden_units=100,
        batch_size=1000,
        theta1_norm_bound=2.0,
    )
    assert eps == pytest.approx(1.5 + 2 / 79.968, rel=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    e1=st.floats(1e-3, 10),
    e2=st.floats(1e-3, 10),
    d=st.integers(1, 5000),
    h1=st.integers(1, 2000),
    batch=st.integers(1, 100_000),
    theta=st.floats(1e-3, 100),
)
def test_l2dp_ml_epsilon_is_the_exact_value_rounded_up(
    e1: float, e2: float, d: int, h1: int, batch: int, theta: float
) -> None:
    eps = mech.l2dp_ml_epsilon(
        epsilon1=e1,
        epsilon2=e2,
        input_dim=d,
        hidden_units=h1,
        batch_size=batch,
        theta1_norm_bound=theta,
    )
    delta_r = Fraction(d * (h1 + 2))
    exact = Fraction(e1) * (1 + batch / delta_r + batch * Fraction(theta) / (2 * delta_r)) + Fraction(e2)
    assert Fraction(eps) >= exact
    assert Fraction(math.nextafter(eps, 0.0)) < exact  # the smallest float above


def test_l2dp_ml_epsilon_grows_with_batch_size_and_norm_bound() -> None:
    base = dict(epsilon1=1.0, epsilon2=1.0, input_dim=10, hidden_units=5)
    small = mech.l2dp_ml_epsilon(**base, batch_size=10, theta1_norm_bound=1.0)
    assert mech.l2dp_ml_epsilon(**base, batch_size=20, theta1_norm_bound=1.0) > small
    assert mech.l2dp_ml_epsilon(**base, batch_size=10, theta1_norm_bound=2.0) > small


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epsilon1", math.nan),
        ("epsilon2", -1.0),
        ("input_dim", 0),
        ("hidden_units", 1.5),
        ("batch_size", True),
        ("theta1_norm_bound", math.inf),
    ],
)
def test_l2dp_ml_epsilon_errors_name_field_and_value(field: str, value: object) -> None:
    kwargs: dict[str, object] = dict(
        epsilon1=1.0,
        epsilon2=1.0,
        input_dim=10,
        hidden_units=5,
        batch_size=10,
        theta1_norm_bound=1.0,
    )
    kwargs[field] = value
    with pytest.raises(InvalidArgumentError) as info:
        mech.l2dp_ml_epsilon(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert repr(value) in str(info.value)


# ---------------------------------------------------------------------------------------------
# Output perturbation and continual release
# ---------------------------------------------------------------------------------------------


def test_output_perturbation_sensitivity_and_epsilon() -> None:
    sens = mech.output_perturbation_l2_sensitivity(lipschitz=1.0, regularization=0.01, dataset_size=1000)
    assert sens == pytest.approx(0.2, rel=1e-15) and Fraction(sens) >= Fraction(2) / 10
    assert mech.output_perturbation_epsilon(l2_sensitivity=sens, noise_scale=sens / 0.5) == pytest.approx(0.5)


@settings(max_examples=100, deadline=None)
@given(sens=st.floats(1e-6, 1e3), eps=st.floats(1e-6, 1e3))
def test_output_perturbation_event_charges_the_noise_actually_drawn(sens: float, eps: float) -> None:
    # The trainer draws noise of scale b = fl(Δ₂/ε); the charge is ≥ both ε and the exact Δ₂/b.
    event = OutputPerturbationEvent(l2_sensitivity=sens, epsilon=eps)
    charged = mech.output_perturbation_event_epsilon(event)
    assert charged >= eps
    assert Fraction(charged) >= Fraction(sens) / Fraction(event.noise_scale)
    assert charged == pytest.approx(eps, rel=1e-15)


def test_continual_release_noise_scale_is_4L_over_lambda_2k_B_epsilon() -> None:
    scale = mech.continual_release_noise_scale(
        lipschitz=1.0, regularization=0.1, level=3, block_size=100, epsilon=1.0
    )
    assert scale == pytest.approx(4 / (0.1 * 8 * 100 * 1.0), rel=1e-15)
    # Level k's scale with sensitivity 2L/(λ·2ᵏB) is an ε/2 mechanism (proof of Theorem 3).
    sens = mech.output_perturbation_l2_sensitivity(lipschitz=1.0, regularization=0.1, dataset_size=800)
    assert mech.output_perturbation_epsilon(l2_sensitivity=sens, noise_scale=scale) == pytest.approx(0.5)


@pytest.mark.parametrize("epsilon", [1e-6, 0.1, 1.0, 3.0, 50.0, 2000.0])
@pytest.mark.parametrize("level", [0, 1, 2, 5, 20])
def test_sampling_probability_amplifies_half_epsilon_to_the_level_share(epsilon: float, level: int) -> None:
    p = mech.continual_release_sampling_probability(epsilon=epsilon, level=level)
    assert 0 <= p <= 1
    if level == 0:
        assert p == 1.0
    if p == 0.0:  # e^{ε/(2·2ᵏ) − ε/2} underflows: rounding down to 0 is the safe side
        assert epsilon / 2 - epsilon / (2 * 2**level) > 700
        return
    # ln(1 + p(e^{ε/2} − 1)) = ε/(2·2ᵏ): Algorithm 6 line 5 with Balle et al. 2018 amplification.
    amplified = mech.amplified_pure_epsilon(epsilon=epsilon / 2, sampling_probability=p)
    target = epsilon / (2 * 2**level)
    assert amplified == pytest.approx(target, rel=1e-9)
    assert mech.continual_release_level_epsilon(epsilon=epsilon, level=level) == pytest.approx(target)


def test_sampling_probability_by_hand_and_rounded_down() -> None:
    p = mech.continual_release_sampling_probability(epsilon=1.0, level=1)
    exact = (math.exp(0.25) - 1) / (math.exp(0.5) - 1)
    assert p == pytest.approx(exact, rel=1e-14) and p <= exact


def test_geometric_series_of_level_costs_stays_below_epsilon() -> None:
    total = math.fsum(mech.continual_release_level_epsilon(epsilon=1.0, level=k) for k in range(60))
    assert total <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(lipschitz=0.0, regularization=1.0, level=0, block_size=1, epsilon=1.0), "lipschitz"),
        (dict(lipschitz=1.0, regularization=1.0, level=-1, block_size=1, epsilon=1.0), "level"),
        (dict(lipschitz=1.0, regularization=1.0, level=0, block_size=0, epsilon=1.0), "block_size"),
        (dict(lipschitz=1.0, regularization=1.0, level=0, block_size=1, epsilon=math.nan), "epsilon"),
    ],
)
def test_continual_release_errors_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        mech.continual_release_noise_scale(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


# ---------------------------------------------------------------------------------------------
# Sampling checks (cheap, fixed seeds)
# ---------------------------------------------------------------------------------------------


def test_output_perturbation_noise_norm_is_gamma_d_b_and_direction_uniform() -> None:
    rng = np.random.default_rng(20240601)
    d, b = 5, 0.3
    noise = mech.sample_output_perturbation_noise(rng=rng, dimension=d, noise_scale=b, size=20_000)
    assert noise.shape == (20_000, d)
    norms = np.linalg.norm(noise, axis=1)
    ks = stats.kstest(norms, stats.gamma(a=d, scale=b).cdf)
    assert ks.pvalue > 1e-3
    assert abs(norms.mean() - d * b) < 5 * math.sqrt(d) * b / math.sqrt(norms.size)
    directions = noise / norms[:, None]
    assert np.all(np.abs(directions.mean(axis=0)) < 0.03)
    assert mech.sample_output_perturbation_noise(rng=rng, dimension=d, noise_scale=b).shape == (d,)


def test_output_perturbation_empirical_density_ratio_within_e_to_epsilon() -> None:
    # In one dimension the density ∝ exp(−|ν|/b) is Laplace(b): neighbouring outputs θ = 0 and
    # θ′ = Δ₂ have density ratio ≤ e^{Δ₂/b} = e^ε everywhere; check it on a histogram.
    rng = np.random.default_rng(7)
    sens, epsilon = 1.0, 1.0
    b = sens / epsilon
    n = 400_000
    a = mech.sample_output_perturbation_noise(rng=rng, dimension=1, noise_scale=b, size=n)[:, 0]
    c = sens + mech.sample_output_perturbation_noise(rng=rng, dimension=1, noise_scale=b, size=n)[:, 0]
    bins = np.linspace(-2, 3, 21)
    ha, _ = np.histogram(a, bins)
    hc, _ = np.histogram(c, bins)
    ratio = np.maximum(ha / hc, hc / ha)
    # Sampling error on ≥ 2000 counts per bin is < 10% at these seeds; e^ε·1.1 bounds the ratio.
    assert np.all(np.minimum(ha, hc) > 2000)
    assert ratio.max() <= math.exp(epsilon) * 1.1
    assert ratio.max() >= math.exp(epsilon) * 0.9  # and the bound is attained (tight)


def test_laplace_mechanism_empirical_density_ratio() -> None:
    # The basic accountant's Laplace ε = 1/scale, checked on samples of Lap(scale) at 0 and 1.
    rng = np.random.default_rng(11)
    scale = 2.0
    a = rng.laplace(0.0, scale, 300_000)
    c = rng.laplace(1.0, scale, 300_000)
    bins = np.linspace(-4, 5, 19)
    ha, _ = np.histogram(a, bins)
    hc, _ = np.histogram(c, bins)
    assert np.max(np.maximum(ha / hc, hc / ha)) <= math.exp(1 / scale) * 1.1


# ---------------------------------------------------------------------------------------------
# AdaDp, Lemma 1
# ---------------------------------------------------------------------------------------------


def test_lemma1_accepts_and_refuses() -> None:
    assert mech.satisfies_lemma1([0.5] * 4, [1.0] * 4, 1.0)  # 4 · 0.25 = 1 ≤ 1 (equality)
    assert not mech.satisfies_lemma1([0.5] * 4, [1.0] * 4, 1.0000001)
    assert mech.satisfies_lemma1(np.array([1.0, 1.0]), np.array([2.0, 2.0]), 1.4)
    assert not mech.satisfies_lemma1([1.0, 1.0], [2.0, 2.0], 1.5)  # 0.5 > 1/2.25


def test_lemma1_is_exact_at_the_boundary() -> None:
    s = [0.1] * 100  # Σ 0.01·… in floats is not exactly 1
    sd = [1.0] * 100
    exact_total = sum(Fraction(0.1) ** 2 for _ in range(100))
    sigma_star = 1.0
    assert mech.satisfies_lemma1(s, sd, sigma_star) == (exact_total <= 1)


def test_lemma1_errors_name_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        mech.satisfies_lemma1([1.0], [0.0], 1.0)
    assert info.value.field == "noise_stddevs[0]"
    with pytest.raises(InvalidArgumentError) as info:
        mech.satisfies_lemma1([1.0, -1.0], [1.0, 1.0], 1.0)
    assert info.value.field == "sensitivities[1]"
    with pytest.raises(InvalidArgumentError) as info:
        mech.satisfies_lemma1([1.0], [1.0, 1.0], 1.0)
    assert info.value.field == "noise_stddevs"
    with pytest.raises(InvalidArgumentError) as info:
        mech.satisfies_lemma1([1.0], [1.0], math.nan)
    assert info.value.field == "noise_multiplier"


# ---------------------------------------------------------------------------------------------
# The analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8)
# ---------------------------------------------------------------------------------------------


def _exact_delta(sigma: float, epsilon: float) -> float:
    """Balle & Wang's δ(ε) in 60-digit arithmetic (mpmath), independent of the float code."""
    import mpmath

    with mpmath.workdps(60):
        s, e = mpmath.mpf(sigma), mpmath.mpf(epsilon)
        return float(mpmath.ncdf(1 / (2 * s) - e * s) - mpmath.exp(e) * mpmath.ncdf(-1 / (2 * s) - e * s))


@pytest.mark.parametrize(
    ("sigma", "delta"),
    [(1e4, 1e-10), (1.0, 1e-5), (0.1, 1e-5), (2.0291607597, 1e-7), (100.0, 1e-12), (1e-3, 1e-5), (0.5, 0.3)],
)
def test_analytic_gaussian_epsilon_is_exact_and_never_below_the_true_value(
    sigma: float, delta: float
) -> None:
    """δ(ε_ours) ≤ δ in exact arithmetic (never below the true ε), and ε_ours·(1 − 1e-4) is not
    enough (tight). σ = 10⁴ at δ = 1e-10 is the audit's lone Gaussian (RDP on a grid to 4096 was
    7.6× this)."""
    eps = mech.analytic_gaussian_epsilon(noise_multiplier=sigma, delta=delta)
    assert _exact_delta(sigma, eps) <= delta
    assert _exact_delta(sigma, eps * (1 - 1e-4)) > delta
    assert mech.analytic_gaussian_delta(noise_multiplier=sigma, epsilon=eps) == pytest.approx(
        _exact_delta(sigma, eps), rel=1e-9
    )


def test_analytic_gaussian_edges_and_errors() -> None:
    # δ(0) = 2Φ(1/(2σ)) − 1: a δ at least that needs no ε at all.
    assert mech.analytic_gaussian_epsilon(noise_multiplier=1e6, delta=1e-6) == 0.0
    assert mech.analytic_gaussian_epsilon(noise_multiplier=1e-200, delta=1e-5) == math.inf
    with pytest.raises(InvalidArgumentError, match="delta"):
        mech.analytic_gaussian_epsilon(noise_multiplier=1.0, delta=0.0)
    with pytest.raises(InvalidArgumentError, match="noise_multiplier"):
        mech.analytic_gaussian_epsilon(noise_multiplier=-1.0, delta=1e-5)
