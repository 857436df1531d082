"""A real HTTP server for client and CLI tests: ``service.app.create_app`` under uvicorn, in a
thread of the test process, on a free loopback port, over the ``db`` fixture's database (SQLite
or PostgreSQL). Requests travel over real TCP; the lifespan runs as under ``ledger serve``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from sqlalchemy.engine import URL

from service.app import create_app
from service.db.session import Database
from service.settings import Settings


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def settings_for(database_url: URL, artifact_dir: Path) -> Settings:
    return Settings(
        database_url=database_url.render_as_string(hide_password=False),
        artifact_dir=artifact_dir,
        reservation_ttl_s=3600,
        expiry_sweep_interval_s=1.0,
    )


@contextmanager
def serve(
    settings: Settings, db: Database, *, timeout_s: float = 15.0, worker: bool = False
) -> Iterator[str]:
    """Serve the app on ``db`` (with its in-process training worker if ``worker``); yields the
    base URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, database=db, worker=worker),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        # Keep the test process's logging as it is: uvicorn's dictConfig would close every
        # existing handler, and absl's (installed on the root logger when dp-accounting is
        # imported) then closes the stream it holds — pytest's capture of an earlier test, so
        # later tests in the process failed with "I/O operation on closed file".
        log_config=None,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
