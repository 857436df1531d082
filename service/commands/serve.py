"""``ledger serve``: migrate the database, make sure an admin key exists, then serve HTTP API v1.

Order of start-up:

1. ``alembic upgrade head`` on ``LEDGER_DATABASE_URL`` (``service.db.migrations.upgrade``): the
   app never runs on a stale schema.
2. The key-hash secret (``service.server_secrets``) is read, or created on a first start; a
   secret that none of the stored keys was hashed with stops the start (exit 2) rather than
   answering 401 to every key.
3. ``LEDGER_BOOTSTRAP_ADMIN_KEY``, when set, is made to exist as an ``admin`` key of tenant
   ``default`` — unless that key was revoked: a revoked key stays revoked, a warning says so,
   and no key is created. When it is not set and the database has no usable admin key at all (a
   first start), a new admin key is created for tenant ``default`` and printed once, with the
   URL, so the README's first command leaves a new user with a working key.
4. uvicorn serves ``service.app`` (``--workers N`` processes; each opens its own database pool),
   with what start-up allocated frozen out of the garbage collector's reach, and the young
   generation collected less often (``_frozen``).

Unless ``--no-worker``, one training worker runs in-process (``service.worker.worker``): in the
app's lifespan with one uvicorn process, in this (supervising) process with ``--workers N``, so
there is one per ``ledger serve`` either way. ``ledger worker`` runs more, in other processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.commands.migrate import DATABASE_URL_HELP, database_url

if TYPE_CHECKING:
    from fastapi import FastAPI

    from service.db.session import Database
    from service.settings import Settings


# Container allocations between two young-generation collections (CPython's default is 700). A
# spend allocates a few hundred containers that die young, so at 700 the young generation was
# collected every two or three spends (and the middle one every ~25), each pass walking what the
# requests in flight hold alive: 0.15 ms of server CPU per spend. Ten thousand makes those passes
# rarer at the price of at most that many young objects waiting (well under a megabyte).
YOUNG_COLLECTION_THRESHOLD: Final = 10_000


def _no_delay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol with ``TCP_NODELAY`` on every connection.

    With ``--workers N`` uvicorn binds the listening socket itself, without ``IPPROTO_TCP``, and
    asyncio then leaves Nagle's algorithm on for the accepted connections: a response written in
    two segments waits for the client's delayed ACK, 40 ms on Linux (measured: 44 ms per
    keep-alive request with two workers, 1.6 ms with one).

    ``AutoHTTPProtocol`` is httptools' parser when httptools is installed (``uvicorn[standard]``),
    h11 otherwise; ``--http`` picks one explicitly (the classes below).
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _no_delay(transport)
        super().connection_made(cast(asyncio.Transport, transport))


class NoDelayH11Protocol(H11Protocol):
    """``--http h11``, with ``TCP_NODELAY`` (see ``NoDelayHTTPProtocol``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _no_delay(transport)
        super().connection_made(cast(asyncio.Transport, transport))


HTTP_PROTOCOL = f"{__name__}:NoDelayHTTPProtocol"
HTTP_PROTOCOLS: dict[str, str] = {
    "auto": HTTP_PROTOCOL,
    "h11": f"{__name__}:NoDelayH11Protocol",
    "httptools": f"{__name__}:NoDelayHttpToolsProtocol",
}


def __getattr__(name: str) -> Any:
    # httptools is optional: its protocol class is built when ``--http httptools`` asks for it.
    if name == "NoDelayHttpToolsProtocol":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class NoDelayHttpToolsProtocol(HttpToolsProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                _no_delay(transport)
                super().connection_made(cast(asyncio.Transport, transport))

        globals()[name] = NoDelayHttpToolsProtocol
        return NoDelayHttpToolsProtocol
    raise AttributeError(name)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="migrate the database and serve the HTTP API (and dashboard)",
        description="Apply migrations, ensure an admin key, then serve HTTP API v1 with uvicorn.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default 1)")
    parser.add_argument(
        "--no-worker",
        action="store_true",
        help="do not run the in-process training worker (run `ledger worker` processes instead)",
    )
    parser.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level (default info)",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "asyncio", "uvloop"),
        help="event loop (default auto: uvloop when installed, as with uvicorn[standard])",
    )
    parser.add_argument(
        "--http",
        default="auto",
        choices=tuple(HTTP_PROTOCOLS),
        help="HTTP parser (default auto: httptools when installed, h11 otherwise)",
    )
    parser.set_defaults(handler=run)


def _display_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class RedactQueryFilter(logging.Filter):
    """Access-log lines keep the path but not its query string.

    The API reads keys only from ``Authorization``, but a client that puts one in the URL
    (``?api_key=...``) would otherwise have it written to the log in plain text.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[redacted]", *args[3:])
        return True


def _log_config() -> dict[str, Any]:
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_query"] = {"()": "service.commands.serve.RedactQueryFilter"}
    config["handlers"]["access"]["filters"] = ["redact_query"]
    return config


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from service.db import migrations
    from service.db.session import Database
    from service.server_secrets import SecretError
    from service.settings import Settings

    if args.workers < 1:
        print("ledger serve: --workers must be >= 1.", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"ledger serve: --port must be in 1..65535. Found {args.port}.", file=sys.stderr)
        return 2
    url = database_url(args)
    # Worker processes (--workers > 1) build their app from the environment: pass the URL on.
    os.environ["LEDGER_DATABASE_URL"] = url
    settings = Settings()

    migrations.make_home(url)
    migrations.upgrade(url)
    database = Database(url, pool_size=2, max_overflow=0)
    try:
        new_key = _ensure_admin_key(database, settings)
    except SecretError as exc:
        print(f"ledger serve: {exc}", file=sys.stderr)
        return 2
    finally:
        database.dispose()

    base = f"http://{_display_host(args.host)}:{args.port}"
    print(_where_state_lives(settings, url), flush=True)
    print(f"privacy-ledger serving HTTP API v1 at {base}  (docs: {base}/docs)", flush=True)
    if new_key is not None:
        print(
            "created the first admin key (tenant 'default'); it is shown once, store it now:\n"
            f"  LEDGER_API_KEY={new_key}\n"
            f"  curl -H 'Authorization: Bearer {new_key}' {base}/v1/datasets",
            flush=True,
        )

    log_level = args.log_level
    access_log = not args.no_access_log
    if args.workers == 1:
        from service.app import create_app

        uvicorn.run(
            _frozen(create_app(settings, worker=not args.no_worker)),
            host=args.host,
            port=args.port,
            log_level=log_level,
            access_log=access_log,
            log_config=_log_config(),
            http=HTTP_PROTOCOLS[getattr(args, "http", "auto")],
            loop=getattr(args, "loop", "auto"),
        )
    else:
        stop, thread = _start_worker(url, settings) if not args.no_worker else (None, None)
        try:
            uvicorn.run(
                f"{__name__}:create_worker_app",
                factory=True,
                host=args.host,
                port=args.port,
                workers=args.workers,
                log_level=log_level,
                access_log=access_log,
                log_config=_log_config(),
                http=HTTP_PROTOCOLS[getattr(args, "http", "auto")],
                loop=getattr(args, "loop", "auto"),
            )
        finally:
            if stop is not None and thread is not None:
                stop.set()
                thread.join()
    return 0


def _where_state_lives(settings: Settings, url: str) -> str:
    """Where this server keeps its state, printed at start (issue 28 §3), and a note when the
    working directory holds a ledger of the days when state landed there, which is not used."""
    from sqlalchemy.engine import make_url

    from service.db.migrations import sqlite_file
    from service.server_secrets import default_secrets_dir
    from service.settings import DATABASE_FILE

    secrets = settings.secrets_dir or default_secrets_dir(url)
    lines = [
        f"ledger home: {settings.home}  (LEDGER_HOME or --home)",
        f"  database:  {make_url(url).render_as_string(hide_password=True)}",
        f"  artifacts: {settings.artifact_dir}",
        f"  secrets:   {Path(secrets).expanduser()}"
        + ("" if settings.key_hash_secret is None else " (key-hash secret from LEDGER_KEY_HASH_SECRET)"),
    ]
    here, served = Path.cwd() / DATABASE_FILE, sqlite_file(url)
    if here.is_file() and (served is None or here.resolve() != served.resolve()):
        lines.append(
            f"note: {here} is not this server's database (state no longer lands in the working "
            "directory); to serve it, run with --home . (or LEDGER_HOME=$PWD)."
        )
    return "\n".join(lines)


def _frozen(app: FastAPI) -> FastAPI:
    """``app``, with everything allocated so far moved out of the garbage collector's sight.

    A full (oldest-generation) collection walks every live container object: the modules,
    routes, schemas and statements of a started app are ~120 000 objects, a 70-85 ms pause (on
    the 2-core benchmark machine) that every request in flight waits out. Measured with
    ``bench/ledger.py`` (PostgreSQL, 32 clients): p99 of reserve and commit 110-140 ms without,
    45-55 ms with ``gc.freeze()``, and ~10% less server CPU per spend. What start-up allocated
    lives as long as the process anyway; later garbage is collected as before, the young
    generation every ``YOUNG_COLLECTION_THRESHOLD`` allocations (docs/PERFORMANCE.md, "Where the
    server CPU of a spend goes": 0.15 → 0.01 ms of collection per spend).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
    return app


def create_worker_app() -> FastAPI:
    """The app of one ``--workers N`` process (uvicorn's factory), frozen as ``_frozen`` says."""
    from service.app import create_app_from_env

    return _frozen(create_app_from_env())


def _start_worker(url: str, settings: Settings) -> tuple[threading.Event, threading.Thread]:
    """One training worker thread in this process (used with ``--workers N``)."""
    from service.db.session import Database
    from service.worker.worker import Worker, start_thread

    stop = threading.Event()
    worker = Worker(
        Database(url, pool_size=2, max_overflow=2),
        artifact_dir=settings.artifact_dir,
        reservation_ttl_s=settings.reservation_ttl_s,
        reservation_max_lifetime_s=settings.reservation_max_lifetime_s,
    )
    return stop, start_thread(worker, stop)


def _ensure_admin_key(database: Database, settings: Settings) -> str | None:
    """Ensure the bootstrap key, or create (and return) a first admin key if none exists.

    Reads the key-hash secret first (``SecretError`` when it cannot be read or made, or is not
    the one the stored keys were hashed with). A revoked bootstrap key stays revoked
    (``ensure_bootstrap_admin_key`` logs a warning) and no other key is made in its place: the
    operator who revoked it decides what replaces it.
    """
    from sqlalchemy import select

    from service import server_secrets
    from service.db.models import ApiKey
    from service.ledger.tenancy import (
        DEFAULT_TENANT,
        check_key_hash_secret,
        ensure_bootstrap_admin_key,
        issue_api_key,
    )

    server_secrets.bind(database, settings)
    check_key_hash_secret(database)
    if settings.bootstrap_admin_key is not None:
        ensure_bootstrap_admin_key(database, settings.bootstrap_admin_key.get_secret_value())
        return None
    with database.session(readonly=True) as session:
        admin = session.scalars(
            select(ApiKey.id).where(ApiKey.scope == "admin", ApiKey.revoked_at.is_(None)).limit(1)
        ).first()
    if admin is not None:
        return None
    return issue_api_key(database, DEFAULT_TENANT, "admin").key
