"""How much pricing one request may ask for (its work, bounded and metered), and why a charge is
priced before its spend transaction.

Why. Under the dataset's lock (``SELECT … FOR UPDATE``; on SQLite ``BEGIN IMMEDIATE``, which is
the whole database's write lock) nothing else can be written. Pricing an event can take seconds:
its RDP curve costs about 70 µs per event node and order (a composed event of 200 subsampled
Gaussians on an ``rdp`` budget of 1 000 orders: 15 s, during which every tenant's writes waited
on SQLite). So the ledger prices *before* the transaction opens, and decides inside it:

* a dataset's budget never changes once the dataset exists, so every state-independent number of
  a charge (its fingerprint, basic (ε, δ), per-order RDP curve, the ε of a fresh charge, a plan
  prefix's PRV ε, a geometric level's price) follows from the event and the budget alone;
* ``spending.pre_pricing.prepare`` computes them in a dry run of ``accountant.rules.reserve`` /
  ``commit`` with an ``accountant.rules.PriceMemo`` active, outside any transaction; the spend
  transaction runs the same functions with the same memo, so what it does under the lock is
  additions and comparisons on the batches' states (the Rényi filter's per-order sums, a
  geometric block's free levels);
* the ``rdp_charge`` / ``prv_epsilon`` caches keep curves across requests (keyed by the event and
  the budget's orders / δ), so a trainer that repeats an event prices it once per process.

How much. A request's pricing *work* is its events' nodes (``accountant.events.walk``: a
``composed`` of n events is n + 1 nodes, a ``self_composed`` is one node whatever its count) times
the budget's *orders*: the Rényi filter's grid size for ``rdp``, 1 for ``basic`` (exact decimal
sums), and ``PRV_WORK_PER_NODE`` for ``prv`` (a PRV composition of one event costs about as much
as its RDP curve at 100 orders). A request above ``Policy.max_work`` (``LEDGER_MAX_PRICING_WORK``)
is refused with a 422 naming ``event`` and the bound, before anything is priced or locked. The
default, 20 000, prices in at most about 1.5 s: 1 000 nodes on the default grid of 20 orders (a
``composed`` of 300 DP-SGD runs), 20 nodes at 1 000 orders, 10 000 nodes on ``basic``.

Who pays. ``Policy.meter`` admits a request's work before it is priced and is told the CPU
seconds the pricing took after it (``Meter``); the HTTP API passes a per-tenant budget of pricing
CPU time there (``service.api.ratelimit``), which answers 429 with ``Retry-After``. Async callers
price in a worker thread of ``Policy.limiter`` (a few threads, so that pricing never takes the
threads the spend transactions and the other routes run in), never on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, Protocol

import anyio

from accountant import events as ev
from accountant.events import DpEvent
from accountant.rules import Budget
from service.ledger.errors import InvalidInput

DEFAULT_MAX_WORK: Final = 20_000
# A PRV composition costs about 10 ms per (sampled) event, about as much as 100 RDP orders.
PRV_WORK_PER_NODE: Final = 100
# Below this much work a charge is priced in the spend group's own worker thread, just before its
# transaction (≤ about 15 ms); above it in a thread of the pricing limiter, before it joins the
# group, so one request's pricing never delays the others queued on the dataset.
INLINE_WORK: Final = 200


class Meter(Protocol):
    """Who pays for one request's pricing (``service.api.ratelimit.TenantMeter``)."""

    def admit(self, work: int) -> None:
        """Before pricing ``work`` units: raise to refuse the request (nothing priced yet)."""

    def spent(self, work: int, cpu_s: float) -> None:
        """After pricing: what it took (CPU seconds of the pricing thread)."""


@dataclass(frozen=True)
class Policy:
    """How a request's pricing is bounded and paid for (the HTTP API builds one per request).

    ``max_work``: the most work one request may ask for (422 above). ``meter``: admits the
    request's work before it is priced (it may raise to refuse) and is told the CPU time after.
    ``limiter``: the threads async callers price in (``None``: anyio's default threads).
    """

    max_work: int = DEFAULT_MAX_WORK
    meter: Meter | None = None
    limiter: anyio.CapacityLimiter | None = None

    @contextmanager
    def metered(self, work: int) -> Iterator[None]:
        """Admit ``work`` (the meter may refuse), run the block, tell the meter its CPU time."""
        if self.meter is None:
            yield
            return
        self.meter.admit(work)
        started = time.thread_time()
        try:
            yield
        finally:
            self.meter.spent(work, time.thread_time() - started)


DEFAULT_POLICY: Final = Policy()


def orders_of(budget: Budget) -> int:
    """The budget's cost per event node: its order grid (``rdp``), 1 (``basic``), or
    ``PRV_WORK_PER_NODE`` (``prv``)."""
    if budget.accountant == "tight" and budget.uses_union:
        # the Rényi filter's grid, and one PRV price of the run (filter A)
        return len(budget.orders or ()) + PRV_WORK_PER_NODE
    if budget.accountant in ("rdp", "tight") and budget.orders is not None:
        if budget.rule in ("parallel", "geometric"):
            # A single charge is priced on the accountant's full grid, not the filter's.
            from accountant.rules.prices import single_charge_orders

            return len(single_charge_orders(budget))
        return len(budget.orders or ())
    if budget.accountant == "prv":
        return PRV_WORK_PER_NODE
    return 1


def nodes(events: Iterable[DpEvent]) -> int:
    """Event nodes of ``events`` (``self_composed`` is not expanded: its count costs nothing)."""
    return sum(len(ev.walk(event)) for event in events)


def work(budget: Budget, events: Iterable[DpEvent]) -> int:
    """Pricing work of ``events`` under ``budget``: nodes × orders."""
    return nodes(events) * orders_of(budget)


def check_work(budget: Budget, events: Iterable[DpEvent], limit: int, field: str = "event") -> int:
    """The work of pricing ``events``; ``InvalidInput`` naming ``field`` when it is above ``limit``."""
    count = nodes(events)
    orders = orders_of(budget)
    units = count * orders
    if units > limit:
        unit = {"rdp": "orders of the budget's Rényi filter", "prv": "per PRV event", "basic": "per node"}
        raise InvalidInput(
            field,
            f"costs too much to price: {count} event nodes x {orders} "
            f"({unit.get(budget.accountant, 'per node')}) = {units} units of pricing work, above "
            f"this server's limit of {limit} per request (LEDGER_MAX_PRICING_WORK). Reserve the "
            "run in smaller charges, or use a budget with fewer orders.",
        )
    return units


__all__ = [
    "DEFAULT_MAX_WORK",
    "DEFAULT_POLICY",
    "INLINE_WORK",
    "PRV_WORK_PER_NODE",
    "Meter",
    "Policy",
    "check_work",
    "nodes",
    "orders_of",
    "work",
]
