"""kill -9 of a process in the middle of batch creation (SQLite and PostgreSQL): a creation is
one transaction, so what the killed process was writing leaves nothing — no batch, no record,
no batch key taken, no audit entry — and the same keyed request, sent again, creates it in full.

The child creates requests of 2 000 batches × 10 records, each under its own idempotency key,
and says when each is done; it is killed at a random moment after the first. Then every stored
record belongs to a batch of its dataset, every batch holds exactly its size in records, the
batch keys are distinct and below ``next_batch_key``, the audit chain verifies, and replaying
every request by its key ends with all of them stored once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from service.db.session import Database
from service.ledger import audit, batches, datasets, tenancy

pytestmark = pytest.mark.slow

BATCHES = 2_000
RECORDS = 10
REQUESTS = 6

_CHILD = """
import sys
from service.db.session import Database
from service.ledger import batches
url, dataset, task, requests, size, records = sys.argv[1:7]
db = Database(url)
for i in range(int(requests)):
    sent = [{"name": f"b{i}-{j}", "records": [f"r{i}-{j}-{k}" for k in range(int(records))]}
            for j in range(int(size))]
    batches.create_batches(db, "acme", dataset, task, batches=sent, idempotency_key=f"create-{i}")
    print(i, flush=True)
"""


def _request(i: int) -> list[dict[str, object]]:
    return [
        {"name": f"b{i}-{j}", "records": [f"r{i}-{j}-{k}" for k in range(RECORDS)]} for j in range(BATCHES)
    ]


def test_kill_9_during_batch_creation_leaves_nothing_half_made(database_url: URL) -> None:
    db = Database(database_url)
    try:
        tenancy.create_tenant(db, "acme")
        budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
        ds = datasets.create_dataset(db, "acme", name="d", budget=budget).id
        task = batches.create_task(db, "acme", ds, name="t").id
        root = Path(__file__).resolve().parents[2]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        }
        url = database_url.render_as_string(hide_password=False)
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, ds, task, str(REQUESTS), str(BATCHES), str(RECORDS)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "0"  # one request done: the next is being written
        time.sleep(random.Random(26).uniform(0.05, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        done = 1 + sum(1 for line in child.stdout if line.strip())
        assert done < REQUESTS, "the child finished before it was killed: nothing was tested"

        def check(expected_batches: int) -> None:
            query = """
                SELECT (SELECT count(*) FROM batches WHERE dataset_id = :d),
                       (SELECT count(DISTINCT key) FROM batches WHERE dataset_id = :d),
                       (SELECT max(key) FROM batches WHERE dataset_id = :d),
                       (SELECT next_batch_key FROM datasets WHERE id = :d),
                       (SELECT count(*) FROM batch_records r JOIN datasets s ON s.key = r.dataset_key
                         WHERE s.id = :d),
                       (SELECT count(*) FROM batch_records r JOIN datasets s ON s.key = r.dataset_key
                         JOIN batches b ON b.dataset_id = s.id AND b.key = r.batch_key WHERE s.id = :d),
                       (SELECT coalesce(sum(size), 0) FROM batches WHERE dataset_id = :d)
            """
            [row] = db.read_all(sa.text(query), {"d": ds})
            made, distinct, top, after, records, owned, sizes = (int(v) for v in row)
            assert made == distinct == expected_batches
            assert top < after  # every key was taken from the counter, none given twice
            assert records == owned == sizes == expected_batches * RECORDS
            assert audit.verify(db).ok

        # what the killed process was writing is gone; the requests it finished are whole
        stored = db.read_all(sa.text("SELECT count(*) FROM batches WHERE dataset_id = :d"), {"d": ds})[0][0]
        assert stored in (done * BATCHES, (done + 1) * BATCHES)  # its last may have committed unsaid
        check(int(stored))
        for i in range(REQUESTS):  # replayed or created, by the same keys: each stored once
            batches.create_batches(db, "acme", ds, task, batches=_request(i), idempotency_key=f"create-{i}")
        check(REQUESTS * BATCHES)
        assert batches.count_records(db, ds) == REQUESTS * BATCHES * RECORDS
    finally:
        db.dispose()
