"""A job's per-step metric history (``jobs.metric_history``; issue 28, dashboard curves): real
torch DP-SGD on builtin:digits through the release gate, real ledger.

The history holds the iterate's held-out metrics every ``trace_every(steps)`` steps and at each
checkpoint, and only for steps a commit has covered: a run whose first commit is refused stores
none of the points it evaluated before it. The bound (``MAX_HISTORY_POINTS``) keeps the first
and the newest point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from service.db.session import Database  # noqa: E402
from service.ledger import jobs  # noqa: E402
from service.training.dp_sgd import trace_every  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import CountingLoader, digits_dataset, versions_of  # noqa: E402


def _worker(db: Database, artifacts: Path, loader: CountingLoader, **kwargs: Any) -> Worker:
    return Worker(db, artifact_dir=artifacts, loader=loader, device="cpu", **kwargs)


def _queue(db: Database, dataset_id: str, **params: Any) -> str:
    return str(jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params=params).id)


@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_history_holds_the_committed_steps_iterates(db: Database, tmp_path: Path) -> None:
    world = digits_dataset(db, epsilon="10")
    job_id = _queue(
        db, world.dataset_id, noise_multiplier=1.0, steps=60, checkpoint_every=25, hidden=8, seed=3
    )
    assert _worker(db, tmp_path / "artifacts", CountingLoader()).run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    history = job.metric_history
    every = trace_every(60)
    assert history["every"] == every == 2
    points = history["points"]
    # every other step, and each checkpoint (25, 50, 60)
    assert [p["step"] for p in points] == sorted({*range(every, 61, every), 25})
    versions = versions_of(db, job_id)
    assert [p["step"] for p in points if p["checkpoint"]] == [v.step for v in versions] == [25, 50, 60]
    # a checkpoint's point is its version's metrics; the others are evaluations of other iterates
    for v in versions:
        (point,) = [p for p in points if p["step"] == v.step]
        assert point["test_loss"] == v.metrics["test_loss"]
        assert point["test_accuracy"] == v.metrics["test_accuracy"]
    losses = [p["test_loss"] for p in points]
    assert len(set(losses)) > len(losses) // 2 and all(0 <= p["test_accuracy"] <= 1 for p in points)
    assert losses[-1] < losses[0]  # it learns
    # a page of jobs does not carry the histories
    listed = jobs.queue.list_jobs(db, "acme").to_json()["data"]
    assert [j["id"] for j in listed] == [job_id] and "metric_history" not in listed[0]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_points_before_a_refused_commit_are_never_stored(db: Database, tmp_path: Path) -> None:
    """The hold expires while the data loads: the run evaluates iterates 1..9 (trace_every(20)
    is 1), then its first commit (step 10) is refused. The steps ran, but no commit released
    them: their points are dropped with the candidate."""
    world = digits_dataset(db, epsilon="10")
    worker = _worker(db, tmp_path / "artifacts", CountingLoader(delay_s=1.0), reservation_ttl_s=0.5)
    job_id = _queue(
        db, world.dataset_id, noise_multiplier=1.5, steps=20, checkpoint_every=10, hidden=8, seed=2
    )
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed" and job.job.error["error"] == "reservation_expired"
    assert job.metric_history is None and versions_of(db, job_id) == []


@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_history_is_bounded_and_keeps_its_span(db: Database) -> None:
    world = digits_dataset(db, epsilon="10")
    job_id = _queue(db, world.dataset_id, noise_multiplier=1.0, steps=10)
    claimed = jobs.leases.claim(db, "w", lease_s=60)
    assert claimed is not None and claimed.lease.job_id == job_id
    for start in range(0, 450, 50):
        points = [{"step": s, "checkpoint": False, "test_loss": 1 / s} for s in range(start + 1, start + 51)]
        jobs.leases.record_history(db, claimed.lease, points, every=1)
    stored = jobs.queue.get_job(db, "acme", job_id).metric_history["points"]
    steps = [p["step"] for p in stored]
    assert len(steps) <= jobs.leases.MAX_HISTORY_POINTS and steps[0] == 1 and steps[-1] == 450
    assert steps == sorted(steps) and len(steps) > jobs.leases.MAX_HISTORY_POINTS // 2
    # a new attempt starts its own curve
    jobs.leases.record_plan(db, claimed.lease, plan={"steps": 10}, total_steps=10)
    assert jobs.queue.get_job(db, "acme", job_id).metric_history is None
