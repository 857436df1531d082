"""Charges over many batches: cost grows with the distinct states touched, not the batch count
(issue 15). Printed, and written as JSON (``--json``, default ``bench/results/scale.json``):

* ``ratio``: reserve + commit of one charge over ``--wide`` batches (default 10 000) against the
  same over 10, on a ``basic`` and an ``rdp`` budget (target ≤ 20×), and the commit answer's bytes
  (target ≤ 256 KB);
* ``heterogeneous``: the same wide charge after 100 earlier charges of different ε on 100 groups
  of its batches, so they are in 100 states (the number of classes it decided on is printed);
* ``large``: ``--large`` batches (default 10⁶) of ``--records`` records each, created through the
  ledger (records/s), one reserve + commit over all of them: the first (it reads every batch id
  for the batch set; on trees before batches were born compact it also made the tasks compact)
  and the median of 3 more (time, batch-charges/s next to Halo's 81 M bucket charges in under a
  minute ≈ 1.35 M/s, the ratio to the same charge over a 10-batch dataset: target ≤ 20×, the
  commit answer: target ≤ 16 KB, and the peak Python memory of the charge), and the spend
  query's p50 / p99 over 200 calls (target < 5 ms);
* ``create``: ``--create`` batches (default 10⁶) of ``--records`` records each, in requests of
  10 000 batches, each request built before its timing starts: wall time, this process's CPU and
  (PostgreSQL) the CPU of the dataset's server backends, per record (target ≥ 250 000
  records/s at 10⁷ records);
* ``spend``: the spend query (``GET /v1/datasets/{id}/spend``'s ``get_spend``) on a ``parallel``
  ``rdp`` budget — a rule whose guarantee was also derived from the batches — over ``--spend``
  batches (default 10⁶, one record each, tasks of 10 000) after one charge on all of them: p50 /
  p99 of ``--spend-calls`` calls (default 1000; stopped after 60 s, the count printed), target
  p99 < 5 ms;
* ``beside``: reserve + commit over a 10-batch task (by task, and by its 10 batch ids) on a
  fresh dataset and on one that also holds a ``--beside``-batch task (default 10⁶, one record
  each): the median of 7 charges each, alternating between the two, and their ratio (target
  ≤ 3×: no cost grows with what a charge does not touch).

Through the ledger's own functions (``service.ledger``) on a fresh database: the server's work
without HTTP. Usage (repository root)::

    python bench/scale.py [--backend sqlite|postgresql] [--postgres-url URL] [--large 1000000]
        [--records 10] [--wide 10000] [--beside 1000000] [--create 1000000]
        [--spend 1000000] [--spend-calls 1000]
        [--cases ratio,heterogeneous,large,beside,create,spend]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from bench.ledger import fresh_database  # noqa: E402
from service.db import migrations  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import batches, datasets, reservations, spent, tenancy  # noqa: E402

TENANT = "bench"
RESULTS = ROOT / "bench" / "results" / "scale.json"
HALO_CHARGES_PER_S = 81e6 / 60
BUDGETS = {
    "basic": {"rule": "sequential", "epsilon": "1000", "delta": "0", "accountant": "basic"},
    "rdp": {"rule": "sequential", "epsilon": "1000", "delta": "1e-5", "accountant": "rdp"},
}
PARALLEL_RDP = {"rule": "parallel", "epsilon": "1000", "delta": "1e-5", "accountant": "rdp"}
EVENTS = {
    "basic": {"kind": "pure_dp", "epsilon": 0.01},
    "rdp": {
        "kind": "self_composed",
        "count": 1000,
        "event": {
            "kind": "poisson_sampled",
            "sampling_probability": 0.01,
            "event": {"kind": "gaussian", "noise_multiplier": 1.1},
        },
    },
}
PER_REQUEST = 10_000  # batches per create_batches call (the API's limit)
REPEATS = 7  # charges timed per size in the ratio (the median is reported: a few ms vary most)


def make_dataset(
    db: Database,
    accountant: str,
    count: int,
    records: int,
    name: str = "",
    budget: dict[str, str] | None = None,
) -> tuple[str, list[str], float]:
    """A dataset of ``count`` batches in tasks of ``PER_REQUEST``: (id, task ids, seconds)."""
    name = name or f"{accountant}-{count}"
    ds = datasets.create_dataset(db, TENANT, name=name, budget=budget or BUDGETS[accountant]).id
    tasks: list[str] = []
    started = time.perf_counter()
    for start in range(0, count, PER_REQUEST):
        task = batches.create_task(db, TENANT, ds, name=f"task-{start}").id
        tasks.append(task)
        size = min(PER_REQUEST, count - start)
        batches.create_batches(
            db,
            TENANT,
            ds,
            task,
            batches=[
                {"name": f"b{start + i}", "records": [f"r{start + i}-{j}" for j in range(records)]}
                for i in range(size)
            ],
        )
    return ds, tasks, time.perf_counter() - started


_versions = iter(range(10**9))


def charge(
    db: Database,
    ds: str,
    accountant: str,
    *,
    tasks: list[str] | None = None,
    batch_ids: list[str] | None = None,
) -> tuple[float, int, dict[str, Any]]:
    """One reserve + commit: (seconds, commit answer bytes, reservation answer)."""
    started = time.perf_counter()
    held = reservations.reserve(
        db,
        TENANT,
        ds,
        event=reservations.parse_event(EVENTS[accountant]),
        task_ids=tasks,
        batch_ids=batch_ids,
    )
    answer = reservations.commit(
        db, TENANT, held.id, release={"model": "scale", "version": str(next(_versions))}
    )
    seconds = time.perf_counter() - started
    return seconds, len(json.dumps(answer.to_json())), held.to_json()


def ratio(db: Database, wide: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for accountant in BUDGETS:
        row: dict[str, Any] = {}
        for count in (10, wide):
            ds, tasks, _ = make_dataset(db, accountant, count, 5)
            charge(db, ds, accountant, tasks=tasks)  # the first prices the event (memoised after)
            runs = [charge(db, ds, accountant, tasks=tasks) for _ in range(REPEATS)]
            row[str(count)] = {
                "seconds": statistics.median(r[0] for r in runs),
                "commit_bytes": max(r[1] for r in runs),
            }
        row["ratio"] = row[str(wide)]["seconds"] / row["10"]["seconds"]
        out[accountant] = row
        print(
            f"{accountant:>5}: reserve+commit over 10 batches {row['10']['seconds'] * 1e3:7.1f} ms, over "
            f"{wide} {row[str(wide)]['seconds'] * 1e3:7.1f} ms: {row['ratio']:.1f}x (target <= 20x); commit "
            f"answer {row[str(wide)]['commit_bytes'] / 1024:.1f} KB (target <= 256 KB)"
        )
    return out


def heterogeneous(db: Database, wide: int) -> dict[str, Any]:
    ds, tasks, _ = make_dataset(db, "basic", wide, 5, name=f"heterogeneous-{wide}")
    ids = [b.id for t in tasks for b in batches_of(db, ds, t)]
    for k in range(100):  # earlier charges on 100 groups, each its own ε: 100 distinct states
        group = ids[k * wide // 100 : (k + 1) * wide // 100]
        event = {"kind": "pure_dp", "epsilon": 0.001 * (k + 1)}
        held = reservations.reserve(db, TENANT, ds, event=reservations.parse_event(event), batch_ids=group)
        reservations.commit(db, TENANT, held.id, release={"model": "scale", "version": str(next(_versions))})
    seconds, size, held = charge(db, ds, "basic", tasks=tasks)
    classes = len(held["batches"]["classes"])
    print(
        f"heterogeneous: {wide} batches in {classes} states: reserve+commit {seconds * 1e3:.1f} ms, "
        f"answer {size / 1024:.1f} KB"
    )
    return {"batches": wide, "classes": classes, "seconds": seconds, "commit_bytes": size}


def batches_of(db: Database, ds: str, task: str) -> tuple[batches.BatchAnswer, ...]:
    return batches.list_batches(db, TENANT, ds, task_id=task).data


def large(db: Database, count: int, records: int) -> dict[str, Any]:
    ds, tasks, created_s = make_dataset(db, "basic", count, records)
    rate = count * records / created_s
    print(
        f"created {count} batches ({count * records} records) in {created_s:.1f} s: {rate:,.0f} "
        "records/s (goal >= 100,000)"
    )
    pids = _backend_pids(db)
    cpu, backend = time.process_time(), _backend_cpu_s(pids)
    first = charge(db, ds, "basic", tasks=tasks)[0]  # all batches in the empty state, never read
    first_cpu, first_server = time.process_time() - cpu, _backend_cpu_s(pids) - backend
    print(
        f"first reserve+commit over {count} batches: {first:.2f} s, this process {first_cpu:.2f} s CPU"
        + (f", PostgreSQL {first_server:.2f} s" if pids else "")
    )
    runs = [charge(db, ds, "basic", tasks=tasks) for _ in range(3)]
    seconds, size = statistics.median(r[0] for r in runs), max(r[1] for r in runs)
    tracemalloc.start()
    charge(db, ds, "basic", tasks=tasks)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    small, small_tasks, _ = make_dataset(db, "basic", 10, records, name=f"small-{count}")
    charge(db, small, "basic", tasks=small_tasks)  # the first prices the event (memoised after)
    small_s = statistics.median(charge(db, small, "basic", tasks=small_tasks)[0] for _ in range(REPEATS))
    per_s = count / seconds
    print(
        f"reserve+commit over {count} batches: first {first:.2f} s, then {seconds * 1e3:.1f} ms "
        f"({per_s:,.0f} batch-charges/s, {per_s / HALO_CHARGES_PER_S:.2f}x Halo's 1.35 M/s); over 10 "
        f"batches {small_s * 1e3:.1f} ms: {seconds / small_s:.1f}x (target <= 20x); answer "
        f"{size / 1024:.1f} KB (target <= 16 KB), peak Python memory {peak / 2**20:.1f} MiB"
    )
    times = []
    for _ in range(200):
        started = time.perf_counter()
        spent.get_spend(db, TENANT, ds).to_json()
        times.append(time.perf_counter() - started)
    times.sort()
    p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99) - 1]
    print(f"spend query at {count} batches: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms (target < 5 ms)")
    return {
        "batches": count,
        "records": count * records,
        "create_s": created_s,
        "records_per_s": rate,
        "first_charge_s": first,
        "first_charge_cpu_s": first_cpu,
        "first_charge_server_cpu_s": first_server if pids else None,
        "charge_s": seconds,
        "charge_10_batches_s": small_s,
        "ratio_to_10_batches": seconds / small_s,
        "batch_charges_per_s": per_s,
        "halo_ratio": per_s / HALO_CHARGES_PER_S,
        "charge_peak_python_mib": peak / 2**20,
        "commit_bytes": size,
        "spend_p50_ms": p50 * 1e3,
        "spend_p99_ms": p99 * 1e3,
    }


def spend_query(db: Database, count: int, calls: int) -> dict[str, Any]:
    """p50 / p99 of ``calls`` spend queries on a ``parallel`` ``rdp`` dataset of ``count``
    batches, charged once on all of them (stopped after 60 s)."""
    ds, tasks, _ = make_dataset(db, "rdp", count, 1, name=f"spend-{count}", budget=PARALLEL_RDP)
    charge(db, ds, "rdp", tasks=tasks)
    spent.get_spend(db, TENANT, ds).to_json()  # the first reads the dataset's rows into the caches
    times: list[float] = []
    deadline = time.perf_counter() + 60
    while len(times) < calls and time.perf_counter() < deadline:
        started = time.perf_counter()
        spent.get_spend(db, TENANT, ds).to_json()
        times.append(time.perf_counter() - started)
    times.sort()
    p50, p99 = times[len(times) // 2], times[max(0, int(len(times) * 0.99) - 1)]
    print(
        f"spend query, parallel rdp, {count} batches: {len(times)} calls, p50 {p50 * 1e3:.2f} ms, "
        f"p99 {p99 * 1e3:.2f} ms (target < 5 ms)"
    )
    return {"batches": count, "calls": len(times), "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3}


def _backend_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these (local) server processes, from ``/proc``."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _backend_pids(db: Database) -> list[int]:
    """The PostgreSQL backends of the benchmark's database, where they run on this machine."""
    if db.engine.dialect.name != "postgresql":
        return []
    with db.session(readonly=True) as session:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        return [p for p in session.scalars(text(query)) if Path(f"/proc/{p}/stat").exists()]


def create(db: Database, count: int, records: int) -> dict[str, Any]:
    """``count`` batches of ``records`` records, timed per request (the request built first)."""
    ds = datasets.create_dataset(db, TENANT, name=f"create-{count}", budget=BUDGETS["basic"]).id
    pids = _backend_pids(db)
    wall = client = server = 0.0
    for start in range(0, count, PER_REQUEST):
        task = batches.create_task(db, TENANT, ds, name=f"task-{start}").id
        size = min(PER_REQUEST, count - start)
        request = [
            {"name": f"b{start + i}", "records": [f"r{start + i}-{j}" for j in range(records)]}
            for i in range(size)
        ]
        cpu, backend, started = time.process_time(), _backend_cpu_s(pids), time.perf_counter()
        batches.create_batches(db, TENANT, ds, task, batches=request)
        wall += time.perf_counter() - started
        client += time.process_time() - cpu
        server += _backend_cpu_s(pids) - backend
    total = count * records
    line = (
        f"created {count} batches ({total} records): {total / wall:,.0f} records/s "
        f"(goal >= 250,000), this process {client / total * 1e6:.1f} µs CPU a record"
    )
    if pids:
        line += f", PostgreSQL {server / total * 1e6:.1f} µs"
    print(line + f"; CPU-bound rate {total / (client + server):,.0f} records/s")
    return {
        "batches": count,
        "records": total,
        "create_s": wall,
        "records_per_s": total / wall,
        "client_cpu_us_per_record": client / total * 1e6,
        "server_cpu_us_per_record": server / total * 1e6 if pids else None,
        "cpu_bound_records_per_s": total / (client + server),
    }


def beside(db: Database, count: int) -> dict[str, Any]:
    """A 10-batch charge on a fresh dataset against the same beside a ``count``-batch task. Both
    datasets exist before anything is timed and their charges alternate, so what the bulk
    creation leaves running (PostgreSQL's checkpoint and autovacuum, SQLite's WAL) weighs on
    both alike."""
    big, _, created_s = make_dataset(db, "basic", count, 1, name=f"beside-{count}")
    fresh = datasets.create_dataset(db, TENANT, name=f"fresh-{count}", budget=BUDGETS["basic"]).id
    small: dict[str, tuple[str, str, list[str]]] = {}
    for label, ds in (("fresh", fresh), ("beside", big)):
        task = batches.create_task(db, TENANT, ds, name="small").id
        made = batches.create_batches(
            db, TENANT, ds, task, batches=[{"name": f"s{i}", "records": [f"s{i}"]} for i in range(10)]
        )
        small[label] = (ds, task, [b.id for b in made.data])
        charge(db, ds, "basic", tasks=[task])  # the first prices the event (memoised after)
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(REPEATS):
        for label, (ds, task, ids) in small.items():
            runs.setdefault((label, "by_task"), []).append(charge(db, ds, "basic", tasks=[task])[0])
            runs.setdefault((label, "by_ids"), []).append(charge(db, ds, "basic", batch_ids=ids)[0])
    out: dict[str, Any] = {"beside_batches": count, "create_s": created_s}
    for (label, how), seconds in runs.items():
        out.setdefault(label, {})[f"{how}_s"] = statistics.median(seconds)
    for how in ("by_task", "by_ids"):
        out[f"ratio_{how}"] = out["beside"][f"{how}_s"] / out["fresh"][f"{how}_s"]
    print(
        f"10-batch charge by task: fresh {out['fresh']['by_task_s'] * 1e3:.1f} ms, beside {count} batches "
        f"{out['beside']['by_task_s'] * 1e3:.1f} ms ({out['ratio_by_task']:.1f}x); by ids: fresh "
        f"{out['fresh']['by_ids_s'] * 1e3:.1f} ms, beside {out['beside']['by_ids_s'] * 1e3:.1f} ms "
        f"({out['ratio_by_ids']:.1f}x) (target <= 3x)"
    )
    return out


@contextmanager
def bench_database(backend: str, postgres_url: str | None) -> Iterator[Database]:
    """A fresh, migrated database (a temporary SQLite file, or a new PostgreSQL database) with the
    benchmark's tenant, disposed of afterwards."""
    with (
        tempfile.TemporaryDirectory() as workdir,
        fresh_database(backend, postgres_url, Path(workdir)) as url,
    ):
        migrations.upgrade(url)
        db = Database(url)
        try:
            tenancy.create_tenant(db, TENANT)
            yield db
        finally:
            db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--wide", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000, help="0 skips the large case")
    parser.add_argument("--records", type=int, default=10)
    parser.add_argument("--beside", type=int, default=1_000_000)
    parser.add_argument("--create", type=int, default=1_000_000, help="batches of the create case")
    parser.add_argument("--spend", type=int, default=1_000_000, help="batches of the spend case")
    parser.add_argument("--spend-calls", type=int, default=1000)
    parser.add_argument("--cases", default="ratio,heterogeneous,large,beside,create,spend")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    with bench_database(args.backend, args.postgres_url) as db:
        print(f"backend: {args.backend}")
        cases = set(args.cases.split(","))
        result: dict[str, Any] = {"backend": args.backend}
        if "ratio" in cases:
            result["ratio"] = ratio(db, args.wide)
        if "heterogeneous" in cases:
            result["heterogeneous"] = heterogeneous(db, args.wide)
        if args.large and "large" in cases:
            result["large"] = large(db, args.large, args.records)
        if args.beside and "beside" in cases:
            result["beside"] = beside(db, args.beside)
        if args.create and "create" in cases:
            result["create"] = create(db, args.create, args.records)
        if args.spend and "spend" in cases:
            result["spend"] = spend_query(db, args.spend, args.spend_calls)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"written: {args.json}")


if __name__ == "__main__":
    main()
