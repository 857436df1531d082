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
* ``tight`` (the default) — the **union of two privacy filters** of ``accountant.rules.tight``:
  basic composition over each charge's own tight (ε, δ) (Rogers, Roth, Ullman & Vadhan 2016,
  Thm. 3.6) and the Rényi filter (Feldman & Zrnic 2021, Thm. 3.1); a charge runs while either
  admits the full list of what the batch ran (proof: docs/ACCOUNTING.md, "The union of filters").
* ``prv`` — the **PRV accountant's upper bound** (Gopi, Lee & Wutschitz 2021, Thm. 5.5: the
  composed privacy-loss distribution is computed with certified error bounds) for a *declared
  plan*: the events are fixed when the budget is created, so the composition is non-adaptive,
  which the PRV/PLD analysis needs. Reservation i on a batch must carry plan entry i exactly
  (``ChargeRefused("outside_plan")`` otherwise); one plan reservation is open per batch at a
  time. After entry i the batch's ε is min(PRV upper of the prefix, PRV upper of the whole plan):
  the prefix's output is a post-processing of the whole plan's output (Dwork & Roth Prop. 2.1).
  It is kept non-decreasing by taking the maximum with the spend before (a larger number is
  still an upper bound).

  **Plan segments.** A budget may declare further plans after creation (``Budget.with_segment``),
  each priced (εᵢ, δᵢ) = (PRV upper ε at its share δᵢ, δᵢ) when it is declared, before any of it
  runs. Segments compose by **basic composition under fully adaptive choice** — the
  basic-composition privacy filter of Rogers, Roth, Ullman & Vadhan 2016 (Thm. 3.6): the
  (εᵢ, δᵢ) of segment i may depend on everything segments 0..i−1 released, provided Σεᵢ ≤ ε and
  Σδᵢ ≤ δ. PRV profiles of adaptively chosen segments are *not* composed: a filter over whole
  privacy profiles is not valid in general (natural approximate-DP filters can fail against an
  adaptive analyst). Declaring a segment closes the open one on every batch
  (``close_segment``): a batch that ran any of it is charged its whole (εᵢ, δᵢ), one that ran
  none of it nothing. Within the open segment a batch runs its entries in order, as above.

The other rule modules reuse this module's pricing: ``basic_price`` (exact), ``rdp_charge``
(per-order RDP rounded up), ``prv_epsilon`` and ``fresh_price`` (a charge's ε as a fresh,
single charge — the naive count and the parallel rule's cost).
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Final

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.exact import (
    INFINITY,
    ZERO,
    exact_add,
    exact_sub,
    exact_sum,
    shown,
    to_text,
)
from accountant.rules import tight
from accountant.rules.bookkeeping import (
    at_least,
    bound_by_reservation,
    canonical,
    naive_step,
    progressive_cost,
    release_additive,
    settle_additive,
    vadd,
    vector,
    vsub,
    zeros,
)
from accountant.rules.budget import Budget, PlanSegment, renyi_filter
from accountant.rules.errors import Amount, BudgetExceeded, ChargeRefused
from accountant.rules.memo import active_pricing, event_fingerprint, memoized
from accountant.rules.naive import naive_price
from accountant.rules.prices import basic_price, fresh_price, is_free, prv_epsilon, rdp_charge
from accountant.rules.state import Admission, BatchState, Charge, Cost, Settlement

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
    if budget.uses_union:
        return tight.reserve(budget, state, event, noise_commitment=noise_commitment)
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
                Amount(_increase(f.epsilon_of(after_total), before), budget.delta), remaining(budget, state)
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
        raise BudgetExceeded(Amount(eps, dlt), remaining(budget, state))
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
    if budget.uses_union:
        return tight.price(budget, event, noise_commitment, focus=None, with_rdp=True)
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


def commit_fresh(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    """Progressive commit of a fresh sequential charge (basic sum, Rényi filter or union)."""
    if budget.uses_union:
        return tight.commit(budget, state, reserved, committed_before, partial_event)
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
                naive_epsilon=exact_add(state.naive_epsilon, naive_step(now, committed_before)),
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


def cancel_fresh(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    """Return a fresh charge's uncommitted hold; with nothing committed, its read too."""
    if budget.uses_union:
        return tight.cancel(budget, state, reserved, committed)
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


def remaining_fresh(budget: Budget, state: BatchState) -> Amount:
    if budget.uses_union:
        return tight.remaining(budget, state)
    if budget.uses_filter:
        f = renyi_filter(budget)
        used = f.epsilon_of(_filter_totals(budget, state))
        # The filter's δ is fixed at creation, not consumed charge by charge.
        return Amount(max(ZERO, exact_sub(budget.epsilon, used)), budget.delta)
    return Amount(
        max(ZERO, exact_sub(budget.epsilon, exact_add(state.epsilon_spent, state.epsilon_held))),
        max(ZERO, exact_sub(budget.delta, exact_add(state.delta_spent, state.delta_held))),
    )


def within_budget_fresh(budget: Budget, state: BatchState) -> bool:
    if budget.uses_union:
        return tight.within_budget(budget, state)
    if budget.uses_filter:
        return renyi_filter(budget).fits(_filter_totals(budget, state))
    return (
        exact_add(state.epsilon_spent, state.epsilon_held) <= budget.epsilon
        and exact_add(state.delta_spent, state.delta_held) <= budget.delta
    )


# ---------------------------------------------------------------------------------------------
# Declared plan (prv)
# ---------------------------------------------------------------------------------------------


def _open_segment(budget: Budget) -> tuple[int, PlanSegment]:
    """The segment reservations run now: the last one declared."""
    segments = budget.plan_segments
    assert segments, "a sequential prv budget has a declared plan"
    return len(segments) - 1, segments[-1]


def _closed_cost(budget: Budget, state: BatchState) -> tuple[Decimal, Decimal]:
    """(Σεᵢ, Σδᵢ) of the closed segments this batch ran: each is charged its whole declared
    (εᵢ, δᵢ), however much of it ran (``close_segment``)."""
    segments = budget.plan_segments
    return (
        exact_sum(segments[i].epsilon for i in state.plan_closed),
        exact_sum(segments[i].delta for i in state.plan_closed),
    )


def _plan_target(budget: Budget, position: int, last: DpEvent) -> Decimal:
    """What the open segment costs a batch that ran its entries 0..position−1 followed by
    ``last``: the segment's whole ε once any of them costs anything (pricing version 3), else 0.

    A trainer may stop a segment early because of what it released; the ε of the prefix that ran
    is then no (ε, δ) guarantee (that would be a privacy odometer; Rogers, Roth, Ullman & Vadhan
    2016), while the whole segment's ε bounds any stopping rule: the stopped run is a
    post-processing of the whole segment's output (Dwork & Roth 2014, Prop. 2.1). Charging it at
    the first entry costs no capacity — ``close_segment`` charges it anyway, and segments are
    admitted by their declared Σεᵢ ≤ ε, not by spend. Versions 1–2 (certificate replays) charged
    min(PRV ε of the prefix, the segment's ε), at the segment's δ."""
    index, segment = _open_segment(budget)
    ran = (*segment.plan[:position], last)

    def compute() -> Decimal:
        if active_pricing() >= 3:
            return ZERO if all(is_free(e) for e in ran) else segment.epsilon
        return min(prv_epsilon(ran, segment.delta), segment.epsilon)

    return memoized("plan_target", budget, last, (index, position), compute)


def _reserve_plan(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    index, segment = _open_segment(budget)
    plan = segment.plan
    position = state.plan_position
    named = "the declared plan" if index == 0 else f"plan segment {index}"
    if state.plan_open:
        raise ChargeRefused(
            "plan_step_pending",
            f"entry {position - 1} of {named} is reserved on this batch and not settled; commit or "
            "abort it first (a declared plan runs in order).",
        )
    if position >= len(plan):
        raise ChargeRefused(
            "outside_plan",
            f"all {len(plan)} entries of {named} have been used on this batch; declare a new plan "
            "segment to spend what the budget has left.",
        )
    expected = plan[position]
    if charge.event != expected:
        raise ChargeRefused(
            "outside_plan",
            f"the next charge on this batch must be entry {position} of {named}: "
            f"{ev.to_json(expected)}. Found {ev.to_json(charge.event)}.",
        )
    closed_eps, closed_dlt = _closed_cost(budget, state)
    target = exact_add(closed_eps, _plan_target(budget, position, expected))
    base = exact_add(state.epsilon_spent, state.epsilon_held)
    eps = max(ZERO, exact_sub(target, base))
    # The segment's δᵢ is charged with its first entry, whatever that entry's ε: an entry whose
    # PRV ε is 0 at δᵢ is (0, δᵢ)-DP, not (0, 0)-DP (100 steps at q = 1e-6 with σ = 0.001 reveal
    # a record with probability ≈ 1e-4). δ charged with the first entry that costs ε > 0
    # certified such a run (0, 0) (issue 24 §6).
    target_dlt = exact_add(closed_dlt, segment.delta)
    dlt = max(ZERO, exact_sub(target_dlt, exact_add(state.delta_spent, state.delta_held)))
    if exact_add(base, eps) > budget.epsilon:  # cannot happen: Σεᵢ ≤ ε (Budget.with_segment)
        raise BudgetExceeded(Amount(eps, dlt), remaining(budget, state))
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
    position = reserved.plan_position
    if position is None or not state.plan_open or position != state.plan_position - 1:
        raise InvalidArgumentError("reserved.plan_position", "is not the open plan entry of this batch.")
    closed_eps, _ = _closed_cost(budget, state)

    def price(partial: DpEvent) -> Cost:
        base = exact_sub(state.epsilon_spent, ZERO if committed_before is None else committed_before.epsilon)
        target = exact_add(closed_eps, _plan_target(budget, position, partial))
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


def close_segment(budget: Budget, state: BatchState) -> BatchState:
    """The batch's state once the open segment of ``budget`` is closed (a new one is declared).

    A batch that ran any entry of it (``plan_position`` > 0) is charged the segment's whole
    declared (εᵢ, δᵢ), not the PRV ε of the prefix it ran: where a segment stopped may depend on
    what it released, and a filter's parameters must be fixed before the mechanism runs
    (Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6); charging the realised prefix would be an
    odometer, which that paper shows cannot be had at a filter's price. A batch that ran none of
    it is charged nothing: it ran no mechanism of the segment, which is (0, 0)-DP on its records.
    Refused while an entry is reserved and not settled (``plan_step_pending``)."""
    if budget.rule != "sequential" or budget.accountant != "prv":
        raise InvalidArgumentError("budget", "plan segments apply to a sequential prv budget only.")
    index, segment = _open_segment(budget)
    if state.plan_open:
        raise ChargeRefused(
            "plan_step_pending",
            f"entry {state.plan_position - 1} of the open plan segment is reserved on this batch and "
            "not settled; commit or abort it before declaring the next segment.",
        )
    if state.plan_position == 0:
        return state
    closed_eps, closed_dlt = _closed_cost(budget, state)
    spent = max(state.epsilon_spent, exact_add(closed_eps, segment.epsilon))
    return replace(
        state,
        epsilon_spent=spent,
        delta_spent=max(state.delta_spent, exact_add(closed_dlt, segment.delta)),
        # The naive figure is never below the spend (``rules._naive_at_least_spent``).
        naive_epsilon=max(state.naive_epsilon, spent),
        plan_position=0,
        plan_closed=(*state.plan_closed, index),
    )


def plan_delta_ran(budget: Budget, state: BatchState) -> Decimal:
    """The least δ a batch in ``state`` is charged for the plan segments it ran: the whole δᵢ of
    every closed segment it ran, and of the open segment once any entry of it is reserved.
    Certificate verification checks a batch's δ against it (``accountant.certificates``)."""
    _, segment = _open_segment(budget)
    _, closed_dlt = _closed_cost(budget, state)
    return closed_dlt if state.plan_position == 0 else exact_add(closed_dlt, segment.delta)


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


def remaining(budget: Budget, state: BatchState) -> Amount:
    if budget.accountant == "prv":
        used = exact_add(state.epsilon_spent, state.epsilon_held)
        return Amount(
            max(ZERO, exact_sub(budget.epsilon, used)),
            max(ZERO, exact_sub(budget.delta, exact_add(state.delta_spent, state.delta_held))),
        )
    return remaining_fresh(budget, state)


def within_budget(budget: Budget, state: BatchState) -> bool:
    if budget.accountant == "prv":
        index, segment = _open_segment(budget)
        if list(state.plan_closed) != sorted(set(state.plan_closed)) or any(
            not 0 <= i < index for i in state.plan_closed
        ):
            return False
        closed_eps, closed_dlt = _closed_cost(budget, state)
        return (
            exact_add(state.epsilon_spent, state.epsilon_held) <= exact_add(closed_eps, segment.epsilon)
            and exact_add(state.delta_spent, state.delta_held) <= exact_add(closed_dlt, segment.delta)
            and exact_sum(s.epsilon for s in budget.plan_segments) <= budget.epsilon
            and exact_sum(s.delta for s in budget.plan_segments) <= budget.delta
            and state.plan_position <= len(segment.plan)
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
    "tight": tight.THEOREM,
}
SEGMENTS_THEOREM: Final = (
    "Sequential composition per batch of declared plan segments: each segment a non-adaptive "
    "plan priced (epsilon_i, delta_i) by the PRV accountant's upper bound at its delta share "
    "(Gopi, Lee & Wutschitz 2021; a prefix is post-processing of the whole segment, Dwork & Roth "
    "2014, Prop. 2.1), fixed when it is declared; segments composed by basic composition under "
    "fully adaptive choice of the segments and their parameters, admitted while sum epsilon_i <= "
    "epsilon and sum delta_i <= delta (Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6, the "
    "basic-composition privacy filter); a closed segment is charged its whole (epsilon_i, delta_i) "
    "on every batch that ran any of it."
)
PARALLEL_OVER_BATCHES: Final = (
    " Disjoint batches compose in parallel: the dataset's epsilon is the maximum over batches "
    "(McSherry 2009, Thm. 4)."
)


def budget_words(budget: Budget) -> str:
    """The budget's (ε, δ) as a theorem text states it."""
    return f"(epsilon = {to_text(budget.epsilon)}, delta = {to_text(budget.delta)})"


def filter_words(budget: Budget) -> str:
    """How the budget's Rényi filter splits δ, from its actual orders and weights."""
    f = renyi_filter(budget)
    active = [i for i, on in enumerate(f.active) if on]
    shares = sorted({Decimal(repr(f.delta_shares[i])) for i in active})
    equal = budget.delta_weights is None or len({budget.delta_weights[i] for i in active}) == 1
    how = (
        f"equally (delta_alpha = {shown(shares[0], 'down')} each)"
        if equal
        else "in proportion to the weights fixed at budget creation (delta_alpha from "
        f"{shown(shares[0], 'down')} to {shown(shares[-1], 'down')})"
    )
    return (
        f"at the {len(f.orders)} orders of a grid fixed at budget creation ({len(active)} active, alpha "
        f"{f.orders[active[0]]:g} to {f.orders[active[-1]]:g}), delta = {to_text(budget.delta)} split "
        f"over the active orders {how}"
    )


def stated_theorem(budget: Budget) -> str:
    """The theorem with the budget's own parameters (certificate version 3): its (ε, δ), and for
    the filter the orders and the δ split that is actually used — never "split equally" when the
    weights are not equal; for plan segments, each segment's (εᵢ, δᵢ)."""
    if budget.accountant == "basic":
        return THEOREMS["basic"] + f" Budget per batch {budget_words(budget)}." + PARALLEL_OVER_BATCHES
    if budget.accountant == "tight":
        words = budget_words(budget)
        if budget.orders is not None:
            words += "; filter B " + filter_words(budget)
        return tight.stated_theorem(budget, words) + PARALLEL_OVER_BATCHES
    if budget.accountant == "rdp":
        return (
            "Sequential composition per batch by a Renyi privacy filter (Feldman & Zrnic 2021, "
            f"Thm. 3.1) with budget {budget_words(budget)} {filter_words(budget)}; a union bound over "
            "the orders' filter events (Lecuyer 2021); improved RDP-to-DP conversion (Balle et al. 2020, "
            "Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12). The guarantee of every release is "
            "the filter's (epsilon, delta) under fully adaptive choices, stopping included; the "
            "filter's progress is no guarantee of its own (that would be a privacy odometer)."
            + PARALLEL_OVER_BATCHES
        )
    segments = "; ".join(
        f"segment {i}: {len(s.plan)} event(s), (epsilon_{i}, delta_{i}) <= ({shown(s.epsilon)}, "
        f"{shown(s.delta)})"
        for i, s in enumerate(budget.plan_segments)
    )
    priced_by = (
        "by the PRV accountant's upper bound at its delta share (Gopi, Lee & Wutschitz 2021)"
        if budget.plan_pricing is None
        else "by the tight upper bound of the plan as one non-adaptive composition at its delta "
        "share (the smallest of the analytic Gaussian, Balle & Wang 2018, Thm. 8; dp-accounting's "
        "pessimistic privacy loss distribution, Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022; "
        "the PRV accountant's upper bound, Gopi, Lee & Wutschitz 2021; RDP and basic composition)"
    )
    return (
        "Sequential composition per batch of declared plan segments, each a non-adaptive plan "
        f"priced (epsilon_i, delta_i) {priced_by} when it is declared, and charged whole on a batch "
        "from its first entry that costs anything: a run stopped early, even because of what it released, is "
        "post-processing of the whole segment (Dwork & Roth 2014, Prop. 2.1); segments composed by "
        "basic composition under fully adaptive choice, admitted while sum epsilon_i <= epsilon and "
        "sum delta_i <= delta (Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6); budget "
        f"{budget_words(budget)}; {segments}." + PARALLEL_OVER_BATCHES
    )


def theorem(budget: Budget) -> str:
    """The theorem certificate versions 1 and 2 cite (kept word for word: they re-verify
    against it); version 3 cites ``stated_theorem``.

    A budget created before segments existed (plan at the whole δ, none declared since) cites
    what it always cited, so its certificates re-verify unchanged."""
    if budget.accountant == "prv" and (budget.plan_delta is not None or budget.segments):
        return SEGMENTS_THEOREM + PARALLEL_OVER_BATCHES
    return THEOREMS[budget.accountant] + PARALLEL_OVER_BATCHES


__all__ = [
    "PARALLEL_OVER_BATCHES",
    "SEGMENTS_THEOREM",
    "THEOREMS",
    "budget_words",
    "cancel",
    "cancel_fresh",
    "close_segment",
    "commit",
    "commit_fresh",
    "derive_filter_state",
    "filter_words",
    "plan_delta_ran",
    "price_fresh",
    "remaining",
    "remaining_fresh",
    "reserve",
    "reserve_fresh",
    "stated_theorem",
    "theorem",
    "within_budget",
    "within_budget_fresh",
]
