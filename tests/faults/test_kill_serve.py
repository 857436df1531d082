"""kill -9 of ``ledger serve`` at random points of reserve/commit cycles (SQLite and PostgreSQL):
after restart no acknowledged commit is lost (its certificate is fetchable), no committed
reservation or release lacks a certificate, the spend equals the sum of the committed charges,
every orphaned reservation expires after its (short) TTL, and ``ledger verify`` passes.

CI size: 30 cycles with 4 kills per backend. ``python bench/faults.py --cycles 200`` is the larger
run (docs/RELIABILITY.md)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import URL

from tests.faults.harness import assert_kill_findings, kill_serve_cycles
from tests.service.api.conftest import url_text

pytestmark = pytest.mark.slow


def test_kill_9_of_serve_loses_no_commit(database_url: URL) -> None:
    run = kill_serve_cycles(url_text(database_url), cycles=30, kills=4, seed=11)
    assert run.kills == 4
    assert_kill_findings(run)
