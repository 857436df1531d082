"""``ledger worker``: a standalone training worker (``service.worker.worker.Worker``).

It applies the migrations (as ``ledger serve`` does; safe when several processes start at once),
then claims jobs from ``LEDGER_DATABASE_URL`` until SIGTERM or SIGINT. Several workers may run
against one PostgreSQL database (claims use ``FOR UPDATE SKIP LOCKED``); on SQLite they take
turns (``BEGIN IMMEDIATE``). On a signal the running job stops at its next step, the rest of its
reservation is aborted and the job is queued again. A worker killed outright stops
heartbeating: its lease expires and another worker takes the job over (``service.worker.gate``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from service.commands.migrate import DATABASE_URL_HELP, database_url


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run a training worker (claims jobs, trains, releases certified model versions)",
        description="Claim training jobs and run them through the release gate until stopped.",
    )
    parser.add_argument("--database-url", help=DATABASE_URL_HELP)
    parser.add_argument(
        "--artifact-dir", type=Path, help="where model artifacts go (default: LEDGER_ARTIFACT_DIR)"
    )
    parser.add_argument("--lease-s", type=float, default=30.0, help="job lease in seconds (default 30)")
    parser.add_argument("--heartbeat-s", type=float, help="heartbeat interval in seconds (default lease/3)")
    parser.add_argument("--poll-s", type=float, default=1.0, help="idle wait between claims (default 1)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--worker-id", help="a name for this worker (default: host:pid:random)")
    parser.add_argument(
        "--once", action="store_true", help="run at most one job, then exit (0: ran one, 1: none queued)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level (default info)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from service.db import migrations
    from service.db.session import Database
    from service.settings import Settings
    from service.worker.worker import Worker

    if args.lease_s <= 0 or args.poll_s <= 0 or (args.heartbeat_s is not None and args.heartbeat_s <= 0):
        print("ledger worker: --lease-s, --heartbeat-s and --poll-s must be > 0.", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings()
    url = database_url(args)
    migrations.make_home(url)
    migrations.upgrade(url)
    database = Database(url, pool_size=2, max_overflow=2)
    # The worker signs what it commits: its keys must not orphan what earlier keys signed
    # (service.ledger.signing_custody), checked now rather than at the first job's commit.
    from service import server_secrets

    try:
        server_secrets.bind_signing_keys(database, settings)
    except server_secrets.SecretError as exc:
        database.dispose()
        print(f"ledger worker: {exc}", file=sys.stderr)
        return 2
    worker = Worker(
        database,
        artifact_dir=args.artifact_dir or settings.artifact_dir,
        reservation_ttl_s=settings.reservation_ttl_s,
        reservation_max_lifetime_s=settings.reservation_max_lifetime_s,
        worker_id=args.worker_id,
        lease_s=args.lease_s,
        heartbeat_s=args.heartbeat_s,
        poll_s=args.poll_s,
        device=args.device,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logging.getLogger("service.worker").info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"ledger worker {worker.worker_id} on {database.url.render_as_string()}", flush=True)
    try:
        if args.once:
            worker.sweep()
            return 0 if worker.run_once(stop) is not None else 1
        worker.run_forever(stop)
    finally:
        database.dispose()
    return 0
