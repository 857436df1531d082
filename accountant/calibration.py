"""Noise calibration: the smallest noise multiplier that meets a target (ε, δ).

DP-SGD with Poisson sampling probability q run for T steps is the event
``self_composed(poisson_sampled(q, gaussian(σ)), T)``. Its ε upper bound, from any registered
accountant (``accountant.base.make_accountant``), decreases as σ grows: for RDP every order's
curve decreases in σ (a larger σ is post-processing of a smaller one: add independent noise), and
the conversion to ε is monotone in the curve; PRV/PLD bounds follow the same true privacy curve.

What a target means. ``target_epsilon`` is what Opacus users mean by it: the run's *own* ε at δ
by the tight engine (``TIGHT_ACCOUNTANT``: the one function the ledger prices a run alone with,
``accountant.rules.prices.tight_epsilon`` — the analytic Gaussian, dp-accounting's pessimistic
PLD or PRV, rounded up to 6 digits — so a run calibrated to ε is charged at most ε wherever the
ledger charges it its own tight ε: a ``parallel`` charge, a ``geometric`` level's ε′), whatever
budget it is charged to (``calibrate_to_epsilon``; ``calibrate_noise_multiplier`` with
``accountant="prv"`` for DP-SGD). What a dataset *charges* for that run can be more (a Rényi
filter splits δ over its orders) or fit or not in what is left; calibrating to the charge is a
separate, explicitly named target (``target_budget_epsilon``: ``calibrate_to_price``). When the
budget cannot admit a run calibrated to ``target_epsilon``, ``largest_fitting_epsilon`` names the
largest target that fits.

``calibrate_noise_multiplier`` searches the grid σ_k = k·resolution (k = 1, 2, ...), each σ_k the
float nearest the decimal k·resolution, for the smallest σ_k whose ε **upper** bound is ≤ the
target: an exponential search for a bracket, then bisection on the integer k. The σ returned is
always one whose upper bound was computed and found ≤ the target, so calibration never
overshoots the target even if a numerical accountant were not exactly monotone (then "smallest"
holds for the bracket the bisection followed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from decimal import ROUND_FLOOR, Decimal
from typing import Final

from accountant.errors import InvalidArgumentError
from accountant.events import MAX_COUNT, DpEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from accountant.registry import make_accountant

MAX_NOISE_MULTIPLIER: Final = 1e6
"""The largest σ considered: if even this σ misses the target, calibration fails."""


def _check_target_epsilon(value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgumentError("target_epsilon", f"must be finite and > 0. Found {value}.")
    return float(value)


def _check_delta(value: float) -> float:
    # δ = 0 is not reachable with Gaussian noise: no σ gives pure DP.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError("delta", f"must be finite and in (0, 1). Found {value}.")
    if not 0 < value < 1:
        raise InvalidArgumentError("delta", f"must be in (0, 1). Found {value}.")
    return float(value)


def _check_probability(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgumentError("sampling_probability", f"must be in (0, 1]. Found {value}.")
    if not 0 < value <= 1:
        raise InvalidArgumentError("sampling_probability", f"must be in (0, 1]. Found {value}.")
    return float(value)


def _check_steps(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise InvalidArgumentError("steps", f"must be an integer in [1, 10^18]. Found {value!r}.")
    return value


def _check_resolution(value: float) -> Decimal:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise InvalidArgumentError("resolution", f"must be finite and in (0, 1]. Found {value}.")
    return Decimal(repr(float(value)))


def _epsilon_upper(
    *, accountant: str, noise_multiplier: float, sampling_probability: float, steps: int, delta: float
) -> float:
    """ε upper bound of T steps of the Poisson-sampled Gaussian mechanism under ``accountant``
    (``TIGHT_ACCOUNTANT``: the ledger's tight price, ``tight_epsilon``)."""
    event = PoissonSampledEvent(sampling_probability, GaussianEvent(noise_multiplier))
    if accountant == TIGHT_ACCOUNTANT:
        return tight_epsilon(SelfComposedEvent(event, steps), delta)
    return make_accountant(accountant).compose(event, steps).get_epsilon(delta).upper


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int,
    accountant: str = "rdp",
    resolution: float = 1e-4,
) -> float:
    """The smallest σ = k·``resolution`` (k ≥ 1) with ε upper bound ≤ ``target_epsilon`` at ``delta``
    for ``steps`` steps of the Gaussian mechanism on Poisson samples of probability
    ``sampling_probability``, accounted by the registered ``accountant`` ("rdp", "prv", ...) or
    by the ledger's tight price (``TIGHT_ACCOUNTANT``, "tight").

    Raises ``InvalidArgumentError`` naming the field for bad arguments, and naming
    ``target_epsilon`` when no σ up to ``MAX_NOISE_MULTIPLIER`` reaches the target.
    """
    target = _check_target_epsilon(target_epsilon)
    delta = _check_delta(delta)
    q = _check_probability(sampling_probability)
    steps = _check_steps(steps)
    step = _check_resolution(resolution)
    if accountant != TIGHT_ACCOUNTANT:
        make_accountant(accountant)  # an unknown name fails here, naming "accountant"

    def meets(sigma: float) -> bool:
        upper = _epsilon_upper(
            accountant=accountant, noise_multiplier=sigma, sampling_probability=q, steps=steps, delta=delta
        )
        return upper <= target

    try:
        return smallest_noise(meets, start=1.0, resolution=float(step))
    except InvalidArgumentError:
        raise InvalidArgumentError(
            "target_epsilon",
            f"cannot be reached: even noise_multiplier={MAX_NOISE_MULTIPLIER:g} gives an epsilon "
            f"upper bound above {target} at delta={delta} for sampling_probability={q} and "
            f"steps={steps}.",
        ) from None


TIGHT_ACCOUNTANT: Final = "tight"
"""The name ``target_epsilon`` is met under (``calibrate_noise_multiplier(accountant=...)``): the
ledger's own tight price of the run alone (``tight_epsilon``). Before issue 25 §3 this was the
``prv`` accountant, whose ε differed slightly from what the ledger then charged."""


def tight_epsilon(event: DpEvent, delta: float) -> float:
    """The run's own ε at ``delta``: exactly the ledger's price of ``event`` run alone,
    ``accountant.rules.prices.tight_epsilon`` at the decimal δ = ``repr(delta)`` (a budget's "1e-5"
    is the float 1e-5's repr), under the pricing version in force — a float equal to that decimal
    (6 significant digits, rounded up: a valid upper bound)."""
    from accountant.rules.prices import tight_epsilon as ledger_price

    return float(ledger_price(event, Decimal(repr(_check_delta(delta)))))


def calibrate_to_epsilon(
    make_event: Callable[[float], DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    start: float = 1.0,
    resolution: float = 1e-4,
) -> float:
    """The smallest σ = k·``resolution`` whose run ``make_event(σ)`` has ``tight_epsilon`` ≤
    ``target_epsilon`` at ``delta``: ``target_epsilon`` as Opacus users mean it (the run's own ε,
    not what a budget charges for it). ``InvalidArgumentError`` naming ``target_epsilon`` when no
    σ up to ``MAX_NOISE_MULTIPLIER`` reaches it."""
    target = _check_target_epsilon(target_epsilon)
    delta = _check_delta(delta)
    return smallest_noise(
        lambda sigma: tight_epsilon(make_event(sigma), delta) <= target, start=start, resolution=resolution
    )


_FIT_DIGITS: Final = Decimal("0.0001")  # the largest fitting target is named to 4 decimals, rounded down
_FIT_TRIES: Final = 20


def largest_fitting_epsilon(
    make_event: Callable[[float], DpEvent],
    *,
    admits: Callable[[DpEvent], bool],
    delta: float,
    start: float = 1.0,
    resolution: float = 1e-4,
) -> float | None:
    """The largest ``target_epsilon`` (to 4 decimals, rounded down) whose run, calibrated by
    ``calibrate_to_epsilon``, ``admits`` accepts (a dataset's quote: the budget can hold it);
    ``None`` when no σ up to ``MAX_NOISE_MULTIPLIER`` is admitted.

    ``admits`` must be monotone in σ (more noise is charged no more). The smallest admitted σ*
    is searched first; its run's tight ε, rounded down, is the candidate. The candidate is
    checked by calibrating to it and asking ``admits`` again (a numerical accountant need not be
    exactly monotone), lowered by 0.1% until it is admitted: the named target always fits."""
    delta = _check_delta(delta)
    try:
        sigma = smallest_noise(lambda s: admits(make_event(s)), start=start, resolution=resolution)
    except InvalidArgumentError:
        return None
    candidate = Decimal(repr(tight_epsilon(make_event(sigma), delta))).quantize(
        _FIT_DIGITS, rounding=ROUND_FLOOR
    )
    for _ in range(_FIT_TRIES):
        if candidate <= 0:
            return None
        try:
            calibrated = calibrate_to_epsilon(
                make_event, target_epsilon=float(candidate), delta=delta, start=sigma, resolution=resolution
            )
        except InvalidArgumentError:
            return None
        if admits(make_event(calibrated)):
            return float(candidate)
        candidate = (candidate * Decimal("0.999")).quantize(_FIT_DIGITS, rounding=ROUND_FLOOR)
    return None


def largest_fitting_target(
    admits: Callable[[float], bool], *, below: float, resolution: float = 1e-4
) -> float | None:
    """The largest target t = k·``resolution`` < ``below`` (k ≥ 1) with ``admits(t)``; ``None``
    when even t = ``resolution`` is not admitted. ``largest_fitting_epsilon``'s form for a run of
    several events each calibrated to the target on its own (a staged run: every stage's σ
    calibrated by ``calibrate_to_epsilon``), where no one σ parametrises the run.

    ``admits`` must be monotone (a smaller target gives every event more noise, charged no
    more); it answers ``False`` for a target no σ reaches. The same "double, then bisect" search
    as ``smallest_noise``, on k: the t returned was asked and admitted, so it always fits."""
    limit = _check_target_epsilon(below)
    step = _check_resolution(resolution)

    def target(k: int) -> float:
        return float(Decimal(k) * step)

    k_max = int((Decimal(repr(limit)) / step).to_integral_value(rounding=ROUND_FLOOR))
    if target(k_max) >= limit:
        k_max -= 1
    if k_max < 1:
        return None
    # From t = 1 (doubling up or halving down): the questions grow with the answer's size, not
    # with ``below`` (a client's target of 1e300 must not cost a thousand calibrations).
    k_one = int(Decimal(1) / step)
    refused = _smallest_meeting(
        lambda k: k > k_max or not admits(target(k)), k_start=min(k_one, k_max), k_max=k_max + 1
    )
    assert refused is not None  # k_max + 1 is refused by definition
    return target(refused - 1) if refused > 1 else None


def calibrate_to_price(
    make_event: Callable[[float], DpEvent],
    *,
    start: float,
    target_epsilon: float,
    price: Callable[[DpEvent], Decimal],
    resolution: float = 1e-4,
) -> float:
    """The smallest σ = k·``resolution`` with ``price(make_event(σ)) ≤ target_epsilon``.

    ``price`` is what a ledger would *charge* the event (a dataset's quote: its rule, grid and δ
    split), which can exceed an accountant's own ε for the same event — a Rényi filter splits δ
    over its orders. ``start`` is a σ to search from (the accountant's own calibration, a
    lower bound when the price is at least the accountant's ε). The price must fall as σ grows,
    as every accountant's ε does (larger noise is post-processing of smaller).

    ``InvalidArgumentError`` naming ``target_epsilon`` when no σ up to ``MAX_NOISE_MULTIPLIER``
    is priced at or below the target."""
    target = Decimal(repr(_check_target_epsilon(target_epsilon)))
    return smallest_noise(
        lambda sigma: price(make_event(sigma)) <= target, start=start, resolution=resolution
    )


def smallest_noise(meets: Callable[[float], bool], *, start: float = 1.0, resolution: float = 1e-4) -> float:
    """The smallest σ = k·``resolution`` (k ≥ 1) with ``meets(σ)``, searching from ``start``:
    the one "double, then bisect" search every calibration uses. ``meets`` must be monotone in σ
    (False, then True). ``InvalidArgumentError`` naming ``target_epsilon`` when even
    ``MAX_NOISE_MULTIPLIER`` does not meet it."""
    step = _check_resolution(resolution)

    def sigma(k: int) -> float:
        return float(Decimal(k) * step)

    k_max = int(Decimal(repr(MAX_NOISE_MULTIPLIER)) / step)
    k = _smallest_meeting(
        lambda k: meets(sigma(k)), k_start=max(1, int(Decimal(repr(float(start))) / step)), k_max=k_max
    )
    if k is None:
        raise InvalidArgumentError(
            "target_epsilon",
            f"cannot be reached: even noise_multiplier={MAX_NOISE_MULTIPLIER:g} does not meet it.",
        )
    return sigma(k)


def _smallest_meeting(meets: Callable[[int], bool], *, k_start: int, k_max: int) -> int | None:
    """The smallest k in [1, k_max] with ``meets(k)`` (``meets`` monotone: False then True), or
    None if ``meets(k_max)`` fails. Exponential search from ``k_start`` (halving or doubling) for
    a bracket (failing, passing], then bisection on the integer k."""
    k_start = min(max(1, k_start), k_max)
    if meets(k_start):
        failing, passing = 0, k_start  # k = 0 stands for "every k >= 1 may pass"
        probe = k_start // 2
        while probe >= 1:
            if not meets(probe):
                failing = probe
                break
            passing = probe
            probe //= 2
    else:
        failing, passing = k_start, k_max
        probe = k_start
        while True:
            probe = min(2 * probe, k_max)
            if meets(probe):
                passing = probe
                break
            if probe == k_max:
                return None
            failing = probe
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if meets(middle):
            passing = middle
        else:
            failing = middle
    return passing


# ---------------------------------------------------------------------------------------------
# What a fresh budget charges: the price callables a trainer calibrates against (issue 29 §4:
# trainers receive these, as DP-SGD receives its dataset's quote, and import no pricing rule)
# ---------------------------------------------------------------------------------------------


def single_charge_price(
    *, delta: float, accountant: str, rule: str = "parallel"
) -> Callable[[DpEvent], Decimal]:
    """ε of an event charged on its own at ``delta`` by a fresh ``rule`` budget on ``accountant``:
    what a ``parallel`` batch pays (``accountant.rules.prices.fresh_price``: since pricing
    version 4 the event's tight ε; before, for ``rdp`` its curve on the accountant's full grid
    converted at δ, for ``prv`` its upper bound)."""
    from accountant.rules import Budget
    from accountant.rules.prices import fresh_price

    budget = Budget.create(rule=rule, epsilon=1, delta=repr(float(delta)), accountant=accountant)
    return lambda event: fresh_price(budget, event)[0]


def filter_admission(*, rule: str, epsilon: float, delta: float) -> Callable[[Sequence[DpEvent]], bool]:
    """Whether the Rényi filter of a fresh ``rule``/``rdp`` budget (ε, δ), on its placed grid,
    admits ``events`` all charged to one batch (their RDP charges added order by order,
    ``accountant.rules.prices.rdp_charge``): the ledger's admission test of a first spend."""
    from accountant.exact import exact_add
    from accountant.rules import Budget, renyi_filter
    from accountant.rules.prices import rdp_charge

    budget = Budget.create(rule=rule, epsilon=repr(epsilon), delta=repr(delta), accountant="rdp")
    assert budget.orders is not None
    orders = budget.orders
    flt = renyi_filter(budget)

    def admits(events: Sequence[DpEvent]) -> bool:
        total = tuple(Decimal(0) for _ in orders)
        for event in events:
            total = tuple(exact_add(a, b) for a, b in zip(total, rdp_charge(event, orders), strict=True))
        return flt.fits(total)

    return admits


def basic_price(event: DpEvent) -> Decimal:
    """ε of ``event`` by exact basic composition, rounded up, as the ledger's ``basic`` accountant
    prices it (``accountant.rules.prices.basic_price``)."""
    from accountant.rules.prices import basic_price as ledger_basic_price

    return ledger_basic_price(event)[0]


__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "TIGHT_ACCOUNTANT",
    "basic_price",
    "calibrate_noise_multiplier",
    "calibrate_to_epsilon",
    "calibrate_to_price",
    "filter_admission",
    "largest_fitting_epsilon",
    "largest_fitting_target",
    "single_charge_price",
    "smallest_noise",
    "tight_epsilon",
]
