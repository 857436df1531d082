"""Pricing: what an event costs under a budget's accountant, shared by every rule.

``basic_price`` (exact basic composition in decimals), ``rdp_charge`` (an RDP curve rounded up on a
grid of orders), ``prv_epsilon`` / ``plan_epsilon`` (the PRV upper bound of a non-adaptive
composition), ``tight_epsilon`` (the tightest valid ε of ONE non-adaptive composition at a δ:
``accountant.prv.tight_epsilon`` in decimals), ``fresh_price`` (the price of ONE charge run on its
own: no filter needed). Each is memoized per request (``rules.memo``) and rounded up
(``ceil18``), never down. (A charge's naive figure: ``rules.naive``.)
"""

from __future__ import annotations

import decimal
import math
from decimal import ROUND_CEILING, Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Final

from accountant import events as ev
from accountant.errors import UnsupportedEventError
from accountant.events import DpEvent
from accountant.exact import (
    INFINITY,
    SIGNIFICANT_DIGITS,
    ZERO,
    as_written,
    exact_add,
    exact_mul,
    round_up,
)
from accountant.rdp_filter import as_charge, rdp_epsilon
from accountant.rules.memo import active_pricing, memoized

if TYPE_CHECKING:  # budget.py imports this module (a declared plan's ε)
    from accountant.rules.budget import Budget

_UP: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_CEILING, Emax=10**6, Emin=-(10**6))
_UP6: Final = decimal.Context(prec=6, rounding=ROUND_CEILING, Emax=10**6, Emin=-(10**6))


def ceil18(value: Decimal) -> Decimal:
    """Round a computed cost up to 18 significant digits (short numbers are unchanged)."""
    return value if value.is_infinite() or value == 0 else _UP.plus(value)


def delta_down(delta: Decimal) -> float:
    """A float ≤ the Decimal δ (a smaller δ gives a larger, safe ε)."""
    return math.nextafter(float(delta), 0.0) if delta > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Pricing: what an event costs under the budget's accountant
# ---------------------------------------------------------------------------------------------


def is_free(event: DpEvent) -> bool:
    """An event that touches no private data (no-ops, possibly composed or repeated)."""
    return memoized("free", None, event, None, lambda: _is_free(event))


def _is_free(event: DpEvent) -> bool:
    if isinstance(event, ev.NoOpEvent):
        return True
    if isinstance(event, ev.SelfComposedEvent):
        return event.count == 0 or _is_free(event.event)
    if isinstance(event, ev.ComposedEvent):
        return all(_is_free(e) for e in event.events)
    return False


def _basic_exact(event: DpEvent) -> tuple[Decimal, Decimal]:
    """Basic composition in exact decimals; user-written ε and δ are taken as written."""
    if isinstance(event, ev.NoOpEvent):
        return ZERO, ZERO
    if isinstance(event, ev.NonPrivateEvent):
        return INFINITY, ZERO
    if isinstance(event, ev.PureDpEvent):
        return as_written(event.epsilon), ZERO
    if isinstance(event, ev.ApproxDpEvent):
        return as_written(event.epsilon), as_written(event.delta)
    if isinstance(event, ev.LaplaceEvent):
        # Pure ε = 1/scale (sensitivity 1), the quotient rounded up.
        return _UP.divide(Decimal(1), as_written(event.scale)), ZERO
    if isinstance(event, ev.OutputPerturbationEvent):
        return as_written(event.epsilon), ZERO
    if isinstance(event, ev.SelfComposedEvent):
        if event.count == 0 or is_free(event.event):
            return ZERO, ZERO
        eps, dlt = _basic_exact(event.event)
        count = Decimal(event.count)
        return (INFINITY if eps.is_infinite() else exact_mul(eps, count)), exact_mul(dlt, count)
    if isinstance(event, ev.ComposedEvent):
        eps_total, dlt_total = ZERO, ZERO
        for child in event.events:
            eps, dlt = _basic_exact(child)
            eps_total = INFINITY if eps.is_infinite() else exact_add(eps_total, eps)
            dlt_total = exact_add(dlt_total, dlt)
        return eps_total, dlt_total
    # Formulas computed in floating point (e.g. L2DP-ML's Thm. 2): accountant.basic, rounded up.
    from accountant.basic import epsilon_delta

    eps_f, dlt_f = epsilon_delta(event)
    return round_up(eps_f), round_up(dlt_f)


def basic_price(event: DpEvent) -> tuple[Decimal, Decimal]:
    """(ε, δ) of ``event`` by basic composition in exact decimals: user numbers as written
    (``exact.as_written``), counts and sums exact, float formulas and 1/scale rounded up to 18 digits.

    ``UnsupportedEventError`` for Gaussian and sampled events (no pure/approximate DP form).
    """
    return memoized("basic", None, event, None, lambda: _basic_exact(event))


def rdp_charge(event: DpEvent, orders: tuple[float, ...]) -> tuple[Decimal, ...]:
    """The event's RDP at ``orders`` (``accountant.rdp.compute_rdp``), each rounded UP."""
    return memoized("rdp", None, event, orders, lambda: _rdp_charge(event, orders))


@lru_cache(maxsize=4096)
def _rdp_charge(event: DpEvent, orders: tuple[float, ...]) -> tuple[Decimal, ...]:
    if is_free(event):
        return tuple(ZERO for _ in orders)
    from accountant.rdp import compute_rdp

    return as_charge([float(v) for v in compute_rdp(event, orders)])


@lru_cache(maxsize=1024)
def prv_epsilon(plan: tuple[DpEvent, ...], delta: Decimal) -> Decimal:
    """PRV upper ε of the non-adaptive composition ``plan`` at δ (``accountant.prv``)."""
    steps = tuple(e for e in plan if not is_free(e))
    if not steps:
        return ZERO
    from accountant.registry import make_accountant

    accountant = make_accountant("prv")
    for step in steps:
        accountant.compose(step)
    return ceil18(round_up(accountant.get_epsilon(delta_down(delta)).upper))


def tight_epsilon(event: DpEvent, delta: Decimal) -> Decimal:
    """The tightest valid ε of ``event`` run as one non-adaptive composition at ``delta``,
    rounded up to 6 significant digits: ``accountant.prv.tight_epsilon`` (the analytic Gaussian for a
    Gaussian-only event, dp-accounting's pessimistic PLD or PRV otherwise, never above the RDP
    bound), at a float δ ≤ ``delta``.

    What a charge that needs no filter costs (pricing version 4), and the (εᵢ, δᵢ) a filter may
    take for one charge whose parameters were fixed before it ran. Rounded UP to 6 significant
    digits: a replayed certificate recomputes this number, and a last-ulp difference of a float
    engine (another numpy, another CPU) must not change the decimal it rounds to (it costs at
    most 1e-5 of ε). The engine is the pricing version's (``tight_engine``). Memoized per request
    and per process."""
    return memoized("tight", None, event, delta, lambda: _tight_epsilon(event, delta, tight_engine()))


def tight_engine() -> int:
    """The ``accountant.prv.tight_epsilon`` engine of the pricing version in force: 2 from pricing
    version 5 (heterogeneous events by ``accountant.pld``), 1 before."""
    return 2 if active_pricing() >= 5 else 1


@lru_cache(maxsize=1024)
def _tight_epsilon(event: DpEvent, delta: Decimal, engine: int) -> Decimal:
    if is_free(event):
        return ZERO
    from accountant.prv import tight_epsilon as tight_bound

    upper = tight_bound(event, delta_down(delta), engine=engine).upper
    return INFINITY if math.isinf(upper) else _UP6.plus(round_up(upper))


def plan_epsilon(plan: tuple[DpEvent, ...], delta: Decimal, pricing: str | None = None) -> Decimal:
    """A declared plan's ε at δ, as the budget prices its plans (``Budget.plan_pricing``):
    ``None``, the PRV upper bound of all its events (budgets stored before issue 25 §4); "tight-2",
    the tight ε of the plan as one composition (``accountant.prv.tight_epsilon`` engine 2, whatever
    pricing version is active: the budget fixes it), rounded up to 6 digits."""
    if pricing is None:
        return prv_epsilon(plan, delta)
    if pricing != "tight-2":
        raise ValueError(f"unknown plan pricing {pricing!r}")
    steps = tuple(e for e in plan if not is_free(e))
    if not steps:
        return ZERO
    return _tight_epsilon(steps[0] if len(steps) == 1 else ev.ComposedEvent(steps), delta, 2)


def single_charge_orders(budget: Budget) -> tuple[float, ...]:
    """The order grid a single charge is priced on (accountant ``rdp``): the RDP accountant's own
    grid (``accountant.rdp.DEFAULT_ORDERS``, what ``ledger epsilon --accountant rdp`` uses) joined
    with the budget's filter orders. A single charge needs no filter, so it needs no fixed grid:
    any grid gives a valid bound and a finer one a tighter bound."""
    assert budget.orders is not None
    return _joined_orders(budget.orders)


@lru_cache(maxsize=64)
def _joined_orders(orders: tuple[float, ...]) -> tuple[float, ...]:
    from accountant.rdp import DEFAULT_ORDERS

    return tuple(sorted(set(DEFAULT_ORDERS) | set(orders)))


def fresh_price(budget: Budget, event: DpEvent, delta: Decimal | None = None) -> tuple[Decimal, Decimal]:
    """(ε, δ) of ``event`` as ONE charge run on its own, at δ (default the budget's).

    One mechanism whose parameters were fixed before it ran needs no filter and no δ split, so
    its price is the smallest of the valid bounds we have:

    * ``basic`` (every accountant): exact basic composition, when its δ fits — a pure ``ε``
      costs exactly ``ε``;
    * ε = 0 when every step runs on a Poisson sample and δ covers the coupling bound
      1 − Π(1 − qᵢ) (``accountant.rdp.untouched_delta``);
    * since pricing version 4, whatever the accountant (``rdp`` or ``prv``): ``tight_epsilon``,
      the tightest valid ε of the event alone (exact for a Gaussian-only event). A budget's
      accountant says how its *adaptive* spend composes (the filter); a single charge composes
      with nothing, so the accountant need not bound it;
    * before version 4, ``rdp``: the event's RDP curve on the accountant's full grid
      (``single_charge_orders``) converted at δ (Balle et al. 2020, Thm. 21); ``prv``: the PRV
      upper bound.

    The δ charged is the budget's δ (or the given one), or the basic δ when that bound is used.
    """
    return memoized("fresh", budget, event, delta, lambda: _fresh_price(budget, event, delta))


def _fresh_price(budget: Budget, event: DpEvent, delta: Decimal | None) -> tuple[Decimal, Decimal]:
    if budget.accountant == "basic" or (budget.accountant == "tight" and budget.orders is None):
        # ``tight`` at δ = 0 holds no grid: pure DP only, as ``basic``
        return basic_price(event)
    at = budget.delta if delta is None else delta
    if is_free(event):
        return ZERO, ZERO
    if active_pricing() < 2:  # a certificate issued before pricing version 2, replayed
        if budget.accountant in ("rdp", "tight"):
            assert budget.orders is not None
            legacy = rdp_epsilon(rdp_charge(event, budget.orders), budget.orders, delta_down(at))
        else:
            legacy = prv_epsilon((event,), at)
        return legacy, (at if legacy > 0 else ZERO)
    if active_pricing() >= 4:
        eps, dlt = _coupling_price(event, at) or (tight_epsilon(event, at), at)
    elif budget.accountant in ("rdp", "tight"):
        eps, dlt = _single_rdp_price(event, single_charge_orders(budget), at)
    else:
        eps, dlt = prv_epsilon((event,), at), at
    exact = _basic_if_supported(event)
    if exact is not None and exact[1] <= at and exact[0] <= eps:
        return exact
    return eps, dlt


def _coupling_price(event: DpEvent, delta: Decimal) -> tuple[Decimal, Decimal] | None:
    """(0, 1 − p₀) when every step runs on a Poisson sample and δ covers 1 − p₀, else None."""
    from accountant.rdp import log_untouched, untouched_delta

    log_p0 = log_untouched(event)
    if log_p0 is not None and log_p0 != 0:
        coupling = round_up(untouched_delta(log_p0))
        if coupling <= delta:
            return ZERO, coupling  # (0, 1 − p₀)-DP by coupling, whatever the curve
    return None


def _single_rdp_price(event: DpEvent, orders: tuple[float, ...], delta: Decimal) -> tuple[Decimal, Decimal]:
    coupled = _coupling_price(event, delta)
    if coupled is not None:
        return coupled
    curve = rdp_charge(event, orders)
    if all(v == 0 for v in curve):
        return ZERO, ZERO  # ρ(α) = 0 at every order: the output does not depend on the record
    return rdp_epsilon(curve, orders, delta_down(delta)), delta


def _basic_if_supported(event: DpEvent) -> tuple[Decimal, Decimal] | None:
    try:
        return basic_price(event)
    except UnsupportedEventError:
        return None
