"""Fault runs at full size (the CI-sized versions are tests/faults): prints figures, writes JSON.

* ``kill -9`` of ``ledger serve`` at random points of ``--cycles`` reserve/commit cycles, with
  ``--kills`` kills (default cycles/10), on SQLite and PostgreSQL. After the last restart and the
  reservation TTL: acknowledged commits lost, releases / committed reservations without a
  certificate, reservations still open, spend vs the sum of committed charges, ``ledger verify``.
* PostgreSQL backends killed with ``pg_terminate_backend`` (only those of the run's own database)
  every 0.25 s under ``--clients`` concurrent reserve/commit loops for ``--terminate-s`` seconds:
  the status counts (every 5xx must be a 503), two ``service.client`` loops (which retry a 503
  with the same Idempotency-Key: every cycle must succeed, no commit lost), then the same load
  with the killer stopped.

Usage (repository root)::

    LEDGER_TEST_POSTGRES_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        python bench/faults.py --cycles 200 [--backend sqlite|postgres|both] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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
        "cycles": run.cycles, "kills": run.kills, "acknowledged": len(run.acknowledged),
        "in_doubt_commits": run.in_doubt, "lost_reserve_answers": run.reserve_lost,
        "restart_s_median": round(statistics.median(run.restart_s), 2) if run.restart_s else None,
        "wall_s": round(time.monotonic() - started, 1), "ok": ok,
        **{k: v for k, v in run.findings.items() if k != "verify_output"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--kills", type=int, help="default: cycles / 10")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--terminate-s", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", default="bench/results/faults.json")
    args = parser.parse_args()
    kills = args.kills if args.kills is not None else max(1, args.cycles // 10)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "cycles": args.cycles, "kills": kills}
    backends = ("sqlite", "postgres") if args.backend == "both" else (args.backend,)
    server = PostgresServer(postgres_admin_url()) if "postgres" in backends else None
    try:
        for backend in backends:
            if backend == "sqlite":
                folder = tempfile.mkdtemp(prefix="faults-")
                url = f"sqlite:///{folder}/ledger.db"
            else:
                assert server is not None
                url = server.url(server.create()).render_as_string(hide_password=False)
            upgrade(url)
            print(f"[{backend}] kill -9 of ledger serve: {args.cycles} cycles, {kills} kills")
            results[f"kill_serve_{backend}"] = out = _kill(url, args.cycles, kills, args.seed)
            print("  " + json.dumps(out))
            if backend == "postgres":
                assert server is not None
                url = server.url(server.create()).render_as_string(hide_password=False)
                upgrade(url)
                print(f"[postgres] pg_terminate_backend every 0.25 s, {args.clients} clients, "
                      f"{args.terminate_s:.0f} s")
                run, findings = terminate_backends_under_load(
                    url, seconds=args.terminate_s, clients=args.clients)
                results["pg_terminate"] = out = {
                    "requests": run.requests, "statuses": dict(run.statuses),
                    "terminated_backends": run.terminated, "transport_errors": run.transport_errors,
                    "non_503_server_errors": sum(n for s, n in run.statuses.items()
                                                 if s >= 500 and s != 503),
                    "after_statuses": dict(run.after), "server_alive": findings["server_alive"],
                    "retrying_client_cycles": run.client_cycles,
                    "retrying_client_failures": len(run.client_failures),
                    "retrying_client_lost_commits": findings["lost_commits"],
                    **{k: findings[k] for k in ("releases_without_certificate",
                                                "committed_without_certificate", "certificates",
                                                "committed", "charges_committed", "epsilon_spent",
                                                "epsilon_recomputed", "verify_rc")},
                }
                print("  " + json.dumps(out))
    finally:
        if server is not None:
            server.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("ok") is False]
    pg = results.get("pg_terminate", {})
    failed += ["pg_terminate"] if pg.get("non_503_server_errors") or \
        pg.get("retrying_client_failures") or pg.get("retrying_client_lost_commits") else []
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
