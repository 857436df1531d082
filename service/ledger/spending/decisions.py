"""The decisions of the spend transactions, each made on a ``Work`` (``spending.store``) whose
dataset's ledger head is locked.

Each operation *decides* first (reading only; it may raise a ``LedgerError``) and then *applies*
(writing into the ``Work`` only, never raising), so a refused operation leaves no trace:

* ``reserve`` prices the charge on every batch it reads (``accountant.rules.reserve``) and holds
  it — on all batches or on none.
* ``commit`` turns the hold into spend (``accountant.rules.commit``), records the release and
  stores the certificate (``accountant.certificates.issue``); with a partial event it is a
  progressive commit and the reservation stays open.
* ``abort`` settles the reservation as a final charge of the whole reserved event
  (``accountant.rules.commit``) with a certificate and no release: the data could have been read.
  Only the built-in worker, in-process, may say what ran (``Ran``): the prefix that ran is
  charged, and what provably never ran is returned (``accountant.rules.cancel``).
* ``extend`` holds an open reservation longer (``expires_at``), never past its maximum lifetime
  from creation; a due one expires instead (charged, as any expiry) and the extension is refused.
* ``expire`` charges reservations past their ``expires_at`` as an abort without ``Ran`` does.
* ``declare_segment`` grows a sequential ``prv`` budget by one declared plan segment
  (``Budget.with_segment``) and closes the open segment on every batch (``rules.close_segment``);
  refused while any reservation is open.

``decide`` is the one seam the group-commit engine (``spending.engine``) calls for each operation.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from accountant import events as ev
from accountant import rules
from accountant.certificates import BatchSet, ClassRecord
from accountant.errors import AccountantError, InvalidArgumentError
from accountant.exact import ZERO, exact_sub, exact_sum
from accountant.rules import BatchState, Charge
from service.ledger import certificates
from service.ledger.datasets import refuse_archived
from service.ledger.errors import (
    BudgetExceeded,
    ChargeRefused,
    Conflict,
    InvalidInput,
    LedgerError,
    LifetimeExceeded,
    NotFound,
    ReleaseExists,
    ReservationExpired,
)
from service.ledger.spending.answers import (
    Answer,
    Commit,
    EpsilonDelta,
    Expired,
    Reservation,
    SegmentDeclared,
    cost_json,
)
from service.ledger.spending.requests import (
    MAX_BATCHES_PER_RESERVATION,
    NOT_PRICED,
    AbortParams,
    CommitParams,
    ExtendParams,
    Priced,
    Ran,
    Request,
    ReserveParams,
    SegmentParams,
)
from service.ledger.spending.store import (
    HeldClass,
    Loaded,
    Move,
    Work,
    members_of,
    whole_dataset,
)
from service.verification.signing import SigningKey


def decide(work: Work, op: Request, priced: Priced) -> tuple[Answer | None, LedgerError | None]:
    """Decide ``op`` on ``work`` and apply it: its answer, or the error it answers while its
    changes stay (a late commit: its reservation expires). A refusal raises a ``LedgerError``
    and changes nothing."""
    params = op.params
    if isinstance(params, ReserveParams):
        return reserve(work, op, params), None
    if isinstance(params, CommitParams):
        return commit(work, op, params, priced)
    if isinstance(params, AbortParams):
        return abort(work, op, params), None
    if isinstance(params, SegmentParams):
        return declare_segment(work, op, params), None
    if isinstance(params, ExtendParams):
        return extend(work, op, params)
    return Expired(work.expired_on_open + expire(work, params.reservation_ids, op.at)), None


def _close(work: Work, r: Loaded, status: str, at: datetime, ran: Ran | None = None) -> Loaded:
    """Abort or expire ``r`` (``status``): settle what could have run, refund only what provably
    never ran (docs/ARCHITECTURE.md, "Threat model").

    ``ran is None`` (every abort over HTTP or by an API key, every expiry): the data could have
    been read from the moment the hold was granted, so the whole reserved event is charged as a
    final commit with no release (``_charge``). ``ran``: the built-in worker's word, in-process
    only — the prefix ``ran.event`` is charged and the rest returned; nothing read (``None``), or
    nothing beyond what its progressive commits charged, returns the rest with no new charge."""
    if ran is None:
        return _charge(work, r, status, at, None)
    if ran.event is not None:
        document = ev.to_json(ran.event)
        if r.committed_event is None or document != r.committed_event:
            return _charge(work, r, status, at, (ran.event, document))
    return _refund(work, r, status, at)


def _refund(work: Work, r: Loaded, status: str, at: datetime) -> Loaded:
    """Close ``r`` returning every class's uncommitted hold (``rules.cancel``), decided once per
    (reservation class, current state): only for what provably never ran."""
    plans: list[tuple[int, list[Move]]] = []
    for index, groups in work.groups(r.id, r.batches).items():
        c = r.classes[index]
        moves = []
        for g in groups:
            try:
                after = rules.cancel(work.budget, work.state(g.state_id), c.reserved, c.committed)
            except AccountantError as exc:
                raise rule_error(
                    exc, work.example_batch(g.state_id, g.scope or members_of(r.id, index))
                ) from exc
            moves.append(g.move(after))
        plans.append((index, moves))
    for index, moves in plans:
        work.move(members_of(r.id, index), moves, at)
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


def _charge(
    work: Work, r: Loaded, status: str, at: datetime, ran: tuple[ev.DpEvent, dict[str, Any]] | None
) -> Loaded:
    """Close ``r`` with a charge and no release: ``ran`` (a prefix of the reserved event, the
    worker's word) or, for ``None``, the whole reserved event, settled by ``rules.commit`` exactly
    as a commit would (a parallel read, a lifelong noise draw, the Rényi filter and a plan's
    segment are consumed), the rest of a prefix's hold returned (``rules.cancel``). A certificate
    with ``release: null`` and ``outcome: status`` records it, and the audit entry names it."""
    charge = Charge(ev.from_json(r.event), r.noise_commitment)
    previous = None if r.committed_event is None else ev.from_json(r.committed_event)
    partial, document = ran if ran is not None else (None, None)
    settled = _settle(work, r, charge, partial, document, previous, refund_rest=ran is not None)
    assert work.signer is not None, "the engine gives every Work its signer"
    certificate = _certify(work, settled, at, work.signer(), release=None, release_id=None, outcome=status)
    # Decided: apply.
    closed = _apply(work, settled, at, closes=True, status=status)
    work.certificates.append(certificate)
    work.audit(
        f"reservation.{status}",
        {
            "reservation_id": r.id,
            "release": None,
            "certificate_id": certificate["id"],
            "content_hash": certificate["content_hash"],
            "committed": cost_json(settled.committed_epsilon, settled.committed_delta),
            "returned": cost_json(
                exact_sub(r.epsilon, settled.committed_epsilon), exact_sub(r.delta, settled.committed_delta)
            ),
            "final": True,
        },
        at,
    )
    return closed


@dataclass(frozen=True)
class Settled:
    """A charge settled on every class of a reservation: decided, not applied. ``records``: the
    certificate's class records; ``moves``: per reservation class, its batches' moves."""

    reservation: Loaded
    charge: Charge
    partial: ev.DpEvent | None  # the run so far; ``None``: all of it
    partial_document: dict[str, Any] | None  # ``ev.to_json(partial)``, made once by the caller
    previous: ev.DpEvent | None  # the run the previous progressive commit reported
    records: list[ClassRecord]
    moves: dict[int, list[Move]]

    @property
    def committed_epsilon(self) -> Decimal:
        return max(x.committed.epsilon for x in self.records)

    @property
    def committed_delta(self) -> Decimal:
        return max(x.committed.delta for x in self.records)


def _certify(
    work: Work,
    settled: Settled,
    at: datetime,
    signer: SigningKey,
    *,
    release: dict[str, Any] | None,
    release_id: str | None,
    outcome: str = "released",
) -> dict[str, Any]:
    """The signed certificate of ``settled`` (``accountant.certificates.issue``), as its row."""
    r = settled.reservation
    certificate_id = f"cert_{secrets.token_hex(12)}"
    body = certificates.issue_signed(
        budget=work.budget,
        charge=settled.charge,
        classes=settled.records,
        batch_set=BatchSet(r.batches, r.batch_set),
        reservation_id=r.id,
        release=release,
        partial_event=settled.partial,
        previous_event=settled.previous,
        release_id=release_id,
        dataset_id=work.head.id,
        issued_at=at,
        signer=signer,
        outcome=outcome,
    )
    return certificates.stored_row(
        certificate_id=certificate_id,
        tenant_id=r.tenant_id,
        dataset_id=work.head.id,
        reservation_id=r.id,
        release_id=release_id,
        body=body,
        at=at,
    )


def _apply(work: Work, settled: Settled, at: datetime, *, closes: bool, status: str) -> Loaded:
    """Apply ``settled``: its batches move, the hold shrinks by what it committed (all of what
    is left when it ``closes``), and the reservation is put with status ``status``."""
    r = settled.reservation
    for index, class_moves in settled.moves.items():
        work.move(members_of(r.id, index), class_moves, at)
    committed_epsilon, committed_delta = settled.committed_epsilon, settled.committed_delta
    committed_of = {x.reservation_class: x.committed for x in settled.records}  # equal within a class
    if closes:  # the rest of the hold returns with the final charge
        work.release_hold(exact_sub(r.epsilon, r.committed_epsilon))
        work.head.reservations_open -= 1
    else:
        work.release_hold(exact_sub(committed_epsilon, r.committed_epsilon))
    work.head.charges_committed += 1
    applied = replace(
        r,
        status=status,
        closed_at=at if closes else None,
        committed_epsilon=committed_epsilon,
        committed_delta=committed_delta,
        committed_event=settled.partial_document,
        classes=tuple(replace(c, committed=committed_of.get(c.index, c.committed)) for c in r.classes),
    )
    work.put_reservation(applied)
    return applied


def _settle(
    work: Work,
    r: Loaded,
    charge: Charge,
    partial: ev.DpEvent | None,
    partial_document: dict[str, Any] | None,
    previous: ev.DpEvent | None,
    *,
    refund_rest: bool,
) -> Settled:
    """Settle ``charge`` (``partial``: the run so far; ``None``: all of it) on every class of
    ``r`` with ``rules.commit``, decided once per (reservation class, current state) — equal
    inputs, equal settlements: the certificate's class records and the batches' moves.
    ``refund_rest``: the batches move to the settled state with the rest of the hold returned
    (``rules.cancel``; an abort's prefix that the built-in worker says ran)."""
    records: list[ClassRecord] = []
    moves: dict[int, list[Move]] = {}
    for index, groups in work.groups(r.id, r.batches).items():
        c = r.classes[index]
        for g in groups:
            before = work.state(g.state_id)
            try:
                settlement = rules.commit(
                    work.budget, before, charge, c.reserved, c.committed, partial, previous
                )
                after = (
                    rules.cancel(work.budget, settlement.state, c.reserved, settlement.committed)
                    if refund_rest
                    else settlement.state
                )
            except AccountantError as exc:
                raise rule_error(
                    exc, work.example_batch(g.state_id, g.scope or members_of(r.id, index))
                ) from exc
            records.append(
                ClassRecord(
                    reservation_class=index,
                    batches=g.batches,
                    state_at_reserve=BatchState.from_json(c.state_at_reserve),
                    reserved=c.reserved,
                    state_before=before,
                    committed_before=c.committed,
                    state_after=settlement.state,
                    committed=settlement.committed,
                )
            )
            moves.setdefault(index, []).append(g.move(after))
    return Settled(r, charge, partial, partial_document, previous, records, moves)


def reserve(work: Work, op: Request, params: ReserveParams) -> Reservation:
    refuse_archived(work.head.id, work.head.archived_at)
    selection = work.select(params.selector, params.ids, MAX_BATCHES_PER_RESERVATION)
    work.load_states(selection.counts)
    admissions: dict[str, rules.Admission] = {}
    for state_id in selection.classes:  # decide on every state before holding on any
        try:
            admissions[state_id] = rules.reserve(work.budget, work.state(state_id), params.charge)
        except AccountantError as exc:
            raise rule_error(exc, selection.example[state_id]) from exc
    epsilon = max(a.cost.epsilon for a in admissions.values())
    delta = max(a.cost.delta for a in admissions.values())
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
        batches=selection.batches,
        batch_set=selection.batch_set,
        classes=tuple(
            HeldClass(
                index,
                work.state(state_id).to_json(),
                admissions[state_id].cost,
                None,
                selection.counts[state_id],
                () if selection.whole is None else tuple(selection.whole[state_id]),
            )
            for state_id, index in selection.classes.items()
        ),
    )
    work.add_reservation(r, selection)
    work.move(
        selection.scope,
        [
            Move(
                state_id,
                admissions[state_id].state,
                selection.counts[state_id],
                frozenset(selection.tasks[state_id]),
                None if selection.members is None else tuple(selection.members[state_id]),
                compact=selection.whole is not None,
            )
            for state_id in selection.classes
        ],
        op.at,
    )
    work.hold(epsilon)
    work.head.reservations_open += 1
    response = Reservation.of(r)
    shown = response.to_json()
    work.audit(
        "reservation.reserved",
        {
            "reservation_id": r.id,
            "event": r.event,
            "noise_commitment": r.noise_commitment,
            "cost": shown["cost"],
            "batches": shown["batches"],
            "expires_at": shown["expires_at"],
        },
        op.at,
    )
    return response


def _open(work: Work, op: Request, reservation_id: str, refusal: str) -> Loaded | ReservationExpired:
    """The open reservation ``op`` acts on (a commit, an extension). Refused: another tenant's or
    an unknown one (``NotFound``), an expired one, a closed one (``reservation_closed``, saying
    ``refusal``). Late — open but past its time — it expires now, charged what could have run as
    any expiry, and stays expired: the ``ReservationExpired`` returned is what ``op`` answers."""
    r = work.reservations.get(reservation_id)
    if r is None or r.tenant_id != op.tenant_id:
        raise NotFound("reservation", reservation_id)
    if r.status == "reserved" and r.expires_at <= op.at:
        _close(work, r, "expired", op.at)
        return ReservationExpired(r.id)
    if r.status == "expired":
        raise ReservationExpired(r.id)
    if r.status != "reserved":
        raise Conflict(
            f"reservation {r.id!r} is {r.status}; {refusal}.", reason="reservation_closed", status=r.status
        )
    return r


def commit(
    work: Work, op: Request, params: CommitParams, priced: Priced = NOT_PRICED
) -> tuple[Commit | None, LedgerError | None]:
    """Settle the reservation's charge (``_settle``), certify it (``_certify``), apply it
    (``_apply``) and record the release. A late commit expires its reservation and is refused."""
    r = _open(work, op, params.reservation_id, "it cannot be committed")
    if isinstance(r, ReservationExpired):
        return None, r
    release_key = (op.tenant_id, params.model, params.version)
    if release_key in work.released:
        raise ReleaseExists(params.model, params.version)
    if priced.reserved_event is not None and priced.reserved_event[0] == r.event:
        event = priced.reserved_event[1]  # parsed (and priced with) before the transaction
    else:
        event = ev.from_json(r.event)
    # The run the previous progressive commit reported: this one must extend it.
    previous = None if r.committed_event is None else ev.from_json(r.committed_event)
    charge = Charge(event, r.noise_commitment)
    settled = _settle(work, r, charge, params.partial, params.partial_document, previous, refund_rest=False)
    release_id = f"rel_{secrets.token_hex(12)}"
    certificate = _certify(work, settled, op.at, params.signer, release=params.release, release_id=release_id)
    # Decided: apply.
    closes = params.partial is None
    r = _apply(work, settled, op.at, closes=closes, status="committed" if closes else "reserved")
    r = replace(r, commits=r.commits + 1)
    work.put_reservation(r)
    work.head.last_release, work.head.last_release_at = params.release, op.at
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
    work.certificates.append(certificate)
    reservation = Reservation.of(r)
    work.audit(
        "reservation.committed",
        {
            "reservation_id": r.id,
            "release": params.release,
            "certificate_id": certificate["id"],
            "content_hash": certificate["content_hash"],
            "committed": reservation.to_json()["committed"],
            "final": closes,
        },
        op.at,
    )
    return Commit(certificates.IssuedCertificate.of_row(certificate, params.release), reservation), None


def abort(work: Work, op: Request, params: AbortParams) -> Reservation:
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
        r = _close(work, r, "aborted", op.at, params.ran)
    return Reservation.of(r)


def extend(work: Work, op: Request, params: ExtendParams) -> tuple[Reservation | None, LedgerError | None]:
    """Hold the reservation until ``max(expires_at, now + ttl)``: a heartbeat never shortens a
    hold, and a repeat changes nothing (no audit entry). Refused: another tenant's or an unknown
    reservation (``NotFound``), a closed one (``reservation_closed``), one past its time (it
    expires now, charged as any expiry, and ``ReservationExpired`` is answered, as a late commit
    is), and a hold past ``max_lifetime`` from creation (``LifetimeExceeded``; nothing changes)."""
    r = _open(work, op, params.reservation_id, "only an open reservation can be extended")
    if isinstance(r, ReservationExpired):
        return None, r
    latest = r.created_at + params.max_lifetime
    wanted = op.at + params.ttl
    if wanted > latest:
        raise LifetimeExceeded(
            r.id, params.ttl.total_seconds(), latest.isoformat(), params.max_lifetime.total_seconds()
        )
    if wanted <= r.expires_at:
        return Reservation.of(r), None
    extended = replace(r, expires_at=wanted)
    work.put_reservation(extended)
    work.audit(
        "reservation.extended",
        {
            "reservation_id": r.id,
            "ttl_s": params.ttl.total_seconds(),
            "previous_expires_at": r.expires_at.isoformat(),
            "expires_at": wanted.isoformat(),
        },
        op.at,
    )
    return Reservation.of(extended), None


def expire(work: Work, reservation_ids: Iterable[str], at: datetime) -> int:
    """Expire those of the reservations that are open and due at ``at``."""
    expired = 0
    for reservation_id in reservation_ids:
        r = work.reservations.get(reservation_id)
        if r is not None and r.status == "reserved" and r.expires_at <= at:
            _close(work, r, "expired", at)
            expired += 1
    return expired


def declare_segment(work: Work, op: Request, params: SegmentParams) -> SegmentDeclared:
    """Declare the next plan segment of the dataset's sequential ``prv`` budget.

    Decided on the locked head, so it is ordered with every reservation of the dataset (and with
    another declaration: the second one is priced against the budget the first one left). While
    any reservation is open the open segment cannot close — its certificate must be issued under
    the budget it was reserved under — so the declaration is refused (``plan_step_pending``);
    due reservations have already expired (``engine``). Then every batch's state is closed
    (``rules.close_segment``: a batch that ran any of the open segment is charged its whole
    (εᵢ, δᵢ)) and the budget is written with the head."""
    budget = work.budget
    if op.tenant_id != work.head.tenant_id:
        raise NotFound("dataset", work.head.id)
    refuse_archived(work.head.id, work.head.archived_at)
    try:
        grown = budget.with_segment(params.plan, params.delta)
    except InvalidArgumentError as exc:
        raise InvalidInput(exc.field, exc.message) from exc
    except AccountantError as exc:  # an event PRV cannot account (UnsupportedEventError)
        raise InvalidInput("plan", str(exc)) from exc
    if work.head.reservations_open > 0:
        raise ChargeRefused(
            "plan_step_pending",
            f"{work.head.reservations_open} reservation(s) of this dataset are open; commit or abort "
            "them before declaring the next plan segment (the open segment closes when it is declared).",
        )
    moves: list[Move] = []
    for state_id, count, tasks in work.dataset_groups():  # once per distinct state
        state = work.state(state_id)
        try:
            after = rules.close_segment(budget, state)
        except AccountantError as exc:
            raise rule_error(exc, work.example_batch(state_id)) from exc
        if after != state:
            moves.append(Move(state_id, after, count, tasks))
    work.move(whole_dataset(work.head.id), moves, op.at)  # decided: apply
    work.grow_budget(grown)
    index = len(grown.plan_segments) - 1
    segment = grown.plan_segments[index]
    held_eps = exact_sum(s.epsilon for s in grown.plan_segments)
    held_dlt = exact_sum(s.delta for s in grown.plan_segments)
    response = SegmentDeclared(
        dataset_id=work.head.id,
        index=index,
        plan=params.plan_document,
        epsilon=segment.epsilon,
        delta=segment.delta,
        declared=EpsilonDelta(held_eps, held_dlt),
        left=EpsilonDelta(exact_sub(grown.epsilon, held_eps), exact_sub(grown.delta, held_dlt)),
        closed_batches=sum(m.count for m in moves),
        theorem=rules.theorem(grown),
    )
    shown = response.to_json()
    work.audit(
        "plan.segment_declared",
        {k: shown[k] for k in ("index", "plan", "delta", "epsilon", "declared", "closed_batches")},
        op.at,
    )
    return response


def rule_error(exc: AccountantError, batch_id: str | None) -> LedgerError:
    """The domain error for an accountant error raised while pricing on ``batch_id`` (``None``:
    a new batch a quote prices)."""
    if isinstance(exc, rules.BudgetExceeded):
        return BudgetExceeded(
            exc.remaining.to_json(), exc.requested.to_json(), exc.message, batch_id=batch_id
        )
    if isinstance(exc, rules.ChargeRefused):
        return ChargeRefused(exc.code, exc.message, batch_id=batch_id)
    if isinstance(exc, InvalidArgumentError):
        return InvalidInput(exc.field, exc.message)
    return InvalidInput("event", str(exc))  # UnsupportedEventError: the accountant cannot
