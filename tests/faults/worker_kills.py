"""kill -9 of ``ledger worker`` at random points of training jobs (shared by tests/faults and
``bench/faults.py``). Nothing is mocked: a real ``ledger worker`` process trains tiny DP-SGD
models on ``builtin:digits`` and is killed with SIGKILL; a new one is started after each kill.

A *cycle* is one job: claim → reserve (before any data is read) → load → train → at each of its
two checkpoints stage → commit → publish → finish. The doomed cycles (chosen by ``seed``) kill
the worker

* ``timer``: at a uniformly random moment of the job, 0-1.2× the median claim-to-end time of the
  undisturbed jobs so far after the claim was seen (inside the reserve, the data load, training,
  a stage, commit or publish, or just after the job ended);
* ``after_reserve``: as soon as the job's reservation is recorded (an orphaned hold for sure);
* ``after_release``: as soon as its first version is published (a partly committed hold).

The killed job's lease (``lease_s``) expires and the next worker takes it over: it settles what
the dead attempt left (staged candidates published if their commit landed, deleted otherwise; the
old reservation aborted — what it committed stays spent) and trains it again. The last kill
leaves the worker down past the reservation TTL, so that orphan is freed by *expiry* (the
restarted worker's sweep) rather than by the retry's abort.

After every job ended: every certificate ever seen during the run is still there (no committed
spend lost), every published version has a certificate certifying exactly its ``{model,
version}`` and its artifact file, every certified release is published (roll-forward), no
reservation is still open and nothing is held, the staging area is empty, ``ledger verify``
passes, and ``ledger check`` (a real ``ledger serve --no-worker`` on the database, every
certificate re-verified offline, budget recomputed, audit chain recomputed) passes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from service.db.session import Database
from service.ledger import jobs, spent, tenancy
from tests.service.api.conftest import ROOT, start_server, stop_server
from tests.worker.digits_world import DIGITS, digits_dataset, staged_files

MODES = ("timer", "after_reserve", "after_release")


@dataclass
class WorkerKillRun:
    cycles: int = 0
    kills: int = 0
    modes: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)  # where each kill landed
    seen_certificates: set[str] = field(default_factory=set)
    orphans: set[str] = field(default_factory=set)  # reservations open when their worker died
    expiry_orphan: str | None = None  # the orphan left past its TTL (freed by expiry)
    restart_s: list[float] = field(default_factory=list)
    job_s: list[float] = field(default_factory=list)
    findings: dict[str, Any] = field(default_factory=dict)


class _Worker:
    """One ``ledger worker`` subprocess (its stderr goes to ``log``)."""

    def __init__(self, url: str, artifact_dir: Path, log: Path, *, lease_s: float, ttl_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_") or k == "LEDGER_HOME"}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LEDGER_RESERVATION_TTL_S=str(ttl_s))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.log = log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.cli",
                "worker",
                "--database-url",
                url,
                "--artifact-dir",
                str(artifact_dir),
                "--lease-s",
                str(lease_s),
                "--poll-s",
                "0.02",
                "--device",
                "cpu",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.log.close()


class _Probe:
    """Reads the job tables from the harness's own connection (polled every few ms)."""

    def __init__(self, url: str) -> None:
        self.db = Database(make_url(url), pool_size=1, max_overflow=0)

    def one(self, sql: str, **params: Any) -> Any:
        with self.db.engine.connect() as conn:
            return conn.execute(text(sql), params).first()

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.db.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def job(self, job_id: str) -> Any:
        return self.one("SELECT status, reservation_id, attempts FROM jobs WHERE id = :j", j=job_id)

    def versions(self, job_id: str) -> int:
        return int(self.scalar("SELECT count(*) FROM model_versions WHERE job_id = :j", j=job_id))

    def certificates(self) -> set[str]:
        with self.db.engine.connect() as conn:
            return {row[0] for row in conn.execute(text("SELECT id FROM certificates"))}

    def open_reservations(self) -> set[str]:
        with self.db.engine.connect() as conn:
            return {
                row[0] for row in conn.execute(text("SELECT id FROM reservations WHERE status = 'reserved'"))
            }

    def wait(
        self,
        predicate: Any,
        timeout_s: float,
        what: str,
        worker: _Worker | None = None,
        every_s: float = 0.005,
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if worker is not None and worker.process.poll() is not None:
                raise AssertionError(
                    f"the worker exited ({worker.process.returncode}) while waiting for {what}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(every_s)


def _job_params(i: int) -> dict[str, Any]:
    # ~0.5 s of training on one core: 20 steps, checkpoints at 10 and 20 (two commits, two
    # published versions per job), a one-layer MLP of 8 units.
    return {
        "noise_multiplier": 1.0,
        "sampling_probability": 0.02,
        "steps": 20,
        "checkpoint_every": 10,
        "hidden": 8,
        "seed": i,
        "model_name": f"faults-{i}",
    }


def _phase(probe: _Probe, job_id: str, artifacts: Path) -> str:
    """Where the kill landed, read back from the database and the staging area."""
    row = probe.job(job_id)
    staged = [n for n in staged_files(artifacts) if n.startswith(job_id + ".")]
    if row is None or row.status == "queued":
        return "before the claim"
    if row.status in jobs.queue.TERMINAL:
        return "after the job ended"
    prefix = "staged candidate, " if staged else ""
    if row.reservation_id is None:
        return prefix + "claimed, before the reserve was recorded"
    status = probe.scalar("SELECT status FROM reservations WHERE id = :r", r=row.reservation_id)
    versions = probe.versions(job_id)
    if status == "committed":
        return prefix + "final commit landed, job not finished"
    return prefix + f"reserved, {versions} version(s) published"


def kill_worker_cycles(
    url: str,
    work_dir: Path,
    *,
    cycles: int,
    kills: int,
    seed: int = 7,
    lease_s: float = 1.5,
    ttl_s: float = 20.0,
) -> WorkerKillRun:
    """Run ``cycles`` jobs through real ``ledger worker`` processes, ``kills`` of them (chosen by
    ``seed``) with a SIGKILL (module docstring); then check the findings."""
    rng = random.Random(seed)
    doomed = sorted(rng.sample(range(cycles), min(kills, cycles)))
    last_kill = doomed[-1] if doomed else -1
    # Every mode at least once (the last kill is an after_reserve one), the rest 3:1:1.
    modes = rng.sample(["timer", "after_release"], 2)[: max(0, len(doomed) - 1)]
    modes += rng.choices(MODES, weights=(3, 1, 1), k=max(0, len(doomed) - 1 - len(modes)))
    rng.shuffle(modes)
    mode_of = dict(zip(doomed, [*modes, "after_reserve"], strict=True))
    run = WorkerKillRun(cycles=cycles)
    artifacts = work_dir / "artifacts"
    log = work_dir / "workers.log"
    db = Database(make_url(url), pool_size=2, max_overflow=0)
    probe = _Probe(url)
    world = digits_dataset(db, epsilon="100000", source=DIGITS)  # every job reads the dataset's source
    worker = _Worker(url, artifacts, log, lease_s=lease_s, ttl_s=ttl_s)
    job_ids: list[str] = []
    try:
        for i in range(cycles):
            job_id = jobs.queue.create_job(
                db, world.tenant, dataset_id=world.dataset_id, algorithm="dp_sgd", params=_job_params(i)
            ).id
            job_ids.append(job_id)
            # the worker may first finish a job a dead worker left; wait for ours to be claimed
            probe.wait(lambda j=job_id: probe.job(j).status != "queued", 300, "a claim", worker)
            claimed = time.monotonic()
            if i not in doomed:
                probe.wait(
                    lambda j=job_id: probe.job(j).status in jobs.queue.TERMINAL,
                    300,
                    f"job {job_id} to end",
                    worker,
                )
                run.job_s.append(time.monotonic() - claimed)
                run.seen_certificates |= probe.certificates()
                continue
            mode = mode_of[i]
            if mode == "timer":
                typical = statistics.median(run.job_s) if run.job_s else 0.5
                time.sleep(rng.uniform(0.0, 1.2 * typical))
            elif mode == "after_reserve":
                probe.wait(
                    lambda j=job_id: (
                        probe.job(j).reservation_id is not None or probe.job(j).status in jobs.queue.TERMINAL
                    ),
                    300,
                    "a reservation",
                    worker,
                    every_s=0.001,
                )
            else:
                probe.wait(
                    lambda j=job_id: probe.versions(j) > 0 or probe.job(j).status in jobs.queue.TERMINAL,
                    300,
                    "a release",
                    worker,
                    every_s=0.001,
                )
            worker.kill()
            run.kills += 1
            run.modes[mode] += 1
            run.phases[_phase(probe, job_id, artifacts)] += 1
            run.seen_certificates |= probe.certificates()
            open_now = probe.open_reservations()
            run.orphans |= open_now
            if i == last_kill:
                # Down past the TTL: nobody runs the expiry sweep or spends on the dataset, so
                # the orphan is still "reserved"; the restarted worker expires it on start.
                run.expiry_orphan = next(iter(open_now), None)
                time.sleep(ttl_s + 0.5)
            started = time.monotonic()
            worker = _Worker(url, artifacts, log, lease_s=lease_s, ttl_s=ttl_s)
            run.restart_s.append(time.monotonic() - started)
        probe.wait(
            lambda: all(probe.job(j).status in jobs.queue.TERMINAL for j in job_ids),
            600,
            "every job to end",
            worker,
        )
        worker.stop()
        run.findings = check_after_worker_kills(
            url, db, probe, world.tenant, world.dataset_id, artifacts, run
        )
        run.findings["jobs"] = dict(Counter(probe.job(j).status for j in job_ids))
        run.findings["attempts"] = dict(Counter(int(probe.job(j).attempts) for j in job_ids))
        with probe.db.engine.connect() as conn:
            errors = conn.execute(text("SELECT error FROM jobs WHERE status <> 'succeeded'")).all()
        run.findings["job_errors"] = [str(e[0])[:300] for e in errors]
    finally:
        worker.stop()
        probe.db.dispose()
        db.dispose()
    return run


def check_after_worker_kills(
    url: str, db: Database, probe: _Probe, tenant: str, dataset: str, artifacts: Path, run: WorkerKillRun
) -> dict[str, Any]:
    f: dict[str, Any] = {}
    now = probe.certificates()
    f["certificates"] = len(now)
    f["seen_certificates"] = len(run.seen_certificates)
    f["lost_certificates"] = len(run.seen_certificates - now)
    with db.engine.connect() as conn:
        versions = conn.execute(
            text(
                "SELECT v.name, v.version, v.artifact_path, r.model, r.version AS released, "
                "res.status AS reservation_status, res.commits "
                "FROM model_versions v LEFT JOIN certificates c ON c.id = v.certificate_id "
                "LEFT JOIN releases r ON r.id = c.release_id "
                "LEFT JOIN reservations res ON res.id = c.reservation_id "
                "WHERE v.dataset_id = :d"
            ),
            {"d": dataset},
        ).all()
        f["versions"] = len(versions)
        f["versions_without_committed_certificate"] = sum(
            1 for v in versions if v.model != v.name or str(v.released) != str(v.version) or not v.commits
        )
        f["versions_missing_artifact"] = sum(
            1 for v in versions if not (artifacts / v.artifact_path).is_file()
        )
        f["certified_releases_not_published"] = conn.execute(
            text(
                "SELECT count(*) FROM certificates c JOIN releases r ON r.id = c.release_id "
                "LEFT JOIN model_versions v ON v.certificate_id = c.id "
                "WHERE c.dataset_id = :d AND v.id IS NULL"
            ),
            {"d": dataset},
        ).scalar_one()
        statuses = Counter(
            dict(
                conn.execute(
                    text("SELECT status, count(*) FROM reservations WHERE dataset_id = :d GROUP BY status"),
                    {"d": dataset},
                ).all()
            )
        )
        f["reservations"] = dict(statuses)
        f["open_reservations"] = statuses.get("reserved", 0)
        orphans = Counter(
            conn.execute(text("SELECT status FROM reservations WHERE id = :r"), {"r": r}).scalar_one()
            for r in run.orphans
        )
        f["orphans"] = len(run.orphans)
        f["orphans_final_status"] = dict(orphans)
        if run.expiry_orphan is not None:
            f["orphan_past_ttl_status"] = conn.execute(
                text("SELECT status FROM reservations WHERE id = :r"), {"r": run.expiry_orphan}
            ).scalar_one()
        row = conn.execute(text("SELECT charges_committed FROM datasets WHERE id = :d"), {"d": dataset}).one()
        f["charges_committed"] = row.charges_committed
        f["unreleased_certificates"] = conn.execute(
            text("SELECT count(*) FROM certificates WHERE dataset_id = :d AND release_id IS NULL"),
            {"d": dataset},
        ).scalar_one()
    ledger = spent.get_spend(db, tenant, dataset).to_json()
    f["epsilon_held"] = ledger["epsilon_held"]
    f["epsilon_spent"] = ledger["epsilon_spent"]
    f["staged_files_left"] = len(staged_files(artifacts))
    verify = subprocess.run(
        [sys.executable, "-m", "service.cli", "verify", "--database-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    f["verify_rc"] = verify.returncode
    f["verify_output"] = verify.stdout.strip()[-300:]
    # ledger check: every certificate re-verified offline, each published version's certificate,
    # the budget recomputed from the certificates, the audit chain recomputed, over HTTP v1.
    key = tenancy.create_api_key(db, tenant, "viewer")
    # the workers' artifact directory: the online check downloads every version's bytes
    server = start_server(url, extra_args=("--no-worker",), env={"LEDGER_ARTIFACT_DIR": str(artifacts)})
    try:
        check = subprocess.run(
            [
                sys.executable,
                "-m",
                "service.cli",
                "check",
                "--url",
                server.base_url,
                "--key",
                key,
                "--dataset",
                dataset,
                "--json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stop_server(server.process)
    f["check_rc"] = check.returncode
    try:  # the findings that did not hold, whole (the output's tail may not reach them)
        report = json.loads(check.stdout)
        f["check_failed"] = [x for x in report.get("checks", []) if not x.get("ok")]
        f["check_result"] = report.get("result")
    except ValueError:
        f["check_failed"] = None
    f["check_output"] = (check.stdout + check.stderr).strip()[-1500:]
    return f


def assert_worker_kill_findings(run: WorkerKillRun) -> None:
    f = run.findings
    assert f["lost_certificates"] == 0, f
    assert f["versions_without_committed_certificate"] == 0, f
    assert f["versions_missing_artifact"] == 0, f
    assert f["certified_releases_not_published"] == 0, f
    assert f["open_reservations"] == 0, f
    assert f["epsilon_held"] == "0", f
    # every charge has a certificate; an orphan's abort or expiry is one with no release (issue 24 §2)
    assert f["certificates"] == f["charges_committed"] == f["versions"] + f["unreleased_certificates"], f
    assert set(f["orphans_final_status"]) <= {"aborted", "expired", "committed"}, f
    if run.expiry_orphan is not None:
        assert f["orphan_past_ttl_status"] == "expired", f
    assert f["staged_files_left"] == 0, f
    assert f["verify_rc"] == 0, f
    assert f["check_rc"] == 0, f
    assert set(f["jobs"]) == {"succeeded"}, f
