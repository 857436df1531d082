"""The tight ε of ONE non-adaptive composition (what a charge that needs no filter costs):
``tight_epsilon``, the smallest of several valid upper bounds — the analytic Gaussian, dp-accounting's
pessimistic privacy loss distribution, the ``prv`` accountant, RDP and basic composition.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Final

from accountant.base import EpsilonBound, check_delta
from accountant.basic import BasicAccountant
from accountant.errors import InvalidArgumentError, UnsupportedEventError
from accountant.events import DpEvent
from accountant.mechanisms import analytic_gaussian_epsilon
from accountant.prv.accountant import DEFAULT_EPS_ERROR, NAME, PrvAccountant
from accountant.prv.compose import merge_gaussians
from accountant.prv.variables import (
    NUMERIC_ERRORS,
    GaussianPrv,
    LaplacePrv,
    NoPrv,
    Prv,
    PrvFailure,
    PureDpPrv,
    SubsampledGaussianPrv,
    prvs_of,
)
from accountant.rdp import RdpAccountant

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
        prvs = prvs_of(event)
    except NoPrv:
        prvs = None
    if prvs is not None and delta > 0:
        if prvs.non_private:
            return EpsilonBound(math.inf, math.inf, math.inf, delta, NAME, "a non-private event")
        if not prvs.components:
            return EpsilonBound.exact(0.0, delta, NAME)
        gaussian = _merged_gaussian(prvs.components)
        if gaussian is not None:
            eps = analytic_gaussian_epsilon(noise_multiplier=gaussian, delta=delta)
            return EpsilonBound(
                eps, eps, eps, delta, "analytic-gaussian", details={"noise_multiplier": gaussian}
            )
    rdp = RdpAccountant().compose(event).get_epsilon(delta)
    if prvs is None or delta == 0 or not math.isfinite(rdp.upper) or rdp.upper == 0:
        return PrvAccountant().compose(event).get_epsilon(delta)
    total = sum(prvs.components.values())
    many = len(prvs.components) > PLD_MAX_DISTINCT
    if not many or engine >= 2:
        pld = _pld_refined(prvs.components, delta, rdp.upper, total, batched=many)
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
    components: dict[Prv, int], delta: float, guess: float, total: int, *, batched: bool = False
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


def _merged_gaussian(components: dict[Prv, int]) -> float | None:
    """σ of the one Gaussian that a Gaussian-only composition is, rounded down; else None."""
    if not all(isinstance(prv, GaussianPrv) and prv.pm_inf == 0 for prv in components):
        return None
    # σ² underflowing to 0 (σ = 5e-324) is an infinite precision, not a ZeroDivisionError (a 500).
    precision = math.fsum(
        n / variance if variance > 0 else math.inf
        for prv, n in components.items()
        if isinstance(prv, GaussianPrv)
        for variance in (prv.noise_multiplier * prv.noise_multiplier,)
    )
    if not 0 < precision < math.inf:
        return None  # 1/σ² overflows or underflows: the PRV accountant's fallbacks answer
    sigma = 1.0 / math.sqrt(precision)
    for _ in range(4):
        sigma = math.nextafter(sigma, 0.0)  # less noise is the safe side
    return sigma


def _pld_epsilon(
    components: dict[Prv, int], delta: float, interval: float, *, batched: bool = False
) -> float | None:
    """dp-accounting's pessimistic PLD ε of ``components`` at δ on a value grid of at most
    ``interval`` (add-or-remove adjacency: the worse of both directions), or None where it cannot
    answer. The grid is rounded down to a power of √2, so nearby δ (a geometric rule's levels)
    reuse one composed PLD (``composed_pld``, cached)."""
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
            return composed_epsilon(merge_gaussians(components), delta, interval)
        except (*NUMERIC_ERRORS, OverflowError, PrvFailure):
            return None
    try:
        composed = composed_pld(tuple(components.items()), interval)
        if composed is None:
            return None
        eps = float(composed.get_epsilon_for_delta(delta))
    except (*NUMERIC_ERRORS, OverflowError):
        return None
    if not math.isfinite(eps) or eps < 0:
        return None
    # The PLD's grid values are multiples of h; 4 ulps up for the final float arithmetic.
    for _ in range(4):
        eps = math.nextafter(eps, math.inf)
    return eps


@lru_cache(maxsize=16)
def composed_pld(components: tuple[tuple[Prv, int], ...], interval: float) -> Any:
    """The composed pessimistic PLD (dp-accounting) of ``components`` on value grid ``interval``;
    None for a component it has no PLD of."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.pld.common import DifferentialPrivacyParameters

    from accountant.pld import gaussian_pld

    composed = None
    for prv, count in components:
        # Gaussians: dp-accounting's ``from_gaussian_mechanism`` bit for bit, built vectorised
        # (``accountant.pld.gaussian_pld``; its pmfs are compared in tests/accountant/test_pld.py).
        if isinstance(prv, GaussianPrv):
            one = gaussian_pld(prv.noise_multiplier, 1.0, interval)
        elif isinstance(prv, SubsampledGaussianPrv):
            one = gaussian_pld(prv.noise_multiplier, prv.sampling_probability, interval)
        elif isinstance(prv, LaplacePrv):
            one = pld_lib.from_laplace_mechanism(
                prv.scale, value_discretization_interval=interval, pessimistic_estimate=True
            )
        elif isinstance(prv, PureDpPrv):
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
    "PLD_HOMOGENEOUS_STEPS",
    "PLD_MAX_DISTINCT",
    "TIGHT_ENGINE",
    "TIGHT_ENGINES",
    "TIGHT_RELATIVE_EPS_ERROR",
    "composed_pld",
    "tight_epsilon",
]
