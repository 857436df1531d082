"""Tenants and API keys.

A key belongs to one tenant and carries one scope: ``admin`` (everything in the tenant),
``trainer`` (reserve, commit, abort, jobs, reads), ``viewer`` (reads). Only
``HMAC-SHA256(server secret, key)`` is stored (``service.server_secrets``): a database dump
alone lets nobody test a guessed key, generated or chosen. ``authenticate`` looks the digest up
(a unique index: one indexed query for a whole batch of requests, DESIGN-NOTES 5 — which is why
the hash is a keyed *fast* hash and not a slow one) and compares it in constant time. Generated
keys are ``pl_`` + 43 URL-safe characters (256 random bits); a chosen key (the bootstrap key)
must have at least ``MIN_KEY_LENGTH`` characters, and the secret is what protects it at rest.
Keys stored before HMAC (``hash_scheme`` ``sha256``) still authenticate and are rehashed at
their first successful use. The stored display ``prefix`` is ``pl_`` + 4 characters (nothing of
a chosen key). A tenant id is a short slug (``default``, ``team-a``); tenant ``default`` holds
the bootstrap admin key (``LEDGER_BOOTSTRAP_ADMIN_KEY``), which a revocation disables for good.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from service import server_secrets
from service.db.base import utcnow
from service.db.models import SCOPES, ApiKey, Tenant
from service.db.session import Database
from service.ledger import audit
from service.ledger.errors import Conflict, InvalidInput, NotFound
from service.settings import MIN_KEY_LENGTH

logger = logging.getLogger("service.ledger.tenancy")

DEFAULT_TENANT: Final = "default"
KEY_PREFIX: Final = "pl_"
MAX_KEY_LENGTH: Final = 512
# Characters of a generated key kept after ``pl_`` to show it to a human: 4 of its 43 random
# characters (24 of 256 bits), enough to tell a tenant's keys apart, no help to a guesser.
DISPLAY_CHARS: Final = 4
HMAC_SCHEME: Final = "hmac-sha256"
LEGACY_SCHEME: Final = "sha256"
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


def hash_key(key: str, secret: bytes) -> str:
    """``HMAC-SHA256(secret, key)``, hex: what is stored for a key (``hash_scheme`` hmac-sha256)."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def legacy_hash_key(key: str) -> str:
    """Plain ``SHA-256(key)``, hex: how keys were stored before HMAC (``hash_scheme`` sha256)."""
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    """What is stored to show ``key`` to a human: ``pl_`` + 4 characters of a generated key;
    nothing of a chosen key, whose first characters may be half of a human-made secret."""
    if key.startswith(KEY_PREFIX):
        return key[: len(KEY_PREFIX) + DISPLAY_CHARS]
    return ""


def _hash_columns(key: str, secret: bytes) -> dict[str, str]:
    return {
        "key_hash": hash_key(key, secret),
        "hash_scheme": HMAC_SCHEME,
        "secret_id": server_secrets.secret_id(secret),
    }


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


@dataclass(frozen=True, slots=True)
class TenantAnswer:
    """A tenant as ``create_tenant`` answers it."""

    id: str
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "created_at": self.created_at.isoformat()}


@dataclass(frozen=True, slots=True)
class ApiKeyAnswer:
    """A key as the key operations answer it: never its plaintext, which is not stored (only
    ``prefix``, what is shown to a human; ``display_prefix``)."""

    id: str
    tenant_id: str
    scope: str
    prefix: str
    hash_scheme: str
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, row: ApiKey) -> ApiKeyAnswer:
        return cls(*_key_fields(row))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant_id": self.tenant_id,
            "scope": self.scope,
            "prefix": self.prefix,
            "hash_scheme": self.hash_scheme,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }


def _key_fields(row: ApiKey) -> tuple[str, str, str, str, str, datetime, datetime | None]:
    return (row.id, row.tenant_id, row.scope, row.prefix, row.hash_scheme, row.created_at, row.revoked_at)


@dataclass(frozen=True, slots=True)
class IssuedApiKey(ApiKeyAnswer):
    """A key just issued, with its plaintext ``key``: in this answer only (the database keeps
    its hash), and kept out of ``repr``."""

    key: str = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {**ApiKeyAnswer.to_json(self), "key": self.key}


@dataclass(frozen=True, slots=True)
class ApiKeysPage:
    """A tenant's keys (``list_api_keys``), oldest first, and how many they are."""

    data: tuple[ApiKeyAnswer, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [k.to_json() for k in self.data], "count": self.count}


def _ensure_tenant(session: Session, tenant_id: str, now: datetime) -> tuple[Tenant, bool]:
    tenant = session.get(Tenant, tenant_id)
    if tenant is not None:
        return tenant, False
    tenant = Tenant(id=tenant_id, created_at=now)
    session.add(tenant)
    session.flush()
    return tenant, True


def create_tenant(db: Database, tenant_id: str) -> TenantAnswer:
    """Create a tenant; ``Conflict`` (``tenant_exists``) if it exists."""
    check_tenant_id(tenant_id)
    now = utcnow()
    with db.session() as session:
        tenant = Tenant(id=tenant_id, created_at=now)
        session.add(tenant)
        session.flush()
        audit.append(session, [audit.AuditEvent("tenant.created", {}, tenant_id=tenant_id)], now=now)
        return TenantAnswer(tenant.id, tenant.created_at)


def issue_api_key(db: Database, tenant: str, scope: str, *, key: str | None = None) -> IssuedApiKey:
    """Create a key for ``tenant`` (created if missing), generated or the chosen ``key``.

    The plaintext ``key`` is in this answer only; the database keeps its hash.
    """
    check_tenant_id(tenant)
    check_scope(scope)
    if key is not None:
        check_chosen_key(key, "key")
    plaintext = key if key is not None else KEY_PREFIX + secrets.token_urlsafe(32)
    secret = server_secrets.key_hash_secret(db)
    now = utcnow()
    with db.session() as session:
        _, created = _ensure_tenant(session, tenant, now)
        row = ApiKey(
            id=f"key_{secrets.token_hex(8)}",
            tenant_id=tenant,
            **_hash_columns(plaintext, secret),
            prefix=display_prefix(plaintext),
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
        return IssuedApiKey(*_key_fields(row), plaintext)


def create_api_key(db: Database, tenant: str, scope: str) -> str:
    """A new key of ``scope`` for ``tenant`` (created if missing); returns the plaintext key."""
    return issue_api_key(db, tenant, scope).key


def list_api_keys(db: Database, tenant_id: str) -> ApiKeysPage:
    """The tenant's keys, oldest first (revoked ones too; never a plaintext)."""
    with db.session(readonly=True) as session:
        rows = session.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at)
        ).all()
        return ApiKeysPage(tuple(ApiKeyAnswer.of(r) for r in rows), len(rows))


def check_chosen_key(key: object, field: str) -> str:
    """A key a person chose: ``MIN_KEY_LENGTH``-``MAX_KEY_LENGTH`` characters, no surrounding
    whitespace (a header carrying it would be stripped, and the key would never match)."""
    if not isinstance(key, str) or not MIN_KEY_LENGTH <= len(key) <= MAX_KEY_LENGTH:
        length = len(key) if isinstance(key, str) else type(key).__name__
        raise InvalidInput(
            field, f"must be {MIN_KEY_LENGTH}-{MAX_KEY_LENGTH} characters. Found length {length}."
        )
    if key != key.strip():
        raise InvalidInput(field, "must not begin or end with whitespace.")
    return key


# Built once: the statement, its compiled form and cache key are reused by every request.
_KEYS_BY_HASH: Final = select(
    ApiKey.id, ApiKey.tenant_id, ApiKey.scope, ApiKey.key_hash, ApiKey.hash_scheme, ApiKey.revoked_at
).where(ApiKey.key_hash.in_(bindparam("digests", expanding=True)))


def authenticate(db: Database, key: str) -> Principal | None:
    """The principal of a valid, unrevoked key; ``None`` otherwise."""
    return authenticate_many(db, [key]).get(key)


def authenticate_many(db: Database, keys: Iterable[str]) -> dict[str, Principal]:
    """``{key: principal}`` for those of ``keys`` that are valid and unrevoked, looked up together.

    One indexed lookup, one round trip (``Database.read_all``) that starts after this call: a
    revocation committed before it is seen. Each key is looked up by its HMAC digest and by its
    legacy SHA-256 digest in that one query; a row matches only the digest of its own
    ``hash_scheme``. A legacy row that matched is rehashed with HMAC (``_rehash``).
    """
    secret = server_secrets.key_hash_secret(db)
    wanted: dict[str, tuple[str, str]] = {}  # digest -> (key, scheme it stands for)
    for key in keys:
        if isinstance(key, str) and key and len(key) <= MAX_KEY_LENGTH:
            wanted[hash_key(key, secret)] = (key, HMAC_SCHEME)
            wanted[legacy_hash_key(key)] = (key, LEGACY_SCHEME)
    if not wanted:
        return {}
    rows = {row.key_hash: row for row in db.read_all(_KEYS_BY_HASH, {"digests": sorted(wanted)})}
    found: dict[str, Principal] = {}
    revoked: set[str] = set()
    legacy: dict[str, tuple[str, str, str]] = {}  # key -> (key id, its SHA-256 digest, the key)
    for digest, (key, scheme) in wanted.items():
        row = rows.get(digest)
        if row is None or row.hash_scheme != scheme or not hmac.compare_digest(row.key_hash, digest):
            continue
        if row.revoked_at is not None:
            revoked.add(key)  # a key stored twice (both schemes) is refused if either is revoked
            continue
        found[key] = Principal(tenant_id=row.tenant_id, scope=row.scope, key_id=row.id)
        if scheme == LEGACY_SCHEME:
            legacy[key] = (row.id, row.key_hash, key)
    for key in revoked:
        found.pop(key, None)
        legacy.pop(key, None)
    if legacy:
        _rehash(db, list(legacy.values()), secret)
    return found


def _rehash(db: Database, legacy: list[tuple[str, str, str]], secret: bytes) -> None:
    """Store HMAC digests for legacy (SHA-256) keys that just authenticated.

    Conditional on the row still holding the SHA-256 digest, so concurrent requests with the
    same key rehash it once. A failure is logged and changes nothing: the key keeps working
    (it was just proven valid) and is rehashed at a later use.
    """
    try:
        with db.session() as session:
            for key_id, old_digest, key in legacy:
                session.execute(
                    update(ApiKey)
                    .where(
                        ApiKey.id == key_id,
                        ApiKey.key_hash == old_digest,
                        ApiKey.hash_scheme == LEGACY_SCHEME,
                    )
                    .values(**_hash_columns(key, secret), prefix=display_prefix(key))
                )
    except Exception:  # the answer (authenticated) stands; only the upgrade is deferred
        logger.exception("could not rehash %d legacy API key(s) with HMAC; will retry", len(legacy))


def check_key_hash_secret(db: Database) -> None:
    """Refuse to run with a key-hash secret that none of the stored HMAC keys was hashed with.

    Keys hashed with another secret (another user's data folder, a lost or replaced secret
    file, a different ``LEDGER_KEY_HASH_SECRET``) can never authenticate here: say so at start,
    instead of answering 401 to every key. Keys under several secrets (some match) only warn.
    """
    current = server_secrets.secret_id(server_secrets.key_hash_secret(db))
    with db.session(readonly=True) as session:
        counts = dict(
            session.execute(
                select(ApiKey.secret_id, func.count())
                .where(ApiKey.hash_scheme == HMAC_SCHEME, ApiKey.revoked_at.is_(None))
                .group_by(ApiKey.secret_id)
            ).all()
        )
    others = sum(n for sid, n in counts.items() if sid != current)
    if not others:
        return
    message = (
        f"{others} API key(s) in this database were hashed with another key-hash secret than this "
        f"process's (secret id {current}; theirs: {sorted(str(s) for s in counts if s != current)}), "
        "so they cannot authenticate here. Give every ledger process the same LEDGER_KEY_HASH_SECRET "
        "or LEDGER_SECRETS_DIR (service/server_secrets.py)."
    )
    if current not in counts:
        raise server_secrets.SecretError(message)
    logger.warning("%s", message)


def revoke_api_key(db: Database, key_id: str, *, tenant_id: str | None = None) -> ApiKeyAnswer:
    """Revoke a key by id (within ``tenant_id`` when given; another tenant's key is NotFound);
    the key as revoked (revoking it again changes nothing and answers the same)."""
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
        return ApiKeyAnswer.of(row)


def ensure_bootstrap_admin_key(db: Database, key: str) -> Principal | None:
    """Make sure ``key`` exists as an ``admin`` key of tenant ``default`` (idempotent; run at
    start-up); its principal, or ``None`` when the key exists but may not be that.

    A key that was revoked stays revoked: the variable still being set at the next start is no
    consent to undo a revocation (it may be exactly the leaked key). A key that already exists
    with another tenant or scope is left as it is (making it ``default``'s admin would hand
    more to whoever holds it). Both are logged as warnings and create nothing.

    Several processes may start at once: the one that loses the race to create the tenant or the
    key finds them on its next attempt.
    """
    check_chosen_key(key, "LEDGER_BOOTSTRAP_ADMIN_KEY")
    for attempt in range(3):
        try:
            return _ensure_bootstrap_admin_key(db, key)
        except Conflict:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _ensure_bootstrap_admin_key(db: Database, key: str) -> Principal | None:
    secret = server_secrets.key_hash_secret(db)
    digests = {hash_key(key, secret): HMAC_SCHEME, legacy_hash_key(key): LEGACY_SCHEME}
    now = utcnow()
    with db.session() as session:
        rows = session.scalars(select(ApiKey).where(ApiKey.key_hash.in_(sorted(digests)))).all()
        row = next((r for r in rows if digests.get(r.key_hash) == r.hash_scheme), None)
        if row is not None and row.revoked_at is not None:
            logger.warning(
                "LEDGER_BOOTSTRAP_ADMIN_KEY is the API key %s, revoked at %s: it stays revoked and no "
                "key is created. Unset the variable, or set it to a new key.",
                row.id,
                row.revoked_at.isoformat(),
            )
            return None
        if row is not None and (row.tenant_id, row.scope) != (DEFAULT_TENANT, "admin"):
            logger.warning(
                "LEDGER_BOOTSTRAP_ADMIN_KEY is the API key %s of tenant %r with scope %r: it is left "
                "as it is and no key is created. Set the variable to a key of its own.",
                row.id,
                row.tenant_id,
                row.scope,
            )
            return None
        _, created = _ensure_tenant(session, DEFAULT_TENANT, now)
        events = [audit.AuditEvent("tenant.created", {}, tenant_id=DEFAULT_TENANT)] if created else []
        if row is None:
            row = ApiKey(
                id=f"key_{secrets.token_hex(8)}",
                tenant_id=DEFAULT_TENANT,
                **_hash_columns(key, secret),
                prefix=display_prefix(key),
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
        elif row.hash_scheme == LEGACY_SCHEME:  # the key is proven here: rehash it now
            for column, value in {**_hash_columns(key, secret), "prefix": display_prefix(key)}.items():
                setattr(row, column, value)
        session.flush()
        audit.append(session, events, now=now)
        return Principal(tenant_id=DEFAULT_TENANT, scope="admin", key_id=row.id)


__all__ = [
    "DEFAULT_TENANT",
    "ApiKeyAnswer",
    "ApiKeysPage",
    "IssuedApiKey",
    "Principal",
    "TenantAnswer",
    "authenticate",
    "authenticate_many",
    "check_chosen_key",
    "check_key_hash_secret",
    "check_scope",
    "check_tenant_id",
    "create_api_key",
    "create_tenant",
    "display_prefix",
    "ensure_bootstrap_admin_key",
    "hash_key",
    "issue_api_key",
    "legacy_hash_key",
    "list_api_keys",
    "revoke_api_key",
]
