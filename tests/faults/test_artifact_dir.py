"""An artifact directory that cannot be written during a release: the commit is not made, or the
version is not published — never a certificate of a published version whose artifact is missing.

Real refusals by the kernel (we run as root, where ``chmod`` stops nothing):

* the artifact dir's parent is a regular FILE (``ENOTDIR`` on every mkdir/open) — staging fails
  before the commit: no release, no version; the steps that ran are charged (issue 24 §2: one
  certificate of ``outcome: "aborted"``, release null);
* the tenant's folder under the artifact dir is a FILE (staging works, the final move fails after
  the ledger committed): the certificate exists, no version is published; once the path is
  repaired the registry's sweep rolls the release forward, file and all;
* disk full: the artifact dir on a 64 KiB tmpfs filled to the last byte (``ENOSPC``) — staging
  fails before the commit, charged as above. Needs ``mount`` (root with CAP_SYS_ADMIN); skipped
  where it is refused.

A real training job runs (tiny MLP on builtin:digits, a few steps) through the real worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sqlalchemy import text

from service.db.session import Database
from service.ledger import jobs
from service.ledger import model_registry as registry
from service.ledger.jobs.answers import JobDetail
from service.worker.worker import Worker
from tests.worker.digits_world import DIGITS, CountingLoader, digits_dataset

pytestmark = pytest.mark.slow


def _run_job(db: Database, artifacts: Path) -> tuple[str, JobDetail]:
    world = digits_dataset(db, epsilon="10", source=DIGITS)  # the job reads the dataset's source
    job = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.5, "steps": 6, "checkpoint_every": 3, "seed": 3},
    )
    worker = Worker(db, artifact_dir=artifacts, loader=CountingLoader(), device="cpu")
    try:
        worker.run_once()
    except OSError:
        pass  # a worker may surface the I/O error; the ledger state below is what matters
    return world.dataset_id, jobs.queue.get_job(db, "acme", str(job.id))


def _ledger(db: Database, dataset_id: str) -> dict[str, int]:
    with db.engine.connect() as conn:
        one = lambda sql: conn.execute(text(sql), {"d": dataset_id}).scalar_one()  # noqa: E731
        return {
            "certificates": one(
                "SELECT count(*) FROM certificates WHERE dataset_id = :d AND release_id IS NOT NULL"
            ),
            # The charge of the steps that ran before a failure: a certificate with no release.
            "aborted": one("SELECT count(*) FROM certificates WHERE dataset_id = :d AND release_id IS NULL"),
            "versions": one("SELECT count(*) FROM model_versions WHERE dataset_id = :d"),
            "committed": one("SELECT count(*) FROM reservations WHERE dataset_id = :d AND commits > 0"),
        }


def _published_files_exist(db: Database, artifacts: Path) -> None:
    with db.engine.connect() as conn:
        rows = conn.execute(text("SELECT artifact_path, certificate_id FROM model_versions")).all()
        certified = {r[0] for r in conn.execute(text("SELECT id FROM certificates"))}
    for path, certificate in rows:
        assert (artifacts / path).is_file(), f"published version without its artifact: {path}"
        assert certificate in certified


def test_artifact_dir_under_a_file_refuses_before_the_commit(db: Database, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the artifact dir's parent should be")
    artifacts = blocker / "artifacts"
    dataset_id, job = _run_job(db, artifacts)
    assert job.job.status != "succeeded", job
    assert _ledger(db, dataset_id) == {"certificates": 0, "versions": 0, "committed": 0, "aborted": 1}


def test_unwritable_final_place_publishes_nothing_then_rolls_forward(db: Database, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "acme").write_text("a file where the tenant's folder should be")
    dataset_id, job = _run_job(db, artifacts)
    state = _ledger(db, dataset_id)
    assert job.job.status != "succeeded", job
    assert state["versions"] == 0, state  # nothing published...
    assert state["certificates"] == 1, state  # the first commit landed, then the move failed
    assert state["aborted"] == 0, state  # nothing ran beyond what that commit charged
    _published_files_exist(db, artifacts)
    # Repair the path: the sweep finishes what the ledger committed, artifact in place.
    (artifacts / "acme").unlink()
    registry.sweep(db, artifacts)
    after = _ledger(db, dataset_id)
    assert after["versions"] == after["certificates"] == state["certificates"], after
    _published_files_exist(db, artifacts)


def test_disk_full_refuses_before_the_commit(db: Database, tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        artifacts = mount / "artifacts"
        (artifacts / registry.STAGING).mkdir(parents=True)
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            for size in (4096, 1):  # fill to the last byte
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError:
                    pass
        finally:
            os.close(fd)
        assert shutil.disk_usage(mount).free < 4096
        dataset_id, job = _run_job(db, artifacts)
        assert job.job.status != "succeeded", job
        assert _ledger(db, dataset_id) == {"certificates": 0, "versions": 0, "committed": 0, "aborted": 1}
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
