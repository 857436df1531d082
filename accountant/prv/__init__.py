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

Stages (one module each, as prv_accountant and Opacus split it)
----------------------------------------------------------------
``variables`` (each mechanism's PRV, and the events → PRVs dispatcher), ``domain`` (the mesh of
Thm. 5.5 and the half-width of Remark 5.6), ``discretise`` (Alg. 1 on a window), ``compose``
(the FFT product and the ε(δ) / δ(ε) bounds of Thm. 5.5), ``accountant`` (``PrvAccountant``:
refinement and the RDP fallback) and ``tight_engine`` (``tight_epsilon``: the tightest valid ε
of one non-adaptive composition).
"""

from accountant.prv.accountant import (
    DEFAULT_EPS_ERROR,
    DEFAULT_RELATIVE_EPS_ERROR,
    FALLBACK_METHOD,
    MIN_EPS_ERROR,
    NAME,
    PrvAccountant,
)
from accountant.prv.domain import MAX_GRID
from accountant.prv.tight_engine import (
    PLD_HOMOGENEOUS_STEPS,
    TIGHT_ENGINE,
    TIGHT_ENGINES,
    TIGHT_RELATIVE_EPS_ERROR,
    tight_epsilon,
)

__all__ = [
    "DEFAULT_EPS_ERROR",
    "DEFAULT_RELATIVE_EPS_ERROR",
    "FALLBACK_METHOD",
    "MAX_GRID",
    "MIN_EPS_ERROR",
    "NAME",
    "PLD_HOMOGENEOUS_STEPS",
    "TIGHT_ENGINE",
    "TIGHT_ENGINES",
    "TIGHT_RELATIVE_EPS_ERROR",
    "PrvAccountant",
    "tight_epsilon",
]
