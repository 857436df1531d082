"""Group commit: concurrent spends on one dataset decided in ONE database transaction.

A durable commit waits for the write-ahead log to reach the disk, and the ledger head stays locked
until it has, so one-transaction-per-spend caps a hot dataset at about one spend per disk flush.
Concurrent spends on one dataset within a process are therefore combined: the first caller
becomes the leader, takes every spend queued for the dataset, and runs them in ONE transaction —
each decided in turn on the states the previous ones left, exactly as if they had run one after
the other; a refused spend changes nothing and gets its own error. Each caller gets its answer
after that transaction commits. If the group transaction itself fails (a constraint race with
another process, a deadlock), each spend is retried alone, so one spend's failure is never
another's. Spends from other processes serialise on the ledger head as before. Callers in
threads (the worker, the CLI) queue on ``Combiner``, whose first caller leads; coroutines (the
HTTP routes) queue on ``AsyncCombiner``, whose drain task runs each group in one worker thread.

The engine knows nothing of what a spend decides: the domain registers one ``Domain`` (its
``decide`` for each operation, with pricing before the transaction and expiry of what is due),
and the engine handles idempotent replays, the locked ledger head, retries and answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import anyio.to_thread
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from accountant import rules
from service import server_secrets
from service.db.session import Database
from service.ledger.errors import (
    Conflict,
    DuplicateIdempotencyKey,
    IdempotencyConflict,
    LedgerError,
    NotFound,
)
from service.ledger.spending.answers import Answer, Result, Stored, refreshed, replay
from service.ledger.spending.requests import NOT_PRICED, Op, Priced, Request
from service.ledger.spending.store import Work, due_ids, load_reservations, released, stored_answers
from service.verification.signing import KeyRing, SigningKey

MAX_GROUP: Final = 64
_RETRIES: Final = 5
_TRANSIENT_SQLSTATES: Final = frozenset({"40P01", "40001"})


@dataclass(frozen=True)
class Domain:
    """The seam between the engine and what it runs: how an operation is priced before its
    transaction and decided in it (``spending.decisions``, ``spending.pre_pricing``)."""

    decide: Callable[[Work, Request, Priced], tuple[Answer | None, LedgerError | None]]
    """Decide a request on the locked ``Work`` with its prices and apply it: its answer, or the
    error it answers while its changes stay; a refusal raises a ``LedgerError`` and changes nothing."""
    expire: Callable[[Work, Iterable[str], datetime], int]
    """Expire those of the reservations that are open and due at the time: how many."""
    prepare: Callable[[Database, Request], Priced]
    """Price a request outside any transaction (once per op); raises the request's own refusal."""
    prices_inline: Callable[[Request], bool]
    """Whether a request is priced in its group's worker thread rather than before it queues."""


def _group_transaction(
    connection: Connection,
    domain: Domain,
    dataset_id: str,
    ops: Sequence[Op],
    signer: Callable[[], SigningKey],
    after_commit: list[Callable[[], None]],
    *,
    check_releases: bool,
) -> dict[int, Result]:
    """Decide and write every operation of ``ops`` in ``connection``'s transaction; their results
    (answer or error) by position. Raises only for failures of the transaction itself.
    ``after_commit``: what to call once the transaction has committed (``Work.committed``)."""
    results: dict[int, Result] = {}
    stored = stored_answers(connection, [op.request for op in ops])
    active: list[int] = []
    replays: list[tuple[int, dict[str, Any], str]] = []  # answered as the reservation is now
    for i, op in enumerate(ops):
        hit = stored.get((op.request.tenant_id, op.request.key)) if op.request.key is not None else None
        if hit is None:
            active.append(i)
            continue
        response, conflict, rid = replay(op.request, hit)
        if response is None:
            results[i] = (None, conflict)
        elif rid is None:
            results[i] = (refreshed(op.request, response, None), None)
        else:
            replays.append((i, response, rid))
    if not active and not replays:
        return results
    at = max(ops[i].request.at for i in [*active, *(i for i, _, _ in replays)])
    work = Work.open(connection, dataset_id)
    if work is None:
        for i in active:
            results[i] = (None, NotFound("dataset", dataset_id))
        for i, response, _ in replays:
            results[i] = (refreshed(ops[i].request, response, None), None)
        return results
    # Read only when the head says one is due: usually nothing.
    due = (
        due_ids(connection, dataset_id, at) if work.next_expiry is not None and work.next_expiry <= at else []
    )
    # A release that exists already is refused by its unique constraint when the group writes;
    # that failure reruns each op alone with this check on, which names the (model, version).
    already = released(connection, [ops[i].request for i in active]) if check_releases else set()
    work.signer = signer
    work.load_for([ops[i].request for i in active], [*due, *(rid for _, _, rid in replays)])
    work.released.update(already)
    work.expired_on_open = domain.expire(work, due, at)
    for i, response, rid in replays:
        r = work.reservations.get(rid)
        if r is not None and r.dataset_id == work.head.id:
            domain.expire(work, [rid], ops[i].request.at)  # a hold past its time is "expired" now, and freed
        results[i] = (refreshed(ops[i].request, response, work.reservations.get(rid)), None)

    answered: dict[tuple[str, str], Stored] = {}
    for i in active:
        request, priced = ops[i].request, ops[i].priced or NOT_PRICED
        if request.tenant_id != work.head.tenant_id:
            results[i] = (None, NotFound("dataset", dataset_id))
            continue
        key = None if request.key is None else (request.tenant_id, request.key)
        if key is not None and key in answered:  # a retry within the group
            response, conflict, rid = replay(request, answered[key])
            if response is None:
                results[i] = (None, conflict)
            else:
                now = None if rid is None else work.reservations.get(rid)
                results[i] = (refreshed(request, response, now), None)
            continue
        # Prices come from the request's memo, filled before the transaction (``prepare``):
        # under the lock the rules only add and compare.
        memo = priced.memo
        pricing: AbstractContextManager[object] = (
            rules.pricing(memo) if memo is not None and memo.adopt(work.budget) else nullcontext()
        )
        try:
            with pricing:
                answer, error = domain.decide(work, request, priced)
        except LedgerError as exc:
            results[i] = (None, exc)
            continue
        results[i] = (None if error else answer, error)
        if key is not None and error is None and answer is not None:
            stored_json = answer.to_json()  # the key's answer, stored as its wire form
            answered[key] = (request.operation, request.digest, stored_json)
            work.idempotency.append(
                {
                    "tenant_id": request.tenant_id,
                    "key": request.key,
                    "operation": request.operation,
                    "request_hash": request.digest,
                    "response": stored_json,
                    "status_code": request.status_code,
                    "created_at": request.at,
                }
            )
    if work.events:  # every change is audited: no event, nothing changed (a refusal changes nothing)
        work.flush()
    after_commit.append(work.committed)
    return results


def _prepared(prepare: Callable[[Database, Request], Priced], db: Database, ops: Sequence[Op]) -> list[Op]:
    """``ops`` priced (``prepare``, once each); an op whose pricing is refused is answered now and
    left out."""
    ready: list[Op] = []
    for op in ops:
        try:
            if op.priced is None:
                op.priced = prepare(db, op.request)
        except Exception as exc:  # its own answer (invalid, not found, rate limited, ...)
            op.finish(None, exc)
            continue
        ready.append(op)
    return ready


def _is_transient(exc: OperationalError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _TRANSIENT_SQLSTATES or "database is locked" in str(
        exc.orig
    )


def _release_taken(failure: BaseException) -> bool:
    """Whether the group failed on the unique (tenant, model, version) of releases."""
    return isinstance(failure, Conflict) and failure.reason == "release_exists"


def _answer_raced_retries(db: Database, ops: Sequence[Op], results: dict[int, Result]) -> None:
    """A retry can race its first attempt (in another process): its key lookup found nothing,
    then the first attempt's commit made it fail (e.g. "already committed"). If an answer for
    its key is stored now, that is its answer."""
    refused = [
        i
        for i, op in enumerate(ops)
        if op.request.key is not None
        and isinstance(results[i][1], LedgerError)
        and not isinstance(results[i][1], IdempotencyConflict)
    ]
    if not refused:
        return
    with db.session(readonly=True) as session:
        connection = session.connection()
        stored = stored_answers(connection, [ops[i].request for i in refused])
        for i in refused:
            hit = stored.get((ops[i].request.tenant_id, ops[i].request.key or ""))
            if hit is None:
                continue
            response, conflict, rid = replay(ops[i].request, hit)
            if response is None:
                results[i] = (None, conflict)
                continue
            now = None if rid is None else load_reservations(connection, [rid]).get(rid)
            results[i] = (refreshed(ops[i].request, response, now), None)


GroupRunner = Callable[[Database, str, Sequence[Op]], None]
"""``SpendEngine.run_group``: what a queue calls to run one group."""


class Combiner:
    """Queues the spends of one dataset in one process; one caller at a time leads a group.

    Each waiting caller sleeps on its own op's ``wake`` event and is woken exactly once: when its
    op is answered, or when the leader hands it the lead (its op still queued). A leader whose own
    op is answered hands the lead to the oldest queued op, so no caller waits on another's
    transaction longer than it must, and nobody is woken just to go back to sleep (a shared
    condition's ``notify_all`` woke every waiter after every group).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: deque[Op] = deque()
        self.busy = False

    def run(self, run_group: GroupRunner, db: Database, dataset_id: str, op: Op) -> None:
        wake = op.wake = threading.Event()
        with self.lock:
            self.queue.append(op)
            lead = not self.busy
            self.busy = True
        if not lead:
            wake.wait()
            if op.done:
                return
            # handed the lead: ``busy`` stayed True for us, and our op is still queued
        while True:
            with self.lock:
                group = [self.queue.popleft() for _ in range(min(MAX_GROUP, len(self.queue)))]
            try:
                run_group(db, dataset_id, group)
            except BaseException:
                self._settle(group, op)
                with self.lock:
                    if op in self.queue:  # not in this group: it leaves with the exception
                        self.queue.remove(op)
                    self._pass_lead()
                raise
            self._settle(group, op)
            if op.done:
                with self.lock:
                    self._pass_lead()
                return

    @staticmethod
    def _settle(group: list[Op], leader: Op) -> None:
        for member in group:  # never leave a caller waiting, whatever happened
            if not member.done:
                member.finish(None, RuntimeError("the spend transaction was interrupted"))
            if member is not leader:
                _wake(member)

    def _pass_lead(self) -> None:
        """Under ``lock``: the oldest waiter leads the next group, or nobody leads."""
        if self.queue:
            _wake(self.queue[0])
        else:
            self.busy = False


def _wake(op: Op) -> None:
    assert op.wake is not None  # queued by ``Combiner.run``
    op.wake.set()


class AsyncCombiner:
    """Queues the spends of one dataset made by the coroutines of one event loop (the HTTP routes).

    A caller waits on a future, not in a thread of its own: one drain task runs the queue in
    groups, each group in one worker thread (``run_group``), and resolves the group's futures
    once its transaction has committed. A request thus costs no thread hop of its own, and each
    group holds every spend that arrived while the previous one ran. Spends that sync callers of
    the same process make on the dataset (``Combiner``) serialise with these on the ledger head,
    like those of another process.
    """

    def __init__(self) -> None:
        self.queue: deque[tuple[Op, asyncio.Future[None]]] = deque()
        self.drain: asyncio.Task[None] | None = None

    async def run(self, run_group: GroupRunner, db: Database, dataset_id: str, op: Op) -> None:
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()
        self.queue.append((op, answered))
        if self.drain is None:
            self.drain = loop.create_task(self._drain(run_group, db, dataset_id))
        await answered

    async def _drain(self, run_group: GroupRunner, db: Database, dataset_id: str) -> None:
        try:
            while self.queue:
                group = [self.queue.popleft() for _ in range(min(MAX_GROUP, len(self.queue)))]
                try:
                    await anyio.to_thread.run_sync(run_group, db, dataset_id, [op for op, _ in group])
                finally:
                    _answer(group)
        finally:
            self.drain = None
            _answer([self.queue.popleft() for _ in range(len(self.queue))])  # left by a cancellation


def _answer(group: Iterable[tuple[Op, asyncio.Future[None]]]) -> None:
    for op, answered in group:  # never leave a caller waiting, whatever happened
        if not op.done:
            op.finish(None, RuntimeError("the spend transaction was interrupted"))
        if not answered.done():
            answered.set_result(None)


def _answered(op: Op) -> Answer:
    if op.error is not None:
        raise op.error
    assert op.response is not None
    return op.response


class SpendEngine:
    """Group commit over one ``Domain``, built once with it and with where its signing keys come
    from (``service.ledger.spending.ENGINE``): every group it runs decides with that domain and
    signs with the active key of ``keys(db)``. It holds the queues of the process's spends, one
    per (database, dataset): ``Combiner`` for callers in threads, ``AsyncCombiner`` per event loop.
    """

    def __init__(
        self, domain: Domain, keys: Callable[[Database], KeyRing] = server_secrets.signing_keys
    ) -> None:
        self.domain = domain
        self.keys = keys
        self._lock = threading.Lock()
        self._combiners: weakref.WeakKeyDictionary[Database, dict[str, Combiner]] = (
            weakref.WeakKeyDictionary()
        )
        self._async_combiners: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, weakref.WeakKeyDictionary[Database, dict[str, AsyncCombiner]]
        ] = weakref.WeakKeyDictionary()

    def run_group(
        self, db: Database, dataset_id: str, ops: Sequence[Op], *, check_releases: bool = False
    ) -> None:
        """Run ``ops`` in one transaction and hand every op its result once it has committed.

        When the transaction itself fails, each op is run alone, so a failure is its own op's only,
        and with ``check_releases`` (a release that exists is then refused by name, before anything
        is written, rather than by the constraint that failed the group).
        Ops not priced yet are priced first, before the transaction opens (``prepare``).
        """
        ops = _prepared(self.domain.prepare, db, ops)
        if not ops:
            return

        # An abort's or an expiry's certificate is signed with the active key — and any spend may
        # expire a due reservation. The key ring is loaded (cached per process after the first time)
        # before the transaction opens, as a commit's is (``_commit_request``): its first load admits
        # the keys through the database's key custody, a transaction of its own, which inside this one
        # would wait forever on the write lock this one holds (SQLite: "database is locked"). Loaded
        # inside the retry loop, so a failure of that load is answered like the transaction's.
        rings: list[KeyRing] = []

        def signer() -> SigningKey:
            return rings[0].active

        attempt = 0
        while True:
            attempt += 1
            try:
                if not rings:
                    rings.append(self.keys(db))
                after_commit: list[Callable[[], None]] = []
                with db.transaction() as connection:
                    results = _group_transaction(
                        connection,
                        self.domain,
                        dataset_id,
                        ops,
                        signer,
                        after_commit,
                        check_releases=check_releases,
                    )
                for hook in after_commit:
                    hook()
            except OperationalError as exc:
                if attempt <= _RETRIES and _is_transient(exc):
                    time.sleep(0.002 * attempt)
                    continue
                failure: BaseException = exc
            except DuplicateIdempotencyKey as exc:
                if attempt <= _RETRIES and len(ops) == 1:
                    continue  # a retry in another process committed first: its answer is there now
                failure = exc
            except Exception as exc:  # the group failed as a whole: isolate it
                failure = exc
            else:
                _answer_raced_retries(db, ops, results)
                for i, op in enumerate(ops):
                    op.finish(*results[i])
                return
            if len(ops) == 1 and (check_releases or not _release_taken(failure)):
                ops[0].finish(None, failure)
                return
            for op in ops:
                self.run_group(db, dataset_id, [op], check_releases=True)
            return

    def submit(self, db: Database, request: Request) -> Answer:
        """Run ``request`` (priced in the caller's thread, then queued for its dataset's next group)."""
        op = Op(request, self.domain.prepare(db, request))
        self._combiner(db, request.dataset_id).run(self.run_group, db, request.dataset_id, op)
        return _answered(op)

    async def submit_async(self, db: Database, request: Request) -> Answer:
        """Run ``request`` from a coroutine (priced in a pricing thread, never on the event loop)."""
        op = Op(request)
        if not self.domain.prices_inline(request):
            op.priced = await anyio.to_thread.run_sync(
                self.domain.prepare, db, request, limiter=request.policy.limiter
            )
        await self._async_combiner(db, request.dataset_id).run(self.run_group, db, request.dataset_id, op)
        return _answered(op)

    def _combiner(self, db: Database, dataset_id: str) -> Combiner:
        with self._lock:
            registry = self._combiners.setdefault(db, {})
            combiner = registry.get(dataset_id)
            if combiner is None:
                combiner = registry[dataset_id] = Combiner()
            return combiner

    def _async_combiner(self, db: Database, dataset_id: str) -> AsyncCombiner:
        loop = asyncio.get_running_loop()
        with self._lock:
            by_db = self._async_combiners.setdefault(loop, weakref.WeakKeyDictionary())
            registry = by_db.setdefault(db, {})
            combiner = registry.get(dataset_id)
            if combiner is None:
                combiner = registry[dataset_id] = AsyncCombiner()
            return combiner
