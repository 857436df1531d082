"""Pricing of a spend, before its transaction (``service.ledger.pricing_limits``).

A reservation's charge and a progressive commit's event are bounded, metered and priced outside
any transaction; the spend transaction then decides with the same memo (``rules.pricing``), on
the states it reads under the lock, so under the lock the rules only add and compare.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from accountant import events as ev
from accountant import rules
from accountant.errors import AccountantError
from accountant.events import DpEvent, EventValidationError
from accountant.rules import BatchState, Budget, Charge, PriceMemo
from service.db.session import Database
from service.ledger import pricing_limits
from service.ledger.errors import NotFound
from service.ledger.spending.decisions import rule_error
from service.ledger.spending.requests import (
    NOT_PRICED,
    AbortParams,
    CommitParams,
    Priced,
    Request,
    ReserveParams,
    SegmentParams,
)
from service.ledger.spending.store import batch_states, dataset_budget, known_dataset, load_reservations


def _priced_event(op: Request) -> DpEvent | None:
    """The event ``op`` asks to price: a reservation's, a progressive commit's, the prefix a
    worker's abort says ran (else ``None``)."""
    if isinstance(op.params, ReserveParams):
        return op.params.charge.event
    if isinstance(op.params, CommitParams):
        return op.params.partial
    if isinstance(op.params, AbortParams) and op.params.ran is not None:
        return op.params.ran.event
    return None


def prices_inline(op: Request) -> bool:
    """Whether ``op`` is priced in its group's worker thread, just before the transaction: it
    prices nothing, or little under a budget this process knows. Otherwise a coroutine prices it
    in a pricing thread before it joins the group, so it never delays the group."""
    if isinstance(op.params, SegmentParams):
        return False  # a whole plan's PRV: priced in a pricing thread, never in the group's
    event = _priced_event(op)
    if event is None:
        return True
    known = known_dataset(op.dataset_id)
    return known is not None and pricing_limits.work(known[1], [event]) <= pricing_limits.INLINE_WORK


def prepare(db: Database, op: Request) -> Priced:
    """Bound, meter and price ``op``'s charge, outside any transaction (once per request).

    The work (event nodes × the budget's orders) is checked against ``op.policy.max_work``
    (``InvalidInput`` naming ``event``) and handed to ``op.policy.meter`` (which may refuse)
    before anything is computed. Then a dry run of the rule fills the memo (``Priced.memo``) with every
    state-independent price; the spend transaction decides with the same memo (``rules.pricing``),
    on the states it reads under the lock. The dry run decides nothing: a refusal it meets is
    left for the transaction, except a refusal of the event itself (invalid, unsupported, or a
    parallel read that costs nothing), which no state changes.
    """
    if isinstance(op.params, SegmentParams):
        _price_segment(db, op, op.params)
        return NOT_PRICED
    event = _priced_event(op)
    if event is None:
        return NOT_PRICED
    tenant_id, budget = dataset_budget(db, op.dataset_id)
    if tenant_id != op.tenant_id:
        raise NotFound("dataset", op.dataset_id)
    units = pricing_limits.check_work(budget, [event], op.policy.max_work)
    memo = PriceMemo(budget)
    reserved_event = None
    with op.policy.metered(units), rules.pricing(memo):
        if isinstance(op.params, ReserveParams):
            _dry_reserve(db, op, budget, op.params)
        elif isinstance(op.params, CommitParams | AbortParams):  # a progressive commit, a worker's prefix
            reserved_event = _dry_commit(db, op, budget, op.params.reservation_id, event)
    return Priced(memo, reserved_event)


def _price_segment(db: Database, op: Request, params: SegmentParams) -> None:
    """Bound and meter a plan segment's PRV (``pricing.check_work``, naming ``plan``), then
    compute it: ``prices.plan_epsilon`` remembers it, so the declaration under the lock is a
    lookup. Refusals that depend on the budget are decided in the transaction."""
    tenant_id, budget = dataset_budget(db, op.dataset_id)
    if tenant_id != op.tenant_id:
        raise NotFound("dataset", op.dataset_id)
    units = pricing_limits.check_work(budget, list(params.plan), op.policy.max_work, "plan")
    with op.policy.metered(units):
        try:
            budget.with_segment(params.plan, params.delta)
        except AccountantError:
            pass  # decided in the transaction, on the budget as it is then


def _dry_run(decide: Any, *args: Any, event_errors: bool) -> None:
    """Run ``decide`` for its prices only. With ``event_errors``, an error of the event itself
    (invalid, unsupported: no state changes that) is raised now, as the transaction would."""
    try:
        decide(*args)
    except (rules.BudgetExceeded, rules.ChargeRefused):
        pass  # depends on the state: decided under the lock, on the state then
    except AccountantError as exc:
        if event_errors:
            raise rule_error(exc, "") from exc


def _dry_reserve(db: Database, op: Request, budget: Budget, params: ReserveParams) -> None:
    states = [BatchState.empty()]
    if budget.plan is not None:
        # A declared plan prices the plan's prefix up to each batch's position: read them.
        _, distinct = batch_states(db, op.dataset_id, params.selector, params.ids)
        positions: dict[int, BatchState] = {}
        for state in distinct.values():
            positions.setdefault(state.plan_position, replace(state, plan_open=False))
        states = list(positions.values()) or states
    for state in states:  # no state error is possible on these states: any error is the event's
        _dry_run(rules.reserve, budget, state, params.charge, event_errors=True)


def _dry_commit(
    db: Database, op: Request, budget: Budget, reservation_id: str, partial: DpEvent
) -> tuple[dict[str, Any], DpEvent] | None:
    """Price a progressive commit (or a worker's prefix) on the states its reserve left in each
    class: the reservation's event as parsed (``Priced.reserved_event``), or ``None``."""
    with db.session(readonly=True) as session:
        r = load_reservations(session.connection(), [reservation_id]).get(reservation_id)
    if r is None or r.tenant_id != op.tenant_id or r.status != "reserved":
        return None  # refused in the transaction
    try:
        reserved = ev.from_json(r.event)
    except EventValidationError:
        return None
    charge = Charge(reserved, r.noise_commitment)
    for c in r.classes:
        # On the state the reserve left (the class's state at reserve, reserved again): what a
        # commit's price depends on is fixed by then — the `tight` rule's focus order, chosen by
        # the batch's first charge, is the grid its reserved RDP was priced on.
        try:
            state = rules.reserve(budget, BatchState.from_json(c.state_at_reserve), charge).state
        except AccountantError:
            continue  # priced in the transaction, on the state then
        _dry_run(rules.commit, budget, state, charge, c.reserved, c.committed, partial, event_errors=False)
    return (r.event, reserved)
