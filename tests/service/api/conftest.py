"""Fixtures for HTTP API tests: the real app over real databases (both backends), real keys.

* ``app`` / ``client`` — ``service.app.create_app`` on the ``db`` fixture (tests/conftest.py:
  a fresh, migrated SQLite file or PostgreSQL database), driven by Starlette's ``TestClient``
  (real HTTP semantics through the ASGI interface, lifespan included).
* ``keys`` — API keys for two tenants (``acme``, ``rival``) in every scope, plus a revoked key.
* ``METRICS_TOKEN`` — the operator's ``/metrics`` token of the ``settings`` fixture and of
  ``start_server`` (``/metrics`` takes no API key).
* ``ledger_server`` — a real ``ledger serve`` (uvicorn) subprocess on ``database_url``, for the
  concurrency test and the command tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.engine import URL

from service.app import create_app
from service.db.session import Database
from service.ledger import tenancy
from service.settings import Settings

with warnings.catch_warnings():
    # Starlette asks for httpx2 in a deprecation warning; httpx is what the project pins.
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[3]
BOOTSTRAP_KEY = "pl_test_bootstrap_admin_key_0123456789abcdef"
METRICS_TOKEN = "test-metrics-token-0123456789abcdef"


def url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class Keys:
    """``keys.get(tenant, scope)``; ``revoked`` is an admin key of ``acme`` that was revoked."""

    by_tenant_scope: dict[tuple[str, str], str]
    revoked: str

    def get(self, tenant: str, scope: str) -> str:
        return self.by_tenant_scope[(tenant, scope)]


@pytest.fixture
def settings(database_url: URL) -> Settings:
    return Settings(
        database_url=url_text(database_url),
        reservation_ttl_s=3600,
        expiry_sweep_interval_s=0.2,
        max_body_bytes=256 * 1024,
        metrics_token=METRICS_TOKEN,
    )


@pytest.fixture
def app(settings: Settings, db: Database) -> FastAPI:
    return create_app(settings, database=db)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def keys(db: Database) -> Keys:
    found: dict[tuple[str, str], str] = {}
    for tenant in ("acme", "rival"):
        for scope in ("admin", "trainer", "viewer"):
            found[(tenant, scope)] = tenancy.create_api_key(db, tenant, scope)
    revoked = tenancy.issue_api_key(db, "acme", "admin")
    tenancy.revoke_api_key(db, revoked.id)
    return Keys(found, revoked.key)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    base_url: str
    admin_key: str
    process: subprocess.Popen[str]
    output: list[str]


def start_server(
    database_url: str,
    *,
    bootstrap_key: str | None = BOOTSTRAP_KEY,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Server:
    """``ledger serve`` in a subprocess; returns once ``/healthz`` answers 200."""
    port = free_port()
    # (the session's LEDGER_HOME stays: the server's default artifacts folder is in it)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_") or k == "LEDGER_HOME"}
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env["LEDGER_METRICS_TOKEN"] = METRICS_TOKEN
    if bootstrap_key is not None:
        child_env["LEDGER_BOOTSTRAP_ADMIN_KEY"] = bootstrap_key
    child_env.update(env or {})
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--port",
        str(port),
        "--database-url",
        database_url,
        "--no-worker",
        "--no-access-log",
        "--log-level",
        "warning",
        *extra_args,
    ]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    output: list[str] = []
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s

    # Read the start-up lines (URL, maybe a key) in the background so the pipe never fills.
    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ledger serve exited with {process.returncode}:\n{''.join(output)}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=1.0).status_code == 200:
                return Server(base_url, bootstrap_key or "", process, output)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(process)
    raise RuntimeError(f"ledger serve did not become healthy:\n{''.join(output)}")


def stop_server(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture
def ledger_server(database_url: URL) -> Iterator[Server]:
    server = start_server(url_text(database_url))
    try:
        yield server
    finally:
        stop_server(server.process)
