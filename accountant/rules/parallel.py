"""Parallel rule: each batch may be read by one reservation only; the dataset's ε is the maximum.

Theorem relied on: **parallel composition** (McSherry 2009, "Privacy integrated queries",
Thm. 4): mechanisms run on disjoint subsets of the data compose to the maximum of their ε (and
δ), because a record's presence affects only the one mechanism that read its subset. DP continual
learning with pre-trained models states the setting as **assumption S2** (task boundaries do not
overlap, no previous sample is stored or replayed, so every task's data is used once) and bases
its accounting on parallel composition. The ledger *enforces* S2: a second reservation on a batch
is refused (``ChargeRefused("batch_already_read")``, answered 409), so each record bears at most
one charge.

The one charge of a batch is one mechanism whose parameters are fixed before it runs; its
(ε, δ) is the tightest valid bound for that event alone (``prices.fresh_price``): ``basic`` exact
basic composition; ``rdp`` and ``prv`` alike, since pricing version 4 (issue 25 §2), the event's
tight ε at the budget's δ (``prices.tight_epsilon``: the analytic Gaussian of Balle & Wang 2018,
exact, for Gaussians; dp-accounting's pessimistic PLD or PRV otherwise; never above the RDP
bound), or ε = 0 by the coupling bound of Poisson sampling — no filter and no δ split, because
nothing else composes with the batch's one charge; and for every accountant the exact basic
(ε, δ) when it is smaller and its δ fits (a pure ε costs exactly ε). Before version 4, ``rdp``
charged the event's RDP curve on the accountant's full order grid converted at δ (Balle et al.
2020, Thm. 21) and ``prv`` the PRV upper bound (Gopi, Lee & Wutschitz 2021).
Choosing a batch's event after seeing releases of *other* batches is fine: those outputs do not
depend on this batch's records. One DP-SGD run is one reservation, however many checkpoints it
commits (progressive commits of a prefix of the reserved run). Since pricing version 3 a
checkpoint on ``rdp`` / ``prv`` settles the whole reserved run: a trainer may stop on what it saw,
and a run stopped early is post-processing of the whole run (Dwork & Roth 2014, Prop. 2.1), while
its prefix's ε is no guarantee; ``basic`` keeps the exact sum of what ran (a valid odometer).

A charge that costs exactly nothing (ε = δ = 0: a ``no_op``, ``self_composed`` with ``count`` 0) is
refused (``InvalidArgumentError`` naming ``event``, answered 422): it would use up the batch's one
read while releasing nothing, so the batch could never be trained on. The other rules take a zero
charge harmlessly (sequential and lifelong add 0; a geometric zero charge takes no level).
"""

from __future__ import annotations

from dataclasses import replace

from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.exact import ZERO, exact_add
from accountant.rules.bookkeeping import progressive_cost, release_additive, settle_additive
from accountant.rules.budget import Budget
from accountant.rules.errors import Amount, BudgetExceeded, ChargeRefused
from accountant.rules.memo import active_pricing, event_fingerprint
from accountant.rules.prices import fresh_price
from accountant.rules.sequential import PARALLEL_OVER_BATCHES, budget_words
from accountant.rules.state import Admission, BatchState, Charge, Cost, Settlement


def _price(budget: Budget, event: DpEvent) -> Cost:
    eps, dlt = fresh_price(budget, event)
    return Cost(eps, dlt, eps, event_fingerprint(event))


def reserve(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    if state.reads > 0:
        raise ChargeRefused(
            "batch_already_read",
            "this batch has already been read by a reservation; under the parallel rule "
            "(assumption S2) every batch is read once.",
        )
    cost = _price(budget, charge.event)
    if cost.epsilon == 0 and cost.delta == 0:
        raise InvalidArgumentError(
            "event",
            f"costs nothing: this {charge.event.kind!r} event has epsilon = delta = 0, and under the "
            "parallel rule (assumption S2) a batch is read by one charge only, so a charge of 0 "
            "would use up the batch's one read. Reserve the run that trains on the batch.",
        )
    if not (cost.epsilon <= budget.epsilon and cost.delta <= budget.delta):
        raise BudgetExceeded(Amount(cost.epsilon, cost.delta), remaining(budget, state))
    new_state = replace(
        state,
        epsilon_held=exact_add(state.epsilon_held, cost.epsilon),
        delta_held=exact_add(state.delta_held, cost.delta),
        reads=state.reads + 1,
    )
    return Admission(new_state, cost)


def commit(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    # Pricing version 3: on ``rdp`` / ``prv`` a checkpoint settles the whole reserved run. Where
    # the run stops may depend on what it released, and the prefix's ε is then no guarantee; the
    # whole run's is (the stopped run is post-processing of it, Dwork & Roth 2014, Prop. 2.1).
    # It costs no capacity: the batch is read once whatever it is charged. ``basic`` prices each
    # step exactly and adds them, a valid privacy odometer (Rogers, Roth, Ullman & Vadhan 2016).
    if partial_event is not None and budget.accountant != "basic" and active_pricing() >= 3:
        partial_event = None
    now = progressive_cost(reserved, committed_before, partial_event, lambda partial: _price(budget, partial))
    return Settlement(settle_additive(state, now, committed_before), now)


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    # With nothing committed the read is freed too: the batch was never released.
    return release_additive(state, reserved, committed)


def remaining(budget: Budget, state: BatchState) -> Amount:
    if state.reads > 0:
        return Amount(ZERO, ZERO)
    return Amount(budget.epsilon, budget.delta)


def within_budget(budget: Budget, state: BatchState) -> bool:
    return (
        state.reads <= 1
        and exact_add(state.epsilon_spent, state.epsilon_held) <= budget.epsilon
        and exact_add(state.delta_spent, state.delta_held) <= budget.delta
        and (state.reads == 1 or (state.epsilon_spent == ZERO and state.epsilon_held == ZERO))
    )


_TIGHT_HOW = (
    "its tightest valid epsilon at delta alone (pricing version 4: the analytic Gaussian of Balle & "
    "Wang 2018 for Gaussians, else a pessimistic PLD or PRV upper bound, never above RDP; one "
    "mechanism fixed before it ran needs no filter)"
)


def theorem(budget: Budget) -> str:
    # The text a certificate cites is the one of the pricing version it was issued under.
    how = {
        "basic": "its basic-composition (epsilon, delta)",
        "rdp": "its RDP curve converted at delta (Balle et al. 2020, Thm. 21)",
        "prv": "the PRV accountant's upper bound at delta (Gopi, Lee & Wutschitz 2021)",
        "tight": "the smallest of its PRV upper bound (Gopi, Lee & Wutschitz 2021), its RDP curve "
        "converted at delta (Balle et al. 2020, Thm. 21) and its exact basic bound",
    }[budget.accountant]
    if budget.accountant != "basic" and active_pricing() >= 4:
        how = _TIGHT_HOW
    return (
        "Parallel composition (McSherry 2009, Thm. 4) under assumption S2 of DP continual "
        "learning with pre-trained models, enforced: each batch is read by one charge, costed "
        f"alone by {how}." + PARALLEL_OVER_BATCHES
    )


def stated_theorem(budget: Budget) -> str:
    """``theorem`` with the budget's (ε, δ), and what a run stopped early is charged."""
    stopped = (
        "a run stopped early is charged the sum of its steps' exact costs (a valid privacy odometer, "
        "Rogers, Roth, Ullman & Vadhan 2016)"
        if budget.accountant == "basic"
        else "a run stopped early, even because of what it released, is charged the whole reserved "
        "run, of which it is post-processing (Dwork & Roth 2014, Prop. 2.1)"
    )
    stated = f" Budget {budget_words(budget)} per charge; {stopped}."
    return theorem(budget).replace(PARALLEL_OVER_BATCHES, stated + PARALLEL_OVER_BATCHES)
