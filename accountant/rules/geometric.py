"""Geometric rule: level k of a block has allowance first·ratioᵏ and is used once (best fit).

Theorems relied on: **continual and sliding-window model release** (the
``continual-sliding-window-release`` paper): Thm. 1 (Alg. 2, continual release from a block whose
k-th update costs ε/2ᵏ⁺¹), Thm. 4 (Alg. 4, each block either used once or in a sequence of
updates whose costs halve) and Thm. 7 (Alg. 5, sliding window as three sub-budgets of ε/3). Their
common argument: the releases that read one block have costs forming a geometric series, so over
an infinite horizon the block's total is at most first/(1 − ratio) ≤ ε. Releases are chosen
adaptively, so the levels compose by **basic composition with adaptively chosen parameters**
(Dwork & Roth 2014, Thm. 3.16; Rogers, Roth, Ullman & Vadhan 2016, basic-composition filter):
every admitted charge fits a level it alone occupies, so Σεᵢ ≤ Σₖ first·ratioᵏ ≤ ε for ever.

Levels and their grants. The budget fixes ``first`` and ``ratio`` (defaults ε/2 and 1/2, with
first/(1 − ratio) ≤ ε checked exactly at creation). Level k grants

    ε_k = first·ratioᵏ   and   δ_k = δ·(1 − ratio)·ratioᵏ   (Σₖ δ_k = δ),

both in Decimal, exact whenever they fit 60 significant digits and rounded down otherwise. The
δ shares keep the block's δ bounded over the infinite horizon too (charging the budget's δ at
every level would not be). A charge's (ε′, δ′) at level k is, for ``basic``, its exact basic
composition (independent of k); for ``rdp`` (and ``prv``), the event's price as one charge at
δ_k (``prices.fresh_price`` — one mechanism, parameters fixed before it ran, no filter: since
pricing version 4 its tight ε at δ_k, ``prices.tight_epsilon``, exact for Gaussians; before, its
RDP curve on the accountant's full grid converted at δ_k, Balle et al. 2020, Thm. 21 — or the
coupling or exact basic bound when smaller) with δ′ = δ_k (or the smaller δ of the bound
used). It fits level k iff ε′ ≤ ε_k and δ′ ≤ δ_k — a condition monotone in k (grants shrink,
ε′ grows as δ_k shrinks).

Sub-budgets (Thm. 7). The sliding window charges a block once at ε/3 (the base model) and along
two chains at ε/6, ε/12, … each, so a block may need two levels of the same size, which one series
cannot give. A schedule may therefore hold ``copies`` series first·ratioᵐ side by side and one
``single`` level used once (``GeometricSchedule``): its levels are the allowances in
non-increasing order (``single``; then each term ``copies`` times), δ shares are proportional to
the allowances, and the block's bound is single + copies·first/(1−ratio) ≤ ε. The sliding window is
``{"single": ε/3, "copies": 2, "ratio": 1/2}`` (first defaults to ε/6): levels ε/3, ε/6, ε/6,
ε/12, ε/12, … summing to ε. The defaults (one series, no single level) are the plain rule above.
Whatever the schedule, each admitted charge occupies a level of its own whose allowance covers it,
so the block's total is at most the sum of all allowances.

Best fit: the charge takes the *free* level with the smallest allowance that still covers it, the
largest k with a fit. The search is a binary search for the deepest fitting level k* over
0..``MAX_GEOMETRIC_LEVEL`` (O(log 1000) evaluations), then a walk from k* towards level 0 that
skips used levels (O(levels used)). Levels stop at 1000: with ratio 1/2 level 1000's allowance is
first·2⁻¹⁰⁰⁰ ≈ 1e-301·first, below anything an accountant computes in floating point; for ratios
near 1 it caps a block at 1001 releases.

No fitting free level → ``BudgetExceeded`` (not ``ChargeRefused``): the charge does not fit what
is left, and the client gets numbers — ``requested`` is the charge's (ε′, δ′) (at level 0's δ for
``rdp``), ``remaining`` the largest free level's grant. The batch's spend is the sum of its used
levels' allowances (ε_k, not ε′), so it never exceeds first/(1 − ratio); ``naive_epsilon`` counts
each charge's ε′ as a fresh charge. A charge that costs nothing (no-ops) takes no level.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal

from accountant.events import DpEvent
from accountant.exact import ZERO, exact_add, exact_sum, to_text
from accountant.rules.bookkeeping import progressive_cost, release_additive, settle_additive
from accountant.rules.budget import MAX_GEOMETRIC_LEVEL, Budget
from accountant.rules.errors import Amount, BudgetExceeded
from accountant.rules.memo import event_fingerprint, memoized
from accountant.rules.prices import basic_price, fresh_price, is_free
from accountant.rules.sequential import PARALLEL_OVER_BATCHES, budget_words
from accountant.rules.state import Admission, BatchState, Charge, Cost, Settlement


def _grant(budget: Budget, level: int) -> tuple[Decimal, Decimal]:
    assert budget.geometric is not None
    return budget.geometric.allowance(level), budget.geometric.level_delta(budget.delta, level)


@dataclass(frozen=True, slots=True)
class _Priced:
    """A charge's (ε′, δ′) as a function of the level it would occupy."""

    budget: Budget
    event: DpEvent
    free: bool
    basic: tuple[Decimal, Decimal] | None

    @classmethod
    def of(cls, budget: Budget, event: DpEvent) -> _Priced:
        # Once per event and budget (``PriceMemo``): every batch, level and commit reuses it.
        return memoized("geometric", budget, event, None, lambda: cls._of(budget, event))

    @classmethod
    def _of(cls, budget: Budget, event: DpEvent) -> _Priced:
        if budget.accountant == "basic":
            eps, dlt = basic_price(event)
            return cls(budget, event, eps == 0 and dlt == 0, (eps, dlt))
        return cls(budget, event, is_free(event), None)

    def at(self, level: int) -> tuple[Decimal, Decimal]:
        if self.basic is not None:
            return self.basic
        return memoized("geometric_level", self.budget, self.event, level, lambda: self._at(level))

    def _at(self, level: int) -> tuple[Decimal, Decimal]:
        # The event alone at the level's δ share: one mechanism, no filter, so its tight ε, the
        # coupling bound and an exact basic bound all apply (``fresh_price``).
        level_delta = self.budget.geometric.level_delta(self.budget.delta, level)  # type: ignore[union-attr]
        return fresh_price(self.budget, self.event, level_delta)

    def fits(self, level: int) -> bool:
        eps, dlt = self.at(level)
        allowance, level_delta = _grant(self.budget, level)
        return eps <= allowance and dlt <= level_delta


def best_fit(fits: Callable[[int], bool], used: frozenset[int] | set[int]) -> int | None:
    """The largest free level k ≤ MAX_GEOMETRIC_LEVEL with ``fits(k)``.

    ``fits`` is monotone (true up to some k*, false after): binary search for k*, then walk down
    over used levels. Each candidate is re-checked, so a numerically non-monotone ``fits`` can
    only make the walk longer, never admit a level that does not fit.
    """
    if not fits(0):
        return None
    lo, hi = 0, MAX_GEOMETRIC_LEVEL
    if fits(hi):
        lo = hi
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    for level in range(lo, -1, -1):
        if level not in used and fits(level):
            return level
    return None


def reserve(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    priced = _Priced.of(budget, charge.event)
    fingerprint = event_fingerprint(charge.event)
    if priced.free:
        return Admission(replace(state, reads=state.reads + 1), Cost(ZERO, ZERO, ZERO, fingerprint))
    level = best_fit(priced.fits, set(state.levels))
    if level is None:
        eps, dlt = priced.at(0)
        raise BudgetExceeded(Amount(eps, dlt), remaining(budget, state))
    allowance, _ = _grant(budget, level)
    eps, dlt = priced.at(level)
    levels = list(state.levels)
    insort(levels, level)
    new_state = replace(
        state,
        epsilon_held=exact_add(state.epsilon_held, allowance),
        delta_held=exact_add(state.delta_held, dlt),
        reads=state.reads + 1,
        levels=tuple(levels),
    )
    return Admission(new_state, Cost(allowance, dlt, eps, fingerprint, level=level))


def commit(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    def price(partial: DpEvent) -> Cost:
        fingerprint = event_fingerprint(partial)
        if reserved.level is None:
            priced = _Priced.of(budget, partial)
            eps, dlt = (ZERO, ZERO) if priced.free else priced.at(0)
            return Cost(eps, dlt, eps, fingerprint)
        eps, dlt = _Priced.of(budget, partial).at(reserved.level)
        allowance, _ = _grant(budget, reserved.level)
        # The level is occupied as a whole once anything from it is released.
        return Cost(allowance, dlt, eps, fingerprint, level=reserved.level)

    now = progressive_cost(reserved, committed_before, partial_event, price)
    return Settlement(settle_additive(state, now, committed_before), now)


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    released = release_additive(state, reserved, committed)
    if committed is None and reserved.level is not None:
        # Nothing was released from this level: it is free again.
        return replace(released, levels=tuple(k for k in released.levels if k != reserved.level))
    return released


def largest_free_level(state: BatchState) -> int | None:
    """The free level with the largest allowance (the smallest free k): O(levels used)."""
    used = set(state.levels)
    level = 0
    while level in used:
        level += 1
    return level if level <= MAX_GEOMETRIC_LEVEL else None


def remaining(budget: Budget, state: BatchState) -> Amount:
    level = largest_free_level(state)
    if level is None:
        return Amount(ZERO, ZERO)
    allowance, level_delta = _grant(budget, level)
    return Amount(allowance, level_delta)


def within_budget(budget: Budget, state: BatchState) -> bool:
    assert budget.geometric is not None
    levels = state.levels
    if len(set(levels)) != len(levels) or any(not 0 <= k <= MAX_GEOMETRIC_LEVEL for k in levels):
        return False
    granted = exact_sum(budget.geometric.allowance(k) for k in levels)
    used = exact_add(state.epsilon_spent, state.epsilon_held)
    return (
        used <= granted
        and used <= budget.geometric.infinite_horizon_bound()
        and used <= budget.epsilon
        and exact_add(state.delta_spent, state.delta_held) <= budget.delta
    )


def theorem(budget: Budget) -> str:
    assert budget.geometric is not None
    schedule = budget.geometric
    if schedule.copies == 1 and schedule.single == 0:
        return (
            "Continual / sliding-window release with geometric-series budgets (Thm. 1, 4, 7): level "
            f"k of a block has allowance first*ratio^k (first={to_text(schedule.first)}, "
            f"ratio={to_text(schedule.ratio)}) and delta share delta*(1-ratio)*ratio^k, each used "
            "once, best fit; levels compose by basic composition with adaptive parameters (Dwork & "
            "Roth 2014, Thm. 3.16; Rogers et al. 2016), so a block's total over an infinite horizon "
            f"is <= first/(1-ratio) = {to_text(schedule.infinite_horizon_bound())} <= epsilon."
            + PARALLEL_OVER_BATCHES
        )
    return (
        "Continual / sliding-window release with geometric-series sub-budgets (Thm. 1, 4, 7): a "
        f"block has one level of allowance single={to_text(schedule.single)} and {schedule.copies} "
        f"series of levels first*ratio^m (first={to_text(schedule.first)}, "
        f"ratio={to_text(schedule.ratio)}), delta shares proportional to the allowances, each level "
        "used once, best fit; levels compose by basic composition with adaptive parameters (Dwork & "
        "Roth 2014, Thm. 3.16; Rogers et al. 2016), so a block's total over an infinite horizon is "
        f"<= single + copies*first/(1-ratio) = {to_text(schedule.infinite_horizon_bound())} <= epsilon."
        + PARALLEL_OVER_BATCHES
    )


def stated_theorem(budget: Budget) -> str:
    """``theorem`` (already written from the schedule) with the budget's (ε, δ)."""
    return theorem(budget).replace(
        PARALLEL_OVER_BATCHES, f" Budget per block {budget_words(budget)}." + PARALLEL_OVER_BATCHES
    )
