"""What a release's numbers mean: three figures, each a valid bound for what it names.

A release (a commit, hence a certificate) is described by three different numbers, never to be
confused (issue 24 §3):

* ``guarantee`` — the (ε, δ)-DP guarantee of the released model: of every release computed from
  the batches it read, up to and including it, under the budget's rule, **valid whatever the
  trainer chose after seeing earlier outputs, stopping early included** (``release_guarantee``).
  By rule:

  - Rényi filter (``sequential`` / ``lifelong`` on ``rdp``): the filter's budget (ε, δ), once
    anything ran on the batch (Feldman & Zrnic 2021, Thm. 3.1 with the conversion of
    ``accountant.rdp_filter``). The filter's progress ``epsilon_of(spent)`` is *not* a
    guarantee: a data-dependent ε would be a privacy odometer, which the filter does not give
    (Rogers, Roth, Ullman & Vadhan 2016; Whitehouse, Ramdas, Rogers & Wu 2023).
  - declared plan segments (``sequential`` / ``prv``): Σ of the closed segments' (εᵢ, δᵢ) it ran
    plus the open segment's whole (εᵢ, δᵢ) once any of it ran — a segment stopped early is
    post-processing of the whole segment (Dwork & Roth 2014, Prop. 2.1) — composed by the
    basic-composition filter (Rogers et al. 2016, Thm. 3.6).
  - ``parallel``: the batch's one charge; on ``rdp`` / ``prv`` the whole reserved run (a run
    stopped early is post-processing of it), on ``basic`` the exact sum of what ran (a valid
    odometer: Rogers et al. 2016 show basic composition holds for odometers).
  - ``basic`` sums (``sequential``, ``lifelong``) and ``geometric`` levels: the batch's spend,
    an exact sum of per-charge εᵢ (geometric: whole level allowances), at the budget's δ: basic
    composition is a valid privacy odometer, Σεᵢ with a δ_g fixed in advance that bounds Σδᵢ on
    every path (Rogers, Roth, Ullman & Vadhan 2016), which admission keeps at most the budget's
    δ. The same δ for plan segments, whose δᵢ are chosen adaptively too.

  Disjoint batches compose in parallel (McSherry 2009, Thm. 4): the maximum over the batches.
* ``run_alone`` — the (ε, δ) of the run that produced the release as the only mechanism ever run
  on its records, at the budget's δ, by the tightest accountant we have for it: the exact ε of a
  lone Gaussian run (Balle & Wang 2018, Thm. 8), else the PRV upper bound (Gopi, Lee & Wutschitz
  2021, Thm. 5.5) or the exact basic composition when smaller (a pure ε is exact). It bounds
  that run alone, not what was released before it from the same records; it is computed for the
  whole reserved run, which bounds a run stopped early. It is **derived, not certified**: it is
  not in the certificate, but a function of two certified inputs (the reserved charge's event and
  the budget's δ), so anyone holding the certificate recomputes it offline
  (``certificate_run_alone``; ``ledger check`` does, for every version a bundle states it for).
* ``budget_share`` — how much of the budget the release consumed: the reservation's committed
  cost in the rule's own units (filter progress, a segment's share, a level's allowance). It is a
  budget figure, **not** a DP guarantee.

``shown`` (``accountant.exact``) writes a number for people: 4 significant digits rounded toward
the safe side (ε and δ up, what remains down); machine-readable fields keep the exact text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final, Protocol

from accountant import events as ev
from accountant.errors import AccountantError
from accountant.events import DpEvent
from accountant.exact import INFINITY, SHOWN_DIGITS, ZERO, exact_sum, shown, to_text
from accountant.rules import BatchState, Budget, Charge, Cost
from accountant.rules.prices import basic_price, prv_epsilon

# ---------------------------------------------------------------------------------------------
# The guarantee of a release
# ---------------------------------------------------------------------------------------------

GUARANTEE_SCOPE: Final = (
    "every release computed from the batches this version read, up to and including this one, "
    "under the dataset's rule; valid whatever was chosen after seeing earlier outputs, stopping "
    "early included"
)


class Reserved(Protocol):
    """A reserved cost as ``batch_guarantee`` reads it (a ``Cost``, or the (ε, δ) a ledger row
    stores)."""

    @property
    def epsilon(self) -> Decimal: ...

    @property
    def delta(self) -> Decimal: ...


def batch_guarantee(
    budget: Budget, state: BatchState, reserved: Reserved | None = None
) -> tuple[Decimal, Decimal]:
    """The (ε, δ) guarantee of everything released from one batch in ``state`` (module
    docstring); ``reserved``: the reservation's reserved cost, when known (a ``parallel`` run
    committed from a prefix under pricing versions 1–2 is bounded by it)."""
    ran = state.epsilon_spent > 0 or state.delta_spent > 0
    if not ran:
        return ZERO, ZERO
    if budget.uses_filter:
        return budget.epsilon, budget.delta
    eps, dlt = state.epsilon_spent, state.delta_spent
    if budget.rule == "parallel":
        if budget.accountant != "basic" and reserved is not None:
            eps, dlt = max(eps, reserved.epsilon), max(dlt, reserved.delta)
        return eps, dlt
    if budget.rule == "sequential" and budget.accountant == "prv":
        segments = budget.plan_segments
        closed = [segments[i] for i in state.plan_closed if 0 <= i < len(segments)]
        opened = [segments[-1]] if state.plan_position > 0 else []
        eps = max(eps, exact_sum(s.epsilon for s in (*closed, *opened)))
    return eps, _odometer_delta(budget, dlt)


def _odometer_delta(budget: Budget, delta_spent: Decimal) -> Decimal:
    """The δ of a realised sum of adaptively chosen (εᵢ, δᵢ): an odometer's δ is fixed before
    anything runs (Rogers, Roth, Ullman & Vadhan 2016: Σεᵢ is valid with δ_g whenever Σδᵢ ≤ δ_g
    on every path), and the ledger admits charges only while Σδᵢ ≤ the budget's δ: that δ."""
    return max(delta_spent, budget.delta)


def spend_guarantee(budget: Budget, epsilon_spent: Decimal, delta_spent: Decimal) -> tuple[Decimal, Decimal]:
    """The guarantee of everything released from a dataset (or task), read from its aggregates:
    the maxima over its batches of the committed spend. A Rényi filter's spend is its progress,
    so the guarantee is the filter's budget once anything ran; every other rule's spend is the
    guarantee (for plan segments and parallel runs since pricing version 3, which charges a
    segment or a run stopped early whole), with the budget's δ where charges were chosen
    adaptively (``_odometer_delta``)."""
    if epsilon_spent <= 0 and delta_spent <= 0:
        return ZERO, ZERO
    if budget.uses_filter:
        return budget.epsilon, budget.delta
    if budget.rule == "parallel":
        return epsilon_spent, delta_spent
    return epsilon_spent, _odometer_delta(budget, delta_spent)


SPEND_MEANING: Final = {
    "filter": "the Renyi filter's progress on the most-spent batch: a budget share, not a DP guarantee "
    "(the guarantee is the filter's budget once anything ran)",
    "union": "the progress of the union of privacy filters (tight) on the most-spent batch: a budget "
    "share, not a DP guarantee (the guarantee is the budget once anything ran)",
    "other": "the (epsilon, delta) guarantee of everything released from the most-spent batch under "
    "the rule (also what the budget has used)",
}


def spend_meaning(budget: Budget) -> str:
    """What a spend view's ``epsilon_spent`` is under ``budget``."""
    if budget.uses_union:
        return SPEND_MEANING["union"]
    return SPEND_MEANING["filter" if budget.uses_filter else "other"]


@dataclass(frozen=True, slots=True)
class Transition:
    """What ``release_guarantee`` reads of a certificate's batch or class record."""

    state_after: BatchState
    reserved: Cost


def release_guarantee(budget: Budget, records: Iterable[Transition | Any]) -> tuple[Decimal, Decimal]:
    """The guarantee of a release: the maximum over the batches it read (parallel composition over
    disjoint batches) of ``batch_guarantee`` after its commit. ``records``: anything with
    ``state_after`` and ``reserved`` (``accountant.certificates.BatchRecord`` / ``ClassRecord``)."""
    pairs = [batch_guarantee(budget, r.state_after, r.reserved) for r in records]
    return max((p[0] for p in pairs), default=ZERO), max((p[1] for p in pairs), default=ZERO)


# ---------------------------------------------------------------------------------------------
# The run alone
# ---------------------------------------------------------------------------------------------

RUN_ALONE_SCOPE: Final = (
    "the run that produced this version alone, as if it were the only mechanism ever run on these "
    "records (the whole reserved run, which bounds a run stopped early); not a guarantee for the "
    "releases before it from the same records"
)


def _gaussian_mu(event: DpEvent) -> float | None:
    """μ of a lone Gaussian run (k Gaussians of σ, sensitivity 1: μ = √k/σ), else ``None``."""
    count, inner = (event.count, event.event) if isinstance(event, ev.SelfComposedEvent) else (1, event)
    if isinstance(inner, ev.GaussianEvent) and count > 0:
        return math.sqrt(count) / inner.noise_multiplier
    return None


def _gaussian_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of the Gaussian mechanism with μ = sensitivity/σ: Balle & Wang 2018, Thm. 8,
    Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), the second term in logs (no overflow)."""
    from scipy.stats import norm

    return float(norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon + norm.logcdf(-mu / 2 - epsilon / mu)))


_GAUSSIAN_SLACK: Final = 1e-14
"""Absolute bound on the float error of ``_gaussian_delta`` (both terms are ≤ 1 and computed to a
few ulps), required as headroom below δ before an exact ε is stated."""


def gaussian_epsilon(mu: float, delta: Decimal) -> Decimal | None:
    """The exact ε at δ of a Gaussian run with μ = √k/σ (the analytic Gaussian mechanism, Balle &
    Wang 2018, Thm. 8: tight, not a bound), rounded up: the root of δ(ε) = δ is found in floats,
    moved up by a relative 10⁻⁹, and stated only if δ at that ε is below δ by more than the float
    error (``None`` otherwise: the caller falls back to an upper bound)."""
    from scipy.optimize import brentq

    target = float(delta)
    if not 0 < target < 1 or _gaussian_delta(mu, 0.0) <= target:
        return None if not 0 < target < 1 else ZERO
    high = 1.0
    while _gaussian_delta(mu, high) > target:
        high *= 2
        if high > 1e6:
            return None
    root = float(brentq(lambda e: _gaussian_delta(mu, e) - target, 0.0, high, xtol=1e-15, rtol=1e-15))
    stated = math.nextafter(root * (1 + 1e-9) + 1e-12, math.inf)
    if _gaussian_delta(mu, stated) + _GAUSSIAN_SLACK > target:
        return None
    return Decimal(repr(stated)).quantize(Decimal("1e-12"), rounding=ROUND_CEILING)


RUN_ALONE_SOURCE: Final = (
    "derived, not certified: recomputed from the certificate's inputs.charge.event and "
    "inputs.budget.delta by the accountant named (ledger check recomputes it offline)"
)


def certificate_run_alone(body: Any) -> dict[str, str]:
    """``run_alone`` of the release a certificate ``body`` justifies, from its certified inputs
    (the reserved charge's event, the budget's δ): what a DP statement states, recomputable by
    anyone holding the certificate."""
    inputs = body["inputs"]
    event = Charge.from_json(inputs["charge"]).event
    return run_alone(event, Budget.from_json(inputs["budget"]).delta)


def run_alone(event: DpEvent, delta: Decimal) -> dict[str, str]:
    """``{epsilon, delta, accountant}``: the run ``event`` alone at δ = ``delta`` (the budget's):
    for a lone Gaussian run its exact ε (``gaussian_epsilon``), else the smaller of its exact basic
    composition (when its δ fits) and the PRV upper bound (Gopi, Lee & Wutschitz 2021, Thm. 5.5;
    ``accountant.prv``, which falls back to RDP where PRV does not apply). ε = ∞ when neither
    bounds it at this δ (a Gaussian at δ = 0)."""
    mu = _gaussian_mu(event)
    exact = None if mu is None or delta <= 0 else gaussian_epsilon(mu, delta)
    if exact is not None:
        return {"epsilon": to_text(exact), "delta": to_text(delta), "accountant": "exact (analytic Gaussian)"}
    best: dict[str, str] = {"epsilon": to_text(INFINITY), "delta": to_text(delta), "accountant": "none"}
    try:
        eps, dlt = basic_price(event)
    except AccountantError:
        pass
    else:
        if dlt <= delta:
            best = {"epsilon": to_text(eps), "delta": to_text(dlt), "accountant": "basic (exact)"}
    if delta > 0:
        try:
            upper = prv_epsilon((event,), delta)
        except AccountantError:
            return best
        if upper < Decimal(best["epsilon"]):
            best = {"epsilon": to_text(upper), "delta": to_text(delta), "accountant": "prv (upper bound)"}
    return best


__all__ = [
    "GUARANTEE_SCOPE",
    "RUN_ALONE_SCOPE",
    "RUN_ALONE_SOURCE",
    "SHOWN_DIGITS",
    "Reserved",
    "Transition",
    "batch_guarantee",
    "certificate_run_alone",
    "gaussian_epsilon",
    "release_guarantee",
    "run_alone",
    "shown",
    "spend_guarantee",
    "spend_meaning",
]
