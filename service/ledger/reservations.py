"""Reserve → commit / abort / expire: the spend transactions.

Every spend runs in a database transaction that holds the dataset's ledger head
(``SELECT … FOR UPDATE`` on the dataset row on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so each
decision is made on the current per-batch states and no two spends on a dataset interleave:

* ``reserve`` takes the event parsed (a ``DpEvent``: by ``parse_event``, by the HTTP schema, or
  built by the worker) and checks it as a new charge (``requests.new_event``), prices it on every
  batch it reads with ``accountant.rules.reserve`` under the dataset's rule, and holds it — on
  all batches or on none. A refusal is 409 ``budget_exceeded`` (with the batch's ``remaining`` and the
  ``requested`` cost) or a rule's own code (``batch_already_read``, ``outside_plan``, ...).
* ``commit`` turns the hold into spend (``accountant.rules.commit``), records the release
  ``{model, version}`` and stores the certificate (``accountant.certificates.issue``). With an
  ``event`` it is a progressive commit: the cost of the run so far (never more than
  reserved); the reservation stays open, and a commit without ``event`` closes it.
* ``abort`` charges what could have run: the data could have been read from the moment the hold
  was granted, so the reservation is settled as a final charge of the whole reserved event
  (``accountant.rules.commit``, as a final commit) with a certificate whose ``release`` is
  ``null`` and ``outcome`` is ``"aborted"``. Only the built-in worker, in-process, says what ran
  (``ran``: no HTTP route or API key can): then the prefix that ran is charged and only what
  provably never ran is returned (``accountant.rules.cancel``); nothing read, nothing charged.
* ``extend`` holds an open reservation longer (a heartbeat or an explicit extension, audited as
  ``reservation.extended``), never past ``max_lifetime_s`` from its creation.
* A reservation past its ``expires_at`` expires and is charged exactly as ``abort`` charges
  (``outcome: "expired"``). Every spend transaction first expires the dataset's due
  reservations, ``expire_due`` sweeps all datasets, and a late commit expires its reservation
  and is refused (``ReservationExpired``): a crashed client's hold is spent, never released.

**Group commit.** A durable commit waits for the write-ahead log to reach the disk, and the
ledger head stays locked until it has, so one-transaction-per-spend caps a hot dataset at about
one spend per disk flush. Concurrent spends on one dataset within a process are therefore
combined: the first caller becomes the leader, takes every spend queued for the dataset, and runs
them in ONE transaction — each decided in turn on the states the previous ones left, exactly as
if they had run one after the other; a refused spend changes nothing and gets its own error.
Each caller gets its answer after that transaction commits. If the group transaction itself fails
(a constraint race with another process, a deadlock), each spend is retried alone, so one spend's
failure is never another's. Spends from other processes serialise on the ledger head as before.
Callers in threads (the worker, the CLI) queue on ``Combiner``, whose first caller leads;
coroutines (the HTTP routes: ``reserve_async`` ...) queue on ``AsyncCombiner``, whose drain task
runs each group in one worker thread. A group reads and writes through prebuilt SQLAlchemy Core
statements on the transaction's connection, and its writes are sent together
(``service.db.session.pipelined``: one round trip on PostgreSQL) while the head is locked.

Aggregates are maintained in the same transaction (per batch: its ``BatchState`` and the numbers
read from it; per task and per dataset: maxima over their batches, valid because a batch's spend
never decreases), so reads never scan charges. Audit entries go to the dataset's chain, whose head
is written with the same update of the ledger head. Numbers in answers are decimal strings.

This module is the public API; the implementation is the package ``service.ledger.spending``:
``requests`` (input, operations), ``store`` (persistence: ``Work``, the statements), ``prices``
(pricing before the transaction), ``decisions`` (reserve, commit, abort, expire) and ``engine``
(group commit: group transactions, retries, ``Combiner``, ``AsyncCombiner``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import anyio.to_thread
from sqlalchemy import ColumnElement, bindparam, select

from accountant import events as ev
from service import server_secrets
from service.db import models
from service.db.base import utcnow
from service.db.models import Batch, ReservationTask
from service.db.session import Database
from service.ledger import idempotency, pricing_limits
from service.ledger.datasets import can_be_id
from service.ledger.errors import Conflict, InvalidInput, NotFound, ReleaseExists
from service.ledger.spending import ENGINE, requests
from service.ledger.spending.answers import (
    Answer,
    ClassCost,
    Commit,
    EpsilonDelta,
    Expired,
    Reservation,
    of_kind,
)
from service.ledger.spending.requests import (
    DEFAULT_MAX_LIFETIME_S,
    DEFAULT_TTL_S,
    MAX_BATCHES_PER_RESERVATION,
    MAX_TTL_S,
    AbortParams,
    CommitParams,
    ExpireParams,
    ExtendParams,
    Ran,
    Request,
    ReserveParams,
    keyed,
    parse_event,
)
from service.ledger.spending.store import EXPIRE_PER_TRANSACTION, load_reservations

# A reservation's dataset and tenant never change, so they are remembered (per process, by id):
# a commit or abort finds its dataset's group without a database round trip.
_OWNERS_SIZE: Final = 100_000
_owners: OrderedDict[str, tuple[str, str]] = OrderedDict()
_owners_lock = threading.Lock()
_OWNER: Final = select(models.Reservation.dataset_id, models.Reservation.tenant_id).where(
    models.Reservation.id == bindparam("reservation_id")
)
_RELEASE: Final = select(models.Release.id).where(
    models.Release.tenant_id == bindparam("tenant_id"),
    models.Release.model == bindparam("model"),
    models.Release.version == bindparam("version"),
)


def _remember_owner(reservation_id: str, dataset_id: str, tenant_id: str) -> None:
    with _owners_lock:
        _owners[reservation_id] = (dataset_id, tenant_id)
        if len(_owners) > _OWNERS_SIZE:
            _owners.popitem(last=False)


def _remembered_owner(reservation_id: str) -> tuple[str, str] | None:
    """``(dataset id, tenant id)`` of the reservation when this process knows it; ``NotFound``
    for what cannot be a reservation id."""
    if not can_be_id(reservation_id):
        raise NotFound("reservation", reservation_id)
    with _owners_lock:
        return _owners.get(reservation_id)


def _load_owner(db: Database, reservation_id: str) -> tuple[str, str]:
    rows = db.read_all(_OWNER, {"reservation_id": reservation_id})
    if not rows:
        raise NotFound("reservation", reservation_id)
    row = rows[0]
    _remember_owner(reservation_id, row.dataset_id, row.tenant_id)
    return row.dataset_id, row.tenant_id


def _dataset_in_tenant(owner: tuple[str, str], tenant_id: str, reservation_id: str) -> str:
    """The reservation's dataset; ``NotFound`` for another tenant's reservation."""
    if owner[1] != tenant_id:
        raise NotFound("reservation", reservation_id)
    return owner[0]


def _dataset_of(db: Database, tenant_id: str, reservation_id: str) -> str:
    owner = _remembered_owner(reservation_id) or _load_owner(db, reservation_id)
    return _dataset_in_tenant(owner, tenant_id, reservation_id)


async def _dataset_of_async(db: Database, tenant_id: str, reservation_id: str) -> str:
    owner = _remembered_owner(reservation_id)
    if owner is None:
        owner = await anyio.to_thread.run_sync(_load_owner, db, reservation_id)
    return _dataset_in_tenant(owner, tenant_id, reservation_id)


def _release_free(db: Database, tenant_id: str, release: tuple[str, str] | None) -> None:
    """``ReleaseExists`` when the release a reservation names was released before: found before
    anything is held or trained. The commit checks again (in its transaction): two reservations
    may name the same release, and only the first commit gets it."""
    if release is None:
        return
    model, version = release
    if db.read_all(_RELEASE, {"tenant_id": tenant_id, "model": model, "version": version}):
        raise ReleaseExists(model, version)


# ---------------------------------------------------------------------------------------------
# Public operations. ``reserve``, ``commit`` and ``abort`` block their thread until the spend has
# committed; ``reserve_async``, ``commit_async`` and ``abort_async`` are the same operations for
# a coroutine (the HTTP routes): same answers, same errors, and the event loop is never blocked.
# ---------------------------------------------------------------------------------------------


def _reserve_op(
    tenant_id: str,
    dataset_id: str,
    *,
    event: ev.DpEvent,
    batch_ids: Sequence[str] | None,
    task_ids: Sequence[str] | None,
    noise_commitment: str | None,
    idempotency_key: str | None,
    ttl_s: float,
    now: datetime | None,
    policy: pricing_limits.Policy | None,
    release: Mapping[str, Any] | None = None,
) -> tuple[Request, tuple[str, str] | None]:
    if (batch_ids is None) == (task_ids is None):
        raise InvalidInput("batches", "give exactly one of batches or tasks.")
    selector = "batches" if batch_ids is not None else "tasks"
    ids = requests.ids(batch_ids if batch_ids is not None else task_ids, selector)
    charge = requests.charge(requests.new_event(event), noise_commitment)
    document = ev.to_json(event)
    if not can_be_id(dataset_id):
        raise NotFound("dataset", dataset_id)
    ttl = requests.ttl(ttl_s)
    params = ReserveParams(selector, ids, charge, document, ttl)
    op = Request(
        "reserve",
        tenant_id,
        dataset_id,
        now or utcnow(),
        params,
        policy=policy or pricing_limits.DEFAULT_POLICY,
    )
    # Every field of the request: a retry that differs in any (the hold's ttl_s included) is
    # another request, answered 409 ``idempotency_conflict``, never the first one's answer.
    request = {
        "dataset_id": dataset_id,
        selector: ids,
        "event": document,
        "noise_commitment": noise_commitment,
        "ttl_s": ttl.total_seconds(),
    }
    named: tuple[str, str] | None = None
    if release is not None:
        # Checked, not reserved, so not part of the keyed request: a retry naming another release
        # gets its first answer, as a retry of the reservation it is.
        model, version, _ = requests.release(release)
        named = (model, version)
    return keyed(op, idempotency_key, request), named


def _reserved(op: Request, answer: Answer) -> Reservation:
    reservation = of_kind(Reservation, answer)
    _remember_owner(reservation.id, op.dataset_id, op.tenant_id)
    return reservation


def reserve(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    event: ev.DpEvent,
    batch_ids: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
    noise_commitment: str | None = None,
    idempotency_key: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: datetime | None = None,
    policy: pricing_limits.Policy | None = None,
    release: Mapping[str, Any] | None = None,
) -> Reservation:
    """Certify a planned charge on the batches (or every batch of the tasks) and hold it (201).

    ``event``: the mechanism event, parsed (``parse_event``; the HTTP schema hands over what it
    parsed) or built in-process; checked as a new charge (``requests.new_event``).
    ``release``: the ``{model, version}`` the run will be committed as, if the caller knows it
    now; a release that exists already is refused here (``ReleaseExists``, naming both) instead
    of at commit, after the training. It is not reserved: the commit names its release again.

    Answer: the ``Reservation`` (``to_json``: ``{id, dataset_id, status: "reserved", cost:
    {epsilon, delta}, committed, commits, noise_commitment, expires_at, created_at, closed_at,
    batches: {count, batch_set, classes: [{class, batches, epsilon, delta, naive_epsilon, level?,
    replay?}]}}``) — one class per reservation class (the batches it read in one state;
    ``list_batches`` pages them); ``cost`` is the maximum over the batches (they are disjoint).
    Raises ``InvalidInput`` (also an event whose pricing is above
    ``policy.max_work``), ``NotFound`` (dataset, batch or task, also another tenant's),
    ``BudgetExceeded`` / ``ChargeRefused`` (409, naming the batch; nothing is held),
    ``IdempotencyConflict``, and whatever ``policy.meter`` raises.

    The charge is priced before the spend transaction opens (``service.ledger.pricing_limits``). A retry
    with the same ``idempotency_key`` and the same request answers the reservation as it is now
    (its current status, hold and commits), and holds nothing more.
    """
    op, named = _reserve_op(
        tenant_id,
        dataset_id,
        event=event,
        batch_ids=batch_ids,
        task_ids=task_ids,
        noise_commitment=noise_commitment,
        idempotency_key=idempotency_key,
        ttl_s=ttl_s,
        now=now,
        policy=policy,
        release=release,
    )
    _release_free(db, tenant_id, named)
    return _reserved(op, ENGINE.submit(db, op))


async def reserve_async(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    event: ev.DpEvent,
    batch_ids: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
    noise_commitment: str | None = None,
    idempotency_key: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    policy: pricing_limits.Policy | None = None,
    release: Mapping[str, Any] | None = None,
) -> Reservation:
    """``reserve`` for a coroutine (the charge is priced in a thread of ``policy.limiter``)."""
    op, named = _reserve_op(
        tenant_id,
        dataset_id,
        event=event,
        batch_ids=batch_ids,
        task_ids=task_ids,
        noise_commitment=noise_commitment,
        idempotency_key=idempotency_key,
        ttl_s=ttl_s,
        now=None,
        policy=policy,
        release=release,
    )
    if named is not None:
        await anyio.to_thread.run_sync(_release_free, db, tenant_id, named)
    return _reserved(op, await ENGINE.submit_async(db, op))


def _commit_request(
    db: Database,
    reservation_id: str,
    release: Mapping[str, Any],
    event: ev.DpEvent | None,
    idempotency_key: str | None,
) -> tuple[CommitParams, str | None, dict[str, Any]]:
    """A commit's parameters, its idempotency key and the request its key is bound to."""
    model, version, release_json = requests.release(release)
    partial = None if event is None else requests.new_event(event)
    key = idempotency.check_key(idempotency_key)
    signer = server_secrets.signing_keys(db).active
    document = None if partial is None else ev.to_json(partial)
    params = CommitParams(reservation_id, model, version, release_json, partial, document, signer)
    request = {"reservation_id": reservation_id, "release": release_json, "event": document}
    return params, key, request


def commit(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    release: Mapping[str, Any],
    event: ev.DpEvent | None = None,
    idempotency_key: str | None = None,
    now: datetime | None = None,
    policy: pricing_limits.Policy | None = None,
) -> Commit:
    """Turn the reservation's hold into spend, record the release, store a certificate (200).

    ``event``: the run so far, for a progressive commit (its cost is never more than the
    reservation's; the reservation stays open); ``None`` commits the whole charge and closes it.
    Answer: the ``Commit`` (``to_json``: ``{certificate: {id, dataset_id, reservation_id,
    release, outcome, content_hash, created_at, certificate}, reservation: {...}}``).
    Raises ``NotFound``, ``InvalidInput``, ``Conflict``
    (``reservation_closed``; ``release_exists`` when the (model, version) was released before),
    ``ReservationExpired`` (its hold is freed and stays freed), ``ChargeRefused``
    (``commit_exceeds_reservation``), ``IdempotencyConflict``. A bad ``release`` (a control
    character in ``model`` or ``version``, say) is refused before anything is locked: the
    reservation stays open and committable.

    ``event`` is priced before the spend transaction (bounded and metered by ``policy`` as a
    reservation's). A retry with the same ``idempotency_key`` and request answers the first
    commit's certificate with the reservation as it is now.
    """
    params, key, request = _commit_request(db, reservation_id, release, event, idempotency_key)
    dataset_id = _dataset_of(db, tenant_id, reservation_id)
    op = Request(
        "commit",
        tenant_id,
        dataset_id,
        now or utcnow(),
        params,
        policy=policy or pricing_limits.DEFAULT_POLICY,
    )
    return of_kind(Commit, ENGINE.submit(db, keyed(op, key, request)))


async def commit_async(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    release: Mapping[str, Any],
    event: ev.DpEvent | None = None,
    idempotency_key: str | None = None,
    policy: pricing_limits.Policy | None = None,
) -> Commit:
    """``commit`` for a coroutine."""
    params, key, request = _commit_request(db, reservation_id, release, event, idempotency_key)
    dataset_id = await _dataset_of_async(db, tenant_id, reservation_id)
    op = Request(
        "commit", tenant_id, dataset_id, utcnow(), params, policy=policy or pricing_limits.DEFAULT_POLICY
    )
    return of_kind(Commit, await ENGINE.submit_async(db, keyed(op, key, request)))


def abort(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    idempotency_key: str | None = None,
    now: datetime | None = None,
    ran: Ran | None = None,
) -> Reservation:
    """Close the reservation without a release, charging what could have run (200): the
    ``Reservation`` (``status: "aborted"``, ``committed``: what it was charged in all).

    Without ``ran`` the whole reserved event is charged as a final commit would charge it, and a
    certificate with ``release: null``, ``outcome: "aborted"`` records it (even after progressive
    commits: what could have run is the whole event). ``ran`` is the built-in worker's word on
    what ran, in-process only (``service.worker.gate``; no route passes it): ``Ran(None)``, no
    data read, returns the hold with no certificate; ``Ran(prefix)`` charges the prefix
    (certificate) and returns the rest. Aborting an aborted or expired reservation answers its
    current state and changes nothing; a fully committed one is a ``Conflict``
    (``reservation_closed``).
    """
    key = idempotency.check_key(idempotency_key)
    dataset_id = _dataset_of(db, tenant_id, reservation_id)
    op = Request("abort", tenant_id, dataset_id, now or utcnow(), AbortParams(reservation_id, ran))
    return of_kind(Reservation, ENGINE.submit(db, keyed(op, key, {"reservation_id": reservation_id})))


async def abort_async(
    db: Database, tenant_id: str, reservation_id: str, *, idempotency_key: str | None = None
) -> Reservation:
    """``abort`` for a coroutine (the HTTP route): always charges what could have run."""
    key = idempotency.check_key(idempotency_key)
    dataset_id = await _dataset_of_async(db, tenant_id, reservation_id)
    op = Request("abort", tenant_id, dataset_id, utcnow(), AbortParams(reservation_id))
    answer = await ENGINE.submit_async(db, keyed(op, key, {"reservation_id": reservation_id}))
    return of_kind(Reservation, answer)


def _extend_op(
    tenant_id: str,
    reservation_id: str,
    dataset_id: str,
    ttl_s: float,
    max_lifetime_s: float,
    idempotency_key: str | None,
    now: datetime | None,
) -> Request:
    ttl = requests.ttl(ttl_s)
    if ttl_s > max_lifetime_s:  # 409: a ttl_s the schema allows, above this server's lifetime
        raise Conflict(
            f"ttl_s must be at most the maximum lifetime of a reservation on this server, "
            f"{max_lifetime_s:g} s. Found {ttl_s!r}.",
            reason="reservation_lifetime_exceeded",
            field="ttl_s",
            max_lifetime_s=max_lifetime_s,
        )
    params = ExtendParams(reservation_id, ttl, requests.ttl(max_lifetime_s))
    op = Request("extend", tenant_id, dataset_id, now or utcnow(), params)
    return keyed(op, idempotency_key, {"reservation_id": reservation_id, "ttl_s": ttl.total_seconds()})


def extend(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    ttl_s: float,
    max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S,
    idempotency_key: str | None = None,
    now: datetime | None = None,
) -> Reservation:
    """Hold an open reservation until ``max(expires_at, now + ttl_s)`` (200: the
    ``Reservation``), at most ``max_lifetime_s`` after its creation. A longer training renews its hold with
    this (a heartbeat: a repeat changes nothing); the extension is audited
    (``reservation.extended``). Raises ``InvalidInput`` (``ttl_s``), ``NotFound`` (also another
    tenant's), ``Conflict`` (``reservation_closed``: committed or aborted), ``ReservationExpired``
    (past its time: it expires now, charged as any expiry) and ``LifetimeExceeded`` (nothing
    changes)."""
    key = idempotency.check_key(idempotency_key)
    dataset_id = _dataset_of(db, tenant_id, reservation_id)
    op = _extend_op(tenant_id, reservation_id, dataset_id, ttl_s, max_lifetime_s, key, now)
    return of_kind(Reservation, ENGINE.submit(db, op))


async def extend_async(
    db: Database,
    tenant_id: str,
    reservation_id: str,
    *,
    ttl_s: float,
    max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S,
    idempotency_key: str | None = None,
) -> Reservation:
    """``extend`` for a coroutine (the HTTP route)."""
    key = idempotency.check_key(idempotency_key)
    dataset_id = await _dataset_of_async(db, tenant_id, reservation_id)
    op = _extend_op(tenant_id, reservation_id, dataset_id, ttl_s, max_lifetime_s, key, None)
    return of_kind(Reservation, await ENGINE.submit_async(db, op))


def expire_due(db: Database, *, now: datetime | None = None, limit: int = 10_000) -> Expired:
    """Expire every reservation past its ``expires_at`` (the background sweep): how many.

    One spend transaction per dataset, re-checking each reservation under the dataset's lock.
    """
    at = now or utcnow()
    with db.session(readonly=True) as session:
        rows = session.execute(
            select(models.Reservation.id, models.Reservation.dataset_id, models.Reservation.tenant_id)
            .where(models.Reservation.status == "reserved", models.Reservation.expires_at <= at)
            .order_by(models.Reservation.expires_at)
            .limit(limit)
        ).all()
    by_dataset: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        by_dataset.setdefault((row.dataset_id, row.tenant_id), []).append(row.id)
    expired = 0
    for (dataset_id, tenant_id), ids in by_dataset.items():
        for start in range(0, len(ids), EXPIRE_PER_TRANSACTION):
            chunk = ids[start : start + EXPIRE_PER_TRANSACTION]
            op = Request("expire", tenant_id, dataset_id, at, ExpireParams(chunk))
            expired += of_kind(Expired, ENGINE.submit(db, op)).expired
    return Expired(expired)


def get_reservation(db: Database, tenant_id: str, reservation_id: str) -> Reservation:
    """The reservation (another tenant's answers ``NotFound``)."""
    if not can_be_id(reservation_id):
        raise NotFound("reservation", reservation_id)
    with db.session(readonly=True) as session:
        loaded = load_reservations(session.connection(), [reservation_id])
    r = loaded.get(reservation_id)
    if r is None or r.tenant_id != tenant_id:
        raise NotFound("reservation", reservation_id)
    return Reservation.of(r)


MAX_BATCH_PAGE: Final = 10_000


@dataclass(frozen=True, slots=True)
class BatchPage:
    """A page of the batches a reservation reads: ``batches``, its (batch id, reservation class)
    pairs in ascending id order; ``count`` and ``batch_set``, the reservation's; ``next``, the
    ``after`` of the next page (``None``: the last). ``to_json``: ``{reservation_id, count,
    batch_set, data: [{id, class}], next}``, the answer of ``GET /v1/reservations/{id}/batches``."""

    reservation_id: str
    count: int
    batch_set: str
    batches: tuple[tuple[str, int], ...]
    next: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "reservation_id": self.reservation_id,
            "count": self.count,
            "batch_set": self.batch_set,
            "data": [{"id": batch_id, "class": index} for batch_id, index in self.batches],
            "next": self.next,
        }


def list_batches(
    db: Database, tenant_id: str, reservation_id: str, *, after: str | None = None, limit: int = 1000
) -> BatchPage:
    """A page of the batches a reservation reads, in ascending id order (code points), with their
    reservation class (``BatchPage``). The pairs of every page, in order, are what ``batch_set``
    commits to (``accountant.certificates.batch_set_hash``)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_BATCH_PAGE:
        raise InvalidInput("limit", f"must be an integer in [1, {MAX_BATCH_PAGE}]. Found {limit!r}.")
    if after is not None and (not isinstance(after, str) or len(after) > 200):
        raise InvalidInput("after", f"must be a batch id. Found {after!r}.")
    if not can_be_id(reservation_id):
        raise NotFound("reservation", reservation_id)
    with db.session(readonly=True) as session:
        connection = session.connection()
        r = load_reservations(connection, [reservation_id]).get(reservation_id)
        if r is None or r.tenant_id != tenant_id:
            raise NotFound("reservation", reservation_id)
        # The hash's order: code points, not the locale's.
        postgresql = connection.dialect.name == "postgresql"
        column: ColumnElement[str] = (
            models.ReservationBatch.batch_id.collate("C")
            if postgresql
            else models.ReservationBatch.batch_id.expression
        )
        query = select(models.ReservationBatch.batch_id, models.ReservationBatch.class_index).where(
            models.ReservationBatch.reservation_id == reservation_id
        )
        if after is not None:
            query = query.where(column > after)
        rows = connection.execute(query.order_by(column).limit(limit + 1)).all()
        if any(c.tasks for c in r.classes):  # and the batches of the whole tasks it read
            ids: ColumnElement[str] = Batch.id.collate("C") if postgresql else Batch.id.expression
            # Walked in batch id order (the key's index), each batch's task looked up among the
            # reservation's: ``|| ''`` keeps the planner from reading every batch of the tasks
            # by their task index and sorting them, once per page.
            page = (
                select(Batch.id, ReservationTask.class_index)
                .join(
                    ReservationTask,
                    (ReservationTask.task_id == Batch.task_id.op("||")(""))
                    & (Batch.position <= ReservationTask.last_position),
                )
                .where(ReservationTask.reservation_id == reservation_id)
            )
            if after is not None:
                page = page.where(ids > after)
            rows.extend(connection.execute(page.order_by(ids).limit(limit + 1)).all())
            rows.sort(key=lambda row: row[0])  # code points, as the database's "C" order
            rows = rows[: limit + 1]
    listed = tuple((batch_id, index) for batch_id, index in rows[:limit])
    following = listed[-1][0] if len(rows) > limit else None
    return BatchPage(reservation_id, r.batches, r.batch_set, listed, following)


def all_batches(db: Database, tenant_id: str, reservation_id: str) -> list[tuple[str, int]]:
    """Every (batch id, class) of the reservation, page by page (``list_batches``)."""
    out: list[tuple[str, int]] = []
    after: str | None = None
    while True:
        page = list_batches(db, tenant_id, reservation_id, after=after, limit=MAX_BATCH_PAGE)
        out.extend(page.batches)
        after = page.next
        if after is None:
            return out


def levels_by_batch(db: Database, tenant_id: str, certificate: Mapping[str, Any]) -> dict[str, int]:
    """``{batch id: geometric level}`` of a geometric budget's certificate: each class's committed
    level, for the batches its reservation lists in that class (``all_batches``);
    a version-1 certificate maps its batches to levels itself."""
    levels = certificate["result"]["levels"]
    if isinstance(levels, Mapping):
        return {str(b): int(k) for b, k in levels.items()}
    of_class = {c["class"]: c["committed"]["level"] for c in certificate["inputs"]["classes"]}
    members = all_batches(db, tenant_id, certificate["reservation_id"])
    return {batch_id: int(of_class[index]) for batch_id, index in members}


__all__ = [
    "DEFAULT_MAX_LIFETIME_S",
    "DEFAULT_TTL_S",
    "MAX_BATCHES_PER_RESERVATION",
    "MAX_BATCH_PAGE",
    "MAX_TTL_S",
    "BatchPage",
    "ClassCost",
    "Commit",
    "EpsilonDelta",
    "Expired",
    "Ran",
    "Reservation",
    "abort",
    "abort_async",
    "all_batches",
    "commit",
    "commit_async",
    "expire_due",
    "extend",
    "extend_async",
    "get_reservation",
    "levels_by_batch",
    "list_batches",
    "parse_event",
    "reserve",
    "reserve_async",
]
