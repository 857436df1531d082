"""Typed dependencies of the routers: the database, the caller (API key → principal) and scopes.

``Authorization: Bearer <key>`` on every call but ``/healthz``. A missing, malformed, unknown or
revoked key answers 401; a key whose scope does not allow the call answers 403. Scopes nest:
``admin`` ⊇ ``trainer`` ⊇ ``viewer`` (docs/ARCHITECTURE.md, "Tenancy, keys and scopes"). Tenancy is
enforced below, by the ledger operations, which look objects up within the principal's tenant
(another tenant's object is "not found"). A key's lookup may be reused for
``LEDGER_AUTH_CACHE_TTL_S`` seconds (off by default; see ``PrincipalCache``).

``GET /metrics`` takes no API key (``require_metrics_reader``): its series count every tenant's
calls, so a tenant's key, even an admin's, must not read them. The operator scrapes with
``LEDGER_METRICS_TOKEN`` as the bearer token, or opens it with ``LEDGER_METRICS_PUBLIC=true``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Annotated, Final

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from service.api.errors import Forbidden, Unauthorized
from service.api.metrics import LedgerMetrics
from service.db.session import Database
from service.ledger.tenancy import Principal, authenticate_many
from service.settings import Settings

_RANK: Final = {"viewer": 0, "trainer": 1, "admin": 2}


# Dependencies that do no I/O are ``async``: FastAPI runs a sync dependency in the thread pool,
# a hop per dependency per request that the hot path (reserve, commit) cannot afford.


async def get_database(request: Request) -> Database:
    database: Database = request.app.state.database
    return database


async def get_metrics(request: Request) -> LedgerMetrics:
    metrics: LedgerMetrics = request.app.state.metrics
    return metrics


DatabaseDep = Annotated[Database, Depends(get_database)]
MetricsDep = Annotated[LedgerMetrics, Depends(get_metrics)]


class PrincipalCache:
    """Successful key lookups, reused for ``ttl_s`` seconds (``LEDGER_AUTH_CACHE_TTL_S``).

    Off (``ttl_s == 0``) by default: then every request looks its key up and a revocation takes
    effect at once. Only successes are kept, by an HMAC of the key under a random key of this
    cache (never the key itself, nor a digest anyone could test a guess against), so a new key
    works at once and an unknown key is looked up every time.
    """

    MAX_ENTRIES: Final = 10_000

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[Principal, float]] = OrderedDict()
        self._lock = threading.Lock()
        self._salt = secrets.token_bytes(32)

    def _digest(self, key: str) -> str:
        return hmac.new(self._salt, key.encode(), hashlib.sha256).hexdigest()

    def get(self, key: str) -> Principal | None:
        if self.ttl_s <= 0:
            return None
        digest = self._digest(key)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            principal, expires = entry
            if expires < time.monotonic():
                del self._entries[digest]
                return None
            return principal

    def put(self, key: str, principal: Principal) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            self._entries[self._digest(key)] = (principal, time.monotonic() + self.ttl_s)
            while len(self._entries) > self.MAX_ENTRIES:
                self._entries.popitem(last=False)


_NO_CACHE: Final = PrincipalCache(0.0)


def _bearer_key(request: Request) -> str:
    header = request.headers.get("authorization")
    if header is None:
        raise Unauthorized("missing Authorization header; send 'Authorization: Bearer <api key>'.")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Authorization must be 'Bearer <api key>'.")
    return key


class KeyLookups:
    """The key lookups of concurrent requests, made together (one per app, on its event loop).

    A request waits on a future while one drain task looks up, in a worker thread and ONE query
    (``tenancy.authenticate_many``), every key that arrived since the previous lookup began. So
    each request's lookup still starts after the request arrived (a revocation committed before
    it is seen, as with a lookup of its own), but a burst of requests shares one thread hop and
    one database round trip.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, list[asyncio.Future[Principal | None]]] = {}
        self._drain: asyncio.Task[None] | None = None

    async def principal(self, database: Database, key: str) -> Principal | None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (an app served again): nothing pending carries over
            self._loop, self._pending, self._drain = loop, {}, None
        answer: asyncio.Future[Principal | None] = loop.create_future()
        self._pending.setdefault(key, []).append(answer)
        if self._drain is None:
            self._drain = loop.create_task(self._lookups(database))
        return await answer

    async def _lookups(self, database: Database) -> None:
        batch: dict[str, list[asyncio.Future[Principal | None]]] = {}
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                try:
                    found = await run_in_threadpool(authenticate_many, database, list(batch))
                except Exception as exc:  # the database is unreachable: each request fails with it
                    for answers in batch.values():
                        for answer in answers:
                            if not answer.done():  # its request may have been cancelled
                                answer.set_exception(exc)
                    continue
                for key, answers in batch.items():
                    for answer in answers:
                        if not answer.done():
                            answer.set_result(found.get(key))
        finally:
            self._drain = None
            for answers in (*batch.values(), *self._pending.values()):  # left by a cancellation
                for answer in answers:
                    answer.cancel()


async def get_principal(request: Request) -> Principal:
    """The caller's principal: an indexed lookup of the key's hash, shared with concurrent
    requests (``KeyLookups``), or the process's recent lookup when ``LEDGER_AUTH_CACHE_TTL_S``
    allows it."""
    key = _bearer_key(request)
    state = request.app.state
    cache: PrincipalCache = getattr(state, "principals", _NO_CACHE)
    principal = cache.get(key)
    if principal is None:
        lookups: KeyLookups = state.key_lookups
        principal = await lookups.principal(state.database, key)
        if principal is None:
            raise Unauthorized("unknown or revoked API key.")
        cache.put(key, principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_scope(required: str) -> Callable[[Request], Awaitable[Principal]]:
    # One dependency (no sub-dependencies to solve): it runs on every call.
    async def check(request: Request) -> Principal:
        principal = await get_principal(request)
        if _RANK.get(principal.scope, -1) < _RANK[required]:
            raise Forbidden(
                f"this call needs a {required!r} key; this key's scope is {principal.scope!r}.",
                scope=principal.scope,
                required=required,
            )
        return principal

    return check


async def require_metrics_reader(request: Request) -> None:
    """Let the operator's scraper through to ``/metrics``, no one else (401).

    Open when ``LEDGER_METRICS_PUBLIC`` is true; otherwise the bearer token must equal
    ``LEDGER_METRICS_TOKEN`` (compared in constant time). With neither set, ``/metrics`` is
    closed: the counts of every tenant's reservations, refusals and routes are not a tenant's
    to read, so no API key opens it.
    """
    settings: Settings = request.app.state.settings
    if settings.metrics_public:
        return
    if settings.metrics_token is None:
        raise Unauthorized(
            "/metrics is closed: the operator sets LEDGER_METRICS_TOKEN (and scrapes with it as the "
            "bearer token) or LEDGER_METRICS_PUBLIC=true; API keys do not read it."
        )
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    expected = settings.metrics_token.get_secret_value()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Unauthorized("/metrics needs 'Authorization: Bearer <LEDGER_METRICS_TOKEN>'.")


MetricsReaderDep = Annotated[None, Depends(require_metrics_reader)]

AdminDep = Annotated[Principal, Depends(require_scope("admin"))]
TrainerDep = Annotated[Principal, Depends(require_scope("trainer"))]
ViewerDep = Annotated[Principal, Depends(require_scope("viewer"))]

IdempotencyKeyDep = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$",  # visible ASCII, inner spaces
        description="A retry with the same key returns the first answer and charges nothing more.",
    ),
]
