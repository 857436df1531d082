"""Composition of discretised PRVs and the ε(δ), δ(ε) bounds read off the result (stages 4 and
5 of the PRV pipeline, ``accountant.prv``).

All distinct PRVs are composed by one product of their FFTs (PRVs with equal counts multiplied
first, then one power per distinct count) and one inverse FFT; Gaussian PRVs are first merged
into one (exact). The float64 FFT round-off is estimated from the composed pmf itself (its
negative entries are pure round-off) as 4·n·max|negative entry| and paid for in δ, with the mass
the windows dropped; the mean-quadrature errors times their counts are paid for in ε. Theorem 5.5
of Gopi, Lee & Wutschitz (2021) then bounds the true curve:

    ε_disc(δ + δ_err) − ε_err ≤ ε(δ) ≤ ε_disc(δ − δ_err) + ε_err,

and ``epsilon_bounds`` returns (lower, estimate, upper) of it, searched with stable tail sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import scipy.fft
from scipy.signal import lfilter
from scipy.special import ndtri

from accountant.prv.discretise import discretise
from accountant.prv.domain import MAX_WORK, grid
from accountant.prv.variables import FloatArray, GaussianPrv, Prv, PrvFailure

# FFT batches of at most this many float64 values (64 MiB). A batched rfft costs less than half
# the CPU of one call per row (measured); one thread, so a request never takes over a shared box.
_FFT_BATCH_VALUES: Final = 2**23
_FFT_WORKERS: Final = 1
# Mass left outside each PRV's evaluation window (per side), at most; paid for in δ.
_WINDOW_TAIL_MAX: Final = 1e-12


@dataclass(frozen=True, slots=True)
class Composed:
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


def merge_gaussians(components: dict[Prv, int]) -> dict[Prv, int]:
    """Replace all Gaussian PRVs by one: N(μᵢ²/2, μᵢ²) summed nᵢ times is N(μ²/2, μ²), μ² = Σnᵢμᵢ².

    Exact (sums of independent normals), and it lowers the composition count N that sets the
    mesh. The merged σ = (Σ nᵢ/σᵢ²)^(−1/2) is rounded down a few ulps (less noise is the safe side).
    """
    gaussians = {prv: n for prv, n in components.items() if isinstance(prv, GaussianPrv)}
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
        raise PrvFailure(
            "a Gaussian noise_multiplier is so small that 1/sigma^2 overflows (the mechanism is "
            "not private in floating point)"
        )
    if not precision > 0:  # every σ so large that 1/σ² underflows: let RDP bound it instead
        raise PrvFailure("the Gaussian noise is too large to discretise (1/sigma^2 underflows)")
    sigma = 1.0 / math.sqrt(precision)
    for _ in range(4):
        sigma = math.nextafter(sigma, 0.0)
    merged: dict[Prv, int] = {prv: n for prv, n in components.items() if prv not in gaussians}
    merged[GaussianPrv(sigma)] = 1
    return merged


def compose(
    components: dict[Prv, int], eps_error: float, delta_error: float, work_cap: int = MAX_WORK
) -> Composed:
    """Discretise and compose ``components`` (Gopi et al. 2021, Alg. 1 and Thm. 5.5).

    Raises ``PrvFailure`` when the grid or the work (distinct PRVs × grid points) would exceed
    its cap (``work_cap``), or when ``delta_error`` is too small for the mesh formula.
    """
    # A subnormal δ (5e-324) gives δ/1000 = 0 and log(12/δ_err) = ∞: no mesh can be sized.
    if not 0 < delta_error < 1 or not math.isfinite(12 / delta_error):
        raise PrvFailure(f"delta_error = {delta_error!r} is too small to size the PRV mesh")
    components = merge_gaussians(components)
    total = sum(components.values())
    mesh = grid(components, eps_error, delta_error, work_cap)
    t_min, h, n = mesh.t_min, mesh.h, mesh.size
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
            j_lo, probabilities, shift, dropped, mean_error = discretise(prv, t_min, h, n, z_tail)
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
    return Composed(
        pmf=pmf,
        t_min=t_min + shift_total,
        h=h,
        log_pmc_inf=log_pmc_inf,
        extra_delta=dropped_total + round_off,
        extra_epsilon=mean_error_total,
        eps_error=mesh.eps_error,
        delta_error=delta_error,
        grid_size=n,
        note=mesh.note,
    )


def _tail_sums(
    composed: Composed, start: int
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


def epsilon_bounds(composed: Composed, delta: float) -> tuple[float, float, float]:
    """(lower, estimate, upper) of ε(δ) from a composed discrete PRV (Gopi et al. Thm. 5.5)."""
    delta_inf = -math.expm1(composed.log_pmc_inf)
    delta_fin = (delta - delta_inf) / (1 - delta_inf)
    slack = composed.delta_error + composed.extra_delta
    if delta_fin - slack <= 0:
        if delta_fin <= 0:
            return math.inf, math.inf, math.inf
        raise PrvFailure(
            f"delta = {delta:g} is too small for the PRV error budget (delta_error "
            f"{composed.delta_error:.3g} + truncation and round-off {composed.extra_delta:.3g})"
        )
    if np.finfo(np.longdouble).eps * composed.pmf.size > delta_fin - slack:
        raise PrvFailure("floating-point errors dominate for such a small delta")
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
            raise PrvFailure("epsilon lies beyond the PRV domain")
        t_i = composed.t_min + (start + i) * composed.h
        return float(t_i + np.log((d1[i] - np.longdouble(target)) / d2[i]))

    upper = find(delta_fin - slack) + composed.eps_error + composed.extra_epsilon
    estimate = find(delta_fin)
    lower = find(min(delta_fin + slack, 1.0)) - composed.eps_error - composed.extra_epsilon
    upper = max(upper, 0.0)
    estimate = min(max(estimate, 0.0), upper)
    lower = min(max(lower, 0.0), estimate)
    return lower, estimate, upper


def delta_upper(composed: Composed, epsilon: float) -> float:
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


__all__ = ["Composed", "compose", "delta_upper", "epsilon_bounds", "merge_gaussians"]
