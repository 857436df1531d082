"""PostgreSQL itself restarted under load — on a throwaway cluster of its own, never a shared
server: ``initdb`` into a temporary folder, ``pg_ctl start`` on a free port with the socket in
that folder, and ``pg_ctl restart`` (``-m fast``: a clean shutdown, and ``-m immediate``: a crash,
WAL recovery on start) every few seconds while clients reserve and commit against one
``ledger serve`` (``tests.faults.harness.disrupted_load``). The server is never restarted: it must
answer 503 while the database is down, and recover on its own.

Needs PostgreSQL's server binaries (``initdb``, ``pg_ctl``: ``/usr/lib/postgresql/*/bin`` or on
``PATH``); run as root, the cluster belongs to the ``postgres`` user (``runuser``).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.faults.harness import TerminateRun, disrupted_load


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def available() -> str | None:
    """Why a throwaway cluster cannot be made here, or ``None`` when it can."""
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) not found"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser (initdb refuses root)"
    return None


class ThrowawayCluster:
    """A PostgreSQL cluster in a temporary folder, on its own port: safe to restart and kill."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ledger-pgcluster-"))
        self.data = self.folder / "data"
        self.log = self.folder / "postgres.log"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        command = [str(_bin(tool)), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=timeout, cwd=self.folder)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _options(self) -> str:
        return f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=100"

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            self._options(),
            "-w",
            "-t",
            "60",
            "start",
        )

    def restart(self, mode: str) -> float:
        """``pg_ctl restart -m mode``; the seconds it took (down and up again)."""
        started = time.monotonic()
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            self._options(),
            "-m",
            mode,
            "-w",
            "-t",
            "60",
            "restart",
        )
        return time.monotonic() - started

    def close(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.folder, ignore_errors=True)


def restart_postgres_under_load(
    *, seconds: float = 20.0, clients: int = 8, every_s: float = 4.0
) -> tuple[TerminateRun, dict[str, Any]]:
    """Restart a throwaway cluster every ``every_s`` (alternately ``fast`` and ``immediate``)
    under load for ``seconds``; findings as ``tests.faults.harness.check_after_kills`` plus the
    restart count and times."""
    from service.db.migrations import upgrade

    cluster = ThrowawayCluster()
    restarts: list[tuple[str, float]] = []
    try:
        cluster.start()
        upgrade(cluster.url)

        def restarter(run: TerminateRun, stop: threading.Event, lock: threading.Lock) -> None:
            modes = ("fast", "immediate")
            while not stop.wait(every_s):
                mode = modes[len(restarts) % 2]
                took = cluster.restart(mode)
                with lock:
                    restarts.append((mode, took))
                    run.terminated += 1

        run, findings = disrupted_load(cluster.url, restarter, seconds=seconds, clients=clients)
    finally:
        cluster.close()
    findings["restarts"] = [{"mode": m, "seconds": round(t, 2)} for m, t in restarts]
    return run, findings
