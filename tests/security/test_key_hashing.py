"""API keys at rest: HMAC-SHA256 under a server secret kept out of the database (issue 12 §2).

Before: ``SHA-256(key)`` and a 10-character plaintext prefix, so a database dump alone let anyone
test guesses of a chosen key. Now (``service.server_secrets``, ``service.ledger.tenancy``):

* the digest is keyed with a secret that lives in ``LEDGER_KEY_HASH_SECRET`` or a 0600 file
  (beside a SQLite database by default), never in the database;
* keys stored before (``sha256``) keep working, through the real migration, and are rehashed
  with HMAC at their first successful use; a revoked one stays refused and is not rehashed;
* the stored prefix is ``pl_`` + 4 characters (nothing of a chosen key);
* a process with another secret refuses to start (``ledger serve``, ``ledger keys create``)
  instead of answering 401 to every key;
* the batched lookup is still one indexed query for many keys (DESIGN-NOTES 5).
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import event, text
from sqlalchemy.engine import URL

from service import server_secrets
from service.db import migrations
from service.db.session import Database
from service.ledger import tenancy
from service.ledger.errors import InvalidInput
from service.settings import Settings
from tests.service.api.conftest import ROOT, free_port, url_text

BEFORE_HMAC = "c4a1d2e3f501"  # the revision before 2026_11_25_api_key_hmac


def _rows(db: Database) -> dict[str, Any]:
    with db.engine.connect() as conn:
        rows = conn.execute(text("SELECT id, key_hash, hash_scheme, secret_id, prefix FROM api_keys"))
        return {row.id: row for row in rows}


def _insert_legacy_key(url: URL, key_id: str, tenant: str, key: str, *, revoked: bool = False) -> None:
    """A key as the code before HMAC stored it: plain SHA-256 and a 10-character prefix."""
    database = Database(url)
    try:
        with database.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, created_at) SELECT CAST(:t AS VARCHAR(64)), CURRENT_TIMESTAMP "
                    "WHERE NOT EXISTS (SELECT 1 FROM tenants WHERE id = CAST(:t AS VARCHAR(64)))"
                ),
                {"t": tenant},
            )
            conn.execute(
                text(
                    "INSERT INTO api_keys (id, tenant_id, key_hash, prefix, scope, created_at, revoked_at) "
                    "VALUES (:id, :t, :h, :p, 'admin', CURRENT_TIMESTAMP, "
                    + ("CURRENT_TIMESTAMP)" if revoked else "NULL)")
                ),
                {"id": key_id, "t": tenant, "h": hashlib.sha256(key.encode()).hexdigest(), "p": key[:10]},
            )
    finally:
        database.dispose()


@pytest.mark.slow
def test_keys_stored_before_hmac_keep_working_and_are_rehashed(empty_database_url: URL) -> None:
    url = empty_database_url
    migrations.upgrade(url, BEFORE_HMAC)
    generated = tenancy.KEY_PREFIX + "LegacyGeneratedKey0123456789abcdefghijklmno"
    chosen = "our-team-admin-password-2024!"
    revoked = tenancy.KEY_PREFIX + "LegacyRevokedKey0123456789abcdefghijklmnopq"
    _insert_legacy_key(url, "key_generated", "acme", generated)
    _insert_legacy_key(url, "key_chosen", "acme", chosen)
    _insert_legacy_key(url, "key_revoked", "acme", revoked, revoked=True)
    migrations.upgrade(url)

    db = Database(url)
    try:
        before = _rows(db)
        assert {r.hash_scheme for r in before.values()} == {"sha256"}
        # the migration cut the plaintext prefixes: pl_ + 4 characters, nothing of a chosen key
        assert before["key_generated"].prefix == generated[:7]
        assert before["key_chosen"].prefix == ""
        assert before["key_revoked"].prefix == revoked[:7]

        found = tenancy.authenticate_many(db, [generated, chosen, revoked])
        assert set(found) == {generated, chosen}
        assert found[generated].key_id == "key_generated" and found[generated].scope == "admin"

        secret = server_secrets.key_hash_secret(db)
        after = _rows(db)
        for key_id, key in (("key_generated", generated), ("key_chosen", chosen)):
            row = after[key_id]
            assert (row.hash_scheme, row.key_hash) == ("hmac-sha256", tenancy.hash_key(key, secret))
            assert row.secret_id == server_secrets.secret_id(secret)
        # the revoked key is neither accepted nor touched
        assert after["key_revoked"].hash_scheme == "sha256"
        assert after["key_revoked"].key_hash == tenancy.legacy_hash_key(revoked)
        # the plain SHA-256 of the rehashed keys is gone from the database
        dump = " ".join(str(v) for row in after.values() for v in row)
        assert tenancy.legacy_hash_key(generated) not in dump
        assert tenancy.legacy_hash_key(chosen) not in dump
        # ... and they authenticate by their HMAC digest from now on
        assert tenancy.authenticate(db, generated) == found[generated]
        assert tenancy.authenticate(db, chosen) == found[chosen]
        assert tenancy.authenticate(db, revoked) is None
        listed = {k.id: k for k in tenancy.list_api_keys(db, "acme").data}
        assert listed["key_revoked"].hash_scheme == "sha256"  # the operator sees what is left
    finally:
        db.dispose()

    migrations.downgrade(url, BEFORE_HMAC)  # reversible (a rehashed key then fails closed)
    migrations.upgrade(url)


def test_a_legacy_digest_never_stands_for_an_hmac_row(db: Database) -> None:
    """A row's digest is compared under its own scheme only: an HMAC row whose digest happens
    to equal some key's plain SHA-256 (here: written so on purpose) does not let that key in."""
    issued = tenancy.issue_api_key(db, "acme", "viewer")
    other = tenancy.KEY_PREFIX + "SomeoneElsesKey0123456789abcdefghijklmnopqr"
    with db.engine.begin() as conn:
        conn.execute(
            text("UPDATE api_keys SET key_hash = :h WHERE id = :i"),
            {"h": tenancy.legacy_hash_key(other), "i": issued.id},
        )
    assert tenancy.authenticate(db, other) is None


def test_the_secret_file_is_private_stable_and_made_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    migrations.upgrade(url)
    databases = [Database(url) for _ in range(6)]
    secrets_seen: list[bytes] = []
    start = threading.Barrier(len(databases))

    def resolve(database: Database) -> None:
        start.wait()
        secrets_seen.append(server_secrets.key_hash_secret(database))

    threads = [threading.Thread(target=resolve, args=(d,)) for d in databases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        path = tmp_path / server_secrets.KEY_HASH_SECRET_FILE
        assert len(set(secrets_seen)) == 1 and len(secrets_seen) == len(databases)
        assert path.read_text().strip().encode() == secrets_seen[0]
        assert len(secrets_seen[0]) == 64  # 32 random bytes, hex
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir() if "secret" in p.name) == [path.name]  # no temp
        key = tenancy.create_api_key(databases[0], "acme", "admin")
        assert tenancy.authenticate(databases[-1], key) is not None
        # the database itself holds neither the secret nor anything that tests a guess
        raw = (tmp_path / "ledger.db").read_bytes() + b"".join(
            p.read_bytes() for p in tmp_path.glob("ledger.db-*")
        )
        assert secrets_seen[0] not in raw
        assert tenancy.legacy_hash_key(key).encode() not in raw
    finally:
        for database in databases:
            database.dispose()


def test_a_damaged_secret_file_is_an_error_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / server_secrets.KEY_HASH_SECRET_FILE
    path.write_text("too-short\n")
    settings = Settings(secrets_dir=tmp_path)
    with pytest.raises(server_secrets.SecretError, match=str(path)):
        server_secrets.load_key_hash_secret(settings, "sqlite:///elsewhere/ledger.db")
    assert path.read_text() == "too-short\n"


def test_the_secret_setting_wins_and_must_be_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="LEDGER_KEY_HASH_SECRET must be at least 32"):
        Settings(key_hash_secret="x" * 31)
    chosen = "s" * 40
    monkeypatch.setenv("LEDGER_KEY_HASH_SECRET", chosen)
    loaded = server_secrets.load_key_hash_secret(Settings(), f"sqlite:///{tmp_path}/ledger.db")
    assert loaded == chosen.encode()
    assert not (tmp_path / server_secrets.KEY_HASH_SECRET_FILE).exists()  # no file made then
    # a server database without the setting: the user's data folder (never the database)
    monkeypatch.delenv("LEDGER_HOME", raising=False)
    assert server_secrets.default_secrets_dir("postgresql+psycopg://u@h/db").name == "privacy-ledger"
    assert server_secrets.default_secrets_dir(f"sqlite:///{tmp_path}/x/l.db") == (tmp_path / "x").resolve()


@pytest.mark.slow
def test_a_process_with_another_secret_refuses_to_start(database_url: URL, db: Database) -> None:
    url = url_text(database_url)
    key = tenancy.create_api_key(db, "acme", "admin")  # hashed under this process's secret
    other = Database(database_url)
    try:
        server_secrets.configure(other, Settings(key_hash_secret="another-secret-" + "0" * 32))
        assert tenancy.authenticate(other, key) is None  # what would happen without the check
        with pytest.raises(server_secrets.SecretError, match="another key-hash secret"):
            tenancy.check_key_hash_secret(other)
    finally:
        other.dispose()
    tenancy.check_key_hash_secret(db)  # the right secret passes

    env = {**os.environ, "LEDGER_KEY_HASH_SECRET": "another-secret-" + "0" * 32}
    env.pop("LEDGER_BOOTSTRAP_ADMIN_KEY", None)

    def ledger(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "service.cli", *args, "--database-url", url]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    made = ledger("keys", "create", "--tenant", "acme", "--scope", "viewer")
    assert made.returncode == 2 and "LEDGER_KEY_HASH_SECRET" in made.stderr, made.stderr
    served = ledger("serve", "--port", str(free_port()), "--no-worker")
    assert served.returncode == 2 and "another key-hash secret" in served.stderr, served.stderr
    assert len(tenancy.list_api_keys(db, "acme").data) == 1  # nothing was made
    assert tenancy.authenticate(db, key) is not None


def test_chosen_keys_are_long_and_show_nothing(db: Database) -> None:
    with pytest.raises(InvalidInput) as info:
        tenancy.issue_api_key(db, "acme", "admin", key="pl_short")
    assert info.value.field == "key" and "24" in info.value.message
    chosen = tenancy.issue_api_key(db, "acme", "admin", key="correct-horse-battery-staple-42")
    assert chosen.prefix == ""
    generated = tenancy.issue_api_key(db, "acme", "admin")
    assert generated.prefix == generated.key[:7]
    assert tenancy.authenticate(db, "correct-horse-battery-staple-42") is not None


def test_many_keys_are_still_looked_up_in_one_query(db: Database) -> None:
    keys = [tenancy.create_api_key(db, f"t{i % 3}", "viewer") for i in range(12)]
    unknown = [tenancy.KEY_PREFIX + f"unknown{i:040d}" for i in range(4)]
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "api_keys" in statement:
            statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        found = tenancy.authenticate_many(db, [*keys, *unknown])
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    assert set(found) == set(keys)
    assert len(statements) == 1, statements  # one indexed lookup, no rehash write (none legacy)
