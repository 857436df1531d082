"""API keys and record ids at rest and in logs: what an attacker with the database (or the logs)
learns. No mocks: real keys, real databases (SQLite file bytes included), a real ``ledger serve``.

* only HMAC-SHA256 digests of keys, under a server secret kept out of the database, are
  stored: no column of any table holds a plaintext key, its secret part, its plain SHA-256 or
  the secret; ``authenticate`` compares digests with ``hmac.compare_digest``
  (``test_key_hashing.py``: legacy SHA-256 keys, the secret's file, chosen keys);
* revocation takes effect on the very next request (``auth_cache_ttl_s`` defaults to 0);
* keys never reach the logs of ``ledger serve`` with access logs on, for good and bad requests;
* record ids are stored as HMAC-SHA256(dataset salt, id): distinctive raw ids are found in no
  text or blob column, and not in the SQLite file (or its WAL) as bytes.
"""

from __future__ import annotations

import ast
import inspect
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import select, text
from sqlalchemy.engine import URL

from service import server_secrets
from service.db.base import Base
from service.db.session import Database
from service.ledger import tenancy
from tests.service.api.conftest import ROOT, Keys, TestClient, bearer, url_text
from tests.service.api.world import sequential_budget, unique
from tests.service.live_server import free_port


def _all_stored_text(db: Database) -> str:
    """Every value of every column of every table, rendered as text (bytes hex and latin-1)."""
    parts: list[str] = []
    with db.engine.connect() as conn:
        for table in Base.metadata.sorted_tables:
            for row in conn.execute(select(table)):
                for value in row:
                    if isinstance(value, bytes | bytearray | memoryview):
                        raw = bytes(value)
                        parts.append(raw.hex())
                        parts.append(raw.decode("latin-1"))
                    elif value is not None:
                        parts.append(str(value))
    return "\n".join(parts)


def _every_table_is_read(db: Database) -> None:
    """The dump above must cover every table the database has (a new table is not skipped)."""
    with db.engine.connect() as conn:
        present = set(sa_inspect(conn).get_table_names()) - {"alembic_version"}
    assert present <= set(Base.metadata.tables), present - set(Base.metadata.tables)


def _sqlite_bytes(database_url: URL) -> bytes:
    if database_url.get_backend_name() != "sqlite" or not database_url.database:
        return b""
    path = Path(database_url.database)
    blobs = [p.read_bytes() for p in (path, Path(f"{path}-wal"), Path(f"{path}-journal")) if p.exists()]
    return b"".join(blobs)


def test_only_key_hashes_are_stored(db: Database, database_url: URL, keys: Keys) -> None:
    issued = tenancy.issue_api_key(db, "acme", "trainer")
    plaintexts = [*keys.by_tenant_scope.values(), keys.revoked, issued.key]
    stored = _all_stored_text(db)
    _every_table_is_read(db)
    raw = _sqlite_bytes(database_url)
    secret = server_secrets.key_hash_secret(db)
    assert secret.decode() not in stored and secret not in raw
    for key in plaintexts:
        secret_part = key.removeprefix(tenancy.KEY_PREFIX)
        assert secret_part not in stored
        assert secret_part.encode() not in raw
        # What is stored is the keyed digest (and the display prefix, 4 random chars), never
        # the plain SHA-256 a dump would let anyone test guesses against.
        assert tenancy.hash_key(key, secret) in stored
        assert tenancy.legacy_hash_key(key) not in stored
    with db.engine.connect() as conn:
        prefixes = [row[0] for row in conn.execute(text("SELECT prefix FROM api_keys"))]
    assert prefixes and all(len(p) == len("pl_") + 4 and p.startswith("pl_") for p in prefixes)


def test_key_comparison_is_constant_time() -> None:
    """``authenticate_many`` (``authenticate`` is its one-key case) looks the digests up by index
    and then compares with ``hmac.compare_digest`` — never ``==`` on a key or digest."""
    assert "authenticate_many" in inspect.getsource(tenancy.authenticate)
    source = inspect.getsource(tenancy.authenticate_many)
    tree = ast.parse(source)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "compare_digest"
    ]
    assert calls, "authenticate_many does not call compare_digest"
    assert any(isinstance(c.func.value, ast.Name) and c.func.value.id in ("hmac", "secrets") for c in calls)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            assert not names & {"key", "digest", "key_hash"} or "ApiKey" in names, ast.dump(node)


def test_revocation_takes_effect_on_the_next_request(client: TestClient, db: Database, keys: Keys) -> None:
    admin = bearer(keys.get("acme", "admin"))
    made = client.post("/v1/keys", json={"scope": "viewer"}, headers=admin)
    if made.status_code == 404:  # no key route over HTTP: issue it through the ledger op
        issued = tenancy.issue_api_key(db, "acme", "viewer").to_json()
    else:
        assert made.status_code in (200, 201), made.text
        issued = made.json()
    headers = bearer(issued["key"])
    for _ in range(3):
        assert client.get("/v1/datasets", headers=headers).status_code == 200
    tenancy.revoke_api_key(db, issued["id"], tenant_id="acme")
    answer = client.get("/v1/datasets", headers=headers)
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"] == "unauthorized"
    # and it stays revoked
    assert client.get("/v1/datasets", headers=headers).status_code == 401


def test_record_ids_never_reach_the_database(
    client: TestClient, db: Database, database_url: URL, keys: Keys
) -> None:
    admin = bearer(keys.get("acme", "admin"))
    marker = secrets.token_hex(6)
    raw_ids = [f"patient-{marker}-{i:04d}" for i in range(40)]
    numeric = [
        int("9" + marker[:6].translate(str.maketrans("abcdef", "123456")) + f"{i:05d}") for i in range(10)
    ]
    ds = client.post(
        "/v1/datasets", json={"name": unique("ds"), "budget": sequential_budget()}, headers=admin
    )
    assert ds.status_code == 201, ds.text
    dataset = ds.json()["id"]
    task = client.post(f"/v1/datasets/{dataset}/tasks", json={"name": unique("t")}, headers=admin)
    assert task.status_code == 201, task.text
    made = client.post(
        f"/v1/datasets/{dataset}/tasks/{task.json()['id']}/batches",
        json={
            "batches": [
                {"name": "b-text", "records": raw_ids[:20]},
                {"name": "b-more", "records": raw_ids[20:]},
                {"name": "b-int", "records": numeric},
            ]
        },
        headers=admin,
    )
    assert made.status_code == 201, made.text
    # a refused overlap names the record in the answer, but must not store it either
    again = client.post(
        f"/v1/datasets/{dataset}/tasks/{task.json()['id']}/batches",
        json={"batches": [{"name": "dup", "records": [raw_ids[3]]}]},
        headers=admin,
    )
    assert again.status_code == 409, again.text
    stored = _all_stored_text(db)
    _every_table_is_read(db)
    raw = _sqlite_bytes(database_url)
    assert marker not in stored
    assert marker.encode() not in raw
    for record in numeric:
        assert str(record) not in stored
        assert str(record).encode() not in raw
    with db.engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM batch_records")).scalar_one()
    assert count == len(raw_ids) + len(numeric)


@pytest.mark.slow
def test_keys_never_appear_in_serve_logs(database_url: URL, db: Database) -> None:
    """A real ``ledger serve`` with access logs at info: good, refused and malformed requests;
    neither a key nor its secret part reaches stdout/stderr."""
    good = tenancy.issue_api_key(db, "acme", "viewer")
    revoked = tenancy.issue_api_key(db, "acme", "admin")
    tenancy.revoke_api_key(db, revoked.id)
    unknown = tenancy.KEY_PREFIX + secrets.token_urlsafe(32)
    bootstrap = "pl_" + secrets.token_urlsafe(32)
    # (tests.service.api.conftest.start_server passes --no-access-log: start it here instead.)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_") or k == "LEDGER_HOME"}
    env["PYTHONUNBUFFERED"] = "1"
    env["LEDGER_BOOTSTRAP_ADMIN_KEY"] = bootstrap
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--port",
            str(port),
            "--database-url",
            url_text(database_url),
            "--no-worker",
            "--log-level",
            "debug",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    output: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "".join(output)
            time.sleep(0.1)
        with httpx.Client(base_url=base, timeout=10) as http:
            statuses = []
            for key in (good.key, revoked.key, unknown, bootstrap):
                statuses.append(http.get("/v1/datasets", headers=bearer(key)).status_code)
                # the key in the query string and in a bad scheme: still not logged
                statuses.append(http.get(f"/v1/datasets?api_key={key}", headers=bearer(key)).status_code)
                basic = {"Authorization": f"Basic {key}"}
                statuses.append(http.get("/v1/datasets", headers=basic).status_code)
                statuses.append(http.get("/v1/datasets", headers={"Authorization": key}).status_code)
                statuses.append(
                    http.post("/v1/datasets", content=b"{bad json", headers=bearer(key)).status_code
                )
                statuses.append(http.get("/v1/datasets/ds_nope", headers=bearer(key)).status_code)
        assert 200 in statuses and 401 in statuses
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        reader.join(timeout=5)
    logs = "".join(output)
    assert "GET /v1/datasets" in logs, "access log is not on: the test would prove nothing"
    for key in (good.key, revoked.key, unknown, bootstrap):
        secret_part = key.removeprefix(tenancy.KEY_PREFIX)
        assert secret_part[:16] not in logs, f"a key leaked into the logs:\n{logs[-3000:]}"
