"""Typed dependencies of the routers: the database, the caller (API key → principal) and scopes.

``Authorization: Bearer <key>`` on every call but ``/healthz``. A missing, malformed, unknown or
revoked key answers 401; a key whose scope does not allow the call answers 403. Scopes nest:
``admin`` ⊇ ``trainer`` ⊇ ``viewer`` (DESIGN.md, "HTTP API v1"). Tenancy is enforced below, by
the ledger operations, which look objects up within the principal's tenant (another tenant's
object is "not found").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Final

from fastapi import Depends, Header, Request

from service.api.errors import Forbidden, Unauthorized
from service.api.metrics import LedgerMetrics
from service.db.session import Database
from service.ledger.tenancy import Principal, authenticate

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


def get_principal(request: Request, database: DatabaseDep) -> Principal:
    """The caller's principal (one indexed lookup of the key's hash; runs in the thread pool)."""
    header = request.headers.get("authorization")
    if header is None:
        raise Unauthorized("missing Authorization header; send 'Authorization: Bearer <api key>'.")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Authorization must be 'Bearer <api key>'.")
    principal = authenticate(database, key)
    if principal is None:
        raise Unauthorized("unknown or revoked API key.")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_scope(required: str) -> Callable[[Principal], Awaitable[Principal]]:
    async def check(principal: PrincipalDep) -> Principal:
        if _RANK.get(principal.scope, -1) < _RANK[required]:
            raise Forbidden(
                f"this call needs a {required!r} key; this key's scope is {principal.scope!r}.",
                scope=principal.scope,
                required=required,
            )
        return principal

    return check


AdminDep = Annotated[Principal, Depends(require_scope("admin"))]
TrainerDep = Annotated[Principal, Depends(require_scope("trainer"))]
ViewerDep = Annotated[Principal, Depends(require_scope("viewer"))]

IdempotencyKeyDep = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="A retry with the same key returns the first answer and charges nothing more.",
    ),
]
