"""A dataset's budget: rule, (ε, δ), accountant and the rule's fixed parameters (``Budget``,
``GeometricSchedule``), validated once when the dataset is created; the Rényi filter it implies
(``renyi_filter``); the declared plan segments of a sequential ``prv`` budget (``PlanSegment``,
``Budget.with_segment``), the one part of a budget that grows after creation."""

from __future__ import annotations

import decimal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from functools import lru_cache
from typing import Any, Final

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, as_written, exact_mul, exact_sub, exact_sum, to_text
from accountant.rdp_filter import DEFAULT_FILTER_ORDERS, RenyiFilter, check_orders, check_weights, placed_grid
from accountant.rules.prices import plan_epsilon as compute_plan_epsilon

RULES: Final = ("lifelong", "parallel", "sequential", "geometric")
ACCOUNTANTS: Final = ("basic", "rdp", "prv", "tight")
DEFAULT_ACCOUNTANT: Final = "tight"
"""The accountant of a budget created without naming one (API, client): ``tight``, the union of
a basic-composition filter over each charge's tight (ε, δ) and a Rényi filter
(``accountant.rules.tight``), valid under fully adaptive choice and tight for a lone DP-SGD run."""
# Which accountants each rule accepts, and why the others are refused (Budget.create).
SUPPORTED: Final[Mapping[str, tuple[str, ...]]] = {
    "sequential": ("basic", "rdp", "prv", "tight"),
    "parallel": ("basic", "rdp", "prv", "tight"),
    "lifelong": ("basic", "rdp", "tight"),
    "geometric": ("basic", "rdp", "tight"),
}
_REFUSAL_REASON: Final[Mapping[tuple[str, str], str]] = {
    ("lifelong", "prv"): (
        "fresh-noise charges on a lifelong batch are chosen adaptively, and tight PRV numbers "
        "hold only for a plan fixed in advance"
    ),
    ("geometric", "prv"): (
        "a geometric level search evaluates each charge at several level deltas, and levels are "
        "chosen adaptively; use 'rdp' or 'basic'"
    ),
}
MAX_PLAN_EVENTS: Final = 10_000
PLAN_PRICING: Final = "tight-2"
"""How a budget created since issue 25 §4 prices its declared plans (``Budget.plan_pricing``): the
tight engine, ``accountant.prv.tight_epsilon`` engine 2, rounded up to 6 digits; the name fixes
the engine, so the budget's hashed ``plan_epsilon`` never depends on a later pricing version."""
# Geometric levels 0..MAX_GEOMETRIC_LEVEL. With the default ratio 1/2 level 1000's allowance is
# first·2⁻¹⁰⁰⁰ ≈ 1e-301·first: below any ε an accountant computes in floating point (it is
# subnormal as a float), so no real charge needs a deeper level. For ratios near 1 it caps one
# block at 1001 releases. The cap also bounds the level search (binary search over 0..1000).
MAX_GEOMETRIC_LEVEL: Final = 1000


# ---------------------------------------------------------------------------------------------
# Budget
# ---------------------------------------------------------------------------------------------

_GEOMETRIC_PRECISION: Final = 60
_LEVEL_DOWN: Final = decimal.Context(
    prec=_GEOMETRIC_PRECISION, rounding=ROUND_FLOOR, Emax=10**6, Emin=-(10**6)
)
_BOUND_UP: Final = decimal.Context(prec=18, rounding=ROUND_CEILING, Emax=10**6, Emin=-(10**6))


def _power_down(base: Decimal, exponent: int) -> Decimal:
    """baseᵉ for 0 ≤ base ≤ 1, rounded DOWN (exact whenever it fits 60 digits).

    Square-and-multiply in a floor context: each product of non-negative lower bounds, floored,
    is again a lower bound, so an allowance is never overstated.
    """
    result = Decimal(1)
    square = base
    while exponent:
        if exponent & 1:
            result = _LEVEL_DOWN.multiply(result, square)
        exponent >>= 1
        if exponent:
            square = _LEVEL_DOWN.multiply(square, square)
    return result


@lru_cache(maxsize=8192)
def _level_allowance(first: Decimal, ratio: Decimal, level: int) -> Decimal:
    return _LEVEL_DOWN.multiply(first, _power_down(ratio, level))


@lru_cache(maxsize=8192)
def _level_delta(delta: Decimal, ratio: Decimal, level: int) -> Decimal:
    share = _LEVEL_DOWN.multiply(delta, _LEVEL_DOWN.subtract(Decimal(1), ratio))
    return _LEVEL_DOWN.multiply(share, _power_down(ratio, level))


@dataclass(frozen=True, slots=True)
class GeometricSchedule:
    """Level k of a block has the allowance first·ratioᵏ (and δ·(1−ratio)·ratioᵏ), used once.

    Sub-budgets (Thm. 7, the sliding window: "three sub-budgets of ε/3, one single, two
    geometric"): ``copies`` geometric series first·ratioᵐ run side by side, and ``single`` > 0
    adds one level used once. Levels are their allowances in non-increasing order (so best fit
    stays a search over a monotone sequence): level 0 is ``single`` when there is one, then each
    term first·ratioᵐ ``copies`` times in a row. The defaults (``copies`` 1, no ``single``) are the
    plain series. A block's total is at most single + copies·first/(1−ratio).
    """

    first: Decimal
    ratio: Decimal
    copies: int = 1
    single: Decimal = ZERO

    def _term(self, level: int) -> int | None:
        """The series index m of ``level`` (None: the single level)."""
        if self.single > 0:
            if level == 0:
                return None
            level -= 1
        return level // self.copies

    def allowance(self, level: int) -> Decimal:
        """first·ratioᵐ of the level's term m (or ``single``), exact in Decimal (rounded down past
        60 significant digits)."""
        term = self._term(level)
        if term is None:
            return self.single
        return _level_allowance(self.first, self.ratio, term)

    def level_delta(self, delta: Decimal, level: int) -> Decimal:
        """Level k's share of the budget's δ: δ·(1−ratio)·ratioᵏ for the plain series; with
        sub-budgets, δ·allowance/total (total = single + copies·first/(1−ratio), rounded up), so
        the shares of all levels sum to ≤ δ."""
        if self.copies == 1 and self.single == 0:
            return _level_delta(delta, self.ratio, level)
        total = self.infinite_horizon_bound()
        term = self._term(level)
        if term is None:
            return _LEVEL_DOWN.divide(_LEVEL_DOWN.multiply(delta, self.single), total)
        coefficient = _LEVEL_DOWN.divide(_LEVEL_DOWN.multiply(delta, self.first), total)
        return _LEVEL_DOWN.multiply(coefficient, _power_down(self.ratio, term))

    def infinite_horizon_bound(self) -> Decimal:
        """single + copies·first/(1−ratio), rounded up: the most a block can ever spend, whatever
        the horizon."""
        series = _BOUND_UP.divide(self.first, exact_sub(Decimal(1), self.ratio))
        if self.copies == 1 and self.single == 0:
            return series
        return _BOUND_UP.add(self.single, _BOUND_UP.multiply(Decimal(self.copies), series))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"first": to_text(self.first), "ratio": to_text(self.ratio)}
        if self.copies != 1:
            out["copies"] = self.copies
        if self.single != 0:
            out["single"] = to_text(self.single)
        return out


MAX_GEOMETRIC_COPIES: Final = 64


@dataclass(frozen=True, slots=True)
class PlanSegment:
    """One declared plan of a sequential ``prv`` budget: its events, the share ``delta`` of the
    budget's δ it is priced at, and ``epsilon``, the PRV upper ε of the whole plan at that δ.

    Segment i's (εᵢ, δᵢ) are fixed when it is declared, before any of its events runs; segments
    compose by basic composition under fully adaptive choice (Rogers, Roth, Ullman & Vadhan 2016,
    Thm. 3.6): the plan of segment i + 1 may depend on what segments 0..i released, as long as
    Σεᵢ ≤ ε and Σδᵢ ≤ δ (``Budget.with_segment`` checks both, exactly)."""

    plan: tuple[DpEvent, ...]
    delta: Decimal
    epsilon: Decimal

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": [ev.to_json(e) for e in self.plan],
            "delta": to_text(self.delta),
            "epsilon": to_text(self.epsilon),
        }


def budget_number(field_name: str, value: object) -> Decimal:
    """A budget's number as written (``exact.as_written``); ``InvalidArgumentError`` naming
    ``field_name`` for a bool, a non-number or a non-finite value."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise InvalidArgumentError(field_name, f"must be a number. Found {value!r}.")
    try:
        number = as_written(value)
    except (ValueError, TypeError, ArithmeticError):
        raise InvalidArgumentError(field_name, f"must be a number. Found {value!r}.") from None
    if not number.is_finite():
        raise InvalidArgumentError(field_name, f"must be finite. Found {value!r}.")
    return number


@dataclass(frozen=True, slots=True)
class Budget:
    """A dataset's budget: rule, (ε, δ), accountant, and the rule's fixed parameters.

    ``orders`` is the Rényi filter's grid (accountant ``rdp``), ``plan`` the declared plan and
    ``plan_epsilon`` its upper ε at ``plan_delta`` (sequential ``prv``; ``plan_delta`` ``None``:
    the whole δ, as every budget created before segments existed), ``segments`` the plans declared
    after creation (``with_segment``). ``plan_pricing`` says how every declared plan is priced:
    ``None``, the PRV accountant's upper bound (every budget stored before issue 25 §4, which keeps
    it); ``PLAN_PRICING`` ("tight-2"), the tight engine (``accountant.prv.tight_epsilon`` engine 2),
    what ``create`` gives a new budget with a plan. Build with ``create``.
    """

    rule: str
    epsilon: Decimal
    delta: Decimal
    accountant: str
    geometric: GeometricSchedule | None = None
    orders: tuple[float, ...] | None = None
    plan: tuple[DpEvent, ...] | None = None
    plan_epsilon: Decimal | None = None
    delta_weights: tuple[Decimal, ...] | None = None
    plan_delta: Decimal | None = None
    segments: tuple[PlanSegment, ...] = ()
    plan_pricing: str | None = None

    @classmethod
    def create(
        cls,
        *,
        rule: str,
        epsilon: Decimal | float | int | str,
        delta: Decimal | float | int | str,
        accountant: str,
        geometric: GeometricSchedule | Mapping[str, Any] | None = None,
        orders: Sequence[float] | None = None,
        plan: Sequence[DpEvent] | None = None,
        delta_weights: Sequence[Decimal | str] | None = None,
        plan_delta: Decimal | float | str | None = None,
    ) -> Budget:
        """Validate and fill defaults. ``InvalidArgumentError`` names the field (``budget.*``).

        A Rényi-filter budget (``rdp``, sequential or lifelong) without ``orders`` gets a grid
        placed for its (ε, δ) with non-uniform δ weights (``accountant.rdp_filter.placed_grid``);
        with ``orders`` and no ``delta_weights``, δ is split equally over the active orders.
        ``plan_delta``: the share of δ the declared plan is priced at, leaving the rest for later
        segments (``with_segment``); ``None``: the whole δ (no segment with δ > 0 can follow)."""
        return cls._build(
            rule=rule,
            epsilon=epsilon,
            delta=delta,
            accountant=accountant,
            geometric=geometric,
            orders=orders,
            plan=plan,
            plan_epsilon=None,
            delta_weights=delta_weights,
            place_grid=True,
            plan_delta=plan_delta,
            plan_pricing=PLAN_PRICING if plan is not None else None,
        )

    @classmethod
    def _build(
        cls,
        *,
        rule: object,
        epsilon: object,
        delta: object,
        accountant: object,
        geometric: object,
        orders: object,
        plan: object,
        plan_epsilon: Decimal | None,
        delta_weights: object = None,
        place_grid: bool = False,
        plan_delta: object = None,
        segments: object = None,
        plan_pricing: object = None,
    ) -> Budget:
        if not isinstance(rule, str) or rule not in RULES:
            raise InvalidArgumentError("budget.rule", f"must be one of {list(RULES)}. Found {rule!r}.")
        if not isinstance(accountant, str) or accountant not in ACCOUNTANTS:
            raise InvalidArgumentError(
                "budget.accountant", f"must be one of {list(ACCOUNTANTS)}. Found {accountant!r}."
            )
        if accountant not in SUPPORTED[rule]:
            reason = _REFUSAL_REASON.get((rule, accountant), "not a valid combination")
            raise InvalidArgumentError(
                "budget.accountant",
                f"must be one of {list(SUPPORTED[rule])} for rule {rule!r} ({reason}). Found {accountant!r}.",
            )
        eps = budget_number("budget.epsilon", epsilon)
        if eps <= 0:
            raise InvalidArgumentError("budget.epsilon", f"must be finite and > 0. Found {epsilon!r}.")
        dlt = budget_number("budget.delta", delta)
        if not 0 <= dlt < 1:
            raise InvalidArgumentError("budget.delta", f"must be in [0, 1). Found {delta!r}.")
        if accountant in ("rdp", "prv") and dlt == 0:  # ``tight`` at δ = 0 is the pure basic filter
            raise InvalidArgumentError(
                "budget.delta",
                f"must be > 0 for accountant {accountant!r} (it bounds (epsilon, delta)-DP with "
                f"delta > 0; use 'basic' for pure DP). Found {delta!r}.",
            )
        schedule = cls._schedule(rule, eps, geometric)
        grid: tuple[float, ...] | None = None
        # ``tight`` places its own grid; only a stored budget (``from_json``) hands it back.
        stored_grid = accountant == "tight" and not place_grid
        if orders is not None and accountant != "rdp" and not stored_grid:
            raise InvalidArgumentError(
                "budget.orders", f"applies to accountant 'rdp' only. Found accountant {accountant!r}."
            )
        weights: tuple[Decimal, ...] | None = None
        if (
            delta_weights is not None
            and not stored_grid
            and (accountant != "rdp" or rule not in ("sequential", "lifelong"))
        ):
            raise InvalidArgumentError(
                "budget.delta_weights",
                "applies to a Rényi filter only (accountant 'rdp', rule sequential or lifelong).",
            )
        if delta_weights is not None and orders is None:
            raise InvalidArgumentError("budget.delta_weights", "needs budget.orders (one weight per order).")
        if accountant == "tight" and dlt > 0:
            # The Rényi filter of the union is placed for the budget; a stored budget keeps the
            # grid it was created with (``orders``/``delta_weights`` as stored).
            if orders is None and place_grid and rule in ("sequential", "lifelong"):
                grid, weights = placed_grid(eps, dlt)
            elif orders is None:
                grid = DEFAULT_FILTER_ORDERS
            else:
                grid = check_orders(orders, "budget.orders")  # type: ignore[arg-type]
                if delta_weights is not None:
                    weights = check_weights(delta_weights, len(grid), "budget.delta_weights")  # type: ignore[arg-type]
        if accountant == "rdp":
            if orders is None and place_grid and rule in ("sequential", "lifelong"):
                grid, weights = placed_grid(eps, dlt)
            else:
                grid = check_orders(
                    DEFAULT_FILTER_ORDERS if orders is None else orders,  # type: ignore[arg-type]
                    "budget.orders",
                )
                if delta_weights is not None:
                    if not isinstance(orders, Sequence) or list(grid) != [float(a) for a in orders]:
                        raise InvalidArgumentError(
                            "budget.orders",
                            "must be sorted in increasing order when budget.delta_weights is given.",
                        )
                    weights = check_weights(delta_weights, len(grid), "budget.delta_weights")  # type: ignore[arg-type]
        steps = cls._plan(rule, accountant, plan)
        share: Decimal | None = None
        if plan_delta is not None:
            if steps is None:
                raise InvalidArgumentError(
                    "budget.plan_delta",
                    "applies to a declared plan only (rule 'sequential', accountant 'prv').",
                )
            share = budget_number("budget.plan_delta", plan_delta)
            if not 0 < share <= dlt:
                raise InvalidArgumentError(
                    "budget.plan_delta",
                    f"must be in (0, budget.delta = {to_text(dlt)}]. Found {plan_delta!r}.",
                )
        if plan_pricing is not None and (steps is None or plan_pricing != PLAN_PRICING):
            raise InvalidArgumentError(
                "budget.plan_pricing",
                f"must be {PLAN_PRICING!r} on a budget with a declared plan, or absent. "
                f"Found {plan_pricing!r}.",
            )
        pricing = None if plan_pricing is None else PLAN_PRICING
        budget = cls(rule, eps, dlt, accountant, schedule, grid, steps, None, weights, share, (), pricing)
        if budget.uses_filter and budget.orders is not None:
            try:
                renyi_filter(budget)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"budget.{exc.field}", exc.message) from None
        if steps is not None:
            if plan_epsilon is None:
                plan_epsilon = compute_plan_epsilon(steps, budget.first_plan_delta, budget.plan_pricing)
            if not plan_epsilon <= eps:
                raise InvalidArgumentError(
                    "budget.plan",
                    f"needs epsilon {to_text(plan_epsilon)} ({budget.plan_bound} at delta="
                    f"{to_text(budget.first_plan_delta)}), more than budget.epsilon {to_text(eps)}.",
                )
            budget = replace(budget, plan_epsilon=plan_epsilon)
        if segments is not None:
            budget = _stored_segments(budget, segments)
        return budget

    @property
    def plan_bound(self) -> str:
        """What a declared plan's ε is, in words (error messages)."""
        return "PRV upper bound" if self.plan_pricing is None else "tight upper bound"

    @property
    def first_plan_delta(self) -> Decimal:
        """The δ the plan declared at creation is priced at (``plan_delta``, else the whole δ)."""
        return self.delta if self.plan_delta is None else self.plan_delta

    @property
    def plan_segments(self) -> tuple[PlanSegment, ...]:
        """Every declared plan in order: the plan declared at creation, then ``segments``
        (empty unless sequential ``prv``). The last one is the open segment."""
        if self.plan is None or self.plan_epsilon is None:
            return ()
        return (PlanSegment(self.plan, self.first_plan_delta, self.plan_epsilon), *self.segments)

    def with_segment(self, plan: Sequence[DpEvent], delta: Decimal | float | str) -> Budget:
        """This budget with one more declared plan segment, priced at ``delta`` as the budget
        prices its plans (``plan_pricing``: PRV, or the tight engine).

        The segment's (εᵢ, δᵢ) = (upper ε of ``plan`` at δᵢ, δᵢ) are fixed now, before any of
        its events runs, and admitted only while Σεᵢ ≤ ε and Σδᵢ ≤ δ over every segment declared
        so far: the basic-composition privacy filter (Rogers, Roth, Ullman & Vadhan 2016,
        Thm. 3.6), valid when each segment's plan and δᵢ are chosen after seeing what earlier
        segments released. ``InvalidArgumentError`` names ``plan``, ``plan[i]`` or ``delta``."""
        if self.rule != "sequential" or self.accountant != "prv" or self.plan is None:
            raise InvalidArgumentError(
                "plan",
                "plan segments apply to a budget with rule 'sequential' and accountant 'prv' only. "
                f"Found rule {self.rule!r}, accountant {self.accountant!r}.",
            )
        steps = self._plan(self.rule, self.accountant, plan, "plan")
        assert steps is not None
        share = budget_number("delta", delta)
        held = exact_sum(s.delta for s in self.plan_segments)
        left = exact_sub(self.delta, held)
        if not 0 < share <= left:
            raise InvalidArgumentError(
                "delta",
                f"must be in (0, {to_text(left)}]: the budget's delta {to_text(self.delta)} less the "
                f"{to_text(held)} its {len(self.plan_segments)} declared segment(s) hold. Found {delta!r}.",
            )
        segment = PlanSegment(steps, share, compute_plan_epsilon(steps, share, self.plan_pricing))
        return _with_segments(self, (*self.segments, segment), "plan")

    @staticmethod
    def _schedule(rule: str, eps: Decimal, geometric: object) -> GeometricSchedule | None:
        if rule != "geometric":
            if geometric is not None:
                raise InvalidArgumentError(
                    "budget.geometric", f"applies to rule 'geometric' only. Found rule {rule!r}."
                )
            return None
        if geometric is None:
            return GeometricSchedule(exact_mul(eps, Decimal("0.5")), Decimal("0.5"))
        if isinstance(geometric, GeometricSchedule):
            first_in: object = geometric.first
            ratio_in: object = geometric.ratio
            copies_in: object = geometric.copies
            single_in: object = geometric.single
        elif isinstance(geometric, Mapping):
            first_in = geometric.get("first")
            ratio_in = geometric.get("ratio", Decimal("0.5"))
            copies_in = geometric.get("copies", 1)
            single_in = geometric.get("single", ZERO)
        else:
            raise InvalidArgumentError(
                "budget.geometric", f"must be an object {{first, ratio}}. Found {geometric!r}."
            )
        ratio = budget_number("budget.geometric.ratio", ratio_in)
        if not 0 < ratio < 1:
            raise InvalidArgumentError("budget.geometric.ratio", f"must be in (0, 1). Found {ratio_in!r}.")
        if (
            isinstance(copies_in, bool)
            or not isinstance(copies_in, int)
            or not 1 <= copies_in <= MAX_GEOMETRIC_COPIES
        ):
            raise InvalidArgumentError(
                "budget.geometric.copies",
                f"must be an integer in [1, {MAX_GEOMETRIC_COPIES}]. Found {copies_in!r}.",
            )
        single = budget_number("budget.geometric.single", single_in)
        if not 0 <= single <= eps:
            raise InvalidArgumentError(
                "budget.geometric.single", f"must be in [0, epsilon]. Found {single_in!r}."
            )
        if first_in is None:
            if copies_in == 1 and single == 0:
                first_in = exact_mul(eps, Decimal("0.5"))  # the default series ε/2, ε/4, ...
            else:  # what the single level leaves, shared by the copies: (ε − single)(1 − ratio)/copies
                left = _LEVEL_DOWN.multiply(exact_sub(eps, single), exact_sub(Decimal(1), ratio))
                first_in = _LEVEL_DOWN.divide(left, Decimal(copies_in))
        first = budget_number("budget.geometric.first", first_in)
        if first <= 0:
            raise InvalidArgumentError("budget.geometric.first", f"must be > 0. Found {first_in!r}.")
        if 0 < single < first:
            raise InvalidArgumentError(
                "budget.geometric.single",
                f"must be 0 or >= first (levels keep non-increasing allowances). Found "
                f"single={to_text(single)}, first={to_text(first)}.",
            )
        schedule = GeometricSchedule(first, ratio, copies_in, single)
        if copies_in == 1 and single == 0:
            # first/(1 − ratio) ≤ ε, checked exactly as first ≤ ε·(1 − ratio).
            fits = first <= exact_mul(eps, exact_sub(Decimal(1), ratio))
        else:
            # single + copies·first/(1 − ratio) ≤ ε, exactly: copies·first ≤ (ε − single)(1 − ratio).
            fits = exact_mul(Decimal(copies_in), first) <= exact_mul(
                exact_sub(eps, single), exact_sub(Decimal(1), ratio)
            )
        if not fits:
            raise InvalidArgumentError(
                "budget.geometric.first",
                f"must satisfy single + copies*first/(1 - ratio) <= epsilon (the infinite-horizon "
                f"bound). Found first={to_text(first)}, ratio={to_text(ratio)}, copies={copies_in}, "
                f"single={to_text(single)}, epsilon={to_text(eps)}.",
            )
        return schedule

    @staticmethod
    def _plan(
        rule: str, accountant: str, plan: object, field: str = "budget.plan"
    ) -> tuple[DpEvent, ...] | None:
        needs_plan = rule == "sequential" and accountant == "prv"
        if plan is None:
            if needs_plan:
                raise InvalidArgumentError(
                    "budget.plan",
                    "is required for accountant 'prv' with rule 'sequential': tight PRV numbers "
                    "hold only for a plan of events declared when the budget is created.",
                )
            return None
        if not needs_plan:
            raise InvalidArgumentError(
                "budget.plan",
                f"applies to rule 'sequential' with accountant 'prv' only. Found rule {rule!r}, "
                f"accountant {accountant!r}.",
            )
        if isinstance(plan, str | bytes) or not isinstance(plan, Sequence):
            raise InvalidArgumentError(field, f"must be a list of events. Found {plan!r}.")
        if not 1 <= len(plan) <= MAX_PLAN_EVENTS:
            raise InvalidArgumentError(field, f"must hold 1 to {MAX_PLAN_EVENTS} events. Found {len(plan)}.")
        for i, step in enumerate(plan):
            if not isinstance(step, DpEvent):
                raise InvalidArgumentError(f"{field}[{i}]", f"must be an event. Found {step!r}.")
        return tuple(plan)

    @property
    def uses_filter(self) -> bool:
        """Charges compose through a privacy filter whose guarantee is the budget's (ε, δ): the
        Rényi filter (``rdp``) or the union of filters (``tight``), sequential or lifelong."""
        return self.accountant in ("rdp", "tight") and self.rule in ("sequential", "lifelong")

    @property
    def uses_union(self) -> bool:
        """Charges compose through the ``tight`` union of filters (``accountant.rules.tight``)."""
        return self.accountant == "tight" and self.rule in ("sequential", "lifelong")

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "epsilon": to_text(self.epsilon),
            "delta": to_text(self.delta),
            "accountant": self.accountant,
            "geometric": None if self.geometric is None else self.geometric.to_json(),
            "orders": None if self.orders is None else list(self.orders),
            "plan": None if self.plan is None else [ev.to_json(e) for e in self.plan],
            "plan_epsilon": None if self.plan_epsilon is None else to_text(self.plan_epsilon),
            **(
                {}
                if self.delta_weights is None
                else {"delta_weights": [to_text(w) for w in self.delta_weights]}
            ),
            # Omitted when unset, so a budget without segments serialises (and hashes) as before.
            **({} if self.plan_delta is None else {"plan_delta": to_text(self.plan_delta)}),
            **({} if not self.segments else {"segments": [s.to_json() for s in self.segments]}),
            **({} if self.plan_pricing is None else {"plan_pricing": self.plan_pricing}),
        }

    @classmethod
    def from_json(cls, obj: object, *, trust_plan_epsilon: bool = True) -> Budget:
        """Parse and validate. A stored ``plan_epsilon`` is reused unless told not to trust it
        (``certificates.verify`` recomputes it); the PRV computation is the expensive part."""
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError("budget", f"must be an object. Found {obj!r}.")
        plan_obj = obj.get("plan")
        plan: list[DpEvent] | None = None
        if plan_obj is not None:
            if not isinstance(plan_obj, list):
                raise InvalidArgumentError("budget.plan", "must be a list of events.")
            plan = [_event("budget.plan", i, e) for i, e in enumerate(plan_obj)]
        stored = obj.get("plan_epsilon")
        plan_epsilon = None
        if trust_plan_epsilon and stored is not None:
            plan_epsilon = budget_number("budget.plan_epsilon", stored)
        budget = cls._build(
            rule=obj.get("rule"),
            epsilon=obj.get("epsilon"),
            delta=obj.get("delta"),
            accountant=obj.get("accountant"),
            geometric=obj.get("geometric"),
            orders=obj.get("orders"),
            plan=plan,
            plan_epsilon=plan_epsilon,
            delta_weights=obj.get("delta_weights"),
            plan_delta=obj.get("plan_delta"),
            segments=_parsed_segments(obj.get("segments"), trust_plan_epsilon),
            plan_pricing=obj.get("plan_pricing"),
        )
        if not trust_plan_epsilon and stored is not None and budget.plan_epsilon is not None:
            if budget_number("budget.plan_epsilon", stored) != budget.plan_epsilon:
                raise InvalidArgumentError(
                    "budget.plan_epsilon",
                    f"does not match the plan: recomputed {to_text(budget.plan_epsilon)}, stored {stored!r}.",
                )
        return budget


def grown_from(earlier: Mapping[str, Any], later: Mapping[str, Any]) -> bool:
    """Whether the budget JSON ``later`` is ``earlier`` with zero or more plan segments declared
    after it (``Budget.with_segment``): every other field equal, ``earlier``'s segments a prefix
    of ``later``'s. A certificate is issued under the budget as it stood then; a budget changes
    in no other way."""
    before = earlier.get("segments") or []
    after = later.get("segments") or []
    if not isinstance(before, list) or not isinstance(after, list) or after[: len(before)] != before:
        return False
    rest = {k: v for k, v in earlier.items() if k != "segments"}
    return rest == {k: v for k, v in later.items() if k != "segments"}


_Parsed = tuple[tuple[DpEvent, ...], Decimal, Decimal, bool]


def _parsed_segments(obj: object, trust_epsilon: bool) -> list[_Parsed] | None:
    """A stored budget's ``segments``: (plan, δᵢ, stored εᵢ, whether to trust it)."""
    if obj is None:
        return None
    if not isinstance(obj, list) or not obj:
        raise InvalidArgumentError("budget.segments", "must be a non-empty list of segments.")
    out: list[_Parsed] = []
    for i, item in enumerate(obj):
        path = f"budget.segments[{i}]"
        if not isinstance(item, Mapping) or set(item) != {"plan", "delta", "epsilon"}:
            raise InvalidArgumentError(path, "must be an object {plan, delta, epsilon}.")
        plan_obj = item["plan"]
        if not isinstance(plan_obj, list):
            raise InvalidArgumentError(f"{path}.plan", "must be a list of events.")
        plan = tuple(_event(f"{path}.plan", j, e) for j, e in enumerate(plan_obj))
        delta = budget_number(f"{path}.delta", item["delta"])
        stored = budget_number(f"{path}.epsilon", item["epsilon"])
        out.append((plan, delta, stored, trust_epsilon))
    return out


def _stored_segments(budget: Budget, segments: object) -> Budget:
    """``budget`` with the segments a stored budget lists, each checked as ``with_segment``
    checked it; an ε that is not trusted is recomputed and must equal the stored one."""
    assert isinstance(segments, list)
    if budget.plan is None:
        raise InvalidArgumentError("budget.segments", "apply to a declared plan only (sequential, prv).")
    for i, (plan, delta, stored, trusted) in enumerate(segments):
        try:
            if not trusted:
                budget = budget.with_segment(plan, delta)
                if budget.segments[-1].epsilon != stored:
                    raise InvalidArgumentError(
                        "epsilon",
                        f"does not match the plan: recomputed {to_text(budget.segments[-1].epsilon)}, "
                        f"stored {to_text(stored)}.",
                    )
            else:
                steps = budget._plan(budget.rule, budget.accountant, plan, "plan")
                assert steps is not None
                budget = _with_segments(budget, (*budget.segments, PlanSegment(steps, delta, stored)), "plan")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"budget.segments[{i}].{exc.field}", exc.message) from None
    return budget


def _with_segments(budget: Budget, segments: tuple[PlanSegment, ...], field: str) -> Budget:
    """``budget`` with ``segments``, refused unless Σεᵢ ≤ ε and Σδᵢ ≤ δ over every declared
    segment (the basic-composition filter's condition, exact in decimals)."""
    grown = replace(budget, segments=segments)
    total_eps = exact_sum(s.epsilon for s in grown.plan_segments)
    total_delta = exact_sum(s.delta for s in grown.plan_segments)
    last = grown.plan_segments[-1]
    if total_delta > budget.delta or last.delta <= 0:
        raise InvalidArgumentError(
            "delta",
            f"the segments' deltas sum to {to_text(total_delta)}, more than budget.delta "
            f"{to_text(budget.delta)} (each must be > 0).",
        )
    if total_eps > budget.epsilon:
        # The earlier segments' sum, not total - last: a segment of epsilon Infinity (a sigma so
        # small its PRV bound is infinite) made that Infinity - Infinity, a 500 (issue 24 §6).
        earlier = exact_sum(s.epsilon for s in grown.plan_segments[:-1])
        raise InvalidArgumentError(
            field,
            f"needs epsilon {to_text(last.epsilon)} ({budget.plan_bound} at delta={to_text(last.delta)}); "
            f"with the {to_text(earlier)} the earlier segments hold that is "
            f"{to_text(total_eps)}, more than budget.epsilon {to_text(budget.epsilon)}.",
        )
    return grown


def _event(field_name: str, index: int, obj: object) -> DpEvent:
    try:
        return ev.from_json(obj, f"{field_name}[{index}]")
    except EventValidationError as exc:
        raise InvalidArgumentError(exc.field, exc.message) from None


@lru_cache(maxsize=256)
def _filter_for(
    epsilon: Decimal, delta: Decimal, orders: tuple[float, ...], weights: tuple[Decimal, ...] | None
) -> RenyiFilter:
    return RenyiFilter(epsilon=epsilon, delta=delta, orders=orders, weights=weights)


def renyi_filter(budget: Budget) -> RenyiFilter:
    """The budget's Rényi filter (accountant ``rdp``); built once per (ε, δ, orders)."""
    if budget.orders is None:
        raise InvalidArgumentError("budget.orders", "is needed for a Rényi filter.")
    return _filter_for(budget.epsilon, budget.delta, budget.orders, budget.delta_weights)
