"""Sequential rule: a batch may be read any number of times; its spend composes all its charges.

Theorems relied on, by the budget's accountant:

* ``basic`` — **basic composition** (Dwork & Roth 2014, Thm. 3.16: (εᵢ, δᵢ)-DP mechanisms
  compose to (Σεᵢ, Σδᵢ)-DP), which stays valid when each (εᵢ, δᵢ) is chosen adaptively after
  seeing earlier outputs, provided charges are admitted only while Σεᵢ ≤ ε and Σδᵢ ≤ δ
  (Rogers, Roth, Ullman & Vadhan 2016, the basic-composition privacy filter). Costs are exact
  decimals: a user's ε is taken as written (100 charges of 0.01 fill ε = 1.0 exactly).
* ``rdp`` — the **Rényi privacy filter** of ``accountant.rdp_filter``: Feldman & Zrnic 2021,
  Thm. 3.1, at every order of the budget's grid, δ split over the active orders (equally, or by
  the weights of a grid placed for the budget, ``accountant.rdp_filter.placed_grid``), with the
  improved RDP→DP conversion (Balle et al. 2020, Thm. 21). The batch keeps its per-order sums;
  its ε fields are derived from them (``RenyiFilter.epsilon_of``).
* ``prv`` — the **PRV accountant's upper bound** (Gopi, Lee & Wutschitz 2021, Thm. 5.5: the
  composed privacy-loss distribution is computed with certified error bounds) for a *declared
  plan*: the events are fixed when the budget is created, so the composition is non-adaptive,
  which the PRV/PLD analysis needs. Reservation i on a batch must carry plan entry i exactly
  (``ChargeRefused("outside_plan")`` otherwise); one plan reservation is open per batch at a
  time. After entry i the batch's ε is min(PRV upper of the prefix, PRV upper of the whole plan):
  the prefix's output is a post-processing of the whole plan's output (Dwork & Roth Prop. 2.1).
  It is kept non-decreasing by taking the maximum with the spend before (a larger number is
  still an upper bound).

The other rule modules reuse this module's pricing: ``basic_price`` (exact), ``rdp_charge``
(per-order RDP rounded up), ``prv_epsilon`` and ``fresh_price`` (a charge's ε as a fresh,
single charge — the naive count and the parallel rule's cost).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from decimal import ROUND_CEILING, Decimal
from functools import lru_cache
from typing import Final

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.exact import (
    INFINITY,
    SIGNIFICANT_DIGITS,
    ZERO,
    as_written,
    exact_add,
    exact_mul,
    exact_sub,
    round_up,
    to_text,
)
from accountant.rdp_filter import as_charge, rdp_epsilon
from accountant.rules import (
    Admission,
    BatchState,
    Budget,
    BudgetExceeded,
    Charge,
    ChargeRefused,
    Cost,
    Settlement,
    active_pricing,
    event_fingerprint,
    memoized,
    renyi_filter,
)

_UP: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_CEILING, Emax=10**6, Emin=-(10**6))


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


def plan_epsilon(plan: tuple[DpEvent, ...], delta: Decimal) -> Decimal:
    """A declared plan's ε: PRV upper bound of all its events at the budget's δ."""
    return prv_epsilon(plan, delta)


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
    * ``rdp``: the event's RDP curve on the accountant's full grid (``single_charge_orders``)
      converted at δ (Balle et al. 2020, Thm. 21), or ε = 0 when every step runs on a Poisson
      sample and δ covers the coupling bound 1 − Π(1 − qᵢ) (``accountant.rdp.untouched_delta``);
    * ``prv``: the PRV upper bound.

    The δ charged is the budget's δ (or the given one), or the basic δ when that bound is used.
    """
    return memoized("fresh", budget, event, delta, lambda: _fresh_price(budget, event, delta))


def _fresh_price(budget: Budget, event: DpEvent, delta: Decimal | None) -> tuple[Decimal, Decimal]:
    if budget.accountant == "basic":
        return basic_price(event)
    at = budget.delta if delta is None else delta
    if is_free(event):
        return ZERO, ZERO
    if active_pricing() < 2:  # a certificate issued before pricing version 2, replayed
        assert budget.orders is not None or budget.accountant == "prv"
        if budget.accountant == "rdp":
            assert budget.orders is not None
            legacy = rdp_epsilon(rdp_charge(event, budget.orders), budget.orders, delta_down(at))
        else:
            legacy = prv_epsilon((event,), at)
        return legacy, (at if legacy > 0 else ZERO)
    if budget.accountant == "rdp":
        eps, dlt = _single_rdp_price(event, single_charge_orders(budget), at)
    else:
        eps, dlt = prv_epsilon((event,), at), at
    exact = _basic_if_supported(event)
    if exact is not None and exact[1] <= at and exact[0] <= eps:
        return exact
    return eps, dlt


def naive_price(budget: Budget, event: DpEvent) -> Decimal:
    """The ε ``event`` would cost as the batch's only charge, converted the way the budget
    converts its spend: the Rényi filter's own ``epsilon_of`` (its grid and δ split) for a filter
    budget, else ``fresh_price``. ``naive_sequential_epsilon`` adds these up; with the same
    conversion a single release's naive figure equals the ledger's charge (never below it)."""
    if budget.uses_filter and active_pricing() >= 2:
        assert budget.orders is not None
        return renyi_filter(budget).epsilon_of(rdp_charge(event, budget.orders))
    return fresh_price(budget, event)[0]


def _single_rdp_price(event: DpEvent, orders: tuple[float, ...], delta: Decimal) -> tuple[Decimal, Decimal]:
    from accountant.rdp import log_untouched, untouched_delta

    log_p0 = log_untouched(event)
    if log_p0 is not None and log_p0 != 0:
        coupling = round_up(untouched_delta(log_p0))
        if coupling <= delta:
            return ZERO, coupling  # (0, 1 − p₀)-DP by coupling, whatever the curve
    curve = rdp_charge(event, orders)
    if all(v == 0 for v in curve):
        return ZERO, ZERO  # ρ(α) = 0 at every order: the output does not depend on the record
    return rdp_epsilon(curve, orders, delta_down(delta)), delta


def _basic_if_supported(event: DpEvent) -> tuple[Decimal, Decimal] | None:
    from accountant.errors import UnsupportedEventError

    try:
        return basic_price(event)
    except UnsupportedEventError:
        return None


# ---------------------------------------------------------------------------------------------
# Exact vectors (per-order RDP sums)
# ---------------------------------------------------------------------------------------------


def zeros(n: int) -> tuple[Decimal, ...]:
    return tuple(ZERO for _ in range(n))


def vector(value: tuple[Decimal, ...] | None, n: int) -> tuple[Decimal, ...]:
    return zeros(n) if value is None else value


def vadd(a: Sequence[Decimal], b: Sequence[Decimal]) -> tuple[Decimal, ...]:
    return tuple(exact_add(x, y) for x, y in zip(a, b, strict=True))


def vsub(a: Sequence[Decimal], b: Sequence[Decimal], what: str) -> tuple[Decimal, ...]:
    out = tuple(exact_sub(x, y) for x, y in zip(a, b, strict=True))
    if any(v < 0 for v in out):
        raise InvalidArgumentError(f"state.{what}", "holds less than the reservation returns.")
    return out


def canonical(value: Sequence[Decimal]) -> tuple[Decimal, ...] | None:
    """All-zero sums are stored as ``None``, so reserve-then-cancel restores the state exactly."""
    return None if all(v == 0 for v in value) else tuple(value)


def sub(a: Decimal, b: Decimal, what: str) -> Decimal:
    out = exact_sub(a, b)
    if out < 0:
        raise InvalidArgumentError(f"state.{what}", "holds less than the reservation returns.")
    return out


def settle_additive(state: BatchState, now: Cost, before: Cost | None) -> BatchState:
    """Move ``now − before`` (cumulative committed costs) from held to spent, exactly."""
    step_eps = exact_sub(now.epsilon, ZERO if before is None else before.epsilon)
    step_dlt = exact_sub(now.delta, ZERO if before is None else before.delta)
    return replace(
        state,
        epsilon_spent=exact_add(state.epsilon_spent, step_eps),
        epsilon_held=sub(state.epsilon_held, step_eps, "epsilon_held"),
        delta_spent=exact_add(state.delta_spent, step_dlt),
        delta_held=sub(state.delta_held, step_dlt, "delta_held"),
        naive_epsilon=exact_add(state.naive_epsilon, _naive_step(now, before)),
    )


def release_additive(state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    """Return ``reserved − committed`` from held; with nothing committed, the read too."""
    reads = state.reads - 1 if committed is None else state.reads
    if reads < 0:
        raise InvalidArgumentError("state.reads", "has no reservation to cancel.")
    rest_eps = max(ZERO, exact_sub(reserved.epsilon, ZERO if committed is None else committed.epsilon))
    rest_dlt = max(ZERO, exact_sub(reserved.delta, ZERO if committed is None else committed.delta))
    return replace(
        state,
        epsilon_held=sub(state.epsilon_held, rest_eps, "epsilon_held"),
        delta_held=sub(state.delta_held, rest_dlt, "delta_held"),
        reads=reads,
    )


# ---------------------------------------------------------------------------------------------
# Fresh charges composed sequentially (basic sum or Rényi filter): shared with ``lifelong``
# ---------------------------------------------------------------------------------------------


def derive_filter_state(budget: Budget, state: BatchState) -> BatchState:
    """Recompute a filter batch's ε/δ fields from its per-order sums (deterministic)."""
    assert budget.orders is not None
    f = renyi_filter(budget)
    n = len(budget.orders)
    spent = vector(state.rdp_spent, n)
    total = vadd(spent, vector(state.rdp_held, n))
    eps_spent = f.epsilon_of(spent)
    eps_total = f.epsilon_of(total)
    delta_spent = budget.delta if any(v > 0 for v in spent) else ZERO
    delta_total = budget.delta if any(v > 0 for v in total) else ZERO
    return replace(
        state,
        epsilon_spent=eps_spent,
        epsilon_held=exact_sub(eps_total, eps_spent),
        delta_spent=delta_spent,
        delta_held=exact_sub(delta_total, delta_spent),
        rdp_spent=canonical(spent),
        rdp_held=state.rdp_held if state.rdp_held is None else canonical(state.rdp_held),
    )


def _filter_totals(budget: Budget, state: BatchState) -> tuple[Decimal, ...]:
    assert budget.orders is not None
    n = len(budget.orders)
    return vadd(vector(state.rdp_spent, n), vector(state.rdp_held, n))


def reserve_fresh(
    budget: Budget, state: BatchState, event: DpEvent, *, noise_commitment: str | None = None
) -> Admission:
    """Hold a fresh charge composed sequentially with everything the batch holds or spent."""
    fingerprint = event_fingerprint(event)
    if budget.uses_filter:
        assert budget.orders is not None
        f = renyi_filter(budget)
        charge = rdp_charge(event, budget.orders)
        total = _filter_totals(budget, state)
        before = f.epsilon_of(total)
        after_total = vadd(total, charge)
        if not f.admits(total, charge):
            raise BudgetExceeded(
                {
                    "epsilon": to_text(_increase(f.epsilon_of(after_total), before)),
                    "delta": to_text(budget.delta),
                },
                remaining(budget, state),
            )
        held = vadd(vector(state.rdp_held, len(budget.orders)), charge)
        new_state = derive_filter_state(
            budget, replace(state, rdp_held=canonical(held), reads=state.reads + 1)
        )
        naive = naive_price(budget, event)
        cost = Cost(
            epsilon=exact_sub(exact_add(new_state.epsilon_spent, new_state.epsilon_held), before),
            delta=exact_sub(
                exact_add(new_state.delta_spent, new_state.delta_held),
                exact_add(state.delta_spent, state.delta_held),
            ),
            naive_epsilon=naive,
            fingerprint=fingerprint,
            rdp=charge,
            noise_commitment=noise_commitment,
        )
        return Admission(new_state, cost)
    eps, dlt = basic_price(event)
    eps_total = exact_add(exact_add(state.epsilon_spent, state.epsilon_held), eps)
    dlt_total = exact_add(exact_add(state.delta_spent, state.delta_held), dlt)
    if not (eps_total <= budget.epsilon and dlt_total <= budget.delta):
        raise BudgetExceeded({"epsilon": to_text(eps), "delta": to_text(dlt)}, remaining(budget, state))
    new_state = replace(
        state,
        epsilon_held=exact_add(state.epsilon_held, eps),
        delta_held=exact_add(state.delta_held, dlt),
        reads=state.reads + 1,
    )
    cost = Cost(eps, dlt, eps, fingerprint, noise_commitment=noise_commitment)
    return Admission(new_state, cost)


def _increase(after: Decimal, before: Decimal) -> Decimal:
    return INFINITY if after.is_infinite() else max(ZERO, exact_sub(after, before))


def price_fresh(budget: Budget, event: DpEvent, noise_commitment: str | None) -> Cost:
    """The cumulative cost of the run ``event`` for a fresh charge (before settling)."""
    if budget.uses_filter:
        assert budget.orders is not None
        naive = naive_price(budget, event)
        return Cost(
            ZERO,
            ZERO,
            naive,
            event_fingerprint(event),
            rdp=rdp_charge(event, budget.orders),
            noise_commitment=noise_commitment,
        )
    eps, dlt = basic_price(event)
    return Cost(eps, dlt, eps, event_fingerprint(event), noise_commitment=noise_commitment)


def is_prefix(partial: DpEvent, event: DpEvent) -> bool:
    """Whether running ``partial`` is a prefix of running ``event`` (its output is part of the
    full run's transcript, so its privacy loss is at most the full run's)."""
    if partial == event or is_free(partial):
        return True
    if isinstance(event, ev.SelfComposedEvent) and event.count >= 1:
        inner = event.event
        if partial == inner:
            return True
        if isinstance(partial, ev.SelfComposedEvent):
            return partial.event == inner and partial.count <= event.count
        if isinstance(partial, ev.ComposedEvent):
            return len(partial.events) <= event.count and all(e == inner for e in partial.events)
        return False
    if isinstance(event, ev.ComposedEvent) and event.events:
        if not isinstance(partial, ev.ComposedEvent):
            return is_prefix(partial, event.events[0])
        n = len(partial.events)
        if n == 0:
            return True
        if n > len(event.events) or partial.events[: n - 1] != event.events[: n - 1]:
            return False
        return is_prefix(partial.events[n - 1], event.events[n - 1])
    return False


def bound_by_reservation(cost: Cost, reserved: Cost, *, compare_epsilon: bool = True) -> Cost:
    """Never more than reserved: the run so far is a prefix of the reserved run (``rules.commit``
    refuses anything else), so its cost is at most the reserved cost mathematically; the cap
    absorbs numerical noise (a prefix priced on its own may round a hair above the whole)."""
    return _pointwise(min, cost, reserved, compare_epsilon=compare_epsilon)


def at_least(cost: Cost, before: Cost | None, *, compare_epsilon: bool = True) -> Cost:
    """Spend is never taken back: the cumulative cost is at least what was committed before
    (the maximum of two upper bounds on the same run is an upper bound)."""
    if before is None:
        return cost
    return _pointwise(max, cost, before, compare_epsilon=compare_epsilon)


def _pointwise(
    pick: Callable[[Decimal, Decimal], Decimal], cost: Cost, other: Cost, *, compare_epsilon: bool
) -> Cost:
    """``cost`` with each bound replaced by ``pick`` of it and ``other``'s: the naive ε, the
    per-order RDP (when both have it) and, with ``compare_epsilon``, ε and δ."""
    return replace(
        cost,
        epsilon=pick(cost.epsilon, other.epsilon) if compare_epsilon else cost.epsilon,
        delta=pick(cost.delta, other.delta) if compare_epsilon else cost.delta,
        naive_epsilon=pick(cost.naive_epsilon, other.naive_epsilon),
        rdp=None
        if cost.rdp is None or other.rdp is None
        else tuple(pick(c, o) for c, o in zip(cost.rdp, other.rdp, strict=True)),
    )


def progressive_cost(
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
    price: Callable[[DpEvent], Cost],
) -> Cost:
    """The cumulative cost a commit settles: the reserved cost for the whole run, or the
    ``price`` of the run so far (``partial_event``) bounded by the reservation; never less than
    what was committed before."""
    if partial_event is None:
        now = reserved
    else:
        now = bound_by_reservation(price(partial_event), reserved)
    return at_least(now, committed_before)


def commit_fresh(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    """Progressive commit of a fresh sequential charge (basic sum or Rényi filter)."""
    if partial_event is None:
        now = replace(reserved, epsilon=ZERO, delta=ZERO) if budget.uses_filter else reserved
    else:
        now = price_fresh(budget, partial_event, reserved.noise_commitment)
        now = bound_by_reservation(now, reserved, compare_epsilon=not budget.uses_filter)
    now = at_least(now, committed_before, compare_epsilon=not budget.uses_filter)
    if budget.uses_filter:
        assert budget.orders is not None and now.rdp is not None
        n = len(budget.orders)
        step = (
            now.rdp
            if committed_before is None or committed_before.rdp is None
            else vsub(now.rdp, committed_before.rdp, "rdp")
        )
        spent = vadd(vector(state.rdp_spent, n), step)
        held = vsub(vector(state.rdp_held, n), step, "rdp_held")
        new_state = derive_filter_state(
            budget,
            replace(
                state,
                rdp_spent=canonical(spent),
                rdp_held=canonical(held),
                naive_epsilon=exact_add(state.naive_epsilon, _naive_step(now, committed_before)),
            ),
        )
        # The ε/δ of a filter charge are indicators (the batch's derived ε is not additive):
        # the committed one grows by what the batch's spent ε grew, capped at the reserved one,
        # so callers that aggregate costs see 0 ≤ committed ≤ reserved, never decreasing.
        base_eps = ZERO if committed_before is None else committed_before.epsilon
        base_dlt = ZERO if committed_before is None else committed_before.delta
        grown_eps = exact_add(base_eps, exact_sub(new_state.epsilon_spent, state.epsilon_spent))
        grown_dlt = exact_add(base_dlt, exact_sub(new_state.delta_spent, state.delta_spent))
        now = replace(
            now,
            epsilon=max(base_eps, min(reserved.epsilon, grown_eps)),
            delta=max(base_dlt, min(reserved.delta, grown_dlt)),
        )
        return Settlement(new_state, now)
    return Settlement(settle_additive(state, now, committed_before), now)


def _naive_step(now: Cost, before: Cost | None) -> Decimal:
    return exact_sub(now.naive_epsilon, ZERO if before is None else before.naive_epsilon)


def cancel_fresh(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    """Return a fresh charge's uncommitted hold; with nothing committed, its read too."""
    if not budget.uses_filter:
        return release_additive(state, reserved, committed)
    reads = state.reads - 1 if committed is None else state.reads
    if reads < 0:
        raise InvalidArgumentError("state.reads", "has no reservation to cancel.")
    if budget.uses_filter:
        assert budget.orders is not None
        n = len(budget.orders)
        reserved_rdp = vector(reserved.rdp, n)
        committed_rdp = zeros(n) if committed is None else vector(committed.rdp, n)
        rest = tuple(max(ZERO, exact_sub(r, c)) for r, c in zip(reserved_rdp, committed_rdp, strict=True))
        held = vsub(vector(state.rdp_held, n), rest, "rdp_held")
        return derive_filter_state(budget, replace(state, rdp_held=canonical(held), reads=reads))


def remaining_fresh(budget: Budget, state: BatchState) -> dict[str, str]:
    if budget.uses_filter:
        f = renyi_filter(budget)
        used = f.epsilon_of(_filter_totals(budget, state))
        # The filter's δ is fixed at creation, not consumed charge by charge.
        return {
            "epsilon": to_text(max(ZERO, exact_sub(budget.epsilon, used))),
            "delta": to_text(budget.delta),
        }
    return {
        "epsilon": to_text(
            max(ZERO, exact_sub(budget.epsilon, exact_add(state.epsilon_spent, state.epsilon_held)))
        ),
        "delta": to_text(max(ZERO, exact_sub(budget.delta, exact_add(state.delta_spent, state.delta_held)))),
    }


def within_budget_fresh(budget: Budget, state: BatchState) -> bool:
    if budget.uses_filter:
        return renyi_filter(budget).fits(_filter_totals(budget, state))
    return (
        exact_add(state.epsilon_spent, state.epsilon_held) <= budget.epsilon
        and exact_add(state.delta_spent, state.delta_held) <= budget.delta
    )


# ---------------------------------------------------------------------------------------------
# Declared plan (prv)
# ---------------------------------------------------------------------------------------------


def _plan_target(budget: Budget, position: int, last: DpEvent) -> Decimal:
    """min(PRV ε of plan entries 0..position−1 followed by ``last``, the plan's ε)."""
    assert budget.plan is not None and budget.plan_epsilon is not None
    plan, plan_epsilon = budget.plan, budget.plan_epsilon

    def compute() -> Decimal:
        return min(prv_epsilon((*plan[:position], last), budget.delta), plan_epsilon)

    return memoized("plan_target", budget, last, position, compute)


def _reserve_plan(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    assert budget.plan is not None
    position = state.plan_position
    if state.plan_open:
        raise ChargeRefused(
            "plan_step_pending",
            f"plan entry {position - 1} is reserved on this batch and not settled; commit or "
            "abort it first (a declared plan runs in order).",
        )
    if position >= len(budget.plan):
        raise ChargeRefused(
            "outside_plan",
            f"all {len(budget.plan)} entries of the declared plan have been used on this batch.",
        )
    expected = budget.plan[position]
    if charge.event != expected:
        raise ChargeRefused(
            "outside_plan",
            f"the next charge on this batch must be plan entry {position}: "
            f"{ev.to_json(expected)}. Found {ev.to_json(charge.event)}.",
        )
    target = _plan_target(budget, position, budget.plan[position])
    base = exact_add(state.epsilon_spent, state.epsilon_held)
    eps = max(ZERO, exact_sub(target, base))
    dlt = ZERO if target == 0 else exact_sub(budget.delta, exact_add(state.delta_spent, state.delta_held))
    dlt = max(ZERO, dlt)
    if exact_add(base, eps) > budget.epsilon:  # cannot happen: target ≤ plan ε ≤ ε
        raise BudgetExceeded({"epsilon": to_text(eps), "delta": to_text(dlt)}, remaining(budget, state))
    naive, _ = fresh_price(budget, charge.event)
    cost = Cost(
        eps,
        dlt,
        naive,
        event_fingerprint(charge.event),
        plan_position=position,
    )
    new_state = replace(
        state,
        epsilon_held=exact_add(state.epsilon_held, eps),
        delta_held=exact_add(state.delta_held, dlt),
        reads=state.reads + 1,
        plan_position=position + 1,
        plan_open=True,
    )
    return Admission(new_state, cost)


def _commit_plan(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    assert budget.plan is not None
    position = reserved.plan_position
    if position is None or not state.plan_open or position != state.plan_position - 1:
        raise InvalidArgumentError("reserved.plan_position", "is not the open plan entry of this batch.")

    def price(partial: DpEvent) -> Cost:
        base = exact_sub(state.epsilon_spent, ZERO if committed_before is None else committed_before.epsilon)
        target = _plan_target(budget, position, partial)
        naive, _ = fresh_price(budget, partial)
        return Cost(
            max(ZERO, exact_sub(target, base)),
            reserved.delta,
            naive,
            event_fingerprint(partial),
            plan_position=position,
        )

    now = progressive_cost(reserved, committed_before, partial_event, price)
    new_state = settle_additive(state, now, committed_before)
    return Settlement(replace(new_state, plan_open=partial_event is not None), now)


def _cancel_plan(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    position = reserved.plan_position
    if position is None or position != state.plan_position - 1:
        raise InvalidArgumentError("reserved.plan_position", "is not the last plan entry of this batch.")
    released = release_additive(state, reserved, committed)
    return replace(
        released,
        plan_position=position if committed is None else state.plan_position,
        plan_open=False,
    )


# ---------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------


def reserve(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    if budget.accountant == "prv":
        return _reserve_plan(budget, state, charge)
    return reserve_fresh(budget, state, charge.event)


def commit(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    if budget.accountant == "prv":
        return _commit_plan(budget, state, charge, reserved, committed_before, partial_event)
    return commit_fresh(budget, state, charge, reserved, committed_before, partial_event)


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    if budget.accountant == "prv":
        return _cancel_plan(budget, state, reserved, committed)
    return cancel_fresh(budget, state, reserved, committed)


def remaining(budget: Budget, state: BatchState) -> dict[str, str]:
    if budget.accountant == "prv":
        assert budget.plan_epsilon is not None
        used = exact_add(state.epsilon_spent, state.epsilon_held)
        return {
            "epsilon": to_text(max(ZERO, exact_sub(budget.epsilon, used))),
            "delta": to_text(
                max(ZERO, exact_sub(budget.delta, exact_add(state.delta_spent, state.delta_held)))
            ),
        }
    return remaining_fresh(budget, state)


def within_budget(budget: Budget, state: BatchState) -> bool:
    if budget.accountant == "prv":
        assert budget.plan is not None and budget.plan_epsilon is not None
        return (
            exact_add(state.epsilon_spent, state.epsilon_held) <= budget.plan_epsilon <= budget.epsilon
            and exact_add(state.delta_spent, state.delta_held) <= budget.delta
            and state.plan_position <= len(budget.plan)
        )
    return within_budget_fresh(budget, state)


THEOREMS: Final = {
    "basic": (
        "Sequential composition per batch by basic composition (Dwork & Roth 2014, Thm. 3.16), "
        "valid for adaptively chosen charges admitted while the sums fit (Rogers, Roth, Ullman & "
        "Vadhan 2016, basic-composition privacy filter); exact decimal sums."
    ),
    "rdp": (
        "Sequential composition per batch by a Renyi privacy filter (Feldman & Zrnic 2021, "
        "Thm. 3.1) at every order of a grid fixed at budget creation, delta split equally over "
        "the active orders (union bound over the orders' filter events; Lecuyer 2021), improved "
        "RDP-to-DP conversion (Balle et al. 2020, Thm. 21; Canonne, Kamath & Steinke 2020, "
        "Prop. 12)."
    ),
    "prv": (
        "Sequential composition per batch of a declared, non-adaptive plan by the PRV "
        "accountant's upper bound (Gopi, Lee & Wutschitz 2021); a prefix of the plan is "
        "post-processing of the whole plan (Dwork & Roth 2014, Prop. 2.1)."
    ),
}
PARALLEL_OVER_BATCHES: Final = (
    " Disjoint batches compose in parallel: the dataset's epsilon is the maximum over batches "
    "(McSherry 2009, Thm. 4)."
)


def theorem(budget: Budget) -> str:
    return THEOREMS[budget.accountant] + PARALLEL_OVER_BATCHES


__all__ = [
    "basic_price",
    "cancel",
    "commit",
    "fresh_price",
    "is_prefix",
    "naive_price",
    "plan_epsilon",
    "prv_epsilon",
    "rdp_charge",
    "remaining",
    "reserve",
    "single_charge_orders",
    "theorem",
    "within_budget",
]
