"""A Rényi privacy filter over an order grid fixed when a budget is created.

Theorem relied on
-----------------
**Feldman & Zrnic 2021, "Individual Privacy Accounting via a Rényi Filter", Theorem 3.1** (fully
adaptive composition for RDP): let mechanisms A₁, A₂, … be chosen adaptively, the i-th one
(α, ρᵢ)-RDP given the outputs of the first i−1 (ρᵢ is *predictable*: a function of the past), and
run A_i only if Σ_{j≤i} ρⱼ ≤ B (otherwise output ⊥ and go on). Then the whole interaction is
(α, B)-RDP, whatever the analyst's strategy. Lécuyer 2021 ("Practical privacy filters and
odometers with Rényi differential privacy and applications to DP-SGD") gives the same filter and
discusses filters over several orders.

**RDP → (ε, δ) conversion** (Balle, Barthe, Gaboardi, Hsu & Sato 2020, Thm. 21; Canonne, Kamath
& Steinke 2020, Prop. 12 — the "improved" conversion): an (α, ρ)-RDP mechanism, α > 1, is
(ε, δ)-DP for every δ ∈ (0, 1) with

    ε = ρ + g(α, δ),   g(α, δ) = log(1 − 1/α) − (log δ + log α)/(α − 1).

Construction
------------
The ledger wants an (ε, δ) budget, not an (α, B) one, and no single order is best for every
sequence of charges. The filter therefore runs one Feldman–Zrnic filter per order α of a grid
fixed at budget creation and admits a charge iff **some** order still fits:

1. δ split. Each order α has a weight w_α, Σ w_α ≤ 1: equal (1/K for a grid of K orders), or
   the weights stored with the budget (``placed_grid``: a grid placed for the budget's (ε, δ)).
   An order is *active* iff ε − g(α, w_α·δ) > 0 (an order without positive allowance can never
   admit anything). Let A be the active set; every active order gets δ_α = δ·w_α/Σ_{β∈A} w_β
   (≥ w_α·δ, so every active order stays positive; with equal weights δ/|A|) and the allowance

       B(α) = ε − g(α, δ_α),   rounded DOWN to 18 significant digits,

   with g computed in floating point and then bounded from above (see "Numerical safety").
   Orders outside A are never consulted.
2. Admission. With exact per-order sums S_α (Decimal; each charge's RDP rounded UP), a charge
   c is admitted iff there is an active α with S_α + c_α ≤ B(α) (exact comparison; equality
   admits).

Why (ε, δ)-DP holds for the whole interaction M. For α ∈ A let M_α be the single-order filter
at α (admit iff S_α + c_α ≤ B(α); refuse and continue otherwise). By Theorem 3.1, M_α is
(α, B(α))-RDP, hence (ε, δ_α)-DP by the conversion above. Let G_α be the set of transcripts in
which every charge that M admitted fitted order α. Sums only grow (RDP ≥ 0), so an order that
fits a charge fitted every earlier one; hence an order fitting the last admitted charge lies in
G_α for that transcript, and the G_α cover all transcripts. The charges and the admission
decisions are part of the transcript (the ledger publishes them), so each G_α is a measurable
set of outputs, and on G_α M and M_α take the same decision at every step: P[M(D) ∈ S ∩ G_α]
= P[M_α(D) ∈ S ∩ G_α] for every S. Partition the cover into H_α = G_α \\ ∪_{β<α} G_β; then for
neighbouring D, D′

    P[M(D) ∈ S] = Σ_α P[M_α(D) ∈ S ∩ H_α] ≤ Σ_α (e^ε P[M_α(D′) ∈ S ∩ H_α] + δ_α)
                = e^ε P[M(D′) ∈ S] + Σ_{α∈A} δ_α = e^ε P[M(D′) ∈ S] + δ.

So the filter is (ε, δ)-DP under fully adaptive choices, with δ split over the active orders (a
union bound; Σ_{α∈A} δ_α ≤ δ whatever the weights, as long as they are fixed before the first
charge). Refused charges are never run; a reservation that is aborted before its
output is released is likewise never part of the transcript.

``epsilon_of(spent)`` is a progress indicator, not a separate guarantee (a data-dependent ε would
need a privacy *odometer*): the smallest ε′ such that the sums would still fit a filter whose
orders and δ_α are these ones, i.e. min_{α∈A} max(0, S_α + g(α, δ_α)). It is monotone in the
sums, 0 for no spend, and ≤ ε whenever the sums fit. The certified guarantee is the filter's
(ε, δ).

Numerical safety
----------------
Every float g(α, δ) is replaced by an upper bound: the three terms' absolute values are summed
and 2⁻⁴⁵ of that (hundreds of ulps, far above the few ulps of log, log1p and the two additions)
is added before rounding up to a Decimal. δ_α is rounded down before its logarithm (a smaller δ
gives a larger g). Allowances are rounded down and charges up, so rounding can only refuse, never
admit, a charge.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Final

from accountant.errors import InvalidArgumentError
from accountant.exact import (
    INFINITY,
    SIGNIFICANT_DIGITS,
    ZERO,
    as_written,
    exact_add,
    exact_sub,
    round_down,
    round_up,
)
from accountant.rdp import MAX_ORDER, MAX_ORDER_WORK

# About twenty orders: dense where DP-SGD-like charges bind (2–16), sparse above. Every extra
# order costs δ (the split is δ/|A|), so the grid is deliberately smaller than an accountant's.
DEFAULT_FILTER_ORDERS: Final[tuple[float, ...]] = (
    1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0,
    8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0, 32.0, 64.0, 128.0,
)  # fmt: skip
MAX_ORDERS: Final = 1000
# Safety margin on g, relative to the sum of the terms' magnitudes (see "Numerical safety").
_MARGIN: Final = 2.0**-45


_UP: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_CEILING, Emax=10**6, Emin=-(10**6))
_DOWN: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_FLOOR, Emax=10**6, Emin=-(10**6))


def _ceil(value: Decimal) -> Decimal:
    """``value`` rounded up to 18 significant digits (unchanged when it is that short)."""
    return _UP.plus(value)


def _floor(value: Decimal) -> Decimal:
    """``value`` rounded down to 18 significant digits (unchanged when it is that short)."""
    return _DOWN.plus(value)


def check_orders(orders: Sequence[float], field: str = "orders") -> tuple[float, ...]:
    """Validate an order grid: 1..1000 distinct finite numbers in (1, 2^20] with Σ⌈α⌉ ≤ 2^21,
    returned sorted.

    Checked when the budget is created: the RDP accountant computes every charge's curve at these
    orders and refuses an order above 2^20 (``accountant.rdp.MAX_ORDER``), so a grid accepted
    here and refused there would make every reservation of the dataset fail. The sum bounds the
    work of one sampled event's curve (``accountant.rdp.MAX_ORDER_WORK``).
    """
    if isinstance(orders, str | bytes) or not isinstance(orders, Sequence):
        raise InvalidArgumentError(field, f"must be a list of numbers > 1. Found {orders!r}.")
    if not 1 <= len(orders) <= MAX_ORDERS:
        raise InvalidArgumentError(field, f"must hold 1 to {MAX_ORDERS} orders. Found {len(orders)}.")
    out: list[float] = []
    for i, alpha in enumerate(orders):
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise InvalidArgumentError(f"{field}[{i}]", f"must be a number > 1. Found {alpha!r}.")
        if not math.isfinite(alpha) or not 1 < alpha <= MAX_ORDER:
            raise InvalidArgumentError(f"{field}[{i}]", f"must be finite and in (1, 2^20]. Found {alpha}.")
        out.append(float(alpha))
    if len(set(out)) != len(out):
        raise InvalidArgumentError(field, "must not repeat an order.")
    work = sum(math.ceil(alpha) for alpha in out)
    if work > MAX_ORDER_WORK:
        raise InvalidArgumentError(
            field,
            f"must have a sum of ceil(order) of at most 2^21 = {MAX_ORDER_WORK} (every charge's RDP "
            f"curve costs that much work). Found {work}.",
        )
    return tuple(sorted(out))


def conversion_offset(alpha: float, delta: float) -> Decimal:
    """An upper bound on g(α, δ) = log(1 − 1/α) − (log δ + log α)/(α − 1), as a Decimal.

    (α, ρ)-RDP implies (ρ + g(α, δ), δ)-DP (Balle et al. 2020, Thm. 21; Canonne–Kamath–Steinke
    2020, Prop. 12). ``delta`` must already be rounded down by the caller.
    """
    if not 0 < delta < 1:
        raise InvalidArgumentError("delta", f"must be in (0, 1) to convert RDP. Found {delta}.")
    terms = (
        math.log1p(-1.0 / alpha),
        -math.log(delta) / (alpha - 1.0),
        -math.log(alpha) / (alpha - 1.0),
    )
    value = math.fsum(terms) + _MARGIN * math.fsum(abs(t) for t in terms)
    # An upper bound either way: round_up(v) ≥ v; for v < 0, −round_down(−v) ≥ v.
    return round_up(value) if value >= 0 else -round_down(-value)


def as_charge(rdp: Sequence[float]) -> tuple[Decimal, ...]:
    """An RDP curve from an accountant as Decimals rounded UP (NaN is refused)."""
    out = []
    for i, value in enumerate(rdp):
        v = float(value)
        if math.isnan(v) or v < 0:
            raise InvalidArgumentError(f"rdp[{i}]", f"must be >= 0 and not NaN. Found {v}.")
        out.append(round_up(v))
    return tuple(out)


def rdp_epsilon(rdp: Sequence[Decimal], orders: Sequence[float], delta: float) -> Decimal:
    """ε upper bound of ONE mechanism (no filter, no δ split) with RDP curve ``rdp`` at δ.

    min over orders of max(0, ρ_α + g(α, δ)) (the improved conversion), rounded up to 18
    significant digits. δ = 0 gives ∞ unless the curve is zero. Valid for a single event whose
    parameters were fixed before it ran, and for each geometric level's charge.
    """
    if len(rdp) != len(orders):
        raise InvalidArgumentError("rdp", f"must have one value per order ({len(orders)}).")
    if all(r == 0 for r in rdp):
        return ZERO
    if delta <= 0:
        return INFINITY
    best = INFINITY
    safe_delta = math.nextafter(math.nextafter(delta, 0.0), 0.0)
    for rho, alpha in zip(rdp, orders, strict=True):
        if rho.is_infinite():
            continue
        value = max(ZERO, _ceil(exact_add(rho, conversion_offset(alpha, safe_delta))))
        best = min(best, value)
    return best


# Budget-placed grids (``placed_grid``): the core spans 0.55–0.95 × x_B in steps of ×1.2, where
# α = 1 + x_B is the order at which a Gaussian-shaped spend (ρ ∝ α) exactly uses up (ε, δ); the
# tail adds orders at ×1.5, ×1.5², … above the core (up to α = 512, for spends far below the
# budget) and one at ½ below it. 85% of the δ goes to the core by exp(−η·ε·x), 15% to every
# order equally. Chosen on DP-SGD runs calibrated to 35–100% of budgets ε ∈ {4, 8, 16}, δ ∈
# {1e-5, 1e-7} (``python bench/charges.py``, docs/ACCOUNTING.md).
_CORE_LOW: Final = 0.55
_CORE_STEP: Final = 1.2
_CORE_ORDERS: Final = 4
_TAIL_STEP: Final = 1.5
_TAIL_TOP: Final = 512.0
_SPREAD: Final = 0.15


def placed_grid(epsilon: Decimal, delta: Decimal) -> tuple[tuple[float, ...], tuple[Decimal, ...]]:
    """Orders and δ weights of a Rényi filter placed for the budget (ε, δ).

    Where the filter binds. A run that uses up the budget is certified at the order α* that
    minimises ρ(α) + g(α, δ_α). For a spend shaped like a Gaussian mechanism's (ρ = cα) that is
    α* = 1 + x_B with x_B ≈ 2·log(1/δ)/ε; a subsampled Gaussian's curve bends up, which moves
    its α* down, to about 0.5–1.1 × x_B for DP-SGD runs calibrated to the budget. The core orders
    cover that range; the tail orders certify smaller spends (larger α*) and larger ones.

    Why weights. A δ share w·δ costs log(1/w)/(α − 1) at its order (``conversion_offset``), a
    penalty that is largest at small α. The core's part of the weights is ∝ exp(−η·ε·x) (x = α −
    1, η fixed so that they sum to 1): the relative penalty log(1/w)/(x·ε) is then about η at
    every core order, instead of log K/(x·ε) with equal shares, largest at the smallest x. That
    is what decides admissions near the budget. A run far below the budget binds at a tail
    order, where a tiny share costs much, so 15% of δ is spread over all orders equally: runs at
    90–100% of the budget are certified within about 1.10× plain RDP (1.17× with the fixed grid)
    and runs at 35–50% within about 1.27× (1.17×). The trade-off is measured in ACCOUNTING.md.

    The grid is a function of (ε, δ) alone and is stored with the budget, so a filter built from
    it is as data-independent as one on a fixed grid (the filter's proof needs only that orders
    and shares are fixed before the first charge). Orders are rounded to 4 significant digits,
    weights down to 6, so they read well and sum to at most 1.
    """
    eps, dlt = float(epsilon), float(delta)
    x_b = _binding_x(eps, dlt)
    core = [x_b * _CORE_LOW * _CORE_STEP**j for j in range(_CORE_ORDERS)]
    tail = [core[-1] * _TAIL_STEP]
    while 1.0 + tail[-1] * _TAIL_STEP <= _TAIL_TOP:
        tail.append(tail[-1] * _TAIL_STEP)
    tail.append(core[0] / 2.0)
    chosen: dict[float, bool] = {}
    for i, x in enumerate(core + tail):
        alpha = float(f"{1.0 + x:.4g}")
        if 1.0 < alpha <= MAX_ORDER and alpha not in chosen:
            chosen[alpha] = i < len(core)
    while sum(math.ceil(a) for a in chosen) > MAX_ORDER_WORK:
        del chosen[max(chosen)]
    orders = sorted(chosen)
    eta = _weight_rate([a - 1.0 for a in orders if chosen[a]], eps, 1.0)
    weights = []
    for a in orders:
        focused = math.exp(-eta * eps * (a - 1.0)) if chosen[a] else 0.0
        w = (1.0 - _SPREAD) * focused + _SPREAD / len(orders)
        weights.append(_DOWN6.plus(Decimal(repr(w))))
    return tuple(orders), tuple(weights)


_DOWN6: Final = decimal.Context(prec=6, rounding=ROUND_FLOOR)


def _binding_x(epsilon: float, delta: float) -> float:
    """x_B = α* − 1 for a spend ρ(α) = c·α whose best conversion at δ is exactly ε."""
    alphas = [1.0 + 10.0 ** (k / 200.0) for k in range(-800, 1201)]  # α − 1 from 1e-4 to 1e6
    alphas = [a for a in alphas if a <= MAX_ORDER]
    offsets = [math.log1p(-1.0 / a) - (math.log(delta) + math.log(a)) / (a - 1.0) for a in alphas]

    def best(c: float) -> tuple[float, float]:
        return min((c * a + g, a) for a, g in zip(alphas, offsets, strict=True))

    lo, hi = 0.0, 1.0
    while best(hi)[0] < epsilon:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if best(mid)[0] < epsilon else (lo, mid)
    return best(hi)[1] - 1.0


def _weight_rate(xs: Sequence[float], epsilon: float, total: float) -> float:
    """η with Σ exp(−η·ε·x) = total over the core orders (bisection; the sum falls with η)."""
    lo, hi = 0.0, 1.0
    while sum(math.exp(-hi * epsilon * x) for x in xs) > total:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if sum(math.exp(-mid * epsilon * x) for x in xs) > total else (lo, mid)
    return hi


class RenyiFilter:
    """Rényi privacy filter with an (ε, δ) budget over a fixed order grid (see module docstring).

    ``allowance[i]`` is B(α_i), rounded down; ``active[i]`` says whether order i is consulted;
    ``delta_per_order`` is the δ_α of every active order (δ/|A|, rounded down).
    """

    __slots__ = (
        "active",
        "allowance",
        "delta",
        "delta_per_order",
        "delta_shares",
        "epsilon",
        "offset",
        "orders",
        "weights",
    )

    def __init__(
        self,
        *,
        epsilon: Decimal | float | str,
        delta: Decimal | float | str,
        orders: Sequence[float],
        weights: Sequence[Decimal | str] | None = None,
    ) -> None:
        eps = _decimal("epsilon", epsilon)
        dlt = _decimal("delta", delta)
        if not eps.is_finite() or eps <= 0:
            raise InvalidArgumentError("epsilon", f"must be finite and > 0. Found {eps}.")
        if not dlt.is_finite() or not 0 < dlt < 1:
            raise InvalidArgumentError(
                "delta", f"must be in (0, 1) for a Rényi filter (RDP gives no pure DP). Found {dlt}."
            )
        self.epsilon: Decimal = eps
        self.delta: Decimal = dlt
        self.orders: tuple[float, ...] = check_orders(orders)
        self.weights: tuple[Decimal, ...] | None = (
            None if weights is None else check_weights(weights, len(self.orders))
        )
        if self.weights is None:
            grid_deltas = [_delta_share(dlt, len(self.orders))] * len(self.orders)
        else:
            grid_deltas = [_weighted_share(dlt, w, Decimal(1)) for w in self.weights]
        candidates = [
            exact_sub(eps, conversion_offset(a, d)) > 0 for a, d in zip(self.orders, grid_deltas, strict=True)
        ]
        n_active = sum(candidates)
        if n_active == 0:
            raise InvalidArgumentError(
                "epsilon",
                f"is too small for a Rényi filter at delta={dlt}: no order of the grid has a "
                f"positive allowance. Found {eps}.",
            )
        # δ is split over the active orders only: equally (no weights), or in proportion to the
        # weights renormalised over the active set (each share ≥ its share of the whole grid).
        # An inactive order keeps its whole-grid share: it admits nothing, and its weight over the
        # active set's alone could exceed δ itself (a tight budget at a tiny ε had δ·w/Σ_active w > 1).
        if self.weights is None:
            shares = [_delta_share(dlt, n_active)] * len(self.orders)
        else:
            active_weight = sum((w for w, on in zip(self.weights, candidates, strict=True) if on), ZERO)
            shares = [
                _weighted_share(dlt, w, active_weight) if on else grid
                for w, on, grid in zip(self.weights, candidates, grid_deltas, strict=True)
            ]
        self.delta_shares: tuple[float, ...] = tuple(shares)
        self.delta_per_order: float = min(d for d, on in zip(shares, candidates, strict=True) if on)
        self.offset: tuple[Decimal, ...] = tuple(
            conversion_offset(a, d) for a, d in zip(self.orders, shares, strict=True)
        )
        self.allowance: tuple[Decimal, ...] = tuple(_floor(exact_sub(eps, g)) for g in self.offset)
        # Active = positive at the grid-wide share; the active-set share is no smaller, so their
        # allowances only grow.
        self.active: tuple[bool, ...] = tuple(candidates)

    def __repr__(self) -> str:
        return (
            f"RenyiFilter(epsilon={self.epsilon}, delta={self.delta}, orders={self.orders}, "
            f"active={sum(self.active)})"
        )

    def _check(self, name: str, vector: Sequence[Decimal]) -> None:
        if len(vector) != len(self.orders):
            raise InvalidArgumentError(
                name, f"must have one value per order ({len(self.orders)}). Found {len(vector)}."
            )

    def fits(self, spent: Sequence[Decimal]) -> bool:
        """Whether the sums ``spent`` are within the filter: some active order within allowance."""
        self._check("spent", spent)
        if all(s == 0 for s in spent):
            return True
        return any(on and s <= b for on, s, b in zip(self.active, spent, self.allowance, strict=True))

    def admits(self, spent: Sequence[Decimal], charge: Sequence[Decimal]) -> bool:
        """Whether ``charge`` may run after ``spent``: ∃ active α with S_α + c_α ≤ B(α) (exact)."""
        self._check("spent", spent)
        self._check("charge", charge)
        if all(c == 0 for c in charge):
            return True  # a charge that costs nothing at every order changes no sum
        return any(
            on and exact_add(s, c) <= b
            for on, s, c, b in zip(self.active, spent, charge, self.allowance, strict=True)
        )

    def epsilon_of(self, spent: Sequence[Decimal]) -> Decimal:
        """min over active orders of max(0, S_α + g(α, δ_α)), rounded up; 0 for no spend."""
        self._check("spent", spent)
        if all(s == 0 for s in spent):
            return ZERO
        best = INFINITY
        for on, s, g in zip(self.active, spent, self.offset, strict=True):
            if on and s.is_finite():
                best = min(best, max(ZERO, _ceil(exact_add(s, g))))
        return best

    def binding_orders(self, spent: Sequence[Decimal]) -> tuple[float, ...]:
        """The active orders whose sums are still within their allowance."""
        self._check("spent", spent)
        return tuple(
            a
            for a, on, s, b in zip(self.orders, self.active, spent, self.allowance, strict=True)
            if on and s <= b
        )


def _decimal(field: str, value: Decimal | float | str) -> Decimal:
    try:
        return as_written(value)
    except (ValueError, TypeError, ArithmeticError):
        raise InvalidArgumentError(field, f"must be a number. Found {value!r}.") from None


def _delta_share(delta: Decimal, parts: int) -> float:
    """δ/parts as a float rounded DOWN (two ulps absorb the Decimal→float and division)."""
    share = float(delta) / parts
    return math.nextafter(math.nextafter(share, 0.0), 0.0)


def _weighted_share(delta: Decimal, weight: Decimal, total: Decimal) -> float:
    """δ·weight/total as a float rounded DOWN: the exact Decimal quotient rounded down, then
    two ulps below its float (absorbing the Decimal→float conversion)."""
    share = _DOWN.divide(_DOWN.multiply(delta, weight), total)
    return math.nextafter(math.nextafter(float(share), 0.0), 0.0)


def check_weights(
    weights: Sequence[Decimal | str], n: int, field: str = "delta_weights"
) -> tuple[Decimal, ...]:
    """Validate δ weights: one per order, each a number in (0, 1], summing to at most 1 (exact)."""
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
        raise InvalidArgumentError(field, f"must be a list of numbers, one per order. Found {weights!r}.")
    if len(weights) != n:
        raise InvalidArgumentError(field, f"must hold one weight per order ({n}). Found {len(weights)}.")
    out: list[Decimal] = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, Decimal | str | int | float):
            raise InvalidArgumentError(f"{field}[{i}]", f"must be a number in (0, 1]. Found {w!r}.")
        try:
            value = as_written(w)
        except (ValueError, TypeError, ArithmeticError):
            raise InvalidArgumentError(f"{field}[{i}]", f"must be a number in (0, 1]. Found {w!r}.") from None
        if not value.is_finite() or not 0 < value <= 1:
            raise InvalidArgumentError(f"{field}[{i}]", f"must be a number in (0, 1]. Found {w!r}.")
        out.append(value)
    total = ZERO
    for value in out:
        total = exact_add(total, value)
    if total > 1:
        raise InvalidArgumentError(
            field, f"must sum to at most 1 (a union bound over the orders). Found {total}."
        )
    return tuple(out)


__all__ = [
    "DEFAULT_FILTER_ORDERS",
    "RenyiFilter",
    "as_charge",
    "check_orders",
    "check_weights",
    "conversion_offset",
    "placed_grid",
    "rdp_epsilon",
]
