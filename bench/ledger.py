"""Ledger benchmark over real HTTP to ``ledger serve`` (uvicorn), on SQLite and on PostgreSQL.

Measures, per backend:

* **hot-dataset throughput** — N concurrent clients (asyncio, one keep-alive connection each)
  loop reserve (pure ε) → commit on ONE dataset, one batch, for ``--duration`` seconds:
  committed spends per second and the p50 / p99 latency of reserve and of commit, as the client
  sees them. Afterwards the dataset's spend must account for exactly the commits the clients saw
  (``charges_committed`` and ``epsilon_spent``, warm-up included; nothing left held).
  Every spend on a dataset serialises on its ledger head (``SELECT … FOR UPDATE`` / SQLite's
  write lock; the ledger groups a process's concurrent spends into one transaction), so this is
  the ledger's worst case. The load generator runs on the same machine and takes CPU from it, so
  by default it is a minimal hand-written HTTP/1.1 client (``RawHttpClient``, ~0.2 ms of CPU per
  reserve+commit pair; ``--client httpx`` uses httpx, ~2.2 ms). CPU per committed spend is
  reported for the load generator, the server (all ``ledger serve`` processes, from ``/proc``)
  and PostgreSQL (the backends of the benchmark's database, WAL writer, background writer,
  checkpointer), so a run on a shared machine still says what the spends cost; with the
  operations per spend transaction (``ledger_version`` counts transactions: the group size) and
  the 1-minute load average before each run.
  ``--servers`` runs several server variants in one invocation (another code tree, e.g. an
  export of the last commit, or other ``ledger serve`` arguments), for side-by-side figures on a
  noisy machine.
* **spend query at 10⁶ charges** — ``GET /v1/datasets/{id}/spend`` on a dataset holding
  ``--charges`` committed charges, sequentially: p50 / p99 / mean latency over HTTP, and the
  domain operation alone (``service.ledger.spent.get_spend``, no HTTP) for comparison.

How the 10⁶ charges are seeded (before the server starts, in a fresh database): one real charge
goes through the ledger (``reservations.reserve`` + ``commit``: reservation rows, certificate,
release, audit entries, aggregates). Its reservation and per-batch rows are then cloned in bulk by
the database itself (``INSERT … SELECT`` over ``generate_series`` on PostgreSQL, a recursive CTE
on SQLite), with fresh ids and the same event and cost. The aggregates are then set to exactly
what the ledger would hold after all those charges: the batch's ``BatchState`` is computed by the
ledger's own rules (``accountant.rules.reserve`` + ``commit`` applied once per seeded charge, in
process), and the task and dataset aggregates (maxima over batches, ``charges_committed``,
``ledger_version``) follow from it. The clones carry no release, certificate or audit entry of
their own (the spend query reads none of those; the audit chain stays intact and verifies). The
benchmark checks the answer: ``epsilon_spent`` = (charges) × ε exactly, ``charges_committed``.

Usage (the repository root is the working directory)::

    python bench/ledger.py                                   # both backends, defaults below
    python bench/ledger.py --backends postgres --workers 2 --clients 64 --duration 20
    python bench/ledger.py --backends postgres --client raw,httpx      # load generator compared
    git archive HEAD | tar -x -C /tmp/base && \
        python bench/ledger.py --servers "/tmp/base;.;. --loop asyncio --http h11"   # before/after
    LEDGER_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test python bench/ledger.py

PostgreSQL comes from ``--postgres-url`` or ``LEDGER_TEST_POSTGRES_URL``; the benchmark creates
its own database on that server and drops it afterwards. Prints a table and writes
``bench/results/ledger.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import insert, select, text, update  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from accountant import events as dp_events  # noqa: E402
from accountant import rules  # noqa: E402
from accountant.exact import exact_mul, to_text  # noqa: E402
from service.db import migrations  # noqa: E402
from service.db.base import utcnow  # noqa: E402
from service.db.models import (  # noqa: E402
    Batch,
    BatchStateRow,
    Dataset,
    Reservation,
    ReservationBatch,
    Task,
)
from service.db.session import Database  # noqa: E402
from service.ledger import batches, datasets, reservations, spent, tenancy  # noqa: E402
from service.ledger.spending.store import state_id  # noqa: E402

ADMIN_KEY = "pl_bench_" + secrets.token_urlsafe(24)
TENANT = "default"
HOT_CHARGE = 0.001
SEED_CHARGE = 0.000001


# ---------------------------------------------------------------------------------------------
# databases


@contextmanager
def fresh_database(backend: str, postgres_url: str | None, workdir: Path) -> Iterator[str]:
    """A new, empty database for one run; removed afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{workdir / 'bench.db'}"
        return
    if not postgres_url:
        raise SystemExit("PostgreSQL: give --postgres-url or set LEDGER_TEST_POSTGRES_URL")
    import psycopg

    server = make_url(postgres_url)
    name = f"ledger_bench_{secrets.token_hex(6)}"
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---------------------------------------------------------------------------------------------
# seeding 10^6 committed charges


@dataclass
class Seeded:
    dataset_id: str
    charges: int
    epsilon_spent: str
    seconds_rules: float
    seconds_sql: float


def _setup_dataset(db: Database, name: str, epsilon: str) -> tuple[str, str]:
    dataset = datasets.create_dataset(
        db,
        TENANT,
        name=name,
        budget={"rule": "sequential", "epsilon": epsilon, "delta": "0", "accountant": "basic"},
    )
    task = batches.create_task(db, TENANT, dataset.id, name="task-0")
    created = batches.create_batches(
        db,
        TENANT,
        dataset.id,
        task.id,
        batches=[{"name": "batch-0", "records": [f"{name}-record-{i}" for i in range(64)]}],
    )
    return dataset.id, created.data[0].id


def _series_cte(dialect: str, count: int) -> str:
    if dialect == "postgresql":
        return f"generate_series(1, {int(count)}) AS s(i)"
    return (
        "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
        f"WHERE i < {int(count)}) SELECT i FROM n) AS s"
    )


def _clone_rows(db: Database, template_id: str, count: int) -> None:
    """``count`` copies of the template reservation and its per-batch rows, new ids."""
    series = _series_cte(db.dialect, count)
    res_cols = [c.name for c in Reservation.__table__.columns]
    new_id = "'res_seed_' || CAST(s.i AS TEXT)"
    res_select = ", ".join(new_id if c == "id" else f"r.{c}" for c in res_cols)
    with db.session() as session:
        session.execute(
            text(
                f"INSERT INTO reservations ({', '.join(res_cols)}) "
                f"SELECT {res_select} FROM reservations r, {series} WHERE r.id = :template"
            ),
            {"template": template_id},
        )
        for table in (ReservationBatch.__table__,):  # its classes are in its row
            cols = [c.name for c in table.columns]
            chosen = ", ".join(new_id if c == "reservation_id" else f'x."{c}"' for c in cols)
            quoted = ", ".join(f'"{c}"' for c in cols)
            session.execute(
                text(
                    f"INSERT INTO {table.name} ({quoted}) "
                    f"SELECT {chosen} FROM {table.name} x, {series} WHERE x.reservation_id = :template"
                ),
                {"template": template_id},
            )


def seed_charges(db: Database, count: int) -> Seeded:
    """A dataset with ``count`` committed charges of ε = SEED_CHARGE (see the module docstring)."""
    dataset_id, batch_id = _setup_dataset(db, "cold", "1000000")
    event = {"kind": "pure_dp", "epsilon": SEED_CHARGE}
    held = reservations.reserve(
        db, TENANT, dataset_id, event=reservations.parse_event(event), batch_ids=[batch_id]
    )
    reservations.commit(db, TENANT, held.id, release={"model": "seed", "version": 0})
    clones = count - 1

    # The aggregates after ``clones`` more identical charges, by the ledger's own rules.
    started = time.perf_counter()
    with db.session(readonly=True) as session:
        dataset = session.get(Dataset, dataset_id)
        batch = session.get(Batch, batch_id)
        assert dataset is not None and batch is not None
        budget = rules.Budget.from_json(dataset.budget)
        stored_state = session.get(BatchStateRow, batch.state_id)
        assert stored_state is not None
        state = rules.BatchState.from_json(stored_state.state)
        task_id = batch.task_id
    charge = rules.Charge(dp_events.from_json(event))
    for _ in range(clones):
        admission = rules.reserve(budget, state, charge)
        state = rules.commit(budget, admission.state, charge, admission.cost, None).state
    seconds_rules = time.perf_counter() - started

    started = time.perf_counter()
    _clone_rows(db, held.id, clones)
    with db.session() as session:
        final = state_id(dataset_id, state)
        session.execute(
            insert(BatchStateRow).values(
                id=final, dataset_id=dataset_id, state=state.to_json(), created_at=utcnow()
            )
        )
        session.execute(update(Batch).where(Batch.id == batch_id).values(state_id=final))
        session.execute(
            update(Task)
            .where(Task.id == task_id)
            .values(
                epsilon_spent=state.epsilon_spent,
                delta_spent=state.delta_spent,
                naive_epsilon=state.naive_epsilon,
            )
        )
        session.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id)
            .values(
                epsilon_spent=state.epsilon_spent,
                delta_spent=state.delta_spent,
                naive_epsilon=state.naive_epsilon,
                charges_committed=Dataset.charges_committed + clones,
                ledger_version=Dataset.ledger_version + 2 * clones,
            )
        )
    if db.dialect == "postgresql":
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM ANALYZE reservations"))
            connection.execute(text("VACUUM ANALYZE reservation_batches"))
    seconds_sql = time.perf_counter() - started
    with db.session(readonly=True) as session:
        stored = session.scalar(select(Reservation.id).where(Reservation.dataset_id == dataset_id).limit(1))
        assert stored is not None
    expected = exact_mul(Decimal(repr(SEED_CHARGE)), Decimal(count))
    assert state.epsilon_spent == expected, (state.epsilon_spent, expected)
    return Seeded(dataset_id, count, to_text(expected), seconds_rules, seconds_sql)


# ---------------------------------------------------------------------------------------------
# the server


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[str]
    output: list[str]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def ledger_serve(
    database_url: str,
    workers: int,
    auth_cache_ttl_s: float = 0.0,
    server_root: Path = ROOT,
    serve_args: Sequence[str] = (),
) -> Iterator[Server]:
    """``ledger serve`` from ``server_root`` (default this checkout; another directory, e.g. an
    export of an earlier commit, serves that code for a side-by-side comparison in one run)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env.update(
        LEDGER_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY,
        PYTHONUNBUFFERED="1",
        LEDGER_AUTH_CACHE_TTL_S=str(auth_cache_ttl_s),
    )
    # ``LEDGER_X=value`` among the serve arguments: settings of the server's environment
    env.update(a.partition("=")[::2] for a in serve_args if a.startswith("LEDGER_") and "=" in a)
    serve_args = [a for a in serve_args if not (a.startswith("LEDGER_") and "=" in a)]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--workers",
            str(workers),
            "--no-worker",
            "--no-access-log",
            "--log-level",
            "warning",
            *serve_args,
        ],
        cwd=server_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError("ledger serve exited:\n" + "".join(output))
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("ledger serve did not start:\n" + "".join(output))
            time.sleep(0.2)
        yield Server(base_url, process, output)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``; ``[pid]`` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{current}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(c) for c in children)
    return out


def _cpu_s(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds (user + system) used so far by each of the processes ``pids`` (``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def server_cpu_s(pid: int | None) -> float | None:
    """CPU seconds used so far by ``ledger serve`` and its worker processes."""
    if pid is None or not Path("/proc/self/stat").exists():
        return None
    return sum(_cpu_s(_process_tree(pid)).values())


def postgres_cpu_s(db: Database | None) -> dict[int, float] | None:
    """CPU seconds used so far, by process, by the PostgreSQL server for this benchmark: the
    backends connected to its database, and the WAL writer, background writer and checkpointer
    (shared with anything else on the server). ``None`` on SQLite or when PostgreSQL runs on
    another machine."""
    if db is None or db.dialect != "postgresql" or not Path("/proc/self/stat").exists():
        return None
    with db.engine.connect() as connection:
        pids = connection.scalars(
            text(
                "SELECT pid FROM pg_stat_activity WHERE "
                "(datname = current_database() OR backend_type IN "
                "('walwriter', 'background writer', 'checkpointer'))"
            )
        ).all()
    return _cpu_s(pids) or None


def _cpu_used_s(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """CPU seconds the processes present at both readings used between them."""
    if before is None or after is None:
        return None
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


# ---------------------------------------------------------------------------------------------
# measurements


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {
        "count": len(values),
        "p50_ms": round(percentile(values, 0.50) * 1000, 2),
        "p99_ms": round(percentile(values, 0.99) * 1000, 2),
        "mean_ms": round(statistics.fmean(values) * 1000, 2) if values else float("nan"),
        "max_ms": round(max(values) * 1000, 2) if values else float("nan"),
    }


@dataclass
class Throughput:
    clients: int
    duration_s: float
    commits: int
    commits_per_s: float
    errors: int
    error_samples: list[str]
    reserve: dict[str, float]
    commit: dict[str, float]
    spend_after: dict[str, Any] = field(default_factory=dict)
    client: str = "raw"
    client_cpu_ms_per_commit: float | None = None
    server_cpu_ms_per_commit: float | None = None
    postgres_cpu_ms_per_commit: float | None = None
    operations_per_transaction: float | None = None  # reserves + commits per spend transaction


class RawHttpClient:
    """A minimal HTTP/1.1 keep-alive client for the hot loop: one connection, one request at a
    time, hand-built requests, status line + ``Content-Length`` (or chunked) body parsed by hand.

    httpx costs the load generator ~3.8 ms of CPU per reserve+commit pair, on the same cores as
    the server; this costs a few hundred µs, so the benchmark measures the ledger, not itself.
    A response with ``Connection: close`` (or a dropped connection before any byte of the
    answer arrived is NOT retried: a POST is not idempotent) reconnects for the next request.
    """

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        url = httpx.URL(base_url)
        self.host = url.host
        self.port = url.port or 80
        fixed = {"Host": f"{self.host}:{self.port}", **headers}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if self._writer is None:
            await self._connect()
        assert self._reader is not None and self._writer is not None
        if body is None:
            head = f"{method} {path} HTTP/1.1\r\n".encode() + self._fixed + b"\r\n"
            payload = b""
        else:
            payload = json.dumps(body, separators=(",", ":")).encode()
            head = (
                f"{method} {path} HTTP/1.1\r\n".encode()
                + self._fixed
                + b"Content-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode()
                + b"\r\n\r\n"
            )
        self._writer.write(head + payload)
        reader = self._reader
        status_line = await reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        length = -1
        chunked = close = False
        while True:
            line = await reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(data[:-2])
            content = b"".join(parts)
        elif length >= 0:
            content = await reader.readexactly(length)
        else:
            content = await reader.read()
            close = True
        if close:
            await self.aclose()
        return status, content

    async def aclose(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()


class HttpxHotClient:
    """The hot loop's client through httpx (``--client httpx``), for comparison."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self.client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        response = await self.client.request(method, path, json=body)
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self.client.aclose()


HotClient = RawHttpClient | HttpxHotClient


async def _hot_loop(
    client: HotClient,
    dataset: str,
    batch: str,
    worker: str,
    stop_at: float,
    reserve_s: list[float],
    commit_s: list[float],
    errors: list[str],
) -> int:
    commits = 0
    reserve_path = f"/v1/datasets/{dataset}/reservations"
    body = {"batches": [batch], "event": {"kind": "pure_dp", "epsilon": HOT_CHARGE}}
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        status, content = await client.request("POST", reserve_path, body)
        t1 = time.perf_counter()
        if status != 201:
            errors.append(f"reserve {status} {content[:200]!r}")
            continue
        held_id = json.loads(content)["id"]
        status, content = await client.request(
            "POST",
            f"/v1/reservations/{held_id}/commit",
            {"release": {"model": f"hot-{worker}", "version": commits}},
        )
        t2 = time.perf_counter()
        if status != 200:
            errors.append(f"commit {status} {content[:200]!r}")
            continue
        reserve_s.append(t1 - t0)
        commit_s.append(t2 - t1)
        commits += 1
    return commits


async def hot_throughput(
    base_url: str,
    clients: int,
    duration_s: float,
    warmup_s: float,
    client_kind: str = "raw",
    server_pid: int | None = None,
    db: Database | None = None,
) -> Throughput:
    """Each simulated client has its own keep-alive connection. ``client_kind`` ``raw`` (the
    default): ``RawHttpClient``; ``httpx``: an ``httpx.AsyncClient`` per connection (one client
    object shared by many connections costs the load generator ~8 ms of CPU per request at 64
    connections, its pool scanned under a lock; even one per connection costs ~3.8 ms of CPU per
    reserve+commit pair, on the cores the server needs)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    factory = RawHttpClient if client_kind == "raw" else HttpxHotClient
    pool: list[HotClient] = [factory(base_url, headers) for _ in range(clients)]
    admin = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120)
    try:
        made = await admin.post(
            "/v1/datasets",
            json={
                "name": f"hot-{secrets.token_hex(4)}",  # one per run: names are unique per tenant
                "budget": {"rule": "sequential", "epsilon": "1000000", "delta": "0", "accountant": "basic"},
            },
        )
        dataset = made.json()["id"]
        task = (await admin.post(f"/v1/datasets/{dataset}/tasks", json={"name": "t"})).json()
        created = await admin.post(
            f"/v1/datasets/{dataset}/tasks/{task['id']}/batches",
            json={"batches": [{"name": "b", "records": list(range(256))}]},
        )
        batch = created.json()["data"][0]["id"]

        # Warm-up (connections, caches, pools), not counted.
        sink: list[float] = []
        warm_errors: list[str] = []
        stop = time.perf_counter() + warmup_s
        warm_counts = await asyncio.gather(
            *(
                _hot_loop(client, dataset, batch, f"{dataset}-warm-{i}", stop, sink, sink, warm_errors)
                for i, client in enumerate(pool)
            )
        )
        reserve_s: list[float] = []
        commit_s: list[float] = []
        errors: list[str] = []
        version_before = (await admin.get(f"/v1/datasets/{dataset}/spend")).json()["ledger_version"]
        cpu_started = time.process_time()
        server_started = server_cpu_s(server_pid)
        postgres_started = postgres_cpu_s(db)
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(
                _hot_loop(
                    client,
                    dataset,
                    batch,
                    f"{dataset}-{i}",
                    started + duration_s,
                    reserve_s,
                    commit_s,
                    errors,
                )
                for i, client in enumerate(pool)
            )
        )
        elapsed = time.perf_counter() - started
        client_cpu_s = time.process_time() - cpu_started
        server_ended = server_cpu_s(server_pid)
        postgres_ended = postgres_cpu_s(db)
        spend_after = (await admin.get(f"/v1/datasets/{dataset}/spend")).json()
    finally:
        for client in pool:
            await client.aclose()
        await admin.aclose()
    commits = sum(counts)
    # Exactly-once accounting: every commit the clients saw (warm-up included) is spend, and
    # nothing else is (HOT_CHARGE each, exact decimal arithmetic).
    total = commits + sum(warm_counts)
    expected = to_text(exact_mul(Decimal(repr(HOT_CHARGE)), Decimal(total)))
    assert spend_after.get("charges_committed") == total, (spend_after, total)
    assert spend_after.get("epsilon_spent") == expected, (spend_after, expected)
    if not errors and not warm_errors:
        assert Decimal(spend_after.get("epsilon_held", "0")) == 0, spend_after
    return Throughput(
        clients=clients,
        duration_s=round(elapsed, 2),
        commits=commits,
        commits_per_s=round(commits / elapsed, 1),
        errors=len(errors + warm_errors),
        error_samples=(errors + warm_errors)[:3],
        reserve=summary_ms(reserve_s),
        commit=summary_ms(commit_s),
        spend_after={k: spend_after.get(k) for k in ("epsilon_spent", "charges_committed", "epsilon_held")},
        client=client_kind,
        client_cpu_ms_per_commit=round(1000 * client_cpu_s / commits, 3) if commits else None,
        server_cpu_ms_per_commit=(
            round(1000 * (server_ended - server_started) / commits, 3)
            if commits and server_started is not None and server_ended is not None
            else None
        ),
        postgres_cpu_ms_per_commit=(
            round(1000 * postgres_used / commits, 3)
            if commits and (postgres_used := _cpu_used_s(postgres_started, postgres_ended)) is not None
            else None
        ),
        operations_per_transaction=round(
            2 * commits / max(1, spend_after["ledger_version"] - version_before), 2
        ),
    )


def spend_queries(base_url: str, db: Database, seeded: Seeded, count: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = f"/v1/datasets/{seeded.dataset_id}/spend"
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for _ in range(20):
            client.get(path)
        timings = []
        answer: dict[str, Any] = {}
        for _ in range(count):
            t0 = time.perf_counter()
            response = client.get(path)
            timings.append(time.perf_counter() - t0)
            answer = response.json()
    assert answer["charges_committed"] == seeded.charges, answer
    assert answer["epsilon_spent"] == seeded.epsilon_spent, (answer, seeded)
    domain = []
    for _ in range(count):
        t0 = time.perf_counter()
        spent.get_spend(db, TENANT, seeded.dataset_id).to_json()
        domain.append(time.perf_counter() - t0)
    return {
        "charges": seeded.charges,
        "epsilon_spent": answer["epsilon_spent"],
        "http": summary_ms(timings),
        "domain_only": summary_ms(domain),
    }


# ---------------------------------------------------------------------------------------------
# driver


def run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"ledger-bench-{backend}-"))
    try:
        with fresh_database(backend, args.postgres_url, workdir) as url:
            migrations.upgrade(url)
            db = Database(url)
            try:
                tenancy.ensure_bootstrap_admin_key(db, ADMIN_KEY)
                print(f"[{backend}] seeding {args.charges} committed charges ...", flush=True)
                seeded = seed_charges(db, args.charges)
                print(
                    f"[{backend}]   rules {seeded.seconds_rules:.1f} s, bulk SQL {seeded.seconds_sql:.1f} s",
                    flush=True,
                )
                results: dict[str, Any] = {"backend": backend, "seed": asdict(seeded), "runs": []}
                for (root, serve_args), workers, ttl in itertools.product(
                    args.servers, args.workers, args.auth_cache_ttl
                ):
                    server = f"{root}{' ' + serve_args if serve_args else ''}"
                    with ledger_serve(url, workers, ttl, Path(root), serve_args.split()) as running:
                        print(
                            f"[{backend}] {server} workers={workers} auth cache={ttl:g}s: spend queries ...",
                            flush=True,
                        )
                        queries = spend_queries(running.base_url, db, seeded, args.spend_queries)
                        for clients, client_kind in itertools.product(args.clients, args.client):
                            print(
                                f"[{backend}] workers={workers} clients={clients} "
                                f"({client_kind}): {args.duration:g} s of reserve+commit ...",
                                flush=True,
                            )
                            load_before = os.getloadavg()[0]
                            hot = asyncio.run(
                                hot_throughput(
                                    running.base_url,
                                    clients,
                                    args.duration,
                                    args.warmup,
                                    client_kind,
                                    running.process.pid,
                                    db,
                                )
                            )
                            results["runs"].append(
                                {
                                    "server_root": root,
                                    "serve_args": serve_args,
                                    "workers": workers,
                                    "clients": clients,
                                    "auth_cache_ttl_s": ttl,
                                    "load_average_1m_before": round(load_before, 2),
                                    "hot": asdict(hot),
                                    "spend_query": queries,
                                }
                            )
                return results
            finally:
                db.dispose()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def print_table(report: dict[str, Any]) -> None:
    header = (
        f"{'backend':<10} {'server':<24} {'client':<6} {'cpu/c':>6} {'srv/c':>6} "
        f"{'pg/c':>5} {'ops/tx':>6} {'workers':>7} {'auth$':>5} {'clients':>7} "
        f"{'commits/s':>10} {'reserve p50':>11} {'p99':>8} {'commit p50':>10} {'p99':>8} "
        f"{'spend@1e6 p50':>13} {'p99':>8} {'errors':>6} {'load':>5}"
    )
    print()
    print(header)
    print("-" * len(header))
    for result in report["results"]:
        for run in result["runs"]:
            hot, query = run["hot"], run["spend_query"]["http"]
            cache = f"{run['auth_cache_ttl_s']:g}s"
            server = (Path(run["server_root"]).name + " " + run["serve_args"])[:24]
            cpu = hot.get("client_cpu_ms_per_commit") or float("nan")
            srv = hot.get("server_cpu_ms_per_commit") or float("nan")
            pg = hot.get("postgres_cpu_ms_per_commit") or float("nan")
            ops = hot.get("operations_per_transaction") or float("nan")
            print(
                f"{result['backend']:<10} {server:<24} {hot['client']:<6} {cpu:>6.2f} {srv:>6.2f} "
                f"{pg:>5.2f} {ops:>6.1f} {run['workers']:>7} {cache:>5} {run['clients']:>7} "
                f"{hot['commits_per_s']:>10.1f} {hot['reserve']['p50_ms']:>9.1f}ms "
                f"{hot['reserve']['p99_ms']:>6.1f}ms {hot['commit']['p50_ms']:>8.1f}ms "
                f"{hot['commit']['p99_ms']:>6.1f}ms {query['p50_ms']:>11.2f}ms "
                f"{query['p99_ms']:>6.2f}ms {hot['errors']:>6} "
                f"{run['load_average_1m_before']:>5.2f}"
            )
    print()
    print(
        "latencies in ms as the client sees them over HTTP; spend@1e6: GET .../spend on a "
        "dataset with the seeded charges; auth$: LEDGER_AUTH_CACHE_TTL_S; cpu/c: the load "
        "generator's own CPU ms per committed spend (reserve + commit); srv/c: the server's "
        "(all its processes); pg/c: PostgreSQL's (the benchmark database's backends, WAL "
        "writer, background writer, checkpointer); ops/tx: reserves + commits per spend "
        "transaction (group commit); load: 1-minute load average before the run"
    )


def print_side_by_side(paths: Sequence[Path]) -> None:
    """Print the hot-loop figures of several saved runs (``--out`` files: one per code tree, each
    run with its own tree's benchmark, interleaved) side by side, per backend, with each figure's
    ratio to the first file's. Trees whose databases cannot be shared (an older migration head)
    are compared this way: run each tree's own ``bench/ledger.py``, then ``--compare``."""
    rows: dict[str, list[tuple[str, dict[str, Any], float]]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        for result in report["results"]:
            for run in result["runs"]:
                label = f"{Path(run['server_root']).name} {run['serve_args']}".strip() + f" ({path.name})"
                rows.setdefault(result["backend"], []).append(
                    (label, run["hot"], run["load_average_1m_before"])
                )
    figures = (
        ("commits/s", lambda h: h["commits_per_s"]),
        ("srv ms/c", lambda h: h.get("server_cpu_ms_per_commit")),
        ("pg ms/c", lambda h: h.get("postgres_cpu_ms_per_commit")),
        ("ops/tx", lambda h: h.get("operations_per_transaction")),
        ("res p99", lambda h: h["reserve"]["p99_ms"]),
        ("com p99", lambda h: h["commit"]["p99_ms"]),
    )
    for backend, runs in rows.items():
        print(f"\n{backend}: each figure, and in brackets its ratio to the first row's")
        print(f"{'tree (file)':<44}" + "".join(f"{name:>18}" for name, _ in figures) + f"{'load':>7}")
        base = runs[0][1]
        for label, hot, load in runs:
            cells = []
            for _, get in figures:
                value, first = get(hot), get(base)
                if value is None:
                    cells.append(f"{'-':>18}")
                    continue
                ratio = f"({value / first:.2f}x)" if first else ""
                cells.append(f"{value:>10.2f} {ratio:>7}")
            print(f"{label[:44]:<44}" + "".join(cells) + f"{load:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", default="sqlite,postgres", help="comma-separated: sqlite, postgres (default both)"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("LEDGER_TEST_POSTGRES_URL"),
        help="PostgreSQL server URL (default: LEDGER_TEST_POSTGRES_URL)",
    )
    parser.add_argument(
        "--clients", default="32", help="concurrent clients; comma-separated for several runs (default 32)"
    )
    parser.add_argument(
        "--workers", default="1", help="uvicorn worker processes; comma-separated (default 1)"
    )
    parser.add_argument(
        "--auth-cache-ttl",
        default="0",
        help="LEDGER_AUTH_CACHE_TTL_S of the server; comma-separated (default 0)",
    )
    parser.add_argument(
        "--client",
        default="raw",
        help="hot-loop HTTP client: raw (asyncio, hand-built HTTP/1.1) or httpx;"
        " comma-separated for both (default raw)",
    )
    parser.add_argument(
        "--servers",
        default=".",
        help="';'-separated server variants, each 'DIR [ledger serve args]': the "
        "code in DIR ('.' this checkout; another, e.g. `git archive HEAD | tar -x"
        " -C DIR`, serves that code) with extra arguments (LEDGER_X=value ones "
        "set the server's environment), for side-by-side comparisons in one run,"
        " e.g. '.;. --loop asyncio --http h11;. LEDGER_DB_POOL_SIZE=40' "
        "(default '.')",
    )
    parser.add_argument(
        "--duration", type=float, default=15.0, help="seconds of reserve+commit per run (default 15)"
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds (default 2)")
    parser.add_argument(
        "--charges",
        type=int,
        default=1_000_000,
        help="committed charges seeded for the spend query (default 10^6)",
    )
    parser.add_argument("--spend-queries", type=int, default=300, help="spend queries timed (default 300)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ledger.json")
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print saved runs (--out files) side by side, ratios to the first; runs nothing",
    )
    args = parser.parse_args(argv)
    if args.compare:
        print_side_by_side(args.compare)
        return 0
    args.clients = [int(c) for c in args.clients.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.auth_cache_ttl = [float(t) for t in args.auth_cache_ttl.split(",")]
    args.client = [c.strip() for c in args.client.split(",")]
    if not set(args.client) <= {"raw", "httpx"}:
        parser.error("--client: raw and/or httpx")
    args.servers = [
        (str(ROOT) if v.split()[0] == "." else v.split()[0], " ".join(v.split()[1:]))
        for v in args.servers.split(";")
        if v.strip()
    ]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    report: dict[str, Any] = {
        "benchmark": "bench/ledger.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_at_start": os.getloadavg()[0],
        },
        "settings": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "charges": args.charges,
            "hot_charge_epsilon": HOT_CHARGE,
            "seed_charge_epsilon": SEED_CHARGE,
        },
        "targets": {"postgres_commits_per_s": 500, "postgres_p99_ms": 100, "spend_query_ms_at_1e6": 20},
        "results": [],
    }
    for backend in backends:
        report["results"].append(run_backend(backend, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
