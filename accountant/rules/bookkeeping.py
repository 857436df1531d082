"""Additive bookkeeping shared by the rules: exact per-order vectors, moving a commit from held
to spent (``settle_additive``) and back on cancel (``release_additive``), and the progressive-commit
algebra (``is_prefix``: a commit reports the reserved run cut short; ``progressive_cost``:
bounded by the reservation, never below what was committed before).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from decimal import Decimal

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.exact import (
    ZERO,
    exact_add,
    exact_sub,
)
from accountant.rules.prices import is_free
from accountant.rules.state import BatchState, Cost

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
        naive_epsilon=exact_add(state.naive_epsilon, naive_step(now, before)),
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


def naive_step(now: Cost, before: Cost | None) -> Decimal:
    return exact_sub(now.naive_epsilon, ZERO if before is None else before.naive_epsilon)
