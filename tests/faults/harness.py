"""Fault runs shared by tests/faults and ``bench/faults.py``: a real ``ledger serve`` subprocess,
killed with SIGKILL at random points of reserve/commit cycles, and PostgreSQL backends killed
with ``pg_terminate_backend`` under load. Nothing is mocked; the checks read the database and the
HTTP API after the faults.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.engine import make_url

from service.db.session import Database
from tests.service.api.conftest import BOOTSTRAP_KEY, ROOT, Server, bearer, start_server, stop_server

HEADERS = bearer(BOOTSTRAP_KEY)


@dataclass
class KillRun:
    cycles: int = 0
    kills: int = 0
    acknowledged: dict[str, str] = field(default_factory=dict)  # reservation -> certificate
    in_doubt: int = 0  # commit sent, connection lost before the answer
    reserve_lost: int = 0  # reserve sent, connection lost before the answer
    restart_s: list[float] = field(default_factory=list)
    findings: dict[str, Any] = field(default_factory=dict)


def _start(url: str, ttl_s: float) -> Server:
    return start_server(
        url,
        env={
            "LEDGER_RESERVATION_TTL_S": str(ttl_s),
            "LEDGER_EXPIRY_SWEEP_INTERVAL_S": "0.2",
        },
    )


def _setup(base: str) -> tuple[str, str]:
    with httpx.Client(base_url=base, headers=HEADERS, timeout=30) as http:
        ds = http.post(
            "/v1/datasets",
            json={
                "name": f"faults-{os.getpid()}-{time.time_ns()}",
                "budget": {"rule": "sequential", "epsilon": "1000000", "delta": "0", "accountant": "basic"},
            },
        )
        ds.raise_for_status()
        dataset = ds.json()["id"]
        task = http.post(f"/v1/datasets/{dataset}/tasks", json={"name": "t"})
        task.raise_for_status()
        made = http.post(
            f"/v1/datasets/{dataset}/tasks/{task.json()['id']}/batches",
            json={"batches": [{"name": "b", "records": ["r1", "r2", "r3"]}]},
        )
        made.raise_for_status()
        return dataset, made.json()["data"][0]["id"]


def kill_serve_cycles(url: str, *, cycles: int, kills: int, seed: int = 7, ttl_s: float = 1.5) -> KillRun:
    """``cycles`` reserve+commit cycles against ``ledger serve``; in ``kills`` of them (chosen by
    ``seed``) SIGKILL is sent either by a timer at a uniformly random point of the cycle (0-1.5x
    the mean duration of the cycles so far: inside a reserve, between reserve and commit, inside
    a commit or just after), or, for every third kill, right after the reserve was answered (an
    orphaned reservation for sure). The server is restarted each time. Then the findings are
    checked (``check_after_kills``)."""
    rng = random.Random(seed)
    doomed = set(rng.sample(range(cycles), min(kills, cycles)))
    run = KillRun(cycles=cycles)
    durations: list[float] = []
    server = _start(url, ttl_s)
    try:
        dataset, batch = _setup(server.base_url)
        for i in range(cycles):
            timer = None
            after_reserve = False
            if i in doomed:
                after_reserve = rng.random() < 1 / 3
                mean = sum(durations) / len(durations) if durations else 0.05
                timer = threading.Timer(
                    rng.uniform(0.0, 1.5 * mean) if not after_reserve else 3600,
                    lambda p=server.process: _sigkill(p),
                )
                timer.start()
            lost = False
            reservation = None
            cycle_started = time.monotonic()
            try:
                with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=20) as http:
                    answer = http.post(
                        f"/v1/datasets/{dataset}/reservations",
                        json={"batches": [batch], "event": {"kind": "pure_dp", "epsilon": 0.5}},
                    )
                    if answer.status_code != 201:
                        raise AssertionError(f"reserve: {answer.status_code} {answer.text}")
                    reservation = answer.json()["id"]
                    if after_reserve:
                        _sigkill(server.process)
                    answer = http.post(
                        f"/v1/reservations/{reservation}/commit",
                        json={"release": {"model": "m", "version": f"v{i}"}},
                    )
                    if answer.status_code != 200:
                        raise AssertionError(f"commit: {answer.status_code} {answer.text}")
                    run.acknowledged[reservation] = answer.json()["certificate"]["id"]
                    if timer is None:
                        durations.append(time.monotonic() - cycle_started)
            except httpx.TransportError:
                lost = True
                if reservation is None:
                    run.reserve_lost += 1
                else:
                    run.in_doubt += 1
            if timer is not None:
                timer.cancel()
                _sigkill(server.process)  # a timer that fired after the cycle: kill now
                server.process.wait(timeout=30)
                run.kills += 1
                started = time.monotonic()
                server = _start(url, ttl_s)
                run.restart_s.append(time.monotonic() - started)
            elif lost:
                raise AssertionError("connection lost without a kill")
        time.sleep(ttl_s + 1.0)  # every orphaned reservation passes its TTL; the sweep runs
        run.findings = check_after_kills(url, server.base_url, dataset, run)
    finally:
        stop_server(server.process)
    return run


def _sigkill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)


def check_after_kills(url: str, base: str, dataset: str, run: KillRun) -> dict[str, Any]:
    findings: dict[str, Any] = {}
    with httpx.Client(base_url=base, headers=HEADERS, timeout=30) as http:
        missing = [
            c for c in run.acknowledged.values() if http.get(f"/v1/certificates/{c}").status_code != 200
        ]
        findings["acknowledged_commits"] = len(run.acknowledged)
        findings["lost_commits"] = len(missing)
        spend = http.get(f"/v1/datasets/{dataset}/spend")
        spend.raise_for_status()
    db = Database(make_url(url), pool_size=1, max_overflow=0)
    try:
        with db.engine.connect() as conn:
            statuses = Counter(
                dict(
                    conn.execute(
                        text(
                            "SELECT status, count(*) FROM reservations WHERE dataset_id = :d GROUP BY status"
                        ),
                        {"d": dataset},
                    ).all()
                )
            )
            findings["reservations"] = dict(statuses)
            findings["open_reservations_after_ttl"] = statuses.get("reserved", 0)
            findings["releases_without_certificate"] = conn.execute(
                text(
                    "SELECT count(*) FROM releases r LEFT JOIN certificates c ON c.release_id = r.id "
                    "WHERE c.id IS NULL"
                )
            ).scalar_one()
            findings["committed_without_certificate"] = conn.execute(
                text(
                    "SELECT count(*) FROM reservations r LEFT JOIN certificates c "
                    "ON c.reservation_id = r.id WHERE r.status = 'committed' AND c.id IS NULL"
                )
            ).scalar_one()
            certificates = conn.execute(
                text("SELECT count(*) FROM certificates WHERE dataset_id = :d"), {"d": dataset}
            ).scalar_one()
            # An abort or an expiry is a charge too (issue 24 §2): its certificate names no release.
            released = conn.execute(
                text("SELECT count(*) FROM certificates WHERE dataset_id = :d AND release_id IS NOT NULL"),
                {"d": dataset},
            ).scalar_one()
            row = conn.execute(
                text("SELECT epsilon_spent, charges_committed FROM datasets WHERE id = :d"), {"d": dataset}
            ).one()
            committed_eps = conn.execute(
                text("SELECT coalesce(sum(committed_epsilon), 0) FROM reservations WHERE dataset_id = :d"),
                {"d": dataset},
            ).scalar_one()
    finally:
        db.dispose()
    findings["certificates"] = certificates
    findings["released_certificates"] = released
    findings["committed"] = statuses.get("committed", 0)
    findings["charges_committed"] = row.charges_committed
    findings["epsilon_spent"] = str(row.epsilon_spent)
    findings["epsilon_recomputed"] = str(committed_eps)
    findings["spend_api_epsilon"] = spend.json().get("epsilon_spent")
    verify = subprocess.run(
        [sys.executable, "-m", "service.cli", "verify", "--database-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    findings["verify_rc"] = verify.returncode
    findings["verify_output"] = verify.stdout.strip()[-300:]
    return findings


def assert_kill_findings(run: KillRun) -> None:
    f = run.findings
    assert f["lost_commits"] == 0, f
    assert f["open_reservations_after_ttl"] == 0, f
    assert f["releases_without_certificate"] == 0, f
    assert f["committed_without_certificate"] == 0, f
    assert f["released_certificates"] == f["committed"], f
    assert f["certificates"] == f["charges_committed"], f  # every commit, abort and expiry
    assert f["committed"] >= f["acknowledged_commits"], f
    assert f["committed"] <= f["acknowledged_commits"] + run.in_doubt, f
    from decimal import Decimal

    assert Decimal(f["epsilon_spent"]) == Decimal(f["epsilon_recomputed"]), f
    assert f["verify_rc"] == 0, f


# ---- PostgreSQL backends killed under load ------------------------------------------------------


@dataclass
class TerminateRun:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    terminated: int = 0
    after: Counter[int] = field(default_factory=Counter)
    bad_bodies: list[str] = field(default_factory=list)
    client_cycles: int = 0  # reserve+commit through service.client (retries 503 idempotently)
    client_failures: list[str] = field(default_factory=list)
    client_certificates: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)  # the server's tracebacks, for a 500


def terminate_backends_under_load(
    url: str, *, seconds: float = 6.0, clients: int = 6, every_s: float = 0.25
) -> tuple[TerminateRun, dict[str, Any]]:
    """``clients`` threads reserve+commit against ``ledger serve`` while another thread kills
    every backend connected to THIS database (``pg_stat_activity.datname``) every ``every_s``.
    Then, with the killer stopped and no restart, the same load must succeed."""
    import psycopg

    parsed = make_url(url)
    dbname = parsed.database
    admin_dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)

    def killer(run: TerminateRun, stop: threading.Event, lock: threading.Lock) -> None:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            while not stop.is_set():
                rows = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (dbname,),
                ).fetchall()
                with lock:
                    run.terminated += sum(1 for (ok,) in rows if ok)
                stop.wait(every_s)

    return disrupted_load(url, killer, seconds=seconds, clients=clients)


def disrupted_load(
    url: str,
    disrupt: Callable[[TerminateRun, threading.Event, threading.Lock], None],
    *,
    seconds: float,
    clients: int,
) -> tuple[TerminateRun, dict[str, Any]]:
    """``clients`` raw HTTP reserve+commit loops and two ``service.client`` loops (retrying a 503
    with the same Idempotency-Key) against one ``ledger serve`` for ``seconds``, while
    ``disrupt(run, stop, lock)`` runs in a thread until ``stop`` is set; then, with no restart of
    the server, the same load for 2 s must succeed. Findings as ``check_after_kills``."""
    run = TerminateRun()
    server = _start(url, 60)
    stop = threading.Event()
    lock = threading.Lock()
    try:
        dataset, batch = _setup(server.base_url)

        def killer() -> None:
            disrupt(run, stop, lock)

        def load(n: int, until: float, into: Counter[int]) -> None:
            i = 0
            with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=20) as http:
                while time.monotonic() < until:
                    i += 1
                    try:
                        answer = http.post(
                            f"/v1/datasets/{dataset}/reservations",
                            json={"batches": [batch], "event": {"kind": "pure_dp", "epsilon": 0.01}},
                        )
                        statuses = [answer.status_code]
                        if answer.status_code == 201:
                            rid = answer.json()["id"]
                            answer = http.post(
                                f"/v1/reservations/{rid}/commit",
                                json={"release": {"model": f"m{n}", "version": f"v{i}-{time.time_ns()}"}},
                            )
                            statuses.append(answer.status_code)
                        if answer.status_code >= 500:
                            body = answer.json()
                            if body.get("error") != "unavailable" and answer.status_code != 503:
                                with lock:
                                    run.bad_bodies.append(answer.text[:300])
                    except httpx.TransportError:
                        with lock:
                            run.transport_errors += 1
                        continue
                    with lock:
                        run.requests += len(statuses)
                        into.update(statuses)

        def retrying_client(n: int, until: float) -> None:
            from service.client import LedgerClient

            with LedgerClient(server.base_url, BOOTSTRAP_KEY, retries=8) as client:
                i = 0
                while time.monotonic() < until:
                    i += 1
                    try:
                        held = client.reserve(dataset, {"kind": "pure_dp", "epsilon": 0.01}, batches=[batch])
                        done = client.commit(held["id"], model=f"c{n}", version=f"v{i}-{time.time_ns()}")
                    except Exception as error:
                        with lock:
                            run.client_failures.append(f"{type(error).__name__}: {error}"[:300])
                        continue
                    with lock:
                        run.client_cycles += 1
                        run.client_certificates.append(done["certificate"]["id"])

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        until = time.monotonic() + seconds
        workers = [threading.Thread(target=load, args=(n, until, run.statuses)) for n in range(clients)]
        workers += [threading.Thread(target=retrying_client, args=(n, until)) for n in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        thread.join(timeout=10)
        # recovery, no restart: the same process answers the same load
        until = time.monotonic() + 2.0
        workers = [threading.Thread(target=load, args=(n, until, run.after)) for n in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        alive = server.process.poll() is None
        findings = check_after_kills(
            url,
            server.base_url,
            dataset,
            KillRun(acknowledged={str(i): c for i, c in enumerate(run.client_certificates)}),
        )
        findings["server_alive"] = alive
        findings["server_log_tail"] = "".join(server.output)[-6000:]
    finally:
        stop.set()
        stop_server(server.process)
        log = "".join(server.output)
        run.server_errors = [part[:2000] for part in log.split("Traceback")[1:][:3]]
    return run, findings
