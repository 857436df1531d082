"""Numerical composition of privacy random variables: the ``"prv"`` accountant.

Theorem relied on
-----------------
Gopi, Lee & Wutschitz (2021), "Numerical Composition of Differential Privacy" (NeurIPS 2021; the
``prv-accountant`` package, v0.2.0). The privacy loss random variable (PRV) of a mechanism with
dominating pair (P, Q) is Y = log(P(o)/Q(o)), o ~ P; composition adds independent PRVs and

    δ(ε) = E[(1 − e^{ε − Y})₊]     (their Eq. (2), with mass at +∞ counted as δ).

Each PRV is truncated to a domain [−L, L], discretised cell-centred on a mesh h with its mean
preserved (their Alg. 1), and the discretised PRVs are convolved by FFT. **Theorem 5.5** bounds the
error: with h = ε_err / sqrt(N/2 · log(12/δ_err)) (N the total number of compositions) and L from
**Remark 5.6** (an RDP tail bound: L = max(ε_RDP(all, δ_err/4), maxᵢ ε_RDP(Yᵢ, δ_err/(8N)),
ε_err) + 3), the true curve satisfies

    ε_disc(δ + δ_err) − ε_err ≤ ε(δ) ≤ ε_disc(δ − δ_err) + ε_err.

The ledger certifies with the right-hand side: ``EpsilonBound.upper``.

What is wrapped, and what is re-implemented for speed
-----------------------------------------------------
The algorithm, the mesh of Theorem 5.5, the domain of Remark 5.6 and the final ε(δ) search are
prv-accountant's (``prv_accountant.Domain`` is used for the grid, its ``LaplaceMechanism`` and
``PureDPMechanism`` PRVs for the Laplace, pure-DP and approximate-DP cdfs). Three steps are
re-implemented, because prv-accountant spends seconds per distinct mechanism on them and a
ledger plan may hold hundreds (the performance target: 200 distinct subsampled-Gaussian entries ×
50 steps in < 5 s):

* the Poisson-subsampled-Gaussian and Gaussian PRVs are evaluated in float64 with the survival
  function computed directly in the upper tail (no cancellation; prv-accountant evaluates the cdf
  in long double), and only on the window that carries their mass;
* the mean of each truncated PRV (needed for the mean-preserving discretisation) is a composite
  Gauss–Legendre integral in x-space (closed forms for Gaussian, Laplace and pure DP) instead of
  ``scipy.integrate.quad`` on the cdf;
* all distinct PRVs are composed by one product of their FFTs (PRVs with equal counts multiplied
  first, then one power per distinct count) and one inverse FFT, instead of a Fourier
  self-composition per PRV followed by a convolution tree;
* the ε(δ) search uses the tail sums Σ_{j≥i} pⱼe^{tᵢ−tⱼ} (a stable recurrence) instead of
  e^{tᵢ}·Σ pⱼe^{−tⱼ}, which overflows long double beyond ε ≈ 11000, and only the grid above 0.

Every approximation these introduce is paid for in the bound, never in the user's favour:

* mass dropped by truncation (window and domain) is subtracted from δ before the search
  (total variation: changing the distribution by d changes δ(ε) by at most d);
* the float64 FFT round-off is estimated from the composed pmf itself (its negative entries are
  pure round-off, whose amplitude is uniform across an FFT's output) as 4·n·max|negative entry|
  and also subtracted from δ;
* the quadrature error of each mean (estimated by comparing 8- and 16-point Gauss–Legendre rules)
  times the number of compositions is added to ε (a mean error shifts the composed PRV).

Tests cross-check the result against prv-accountant's own ``PRVAccountant`` and against
dp-accounting's PLD accountant.

Parameters
----------
``eps_error`` (default 0.01, Opacus's default) and ``delta_error`` (default δ/1000, Opacus's and
prv-accountant's recommendation) set the mesh. When the mesh for ``eps_error`` would need more
than 2²² grid points (very many compositions), ``eps_error`` is raised until it fits, up to 0.1
(prv-accountant's "typically around 0.1") or 0.1 % of the domain half-width L ≈ ε + 3 when that is
larger, and the note says so; beyond that the accountant falls back to RDP. All Gaussian PRVs of a
composition are first merged into one (exact: sums of normals are normal), which keeps the count
N, hence the grid, small for un-sampled Gaussian compositions.

Events
------
``gaussian`` and ``adaptive_gaussian`` (AdaDp Lemma 1: as private as a Gaussian with its
``noise_multiplier``) → Gaussian PRV; ``poisson_sampled`` of those → Poisson-subsampled Gaussian
PRV (add/remove adjacency, the "remove" pair P = (1−q)N(0,σ²) + qN(1,σ²) vs Q = N(0,σ²) that
prv-accountant and Opacus use; dp-accounting's PLD, which also accounts the "add" pair and takes
the worse, never exceeds our upper bound on the test grid); ``laplace`` → Laplace PRV; ``pure_dp``,
``l2dp_ml_functional`` and ``output_perturbation`` (pure ε-DP) → randomized-response PRV (the
dominating pair of every ε-DP mechanism); ``approx_dp`` → the same with mass δ at +∞.
``self_composed`` multiplies counts; ``composed`` concatenates.

Fallback
--------
Where PRV composition does not apply or fails — an event with no PRV here
(``sampled_without_replacement``, subsampled non-Gaussian mechanisms), a grid too large, a δ so
small that round-off dominates, an ε beyond the domain, prv-accountant's "discrete mean differs"
condition — the result comes from the ``rdp`` accountant (``method="rdp-fallback"``, ``note``
says why). It never raises for a supported event and never returns less than a valid upper bound.
When both are available, ``upper = min(PRV upper, RDP ε)``: both are valid upper bounds, so their
minimum is too (the note says when RDP was the smaller).

Tight PRV values assume the sequence of mechanisms was fixed in advance (a *declared plan*;
docs/ARCHITECTURE.md, "Adaptive composition"): the ledger does not use this accountant for ad-hoc
adaptive admission.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import scipy.fft
from prv_accountant.domain import Domain
from prv_accountant.privacy_random_variables import LaplaceMechanism, PureDPMechanism
from scipy.signal import lfilter
from scipy.special import log_ndtr, ndtr, ndtri

from accountant.base import EpsilonBound, PrivacyAccountant, check_delta, check_epsilon
from accountant.basic import BasicAccountant
from accountant.errors import AccountantError, InvalidArgumentError, UnsupportedEventError
from accountant.events import (
    MAX_COUNT,
    AdaptiveGaussianEvent,
    ApproxDpEvent,
    ComposedEvent,
    DpEvent,
    FunctionalMechanismL2DPEvent,
    GaussianEvent,
    LaplaceEvent,
    NonPrivateEvent,
    NoOpEvent,
    OutputPerturbationEvent,
    PoissonSampledEvent,
    PureDpEvent,
    SelfComposedEvent,
)
from accountant.mechanisms import (
    analytic_gaussian_epsilon,
    l2dp_ml_event_epsilon,
    output_perturbation_event_epsilon,
)
from accountant.rdp import RdpAccountant, untouched_delta

FloatArray = npt.NDArray[np.float64]

NAME: Final = "prv"
# The accountants PRV falls back on for events it has no PRV of (imported, not looked up in
# ``accountant.registry``, which sits above every accountant).
_FALLBACKS: Final[dict[str, Callable[[], PrivacyAccountant]]] = {
    "rdp": RdpAccountant,
    "basic": BasicAccountant,
}
FALLBACK_METHOD: Final = "rdp-fallback"
DEFAULT_EPS_ERROR: Final = 0.01
# The mesh error is also kept below this fraction of the ε found (a finer mesh is re-run), so a
# small ε is not inflated by an absolute 0.01: 3% leaves room for the δ − δ_err shift under the
# 5% the ledger promises against dp-accounting's PLD.
DEFAULT_RELATIVE_EPS_ERROR: Final = 0.03
# ... but never below this absolute error (and never beyond REFINE_WORK: see ``_refined``).
MIN_EPS_ERROR: Final = 1e-5
DEFAULT_DELTA_ERROR_RATIO: Final = 1e-3
MAX_EPS_ERROR: Final = 0.1
# ... or, for a large ε, 0.1% of the domain half-width (≈ ε + 3).
MAX_RELATIVE_EPS_ERROR: Final = 1e-3
MAX_GRID: Final = 2**22
# Above this half-width of the privacy-loss domain PRV is not attempted (RDP answers): such a
# loss means ε ≳ 10⁵, far beyond any meaningful guarantee, and its 4M-point grid took seconds.
MAX_HALF_WIDTH: Final = 1e5
# Total work cap (distinct PRVs × grid points) before falling back to RDP.
MAX_WORK: Final = 2 * 10**9
# Work cap of a re-run on a finer mesh for relative precision (~1 s on one core); beyond it the
# coarser, still valid, bound is kept and the note says so.
REFINE_WORK: Final = 2**23
_REFINEMENTS: Final = 2
# Errors of the float computation that make PRV composition give up (and RDP answer instead).
_NUMERIC_ERRORS: Final = (ValueError, RuntimeError, ArithmeticError, MemoryError)
# FFT batches of at most this many float64 values (64 MiB). A batched rfft costs less than half
# the CPU of one call per row (measured); one thread, so a request never takes over a shared box.
_FFT_BATCH_VALUES: Final = 2**23
_FFT_WORKERS: Final = 1
# Mass left outside each PRV's evaluation window (per side), at most; paid for in δ.
_WINDOW_TAIL_MAX: Final = 1e-12
# Gaussian tail beyond which the truncated-mean quadrature stops (mass < 1e-30).
_WINDOW_TAIL: Final = 1e-30
_Z_TAIL: Final = float(-ndtri(_WINDOW_TAIL))
# Orders for the RDP tail bound that sizes the domain (Remark 5.6): integer orders (cheap and
# exact for the subsampled Gaussian) reaching the small δ_err/(8N) of the per-PRV term.
_SIZING_ORDERS: Final = tuple([*range(2, 33), 40, 48, 56, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024])
_GL8: Final = np.polynomial.legendre.leggauss(8)
_GL16: Final = np.polynomial.legendre.leggauss(16)


class _PrvFailure(Exception):
    """PRV composition cannot certify this query; the message says why (becomes the note)."""


# ---------------------------------------------------------------------------------------------
# Privacy random variables (float64, vectorised)
# ---------------------------------------------------------------------------------------------


class _Prv(ABC):
    """One mechanism's PRV: cdf/sf on a window, the truncated mean, an RDP curve for sizing."""

    @property
    def pm_inf(self) -> float:
        """Probability mass at +∞ (the δ of an (ε, δ)-DP event)."""
        return 0.0

    @abstractmethod
    def window(self, z_tail: float) -> tuple[float, float]:
        """[lo, hi] outside which the finite mass is < Φ(−z_tail) per side (or exactly 0)."""

    @abstractmethod
    def cdf(self, t: FloatArray) -> FloatArray:
        """P(Y ≤ t | Y finite)."""

    def cdf_sf(self, t: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(P(Y ≤ t), P(Y > t)); overridden where 1 − cdf would lose the tail to cancellation."""
        cdf = self.cdf(t)
        return cdf, 1.0 - cdf

    def cell_probabilities(self, edges: FloatArray) -> tuple[FloatArray, float]:
        """(P(eₖ < Y ≤ eₖ₊₁) for consecutive edges, P(Y ≤ e₀) + P(Y > e_last)).

        Differences of the cdf below the median and of the survival function above it, so no
        cell's probability is lost to cancellation in either tail.
        """
        cdf, sf = self.cdf_sf(edges)
        upper = cdf[1:] > 0.5
        probabilities = np.where(upper, sf[:-1] - sf[1:], cdf[1:] - cdf[:-1])
        return probabilities, float(cdf[0]) + float(sf[-1])

    @abstractmethod
    def truncated_mean(self, lo: float, hi: float) -> tuple[float, float]:
        """(E[Y | lo < Y ≤ hi], an estimate of its absolute error)."""

    @abstractmethod
    def sizing_rdp(self, orders: FloatArray) -> FloatArray:
        """An upper bound on the RDP curve (only used to size the domain, Remark 5.6)."""


@dataclass(frozen=True, slots=True)
class _GaussianPrv(_Prv):
    """Gaussian mechanism, sensitivity 1, noise σ: Y ~ N(μ²/2, μ²) with μ = 1/σ."""

    noise_multiplier: float

    @property
    def _mu(self) -> float:
        return 1.0 / self.noise_multiplier

    def window(self, z_tail: float) -> tuple[float, float]:
        mu = self._mu
        return mu * mu / 2 - z_tail * mu, mu * mu / 2 + z_tail * mu

    def cdf(self, t: FloatArray) -> FloatArray:
        mu = self._mu
        result: FloatArray = ndtr((t - mu * mu / 2) / mu)
        return result

    def cdf_sf(self, t: FloatArray) -> tuple[FloatArray, FloatArray]:
        mu = self._mu
        z = (t - mu * mu / 2) / mu
        return ndtr(z), ndtr(-z)

    def truncated_mean(self, lo: float, hi: float) -> tuple[float, float]:
        # Mean of a truncated normal: m + s (φ(a) − φ(b)) / (Φ(b) − Φ(a)).
        mu = self._mu
        m, s = mu * mu / 2, mu
        a, b = (lo - m) / s, (hi - m) / s
        mass = float(ndtr(b) - ndtr(a)) if b <= 0 else float(ndtr(-a) - ndtr(-b))
        phi = math.exp(-a * a / 2) - math.exp(-b * b / 2)
        mean = m + s * phi / (math.sqrt(2 * math.pi) * mass)
        return mean, 1e-15 * (abs(m) + s)

    def sizing_rdp(self, orders: FloatArray) -> FloatArray:
        with np.errstate(divide="ignore", over="ignore"):  # σ² underflows to 0: ρ = ∞, as it is
            result: FloatArray = orders / (2 * self.noise_multiplier * self.noise_multiplier)
        return result


@dataclass(frozen=True, slots=True)
class _SubsampledGaussianPrv(_Prv):
    """Poisson-subsampled Gaussian, "remove" pair P = (1−q)N(0,σ²) + qN(1,σ²), Q = N(0,σ²).

    Y = ℓ(X), X ~ P, ℓ(x) = log(1 − q + q·e^{(2x−1)/(2σ²)}) increasing; so
    P(Y ≤ t) = P(X ≤ x(t)) with x(t) = σ² log(1 + (e^t − 1)/q) + 1/2 for t > log(1 − q).
    (prv-accountant's ``PoissonSubsampledGaussianMechanism``, in float64 with a direct survival
    function.)
    """

    sampling_probability: float
    noise_multiplier: float

    def _x_of_t(self, t: FloatArray) -> FloatArray:
        q, s = self.sampling_probability, self.noise_multiplier
        with np.errstate(over="ignore"):  # t beyond ~709: x = +inf, P(Y ≤ t) = 1, as it should
            x: FloatArray = np.expm1(t)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            x /= q
            np.log1p(x, out=x)
        x *= s * s
        x += 0.5
        x[t <= math.log1p(-q)] = -np.inf  # below the support: P(Y ≤ t) = 0
        return x

    def _loss(self, x: FloatArray) -> FloatArray:
        q, s = self.sampling_probability, self.noise_multiplier
        with np.errstate(over="ignore"):  # σ² beyond float range: the loss is log(1 − q + q) = 0
            result: FloatArray = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * s * s))
        return result

    def window(self, z_tail: float) -> tuple[float, float]:
        # The smallest x_hi with P(X > x_hi) = (1−q)Φ(−x/σ) + qΦ(−(x−1)/σ) ≤ Φ(−z_tail), by
        # bisection on [1, 1 + z_tail·σ] (where the qΦ(−(x−1)/σ) term alone already fits).
        q, s = self.sampling_probability, self.noise_multiplier
        log_tail = float(log_ndtr(-z_tail))
        lo, hi = 1.0, 1.0 + z_tail * s
        for _ in range(30):
            mid = (lo + hi) / 2
            log_mass = float(
                np.logaddexp(math.log1p(-q) + log_ndtr(-mid / s), math.log(q) + log_ndtr(-(mid - 1) / s))
            )
            lo, hi = (lo, mid) if log_mass <= log_tail else (mid, hi)
        return math.log1p(-q), float(self._loss(np.array([hi]))[0])

    def cdf(self, t: FloatArray) -> FloatArray:
        return self.cdf_sf(t)[0]

    def cdf_sf(self, t: FloatArray) -> tuple[FloatArray, FloatArray]:
        # Two ndtr calls per point: Φ(−|z|) is accurate in both tails; the cdf is exact where
        # x < 0 and the survival function where x > 1, the regions where each is used.
        q, s = self.sampling_probability, self.noise_multiplier
        x = self._x_of_t(t)
        z0, z1 = x / s, (x - 1) / s
        u, v = ndtr(-np.abs(z0)), ndtr(-np.abs(z1))
        phi0 = np.where(z0 < 0, u, 1.0 - u)  # Φ(z0)
        phi1 = np.where(z1 < 0, v, 1.0 - v)  # Φ(z1)
        sf0 = np.where(z0 < 0, 1.0 - u, u)  # Φ(−z0)
        sf1 = np.where(z1 < 0, 1.0 - v, v)  # Φ(−z1)
        return (1 - q) * phi0 + q * phi1, (1 - q) * sf0 + q * sf1

    def cell_probabilities(self, edges: FloatArray) -> tuple[FloatArray, float]:
        # With z0 = x/σ and z1 = (x − 1)/σ < z0, A = (1−q)Φ(−|z0|) + qΦ(−|z1|) is the cdf where
        # z0 < 0 and the survival function where z1 ≥ 0 (both exact there, no cancellation);
        # the few edges in between (0 ≤ x < 1) get the cdf directly. Edges are increasing.
        q, s = self.sampling_probability, self.noise_multiplier
        x = self._x_of_t(edges)
        z0 = x / s
        z1 = z0 - 1.0 / s
        u = ndtr(-np.abs(z0))
        v = ndtr(-np.abs(z1))
        a = (1 - q) * u + q * v
        left = int(np.searchsorted(z0, 0.0, side="left"))  # z0 < 0 on edges[:left]
        right = int(np.searchsorted(z1, 0.0, side="left"))  # z1 ≥ 0 on edges[right:]
        cdf = np.empty_like(a)
        cdf[:left] = a[:left]
        cdf[right:] = 1.0 - a[right:]
        cdf[left:right] = (1 - q) * (1.0 - u[left:right]) + q * v[left:right]
        probabilities = np.diff(cdf)
        # Cells whose both edges are in the right region: survival differences, exact.
        if right < a.size:
            probabilities[right:] = a[right:-1] - a[right + 1 :]
        below = float(a[0]) if left > 0 else float(cdf[0])
        above = float(a[-1]) if right < a.size else float(1.0 - cdf[-1])
        return probabilities, below + above

    def _density(self, x: FloatArray) -> FloatArray:
        q, s = self.sampling_probability, self.noise_multiplier
        c = 1.0 / (s * math.sqrt(2 * math.pi))
        result: FloatArray = c * (
            (1 - q) * np.exp(-0.5 * (x / s) ** 2) + q * np.exp(-0.5 * ((x - 1) / s) ** 2)
        )
        return result

    def truncated_mean(self, lo: float, hi: float) -> tuple[float, float]:
        # E[ℓ(X) | ℓ(X) ≤ hi] by composite Gauss–Legendre in x (panels of width σ/2) over the two
        # windows that carry the mass, ±(z + 2)σ around 0 and around 1 (one interval when they
        # overlap). The lower truncation is inactive because lo lies below the support start
        # log(1 − q). A small σ leaves a wide gap between the windows: integrating across it
        # cost 2/σ panels (σ = 1e-6: 4·10⁶ panels, ~10 s) for mass < 2Φ(−z − 2) < 1e-30.
        q, s = self.sampling_probability, self.noise_multiplier
        if lo > math.log1p(-q):
            raise _PrvFailure("the domain does not contain the subsampled-Gaussian support")
        reach = (_Z_TAIL + 2.0) * s
        x_lo = -reach
        x_hi = min(float(self._x_of_t(np.array([hi]))[0]), 1.0 + reach)
        if x_hi <= x_lo:
            raise _PrvFailure("the domain cuts off the subsampled-Gaussian mass")
        if reach < 0.5 - reach:  # separated windows: [x_lo, reach] and [1 − reach, x_hi]
            intervals = [(x_lo, min(reach, x_hi))]
            if x_hi > 1.0 - reach:
                intervals.append((1.0 - reach, x_hi))
            # |ℓ| in the gap is at most its value at the gap's ends (ℓ is increasing).
            gap_loss = float(np.max(np.abs(self._loss(np.array([reach, min(x_hi, 1.0 - reach)])))))
        else:
            intervals, gap_loss = [(x_lo, x_hi)], 0.0
        edges_parts = [
            np.linspace(a, b, max(8, math.ceil((b - a) / (s / 2))) + 1) for a, b in intervals if b > a
        ]
        mid = np.concatenate([(e[1:] + e[:-1]) / 2 for e in edges_parts])
        half = np.concatenate([(e[1:] - e[:-1]) / 2 for e in edges_parts])

        def integrate(rule: tuple[FloatArray, FloatArray]) -> float:
            nodes, weights = rule
            x = mid[:, None] + half[:, None] * nodes[None, :]
            values = self._loss(x) * self._density(x) * weights[None, :] * half[:, None]
            return math.fsum(values.ravel().tolist())

        fine, coarse = integrate(_GL16), integrate(_GL8)
        mass = float((1 - q) * ndtr(x_hi / s) + q * ndtr((x_hi - 1) / s))
        # Mass below x_lo and in the gap (each < 1e-30) times a bound on |ℓ| there is added to
        # the error estimate (the mass term of the gap is left out of ``mass`` too: the
        # quadrature's total is over the windows, so the quotient is an estimate of the mean
        # within the windows, and the gap's share is what the added term bounds).
        error = (abs(fine - coarse) + 1e-16 * abs(fine)) / mass
        error += _WINDOW_TAIL * (1 - math.log1p(-q))
        error += 2 * _WINDOW_TAIL * gap_loss / mass
        return fine / mass, error

    def sizing_rdp(self, orders: FloatArray) -> FloatArray:
        from accountant.rdp import compute_rdp

        event = PoissonSampledEvent(
            sampling_probability=self.sampling_probability,
            event=GaussianEvent(noise_multiplier=self.noise_multiplier),
        )
        return np.asarray(compute_rdp(event, [float(a) for a in orders]), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class _LaplacePrv(_Prv):
    """Laplace mechanism, sensitivity 1, scale b; μ = 1/b. prv-accountant's ``LaplaceMechanism``."""

    scale: float

    @property
    def _mu(self) -> float:
        return 1.0 / self.scale

    def window(self, z_tail: float) -> tuple[float, float]:
        return -self._mu, self._mu

    def cdf(self, t: FloatArray) -> FloatArray:
        return np.asarray(LaplaceMechanism(self._mu).cdf(t), dtype=np.float64)

    def truncated_mean(self, lo: float, hi: float) -> tuple[float, float]:
        mu = self._mu
        if lo >= -mu or hi < mu:
            raise _PrvFailure("the domain cuts off the Laplace PRV's atoms")
        # KL(Lap(0,1/μ) ‖ Lap(1,1/μ)) = μ − 1 + e^{−μ}.
        return mu + math.expm1(-mu), 1e-16 * mu

    def sizing_rdp(self, orders: FloatArray) -> FloatArray:
        # Mironov 2017, Prop. 6 (Laplace RDP), in log space.
        mu = self._mu
        a = orders
        terms = np.logaddexp(np.log(a / (2 * a - 1)) + (a - 1) * mu, np.log((a - 1) / (2 * a - 1)) - a * mu)
        result: FloatArray = terms / (a - 1)
        return result


@dataclass(frozen=True, slots=True)
class _PureDpPrv(_Prv):
    """ε-DP (with mass δ at +∞ for (ε, δ)-DP): the randomized-response dominating pair.

    Y = +ε w.p. e^ε/(1+e^ε), −ε w.p. 1/(1+e^ε) (given finite); prv-accountant's
    ``PureDPMechanism`` / ``ApproximateDPMechanism``.
    """

    epsilon: float
    delta: float = 0.0

    @property
    def pm_inf(self) -> float:
        return self.delta

    def window(self, z_tail: float) -> tuple[float, float]:
        return -self.epsilon, self.epsilon

    def cdf(self, t: FloatArray) -> FloatArray:
        return np.asarray(PureDPMechanism(self.epsilon).cdf(t), dtype=np.float64)

    def truncated_mean(self, lo: float, hi: float) -> tuple[float, float]:
        eps = self.epsilon
        if lo >= -eps or hi < eps:
            raise _PrvFailure("the domain cuts off the pure-DP PRV's atoms")
        return eps * math.tanh(eps / 2), 1e-16 * eps

    def sizing_rdp(self, orders: FloatArray) -> FloatArray:
        # Exact RDP of randomized response (the dominating pair of ε-DP):
        # D_α = log(p^α q^{1−α} + q^α p^{1−α})/(α − 1), p = e^ε/(1+e^ε), q = 1 − p.
        eps, a = self.epsilon, orders
        log_p, log_q = -np.logaddexp(0.0, -eps), -np.logaddexp(0.0, eps)
        terms = np.logaddexp(a * log_p + (1 - a) * log_q, a * log_q + (1 - a) * log_p)
        result: FloatArray = terms / (a - 1)
        return result


# ---------------------------------------------------------------------------------------------
# Events → PRVs (the one dispatcher behind supports, compose and the fallback decision)
# ---------------------------------------------------------------------------------------------


class _NoPrv(Exception):
    """This event has no PRV here; the RDP fallback may still account it."""

    def __init__(self, event: DpEvent, reason: str) -> None:
        super().__init__(reason)
        self.event = event
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Plan:
    components: dict[_Prv, int]
    non_private: bool = False


def _merge(into: dict[_Prv, int], other: dict[_Prv, int], times: int) -> None:
    for prv, count in other.items():
        into[prv] = into.get(prv, 0) + count * times


def _plan(event: DpEvent) -> _Plan:
    """The PRVs (with counts) of ``event``; raises ``_NoPrv`` for an event with no PRV here."""
    if isinstance(event, NoOpEvent):
        return _Plan({})
    if isinstance(event, NonPrivateEvent):
        return _Plan({}, non_private=True)
    if isinstance(event, GaussianEvent | AdaptiveGaussianEvent):
        # AdaDp Lemma 1: per-coordinate noise satisfying Σ sᵢ²/σᵢ² ≤ 1/σ*² is a Gaussian with σ*.
        return _Plan({_GaussianPrv(event.noise_multiplier): 1})
    if isinstance(event, LaplaceEvent):
        return _Plan({_LaplacePrv(event.scale): 1})
    if isinstance(event, PureDpEvent):
        return _Plan({_PureDpPrv(event.epsilon): 1} if event.epsilon > 0 else {})
    if isinstance(event, ApproxDpEvent):
        if event.epsilon == 0 and event.delta == 0:
            return _Plan({})
        return _Plan({_PureDpPrv(event.epsilon, event.delta): 1})
    if isinstance(event, FunctionalMechanismL2DPEvent):
        return _Plan({_PureDpPrv(l2dp_ml_event_epsilon(event)): 1})
    if isinstance(event, OutputPerturbationEvent):
        return _Plan({_PureDpPrv(output_perturbation_event_epsilon(event)): 1})
    if isinstance(event, PoissonSampledEvent):
        inner = event.event
        if isinstance(inner, GaussianEvent | AdaptiveGaussianEvent):
            q = event.sampling_probability
            if q == 1.0:
                return _Plan({_GaussianPrv(inner.noise_multiplier): 1})
            return _Plan({_SubsampledGaussianPrv(q, inner.noise_multiplier): 1})
        _plan(inner)  # an unsupported inner event is the innermost reason
        raise _NoPrv(event, f"no PRV for Poisson sampling of a {inner.kind!r} event")
    if isinstance(event, SelfComposedEvent):
        child = _plan(event.event)
        if event.count == 0:
            return _Plan({})
        out: dict[_Prv, int] = {}
        _merge(out, child.components, event.count)
        return _Plan(out, child.non_private)
    if isinstance(event, ComposedEvent):
        out = {}
        non_private = False
        for child_event in event.events:
            child = _plan(child_event)
            _merge(out, child.components, 1)
            non_private = non_private or child.non_private
        return _Plan(out, non_private)
    for child_event in event.children():
        _plan(child_event)
    raise _NoPrv(event, f"no PRV for a {event.kind!r} event")


# ---------------------------------------------------------------------------------------------
# Discretisation and composition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Composed:
    """A composed discrete PRV on the grid t_min + shift + j·h, with its error budget."""

    pmf: FloatArray
    t_min: float
    h: float
    log_pmc_inf: float  # log P(all components finite)
    extra_delta: float  # truncation + FFT round-off, subtracted from δ
    extra_epsilon: float  # mean-quadrature error × count, added to ε
    eps_error: float
    delta_error: float
    grid_size: int
    note: str


def _sizing_epsilon(rdp: FloatArray, orders: FloatArray, delta: float) -> float:
    """ε from an RDP curve (improved conversion, Balle et al. 2020 Thm. 21), for sizing only."""
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log1p(-1 / orders)
    eps = eps[np.isfinite(eps)]
    if eps.size == 0:
        raise _PrvFailure("no finite RDP tail bound to size the PRV domain")
    return max(0.0, float(eps.min()))


def _domain_half_width(
    components: dict[_Prv, int], total: int, eps_error: float, delta_error: float
) -> float:
    """L of Remark 5.6 (Gopi et al. 2021), from RDP tail bounds (as prv-accountant computes it)."""
    orders = np.array(_SIZING_ORDERS, dtype=np.float64)
    curves = {prv: prv.sizing_rdp(orders) for prv in components}
    all_rdp = np.zeros_like(orders)
    for prv, count in components.items():
        all_rdp = all_rdp + count * curves[prv]
    half_width = _sizing_epsilon(all_rdp, orders, delta_error / 4)
    for prv in components:
        half_width = max(half_width, _sizing_epsilon(curves[prv], orders, delta_error / 8 / total))
    return max(half_width, eps_error) + 3.0


def _discretise(
    prv: _Prv, t_min: float, h: float, n: int, z_tail: float
) -> tuple[int, FloatArray, float, float, float]:
    """Cell-centred, mean-preserving discretisation (Gopi et al. 2021, Alg. 1) on a window.

    Returns (first cell index, probabilities, mean shift, dropped mass, mean error).
    """
    lo, hi = prv.window(z_tail)
    # One extra cell on each side keeps atoms (Laplace, pure DP) strictly inside the window.
    lo = max(lo - h, t_min - h / 2)
    hi = min(hi + h, t_min + (n - 0.5) * h)
    j_lo = max(0, math.floor((lo - t_min) / h + 0.5))
    j_hi = min(n - 1, math.floor((hi - t_min) / h + 0.5))
    if j_hi < j_lo:
        raise _PrvFailure("a PRV lies outside the domain")
    offsets = np.arange(j_hi - j_lo + 2, dtype=np.float64)
    edges = offsets * h
    edges += t_min + (j_lo - 0.5) * h
    probabilities, dropped = prv.cell_probabilities(edges)
    np.maximum(probabilities, 0.0, out=probabilities)
    mass = float(probabilities.sum())
    if not mass > 0:
        raise _PrvFailure("a PRV has no mass on the domain")
    probabilities /= mass
    # Σ tⱼpⱼ with tⱼ = t_min + (j_lo + k)·h.
    mean_discrete = t_min + h * (j_lo + float(np.dot(offsets[:-1], probabilities)))
    mean_continuous, mean_error = prv.truncated_mean(float(edges[0]), float(edges[-1]))
    shift = mean_continuous - mean_discrete
    if not abs(shift) < h / 2:
        # prv-accountant's "Discrete mean differs from continuous mean significantly."
        raise _PrvFailure("the discrete mean differs from the continuous mean (mesh too coarse)")
    return j_lo, probabilities, shift, dropped, mean_error


def _fast_length(size: int) -> int:
    """The smallest even length ≥ ``size`` of the form 2ᵃ·m, m ∈ {1, 3, 5, 15, 25, 125}.

    pocketfft is several times faster on these than on lengths with large powers of 3 or 5
    (``scipy.fft.next_fast_len`` may return e.g. 2·3⁴·5⁵, measured 3× slower than 2¹²·5³).
    """
    best = 1 << max(1, (size - 1).bit_length())
    for m in (3, 5, 15, 25, 125):
        a = max(1, math.ceil(math.log2(size / m)))
        while m << a < size:
            a += 1
        best = min(best, m << a)
    return best


def _untouched_bound(components: dict[_Prv, int]) -> float | None:
    """1 − Π(1 − qᵢ)^{nᵢ} (rounded up) when every component is Poisson-subsampled, else ``None``.

    Coupling (privacy amplification by subsampling, Balle, Barthe & Gaboardi 2018, Thm. 8 with a
    base mechanism that is (∞, 1)-DP; Li, Qardaji & Su 2012): with probability
    p₀ = Π(1 − qᵢ)^{nᵢ} no step samples the record, and then the output is distributed exactly
    as without it, so P = p₀·Q + (1 − p₀)·R and |P(S) − Q(S)| ≤ 1 − p₀ for every S. The
    composition is (0, 1 − p₀)-DP (both directions of add/remove adjacency), whatever σ is:
    δ(ε) ≤ 1 − p₀ for every ε ≥ 0. A tiny q with a tiny σ is such a case: the PRV is then
    almost all an atom near 0 plus a far, negligible spike, which a grid resolves badly.
    The same bound as the ``rdp`` accountant's (``accountant.rdp.untouched_delta``).
    """
    if not components or not all(isinstance(p, _SubsampledGaussianPrv) for p in components):
        return None
    log_untouched = math.fsum(
        n * math.log1p(-p.sampling_probability)
        for p, n in components.items()
        if isinstance(p, _SubsampledGaussianPrv)
    )
    return untouched_delta(log_untouched)


def _merge_gaussians(components: dict[_Prv, int]) -> dict[_Prv, int]:
    """Replace all Gaussian PRVs by one: N(μᵢ²/2, μᵢ²) summed nᵢ times is N(μ²/2, μ²), μ² = Σnᵢμᵢ².

    Exact (sums of independent normals), and it lowers the composition count N that sets the
    mesh. The merged σ = (Σ nᵢ/σᵢ²)^(−1/2) is rounded down a few ulps (less noise is the safe side).
    """
    gaussians = {prv: n for prv, n in components.items() if isinstance(prv, _GaussianPrv)}
    if len(gaussians) + sum(gaussians.values()) <= 2:
        return components
    precisions = []
    for prv, n in gaussians.items():
        variance = prv.noise_multiplier * prv.noise_multiplier  # σ·σ: σ < 1.5e-154 underflows
        with np.errstate(over="ignore", divide="ignore"):
            precision_i = float(np.float64(n) / np.float64(variance))  # n/0 = ∞, not an exception
        precisions.append(precision_i)
    precision = math.inf if any(math.isinf(p) for p in precisions) else math.fsum(precisions)
    if not math.isfinite(precision):
        # Σ n/σ² beyond the float range: μ = 1/σ > 1e154, ε(δ) ≈ μ²/2 > 1e307 — no grid holds
        # that PRV. The RDP fallback answers (ε = ∞ where α/(2σ²) overflows; a valid bound).
        raise _PrvFailure(
            "a Gaussian noise_multiplier is so small that 1/sigma^2 overflows (the mechanism is "
            "not private in floating point)"
        )
    if not precision > 0:  # every σ so large that 1/σ² underflows: let RDP bound it instead
        raise _PrvFailure("the Gaussian noise is too large to discretise (1/sigma^2 underflows)")
    sigma = 1.0 / math.sqrt(precision)
    for _ in range(4):
        sigma = math.nextafter(sigma, 0.0)
    merged: dict[_Prv, int] = {prv: n for prv, n in components.items() if prv not in gaussians}
    merged[_GaussianPrv(sigma)] = 1
    return merged


def _compose(
    components: dict[_Prv, int], eps_error: float, delta_error: float, work_cap: int = MAX_WORK
) -> _Composed:
    """Discretise and compose ``components`` (Gopi et al. 2021, Alg. 1 and Thm. 5.5).

    Raises ``_PrvFailure`` when the grid or the work (distinct PRVs × grid points) would exceed
    its cap (``work_cap``), or when ``delta_error`` is too small for the mesh formula.
    """
    # A subnormal δ (5e-324) gives δ/1000 = 0 and log(12/δ_err) = ∞: no mesh can be sized.
    if not 0 < delta_error < 1 or not math.isfinite(12 / delta_error):
        raise _PrvFailure(f"delta_error = {delta_error!r} is too small to size the PRV mesh")
    components = _merge_gaussians(components)
    total = sum(components.values())
    log_term = total / 2 * math.log(12 / delta_error)
    half_width = _domain_half_width(components, total, eps_error, delta_error)
    if half_width > MAX_HALF_WIDTH:
        # A privacy loss spread this wide means an ε above 10⁵: a 4M-point grid could
        # not resolve it to the requested precision, and RDP bounds it at once.
        raise _PrvFailure(
            f"the privacy loss spans ±{half_width:.3g}, beyond the grid's ±{MAX_HALF_WIDTH:g} "
            "(an epsilon above 10^5)"
        )
    note = ""

    def grid_points(err: float) -> int:
        return math.ceil(2 * half_width / (err / math.sqrt(log_term))) + 2

    if grid_points(eps_error) > MAX_GRID:
        raised = eps_error * grid_points(eps_error) / MAX_GRID * 1.01
        cap = max(MAX_EPS_ERROR, MAX_RELATIVE_EPS_ERROR * half_width)
        if raised > cap:
            raise _PrvFailure(
                f"{total} compositions on a domain of half-width {half_width:.3g} need more than "
                f"{MAX_GRID} grid points even at eps_error = {cap:.3g}"
            )
        note = f"eps_error raised from {eps_error:g} to {raised:.3g} to fit a {MAX_GRID}-point grid"
        eps_error = raised
    h = eps_error / math.sqrt(log_term)
    if len(components) * grid_points(eps_error) > work_cap:
        raise _PrvFailure(f"{len(components)} distinct PRVs on a large grid exceed the work cap")
    aligned = Domain.create_aligned(-half_width, half_width, h)
    t_min, h = float(aligned.t_min()), float(aligned.dt())
    n = _fast_length(len(aligned))
    k0 = round(t_min / h)
    # Window cut: at most 1e-4·δ_err of mass in all dropped tails together (paid for in δ).
    z_tail = float(-ndtri(min(_WINDOW_TAIL_MAX, 1e-4 * delta_error / total)))

    # Π Fᵢ^{nᵢ} = Π_n (Π_{i: nᵢ = n} Fᵢ)^n: one power per distinct count, not per PRV. The
    # FFTs run in batches of rows (pocketfft is faster on a batch than on one row at a time).
    by_count: dict[int, npt.NDArray[np.complex128]] = {}
    shift_total = 0.0
    dropped_total = 0.0
    mean_error_total = 0.0
    log_pmc_inf = 0.0
    items = list(components.items())
    rows = max(1, min(len(items), _FFT_BATCH_VALUES // n))
    batch = np.zeros((rows, n), dtype=np.float64)
    for first in range(0, len(items), rows):
        chunk = items[first : first + rows]
        windows = []
        for row, (prv, count) in enumerate(chunk):
            j_lo, probabilities, shift, dropped, mean_error = _discretise(prv, t_min, h, n, z_tail)
            batch[row, j_lo : j_lo + probabilities.size] = probabilities
            windows.append((j_lo, probabilities.size))
            shift_total += count * shift
            dropped_total += count * dropped
            mean_error_total += count * mean_error
            if prv.pm_inf > 0:
                log_pmc_inf += count * math.log1p(-prv.pm_inf)
        factors = scipy.fft.rfft(batch[: len(chunk)], axis=-1, workers=_FFT_WORKERS)
        for row, ((_, count), (j_lo, size)) in enumerate(zip(chunk, windows, strict=True)):
            batch[row, j_lo : j_lo + size] = 0.0
            group = by_count.get(count)
            if group is None:
                by_count[count] = factors[row].copy()
            else:
                group *= factors[row]
    spectrum: npt.NDArray[np.complex128] | None = None
    for count, group in by_count.items():
        if count > 1:
            np.power(group, count, out=group)
        if spectrum is None:
            spectrum = group
        else:
            spectrum *= group
    assert spectrum is not None
    pmf = scipy.fft.irfft(spectrum, n)
    # Sum of `total` variables on grids starting at t_min: index J = Σj, value total·t_min + J·h;
    # the output grid starts at t_min, so out[j] = raw[j − (total−1)·k0] (circular).
    pmf = np.roll(pmf, ((total - 1) * k0) % n)
    negative = float(-pmf.min()) if pmf.min() < 0 else 0.0
    noise = max(negative, np.finfo(np.float64).eps * float(pmf.max()) * 1e-3)
    pmf = np.maximum(pmf, 0.0)
    round_off = 4.0 * n * noise
    return _Composed(
        pmf=pmf,
        t_min=t_min + shift_total,
        h=h,
        log_pmc_inf=log_pmc_inf,
        extra_delta=dropped_total + round_off,
        extra_epsilon=mean_error_total,
        eps_error=eps_error,
        delta_error=delta_error,
        grid_size=n,
        note=note,
    )


def _tail_sums(
    composed: _Composed, start: int
) -> tuple[npt.NDArray[np.longdouble], npt.NDArray[np.longdouble]]:
    """d1[i] = Σ_{j≥i} pⱼ and d2[i] = Σ_{j≥i} pⱼ·e^{tᵢ−tⱼ} for i ≥ ``start``, in long double.

    prv-accountant computes Σ pⱼe^{−tⱼ} and multiplies by e^{tᵢ}, which overflows for |t| beyond
    ~11000 (large ε); the relative form is the recurrence d2[i] = pᵢ + e^{−h}·d2[i+1] (a stable
    first-order filter, every term ≤ 1). Tail sums need only the grid above ``start``.
    """
    p = composed.pmf[start:].astype(np.longdouble)
    d1 = np.flip(np.cumsum(np.flip(p)))
    decay = np.exp(-np.longdouble(composed.h))
    d2 = np.flip(lfilter([np.longdouble(1)], [np.longdouble(1), -decay], np.flip(p)))
    return d1, d2


def _epsilon_bounds(composed: _Composed, delta: float) -> tuple[float, float, float]:
    """(lower, estimate, upper) of ε(δ) from a composed discrete PRV (Gopi et al. Thm. 5.5)."""
    delta_inf = -math.expm1(composed.log_pmc_inf)
    delta_fin = (delta - delta_inf) / (1 - delta_inf)
    slack = composed.delta_error + composed.extra_delta
    if delta_fin - slack <= 0:
        if delta_fin <= 0:
            return math.inf, math.inf, math.inf
        raise _PrvFailure(
            f"delta = {delta:g} is too small for the PRV error budget (delta_error "
            f"{composed.delta_error:.3g} + truncation and round-off {composed.extra_delta:.3g})"
        )
    if np.finfo(np.longdouble).eps * composed.pmf.size > delta_fin - slack:
        raise _PrvFailure("floating-point errors dominate for such a small delta")
    # Only ε ≥ 0 matters: start at the last grid point ≤ 0 (δ there ≥ δ(0)).
    start = max(0, min(composed.pmf.size - 1, math.floor(-composed.t_min / composed.h)))
    d1, d2 = _tail_sums(composed, start)
    ndelta = d2 - d1  # −δ(tᵢ) on the grid from ``start``, non-decreasing

    def find(target: float) -> float:
        # For ε ∈ [t_{i−1}, tᵢ]: δ(ε) = d1[i] − e^{ε−tᵢ}·d2[i].
        i = int(np.searchsorted(ndelta, -target, side="left"))
        if i <= 0:
            return 0.0  # δ(t_start) ≤ target with t_start ≤ 0: ε = 0 already suffices
        if i >= ndelta.size:
            raise _PrvFailure("epsilon lies beyond the PRV domain")
        t_i = composed.t_min + (start + i) * composed.h
        return float(t_i + np.log((d1[i] - np.longdouble(target)) / d2[i]))

    upper = find(delta_fin - slack) + composed.eps_error + composed.extra_epsilon
    estimate = find(delta_fin)
    lower = find(min(delta_fin + slack, 1.0)) - composed.eps_error - composed.extra_epsilon
    upper = max(upper, 0.0)
    estimate = min(max(estimate, 0.0), upper)
    lower = min(max(lower, 0.0), estimate)
    return lower, estimate, upper


def _delta_upper(composed: _Composed, epsilon: float) -> float:
    """An upper bound on δ(ε): δ_disc(ε − ε_err) + δ_err + truncation/round-off."""
    t = composed.t_min + np.arange(composed.pmf.size, dtype=np.float64) * composed.h
    shifted = epsilon - composed.eps_error - composed.extra_epsilon
    mask = t >= shifted
    delta_fin = float(
        np.sum(composed.pmf[mask] * -np.expm1(shifted - t[mask]))
        + composed.delta_error
        + composed.extra_delta
    )
    delta_inf = -math.expm1(composed.log_pmc_inf)
    return min(1.0, delta_inf + (1 - delta_inf) * delta_fin)


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------


class PrvAccountant(PrivacyAccountant):
    """PRV composition (Gopi, Lee & Wutschitz 2021) with an RDP fallback; see the module docstring.

    ``eps_error`` (default 0.01: the largest absolute mesh error), ``relative_eps_error``
    (default 0.03: a finer mesh is re-run until the mesh error is at most this fraction of the ε
    found, down to ``MIN_EPS_ERROR`` and within ``REFINE_WORK``; ``None`` keeps the absolute
    ``eps_error`` only) and ``delta_error`` (default ``None``: δ/1000 for ``get_epsilon(δ)``; for
    ``get_delta(ε)``, 1/1000 of the RDP δ or 1e-12) set the discretisation.
    """

    name = NAME

    def __init__(
        self,
        eps_error: float = DEFAULT_EPS_ERROR,
        delta_error: float | None = None,
        relative_eps_error: float | None = DEFAULT_RELATIVE_EPS_ERROR,
    ) -> None:
        if isinstance(eps_error, bool) or not isinstance(eps_error, int | float):
            raise InvalidArgumentError("eps_error", f"must be a number in (0, 1]. Found {eps_error!r}.")
        if not math.isfinite(eps_error) or not 0 < eps_error <= 1:
            raise InvalidArgumentError("eps_error", f"must be in (0, 1]. Found {eps_error!r}.")
        if relative_eps_error is not None and (
            isinstance(relative_eps_error, bool)
            or not isinstance(relative_eps_error, int | float)
            or not math.isfinite(relative_eps_error)
            or not 0 < relative_eps_error <= 1
        ):
            raise InvalidArgumentError(
                "relative_eps_error", f"must be None or a number in (0, 1]. Found {relative_eps_error!r}."
            )
        if delta_error is not None:
            if isinstance(delta_error, bool) or not isinstance(delta_error, int | float):
                raise InvalidArgumentError(
                    "delta_error", f"must be a number in (0, 1). Found {delta_error!r}."
                )
            if not math.isfinite(delta_error) or not 0 < delta_error < 1:
                raise InvalidArgumentError("delta_error", f"must be in (0, 1). Found {delta_error!r}.")
        self.eps_error = float(eps_error)
        self.relative_eps_error = None if relative_eps_error is None else float(relative_eps_error)
        self.delta_error = None if delta_error is None else float(delta_error)
        self._events: dict[DpEvent, int] = {}
        self._components: dict[_Prv, int] = {}
        self._non_private = False
        self._no_prv: _NoPrv | None = None
        self._cache: dict[tuple[object, ...], object] = {}

    # -- the dispatcher --------------------------------------------------------------------

    def _dispatch(self, event: DpEvent) -> tuple[_Plan | None, _NoPrv | None]:
        """PRVs of ``event``, or why there are none; raises if RDP cannot account it either."""
        try:
            return _plan(event), None
        except _NoPrv as no_prv:
            rdp = RdpAccountant()
            try:
                rdp.compose(event)
            except UnsupportedEventError as exc:
                raise UnsupportedEventError(NAME, exc.event, exc.reason) from exc
            return None, no_prv

    def supports(self, event: DpEvent) -> bool:
        try:
            self._dispatch(event)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: DpEvent, count: int = 1) -> PrvAccountant:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            raise InvalidArgumentError("count", f"must be an integer in [0, 10^18]. Found {count!r}.")
        plan, no_prv = self._dispatch(event)
        if count == 0:
            return self
        self._events[event] = self._events.get(event, 0) + count
        if plan is not None:
            _merge(self._components, plan.components, count)
            self._non_private = self._non_private or plan.non_private
        elif self._no_prv is None:
            self._no_prv = no_prv
        self._cache.clear()
        return self

    # -- helpers -----------------------------------------------------------------------------

    def _fallback_accountant(self, name: str) -> PrivacyAccountant | None:
        accountant = _FALLBACKS[name]()
        try:
            for event, count in self._events.items():
                accountant.compose(event, count)
        except UnsupportedEventError:
            return None
        return accountant

    def _rdp_bound(self, delta: float) -> EpsilonBound | None:
        rdp = self._fallback_accountant("rdp")
        return None if rdp is None else rdp.get_epsilon(delta)

    def _fallback(self, delta: float, reason: str) -> EpsilonBound:
        """The RDP bound (basic composition where RDP does not apply, or first for δ = 0)."""
        method = FALLBACK_METHOD
        bound = None
        if delta == 0:
            basic = self._fallback_accountant("basic")
            if basic is not None:
                bound, method = basic.get_epsilon(delta), "basic-fallback"
                reason = f"{reason}; basic composition used"
        if bound is None:
            bound = self._rdp_bound(delta)
        if bound is None:
            basic = self._fallback_accountant("basic")
            if basic is None:
                note = f"{reason}; neither RDP nor basic composition applies: no finite bound"
                return EpsilonBound(math.inf, math.inf, math.inf, delta, method, note)
            bound, method = basic.get_epsilon(delta), "basic-fallback"
            reason = f"{reason}; RDP does not apply, basic composition used"
        return EpsilonBound(
            bound.lower, bound.estimate, bound.upper, delta, method, reason, dict(bound.details)
        )

    def _composed(
        self, delta_error: float, eps_error: float | None = None, work_cap: int = MAX_WORK
    ) -> _Composed:
        mesh_error = self.eps_error if eps_error is None else eps_error
        key = ("composed", delta_error, mesh_error, work_cap)
        cached = self._cache.get(key)
        if isinstance(cached, _Composed):
            return cached
        composed = _compose(self._components, mesh_error, delta_error, work_cap)
        self._cache[key] = composed
        return composed

    def _wanted_eps_error(self, epsilon: float) -> float | None:
        """The mesh error that relative precision asks for at ``epsilon`` (None: not asked)."""
        if self.relative_eps_error is None:
            return None
        return min(self.eps_error, max(MIN_EPS_ERROR, self.relative_eps_error * epsilon))

    def _refined(
        self, composed: _Composed, delta: float, bounds: tuple[float, float, float]
    ) -> tuple[_Composed, tuple[float, float, float], str]:
        """Re-run on finer meshes until eps_error ≤ relative_eps_error · ε (at most twice).

        Theorem 5.5's error is absolute: with eps_error = 0.01 an ε of 0.005 would be certified
        as 0.016. Every mesh gives valid bounds (the theorem holds for each), so the tighter of
        each pair is kept: the largest lower, the smallest upper. A re-run that fails or would
        exceed ``REFINE_WORK`` leaves the last valid bounds and says so in the note.
        """
        lower, estimate, upper = bounds
        for _ in range(_REFINEMENTS):
            wanted = self._wanted_eps_error(estimate)
            if wanted is None or composed.eps_error <= wanted:
                return composed, (lower, estimate, upper), ""
            try:
                # 10% below the target: the finer estimate is usually a little smaller.
                finer = self._composed(composed.delta_error, max(MIN_EPS_ERROR, 0.9 * wanted), REFINE_WORK)
                finer_bounds = _epsilon_bounds(finer, delta)
            except (_PrvFailure, AccountantError, *_NUMERIC_ERRORS) as exc:
                note = (
                    f"relative precision not reached: eps_error {composed.eps_error:.3g} > "
                    f"{self.relative_eps_error:g} x epsilon ({exc})"
                )
                return composed, (lower, estimate, upper), note
            if finer.eps_error >= composed.eps_error:  # the grid cap allows no finer mesh
                break
            lower = max(lower, finer_bounds[0])
            upper = min(upper, finer_bounds[2])
            estimate = min(max(finer_bounds[1], lower), upper)
            composed = finer
        wanted = self._wanted_eps_error(estimate)
        if wanted is not None and composed.eps_error > wanted * (1 + 1e-9):
            note = (
                f"relative precision not reached: eps_error {composed.eps_error:.3g} > "
                f"{self.relative_eps_error:g} x epsilon"
            )
            return composed, (lower, estimate, upper), note
        return composed, (lower, estimate, upper), ""

    # -- queries -----------------------------------------------------------------------------

    def get_epsilon(self, delta: float) -> EpsilonBound:
        check_delta(delta)
        key = ("epsilon", delta)
        cached = self._cache.get(key)
        if isinstance(cached, EpsilonBound):
            return cached
        bound = self._get_epsilon(delta)
        self._cache[key] = bound
        return bound

    def _get_epsilon(self, delta: float) -> EpsilonBound:
        if self._non_private:
            return EpsilonBound(math.inf, math.inf, math.inf, delta, NAME, "a non-private event")
        if self._no_prv is not None:
            return self._fallback(delta, f"{self._no_prv.reason} (event kind {self._no_prv.event.kind!r})")
        if not self._components:
            return EpsilonBound.exact(0.0, delta, NAME)
        if delta == 0:
            return self._fallback(delta, "PRV bounds need delta > 0")
        untouched = _untouched_bound(self._components)
        if untouched is not None and delta >= untouched:
            note = (
                f"no step samples the record with probability 1 - {untouched:.3g}, so the "
                f"composition is (0, {untouched:.3g})-DP (subsampling by coupling) and "
                f"delta = {delta:g} covers it: epsilon = 0"
            )
            return EpsilonBound(0.0, 0.0, 0.0, delta, NAME, note, {"untouched_delta": untouched})
        delta_error = self.delta_error if self.delta_error is not None else delta * DEFAULT_DELTA_ERROR_RATIO
        try:
            composed = self._composed(delta_error)
            lower, estimate, upper = _epsilon_bounds(composed, delta)
        except _PrvFailure as exc:
            return self._fallback(delta, f"PRV composition failed: {exc}")
        except _NUMERIC_ERRORS as exc:
            return self._fallback(delta, f"PRV composition failed: {type(exc).__name__}: {exc}")
        except AccountantError as exc:
            return self._fallback(delta, f"PRV domain sizing failed: {exc}")
        composed, (lower, estimate, upper), precision_note = self._refined(
            composed, delta, (lower, estimate, upper)
        )
        details = {
            "prv_upper": upper,
            "eps_error": composed.eps_error,
            "delta_error": composed.delta_error,
            "grid_size": float(composed.grid_size),
        }
        notes = [n for n in (composed.note, precision_note) if n]
        rdp = self._rdp_bound(delta)
        if rdp is not None:
            details["rdp_epsilon"] = rdp.upper
            if rdp.upper < upper:
                upper = rdp.upper
                notes.append("upper is the RDP bound, tighter than the PRV upper bound here")
                estimate = min(estimate, upper)
                lower = min(lower, estimate)
        return EpsilonBound(lower, estimate, upper, delta, NAME, "; ".join(notes), details)

    def get_delta(self, epsilon: float) -> float:
        check_epsilon(epsilon)
        if epsilon == math.inf:
            return 0.0
        if self._non_private:
            return 1.0
        rdp = self._fallback_accountant("rdp")
        rdp_delta = None if rdp is None else min(1.0, rdp.get_delta(epsilon))
        if self._no_prv is not None:
            if rdp_delta is not None:
                return rdp_delta
            basic = self._fallback_accountant("basic")
            return 1.0 if basic is None else basic.get_delta(epsilon)
        if not self._components:
            return 0.0
        try:
            if self.delta_error is not None:
                prv_delta = self._delta_upper(self.delta_error, epsilon)
            else:
                # δ_err = δ/1000 for the δ being computed: a first pass at 1/1000 of the RDP δ
                # (≥ the true δ) gives an upper estimate; a second pass refines when it is smaller.
                guess = rdp_delta if rdp_delta is not None and rdp_delta > 0 else 1e-9
                delta_error = min(1e-3, max(1e-18, guess * DEFAULT_DELTA_ERROR_RATIO))
                prv_delta = self._delta_upper(delta_error, epsilon)
                refined = max(1e-18, prv_delta * DEFAULT_DELTA_ERROR_RATIO)
                if refined < delta_error / 10:
                    prv_delta = min(prv_delta, self._delta_upper(refined, epsilon))
        except (_PrvFailure, AccountantError, *_NUMERIC_ERRORS):
            return 1.0 if rdp_delta is None else rdp_delta
        untouched = _untouched_bound(self._components)
        if untouched is not None:  # δ(ε) ≤ 1 − p₀ for every ε ≥ 0
            prv_delta = min(prv_delta, untouched)
        return prv_delta if rdp_delta is None else min(prv_delta, rdp_delta)

    def _delta_upper(self, delta_error: float, epsilon: float) -> float:
        """δ(ε) upper bound at ``delta_error``; on a mesh finer than ``eps_error`` when relative
        precision asks for it at this ε (the ε shift of Thm. 5.5 is absolute too), and that
        re-run fits ``REFINE_WORK`` (otherwise the coarse, still valid, bound stands)."""
        composed = self._composed(delta_error)
        delta = _delta_upper(composed, epsilon)
        wanted = self._wanted_eps_error(epsilon)
        if wanted is not None and composed.eps_error > wanted:
            try:
                finer = self._composed(delta_error, wanted, REFINE_WORK)
                delta = min(delta, _delta_upper(finer, epsilon))
            except (_PrvFailure, AccountantError, *_NUMERIC_ERRORS):
                pass
        return delta


# ---------------------------------------------------------------------------------------------
# The tight ε of one non-adaptive composition (what a charge that needs no filter costs)
# ---------------------------------------------------------------------------------------------

TIGHT_RELATIVE_EPS_ERROR: Final = 0.01
"""The tight engine's PRV mesh error, relative to the ε found (``tight_epsilon``): PRV is the
engine for compositions of many distinct mechanisms, whose cost is one FFT per distinct
mechanism on a grid ∝ 1/mesh error (Thm. 5.5); 1% keeps 200 distinct entries near 2 s."""
_TIGHT_FIRST_MESH: Final = 0.008
"""First mesh error of the tight engine, relative to the RDP ε (≥ the true ε): the first grid
is sized for the ε (200 distinct entries: 5× fewer points than at an absolute 0.01) and is
usually fine enough to need no re-run."""
PLD_HOMOGENEOUS_STEPS: Final = 10**4
"""A composition of one mechanism repeated at least this often goes to the PLD first: PRV's mesh
shrinks as 1/√N (Thm. 5.5), dp-accounting's self-composition does not."""
PLD_MAX_DISTINCT: Final = 4
"""dp-accounting composes distinct PLDs one convolution at a time (200 distinct entries: minutes);
beyond this many distinct mechanisms engine 2 composes their PLDs in one pass
(``accountant.pld``) and engine 1 goes to PRV."""
TIGHT_ENGINES: Final = (1, 2)
"""Versions of ``tight_epsilon``: 1 — pricing version 4 (beyond ``PLD_MAX_DISTINCT`` distinct
mechanisms, PRV); 2 — pricing version 5 (there, the pessimistic PLDs of ``accountant.pld``, PRV
where they cannot answer). Certificates replay the engine of their pricing version."""
TIGHT_ENGINE: Final = 2
_PLD_RESOLUTION: Final = 500.0
_PLD_SMALL_EPSILON: Final = 200.0
_PLD_MAX_POINTS: Final = 2**24
_PLD_MAX_STEP_POINTS: Final = 2**16
"""The PLD's value grid is h ≤ min(√(ε/(500·N)), ε/200), rounded down to a power of √2: the
connect-the-dots error grows about as N·h² (the first term), and a small ε needs h well below ε
(the second); measured ≤ 0.2% of ε from 18 to 10⁶ steps (bench/charges.py)."""


def tight_epsilon(event: DpEvent, delta: float, *, engine: int = TIGHT_ENGINE) -> EpsilonBound:
    """The tightest valid ε of ``event`` run as ONE non-adaptive composition at ``delta``.

    Valid only where the sequence of mechanisms is fixed before any runs: a single charge, a
    declared plan, one geometric level's ε′. It is not a filter (docs/ACCOUNTING.md, "Which
    charges need no filter"). The engines, each an upper bound, the smallest kept:

    * a Gaussian-only composition (``gaussian``, ``adaptive_gaussian``, any counts): one Gaussian
      with σ = (Σ nᵢσᵢ⁻²)^(−1/2), whose exact ε is the analytic Gaussian (Balle & Wang 2018,
      Thm. 8; ``mechanisms.analytic_gaussian_epsilon``);
    * a long run of one mechanism (≥ ``PLD_HOMOGENEOUS_STEPS`` steps): dp-accounting's privacy
      loss distribution, pessimistic estimate with connect-the-dots discretisation (Doroshenko,
      Ghazi, Kamath, Kumar & Manurangsi 2022, Thm. 4.1: the discretised PLD dominates the true
      one, so its ε is an upper bound; tail mass beyond its truncation is counted at +∞, i.e. in
      δ), on a value grid h ≤ min(√(ε/(500·N)), ε/200);
    * more distinct mechanisms (``engine`` 2, pricing version 5): their pessimistic PLDs
      composed in one pass (``accountant.pld.composed_epsilon``: dp-accounting's connect-the-dots
      PLD of each, one FFT product, truncation and round-off paid in δ) on the same value grid;
    * otherwise PRV composition (``PrvAccountant``, Gopi et al. 2021, Thm. 5.5) with its mesh
      error at most ``TIGHT_RELATIVE_EPS_ERROR``·ε, and the PLD where PRV cannot reach that
      precision (a tiny ε: the mesh error has an absolute floor) or cannot compose at all (a
      grid too large), for at most ``PLD_MAX_DISTINCT`` distinct mechanisms;
    * the RDP bound and basic composition where smaller (``PrvAccountant`` takes RDP itself), and
      RDP/basic for what no PRV exists for (the ``prv`` accountant's fallbacks).

    Deterministic: the same event, δ and ``engine`` give the same float on the same platform.
    """
    check_delta(delta)
    if engine not in TIGHT_ENGINES:
        raise InvalidArgumentError("engine", f"must be one of {TIGHT_ENGINES}. Found {engine!r}.")
    try:
        plan = _plan(event)
    except _NoPrv:
        plan = None
    if plan is not None and delta > 0:
        if plan.non_private:
            return EpsilonBound(math.inf, math.inf, math.inf, delta, NAME, "a non-private event")
        if not plan.components:
            return EpsilonBound.exact(0.0, delta, NAME)
        gaussian = _merged_gaussian(plan.components)
        if gaussian is not None:
            eps = analytic_gaussian_epsilon(noise_multiplier=gaussian, delta=delta)
            return EpsilonBound(
                eps, eps, eps, delta, "analytic-gaussian", details={"noise_multiplier": gaussian}
            )
    rdp = RdpAccountant().compose(event).get_epsilon(delta)
    if plan is None or delta == 0 or not math.isfinite(rdp.upper) or rdp.upper == 0:
        return PrvAccountant().compose(event).get_epsilon(delta)
    total = sum(plan.components.values())
    many = len(plan.components) > PLD_MAX_DISTINCT
    if not many or engine >= 2:
        pld = _pld_refined(plan.components, delta, rdp.upper, total, batched=many)
        if pld is not None:
            basic = _basic_epsilon(event, delta)
            upper = min(pld, rdp.upper, basic)
            details = {"rdp_epsilon": rdp.upper, "pld_epsilon": pld, "basic_epsilon": basic}
            return EpsilonBound(0.0, upper, upper, delta, "pld", details=details)
    first_mesh = min(1.0, max(DEFAULT_EPS_ERROR, _TIGHT_FIRST_MESH * rdp.upper))
    return (
        PrvAccountant(first_mesh, relative_eps_error=TIGHT_RELATIVE_EPS_ERROR)
        .compose(event)
        .get_epsilon(delta)
    )


def _pld_refined(
    components: dict[_Prv, int], delta: float, guess: float, total: int, *, batched: bool = False
) -> float | None:
    """The PLD ε on a grid h ≤ min(√(ε/(500·N)), ε/200), ε first the upper bound ``guess`` and then, when
    that was more than twice the ε found, once more from the ε found (a finer grid). ``batched``:
    composed by ``accountant.pld`` (many distinct mechanisms), else by dp-accounting."""

    def interval(eps: float) -> float:
        return min(math.sqrt(eps / (_PLD_RESOLUTION * total)), eps / _PLD_SMALL_EPSILON)

    first = _pld_epsilon(components, delta, interval(guess), batched=batched)
    if first is None or first == 0 or guess <= 2 * first:
        return first
    finer = _pld_epsilon(components, delta, interval(first), batched=batched)
    return first if finer is None else min(first, finer)


def _basic_epsilon(event: DpEvent, delta: float) -> float:
    """Basic composition's ε where its δ fits (pure-DP parts: 0.5 for five Laplace(10), where
    the PLD's grid gives 0.50025), else ∞."""
    basic = BasicAccountant()
    try:
        basic.compose(event)
    except UnsupportedEventError:
        return math.inf
    return basic.get_epsilon(delta).upper


def _merged_gaussian(components: dict[_Prv, int]) -> float | None:
    """σ of the one Gaussian that a Gaussian-only composition is, rounded down; else None."""
    if not all(isinstance(prv, _GaussianPrv) and prv.pm_inf == 0 for prv in components):
        return None
    # σ² underflowing to 0 (σ = 5e-324) is an infinite precision, not a ZeroDivisionError (a 500).
    precision = math.fsum(
        n / variance if variance > 0 else math.inf
        for prv, n in components.items()
        if isinstance(prv, _GaussianPrv)
        for variance in (prv.noise_multiplier * prv.noise_multiplier,)
    )
    if not 0 < precision < math.inf:
        return None  # 1/σ² overflows or underflows: the PRV accountant's fallbacks answer
    sigma = 1.0 / math.sqrt(precision)
    for _ in range(4):
        sigma = math.nextafter(sigma, 0.0)  # less noise is the safe side
    return sigma


def _pld_epsilon(
    components: dict[_Prv, int], delta: float, interval: float, *, batched: bool = False
) -> float | None:
    """dp-accounting's pessimistic PLD ε of ``components`` at δ on a value grid of at most
    ``interval`` (add-or-remove adjacency: the worse of both directions), or None where it cannot
    answer. The grid is rounded down to a power of √2, so nearby δ (a geometric rule's levels)
    reuse one composed PLD (``_composed_pld``, cached)."""
    if not interval > 0:
        return None
    interval = 2.0 ** (math.floor(2 * math.log2(min(1.0, max(1e-9, interval)))) / 2)
    # Size guards (a client picks the event): dp-accounting builds one mechanism's PLD point by
    # point in Python, and the composed loss spreads over about √N times one step's window; grids
    # larger than these are not attempted (PRV or RDP answers).
    total = sum(components.values())
    width = max(hi - lo for lo, hi in (prv.window(8.0) for prv in components))
    if not (
        width / interval <= _PLD_MAX_STEP_POINTS and math.sqrt(total) * width / interval <= _PLD_MAX_POINTS
    ):
        return None
    if batched:
        from accountant.pld import composed_epsilon

        try:
            return composed_epsilon(_merge_gaussians(components), delta, interval)
        except (*_NUMERIC_ERRORS, OverflowError, _PrvFailure):
            return None
    try:
        composed = _composed_pld(tuple(components.items()), interval)
        if composed is None:
            return None
        eps = float(composed.get_epsilon_for_delta(delta))
    except (*_NUMERIC_ERRORS, OverflowError):
        return None
    if not math.isfinite(eps) or eps < 0:
        return None
    # The PLD's grid values are multiples of h; 4 ulps up for the final float arithmetic.
    for _ in range(4):
        eps = math.nextafter(eps, math.inf)
    return eps


@lru_cache(maxsize=16)
def _composed_pld(components: tuple[tuple[_Prv, int], ...], interval: float) -> Any:
    """The composed pessimistic PLD (dp-accounting) of ``components`` on value grid ``interval``;
    None for a component it has no PLD of."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld.common import DifferentialPrivacyParameters

    from accountant.pld import gaussian_pld

    composed = None
    for prv, count in components:
        # Gaussians: dp-accounting's ``from_gaussian_mechanism`` bit for bit, built vectorised
        # (``accountant.pld.gaussian_pld``; its pmfs are compared in tests/accountant/test_pld.py).
        if isinstance(prv, _GaussianPrv):
            one = gaussian_pld(prv.noise_multiplier, 1.0, interval)
        elif isinstance(prv, _SubsampledGaussianPrv):
            one = gaussian_pld(prv.noise_multiplier, prv.sampling_probability, interval)
        elif isinstance(prv, _LaplacePrv):
            one = pld_lib.from_laplace_mechanism(
                prv.scale, value_discretization_interval=interval, pessimistic_estimate=True
            )
        elif isinstance(prv, _PureDpPrv):
            one = pld_lib.from_privacy_parameters(
                DifferentialPrivacyParameters(prv.epsilon, prv.delta), value_discretization_interval=interval
            )
        else:
            return None
        if one is None:
            return None
        if count > 1:
            one = one.self_compose(count)
        composed = one if composed is None else composed.compose(one)
    return composed


__all__ = [
    "DEFAULT_EPS_ERROR",
    "DEFAULT_RELATIVE_EPS_ERROR",
    "FALLBACK_METHOD",
    "MAX_GRID",
    "MIN_EPS_ERROR",
    "PLD_HOMOGENEOUS_STEPS",
    "TIGHT_ENGINE",
    "TIGHT_ENGINES",
    "TIGHT_RELATIVE_EPS_ERROR",
    "PrvAccountant",
    "tight_epsilon",
]
