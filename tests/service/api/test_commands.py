"""The ``ledger`` commands of the service: ``serve`` (migrates, prints a first admin key and the
URL), ``keys create`` / ``keys revoke``, ``verify`` (exit codes), ``migrate``."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL

from service.db import migrations
from service.db.session import Database
from service.ledger import tenancy
from tests.service.api.conftest import ROOT, TestClient, bearer, start_server, stop_server, url_text
from tests.service.api.world import make_world


def ledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _wait_for(output: list[str], pattern: str, timeout_s: float = 10.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, "".join(output))
        if match:
            return match
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} not in the output:\n{''.join(output)}")


@pytest.mark.slow
def test_serve_migrates_and_prints_a_first_admin_key_and_the_url(
    empty_database_url: URL,
) -> None:
    url = url_text(empty_database_url)
    server = start_server(url, bootstrap_key=None)
    try:
        shown = _wait_for(server.output, r"serving HTTP API v1 at (http://\S+)").group(1)
        assert shown == server.base_url
        # where the state lives, said at start (issue 28 §3); a PostgreSQL password never shown
        _wait_for(server.output, r"ledger home: \S+\s+\(LEDGER_HOME or --home\)\s+database:\s+\S+")
        if empty_database_url.password:
            assert empty_database_url.password not in "".join(server.output)
        key = _wait_for(server.output, r"LEDGER_API_KEY=(\S+)").group(1)
        headers = bearer(key)
        created = httpx.post(
            f"{shown}/v1/datasets",
            headers=headers,
            json={
                "name": "first",
                "budget": {"rule": "lifelong", "epsilon": 1, "delta": 0, "accountant": "basic"},
            },
        )
        assert created.status_code == 201, created.text
        assert httpx.get(f"{shown}/v1/datasets", headers=headers).json()["count"] == 1
    finally:
        stop_server(server.process)
    assert migrations.is_up_to_date(url)

    # A second start finds the admin key and prints none.
    again = start_server(url, bootstrap_key=None)
    try:
        _wait_for(again.output, r"serving HTTP API v1 at")
        assert "LEDGER_API_KEY=" not in "".join(again.output)
    finally:
        stop_server(again.process)


@pytest.mark.slow
def test_serve_with_a_bootstrap_key_and_several_workers(database_url: URL) -> None:
    server = start_server(url_text(database_url), extra_args=("--workers", "2"))
    try:
        assert "LEDGER_API_KEY=" not in "".join(server.output)
        headers = bearer(server.admin_key)
        for _ in range(4):  # the requests spread over both processes
            answer = httpx.get(f"{server.base_url}/v1/datasets", headers=headers)
            assert answer.status_code == 200, answer.text
    finally:
        stop_server(server.process)


@pytest.mark.slow
def test_keys_create_then_use_then_revoke(database_url: URL, client: TestClient) -> None:
    url = url_text(database_url)
    made = ledger("keys", "create", "--tenant", "team-a", "--scope", "trainer", "--database-url", url)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("pl_") and "\n" not in key
    assert "shown once" in made.stderr
    headers = bearer(key)
    assert client.get("/v1/datasets", headers=headers).status_code == 200
    assert client.post("/v1/datasets", headers=headers, json={}).status_code == 403

    record = ledger(
        "keys", "create", "--tenant", "team-a", "--scope", "viewer", "--json", "--database-url", url
    )
    viewer = json.loads(record.stdout)
    assert viewer["scope"] == "viewer" and viewer["tenant_id"] == "team-a"
    listed = json.loads(ledger("keys", "list", "--tenant", "team-a", "--database-url", url).stdout)
    assert listed["count"] == 2 and all("key" not in k for k in listed["data"])

    revoked = ledger("keys", "revoke", viewer["id"], "--database-url", url)
    assert revoked.returncode == 0, revoked.stderr
    assert client.get("/v1/datasets", headers=bearer(viewer["key"])).status_code == 401
    assert client.get("/v1/datasets", headers=headers).status_code == 200
    assert ledger("keys", "revoke", "key_nope", "--database-url", url).returncode == 1
    bad = ledger("keys", "create", "--tenant", "Bad Tenant!", "--scope", "admin", "--database-url", url)
    assert bad.returncode == 2 and "tenant" in bad.stderr


@pytest.mark.slow
def test_verify_exit_codes(database_url: URL, db: Database) -> None:
    url = url_text(database_url)
    tenancy.create_tenant(db, "acme")
    make_world(db, "acme")
    intact = ledger("verify", "--database-url", url)
    assert intact.returncode == 0, intact.stdout + intact.stderr
    assert json.loads(intact.stdout)["ok"] is True

    with db.session() as session:  # edit one ledger event behind the ledger's back
        seq = session.execute(
            text("SELECT min(seq) FROM audit_log WHERE event_type = 'reservation.committed'")
        ).scalar_one()
        session.execute(
            text("UPDATE audit_log SET event_type = 'reservation.aborted' WHERE seq = :seq"), {"seq": seq}
        )
    broken = ledger("verify", "--database-url", url)
    assert broken.returncode == 1
    result = json.loads(broken.stdout)
    assert result["ok"] is False and result["first_broken"] == seq
    assert f"broken at entry {seq}" in broken.stderr


@pytest.mark.slow
def test_migrate_creates_the_schema(empty_database_url: URL) -> None:
    url = url_text(empty_database_url)
    assert migrations.current_revision(url) is None
    done = ledger("migrate", "--database-url", url)
    assert done.returncode == 0, done.stderr
    assert migrations.is_up_to_date(url)
    assert migrations.head_revision() in done.stdout


@pytest.mark.slow  # several `ledger` processes, ~6 s
def test_state_lives_in_one_home_and_a_missing_ledger_is_said_in_one_line(tmp_path: Path) -> None:
    """Issue 28 §3: ``ledger keys create`` from another folder used to create an empty
    ``ledger.db`` there and crash with ``sqlalchemy ... no such table: api_keys``. State lives in
    one home (``LEDGER_HOME`` / ``--home``); a command that finds no ledger says so in one line
    and creates nothing."""
    elsewhere, home = tmp_path / "elsewhere", tmp_path / "home"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "service.cli", *args],
            cwd=elsewhere,
            env={**env, "PYTHONPATH": str(ROOT), **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    commands = {
        "keys create": ("keys", "create", "--tenant", "t", "--scope", "admin"),
        "keys list": ("keys", "list", "--tenant", "t"),
        "verify": ("verify",),
    }
    for name, args in commands.items():
        missing = run(*args, LEDGER_HOME=str(home))
        assert missing.returncode == 2 and missing.stdout == "", missing
        (line,) = missing.stderr.strip().splitlines()
        assert line.startswith(f"ledger {name}: no ledger at {home / 'ledger.db'}"), line
        assert "sqlalchemy" not in line.lower() and "migrate" in line
    assert list(elsewhere.iterdir()) == [] and not home.exists()

    # A database that exists but was never migrated is said plainly too.
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    unmigrated = run(
        "keys", "create", "--tenant", "t", "--scope", "admin", "--database-url", f"sqlite:///{empty}"
    )
    assert unmigrated.returncode == 2 and "holds no ledger (never migrated)" in unmigrated.stderr

    # --home (relative to the working folder) and LEDGER_HOME are one setting: migrate there,
    # then a key made with either is stored in that home's database, beside its secret.
    assert run("--home", "home-flag", "migrate").returncode == 0
    made = run("--home", "home-flag", "keys", "create", "--tenant", "t", "--scope", "admin")
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (elsewhere / "home-flag").iterdir()) == ["key-hash.secret", "ledger.db"]
    listed = run("keys", "list", "--tenant", "t", LEDGER_HOME=str(elsewhere / "home-flag"))
    assert listed.returncode == 0 and json.loads(listed.stdout)["count"] == 1
    assert [p.name for p in elsewhere.iterdir()] == ["home-flag"]


def test_migrate_in_process_creates_the_schema_and_refuses_a_downgrade_without_a_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ledger migrate`` run by ``main`` in this process (the fast loop's run of the command; the
    subprocess test above is slow): a new SQLite file is at the head revision, and ``--downgrade``
    without ``--revision`` is refused before anything is touched."""
    from service.cli import main

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert main(["migrate", "--database-url", url]) == 0
    assert capsys.readouterr().out.strip() == f"database at revision {migrations.head_revision()}"
    assert migrations.current_revision(url) == migrations.head_revision()
    assert main(["migrate", "--database-url", url, "--downgrade"]) == 2
    assert "--revision" in capsys.readouterr().err
    assert migrations.current_revision(url) == migrations.head_revision()


@pytest.mark.parametrize(
    "argv",
    [["--lease-s", "0"], ["--poll-s", "-1"], ["--heartbeat-s", "0"]],
)
def test_worker_refuses_a_non_positive_interval_before_opening_the_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """``ledger worker`` with an interval ≤ 0 exits 2 naming the options, and creates no database."""
    from service.cli import main

    path = tmp_path / "ledger.db"
    assert main(["worker", "--database-url", f"sqlite:///{path}", *argv]) == 2
    assert "--lease-s, --heartbeat-s and --poll-s must be > 0" in capsys.readouterr().err
    assert not path.exists()
