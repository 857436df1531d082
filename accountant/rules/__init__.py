"""The ledger's semantics: four composition rules as pure functions over per-batch state.

Theorems relied on (each rule module states its own in full):

* **parallel composition over disjoint batches** (McSherry 2009, Thm. 4): a record lives in one
  batch, so a dataset's guarantee is the maximum over its batches of each batch's spend
  (``dataset_epsilon``), never the sum;
* per batch, the budget's rule: ``sequential`` (basic composition / Rényi filter, Feldman &
  Zrnic 2021 Thm. 3.1 / PRV for a declared plan / the ``tight`` union of filters, the default),
  ``parallel`` (one read per batch; assumption S2 of DP continual learning with pre-trained
  models), ``lifelong`` (L2DP-ML Thm. 2: replays of committed noise are post-processing),
  ``geometric`` (continual / sliding-window release,
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

from collections.abc import Iterable
from dataclasses import replace
from decimal import Decimal
from types import ModuleType
from typing import Final, Protocol

from accountant import events as ev
from accountant.canonical import canonical_json
from accountant.events import DpEvent
from accountant.exact import ZERO
from accountant.rules import geometric, lifelong, parallel, sequential
from accountant.rules.bookkeeping import is_prefix
from accountant.rules.budget import (
    ACCOUNTANTS,
    MAX_GEOMETRIC_COPIES,
    MAX_GEOMETRIC_LEVEL,
    MAX_PLAN_EVENTS,
    PLAN_PRICING,
    RULES,
    SUPPORTED,
    Budget,
    GeometricSchedule,
    PlanSegment,
    renyi_filter,
)
from accountant.rules.errors import Amount, BudgetExceeded, ChargeRefused
from accountant.rules.memo import (
    PRICING_VERSION,
    PRICING_VERSIONS,
    PriceMemo,
    active_pricing,
    event_fingerprint,
    memoized,
    pricing,
    pricing_version,
)
from accountant.rules.state import (
    MAX_COMMITMENT_LENGTH,
    Admission,
    BatchState,
    Charge,
    Cost,
    NoiseCommitment,
    Settlement,
)

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

    def remaining(self, budget: Budget, state: BatchState) -> Amount: ...

    def within_budget(self, budget: Budget, state: BatchState) -> bool: ...

    def theorem(self, budget: Budget) -> str: ...

    def stated_theorem(self, budget: Budget) -> str: ...


# The rule modules by ``Budget.rule`` (each module is a ``_Rule``).
_RULES: Final[dict[str, ModuleType]] = {
    "sequential": sequential,
    "parallel": parallel,
    "lifelong": lifelong,
    "geometric": geometric,
}


def _rule(budget: Budget) -> _Rule:
    module: _Rule = _RULES[budget.rule]
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
    prefix of the reserved event (``bookkeeping.is_prefix``: the same mechanism with fewer steps of
    a ``self_composed``, a prefix of a ``composed``), and each commit's run must extend the
    previous one. Otherwise the ledger would price an event chosen after the reservation — fresh
    noise passed off as a replay, a PRV plan entry swapped for another mechanism, two unrelated
    "runs so far" charged as their maximum instead of their composition — so it is refused:
    ``ChargeRefused`` ``commit_not_prefix`` / ``commit_does_not_extend`` (409).
    """
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


def close_segment(budget: Budget, state: BatchState) -> BatchState:
    """The batch's state once the open plan segment of a sequential ``prv`` budget is closed, as
    declaring the next segment does (``sequential.close_segment``: a batch that ran any of it is
    charged its whole declared (εᵢ, δᵢ)). ``ChargeRefused`` ``plan_step_pending`` while an entry
    is reserved and not settled; ``InvalidArgumentError`` on any other budget."""
    return sequential.close_segment(budget, state)


def delta_of_what_ran(budget: Budget, state: BatchState) -> Decimal:
    """The least δ (spent + held) a batch in ``state`` must be charged for what it ran: on a
    sequential ``prv`` budget the whole δᵢ of every plan segment it ran any entry of
    (``sequential.plan_delta_ran``); 0 under the other rules, whose δ each charge prices itself."""
    if budget.rule != "sequential" or budget.accountant != "prv":
        return ZERO
    return sequential.plan_delta_ran(budget, state)


def remaining(budget: Budget, state: BatchState) -> Amount:
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


def stated_theorem(budget: Budget) -> str:
    """The theorem with the budget's own parameters (its (ε, δ), the filter's actual δ split,
    the plan segments' (εᵢ, δᵢ)): what certificates of version 3 cite and statements show."""
    return _rule(budget).stated_theorem(budget)


__all__ = [
    "ACCOUNTANTS",
    "MAX_COMMITMENT_LENGTH",
    "MAX_GEOMETRIC_COPIES",
    "MAX_GEOMETRIC_LEVEL",
    "MAX_PLAN_EVENTS",
    "PLAN_PRICING",
    "PRICING_VERSION",
    "PRICING_VERSIONS",
    "RULES",
    "SUPPORTED",
    "Admission",
    "Amount",
    "BatchState",
    "Budget",
    "BudgetExceeded",
    "Charge",
    "ChargeRefused",
    "Cost",
    "GeometricSchedule",
    "NoiseCommitment",
    "PlanSegment",
    "PriceMemo",
    "Settlement",
    "active_pricing",
    "cancel",
    "canonical_json",
    "close_segment",
    "commit",
    "dataset_epsilon",
    "delta_of_what_ran",
    "event_fingerprint",
    "memoized",
    "naive_epsilon",
    "neighbouring_relation",
    "pricing",
    "pricing_version",
    "remaining",
    "renyi_filter",
    "reserve",
    "stated_theorem",
    "theorem",
    "within_budget",
]
