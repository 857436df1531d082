"""Where batch creation's time goes (issue 26), two ways:

* ``phases``: ``--create`` batches × 10 records through ``batches.create_batches`` (requests of
  10 000 batches, as ``bench/scale.py``'s create case), with this process's CPU — and on
  PostgreSQL the dataset's server backends' CPU — counted per phase: parsing and checking the
  ids, the HMAC, inserting the records (on PostgreSQL: their ``COPY``; also the batches' ``COPY``),
  and the whole call. Per record, in µs.
* ``tree``: the ``batch_records`` layout alone, driven by raw ``sqlite3`` / ``psycopg`` with
  random 32-byte hashes in transactions of 10⁵ rows: per transaction, the CPU a row and what
  the transaction wrote — on SQLite the WAL pages of the commit (checkpointed after each), on
  PostgreSQL the WAL bytes — as the table grows to ``--rows``. What a random-key B-tree costs
  as it outgrows what a commit touches.

Usage (repository root; ``--tree`` works on any tree, ``phases`` on this one's schema)::

    python bench/create_phases.py phases [--backend sqlite|postgresql] [--create 50000]
    python bench/create_phases.py tree [--backend sqlite|postgresql] [--rows 3000000] [--cache-mib 64]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sqlite3
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import event, text  # noqa: E402

from bench.ledger import fresh_database  # noqa: E402
from service.db import migrations  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import batches, datasets, tenancy  # noqa: E402

TENANT = "bench"
PER_REQUEST = 10_000
TRANSACTION = 100_000


def _backend_cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def phases(backend: str, postgres_url: str | None, count: int) -> None:
    spent: dict[str, list[float]] = {}
    pids: list[int] = []

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            cpu, server = time.process_time(), _backend_cpu_s(pids)
            try:
                return function(*args, **kwargs)
            finally:
                entry = spent.setdefault(name, [0.0, 0.0])
                entry[0] += time.process_time() - cpu
                entry[1] += _backend_cpu_s(pids) - server

        return call

    batches._parse_batches = counted("parse and check ids", batches._parse_batches)
    batches.record_hashes = counted("HMAC", batches.record_hashes)
    batches.insert_records = counted("records insert", batches.insert_records)
    batches._copy = counted("batches COPY", batches._copy)
    batches._insert_batches = counted("batches INSERT", batches._insert_batches)
    whole_call = counted("whole call", batches.create_batches)
    inside: list[bool] = []

    def create(*args: Any, **kwargs: Any) -> Any:
        inside.append(True)
        try:
            return whole_call(*args, **kwargs)
        finally:
            inside.pop()

    with (
        tempfile.TemporaryDirectory() as workdir,
        fresh_database(backend, postgres_url, Path(workdir)) as url,
    ):
        migrations.upgrade(url)
        db = Database(url, pool_size=1, max_overflow=0)
        _count_statements(db, spent, lambda: pids, inside)
        do_commit = db.engine.dialect.do_commit
        counted_commit = counted("COMMIT", do_commit)

        def commit(connection: Any) -> None:
            (counted_commit if inside else do_commit)(connection)

        db.engine.dialect.do_commit = commit  # type: ignore[method-assign]
        try:
            tenancy.create_tenant(db, TENANT)
            budget = {"rule": "sequential", "epsilon": "1000", "delta": "0", "accountant": "basic"}
            ds = datasets.create_dataset(db, TENANT, name="phases", budget=budget).id
            if backend == "postgresql":
                with db.session(readonly=True) as session:
                    query = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                    pids = [p for p in session.scalars(text(query)) if Path(f"/proc/{p}/stat").exists()]
            for start in range(0, count, PER_REQUEST):
                task = batches.create_task(db, TENANT, ds, name=f"task-{start}").id
                request = [
                    {"name": f"b{start + i}", "records": [f"r{start + i}-{j}" for j in range(10)]}
                    for i in range(min(PER_REQUEST, count - start))
                ]
                create(db, TENANT, ds, task, batches=request)
        finally:
            db.dispose()
    records = count * 10
    print(f"{backend}: {count} batches, {records} records; µs a record, this process / server")
    whole = spent.pop("whole call")
    rest = [whole[0], whole[1]]
    for name, (cpu, server) in spent.items():
        print(f"  {name:40s} {cpu / records * 1e6:5.2f} / {server / records * 1e6:5.2f}")
        rest[0], rest[1] = rest[0] - cpu, rest[1] - server
    label = "the rest (Python of the call)"
    print(f"  {label:41s} {rest[0] / records * 1e6:5.2f} / {rest[1] / records * 1e6:5.2f}")
    print(f"  {'whole call':40s} {whole[0] / records * 1e6:5.2f} / {whole[1] / records * 1e6:5.2f}")


def _count_statements(
    db: Database, spent: dict[str, list[float]], pids: Callable[[], list[int]], inside: list[bool]
) -> None:
    """Every statement SQLAlchemy runs inside ``create_batches``, counted as
    ``spent["SQL: " + its first words]`` (the driver's own COPY and executemany are counted by
    their functions)."""
    started: list[tuple[float, float]] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def before(*_: Any) -> None:
        started.append((time.process_time(), _backend_cpu_s(pids())))

    @event.listens_for(db.engine, "after_cursor_execute")
    def after(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        cpu, server = started.pop()
        if not inside:
            return
        entry = spent.setdefault("SQL: " + " ".join(statement.split()[:4])[:35], [0.0, 0.0])
        entry[0] += time.process_time() - cpu
        entry[1] += _backend_cpu_s(pids()) - server


def tree(backend: str, postgres_url: str | None, rows: int, cache_mib: int) -> None:
    print(f"{backend}: batch_records alone, transactions of {TRANSACTION} random hashes")
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as workdir:
            _sqlite_tree(Path(workdir) / "tree.db", rows, cache_mib)
        return
    with (
        tempfile.TemporaryDirectory() as workdir,
        fresh_database(backend, postgres_url, Path(workdir)) as url,
    ):
        _postgres_tree(url.replace("postgresql+psycopg://", "postgresql://"), rows)


def _hashes(batch_key: int) -> list[tuple[bytes, int]]:
    return sorted((hashlib.sha256(os.urandom(16)).digest(), batch_key + i // 10) for i in range(TRANSACTION))


def _sqlite_tree(path: Path, rows: int, cache_mib: int) -> None:
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA cache_size=-{cache_mib * 1024}")  # the ledger's: 64 MiB
    connection.execute("PRAGMA wal_autocheckpoint=0")  # checkpointed below, after each commit
    connection.execute(
        "CREATE TABLE batch_records (dataset_key BIGINT, record_hash BLOB, batch_key BIGINT NOT NULL,"
        " PRIMARY KEY (dataset_key, record_hash)) WITHOUT ROWID"
    )
    connection.execute("CREATE INDEX ix ON batch_records (dataset_key, batch_key)")
    done = 0
    while done < rows:
        made = [(7, digest, key) for digest, key in _hashes(done // 10)]
        cpu = time.process_time()
        connection.execute("BEGIN IMMEDIATE")
        connection.executemany("INSERT INTO batch_records VALUES (?, ?, ?)", made)
        connection.execute("COMMIT")
        insert = time.process_time() - cpu
        _, pages, _ = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        checkpoint = time.process_time() - cpu - insert
        done += TRANSACTION
        if done % (rows // 6) < TRANSACTION:
            print(
                f"  {done:>9} rows: the commit wrote {pages} pages "
                f"({pages * 4096 / TRANSACTION:.0f} B a row); "
                f"CPU insert + commit {insert / TRANSACTION * 1e6:.2f} µs, checkpoint "
                f"{checkpoint / TRANSACTION * 1e6:.2f} µs a row"
            )
    connection.close()


def _postgres_tree(dsn: str, rows: int) -> None:
    import psycopg

    prefix = struct.Struct(">hiqiqi")
    with psycopg.connect(dsn) as connection:
        connection.execute(
            "CREATE TABLE batch_records (dataset_key int8 NOT NULL, record_hash bytea NOT NULL,"
            " batch_key int8 NOT NULL, PRIMARY KEY (dataset_key, record_hash))"
        )
        connection.execute("CREATE INDEX ix ON batch_records (dataset_key, batch_key)")
        connection.commit()
        pid = connection.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        done = 0
        while done < rows:
            made = _hashes(done // 10)
            body = b"".join(chain.from_iterable((prefix.pack(3, 8, 7, 8, k, 32), d) for d, k in made))
            before = connection.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            server = _backend_cpu_s([pid])
            with (
                connection.cursor() as cursor,
                cursor.copy(
                    "COPY batch_records (dataset_key, batch_key, record_hash) FROM STDIN (FORMAT BINARY)"
                ) as copy,
            ):
                copy.write(b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8 + body + b"\xff\xff")
            connection.commit()
            server = _backend_cpu_s([pid]) - server
            wal = connection.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (before,)
            ).fetchone()[0]  # type: ignore[index]
            done += TRANSACTION
            if done % (rows // 6) < TRANSACTION:
                size = connection.execute("SELECT pg_total_relation_size('batch_records')").fetchone()[0]  # type: ignore[index]
                print(
                    f"  {done:>9} rows: server CPU {server / TRANSACTION * 1e6:.2f} µs, "
                    f"WAL {float(wal) / TRANSACTION:.0f} B a row; table and indexes {size / 1e6:.0f} MB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("phases", "tree"))
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--postgres-url", default=os.environ.get("LEDGER_TEST_POSTGRES_URL"))
    parser.add_argument("--create", type=int, default=50_000, help="batches (× 10 records) for phases")
    parser.add_argument("--rows", type=int, default=3_000_000, help="rows for tree")
    parser.add_argument("--cache-mib", type=int, default=64, help="SQLite's page cache for tree")
    args = parser.parse_args()
    if args.what == "phases":
        phases(args.backend, args.postgres_url, args.create)
    else:
        tree(args.backend, args.postgres_url, args.rows, args.cache_mib)


if __name__ == "__main__":
    main()
