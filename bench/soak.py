"""Soak: a mixed workload against ``ledger serve --workers 2`` and two ``ledger worker`` processes
on PostgreSQL (or SQLite with ``--backend sqlite``), for ``--duration`` seconds.

``--clients`` concurrent clients (asyncio, one keep-alive httpx client each) pick, per iteration:
reserve → commit (45 %), reserve → abort (15 %), spend read (25 %), certificate read (15 %), on
``--datasets`` datasets of which the first ``--hot`` take 70 % of the traffic. Budgets are small
enough that the hot datasets run out (``budget_exceeded`` 409s are expected answers, not errors).
The ``ledger worker`` processes run and poll the job queue; no training job is queued (their
RSS is sampled; training load is ``bench/training.py``'s).

Reported: throughput (requests/s, commits/s), p50/p99 latency per operation, error rate (5xx and
transport errors; 4xx other than the ledger's expected refusals count as errors too), RSS of the
server processes and the workers sampled every 5 s. At the end every dataset's spend is recomputed
from its charges (the sum of committed ε of its reservations, sequential rule) and compared with
the stored spend and with the budget: 0 over-spends is asserted. ``ledger verify`` must pass.

Usage (repository root)::

    LEDGER_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        python bench/soak.py --duration 600 [--clients 50] [--json bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import text  # noqa: E402

from service.db.migrations import upgrade  # noqa: E402
from service.db.session import Database  # noqa: E402
from tests.conftest import PostgresServer, postgres_admin_url  # noqa: E402
from tests.service.live_server import free_port  # noqa: E402

KEY = "pl_soak_bootstrap_admin_key_0123456789abcdef"
EXPECTED_REFUSALS = {"budget_exceeded", "reservation_expired", "conflict", "reservation_closed"}


def _rss_kib(pid: int) -> int:
    """RSS of ``pid`` and its children (uvicorn's worker processes), KiB."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = open(log, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


async def _client(
    n: int,
    base: str,
    datasets: list[tuple[str, str]],
    hot: int,
    until: float,
    lat: dict[str, list[float]],
    outcomes: Counter[str],
    certs: list[str],
    seed: int,
) -> None:
    rng = random.Random(seed * 1000 + n)
    async with httpx.AsyncClient(
        base_url=base, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    ) as http:

        async def call(op: str, method: str, path: str, **kw: Any) -> httpx.Response | None:
            started = time.perf_counter()
            try:
                answer = await http.request(method, path, **kw)
            except httpx.TransportError:
                outcomes["transport_error"] += 1
                return None
            lat[op].append(time.perf_counter() - started)
            if answer.status_code >= 500:
                outcomes[f"{answer.status_code}"] += 1
            elif answer.status_code >= 400:
                code = answer.json().get("error", "")
                outcomes[
                    "refused:" + code
                    if code in EXPECTED_REFUSALS
                    else f"unexpected:{answer.status_code}:{code}"
                ] += 1
            else:
                outcomes["ok"] += 1
            return answer

        i = 0
        while time.monotonic() < until:
            i += 1
            if rng.random() < 0.7 and hot:
                dataset, batch = datasets[rng.randrange(hot)]
            else:
                dataset, batch = datasets[rng.randrange(len(datasets))]
            pick = rng.random()
            if pick < 0.60:
                answer = await call(
                    "reserve",
                    "POST",
                    f"/v1/datasets/{dataset}/reservations",
                    json={"batches": [batch], "event": {"kind": "pure_dp", "epsilon": 0.01}},
                )
                if answer is None or answer.status_code != 201:
                    continue
                rid = answer.json()["id"]
                if pick < 0.45:
                    done = await call(
                        "commit",
                        "POST",
                        f"/v1/reservations/{rid}/commit",
                        json={"release": {"model": f"soak-{n}", "version": f"{seed}-{n}-{i}"}},
                    )
                    if done is not None and done.status_code == 200:
                        certs.append(done.json()["certificate"]["id"])
                else:
                    await call("abort", "POST", f"/v1/reservations/{rid}/abort")
            elif pick < 0.85:
                await call("spend", "GET", f"/v1/datasets/{dataset}/spend")
            elif certs:
                await call("certificate", "GET", f"/v1/certificates/{rng.choice(certs)}")


def _setup(base: str, datasets: int, hot: int, budget: str, hot_budget: str) -> list[tuple[str, str]]:
    out = []
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as h:
        for d in range(datasets):
            epsilon = hot_budget if d < hot else budget
            ds = h.post(
                "/v1/datasets",
                json={
                    "name": f"soak-{d}-{time.time_ns()}",
                    "budget": {"rule": "sequential", "epsilon": epsilon, "delta": "0", "accountant": "basic"},
                },
            )
            ds.raise_for_status()
            dataset = ds.json()["id"]
            task = h.post(f"/v1/datasets/{dataset}/tasks", json={"name": "t"}).json()["id"]
            made = h.post(
                f"/v1/datasets/{dataset}/tasks/{task}/batches",
                json={"batches": [{"name": "b", "records": [f"r{d}-{i}" for i in range(8)]}]},
            )
            made.raise_for_status()
            out.append((dataset, made.json()["data"][0]["id"]))
    return out


def _recompute(url: str, datasets: list[tuple[str, str]]) -> dict[str, Any]:
    db = Database(url, pool_size=1, max_overflow=0)
    over, mismatched, rows = [], [], []
    try:
        with db.engine.connect() as conn:
            for dataset, _ in datasets:
                stored, budget, charges = conn.execute(
                    text(
                        "SELECT epsilon_spent, epsilon_budget, charges_committed FROM datasets WHERE id = :d"
                    ),
                    {"d": dataset},
                ).one()
                recomputed = conn.execute(
                    text(
                        "SELECT coalesce(sum(committed_epsilon), 0), count(*) FILTER (WHERE commits > 0) "
                        "FROM reservations WHERE dataset_id = :d"
                        if db.is_postgresql
                        else "SELECT coalesce(sum(committed_epsilon), 0), sum(commits > 0) "
                        "FROM reservations WHERE dataset_id = :d"
                    ),
                    {"d": dataset},
                ).one()
                total = Decimal(str(recomputed[0]))
                rows.append(
                    {
                        "dataset": dataset,
                        "stored": str(stored),
                        "recomputed": str(total),
                        "budget": str(budget),
                        "charges": charges,
                    }
                )
                if total > Decimal(str(budget)):
                    over.append(dataset)
                if total != Decimal(str(stored)):
                    mismatched.append(dataset)
    finally:
        db.dispose()
    return {"over_spends": len(over), "stored_vs_recomputed_mismatches": len(mismatched), "datasets": rows}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--datasets", type=int, default=8)
    parser.add_argument("--hot", type=int, default=2)
    parser.add_argument("--budget", default="1000", help="ε budget of a cold dataset (default 1000)")
    parser.add_argument(
        "--hot-budget",
        default="5",
        help="ε budget of a hot dataset (default 5: spent within the first minute, "
        "so the rest of the run races reserves against an exhausted budget)",
    )
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--serve-workers", type=int, default=2)
    parser.add_argument("--ledger-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default="bench/results/soak.json")
    args = parser.parse_args()

    server = None
    if args.backend == "postgres":
        admin = postgres_admin_url()
        if admin is None:
            parser.error("set LEDGER_TEST_POSTGRES_URL (or use --backend sqlite)")
        server = PostgresServer(admin)
        url = server.url(server.create()).render_as_string(hide_password=False)
    else:
        url = f"sqlite:///{tempfile.mkdtemp(prefix='soak-')}/ledger.db"
    upgrade(url)
    logs = Path(tempfile.mkdtemp(prefix="soak-logs-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env.update(
        {
            "LEDGER_BOOTSTRAP_ADMIN_KEY": KEY,
            "LEDGER_DATABASE_URL": url,
            "LEDGER_RESERVATION_TTL_S": "30",
            "LEDGER_ARTIFACT_DIR": str(logs / "artifacts"),
        }
    )
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "backend": args.backend,
        "clients": args.clients,
        "duration_s": args.duration,
        "serve_workers": args.serve_workers,
        "ledger_workers": args.ledger_workers,
    }
    try:
        serve = _spawn(
            [
                "serve",
                "--port",
                str(port),
                "--workers",
                str(args.serve_workers),
                "--no-worker",
                "--no-access-log",
                "--log-level",
                "warning",
            ],
            env,
            logs / "serve.log",
        )
        procs.append(serve)
        for w in range(args.ledger_workers):
            procs.append(
                _spawn(["worker", "--poll-s", "1", "--worker-id", f"soak-{w}"], env, logs / f"worker-{w}.log")
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit(f"ledger serve did not start; see {logs / 'serve.log'}")
            time.sleep(0.2)
        datasets = _setup(base, args.datasets, args.hot, args.budget, args.hot_budget)
        rss: list[dict[str, Any]] = []
        stop = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                rss.append(
                    {
                        "t_s": round(time.monotonic() - started, 1),
                        "serve_kib": _rss_kib(serve.pid),
                        "workers_kib": [_rss_kib(p.pid) for p in procs[1:]],
                    }
                )
                stop.wait(5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        lat: dict[str, list[float]] = defaultdict(list)
        outcomes: Counter[str] = Counter()
        certs: list[str] = []
        until = time.monotonic() + args.duration

        async def run_all() -> None:
            await asyncio.gather(
                *(
                    _client(n, base, datasets, args.hot, until, lat, outcomes, certs, args.seed)
                    for n in range(args.clients)
                )
            )

        asyncio.run(run_all())
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
        total = sum(outcomes.values())
        errors = sum(
            n
            for k, n in outcomes.items()
            if k == "transport_error" or k[:1] == "5" or k.startswith("unexpected")
        )
        results.update(
            {
                "elapsed_s": round(elapsed, 1),
                "requests": total,
                "requests_per_s": round(total / elapsed, 1),
                "commits_per_s": round(len(lat["commit"]) / elapsed, 1),
                "error_rate": errors / total if total else None,
                "outcomes": dict(outcomes),
                "latency_ms": {
                    op: {
                        "n": len(v),
                        "p50": round(_pct(v, 0.5), 1),
                        "p99": round(_pct(v, 0.99), 1),
                        "mean": round(statistics.fmean(v) * 1000, 1),
                    }
                    for op, v in sorted(lat.items())
                },
                "rss": rss,
                "processes_alive": all(p.poll() is None for p in procs),
            }
        )
        results["spend_check"] = _recompute(url, datasets)
        verify = subprocess.run(
            [sys.executable, "-m", "service.cli", "verify", "--database-url", url],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        results["verify_rc"] = verify.returncode
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if server is not None:
            server.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    summary = {k: v for k, v in results.items() if k not in ("rss", "spend_check")}
    summary["rss_first_last"] = (results["rss"][0], results["rss"][-1]) if results["rss"] else None
    summary["over_spends"] = results["spend_check"]["over_spends"]
    summary["stored_vs_recomputed_mismatches"] = results["spend_check"]["stored_vs_recomputed_mismatches"]
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.json}; logs in {logs}")
    ok = (
        summary["over_spends"] == 0
        and summary["stored_vs_recomputed_mismatches"] == 0
        and results["verify_rc"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
