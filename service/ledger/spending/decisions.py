"""The decisions of the spend transactions, each made on a ``Work`` (``spending.store``) whose
dataset's ledger head is locked.

Each operation *decides* first (reading only; it may raise a ``LedgerError``) and then *applies*
(writing into the ``Work`` only, never raising), so a refused operation leaves no trace:

* ``reserve`` prices the charge on every batch it reads (``accountant.rules.reserve``) and holds
  it — on all batches or on none.
* ``commit`` turns the hold into spend (``accountant.rules.commit``), records the release and
  stores the certificate (``accountant.certificates.issue``); with a partial event it is a
  progressive commit and the reservation stays open.
* ``abort`` returns what was held and not committed (``accountant.rules.cancel``).
* ``expire`` does the same for reservations past their ``expires_at``.

``decide`` is the one seam the group-commit engine (``spending.engine``) calls for each operation.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any

from accountant import events as ev
from accountant import rules
from accountant.certificates import BatchRecord
from accountant.errors import AccountantError, InvalidArgumentError
from accountant.exact import ZERO, exact_sub
from accountant.rules import BatchState, Charge
from service.ledger import certificates
from service.ledger.errors import (
    BudgetExceeded,
    ChargeRefused,
    Conflict,
    InvalidInput,
    LedgerError,
    NotFound,
    ReleaseExists,
    ReservationExpired,
)
from service.ledger.spending.requests import (
    MAX_BATCHES_PER_RESERVATION,
    AbortParams,
    CommitParams,
    Op,
    ReserveParams,
)
from service.ledger.spending.store import Held, Loaded, Work, cost_json, reservation_json


def decide(work: Work, op: Op) -> tuple[dict[str, Any], LedgerError | None]:
    """Decide ``op`` on ``work`` and apply it: its answer, or the error it answers while its
    changes stay (a late commit: its reservation expires). A refusal raises a ``LedgerError``
    and changes nothing."""
    params = op.params
    if isinstance(params, ReserveParams):
        return reserve(work, op, params), None
    if isinstance(params, CommitParams):
        return commit(work, op, params)
    if isinstance(params, AbortParams):
        return abort(work, op, params), None
    return {"expired": work.expired_on_open + expire(work, params.reservation_ids, op.at)}, None


def _close(work: Work, r: Loaded, status: str, at: datetime) -> Loaded:
    """Abort or expire ``r``: return every batch's uncommitted hold (``rules.cancel``)."""
    states: list[tuple[str, BatchState]] = []
    for h in r.batches:
        try:
            states.append(
                (h.batch_id, rules.cancel(work.budget, work.states[h.batch_id], h.reserved, h.committed))
            )
        except AccountantError as exc:
            raise rule_error(exc, h.batch_id) from exc
    for batch_id, state in states:
        work.set_state(batch_id, state)
    work.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
    work.head.reservations_open -= 1
    closed = replace(r, status=status, closed_at=at)
    work.put_reservation(closed)
    work.audit(
        f"reservation.{status}",
        {
            "reservation_id": r.id,
            "returned": cost_json(
                exact_sub(r.epsilon, r.committed_epsilon), exact_sub(r.delta, r.committed_delta)
            ),
            "committed": cost_json(r.committed_epsilon, r.committed_delta),
        },
        at,
    )
    return closed


def reserve(work: Work, op: Op, params: ReserveParams) -> dict[str, Any]:
    task_batches = work.task_batches
    if params.selector == "batches":
        batch_ids = params.ids
        for batch_id in batch_ids:
            if batch_id not in work.states:
                raise NotFound("batch", batch_id)
    else:
        batch_ids = []
        for task_id in params.ids:
            if task_id not in task_batches:
                raise NotFound("task", task_id)
            batch_ids.extend(task_batches[task_id])
        if not batch_ids:
            raise InvalidInput("tasks", "the tasks have no batches.")
        if len(batch_ids) > MAX_BATCHES_PER_RESERVATION:
            raise InvalidInput("tasks", f"cover more than {MAX_BATCHES_PER_RESERVATION} batches.")
    admissions: list[tuple[str, rules.Admission]] = []
    for batch_id in batch_ids:  # decide on every batch before holding on any
        try:
            admissions.append((batch_id, rules.reserve(work.budget, work.states[batch_id], params.charge)))
        except AccountantError as exc:
            raise rule_error(exc, batch_id) from exc
    epsilon = max(a.cost.epsilon for _, a in admissions)
    delta = max(a.cost.delta for _, a in admissions)
    r = Loaded(
        id=f"res_{secrets.token_hex(12)}",
        tenant_id=op.tenant_id,
        dataset_id=work.head.id,
        status="reserved",
        event=params.event_document,
        noise_commitment=params.charge.noise_commitment,
        epsilon=epsilon,
        delta=delta,
        committed_epsilon=ZERO,
        committed_delta=ZERO,
        commits=0,
        expires_at=op.at + params.ttl,
        created_at=op.at,
        closed_at=None,
        batches=tuple(
            Held(b, work.batch_task[b], i, work.states[b].to_json(), a.cost, None)
            for i, (b, a) in enumerate(admissions)
        ),
    )
    for batch_id, admission in admissions:
        work.set_state(batch_id, admission.state)
    work.put_reservation(r, new=True)
    work.hold(epsilon)
    work.head.reservations_open += 1
    response = reservation_json(r)
    work.audit(
        "reservation.reserved",
        {
            "reservation_id": r.id,
            "event": r.event,
            "noise_commitment": r.noise_commitment,
            "cost": response["cost"],
            "batches": response["batches"],
            "expires_at": response["expires_at"],
        },
        op.at,
    )
    return response


def commit(work: Work, op: Op, params: CommitParams) -> tuple[dict[str, Any], LedgerError | None]:
    r = work.reservations.get(params.reservation_id)
    if r is None or r.tenant_id != op.tenant_id:
        raise NotFound("reservation", params.reservation_id)
    if r.status == "reserved" and r.expires_at <= op.at:
        # Late: the hold is returned and stays returned although this commit is refused.
        _close(work, r, "expired", op.at)
        return {}, ReservationExpired(r.id)
    if r.status == "expired":
        raise ReservationExpired(r.id)
    if r.status != "reserved":
        raise Conflict(
            f"reservation {r.id!r} is {r.status}; it cannot be committed.",
            reason="reservation_closed",
            status=r.status,
        )
    release_key = (op.tenant_id, params.model, params.version)
    if release_key in work.released:
        raise ReleaseExists(params.model, params.version)
    if op.reserved_event is not None and op.reserved_event[0] == r.event:
        event = op.reserved_event[1]  # parsed (and priced with) before the transaction
    else:
        event = ev.from_json(r.event)
    charge = Charge(event, r.noise_commitment)
    # The run the previous progressive commit reported: this one must extend it.
    previous = None if r.committed_event is None else ev.from_json(r.committed_event)
    settled: list[tuple[Held, BatchState, rules.Settlement]] = []
    for h in r.batches:
        before = work.states[h.batch_id]
        try:
            settlement = rules.commit(
                work.budget, before, charge, h.reserved, h.committed, params.partial, previous
            )
        except AccountantError as exc:
            raise rule_error(exc, h.batch_id) from exc
        settled.append((h, before, settlement))
    closes = params.partial is None
    committed_epsilon = max(s.committed.epsilon for _, _, s in settled)
    committed_delta = max(s.committed.delta for _, _, s in settled)
    release_id = f"rel_{secrets.token_hex(12)}"
    certificate_id = f"cert_{secrets.token_hex(12)}"
    body = certificates.issue(
        budget=work.budget,
        charge=charge,
        batches=[
            BatchRecord(
                batch_id=h.batch_id,
                state_at_reserve=BatchState.from_json(h.state_at_reserve),
                reserved=h.reserved,
                state_before=before,
                committed_before=h.committed,
                state_after=s.state,
                committed=s.committed,
            )
            for h, before, s in settled
        ],
        reservation_id=r.id,
        release=params.release,
        partial_event=params.partial,
        previous_event=previous,
        release_id=release_id,
        dataset_id=work.head.id,
        issued_at=op.at,
        signer=params.signer,
    )
    # Decided: apply.
    for h, _, s in settled:
        work.set_state(h.batch_id, s.state)
    if closes:  # the rest of the hold returns with the final commit
        work.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
        work.head.reservations_open -= 1
    else:
        work.release_hold(exact_sub(committed_epsilon, r.committed_epsilon))
    work.head.charges_committed += 1
    work.head.last_release, work.head.last_release_at = params.release, op.at
    r = replace(
        r,
        status="committed" if closes else "reserved",
        closed_at=op.at if closes else None,
        committed_epsilon=committed_epsilon,
        committed_delta=committed_delta,
        commits=r.commits + 1,
        committed_event=None if params.partial is None else ev.to_json(params.partial),
        batches=tuple(replace(h, committed=s.committed) for h, _, s in settled),
    )
    work.put_reservation(r)
    work.released.add(release_key)
    work.releases.append(
        {
            "id": release_id,
            "tenant_id": op.tenant_id,
            "dataset_id": work.head.id,
            "reservation_id": r.id,
            "model": params.model,
            "version": params.version,
            "created_at": op.at,
        }
    )
    certificate = certificates.stored_row(
        certificate_id=certificate_id,
        tenant_id=op.tenant_id,
        dataset_id=work.head.id,
        reservation_id=r.id,
        release_id=release_id,
        body=body,
        at=op.at,
    )
    work.certificates.append(certificate)
    reservation = reservation_json(r)
    work.audit(
        "reservation.committed",
        {
            "reservation_id": r.id,
            "release": params.release,
            "certificate_id": certificate_id,
            "content_hash": certificate["content_hash"],
            "committed": reservation["committed"],
            "final": closes,
        },
        op.at,
    )
    return {
        "certificate": certificates.row_json(certificate, params.release),
        "reservation": reservation,
    }, None


def abort(work: Work, op: Op, params: AbortParams) -> dict[str, Any]:
    r = work.reservations.get(params.reservation_id)
    if r is None or r.tenant_id != op.tenant_id:
        raise NotFound("reservation", params.reservation_id)
    if r.status == "committed":
        raise Conflict(
            f"reservation {r.id!r} is committed; spend is never returned.",
            reason="reservation_closed",
            status=r.status,
        )
    if r.status == "reserved":
        r = _close(work, r, "aborted", op.at)
    return reservation_json(r)


def expire(work: Work, reservation_ids: Iterable[str], at: datetime) -> int:
    """Expire those of the reservations that are open and due at ``at``."""
    expired = 0
    for reservation_id in reservation_ids:
        r = work.reservations.get(reservation_id)
        if r is not None and r.status == "reserved" and r.expires_at <= at:
            _close(work, r, "expired", at)
            expired += 1
    return expired


def rule_error(exc: AccountantError, batch_id: str) -> LedgerError:
    """The domain error for an accountant error raised while pricing on ``batch_id``."""
    if isinstance(exc, rules.BudgetExceeded):
        return BudgetExceeded(exc.remaining, exc.requested, exc.message, batch_id=batch_id)
    if isinstance(exc, rules.ChargeRefused):
        return ChargeRefused(exc.code, exc.message, batch_id=batch_id)
    if isinstance(exc, InvalidArgumentError):
        return InvalidInput(exc.field, exc.message)
    return InvalidInput("event", str(exc))  # UnsupportedEventError: the accountant cannot
