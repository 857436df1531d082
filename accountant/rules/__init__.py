"""The ledger's semantics: four composition rules as pure functions over per-batch state.

Theorems relied on (each rule module states its own in full):

* **parallel composition over disjoint batches** (McSherry 2009, Thm. 4): a record lives in one
  batch, so a dataset's guarantee is the maximum over its batches of each batch's spend
  (``dataset_epsilon``), never the sum;
* per batch, the budget's rule: ``sequential`` (basic composition / Rényi filter, Feldman &
  Zrnic 2021 Thm. 3.1 / PRV for a declared plan), ``parallel`` (one read per batch; assumption S2
  of DP continual learning with pre-trained models), ``lifelong`` (L2DP-ML Thm. 2: replays of
  committed noise are post-processing), ``geometric`` (continual / sliding-window release,
  Thm. 1, 4, 7: level k has allowance first·ratioᵏ, total ≤ first/(1−ratio) ≤ ε).

The service keeps one ``BatchState`` per batch (an aggregate, so it never scans charges) and calls

* ``reserve(budget, state, charge) -> Admission`` — cost the charge on this batch and hold it
  (``BudgetExceeded`` / ``ChargeRefused`` / ``UnsupportedEventError`` otherwise, state unchanged);
* ``commit(budget, state, charge, reserved, committed_before, partial_event=None) -> Settlement``
  — turn (part of) a hold into spend; ``partial_event`` is the run so far (progressive commit),
  ``None`` the whole reserved charge; ``Settlement.committed`` is the cumulative committed cost;
* ``cancel(budget, state, reserved, committed) -> BatchState`` — abort / expire: return what was
  held and not committed; with nothing committed also free the reservation's discrete slot
  (parallel read, geometric level, noise commitment, plan position).

Budget numbers are ``Decimal`` (``accountant.exact``): user numbers as written, computed costs
rounded UP to 18 significant digits, sums and comparisons exact. A reservation's ``Cost`` is
stored by the service and handed back at commit and cancel time; the state returned by every call
is authoritative (for the Rényi filter its ε fields are derived from per-order sums).
"""

from __future__ import annotations

import decimal
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from accountant import events as ev
from accountant.canonical import canonical_json, sha256_hex
from accountant.errors import AccountantError, InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, as_written, exact_mul, exact_sub, to_text
from accountant.rdp_filter import DEFAULT_FILTER_ORDERS, RenyiFilter, check_orders, check_weights, placed_grid

if TYPE_CHECKING:
    from types import ModuleType

RULES: Final = ("lifelong", "parallel", "sequential", "geometric")
ACCOUNTANTS: Final = ("basic", "rdp", "prv")
# Which accountants each rule accepts, and why the others are refused (Budget.create).
SUPPORTED: Final[Mapping[str, tuple[str, ...]]] = {
    "sequential": ("basic", "rdp", "prv"),
    "parallel": ("basic", "rdp", "prv"),
    "lifelong": ("basic", "rdp"),
    "geometric": ("basic", "rdp"),
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
MAX_COMMITMENT_LENGTH: Final = 256
# Geometric levels 0..MAX_GEOMETRIC_LEVEL. With the default ratio 1/2 level 1000's allowance is
# first·2⁻¹⁰⁰⁰ ≈ 1e-301·first: below any ε an accountant computes in floating point (it is
# subnormal as a float), so no real charge needs a deeper level. For ratios near 1 it caps one
# block at 1001 releases. The cap also bounds the level search (binary search over 0..1000).
MAX_GEOMETRIC_LEVEL: Final = 1000


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BudgetExceeded(AccountantError):
    """The charge does not fit. ``requested`` / ``remaining``: ``{"epsilon": str, "delta": str}``."""

    def __init__(self, requested: Mapping[str, str], remaining: Mapping[str, str], message: str = "") -> None:
        self.requested: dict[str, str] = dict(requested)
        self.remaining: dict[str, str] = dict(remaining)
        self.message = message or (
            f"requested epsilon={self.requested.get('epsilon')}, "
            f"delta={self.requested.get('delta')} exceeds the remaining "
            f"epsilon={self.remaining.get('epsilon')}, delta={self.remaining.get('delta')}."
        )
        super().__init__(self.message)


class ChargeRefused(AccountantError):
    """The rule refuses the charge whatever the budget. ``code`` is stable (the API's error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------------------------------------
# Canonical JSON and fingerprints
# ---------------------------------------------------------------------------------------------


def event_fingerprint(event: DpEvent) -> str:
    """``sha256:<hex>`` of the event's canonical JSON (identifies the noise of a commitment)."""

    def compute() -> str:
        return f"sha256:{sha256_hex(ev.to_json(event))}"

    return memoized("fingerprint", None, event, None, compute)


# ---------------------------------------------------------------------------------------------
# Prices computed once per request
# ---------------------------------------------------------------------------------------------

_T = TypeVar("_T")


class PriceMemo:
    """What one request's events cost under one budget, computed once and reused.

    Why: a service decides a charge while it holds a lock (the ledger's write transaction), and a
    price can take seconds (an event's RDP curve at a thousand orders). The service prices first,
    outside the lock, with ``with pricing(memo):`` around a dry run of ``reserve`` / ``commit``,
    and then decides under the lock inside the same ``with``: every state-independent number
    (fingerprint, basic (ε, δ), RDP curve, ε of a fresh charge, a plan prefix's PRV ε, a geometric
    level's price) is then a lookup, and what runs under the lock is additions and comparisons
    on the batches' states. The numbers are the same functions' answers, so decisions are the
    same as without a memo.

    Entries are keyed by the *identity* of the event they price (events are immutable and the
    memo holds a reference to each, so an id is never reused while it lives): an O(1) lookup,
    where hashing a 10 000-node event is not. The memo is bound to the ``budget`` object; under
    any other object it is not consulted (``adopt`` rebinds it to an equal one).
    """

    __slots__ = ("_values", "budget")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._values: dict[tuple[str, int, Hashable], tuple[object, object]] = {}

    def __len__(self) -> int:
        return len(self._values)

    def adopt(self, budget: Budget) -> bool:
        """Bind the memo to ``budget`` if it equals the memo's budget (prices depend only on the
        budget's value); whether the memo now applies to ``budget``."""
        if self.budget is not budget and self.budget == budget:
            self.budget = budget
        return self.budget is budget

    def get(self, name: str, anchor: object, extra: Hashable, compute: Callable[[], _T]) -> _T:
        key = (name, id(anchor), extra)
        hit = self._values.get(key)
        if hit is not None and hit[0] is anchor:
            value: _T = hit[1]  # type: ignore[assignment]
            return value
        value = compute()
        self._values[key] = (anchor, value)
        return value


_MEMO: Final[ContextVar[PriceMemo | None]] = ContextVar("accountant_price_memo", default=None)


@contextmanager
def pricing(memo: PriceMemo) -> Iterator[PriceMemo]:
    """Within the block, the pricing functions of the rules read and fill ``memo``."""
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)


def memoized(
    name: str, budget: Budget | None, anchor: object, extra: Hashable, compute: Callable[[], _T]
) -> _T:
    """``compute()``, or the value the active ``PriceMemo`` holds for (name, anchor, extra) under
    the active pricing version.

    ``budget``: the budget the value depends on (``None``: none); a memo bound to another budget
    object is not consulted."""
    memo = _MEMO.get()
    if memo is None or (budget is not None and memo.budget is not budget):
        return compute()
    return memo.get(name, anchor, (extra, _PRICING.get()), compute)


# ---------------------------------------------------------------------------------------------
# Pricing versions
# ---------------------------------------------------------------------------------------------

PRICING_VERSION: Final = 2
"""How single charges and the naive figure are priced (certificates record it as ``pricing``).

1 — before issue 13 §3: a single charge (``parallel``, a ``geometric`` level) on the budget's
    order grid with δ charged only when ε > 0; the naive figure each charge's single-charge ε.
2 — a single charge is the minimum of the RDP bound on the accountant's full grid, the coupling
    bound and the exact basic bound; the naive figure uses the rule's own conversion and is
    floored at the batch's spend (``sequential.fresh_price``, ``naive_price``).

Both are valid upper bounds; a certificate re-verifies under the version that issued it, so an
upgrade never turns a stored certificate invalid. New charges use ``PRICING_VERSION``."""

_PRICING: Final[ContextVar[int]] = ContextVar("accountant_pricing_version", default=PRICING_VERSION)


@contextmanager
def pricing_version(version: int) -> Iterator[int]:
    """Within the block, charges are priced as ``version`` prices them (certificate replays)."""
    if version not in (1, 2):
        raise InvalidArgumentError("pricing", f"must be 1 or 2. Found {version!r}.")
    token = _PRICING.set(version)
    try:
        yield version
    finally:
        _PRICING.reset(token)


def active_pricing() -> int:
    """The pricing version in force (``PRICING_VERSION`` unless a replay set another)."""
    return _PRICING.get()


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


def _budget_number(field_name: str, value: object) -> Decimal:
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
    ``plan_epsilon`` its PRV upper ε at δ (sequential ``prv``). Build with ``create``.
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
    ) -> Budget:
        """Validate and fill defaults. ``InvalidArgumentError`` names the field (``budget.*``).

        A Rényi-filter budget (``rdp``, sequential or lifelong) without ``orders`` gets a grid
        placed for its (ε, δ) with non-uniform δ weights (``accountant.rdp_filter.placed_grid``);
        with ``orders`` and no ``delta_weights``, δ is split equally over the active orders."""
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
        eps = _budget_number("budget.epsilon", epsilon)
        if eps <= 0:
            raise InvalidArgumentError("budget.epsilon", f"must be finite and > 0. Found {epsilon!r}.")
        dlt = _budget_number("budget.delta", delta)
        if not 0 <= dlt < 1:
            raise InvalidArgumentError("budget.delta", f"must be in [0, 1). Found {delta!r}.")
        if accountant in ("rdp", "prv") and dlt == 0:
            raise InvalidArgumentError(
                "budget.delta",
                f"must be > 0 for accountant {accountant!r} (it bounds (epsilon, delta)-DP with "
                f"delta > 0; use 'basic' for pure DP). Found {delta!r}.",
            )
        schedule = cls._schedule(rule, eps, geometric)
        grid: tuple[float, ...] | None = None
        if orders is not None and accountant != "rdp":
            raise InvalidArgumentError(
                "budget.orders", f"applies to accountant 'rdp' only. Found accountant {accountant!r}."
            )
        weights: tuple[Decimal, ...] | None = None
        if delta_weights is not None and (accountant != "rdp" or rule not in ("sequential", "lifelong")):
            raise InvalidArgumentError(
                "budget.delta_weights",
                "applies to a Rényi filter only (accountant 'rdp', rule sequential or lifelong).",
            )
        if delta_weights is not None and orders is None:
            raise InvalidArgumentError("budget.delta_weights", "needs budget.orders (one weight per order).")
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
        budget = cls(rule, eps, dlt, accountant, schedule, grid, steps, None, weights)
        if budget.uses_filter:
            try:
                renyi_filter(budget)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"budget.{exc.field}", exc.message) from None
        if steps is not None:
            if plan_epsilon is None:
                from accountant.rules.sequential import plan_epsilon as compute_plan_epsilon

                plan_epsilon = compute_plan_epsilon(steps, dlt)
            if not plan_epsilon <= eps:
                raise InvalidArgumentError(
                    "budget.plan",
                    f"needs epsilon {to_text(plan_epsilon)} (PRV upper bound at delta={dlt}), "
                    f"more than budget.epsilon {to_text(eps)}.",
                )
            budget = replace(budget, plan_epsilon=plan_epsilon)
        return budget

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
        ratio = _budget_number("budget.geometric.ratio", ratio_in)
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
        single = _budget_number("budget.geometric.single", single_in)
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
        first = _budget_number("budget.geometric.first", first_in)
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
    def _plan(rule: str, accountant: str, plan: object) -> tuple[DpEvent, ...] | None:
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
            raise InvalidArgumentError("budget.plan", f"must be a list of events. Found {plan!r}.")
        if not 1 <= len(plan) <= MAX_PLAN_EVENTS:
            raise InvalidArgumentError(
                "budget.plan", f"must hold 1 to {MAX_PLAN_EVENTS} events. Found {len(plan)}."
            )
        for i, step in enumerate(plan):
            if not isinstance(step, DpEvent):
                raise InvalidArgumentError(f"budget.plan[{i}]", f"must be an event. Found {step!r}.")
        return tuple(plan)

    @property
    def uses_filter(self) -> bool:
        """Charges compose through the Rényi filter (sequential or lifelong on ``rdp``)."""
        return self.accountant == "rdp" and self.rule in ("sequential", "lifelong")

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
            plan_epsilon = _budget_number("budget.plan_epsilon", stored)
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
        )
        if not trust_plan_epsilon and stored is not None and budget.plan_epsilon is not None:
            if _budget_number("budget.plan_epsilon", stored) != budget.plan_epsilon:
                raise InvalidArgumentError(
                    "budget.plan_epsilon",
                    f"does not match the plan: recomputed {to_text(budget.plan_epsilon)}, stored {stored!r}.",
                )
        return budget


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


# ---------------------------------------------------------------------------------------------
# Charges, costs, per-batch state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Charge:
    """What a reservation ran on a batch: the event, and for lifelong budgets its noise commitment
    (an opaque id of one fixed noise draw). Other rules ignore ``noise_commitment``."""

    event: DpEvent
    noise_commitment: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.event, DpEvent):
            raise InvalidArgumentError("event", f"must be an event. Found {self.event!r}.")
        c = self.noise_commitment
        if c is not None and (
            not isinstance(c, str) or not 1 <= len(c) <= MAX_COMMITMENT_LENGTH or not c.isprintable()
        ):
            raise InvalidArgumentError(
                "noise_commitment",
                f"must be a printable string of 1 to {MAX_COMMITMENT_LENGTH} characters. Found {c!r}.",
            )

    def to_json(self) -> dict[str, Any]:
        return {"event": ev.to_json(self.event), "noise_commitment": self.noise_commitment}

    @classmethod
    def from_json(cls, obj: object) -> Charge:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError("charge", f"must be an object. Found {obj!r}.")
        try:
            event = ev.from_json(obj.get("event"), "charge.event")
        except EventValidationError as exc:
            raise InvalidArgumentError(exc.field, exc.message) from None
        return cls(event, obj.get("noise_commitment"))


def _decimal_field(obj: Mapping[str, Any], name: str, path: str) -> Decimal:
    value = obj.get(name)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{path}.{name}", f"must be a decimal string. Found {value!r}.")
    number = _budget_number(f"{path}.{name}", value)
    return number


def _vector_field(obj: Mapping[str, Any], name: str, path: str) -> tuple[Decimal, ...] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{path}.{name}", "must be a list of decimal strings or null.")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidArgumentError(f"{path}.{name}[{i}]", f"must be a decimal string. Found {item!r}.")
        out.append(_budget_number(f"{path}.{name}[{i}]", item))
    return tuple(out)


def _int_field(obj: Mapping[str, Any], name: str, path: str, *, optional: bool = False) -> int | None:
    value = obj.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{path}.{name}", f"must be an integer >= 0. Found {value!r}.")
    return value


def _vector_json(vector: tuple[Decimal, ...] | None) -> list[str] | None:
    return None if vector is None else [to_text(v) for v in vector]


@dataclass(frozen=True, slots=True)
class Cost:
    """What one reservation adds to one batch (``Admission.cost``), or what it has committed so
    far (``Settlement.committed``, cumulative).

    ``epsilon``/``delta``: the increase of the batch's spend under the rule (for the Rényi filter:
    the increase of its derived ε indicator when it was computed; the per-order sums ``rdp`` are
    authoritative). ``naive_epsilon``: the charge's ε as a fresh charge (replays and geometric
    levels included). ``fingerprint``: of the event accounted. ``level``: the geometric level.
    ``replay``: a lifelong replay of committed noise. ``plan_position``: the prv plan entry.
    """

    epsilon: Decimal
    delta: Decimal
    naive_epsilon: Decimal
    fingerprint: str
    rdp: tuple[Decimal, ...] | None = None
    level: int | None = None
    replay: bool = False
    noise_commitment: str | None = None
    plan_position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "epsilon": to_text(self.epsilon),
            "delta": to_text(self.delta),
            "naive_epsilon": to_text(self.naive_epsilon),
            "fingerprint": self.fingerprint,
            "rdp": _vector_json(self.rdp),
            "level": self.level,
            "replay": self.replay,
            "noise_commitment": self.noise_commitment,
            "plan_position": self.plan_position,
        }

    @classmethod
    def from_json(cls, obj: object, path: str = "cost") -> Cost:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, f"must be an object. Found {obj!r}.")
        fingerprint = obj.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise InvalidArgumentError(f"{path}.fingerprint", "must be a string.")
        replay = obj.get("replay", False)
        if not isinstance(replay, bool):
            raise InvalidArgumentError(f"{path}.replay", "must be a boolean.")
        commitment = obj.get("noise_commitment")
        if commitment is not None and not isinstance(commitment, str):
            raise InvalidArgumentError(f"{path}.noise_commitment", "must be a string or null.")
        return cls(
            epsilon=_decimal_field(obj, "epsilon", path),
            delta=_decimal_field(obj, "delta", path),
            naive_epsilon=_decimal_field(obj, "naive_epsilon", path),
            fingerprint=fingerprint,
            rdp=_vector_field(obj, "rdp", path),
            level=_int_field(obj, "level", path, optional=True),
            replay=replay,
            noise_commitment=commitment,
            plan_position=_int_field(obj, "plan_position", path, optional=True),
        )


@dataclass(frozen=True, slots=True)
class NoiseCommitment:
    """A lifelong batch's fixed noise draw: the event it was drawn for, and whether it has been
    committed (released). Only committed noise can be replayed for free."""

    commitment: str
    fingerprint: str
    committed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "commitment": self.commitment,
            "fingerprint": self.fingerprint,
            "committed": self.committed,
        }


@dataclass(frozen=True, slots=True)
class BatchState:
    """Per-batch aggregate, JSON-serialisable; the service stores it and passes it back.

    ``epsilon_spent`` (committed, under the rule), ``epsilon_held`` (reserved, not committed),
    ``delta_spent`` / ``delta_held`` likewise; ``naive_epsilon``: committed, every charge counted
    as fresh. ``reads``: reservations on the batch not cancelled before any commit. Rule state:
    ``rdp_spent`` / ``rdp_held`` (Rényi filter per-order sums; ``None`` = all zero), ``levels``
    (geometric levels in use, sorted), ``noise_commitments`` (lifelong, sorted),
    ``plan_position`` / ``plan_open`` (prv: plan entries claimed; a reservation is open).
    ``neighbouring_relation``: ``"add_remove"`` or ``"replace_one"`` once a charge whose event
    states one has been reserved on the batch (``None``: none has; rows stored before the field
    existed read as ``None``). Charges under the other relation are refused (``reserve``).
    """

    epsilon_spent: Decimal = ZERO
    epsilon_held: Decimal = ZERO
    delta_spent: Decimal = ZERO
    delta_held: Decimal = ZERO
    naive_epsilon: Decimal = ZERO
    reads: int = 0
    rdp_spent: tuple[Decimal, ...] | None = None
    rdp_held: tuple[Decimal, ...] | None = None
    levels: tuple[int, ...] = ()
    noise_commitments: tuple[NoiseCommitment, ...] = field(default=())
    plan_position: int = 0
    plan_open: bool = False
    neighbouring_relation: str | None = None

    @classmethod
    def empty(cls) -> BatchState:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {
            "epsilon_spent": to_text(self.epsilon_spent),
            "epsilon_held": to_text(self.epsilon_held),
            "delta_spent": to_text(self.delta_spent),
            "delta_held": to_text(self.delta_held),
            "naive_epsilon": to_text(self.naive_epsilon),
            "reads": self.reads,
            "rdp_spent": _vector_json(self.rdp_spent),
            "rdp_held": _vector_json(self.rdp_held),
            "levels": list(self.levels),
            "noise_commitments": [c.to_json() for c in self.noise_commitments],
            "plan_position": self.plan_position,
            "plan_open": self.plan_open,
            # Omitted when unset, so a state without a relation serialises as before.
            **(
                {}
                if self.neighbouring_relation is None
                else {"neighbouring_relation": self.neighbouring_relation}
            ),
        }

    @classmethod
    def from_json(cls, obj: object, path: str = "state") -> BatchState:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, f"must be an object. Found {obj!r}.")
        levels = obj.get("levels", [])
        if (
            not isinstance(levels, list)
            or any(
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_GEOMETRIC_LEVEL
                for k in levels
            )
            or sorted(set(levels)) != levels
        ):
            raise InvalidArgumentError(f"{path}.levels", "must be a sorted list of distinct levels.")
        commitments_obj = obj.get("noise_commitments", [])
        if not isinstance(commitments_obj, list):
            raise InvalidArgumentError(f"{path}.noise_commitments", "must be a list.")
        commitments = []
        for i, c in enumerate(commitments_obj):
            p = f"{path}.noise_commitments[{i}]"
            if (
                not isinstance(c, Mapping)
                or not all(isinstance(c.get(k), str) for k in ("commitment", "fingerprint"))
                or not isinstance(c.get("committed"), bool)
            ):
                raise InvalidArgumentError(p, "must be {commitment, fingerprint, committed}.")
            commitments.append(NoiseCommitment(c["commitment"], c["fingerprint"], c["committed"]))
        if [c.commitment for c in commitments] != sorted({c.commitment for c in commitments}):
            raise InvalidArgumentError(
                f"{path}.noise_commitments", "must be sorted by commitment, without repeats."
            )
        plan_open = obj.get("plan_open", False)
        if not isinstance(plan_open, bool):
            raise InvalidArgumentError(f"{path}.plan_open", "must be a boolean.")
        relation = obj.get("neighbouring_relation")
        if relation is not None and relation not in (ev.ADD_REMOVE, ev.REPLACE_ONE):
            raise InvalidArgumentError(
                f"{path}.neighbouring_relation",
                f"must be {ev.ADD_REMOVE!r}, {ev.REPLACE_ONE!r} or absent. Found {relation!r}.",
            )
        state = cls(
            epsilon_spent=_decimal_field(obj, "epsilon_spent", path),
            epsilon_held=_decimal_field(obj, "epsilon_held", path),
            delta_spent=_decimal_field(obj, "delta_spent", path),
            delta_held=_decimal_field(obj, "delta_held", path),
            naive_epsilon=_decimal_field(obj, "naive_epsilon", path),
            reads=_int_field(obj, "reads", path) or 0,
            rdp_spent=_vector_field(obj, "rdp_spent", path),
            rdp_held=_vector_field(obj, "rdp_held", path),
            levels=tuple(levels),
            noise_commitments=tuple(commitments),
            plan_position=_int_field(obj, "plan_position", path) or 0,
            plan_open=plan_open,
            neighbouring_relation=relation,
        )
        for name in ("epsilon_spent", "epsilon_held", "delta_spent", "delta_held", "naive_epsilon"):
            if getattr(state, name) < 0:
                raise InvalidArgumentError(f"{path}.{name}", "must be >= 0.")
        return state


@dataclass(frozen=True, slots=True)
class Admission:
    """``reserve``'s answer: the batch's new state (charge held) and the reservation's cost."""

    state: BatchState
    cost: Cost


@dataclass(frozen=True, slots=True)
class Settlement:
    """``commit``'s answer: the batch's new state and the cumulative committed cost."""

    state: BatchState
    committed: Cost


# ---------------------------------------------------------------------------------------------
# The public functions: dispatch to the budget's rule
# ---------------------------------------------------------------------------------------------


class _Rule(Protocol):
    def reserve(self, budget: Budget, state: BatchState, charge: Charge) -> Admission: ...

    def commit(
        self,
        budget: Budget,
        state: BatchState,
        charge: Charge,
        reserved: Cost,
        committed_before: Cost | None,
        partial_event: DpEvent | None,
    ) -> Settlement: ...

    def cancel(
        self, budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None
    ) -> BatchState: ...

    def remaining(self, budget: Budget, state: BatchState) -> dict[str, str]: ...

    def within_budget(self, budget: Budget, state: BatchState) -> bool: ...

    def theorem(self, budget: Budget) -> str: ...


def _rule(budget: Budget) -> _Rule:
    # Imported here: the rule modules import this package's types.
    from accountant.rules import geometric, lifelong, parallel, sequential

    modules: dict[str, ModuleType] = {
        "sequential": sequential,
        "parallel": parallel,
        "lifelong": lifelong,
        "geometric": geometric,
    }
    module: _Rule = modules[budget.rule]
    return module


def reserve(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    """Cost ``charge`` on this batch under the budget's rule and hold it.

    Raises ``BudgetExceeded`` (does not fit), ``ChargeRefused`` (the rule forbids it: codes
    ``batch_already_read``, ``noise_commitment_mismatch``, ``noise_commitment_pending``,
    ``outside_plan``, ``plan_step_pending``, ``mixed_neighbouring_relations``) or
    ``UnsupportedEventError`` (the accountant cannot account the event).

    Every rule composes charges on a batch under **one** neighbouring relation
    (``neighbouring_relation``): the first charge whose event states one fixes it for the batch.
    """
    relation = neighbouring_relation(state, charge.event)
    admission = _rule(budget).reserve(budget, state, charge)
    if relation is not None and admission.state.neighbouring_relation != relation:
        admission = replace(admission, state=replace(admission.state, neighbouring_relation=relation))
    return admission


_RELATION_WORDS: Final = {ev.ADD_REMOVE: "add/remove-one", ev.REPLACE_ONE: "replace-one"}


def neighbouring_relation(state: BatchState, event: DpEvent) -> str | None:
    """The neighbouring relation ``event`` is stated under (``None``: it states none), checked
    against the batch's; ``ChargeRefused`` ``mixed_neighbouring_relations`` when they differ or
    the event itself mixes them (docs/DESIGN-NOTES.md note 21).

    A guarantee under add/remove neighbours and one under replace-one neighbours do not compose
    into a guarantee under either as stated: composition theorems (basic, Rényi, PRV) take every
    mechanism's bound over the *same* pairs of neighbouring datasets. Replace-one is two
    add/remove steps, so an (ε, δ) add/remove bound gives (2ε, (1 + e^ε)δ) under replace-one
    (group privacy, Dwork & Roth 2014 Thm. 2.2), and no replace-one bound gives any add/remove
    bound (a released count is 0-DP under replace-one). The ledger refuses instead of converting.
    """
    found = ev.neighbouring_relations(event)
    if len(found) > 1:
        raise ChargeRefused(
            "mixed_neighbouring_relations",
            f"the event mixes add/remove-one neighbours (its {found[ev.ADD_REMOVE]!r} event) and "
            f"replace-one neighbours (its {found[ev.REPLACE_ONE]!r} event); their bounds do not "
            "compose as stated. Reserve events of one relation on a batch.",
        )
    if not found:
        return None
    ((relation, kind),) = found.items()
    held = state.neighbouring_relation
    if held is not None and held != relation:
        raise ChargeRefused(
            "mixed_neighbouring_relations",
            f"this batch's charges are stated under {_RELATION_WORDS[held]} neighbours; a "
            f"{kind!r} event is stated under {_RELATION_WORDS[relation]} neighbours, and the two "
            "do not compose as stated. Reserve events of one relation on a batch.",
        )
    return relation


def commit(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None = None,
    previous_event: DpEvent | None = None,
) -> Settlement:
    """Commit the run so far (``partial_event``; ``None`` = the whole reserved charge).

    ``committed_before`` is the previous ``Settlement.committed`` of this reservation (``None``
    for its first commit), ``previous_event`` the run so far that commit settled (``None``: the
    first commit). The new cumulative cost is never more than ``reserved`` and never less than
    ``committed_before`` (spend is never taken back).

    A progressive commit describes *the reserved run, cut short*: ``partial_event`` must be a
    prefix of the reserved event (``sequential.is_prefix``: the same mechanism with fewer steps of
    a ``self_composed``, a prefix of a ``composed``), and each commit's run must extend the
    previous one. Otherwise the ledger would price an event chosen after the reservation — fresh
    noise passed off as a replay, a PRV plan entry swapped for another mechanism, two unrelated
    "runs so far" charged as their maximum instead of their composition — so it is refused:
    ``ChargeRefused`` ``commit_not_prefix`` / ``commit_does_not_extend`` (409).
    """
    from accountant.rules.sequential import is_prefix

    if partial_event is not None and not is_prefix(partial_event, charge.event):
        raise ChargeRefused(
            "commit_not_prefix",
            f"the committed event {_shown(partial_event)} is not a prefix of the reserved event "
            f"{_shown(charge.event)}: a progressive commit reports the reserved run cut short "
            "(the same mechanism, fewer steps), never another event. Reserve what ran instead.",
        )
    if previous_event is not None and not is_prefix(previous_event, partial_event or charge.event):
        raise ChargeRefused(
            "commit_does_not_extend",
            f"the committed event {_shown(partial_event or charge.event)} does not extend the run "
            f"committed before ({_shown(previous_event)}): each progressive commit reports the "
            "same run, further along.",
        )
    settlement = _rule(budget).commit(budget, state, charge, reserved, committed_before, partial_event)
    if budget.rule == "geometric" or active_pricing() < 2:
        return settlement
    return _naive_at_least_spent(settlement)


def _naive_at_least_spent(settlement: Settlement) -> Settlement:
    """``naive_sequential_epsilon`` is never below what the ledger charged the batch.

    The naive figure adds each charge's ε converted on its own the way the rule converts, so a
    single release's naive figure is the ledger's charge, and a sum of them is at least the
    filter's ε of the sum whenever the conversion offsets at the binding orders are ≥ 0 (RDP
    curves grow with the order). Where an offset is negative (a large δ share at a high order)
    the sum could fall a little short; then the ledger's own spend is the floor, so "without
    this rule" never looks cheaper than "with it". Not for ``geometric``: there the spend is the
    levels' allowances, reserved whole by design (a first 0.1 takes a level of ε/4), and the
    naive figure is the plain sum of the charges' ε′ (module ``geometric``)."""
    state = settlement.state
    if state.naive_epsilon >= state.epsilon_spent:
        return settlement
    return replace(settlement, state=replace(state, naive_epsilon=state.epsilon_spent))


def _shown(event: DpEvent, limit: int = 200) -> str:
    text = canonical_json(ev.to_json(event))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    """Abort / expire: return ``reserved − committed`` from held; with ``committed is None`` also
    free the reservation's slot (parallel read, geometric level, noise commitment, plan entry).
    After progressive commits, ``cancel`` closes the reservation (it may return nothing).

    Once no reservation is left on the batch (``reads`` back to 0: nothing held, nothing
    committed), its neighbouring relation is freed too, so a reserve-then-abort leaves the batch
    exactly as it was."""
    after = _rule(budget).cancel(budget, state, reserved, committed)
    if after.reads == 0 and after.neighbouring_relation is not None:
        after = replace(after, neighbouring_relation=None)
    return after


def remaining(budget: Budget, state: BatchState) -> dict[str, str]:
    """What this batch can still take: the largest single charge that would fit now, in the
    rule's terms (geometric: the largest free level; parallel: 0 once read)."""
    return _rule(budget).remaining(budget, state)


def within_budget(budget: Budget, state: BatchState) -> bool:
    """Whether the state (spent + held) respects the budget under its rule."""
    return _rule(budget).within_budget(budget, state)


def dataset_epsilon(budget: Budget, states: Iterable[BatchState]) -> Decimal:
    """The dataset's ε: the maximum over its disjoint batches of the committed spend (parallel
    composition, McSherry 2009 Thm. 4) — never the sum. 0 for no batches.

    Every call above leaves ``epsilon_spent`` equal or larger, so a service may keep the maximum
    incrementally over the batches a transaction touched."""
    del budget  # the same for every rule: disjoint batches compose in parallel
    return max((s.epsilon_spent for s in states), default=ZERO)


def naive_epsilon(states: Iterable[BatchState]) -> Decimal:
    """``naive_sequential_epsilon`` (docs/ARCHITECTURE.md, "The naive figure"): max over batches
    of the sum of every committed charge's ε as if fresh (replays and geometric levels counted)."""
    return max((s.naive_epsilon for s in states), default=ZERO)


def theorem(budget: Budget) -> str:
    """The theorem that justifies this budget's admissions (cited in certificates)."""
    return _rule(budget).theorem(budget)


__all__ = [
    "ACCOUNTANTS",
    "MAX_GEOMETRIC_COPIES",
    "MAX_GEOMETRIC_LEVEL",
    "PRICING_VERSION",
    "RULES",
    "SUPPORTED",
    "Admission",
    "BatchState",
    "Budget",
    "BudgetExceeded",
    "Charge",
    "ChargeRefused",
    "Cost",
    "GeometricSchedule",
    "NoiseCommitment",
    "PriceMemo",
    "Settlement",
    "active_pricing",
    "cancel",
    "canonical_json",
    "commit",
    "dataset_epsilon",
    "event_fingerprint",
    "memoized",
    "naive_epsilon",
    "neighbouring_relation",
    "pricing",
    "pricing_version",
    "remaining",
    "renyi_filter",
    "reserve",
    "theorem",
    "within_budget",
]
