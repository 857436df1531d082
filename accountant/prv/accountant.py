"""The ``"prv"`` accountant (stage 5 of the PRV pipeline, ``accountant.prv``): events composed into
PRVs (``variables``), the composed PRV's bounds (``compose``) refined for relative precision, and
the RDP / basic fallback where PRV composition does not apply or fails; ``upper`` is the smaller
of the PRV and RDP upper bounds (the package docstring says why each step is sound).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from accountant.base import EpsilonBound, PrivacyAccountant, check_delta, check_epsilon
from accountant.basic import BasicAccountant
from accountant.errors import AccountantError, InvalidArgumentError, UnsupportedEventError
from accountant.events import MAX_COUNT, DpEvent
from accountant.prv.compose import Composed, compose, delta_upper, epsilon_bounds
from accountant.prv.domain import MAX_WORK
from accountant.prv.variables import (
    NUMERIC_ERRORS,
    EventPrvs,
    NoPrv,
    Prv,
    PrvFailure,
    SubsampledGaussianPrv,
    add_counts,
    prvs_of,
)
from accountant.rdp import RdpAccountant, untouched_delta

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
# Work cap of a re-run on a finer mesh for relative precision (~1 s on one core); beyond it the
# coarser, still valid, bound is kept and the note says so.
REFINE_WORK: Final = 2**23
_REFINEMENTS: Final = 2


def _untouched_bound(components: dict[Prv, int]) -> float | None:
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
    if not components or not all(isinstance(p, SubsampledGaussianPrv) for p in components):
        return None
    log_untouched = math.fsum(
        n * math.log1p(-p.sampling_probability)
        for p, n in components.items()
        if isinstance(p, SubsampledGaussianPrv)
    )
    return untouched_delta(log_untouched)


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
        self._components: dict[Prv, int] = {}
        self._non_private = False
        self._no_prv: NoPrv | None = None
        self._cache: dict[tuple[object, ...], object] = {}

    # -- the dispatcher --------------------------------------------------------------------

    def _dispatch(self, event: DpEvent) -> tuple[EventPrvs | None, NoPrv | None]:
        """PRVs of ``event``, or why there are none; raises if RDP cannot account it either."""
        try:
            return prvs_of(event), None
        except NoPrv as no_prv:
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
        prvs, no_prv = self._dispatch(event)
        if count == 0:
            return self
        self._events[event] = self._events.get(event, 0) + count
        if prvs is not None:
            add_counts(self._components, prvs.components, count)
            self._non_private = self._non_private or prvs.non_private
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
    ) -> Composed:
        mesh_error = self.eps_error if eps_error is None else eps_error
        key = ("composed", delta_error, mesh_error, work_cap)
        cached = self._cache.get(key)
        if isinstance(cached, Composed):
            return cached
        composed = compose(self._components, mesh_error, delta_error, work_cap)
        self._cache[key] = composed
        return composed

    def _wanted_eps_error(self, epsilon: float) -> float | None:
        """The mesh error that relative precision asks for at ``epsilon`` (None: not asked)."""
        if self.relative_eps_error is None:
            return None
        return min(self.eps_error, max(MIN_EPS_ERROR, self.relative_eps_error * epsilon))

    def _refined(
        self, composed: Composed, delta: float, bounds: tuple[float, float, float]
    ) -> tuple[Composed, tuple[float, float, float], str]:
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
                finer_bounds = epsilon_bounds(finer, delta)
            except (PrvFailure, AccountantError, *NUMERIC_ERRORS) as exc:
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
            lower, estimate, upper = epsilon_bounds(composed, delta)
        except PrvFailure as exc:
            return self._fallback(delta, f"PRV composition failed: {exc}")
        except NUMERIC_ERRORS as exc:
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
        except (PrvFailure, AccountantError, *NUMERIC_ERRORS):
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
        delta = delta_upper(composed, epsilon)
        wanted = self._wanted_eps_error(epsilon)
        if wanted is not None and composed.eps_error > wanted:
            try:
                finer = self._composed(delta_error, wanted, REFINE_WORK)
                delta = min(delta, delta_upper(finer, epsilon))
            except (PrvFailure, AccountantError, *NUMERIC_ERRORS):
                pass
        return delta


__all__ = [
    "DEFAULT_DELTA_ERROR_RATIO",
    "DEFAULT_EPS_ERROR",
    "DEFAULT_RELATIVE_EPS_ERROR",
    "FALLBACK_METHOD",
    "MIN_EPS_ERROR",
    "NAME",
    "REFINE_WORK",
    "PrvAccountant",
]
