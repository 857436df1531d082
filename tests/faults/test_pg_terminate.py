"""PostgreSQL connections killed with ``pg_terminate_backend`` under load (only the backends of
this test's own database): every request either succeeds or fails cleanly (503, never a 500 and
never a half write); ``service.client``, which retries a 503 with the same Idempotency-Key,
completes every reserve+commit; and the same server process serves the load again once the
killing stops."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import URL

from tests.faults.harness import terminate_backends_under_load
from tests.service.api.conftest import url_text

pytestmark = pytest.mark.slow


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_terminated_backends_fail_cleanly_and_recover(database_url: URL) -> None:
    run, findings = terminate_backends_under_load(url_text(database_url), seconds=5.0)
    assert run.terminated > 0, "no backend was terminated: the test proved nothing"
    server_errors = {s: n for s, n in run.statuses.items() if s >= 500 and s != 503}
    assert not server_errors, (dict(run.statuses), run.bad_bodies[:3], run.server_errors)
    assert run.transport_errors == 0
    assert findings["server_alive"]
    # service.client retries 503s with the same Idempotency-Key: every cycle through it succeeds
    # and every certificate it was given exists (no lost or doubled commit)
    assert run.client_cycles > 0 and not run.client_failures, run.client_failures[:3]
    assert findings["lost_commits"] == 0, findings
    assert run.after and set(run.after) <= {200, 201}, dict(run.after)
    assert findings["releases_without_certificate"] == 0, findings
    assert findings["committed_without_certificate"] == 0, findings
    assert findings["released_certificates"] == findings["committed"], findings
    assert findings["certificates"] == findings["charges_committed"], findings  # aborts charge too
    assert findings["epsilon_spent"] == findings["epsilon_recomputed"] or float(
        findings["epsilon_spent"]
    ) == float(findings["epsilon_recomputed"]), findings
    assert findings["verify_rc"] == 0, findings
