"""The domain and mesh of a PRV composition (stage 2 of the PRV pipeline, ``accountant.prv``).

Gopi, Lee & Wutschitz (2021): the mesh h = ε_err / sqrt(N/2 · log(12/δ_err)) of **Theorem 5.5**
(N the total number of compositions) and the half-width L of **Remark 5.6**, an RDP tail bound:
L = max(ε_RDP(all, δ_err/4), maxᵢ ε_RDP(Yᵢ, δ_err/(8N)), ε_err) + 3. The grid is
prv-accountant's ``Domain.create_aligned``, padded to a length pocketfft is fast on.

When the mesh for ``eps_error`` would need more than ``MAX_GRID`` points, ``eps_error`` is raised
until it fits, up to ``MAX_EPS_ERROR`` (prv-accountant's "typically around 0.1") or
``MAX_RELATIVE_EPS_ERROR`` of L when that is larger; beyond that, or beyond ``MAX_HALF_WIDTH`` or
the work cap, ``PrvFailure`` (the accountant falls back to RDP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
from prv_accountant.domain import Domain

from accountant.prv.variables import FloatArray, Prv, PrvFailure

MAX_EPS_ERROR: Final = 0.1
# ... or, for a large ε, 0.1% of the domain half-width (≈ ε + 3).
MAX_RELATIVE_EPS_ERROR: Final = 1e-3
MAX_GRID: Final = 2**22
# Above this half-width of the privacy-loss domain PRV is not attempted (RDP answers): such a
# loss means ε ≳ 10⁵, far beyond any meaningful guarantee, and its 4M-point grid took seconds.
MAX_HALF_WIDTH: Final = 1e5
# Total work cap (distinct PRVs × grid points) before falling back to RDP.
MAX_WORK: Final = 2 * 10**9
# Orders for the RDP tail bound that sizes the domain (Remark 5.6): integer orders (cheap and
# exact for the subsampled Gaussian) reaching the small δ_err/(8N) of the per-PRV term.
_SIZING_ORDERS: Final = tuple([*range(2, 33), 40, 48, 56, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024])


@dataclass(frozen=True, slots=True)
class Grid:
    """The composition's grid t_min + j·h, j < ``size``, and the mesh error it was sized for
    (``eps_error``, raised where the grid cap asked for it: ``note`` says so)."""

    t_min: float
    h: float
    size: int
    eps_error: float
    note: str


def _sizing_epsilon(rdp: FloatArray, orders: FloatArray, delta: float) -> float:
    """ε from an RDP curve (improved conversion, Balle et al. 2020 Thm. 21), for sizing only."""
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1) + np.log1p(-1 / orders)
    eps = eps[np.isfinite(eps)]
    if eps.size == 0:
        raise PrvFailure("no finite RDP tail bound to size the PRV domain")
    return max(0.0, float(eps.min()))


def _domain_half_width(components: dict[Prv, int], total: int, eps_error: float, delta_error: float) -> float:
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


def grid(components: dict[Prv, int], eps_error: float, delta_error: float, work_cap: int) -> Grid:
    """The grid of Theorem 5.5 and Remark 5.6 for ``components`` at (``eps_error``,
    ``delta_error``); ``PrvFailure`` when the domain, the grid or the work (distinct PRVs × grid
    points, at most ``work_cap``) would exceed its cap."""
    total = sum(components.values())
    log_term = total / 2 * math.log(12 / delta_error)
    half_width = _domain_half_width(components, total, eps_error, delta_error)
    if half_width > MAX_HALF_WIDTH:
        # A privacy loss spread this wide means an ε above 10⁵: a 4M-point grid could
        # not resolve it to the requested precision, and RDP bounds it at once.
        raise PrvFailure(
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
            raise PrvFailure(
                f"{total} compositions on a domain of half-width {half_width:.3g} need more than "
                f"{MAX_GRID} grid points even at eps_error = {cap:.3g}"
            )
        note = f"eps_error raised from {eps_error:g} to {raised:.3g} to fit a {MAX_GRID}-point grid"
        eps_error = raised
    h = eps_error / math.sqrt(log_term)
    if len(components) * grid_points(eps_error) > work_cap:
        raise PrvFailure(f"{len(components)} distinct PRVs on a large grid exceed the work cap")
    aligned = Domain.create_aligned(-half_width, half_width, h)
    t_min, h = float(aligned.t_min()), float(aligned.dt())
    return Grid(t_min, h, fast_length(len(aligned)), eps_error, note)


def fast_length(size: int) -> int:
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


__all__ = [
    "MAX_EPS_ERROR",
    "MAX_GRID",
    "MAX_HALF_WIDTH",
    "MAX_RELATIVE_EPS_ERROR",
    "MAX_WORK",
    "Grid",
    "fast_length",
    "grid",
]
