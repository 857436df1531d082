"""Privacy random variables (stage 1 of the PRV pipeline, ``accountant.prv``): each mechanism's
PRV in float64, vectorised — its cdf and survival function on the window that carries its mass,
the mean of the truncated PRV (for the mean-preserving discretisation) and an RDP curve that sizes
the domain — and the one dispatcher from events to PRVs with counts (``prvs_of``), behind
the accountant's ``supports``, ``compose`` and fallback decision.

Gopi, Lee & Wutschitz (2021): the PRV of a mechanism with dominating pair (P, Q) is
Y = log(P(o)/Q(o)), o ~ P. The pairs are prv-accountant's (its ``privacy_random_variables``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from prv_accountant.privacy_random_variables import LaplaceMechanism, PureDPMechanism
from scipy.special import log_ndtr, ndtr, ndtri

from accountant.events import (
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
from accountant.mechanisms import l2dp_ml_event_epsilon, output_perturbation_event_epsilon
from accountant.rdp import compute_rdp

FloatArray = npt.NDArray[np.float64]

# Errors of the float computation that make PRV composition give up (and RDP answer instead).
NUMERIC_ERRORS: Final = (ValueError, RuntimeError, ArithmeticError, MemoryError)
# Gaussian tail beyond which the truncated-mean quadrature stops (mass < 1e-30).
_WINDOW_TAIL: Final = 1e-30
_Z_TAIL: Final = float(-ndtri(_WINDOW_TAIL))
_GL8: Final = np.polynomial.legendre.leggauss(8)
_GL16: Final = np.polynomial.legendre.leggauss(16)


class PrvFailure(Exception):
    """PRV composition cannot certify this query; the message says why (becomes the note)."""


class Prv(ABC):
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
class GaussianPrv(Prv):
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
class SubsampledGaussianPrv(Prv):
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
            raise PrvFailure("the domain does not contain the subsampled-Gaussian support")
        reach = (_Z_TAIL + 2.0) * s
        x_lo = -reach
        x_hi = min(float(self._x_of_t(np.array([hi]))[0]), 1.0 + reach)
        if x_hi <= x_lo:
            raise PrvFailure("the domain cuts off the subsampled-Gaussian mass")
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
        event = PoissonSampledEvent(
            sampling_probability=self.sampling_probability,
            event=GaussianEvent(noise_multiplier=self.noise_multiplier),
        )
        return np.asarray(compute_rdp(event, [float(a) for a in orders]), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class LaplacePrv(Prv):
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
            raise PrvFailure("the domain cuts off the Laplace PRV's atoms")
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
class PureDpPrv(Prv):
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
            raise PrvFailure("the domain cuts off the pure-DP PRV's atoms")
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


class NoPrv(Exception):
    """This event has no PRV here; the RDP fallback may still account it."""

    def __init__(self, event: DpEvent, reason: str) -> None:
        super().__init__(reason)
        self.event = event
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EventPrvs:
    """The PRVs of an event with their counts, and whether a non-private part makes ε = ∞."""

    components: dict[Prv, int]
    non_private: bool = False


def add_counts(into: dict[Prv, int], other: dict[Prv, int], times: int) -> None:
    """Add ``other``'s counts, each ``times`` over, to ``into`` (composition of PRV multisets)."""
    for prv, count in other.items():
        into[prv] = into.get(prv, 0) + count * times


def prvs_of(event: DpEvent) -> EventPrvs:
    """The PRVs (with counts) of ``event``; raises ``NoPrv`` for an event with no PRV here."""
    if isinstance(event, NoOpEvent):
        return EventPrvs({})
    if isinstance(event, NonPrivateEvent):
        return EventPrvs({}, non_private=True)
    if isinstance(event, GaussianEvent | AdaptiveGaussianEvent):
        # AdaDp Lemma 1: per-coordinate noise satisfying Σ sᵢ²/σᵢ² ≤ 1/σ*² is a Gaussian with σ*.
        return EventPrvs({GaussianPrv(event.noise_multiplier): 1})
    if isinstance(event, LaplaceEvent):
        return EventPrvs({LaplacePrv(event.scale): 1})
    if isinstance(event, PureDpEvent):
        return EventPrvs({PureDpPrv(event.epsilon): 1} if event.epsilon > 0 else {})
    if isinstance(event, ApproxDpEvent):
        if event.epsilon == 0 and event.delta == 0:
            return EventPrvs({})
        return EventPrvs({PureDpPrv(event.epsilon, event.delta): 1})
    if isinstance(event, FunctionalMechanismL2DPEvent):
        return EventPrvs({PureDpPrv(l2dp_ml_event_epsilon(event)): 1})
    if isinstance(event, OutputPerturbationEvent):
        return EventPrvs({PureDpPrv(output_perturbation_event_epsilon(event)): 1})
    if isinstance(event, PoissonSampledEvent):
        inner = event.event
        if isinstance(inner, GaussianEvent | AdaptiveGaussianEvent):
            q = event.sampling_probability
            if q == 1.0:
                return EventPrvs({GaussianPrv(inner.noise_multiplier): 1})
            return EventPrvs({SubsampledGaussianPrv(q, inner.noise_multiplier): 1})
        prvs_of(inner)  # an unsupported inner event is the innermost reason
        raise NoPrv(event, f"no PRV for Poisson sampling of a {inner.kind!r} event")
    if isinstance(event, SelfComposedEvent):
        child = prvs_of(event.event)
        if event.count == 0:
            return EventPrvs({})
        out: dict[Prv, int] = {}
        add_counts(out, child.components, event.count)
        return EventPrvs(out, child.non_private)
    if isinstance(event, ComposedEvent):
        out = {}
        non_private = False
        for child_event in event.events:
            child = prvs_of(child_event)
            add_counts(out, child.components, 1)
            non_private = non_private or child.non_private
        return EventPrvs(out, non_private)
    for child_event in event.children():
        prvs_of(child_event)
    raise NoPrv(event, f"no PRV for a {event.kind!r} event")


__all__ = [
    "NUMERIC_ERRORS",
    "EventPrvs",
    "FloatArray",
    "GaussianPrv",
    "LaplacePrv",
    "NoPrv",
    "Prv",
    "PrvFailure",
    "PureDpPrv",
    "SubsampledGaussianPrv",
    "add_counts",
    "prvs_of",
]
