"""The ``tight`` accountant: a charge is admitted while ANY of two privacy filters still admits
the full list of what ran on the batch; valid under fully adaptive choice, at the sum of their δ.

Filters
-------
**A — basic composition over tight per-charge prices.** Charge i is priced (εᵢ, δᵢ): its own
tight ε at δᵢ (``prices.tight_epsilon``: the analytic Gaussian for a Gaussian-only event,
dp-accounting's pessimistic PLD or the PRV upper bound otherwise, with the single-run RDP bound
and the exact basic bound where smaller), δᵢ = ``SHARE``·(δ_A − Σ_{j<i} δⱼ)
(a pure-DP charge: its exact ε at δᵢ = 0). A admits while Σεᵢ ≤ ε and Σδᵢ ≤ δ_A. The (εᵢ, δᵢ)
are functions of the declared event and of A's sums, i.e. of the past, never of the data:
Rogers, Roth, Ullman & Vadhan 2016 ("Privacy odometers and filters", Thm. 3.6, the
basic-composition filter) make A (ε, δ_A)-DP under fully adaptive choice.

**B — the Rényi filter** of ``accountant.rdp_filter`` over the budget's placed grid at δ_B
(Feldman & Zrnic 2021, Thm. 3.1; a union bound over its orders; improved conversion).

Both judge the FULL list of charges that ran on the batch (spent or held), whichever filter
admitted them, and both refusals are absorbing: B's sums only grow; A, once a charge it refused
runs (admitted by B), is closed for good (``basic_open``). Zero-cost charges touch no record and
are not part of the list.

Profiles (δ_A, δ_B), fixed at the batch's first charge
--------------------------------------------------------
Before a batch's first charge nothing that depends on its records has been released, so the
filters' parameters may be chosen from that charge's declared event, like any parameter fixed in
advance (conditioned on the analyst's first request every filter below is a fixed valid filter;
averaging over that request keeps (ε, δ)-DP):

* ``stream`` — the first charge fits B at the whole δ: (δ_A, δ_B) = (0, δ). B composes the
  stream at the Rényi rate; A at δ_A = 0 is the exact basic sum of pure-DP charges.
* ``run`` — it does not (a run calibrated close to the budget): (δ_A, δ_B) = (δ, 0). The run is
  charged its tight ε at ``SHARE``·δ; what follows is priced by A alone.

A budget with δ = 0 is ``run`` with δ_A = 0: the exact basic filter over pure-DP charges.
A batch whose reservations were all aborted before any commit (``reads`` 0) has released
nothing, and chooses again at its next charge.

Why the union is valid (docs/ACCOUNTING.md, "The union of filters"): let D_j be the first charge
that runs although filter j refused it. Some filter never departs (at the last departure the
charge ran because some k admitted it; k had departed earlier, and its refusal is absorbing on
the full list: contradiction). On the event that j* — the first filter that never departs — is
j, the transcript is the one the j-filtered interaction produces (j's refusals are data-independent
skips), and the event is a function of that transcript, so P(S) − e^ε Q(S) = Σ_j [P_j(S ∩ H_j) −
e^ε Q_j(S ∩ H_j)] ≤ Σ_j δ_j. A filter that kept only its own admitted list breaks this (two
basic filters each of budget ε, alternating: 2ε ran; docs/ACCOUNTING.md).

Progressive commits: A charged the whole reserved run at reservation (a run stopped early, even
because of what it released, is post-processing of the whole run: Dwork & Roth 2014, Prop. 2.1);
B the prefix's RDP, step by step (Feldman & Zrnic's filter is over steps). An abort with nothing
committed returns A's price; it never reopens A.
"""

from __future__ import annotations

import decimal
import math
from dataclasses import replace
from decimal import ROUND_CEILING, Decimal
from functools import lru_cache
from typing import Final

from accountant.errors import UnsupportedEventError
from accountant.events import DpEvent
from accountant.exact import INFINITY, ZERO, exact_add, exact_sub
from accountant.rdp_filter import RenyiFilter
from accountant.rules.bookkeeping import canonical, naive_step, vadd, vector, vsub, zeros
from accountant.rules.budget import Budget, renyi_filter
from accountant.rules.errors import Amount, BudgetExceeded
from accountant.rules.memo import event_fingerprint, memoized
from accountant.rules.prices import basic_price, is_free, rdp_charge, tight_epsilon
from accountant.rules.state import Admission, BatchState, Cost, Settlement

SHARE: Final = Decimal("0.99")
"""The part of A's δ left that a charge is priced at (the rest stays for later charges). A
DP-SGD run (q 0.01, 1 000 steps) priced at 0.99·δ costs 0.07% more ε than at δ."""
_DIGITS: Final = 6
_UP6: Final = decimal.Context(prec=_DIGITS, rounding=ROUND_CEILING)
_PAIR_ZERO: Final = (ZERO, ZERO)


# ---------------------------------------------------------------------------------------------
# A's price of one charge
# ---------------------------------------------------------------------------------------------


def run_price(event: DpEvent, delta: Decimal) -> tuple[Decimal, Decimal]:
    """A's (εᵢ, δᵢ) of ``event`` offered δᵢ = ``delta``: (0, 0) for a free event; the exact basic
    (ε, 0) of a pure-DP event; else the smaller of the exact basic bound (when its δ fits) and
    (``tight_epsilon`` at ``delta``, ``delta``). (∞, 0) when nothing is finite."""
    if is_free(event):
        return _PAIR_ZERO
    try:
        exact: tuple[Decimal, Decimal] | None = basic_price(event)
    except UnsupportedEventError:
        exact = None
    if exact is not None and exact[1] == 0 and exact[0].is_finite():
        return exact  # pure DP: exact, and it leaves δ to the charges that need it
    if delta <= 0:
        return INFINITY, ZERO
    eps = tight_epsilon(event, delta)
    if exact is not None and exact[1] <= delta and exact[0] <= eps:
        return exact
    return eps, delta


# ---------------------------------------------------------------------------------------------
# The batch's filters
# ---------------------------------------------------------------------------------------------


def profile_deltas(budget: Budget, profile: str) -> tuple[Decimal, Decimal]:
    """(δ_A, δ_B) of a profile: ``stream`` (0, δ), ``run`` (δ, 0)."""
    return (ZERO, budget.delta) if profile == "stream" else (budget.delta, ZERO)


def _pair(value: tuple[Decimal, Decimal] | None) -> tuple[Decimal, Decimal]:
    return _PAIR_ZERO if value is None else value


def _padd(a: tuple[Decimal, Decimal], b: tuple[Decimal, Decimal]) -> tuple[Decimal, Decimal]:
    return exact_add(a[0], b[0]), exact_add(a[1], b[1])


def _psub(a: tuple[Decimal, Decimal], b: tuple[Decimal, Decimal]) -> tuple[Decimal, Decimal]:
    return max(ZERO, exact_sub(a[0], b[0])), max(ZERO, exact_sub(a[1], b[1]))


def _stored(pair: tuple[Decimal, Decimal]) -> tuple[Decimal, Decimal] | None:
    return None if pair == _PAIR_ZERO else pair


def _basic_total(state: BatchState) -> tuple[Decimal, Decimal]:
    return _padd(_pair(state.basic_spent), _pair(state.basic_held))


def _rdp_total(budget: Budget, state: BatchState) -> tuple[Decimal, ...]:
    n = len(filter_b(budget, _state_focus(state)).orders)
    return vadd(vector(state.rdp_spent, n), vector(state.rdp_held, n))


# ---------------------------------------------------------------------------------------------
# B's grid: the budget's placed grid, plus an order focused on the batch's first charge
# ---------------------------------------------------------------------------------------------

FOCUS_WEIGHT: Final = Decimal("0.9")
"""The part of δ_B given to the focus order (the rest: the budget's grid, in its proportions).
Charges like the first one bind at the focus order, where the filter then loses only
log(1/0.9)/(α − 1) of ε against plain RDP composition at the whole δ; charges unlike it keep a
tenth of δ on the budget's grid."""
STREAM_FOCUS_WEIGHT: Final = Decimal("0.99")
"""The focus order's part when the first charge is at most 1/``STREAM_COPIES`` of the budget (by
plain RDP): many small charges, a stream of chunks of one computation, which then composes
within log(1/0.99)/(α − 1) of plain RDP composition at the whole δ."""
STREAM_COPIES: Final = 10.0
# Candidate focus orders: α − 1 = 10^(k/40) from 0.01 to 1000, 4 significant digits, then a finer
# search (steps of 10^(1/400)) around the best of them.
_COARSE: Final = tuple(sorted({float(f"{1.0 + 10.0 ** (k / 40.0):.4g}") for k in range(-80, 121)}))


Focus = tuple[float, Decimal]
"""A focus order and the part of δ_B it holds."""


def filter_b(budget: Budget, focus: Focus | None) -> RenyiFilter:
    """Filter B of a batch: the budget's Rényi filter, or with ``focus`` = (α_f, w_f) that
    filter's grid plus α_f holding w_f of δ (the grid's weights scaled by 1 − w_f)."""
    if focus is None or budget.orders is None:
        return renyi_filter(budget)
    return _focused(budget.epsilon, budget.delta, budget.orders, budget.delta_weights, focus[0], focus[1])


def _state_focus(state: BatchState) -> Focus | None:
    if state.union_focus is None or state.union_focus_weight is None:
        return None
    return state.union_focus, state.union_focus_weight


@lru_cache(maxsize=1024)
def _focused(
    epsilon: Decimal,
    delta: Decimal,
    orders: tuple[float, ...],
    weights: tuple[Decimal, ...] | None,
    focus: float,
    focus_weight: Decimal,
) -> RenyiFilter:
    base = (
        weights
        if weights is not None
        else tuple(_DOWN6.divide(Decimal(1), Decimal(len(orders))) for _ in orders)
    )
    rest = Decimal(1) - focus_weight
    merged: dict[float, Decimal] = {a: _DOWN6.multiply(w, rest) for a, w in zip(orders, base, strict=True)}
    merged[focus] = merged.get(focus, ZERO) + focus_weight
    grid = tuple(sorted(merged))
    return RenyiFilter(epsilon=epsilon, delta=delta, orders=grid, weights=tuple(merged[a] for a in grid))


_DOWN6: Final = decimal.Context(prec=6, rounding=decimal.ROUND_FLOOR)


def focus_order(budget: Budget, event: DpEvent) -> Focus | None:
    """The order at which copies of ``event`` filling the budget bind under plain RDP composition
    at δ·``FOCUS_WEIGHT``: α* minimising t·ρ(α) + g(α, δ_f) where t (real) copies reach ε, with
    its weight (``STREAM_FOCUS_WEIGHT`` when t ≥ ``STREAM_COPIES``, else ``FOCUS_WEIGHT``).
    A function of the declared event and the budget only. ``None``: no useful order (a free
    event, or one whose curve is infinite at every candidate)."""
    if budget.delta <= 0:
        return None
    return memoized(
        "union_focus", budget, event, None, lambda: _focus_order(budget.epsilon, budget.delta, event)
    )


@lru_cache(maxsize=1024)
def _focus_order(epsilon: Decimal, delta: Decimal, event: DpEvent) -> Focus | None:
    from accountant.rdp import MAX_ORDER, compute_rdp

    at = float(delta) * float(FOCUS_WEIGHT)
    eps = float(epsilon)

    def best(orders: tuple[float, ...]) -> tuple[float, float] | None:
        curve = [float(v) for v in compute_rdp(event, orders)]
        pairs = [
            (rho, a, math.log1p(-1.0 / a) - (math.log(at) + math.log(a)) / (a - 1.0))
            for rho, a in zip(curve, orders, strict=True)
            if math.isfinite(rho) and rho > 0
        ]
        if not pairs:
            return None

        def at_copies(t: float) -> tuple[float, float]:
            return min((t * rho + g, a) for rho, a, g in pairs)

        lo, hi = 0.0, 1.0
        while at_copies(hi)[0] < eps and hi < 1e18:
            hi *= 2.0
        for _ in range(80):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if at_copies(mid)[0] < eps else (lo, mid)
        return at_copies(hi)[1], hi

    coarse = best(_COARSE)
    if coarse is None:
        return None
    x = coarse[0] - 1.0
    fine = tuple(sorted({float(f"{1.0 + x * 10.0 ** (k / 400.0):.4g}") for k in range(-12, 13)}))
    alpha, copies = best(tuple(a for a in fine if 1.0 < a <= MAX_ORDER)) or coarse
    if not 1.0 < alpha <= MAX_ORDER:
        return None
    return alpha, (STREAM_FOCUS_WEIGHT if copies >= STREAM_COPIES else FOCUS_WEIGHT)


def _choose(budget: Budget, event: DpEvent) -> tuple[str, Focus | None]:
    """A batch's profile and focus, from its first charge: ``stream`` when the charge fits the
    focused filter B at the whole δ, else ``run`` (module docstring)."""
    if budget.delta <= 0 or budget.orders is None:
        return "run", None

    def compute() -> tuple[str, Focus | None]:
        focus = focus_order(budget, event)
        f = filter_b(budget, focus)
        fits = f.admits(zeros(len(f.orders)), rdp_charge(event, f.orders))
        return ("stream", focus) if fits else ("run", None)

    return memoized("union_profile", budget, event, None, compute)


def _offered_delta(budget: Budget, profile: str, basic: tuple[Decimal, Decimal]) -> Decimal:
    delta_a, _ = profile_deltas(budget, profile)
    left = max(ZERO, exact_sub(delta_a, basic[1]))
    return _DOWN18.multiply(left, SHARE)


_DOWN18: Final = decimal.Context(prec=18, rounding=decimal.ROUND_FLOOR)


def indicator(budget: Budget, state: BatchState, *, held: bool) -> Decimal:
    """The batch's ε progress: the smallest of its open filters' progress (A: Σεᵢ; B: the Rényi
    filter's ``epsilon_of``), over spent (``held=False``) or spent + held charges. A budget share,
    not a guarantee (the guarantee is the budget's (ε, δ) once anything ran)."""
    if state.union_profile is None:
        return ZERO
    basic = _basic_total(state) if held else _pair(state.basic_spent)
    values = []
    # A counts while open over the list it judges: spent + held (``basic_open``), or spent only
    # (``basic_departed``: a charge it refused has committed), so a reservation never moves the
    # spent figure (only settlements do).
    if state.basic_open if held else not state.basic_departed:
        values.append(basic[0])
    if state.union_profile == "stream":
        f = filter_b(budget, _state_focus(state))
        sums = _rdp_total(budget, state) if held else vector(state.rdp_spent, len(f.orders))
        values.append(f.epsilon_of(sums))
    return min(values, default=INFINITY)


def _derive(budget: Budget, state: BatchState) -> BatchState:
    """Recompute the ε/δ fields from the filters' sums (deterministic)."""
    spent = indicator(budget, state, held=False)
    total = indicator(budget, state, held=True)
    ran_spent = spent > 0 or _pair(state.basic_spent)[1] > 0 or any(v > 0 for v in state.rdp_spent or ())
    ran_total = (
        ran_spent or total > 0 or _pair(state.basic_held)[1] > 0 or any(v > 0 for v in state.rdp_held or ())
    )
    delta_spent = budget.delta if ran_spent else ZERO
    delta_total = budget.delta if ran_total else ZERO
    return replace(
        state,
        epsilon_spent=spent,
        epsilon_held=exact_sub(total, spent),
        delta_spent=delta_spent,
        delta_held=exact_sub(delta_total, delta_spent),
    )


def reserve(
    budget: Budget, state: BatchState, event: DpEvent, *, noise_commitment: str | None = None
) -> Admission:
    """Hold a fresh charge: admitted iff A or B admits the full list with it (module docstring)."""
    fingerprint = event_fingerprint(event)
    if is_free(event):
        # Touches no record: in no filter's list, and no first charge (it chooses no profile).
        naive = naive_price(budget, event)
        return Admission(
            replace(state, reads=state.reads + 1),
            Cost(ZERO, ZERO, naive, fingerprint, noise_commitment=noise_commitment),
        )
    if budget.delta <= 0:
        basic_price(event)  # at δ = 0 only pure DP can run: Gaussian kinds are refused as by 'basic'
    if state.union_profile is None:
        profile, focus = _choose(budget, event)
    else:
        profile, focus = state.union_profile, _state_focus(state)
    basic = _basic_total(state)
    price: tuple[Decimal, Decimal] | None = None
    a_admits = False
    if state.basic_open:
        price = run_price(event, _offered_delta(budget, profile, basic))
        delta_a, _ = profile_deltas(budget, profile)
        after = _padd(basic, price)
        a_admits = after[0] <= budget.epsilon and after[1] <= delta_a
    charge: tuple[Decimal, ...] | None = None
    b_admits = False
    if profile == "stream":
        f = filter_b(budget, focus)
        charge = rdp_charge(event, f.orders)
        b_admits = f.admits(
            vadd(vector(state.rdp_spent, len(f.orders)), vector(state.rdp_held, len(f.orders))), charge
        )
    if not (a_admits or b_admits):
        asked = price[0] if price is not None else INFINITY
        raise BudgetExceeded(Amount(asked, budget.delta), remaining(budget, state))
    before = exact_add(state.epsilon_spent, state.epsilon_held)
    new_state = replace(
        state,
        union_profile=profile,
        union_focus=None if focus is None else focus[0],
        union_focus_weight=None if focus is None else focus[1],
        reads=state.reads + 1,
        basic_held=_stored(_padd(_pair(state.basic_held), price)) if a_admits and price else state.basic_held,
        # A refused a charge that runs: A departs, for good (its refusal is absorbing).
        basic_open=state.basic_open and a_admits,
        rdp_held=state.rdp_held
        if charge is None
        else canonical(vadd(vector(state.rdp_held, len(charge)), charge)),
    )
    new_state = _derive(budget, new_state)
    cost = Cost(
        epsilon=max(ZERO, exact_sub(exact_add(new_state.epsilon_spent, new_state.epsilon_held), before)),
        delta=exact_sub(
            exact_add(new_state.delta_spent, new_state.delta_held),
            exact_add(state.delta_spent, state.delta_held),
        ),
        naive_epsilon=naive_price(budget, event),
        fingerprint=fingerprint,
        rdp=charge,
        noise_commitment=noise_commitment,
        basic=price if a_admits else None,
    )
    return Admission(new_state, cost)


def naive_price(budget: Budget, event: DpEvent) -> Decimal:
    """The charge's ε as the batch's only charge: its progress on an empty batch (the smaller
    of A's price and B's progress where each admits it; A's price at ``SHARE``·δ otherwise)."""

    def compute() -> Decimal:
        if is_free(event):
            return ZERO
        profile, focus = _choose(budget, event)
        price = run_price(event, _offered_delta(budget, profile, _PAIR_ZERO))
        values = []
        if price[0] <= budget.epsilon and price[1] <= profile_deltas(budget, profile)[0]:
            values.append(price[0])
        if profile == "stream":
            f = filter_b(budget, focus)
            values.append(f.epsilon_of(rdp_charge(event, f.orders)))
        return min(values, default=price[0])

    return memoized("union_naive", budget, event, None, compute)


def price(
    budget: Budget, event: DpEvent, noise_commitment: str | None, *, focus: Focus | None, with_rdp: bool
) -> Cost:
    """The cumulative cost of the run so far ``event`` (before settling): B's RDP of it on the
    batch's grid (``focus``)."""
    charge = (
        rdp_charge(event, filter_b(budget, focus).orders) if with_rdp and budget.orders is not None else None
    )
    return Cost(
        ZERO,
        ZERO,
        naive_price(budget, event),
        event_fingerprint(event),
        rdp=charge,
        noise_commitment=noise_commitment,
    )


def commit(
    budget: Budget,
    state: BatchState,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    """Progressive commit: A's whole price moves from held to spent at the first commit; B's sums
    move the RDP of the run so far (never more than reserved, never less than committed)."""
    from accountant.rules.bookkeeping import at_least, bound_by_reservation

    if partial_event is None:
        now = replace(reserved, epsilon=ZERO, delta=ZERO)
    else:
        now = price(
            budget,
            partial_event,
            reserved.noise_commitment,
            focus=_state_focus(state),
            with_rdp=reserved.rdp is not None,
        )
        now = bound_by_reservation(now, reserved, compare_epsilon=False)
    now = at_least(now, committed_before, compare_epsilon=False)
    now = replace(now, basic=reserved.basic)
    changes: dict[str, object] = {
        "naive_epsilon": exact_add(state.naive_epsilon, naive_step(now, committed_before))
    }
    if committed_before is None and reserved.basic is not None:
        changes["basic_spent"] = _stored(_padd(_pair(state.basic_spent), reserved.basic))
        changes["basic_held"] = _stored(_psub(_pair(state.basic_held), reserved.basic))
    if reserved.basic is None and reserved.rdp is not None:
        changes["basic_departed"] = True  # a charge A refused (B admitted it) has run
    if now.rdp is not None and reserved.rdp is not None and budget.orders is not None:
        n = len(filter_b(budget, _state_focus(state)).orders)
        step = (
            now.rdp
            if committed_before is None or committed_before.rdp is None
            else vsub(now.rdp, committed_before.rdp, "rdp")
        )
        changes["rdp_spent"] = canonical(vadd(vector(state.rdp_spent, n), step))
        changes["rdp_held"] = canonical(vsub(vector(state.rdp_held, n), step, "rdp_held"))
    new_state = _derive(budget, replace(state, **changes))  # type: ignore[arg-type]
    # As for the Rényi filter: the committed ε/δ grow by what the batch's spent indicator grew,
    # between what was committed before and what was reserved.
    base_eps = ZERO if committed_before is None else committed_before.epsilon
    base_dlt = ZERO if committed_before is None else committed_before.delta
    grown_eps = exact_add(base_eps, max(ZERO, exact_sub(new_state.epsilon_spent, state.epsilon_spent)))
    grown_dlt = exact_add(base_dlt, max(ZERO, exact_sub(new_state.delta_spent, state.delta_spent)))
    now = replace(
        now,
        epsilon=max(base_eps, min(reserved.epsilon, grown_eps)),
        delta=max(base_dlt, min(reserved.delta, grown_dlt)),
    )
    return Settlement(new_state, now)


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    """Return an uncommitted hold: B's RDP not committed; A's price when nothing was committed
    (what ran is kept). A stays closed. A batch left with no reservation chooses its profile
    again at its next charge (nothing was released)."""
    from accountant.errors import InvalidArgumentError

    reads = state.reads - 1 if committed is None else state.reads
    if reads < 0:
        raise InvalidArgumentError("state.reads", "has no reservation to cancel.")
    changes: dict[str, object] = {"reads": reads}
    if committed is None and reserved.basic is not None:
        changes["basic_held"] = _stored(_psub(_pair(state.basic_held), reserved.basic))
    if reserved.rdp is not None and budget.orders is not None:
        n = len(filter_b(budget, _state_focus(state)).orders)
        committed_rdp = zeros(n) if committed is None or committed.rdp is None else vector(committed.rdp, n)
        rest = tuple(
            max(ZERO, exact_sub(r, c)) for r, c in zip(vector(reserved.rdp, n), committed_rdp, strict=True)
        )
        changes["rdp_held"] = canonical(vsub(vector(state.rdp_held, n), rest, "rdp_held"))
    after = replace(state, **changes)  # type: ignore[arg-type]
    if after.reads == 0:
        after = replace(
            after,
            union_profile=None,
            union_focus=None,
            union_focus_weight=None,
            basic_open=True,
            basic_held=None,
            rdp_held=None,
        )
    return _derive(budget, after)


def remaining(budget: Budget, state: BatchState) -> Amount:
    """The most ε a filter still open has left (A: ε − Σεᵢ; B: ε − its progress)."""
    if state.union_profile is None:
        return Amount(budget.epsilon, budget.delta)
    left = [ZERO]
    if state.basic_open:
        left.append(exact_sub(budget.epsilon, _basic_total(state)[0]))
    if state.union_profile == "stream":
        used = filter_b(budget, _state_focus(state)).epsilon_of(_rdp_total(budget, state))
        left.append(exact_sub(budget.epsilon, used))
    return Amount(max(left), budget.delta)


def within_budget(budget: Budget, state: BatchState) -> bool:
    """Whether some filter admits the full list: A open within (ε, δ_A), or B's sums fit."""
    if state.union_profile is None:
        return (
            state.basic_spent is None
            and state.basic_held is None
            and not any(v > 0 for v in (*(state.rdp_spent or ()), *(state.rdp_held or ())))
        )
    delta_a, _ = profile_deltas(budget, state.union_profile)
    basic = _basic_total(state)
    if state.basic_open and basic[0] <= budget.epsilon and basic[1] <= delta_a:
        return True
    if state.union_profile == "stream":
        return filter_b(budget, _state_focus(state)).fits(_rdp_total(budget, state))
    return False


THEOREM: Final = (
    "Sequential composition per batch by the union of two privacy filters that each judge the full "
    "list of charges run on the batch, with absorbing refusals: (A) basic composition over each "
    "charge's tight (epsilon_i, delta_i), priced by the PRV accountant's upper bound (Gopi, Lee & "
    "Wutschitz 2021) before it runs, valid under fully adaptive choice (Rogers, Roth, Ullman & "
    "Vadhan 2016, Thm. 3.6); (B) a Renyi privacy filter (Feldman & Zrnic 2021, Thm. 3.1) over a "
    "grid fixed at budget creation with the improved RDP-to-DP conversion (Balle et al. 2020, "
    "Thm. 21). A charge runs while either admits; the interaction is (epsilon, delta_A + delta_B)-DP "
    "(docs/ACCOUNTING.md, 'The union of filters'); (delta_A, delta_B) is (0, delta) or (delta, 0), "
    "fixed at a batch's first charge, before any of its records is touched."
)


def stated_theorem(budget: Budget, words: str) -> str:
    return f"{THEOREM} Budget per batch {words}."


__all__ = [
    "SHARE",
    "THEOREM",
    "cancel",
    "commit",
    "indicator",
    "naive_price",
    "price",
    "profile_deltas",
    "remaining",
    "reserve",
    "run_price",
    "stated_theorem",
    "tight_epsilon",
    "within_budget",
]
