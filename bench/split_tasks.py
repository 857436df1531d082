"""Where a charge over tasks split across many states spends its time, per statement (issue 26).

A task whose batches are all in one state is one row (``tasks.state_id``); a task split across
states keeps a pointer per batch, and a charge over it works per batch. This builds ``--wide``
batches (tasks of 10 000) whose states are set by 100 earlier charges on 100 groups of batch
ids (100 distinct states, as ``bench/scale.py``'s ``heterogeneous`` case), then times one
reserve + commit over the whole tasks: wall, this process's CPU, and the driver's time of every
statement (SQLAlchemy's cursor events), grouped by the statement's first words. Printed, and
written as JSON (``--json``, default ``bench/results/split_tasks.json``). Usage (repository root)::

    python bench/split_tasks.py [--backend sqlite|postgresql] [--postgres-url URL] [--wide 10000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import event  # noqa: E402

from bench import scale  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import reservations  # noqa: E402

GROUPS = 100  # earlier charges, each on its own group of batches at its own ε: 100 states


def split_dataset(db: Database, wide: int) -> tuple[str, list[str]]:
    """A dataset of ``wide`` batches whose tasks are split across ``GROUPS`` states."""
    ds, tasks, _ = scale.make_dataset(db, "basic", wide, 5, name=f"split-{wide}")
    ids = [b.id for t in tasks for b in scale.batches_of(db, ds, t)]
    for k in range(GROUPS):
        group = ids[k * wide // GROUPS : (k + 1) * wide // GROUPS]
        event_json = {"kind": "pure_dp", "epsilon": 0.001 * (k + 1)}
        held = reservations.reserve(
            db, scale.TENANT, ds, event=reservations.parse_event(event_json), batch_ids=group
        )
        reservations.commit(db, scale.TENANT, held.id, release={"model": "split", "version": str(k)})
    return ds, tasks


def timed_charge(db: Database, ds: str, tasks: list[str]) -> dict[str, Any]:
    """One reserve + commit over ``tasks``, with the driver's time of each kind of statement."""
    by_statement: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    started: dict[int, float] = {}

    def before(_conn: Any, cursor: Any, *_args: Any) -> None:
        started[id(cursor)] = time.perf_counter()

    def after(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        seconds = time.perf_counter() - started.pop(id(cursor))
        row = by_statement[" ".join(statement.split()[:4])[:60]]
        row[0] += 1
        row[1] += seconds

    event.listen(db.engine, "before_cursor_execute", before)
    event.listen(db.engine, "after_cursor_execute", after)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        _seconds, answer_bytes, held = scale.charge(db, ds, "basic", tasks=tasks)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        event.remove(db.engine, "before_cursor_execute", before)
        event.remove(db.engine, "after_cursor_execute", after)
    statements = sorted(
        ({"statement": k, "count": int(n), "ms": s * 1e3} for k, (n, s) in by_statement.items()),
        key=lambda row: -row["ms"],
    )
    return {
        "classes": len(held["batches"]["classes"]),
        "wall_ms": wall * 1e3,
        "cpu_ms": cpu * 1e3,
        "answer_kb": answer_bytes / 1024,
        "statements": statements,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--wide", type=int, default=10_000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "split_tasks.json")
    args = parser.parse_args()
    with scale.bench_database(args.backend, args.postgres_url) as db:
        ds, tasks = split_dataset(db, args.wide)
        result = {"backend": args.backend, "batches": args.wide, **timed_charge(db, ds, tasks)}
    print(
        f"{args.backend}: {args.wide} batches in {result['classes']} states: reserve + commit "
        f"{result['wall_ms']:.1f} ms (this process's CPU {result['cpu_ms']:.1f} ms), answer "
        f"{result['answer_kb']:.1f} KB"
    )
    for row in result["statements"]:
        print(f"  {row['ms']:8.1f} ms  x{row['count']:<4} {row['statement']}")
    total = sum(row["ms"] for row in result["statements"])
    count = sum(row["count"] for row in result["statements"])
    print(f"  {count} statements, {total:.1f} ms in the driver; the rest is Python")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"written: {args.json}")


if __name__ == "__main__":
    main()
