"""The release flow's order through the worker's gate: the reservation is granted before the data
source is opened (a refused one opens nothing: ``test_gate.py``, ``loader.opened == []``).

These replace the tests of ``service.training.dp_sgd.run_with_reservation``, a copy of this order
that only tests used (issue 29 §4); here the order is checked on the path production runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from service.db.session import Database  # noqa: E402
from service.ledger import jobs, spent  # noqa: E402
from service.training.data import LoadedData  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import DIGITS, CountingLoader, digits_dataset  # noqa: E402


def test_the_data_source_is_opened_only_once_the_reservation_is_held(db: Database, tmp_path: Path) -> None:
    world = digits_dataset(db, epsilon="3", delta="1e-5")
    counting = CountingLoader()
    held_when_opened: list[tuple[int, str]] = []

    def loader(uri: str, tenant_id: str) -> LoadedData:
        now = spent.get_spend(db, "acme", world.dataset_id).to_json()
        held_when_opened.append((now["reservations_open"], now["epsilon_held"]))
        return counting(uri, tenant_id)

    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=loader, device="cpu")
    answer = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=world.dataset_id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 2.0, "steps": 3},
    )
    assert worker.run_once() == answer.id
    job = jobs.queue.get_job(db, "acme", str(answer.id))
    assert job.job.status == "succeeded", job.job.error
    assert counting.opened == [DIGITS]
    [(open_reservations, held)] = held_when_opened
    assert open_reservations == 1 and float(held) > 0  # the run's whole cost held before any read
