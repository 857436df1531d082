"""Tenants and API keys.

A key belongs to one tenant and carries one scope: ``admin`` (everything in the tenant),
``trainer`` (reserve, commit, abort, jobs, reads), ``viewer`` (reads). Only ``SHA-256(key)`` is
stored; ``authenticate`` looks the hash up (a unique index) and compares it in constant time.
Generated keys are ``pl_`` + 43 URL-safe characters (256 random bits), so a hash lookup is as
strong as the key. A tenant id is a short slug (``default``, ``team-a``); tenant ``default``
holds the bootstrap admin key (``LEDGER_BOOTSTRAP_ADMIN_KEY``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from service.db.base import utcnow
from service.db.models import SCOPES, ApiKey, Tenant
from service.db.session import Database
from service.ledger import audit
from service.ledger.errors import Conflict, InvalidInput, NotFound

DEFAULT_TENANT: Final = "default"
KEY_PREFIX: Final = "pl_"
MAX_KEY_LENGTH: Final = 512
_TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's tenant, scope and id."""

    tenant_id: str
    scope: str
    key_id: str

    def allows(self, scope: str) -> bool:
        """Whether this principal's scope covers ``scope`` (admin ⊇ trainer ⊇ viewer)."""
        return SCOPES.index(self.scope) <= SCOPES.index(scope)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_id(tenant_id: object, field: str = "tenant") -> str:
    if not isinstance(tenant_id, str) or not _TENANT_ID.match(tenant_id):
        raise InvalidInput(
            field,
            "must be 1-64 characters of a-z, 0-9, '_', '.', '-', starting with a letter or digit. "
            f"Found {tenant_id!r}.",
        )
    return tenant_id


def check_scope(scope: object) -> str:
    if scope not in SCOPES:
        raise InvalidInput("scope", f"must be one of {list(SCOPES)}. Found {scope!r}.")
    return str(scope)


def _tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "created_at": tenant.created_at.isoformat()}


def _key_json(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id,
        "tenant_id": key.tenant_id,
        "scope": key.scope,
        "prefix": key.prefix,
        "created_at": key.created_at.isoformat(),
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }


def _ensure_tenant(session: Session, tenant_id: str, now: datetime) -> tuple[Tenant, bool]:
    tenant = session.get(Tenant, tenant_id)
    if tenant is not None:
        return tenant, False
    tenant = Tenant(id=tenant_id, created_at=now)
    session.add(tenant)
    session.flush()
    return tenant, True


def create_tenant(db: Database, tenant_id: str) -> dict[str, Any]:
    """Create a tenant; ``Conflict`` (``tenant_exists``) if it exists."""
    check_tenant_id(tenant_id)
    now = utcnow()
    with db.session() as session:
        tenant = Tenant(id=tenant_id, created_at=now)
        session.add(tenant)
        session.flush()
        audit.append(session, [audit.AuditEvent("tenant.created", {}, tenant_id=tenant_id)], now=now)
        return _tenant_json(tenant)


def get_tenant(db: Database, tenant_id: str) -> dict[str, Any]:
    with db.session(readonly=True) as session:
        tenant = session.get(Tenant, tenant_id)
        if tenant is None:
            raise NotFound("tenant", tenant_id)
        return _tenant_json(tenant)


def issue_api_key(db: Database, tenant: str, scope: str, *, key: str | None = None) -> dict[str, Any]:
    """Create a key for ``tenant`` (created if missing): ``{id, key, tenant_id, scope, ...}``.

    The plaintext ``key`` is in this answer only; the database keeps its hash.
    """
    check_tenant_id(tenant)
    check_scope(scope)
    plaintext = key if key is not None else KEY_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    with db.session() as session:
        _, created = _ensure_tenant(session, tenant, now)
        row = ApiKey(
            id=f"key_{secrets.token_hex(8)}",
            tenant_id=tenant,
            key_hash=hash_key(plaintext),
            prefix=plaintext[:10],
            scope=scope,
            created_at=now,
            revoked_at=None,
        )
        session.add(row)
        session.flush()
        events = [audit.AuditEvent("tenant.created", {}, tenant_id=tenant)] if created else []
        events.append(
            audit.AuditEvent("api_key.created", {"key_id": row.id, "scope": scope}, tenant_id=tenant)
        )
        audit.append(session, events, now=now)
        return {**_key_json(row), "key": plaintext}


def create_api_key(db: Database, tenant: str, scope: str) -> str:
    """A new key of ``scope`` for ``tenant`` (created if missing); returns the plaintext key."""
    key: str = issue_api_key(db, tenant, scope)["key"]
    return key


def list_api_keys(db: Database, tenant_id: str) -> dict[str, Any]:
    with db.session(readonly=True) as session:
        rows = session.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
        ).all()
        data = [_key_json(r) for r in rows]
        return {"data": data, "count": len(data)}


# Built once: the statement, its compiled form and cache key are reused by every request.
_KEYS_BY_HASH: Final = select(
    ApiKey.id, ApiKey.tenant_id, ApiKey.scope, ApiKey.key_hash, ApiKey.revoked_at
).where(ApiKey.key_hash.in_(bindparam("digests", expanding=True)))


def authenticate(db: Database, key: str) -> Principal | None:
    """The principal of a valid, unrevoked key; ``None`` otherwise."""
    return authenticate_many(db, [key]).get(key)


def authenticate_many(db: Database, keys: Iterable[str]) -> dict[str, Principal]:
    """``{key: principal}`` for those of ``keys`` that are valid and unrevoked, looked up together.

    One indexed lookup, one round trip (``Database.read_all``) that starts after this call: a
    revocation committed before it is seen.
    """
    digests = {
        hash_key(key): key for key in keys if isinstance(key, str) and key and len(key) <= MAX_KEY_LENGTH
    }
    if not digests:
        return {}
    rows = {row.key_hash: row for row in db.read_all(_KEYS_BY_HASH, {"digests": sorted(digests)})}
    found: dict[str, Principal] = {}
    for digest, key in digests.items():
        row = rows.get(digest)
        if row is not None and hmac.compare_digest(row.key_hash, digest) and row.revoked_at is None:
            found[key] = Principal(tenant_id=row.tenant_id, scope=row.scope, key_id=row.id)
    return found


def revoke_api_key(db: Database, key_id: str, *, tenant_id: str | None = None) -> dict[str, Any]:
    """Revoke a key by id (within ``tenant_id`` when given; another tenant's key is NotFound)."""
    now = utcnow()
    with db.session() as session:
        row = session.get(ApiKey, key_id)
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            raise NotFound("api key", key_id)
        if row.revoked_at is None:
            row.revoked_at = now
            session.flush()
            audit.append(
                session,
                [audit.AuditEvent("api_key.revoked", {"key_id": row.id}, tenant_id=row.tenant_id)],
                now=now,
            )
        return _key_json(row)


def ensure_bootstrap_admin_key(db: Database, key: str) -> Principal:
    """Make ``key`` a valid ``admin`` key of tenant ``default`` (idempotent; run at start-up).

    Several processes may start at once: the one that loses the race to create the tenant or the
    key finds them on its next attempt.
    """
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidInput("LEDGER_BOOTSTRAP_ADMIN_KEY", f"must be 1-{MAX_KEY_LENGTH} characters.")
    for attempt in range(3):
        try:
            return _ensure_bootstrap_admin_key(db, key)
        except Conflict:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _ensure_bootstrap_admin_key(db: Database, key: str) -> Principal:
    digest = hash_key(key)
    now = utcnow()
    with db.session() as session:
        _, created = _ensure_tenant(session, DEFAULT_TENANT, now)
        events = [audit.AuditEvent("tenant.created", {}, tenant_id=DEFAULT_TENANT)] if created else []
        row = session.scalars(select(ApiKey).where(ApiKey.key_hash == digest)).one_or_none()
        if row is None:
            row = ApiKey(
                id=f"key_{secrets.token_hex(8)}",
                tenant_id=DEFAULT_TENANT,
                key_hash=digest,
                prefix=key[:10],
                scope="admin",
                created_at=now,
                revoked_at=None,
            )
            session.add(row)
            events.append(
                audit.AuditEvent(
                    "api_key.created",
                    {"key_id": row.id, "scope": "admin", "bootstrap": True},
                    tenant_id=DEFAULT_TENANT,
                )
            )
        elif (row.tenant_id, row.scope, row.revoked_at) != (DEFAULT_TENANT, "admin", None):
            row.tenant_id, row.scope, row.revoked_at = DEFAULT_TENANT, "admin", None
            events.append(
                audit.AuditEvent(
                    "api_key.restored",
                    {"key_id": row.id, "scope": "admin", "bootstrap": True},
                    tenant_id=DEFAULT_TENANT,
                )
            )
        session.flush()
        audit.append(session, events, now=now)
        return Principal(tenant_id=DEFAULT_TENANT, scope="admin", key_id=row.id)


__all__ = [
    "DEFAULT_TENANT",
    "Principal",
    "authenticate",
    "check_scope",
    "check_tenant_id",
    "create_api_key",
    "create_tenant",
    "ensure_bootstrap_admin_key",
    "get_tenant",
    "hash_key",
    "issue_api_key",
    "list_api_keys",
    "revoke_api_key",
]
