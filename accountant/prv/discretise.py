"""Discretisation of one PRV (stage 3 of the PRV pipeline, ``accountant.prv``): cell-centred on
the grid's mesh, its mean preserved (Gopi, Lee & Wutschitz 2021, Alg. 1), evaluated only on the
window that carries its mass. The mass the window drops and the quadrature error of the mean are
returned, so the composition pays for them in δ and ε.
"""

from __future__ import annotations

import math

import numpy as np

from accountant.prv.variables import FloatArray, Prv, PrvFailure


def discretise(
    prv: Prv, t_min: float, h: float, n: int, z_tail: float
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
        raise PrvFailure("a PRV lies outside the domain")
    offsets = np.arange(j_hi - j_lo + 2, dtype=np.float64)
    edges = offsets * h
    edges += t_min + (j_lo - 0.5) * h
    probabilities, dropped = prv.cell_probabilities(edges)
    np.maximum(probabilities, 0.0, out=probabilities)
    mass = float(probabilities.sum())
    if not mass > 0:
        raise PrvFailure("a PRV has no mass on the domain")
    probabilities /= mass
    # Σ tⱼpⱼ with tⱼ = t_min + (j_lo + k)·h.
    mean_discrete = t_min + h * (j_lo + float(np.dot(offsets[:-1], probabilities)))
    mean_continuous, mean_error = prv.truncated_mean(float(edges[0]), float(edges[-1]))
    shift = mean_continuous - mean_discrete
    if not abs(shift) < h / 2:
        # prv-accountant's "Discrete mean differs from continuous mean significantly."
        raise PrvFailure("the discrete mean differs from the continuous mean (mesh too coarse)")
    return j_lo, probabilities, shift, dropped, mean_error


__all__ = ["discretise"]
