"""Crash a real ``ledger worker`` process mid-job (SIGKILL) and check what survives.

While it is dead: the job is still ``running`` with its reservation holding budget, and every
published version has a committed certificate. After its lease expires, another worker takes the
job over: it settles what the dead one left (staged candidates published if committed, deleted
otherwise; the old reservation aborted — what it committed stays spent, the rest is freed) and
runs the job again to the end. At no point is a version published without a commit, and in the
end every release the ledger certified is a published version.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import URL

pytest.importorskip("torch")

from accountant.certificates import verify
from service.db.base import utcnow
from service.db.models import Release
from service.db.session import Database
from service.ledger import certificates, jobs, spent
from service.worker.worker import Worker
from tests.worker.digits_world import (
    digits_dataset,
    job_row,
    reservation,
    staged_files,
    versions_of,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 2.0


def _start_worker(url: URL, artifact_dir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_") or k == "LEDGER_HOME"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "service.cli",
        "worker",
        "--database-url",
        url.render_as_string(hide_password=False),
        "--artifact-dir",
        str(artifact_dir),
        "--lease-s",
        str(LEASE_S),
        "--poll-s",
        "0.05",
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_mid_job_then_another_worker_takes_over(
    db: Database, database_url: URL, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    world = digits_dataset(db, epsilon="10")
    job_id = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={
            "noise_multiplier": 1.5,
            "sampling_probability": 0.02,
            "steps": 600,
            "checkpoint_every": 100,
            "hidden": 16,
            "model_name": "crash-test",
        },
    ).id

    child = _start_worker(database_url, artifacts)
    try:
        deadline = time.monotonic() + 120
        while not versions_of(db, job_id):
            assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
            assert time.monotonic() < deadline, "the worker published no version in time"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    # Dead worker: the job is still running, its reservation still holds the rest.
    dead = job_row(db, job_id)
    assert dead.status == "running" and dead.attempts == 1 and dead.reservation_id is not None
    first = reservation(db, dead.reservation_id)
    assert first.status == "reserved" and first.committed_epsilon < first.epsilon
    assert spent.get_spend(db, "acme", world.dataset_id).spent.epsilon_held > 0
    for version in versions_of(db, job_id):  # nothing published without a commit
        certificate = certificates.get_certificate(db, "acme", version.certificate_id)
        assert certificate["release"] == {
            "model": "crash-test",
            "version": version.version,
            "artifact_sha256": version.artifact_sha256,
        }
        assert certificate["reservation_id"] == first.id

    # No one else may take the job while the lease lasts (asked at an instant before it ends, so a
    # loaded machine's slow checks above cannot let it lapse first); once it expired, another
    # worker does.
    live = dead.lease_expires_at - timedelta(milliseconds=1)
    assert jobs.leases.claim(db, "impatient", LEASE_S, now=live) is None, "claimed a live lease"
    time.sleep(max(0.0, (dead.lease_expires_at - utcnow()).total_seconds()) + 0.2)
    assert Worker(db, artifact_dir=artifacts, device="cpu").run_once() == job_id

    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert job.job.attempts == 2 and job.job.reservation_id != first.id
    old = reservation(db, first.id)
    assert old.status == "aborted" and old.committed_epsilon > 0  # committed stays spent
    assert reservation(db, job.job.reservation_id).status == "committed"
    ledger = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert ledger["epsilon_held"] == "0" and ledger["reservations_open"] == 0

    # Every certified release of the model is a published version, and every version certified.
    versions = versions_of(db, job_id)
    with db.session(readonly=True) as session:
        released = sorted(
            int(v) for v in session.scalars(select(Release.version).where(Release.model == "crash-test"))
        )
    assert [v.version for v in versions] == released == list(range(1, len(released) + 1))
    assert versions[-1].step == 600
    for version in versions:
        body = certificates.get_certificate(db, "acme", version.certificate_id)["certificate"]
        assert verify(body).ok
        assert (artifacts / version.artifact_path).is_file()
    assert staged_files(artifacts) == []
