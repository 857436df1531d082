"""kill -9 of ``ledger worker`` at random points of training jobs (SQLite and PostgreSQL): after
the restarts no committed spend is lost, no version is published without a certificate of its
release, every orphaned reservation is freed (aborted by the job's retry, or expired after its
TTL), every job ends ``succeeded``, ``ledger verify`` and ``ledger check`` pass
(``tests/faults/worker_kills.py`` says how the kills are placed and what is checked).

CI size: 5 jobs, 3 kills per backend (one after the reserve, one after the first release, one at
a random moment, the last left down past the TTL). ``python bench/faults.py --cycles 200`` is the
larger run (docs/RELIABILITY.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

pytest.importorskip("torch")

from tests.faults.worker_kills import assert_worker_kill_findings, kill_worker_cycles
from tests.service.api.conftest import url_text

pytestmark = pytest.mark.slow


def test_kill_9_of_worker_loses_no_commit(database_url: URL, tmp_path: Path) -> None:
    # ttl_s 6: a live worker renews its job's hold with its heartbeat (every 0.33 s here), so
    # only a killed worker's orphan runs out of it; the run waits one TTL for that expiry.
    run = kill_worker_cycles(
        url_text(database_url), tmp_path, cycles=5, kills=3, seed=5, lease_s=1.0, ttl_s=6.0
    )
    assert run.kills == 3
    assert_worker_kill_findings(run)
