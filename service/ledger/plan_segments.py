"""Plan segments: a sequential ``prv`` budget takes a new declared plan once its plan is used up.

A ``prv`` budget prices a *declared* plan tightly, which is valid only because the plan is fixed
before anything runs; once the plan is used up, what the budget has left could not be spent. A
**plan segment** is a further declared plan: ``declare_segment`` prices it with PRV at a share
``delta`` of the budget's δ (its (εᵢ, δᵢ) fixed now, before any of it runs), appends it to the
budget, and makes it the open segment; reservations then run its entries in order, exactly as
the first plan's. Segments compose by basic composition under fully adaptive choice (the
basic-composition privacy filter of Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6): each may be
chosen after seeing what the earlier ones released, while Σεᵢ ≤ ε and Σδᵢ ≤ δ.

Declaring closes the open segment on every batch (``accountant.rules.close_segment``): a batch
that ran any of it is charged its whole (εᵢ, δᵢ); it can never run its remaining entries. A
declaration is refused while any reservation of the dataset is open (``plan_step_pending``), and
it is a spend transaction like a reservation (the ledger head locked, idempotent with
``Idempotency-Key``, audited as ``plan.segment_declared``, metered like a reservation).

Answer: ``{dataset_id, index, plan, delta, epsilon, declared: {epsilon, delta}, left: {epsilon,
delta}, closed_batches, theorem}`` — ``declared`` sums every segment's (εᵢ, δᵢ), ``left`` is what
a further segment may still take.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.rules.budget import MAX_PLAN_EVENTS, budget_number
from service.db.base import utcnow
from service.db.session import Database
from service.ledger import pricing_limits
from service.ledger.datasets import can_be_id
from service.ledger.errors import InvalidInput, NotFound
from service.ledger.spending import ENGINE
from service.ledger.spending.answers import SegmentDeclared, of_kind
from service.ledger.spending.requests import Request, SegmentParams, keyed, new_event


def check_plan_size(plan: object) -> None:
    """``InvalidInput`` naming ``plan`` unless it is a list of 1 to ``MAX_PLAN_EVENTS`` events. The
    message quotes the plan's JSON: the HTTP route checks the body as sent (before the parsed
    events reach ``declare_segment``), the ledger its events' documents."""
    if not isinstance(plan, list | tuple) or not 1 <= len(plan) <= MAX_PLAN_EVENTS:
        found = (
            [ev.to_json(e) if isinstance(e, DpEvent) else e for e in plan]
            if isinstance(plan, list | tuple)
            else plan
        )
        raise InvalidInput("plan", f"must be a list of 1 to {MAX_PLAN_EVENTS} events. Found {found!r:.200}.")


def _segment_op(
    tenant_id: str,
    dataset_id: str,
    *,
    plan: Sequence[DpEvent],
    delta: object,
    idempotency_key: str | None,
    now: datetime | None,
    policy: pricing_limits.Policy | None,
) -> Request:
    check_plan_size(plan)
    events = tuple(new_event(e, f"plan[{i}]") for i, e in enumerate(plan))
    if isinstance(delta, bool) or not isinstance(delta, int | float | str):
        raise InvalidInput("delta", f"must be a number. Found {delta!r}.")
    try:
        share = budget_number("delta", delta)
    except InvalidArgumentError as exc:
        raise InvalidInput(exc.field, exc.message) from None
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)
    document = [ev.to_json(e) for e in events]
    params = SegmentParams(events, document, share)
    op = Request(
        "declare_segment",
        tenant_id,
        dataset_id,
        now or utcnow(),
        params,
        policy=policy or pricing_limits.DEFAULT_POLICY,
    )
    return keyed(op, idempotency_key, {"dataset_id": dataset_id, "plan": document, "delta": str(share)})


def declare_segment(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    plan: Sequence[DpEvent],
    delta: object,
    idempotency_key: str | None = None,
    now: datetime | None = None,
    policy: pricing_limits.Policy | None = None,
) -> SegmentDeclared:
    """Declare the next plan segment (module docstring). ``plan``: its events, parsed
    (``reservations.parse_event``; the HTTP schema hands over what it parsed) or built
    in-process, each checked as a new charge (``requests.new_event``). Raises ``InvalidInput``
    naming ``plan``, ``plan[i]...`` or ``delta`` (also: not a sequential ``prv`` budget, a
    segment that does not fit what the budget has left), ``NotFound`` (also another tenant's
    dataset), ``ChargeRefused`` ``plan_step_pending`` (a reservation is open),
    ``IdempotencyConflict``."""
    op = _segment_op(
        tenant_id,
        dataset_id,
        plan=plan,
        delta=delta,
        idempotency_key=idempotency_key,
        now=now,
        policy=policy,
    )
    return of_kind(SegmentDeclared, ENGINE.submit(db, op))


async def declare_segment_async(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    plan: Sequence[DpEvent],
    delta: object,
    idempotency_key: str | None = None,
    policy: pricing_limits.Policy | None = None,
) -> SegmentDeclared:
    """``declare_segment`` for a coroutine (the plan is priced in a thread of ``policy.limiter``)."""
    op = _segment_op(
        tenant_id,
        dataset_id,
        plan=plan,
        delta=delta,
        idempotency_key=idempotency_key,
        now=None,
        policy=policy,
    )
    return of_kind(SegmentDeclared, await ENGINE.submit_async(db, op))


__all__ = ["MAX_PLAN_EVENTS", "check_plan_size", "declare_segment", "declare_segment_async"]
