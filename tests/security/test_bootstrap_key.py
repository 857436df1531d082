"""A revoked bootstrap admin key stays revoked (issue 12 §2).

``LEDGER_BOOTSTRAP_ADMIN_KEY`` still being set at the next start used to un-revoke the key —
possibly the very key that leaked. Now the start leaves it revoked, logs a warning and creates no
key either; a bootstrap key that is already another tenant's key, or another scope, is left as it
is. Tested through the function ``ledger serve`` calls at start (``_ensure_admin_key``) and
through a real ``ledger serve``, on both databases.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import URL

from service.commands.serve import _ensure_admin_key
from service.db.models import ApiKey, AuditEntry
from service.db.session import Database
from service.ledger import tenancy
from service.ledger.errors import InvalidInput
from service.settings import Settings
from tests.service.api.conftest import BOOTSTRAP_KEY, bearer, start_server, stop_server, url_text


def _settings(database_url: URL, bootstrap_key: str | None) -> Settings:
    return Settings(database_url=url_text(database_url), bootstrap_admin_key=bootstrap_key)


def _key_count(db: Database) -> int:
    with db.session(readonly=True) as session:
        return int(session.execute(select(func.count()).select_from(ApiKey)).scalar_one())


def test_start_up_keeps_a_revoked_bootstrap_key_revoked(
    db: Database, database_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _settings(database_url, BOOTSTRAP_KEY)
    assert _ensure_admin_key(db, settings) is None  # first start: the bootstrap key is made
    principal = tenancy.authenticate(db, BOOTSTRAP_KEY)
    assert principal is not None and (principal.tenant_id, principal.scope) == ("default", "admin")
    tenancy.revoke_api_key(db, principal.key_id)
    count = _key_count(db)

    with caplog.at_level(logging.WARNING, logger="service.ledger.tenancy"):
        new_key = _ensure_admin_key(db, settings)  # the next start, variable still set
    assert new_key is None  # no first-start key printed in its place either
    assert tenancy.authenticate(db, BOOTSTRAP_KEY) is None
    assert _key_count(db) == count
    (row,) = tenancy.list_api_keys(db, "default").data
    assert row.id == principal.key_id and row.revoked_at is not None
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert principal.key_id in warning and "stays revoked" in warning
    assert BOOTSTRAP_KEY not in caplog.text  # the log names the key's id, never the key
    with db.session(readonly=True) as session:  # and the audit log records no restoration
        restored = session.execute(
            select(func.count()).select_from(AuditEntry).where(AuditEntry.event_type == "api_key.restored")
        ).scalar_one()
    assert restored == 0


def test_a_bootstrap_key_that_is_another_tenants_key_is_left_alone(
    db: Database, database_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    chosen = "pl_chosen_viewer_key_0123456789abcdef"
    issued = tenancy.issue_api_key(db, "rival", "viewer", key=chosen)
    with caplog.at_level(logging.WARNING, logger="service.ledger.tenancy"):
        assert _ensure_admin_key(db, _settings(database_url, chosen)) is None
    principal = tenancy.authenticate(db, chosen)
    assert principal == tenancy.Principal("rival", "viewer", issued.id)  # not promoted
    assert issued.id in caplog.text and "left as it is" in caplog.text


def test_bootstrap_key_must_be_long_and_unpadded(db: Database) -> None:
    for bad in ("short-key", " pl_padded_bootstrap_key_0123456789 ", ""):
        with pytest.raises(InvalidInput) as info:
            tenancy.ensure_bootstrap_admin_key(db, bad)
        assert info.value.field == "LEDGER_BOOTSTRAP_ADMIN_KEY"
    assert _key_count(db) == 0


@pytest.mark.slow
def test_ledger_serve_says_the_bootstrap_key_stays_revoked(database_url: URL, db: Database) -> None:
    url = url_text(database_url)
    server = start_server(url)
    try:
        assert httpx.get(f"{server.base_url}/v1/datasets", headers=bearer(BOOTSTRAP_KEY)).status_code == 200
    finally:
        stop_server(server.process)
    principal = tenancy.authenticate(db, BOOTSTRAP_KEY)
    assert principal is not None
    tenancy.revoke_api_key(db, principal.key_id)

    again = start_server(url)  # LEDGER_BOOTSTRAP_ADMIN_KEY still set
    try:
        answer = httpx.get(f"{again.base_url}/v1/datasets", headers=bearer(BOOTSTRAP_KEY))
        assert answer.status_code == 401, answer.text
    finally:
        stop_server(again.process)
    output = "".join(again.output)
    assert re.search(rf"{principal.key_id}, revoked at .*stays revoked", output), output
    assert "LEDGER_API_KEY=" not in output
    assert tenancy.authenticate(db, BOOTSTRAP_KEY) is None
