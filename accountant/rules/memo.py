"""Prices computed once per request (``PriceMemo``), event fingerprints, and the pricing version
certificates are replayed under (``PRICING_VERSION``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final, TypeVar

from accountant import events as ev
from accountant.canonical import sha256_hex
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent

if TYPE_CHECKING:
    from accountant.rules.budget import Budget

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

PRICING_VERSION: Final = 5
"""How single charges and the naive figure are priced (certificates record it as ``pricing``).

1 — before issue 13 §3: a single charge (``parallel``, a ``geometric`` level) on the budget's
    order grid with δ charged only when ε > 0; the naive figure each charge's single-charge ε.
2 — a single charge is the minimum of the RDP bound on the accountant's full grid, the coupling
    bound and the exact basic bound; the naive figure uses the rule's own conversion and is
    floored at the batch's spend (``prices.fresh_price``, ``naive_price``).
3 — issue 24 §4: where a run may be stopped early because of what it released, the spend is the
    whole run's, never the prefix's (a prefix's ε is no guarantee under adaptive stopping; the
    whole run's output bounds any stopping by post-processing, Dwork & Roth 2014, Prop. 2.1): a
    declared plan segment (``sequential`` / ``prv``) is charged its whole (εᵢ, δᵢ) from its first
    entry that costs anything, and a ``parallel`` progressive commit on an ``rdp`` or ``prv``
    budget the whole reserved run (a ``basic`` prefix is a sum of per-step charges, a valid
    odometer, and stays as it was).
4 — issue 25 §2: a charge that needs no filter (a ``parallel`` charge, a ``geometric`` level's
    ε′, a run priced alone) costs the tightest valid ε of the event alone, whatever the budget's
    accountant (``prices.tight_epsilon``: the analytic Gaussian for a Gaussian-only event, exact;
    dp-accounting's pessimistic PLD or PRV with a relative mesh error otherwise; never above the
    RDP bound), with the coupling and exact basic bounds where smaller. Declared plans keep the
    PRV price they were stored with (a budget's ``plan_epsilon`` is part of the budget).
5 — issue 25 §4: the same, but an event of more than ``prv.PLD_MAX_DISTINCT`` distinct
    mechanisms (a heterogeneous charge) is priced by their pessimistic PLDs composed in one pass
    (``accountant.pld``; ``prv.tight_epsilon`` engine 2) instead of PRV with a 1% relative mesh
    error: tighter and several times faster. Version 4 replays with engine 1.

All are valid upper bounds for non-adaptive runs, and 3 also under adaptive stopping; a
certificate re-verifies under the version that issued it, so an upgrade never turns a stored
certificate invalid. New charges use ``PRICING_VERSION``."""

PRICING_VERSIONS: Final = (1, 2, 3, 4, 5)
_PRICING: Final[ContextVar[int]] = ContextVar("accountant_pricing_version", default=PRICING_VERSION)


@contextmanager
def pricing_version(version: int) -> Iterator[int]:
    """Within the block, charges are priced as ``version`` prices them (certificate replays)."""
    if version not in PRICING_VERSIONS:
        raise InvalidArgumentError("pricing", f"must be one of {PRICING_VERSIONS}. Found {version!r}.")
    token = _PRICING.set(version)
    try:
        yield version
    finally:
        _PRICING.reset(token)


def active_pricing() -> int:
    """The pricing version in force (``PRICING_VERSION`` unless a replay set another)."""
    return _PRICING.get()
