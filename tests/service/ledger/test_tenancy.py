"""Tenants and API keys: only keyed hashes stored, scopes, revocation, the bootstrap key."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from service import server_secrets
from service.db.models import ApiKey
from service.db.session import Database
from service.ledger import tenancy
from service.ledger.errors import Conflict, InvalidInput, NotFound


def test_key_is_stored_as_hash_only_and_authenticates(db: Database) -> None:
    key = tenancy.create_api_key(db, "team-a", "trainer")
    principal = tenancy.authenticate(db, key)
    assert principal is not None
    assert (principal.tenant_id, principal.scope) == ("team-a", "trainer")
    with db.session(readonly=True) as session:
        stored = session.scalars(select(ApiKey)).one()
        assert key not in (stored.key_hash, stored.prefix, stored.id)
        secret = server_secrets.key_hash_secret(db)
        assert stored.key_hash == tenancy.hash_key(key, secret) != tenancy.legacy_hash_key(key)
        assert (stored.hash_scheme, stored.secret_id) == ("hmac-sha256", server_secrets.secret_id(secret))
        assert stored.prefix == key[:7] and stored.prefix.startswith("pl_")
    assert tenancy.authenticate(db, key + "x") is None
    assert tenancy.authenticate(db, "") is None


def test_revoked_key_no_longer_authenticates(db: Database) -> None:
    issued = tenancy.issue_api_key(db, "team-a", "viewer")
    tenancy.revoke_api_key(db, issued.id, tenant_id="team-a")
    assert tenancy.authenticate(db, issued.key) is None
    with pytest.raises(NotFound):
        tenancy.revoke_api_key(db, issued.id, tenant_id="team-b")


def test_bootstrap_key_is_admin_of_default_and_idempotent(db: Database) -> None:
    key = "bootstrap-key-0123456789abcdef"
    first = tenancy.ensure_bootstrap_admin_key(db, key)
    second = tenancy.ensure_bootstrap_admin_key(db, key)
    assert first == second
    assert tenancy.authenticate(db, key) == first
    assert (first.tenant_id, first.scope) == ("default", "admin")
    tenancy.revoke_api_key(db, first.key_id)
    assert tenancy.authenticate(db, key) is None
    # A revoked bootstrap key stays revoked at the next start (issue 12 §2).
    assert tenancy.ensure_bootstrap_admin_key(db, key) is None
    assert tenancy.authenticate(db, key) is None
    assert len(tenancy.list_api_keys(db, "default").data) == 1


def test_scopes_and_tenant_ids_are_validated(db: Database) -> None:
    with pytest.raises(InvalidInput) as info:
        tenancy.create_api_key(db, "team-a", "root")
    assert info.value.field == "scope"
    with pytest.raises(InvalidInput) as info:
        tenancy.create_api_key(db, "Team A", "admin")
    assert info.value.field == "tenant"
    tenancy.create_tenant(db, "team-c")
    with pytest.raises(Conflict):
        tenancy.create_tenant(db, "team-c")


def test_scope_order() -> None:
    admin = tenancy.Principal("t", "admin", "k")
    viewer = tenancy.Principal("t", "viewer", "k")
    assert admin.allows("trainer") and admin.allows("viewer")
    assert viewer.allows("viewer") and not viewer.allows("trainer")


def test_concurrent_bootstrap_from_several_processes(db: Database) -> None:
    key = "bootstrap-key-concurrent-0123456789"
    others = [Database(db.url) for _ in range(3)]
    errors: list[BaseException] = []

    def run(database: Database) -> None:
        try:
            tenancy.ensure_bootstrap_admin_key(database, key)
        except BaseException as exc:  # collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in [db, *others]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for other in others:
        other.dispose()
    assert not errors
    principal = tenancy.authenticate(db, key)
    assert principal is not None and principal.scope == "admin"
    assert len(tenancy.list_api_keys(db, "default").data) == 1
