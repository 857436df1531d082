"""Fault runs at full size (the CI-sized versions are tests/faults): prints figures, writes JSON.

* ``kill -9`` of ``ledger serve`` at random points of ``--cycles`` reserve/commit cycles, with
  ``--kills`` kills (default cycles/10), on SQLite and PostgreSQL. After the last restart and the
  reservation TTL: acknowledged commits lost, releases / committed reservations without a
  certificate, reservations still open, spend vs the sum of committed charges, ``ledger verify``.
* ``kill -9`` of ``ledger worker`` at random points of ``--worker-cycles`` training jobs (default
  ``--cycles``; tiny DP-SGD runs on ``builtin:digits``, each a reserve and two commit → publish
  steps), with ``--worker-kills`` kills (default cycles/10), on SQLite and PostgreSQL
  (``tests/faults/worker_kills.py``). After every job ended: certificates seen during the run and
  lost, versions without a certificate of their release, certified releases not published,
  orphaned reservations and how they were freed, ``ledger verify`` and ``ledger check``.
* PostgreSQL backends killed with ``pg_terminate_backend`` (only those of the run's own database)
  every 0.25 s under ``--clients`` concurrent reserve/commit loops for ``--terminate-s`` seconds:
  the status counts (every 5xx must be a 503), two ``service.client`` loops (which retry a 503
  with the same Idempotency-Key: every cycle must succeed, no commit lost), then the same load
  with the killer stopped.
* PostgreSQL itself restarted under load (``--parts pg-restart``): a throwaway cluster of its
  own (``initdb`` in a temporary folder, its own port; never the shared server), ``pg_ctl
  restart`` every ``--restart-every-s`` (alternately ``-m fast`` and ``-m immediate``, a crash
  with WAL recovery) for ``--restart-s`` seconds under the same load; ``ledger serve`` is not
  restarted (``tests/faults/pg_restart.py``).

Usage (repository root)::

    LEDGER_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        python bench/faults.py --cycles 200 [--backend sqlite|postgres|both] \\
        [--parts serve,worker,terminate,pg-restart] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.db.migrations import upgrade  # noqa: E402
from tests.conftest import PostgresServer, postgres_admin_url  # noqa: E402
from tests.faults.harness import (  # noqa: E402
    assert_kill_findings,
    kill_serve_cycles,
    terminate_backends_under_load,
)
from tests.faults.pg_restart import available, restart_postgres_under_load  # noqa: E402
from tests.faults.worker_kills import (  # noqa: E402
    assert_worker_kill_findings,
    kill_worker_cycles,
)


def _kill(url: str, cycles: int, kills: int, seed: int) -> dict[str, Any]:
    started = time.monotonic()
    run = kill_serve_cycles(url, cycles=cycles, kills=kills, seed=seed)
    ok = True
    try:
        assert_kill_findings(run)
    except AssertionError as error:
        ok = False
        print(f"  FAILED: {error}")
    return {
        "cycles": run.cycles,
        "kills": run.kills,
        "acknowledged": len(run.acknowledged),
        "in_doubt_commits": run.in_doubt,
        "lost_reserve_answers": run.reserve_lost,
        "restart_s_median": round(statistics.median(run.restart_s), 2) if run.restart_s else None,
        "wall_s": round(time.monotonic() - started, 1),
        "ok": ok,
        **{k: v for k, v in run.findings.items() if k != "verify_output"},
    }


def _kill_worker(url: str, cycles: int, kills: int, seed: int) -> dict[str, Any]:
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="faults-worker-"))
    run = kill_worker_cycles(url, folder, cycles=cycles, kills=kills, seed=seed)
    ok = True
    try:
        assert_worker_kill_findings(run)
    except AssertionError as error:
        ok = False
        print(f"  FAILED: {error}")
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "cycles": run.cycles,
        "kills": run.kills,
        "kill_modes": dict(run.modes),
        "kill_phases": dict(run.phases),
        "job_s_median": round(statistics.median(run.job_s), 2) if run.job_s else None,
        "wall_s": round(time.monotonic() - started, 1),
        "ok": ok,
        **{k: v for k, v in run.findings.items() if k not in ("verify_output", "check_output")},
        "check_output_tail": run.findings.get("check_output", "")[-300:],
    }


_LEDGER_FINDINGS = (
    "releases_without_certificate",
    "committed_without_certificate",
    "certificates",
    "committed",
    "charges_committed",
    "epsilon_spent",
    "epsilon_recomputed",
    "verify_rc",
)


def _under_load(run: Any, findings: dict[str, Any]) -> dict[str, Any]:
    """What both PostgreSQL fault runs report: the answers under load and the ledger afterwards."""
    return {
        "requests": run.requests,
        "statuses": dict(run.statuses),
        "transport_errors": run.transport_errors,
        "non_503_server_errors": sum(n for s, n in run.statuses.items() if s >= 500 and s != 503),
        "after_statuses": dict(run.after),
        "server_alive": findings["server_alive"],
        "retrying_client_cycles": run.client_cycles,
        "retrying_client_failures": len(run.client_failures),
        "retrying_client_lost_commits": findings["lost_commits"],
        **{k: findings[k] for k in _LEDGER_FINDINGS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--kills", type=int, help="default: cycles / 10")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--terminate-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--worker-cycles", type=int, help="jobs of the worker run (default: --cycles)")
    parser.add_argument("--worker-kills", type=int, help="default: worker cycles / 10")
    parser.add_argument(
        "--parts",
        default="serve,worker,terminate,pg-restart",
        help="comma-separated: serve, worker, terminate, pg-restart (default: all)",
    )
    parser.add_argument("--restart-s", type=float, default=20.0)
    parser.add_argument("--restart-every-s", type=float, default=4.0)
    parser.add_argument("--json", default="bench/results/faults.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    known = {"serve", "worker", "terminate", "pg-restart"}
    if parts - known:
        parser.error(f"unknown --parts {sorted(parts - known)}")
    kills = args.kills if args.kills is not None else max(1, args.cycles // 10)
    worker_cycles = args.worker_cycles if args.worker_cycles is not None else args.cycles
    worker_kills = args.worker_kills if args.worker_kills is not None else max(1, worker_cycles // 10)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "cycles": args.cycles,
        "kills": kills,
        "worker_cycles": worker_cycles,
        "worker_kills": worker_kills,
    }
    backends = ("sqlite", "postgres") if args.backend == "both" else (args.backend,)
    server = PostgresServer(postgres_admin_url()) if "postgres" in backends else None
    try:

        def fresh(backend: str) -> str:
            if backend == "sqlite":
                folder = tempfile.mkdtemp(prefix="faults-")
                url = f"sqlite:///{folder}/ledger.db"
            else:
                assert server is not None
                url = server.url(server.create()).render_as_string(hide_password=False)
            upgrade(url)
            return url

        for backend in backends:
            if "serve" in parts:
                print(f"[{backend}] kill -9 of ledger serve: {args.cycles} cycles, {kills} kills")
                results[f"kill_serve_{backend}"] = out = _kill(fresh(backend), args.cycles, kills, args.seed)
                print("  " + json.dumps(out))
            if "worker" in parts:
                print(f"[{backend}] kill -9 of ledger worker: {worker_cycles} jobs, {worker_kills} kills")
                results[f"kill_worker_{backend}"] = out = _kill_worker(
                    fresh(backend), worker_cycles, worker_kills, args.seed
                )
                print("  " + json.dumps(out))
            if backend == "postgres" and "terminate" in parts:
                assert server is not None
                url = server.url(server.create()).render_as_string(hide_password=False)
                upgrade(url)
                print(
                    f"[postgres] pg_terminate_backend every 0.25 s, {args.clients} clients, "
                    f"{args.terminate_s:.0f} s"
                )
                run, findings = terminate_backends_under_load(
                    url, seconds=args.terminate_s, clients=args.clients
                )
                results["pg_terminate"] = out = {
                    "terminated_backends": run.terminated,
                    **_under_load(run, findings),
                }
                print("  " + json.dumps(out))
        if "pg-restart" in parts and "postgres" in backends:
            why_not = available()
            if why_not is not None:
                print(f"[pg-restart] skipped: {why_not}")
                results["pg_restart"] = {"skipped": why_not}
            else:
                print(
                    f"[pg-restart] pg_ctl restart every {args.restart_every_s:g} s (fast / "
                    f"immediate), {args.clients} clients, {args.restart_s:.0f} s"
                )
                run, findings = restart_postgres_under_load(
                    seconds=args.restart_s, clients=args.clients, every_s=args.restart_every_s
                )
                results["pg_restart"] = out = {
                    "restarts": findings["restarts"],
                    "bad_5xx_bodies": len(run.bad_bodies),
                    "holds_left_by_503_commits": findings["open_reservations_after_ttl"],
                    **_under_load(run, findings),
                }
                print("  " + json.dumps(out))
    finally:
        if server is not None:
            server.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False]
    for part in ("pg_terminate", "pg_restart"):
        pg = results.get(part, {})
        if (
            pg.get("non_503_server_errors")
            or pg.get("retrying_client_failures")
            or pg.get("retrying_client_lost_commits")
            or pg.get("transport_errors")
            or pg.get("releases_without_certificate")
            or pg.get("committed_without_certificate")
            or pg.get("verify_rc")
            or pg.get("epsilon_spent") != pg.get("epsilon_recomputed")
        ):
            failed.append(part)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
