"""Per-tenant fairness and limits of the shared workers (issue 12): tenants take turns in the
claim, a tenant's queue is bounded, a plan longer than ``LEDGER_JOB_MAX_STEPS`` is refused before
it reserves, and an attempt past ``LEDGER_JOB_MAX_WALL_S`` is stopped and failed with the rest of
its reservation returned. Real SQLite and PostgreSQL, real torch for the runs."""

from __future__ import annotations

import threading
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.db.base import utcnow
from service.db.models import Reservation
from service.db.session import Database
from service.ledger import certificates, jobs, spent
from service.ledger.jobs.params import JobLimits
from service.worker.worker import Worker
from tests.worker.digits_world import CountingLoader, claim_concurrently, digits_dataset, job_row, versions_of

PARAMS: dict[str, Any] = {"noise_multiplier": 1.0, "steps": 10}


def _dataset(db: Database, tenant: str, **kwargs: Any) -> str:
    return digits_dataset(
        db, tenant, **{"records": [f"{tenant}-r{i}" for i in range(8)], **kwargs}
    ).dataset_id


def _job(
    db: Database, tenant: str, dataset_id: str, limits: JobLimits = jobs.params.DEFAULT_LIMITS, **params: Any
) -> str:
    answer = jobs.queue.create_job(
        db, tenant, dataset_id=dataset_id, algorithm="dp_sgd", params={**PARAMS, **params}, limits=limits
    )
    return str(answer.id)


def _warm_up_per_example_gradients(torch: Any) -> None:
    """Run DP-SGD's per-example gradients once in this process, before a wall clock starts: the
    first call imports part of torch lazily (torch._dynamo, seconds on a loaded machine), which
    would otherwise count against a job's LEDGER_JOB_MAX_WALL_S."""
    from service.training.per_example_gradients import PerExampleGradients

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    gradients = PerExampleGradients(model, 2)
    flat = gradients.flat(dict(model.named_parameters()), torch.zeros(1, 4), torch.tensor([1]))
    assert flat.shape == (1, 4 * 2 + 2)  # one example's gradient: weights and biases


def _reservations(db: Database, dataset_id: str) -> list[Reservation]:
    with db.session(readonly=True) as session:
        return list(session.scalars(select(Reservation).where(Reservation.dataset_id == dataset_id)))


# ---------------------------------------------------------------------------------------------
# Fairness: the claim's order
# ---------------------------------------------------------------------------------------------


def test_a_tenant_queued_behind_another_tenants_jobs_gets_the_second_claim(db: Database) -> None:
    """The finding: tenant A's long jobs kept B's job queued. A's five go first, B's one after:
    B's job is the second claimed, not the sixth."""
    a, b = _dataset(db, "acme"), _dataset(db, "rival")
    a_jobs = [_job(db, "acme", a) for _ in range(5)]
    b_job = _job(db, "rival", b)
    now = utcnow()
    first = jobs.leases.claim(db, "worker-1", 600, now=now)
    second = jobs.leases.claim(db, "worker-2", 600, now=now + timedelta(seconds=1))
    assert first is not None and second is not None
    assert (first.id, second.id) == (a_jobs[0], b_job)
    rest = [jobs.leases.claim(db, f"worker-{n}", 600, now=now + timedelta(seconds=n)) for n in range(3, 7)]
    assert [c.id for c in rest if c is not None] == a_jobs[1:]  # then A's, oldest first
    assert jobs.leases.claim(db, "worker-7", 600, now=now + timedelta(seconds=7)) is None


def test_one_worker_alternates_between_tenants(db: Database) -> None:
    """With one worker (a job ends before the next claim) no tenant runs anything, so the turn
    goes to the tenant whose last job was claimed longest ago — never claimed: first."""
    a, b, c = _dataset(db, "acme"), _dataset(db, "rival"), _dataset(db, "third")
    queued = {
        "acme": [_job(db, "acme", a) for _ in range(3)],
        "rival": [_job(db, "rival", b) for _ in range(2)],
        "third": [_job(db, "third", c)],
    }
    tenant_of = {job_id: tenant for tenant, ids in queued.items() for job_id in ids}
    now = utcnow()
    order = []
    for n in range(6):
        claimed = jobs.leases.claim(db, "worker", 600, now=now + timedelta(seconds=n))
        assert claimed is not None
        order.append(tenant_of[claimed.id])
        jobs.leases.finish(db, claimed.lease, "succeeded", now=now + timedelta(seconds=n, milliseconds=500))
    assert order == ["acme", "rival", "third", "acme", "rival", "acme"]
    assert queued["acme"] == [
        j for j in (jobs.queue.get_job(db, "acme", i).job.id for i in queued["acme"]) if j
    ]  # (each tenant's own jobs still run oldest first: checked by the first test)


def test_an_expired_lease_does_not_count_as_running(db: Database) -> None:
    """A tenant whose worker died (lease expired) is not treated as busy: its job is claimable
    again and the tenant is not pushed back behind others for a job nobody runs."""
    a, b = _dataset(db, "acme"), _dataset(db, "rival")
    dead_job = _job(db, "acme", a)
    now = utcnow()
    assert jobs.leases.claim(db, "dead", 5, now=now) is not None
    other = _job(db, "rival", b)
    # At now+10 the lease expired: both tenants have no live job; rival never had a claim.
    first = jobs.leases.claim(db, "w1", 60, now=now + timedelta(seconds=10))
    second = jobs.leases.claim(db, "w2", 60, now=now + timedelta(seconds=11))
    assert first is not None and second is not None
    assert (first.id, second.id) == (other, dead_job)
    assert second.attempt == 2


@pytest.mark.slow
def test_concurrent_claims_stay_exactly_once_across_tenants(db: Database) -> None:
    created = {
        _job(db, tenant, _dataset(db, tenant)) for tenant in ("acme", "rival", "third") for _ in range(6)
    }
    claimed = claim_concurrently(db, 6)
    assert sorted(claimed) == sorted(created)


# ---------------------------------------------------------------------------------------------
# Queue limit
# ---------------------------------------------------------------------------------------------


def test_a_tenants_queue_is_bounded_and_other_tenants_are_not(db: Database) -> None:
    limits = JobLimits(max_steps=1000, max_wall_s=60, max_queued_per_tenant=2)
    a, b = _dataset(db, "acme"), _dataset(db, "rival")
    first, _ = _job(db, "acme", a, limits), _job(db, "acme", a, limits)
    with pytest.raises(jobs.queue.TooManyQueuedJobs) as info:
        _job(db, "acme", a, limits)
    assert info.value.status == 409 and info.value.code == "too_many_queued_jobs"
    assert info.value.details["limit"] == 2 and info.value.details["queued"] == 2
    assert jobs.queue.list_jobs(db, "acme").count == 2  # nothing stored
    _job(db, "rival", b, limits)  # another tenant's queue is its own
    assert jobs.leases.claim(db, "worker", 60) is not None  # one of acme's starts: a place frees up
    jobs.queue.cancel_job(db, "acme", first) if job_row(db, first).status == "queued" else None
    _job(db, "acme", a, limits)


def test_the_queue_limit_holds_under_concurrent_submits(db: Database) -> None:
    limits = JobLimits(max_steps=1000, max_wall_s=60, max_queued_per_tenant=3)
    dataset_id = _dataset(db, "acme")
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def submit() -> None:
        try:
            barrier.wait()
            _job(db, "acme", dataset_id, limits)
            result = "created"
        except jobs.queue.TooManyQueuedJobs:
            result = "refused"
        except BaseException as exc:  # recorded, so the assertion shows it (a thread's own
            result = f"{type(exc).__name__}: {exc}"  # exception would leave only a short list)
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["created"] * 3 + ["refused"] * 5
    assert jobs.queue.list_jobs(db, "acme").count == 3


# ---------------------------------------------------------------------------------------------
# Steps and wall time (a real worker, real torch)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"epochs": 10, "expected_batch_size": 1}, "params.epochs"),  # 10 epochs of q = 1/N
        ({"steps": 5000}, "params.steps"),  # explicit: allowed at submit under its limit
    ],
)
def test_a_plan_past_the_step_limit_fails_before_it_reserves(
    db: Database, tmp_path: Path, params: dict[str, Any], field: str
) -> None:
    pytest.importorskip("torch")
    dataset_id = digits_dataset(db, epsilon="10").dataset_id
    job_id = jobs.queue.create_job(
        db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params={"noise_multiplier": 1.0, **params}
    ).id
    loader = CountingLoader()
    limits = JobLimits(max_steps=1000, max_wall_s=600, max_queued_per_tenant=10)
    worker = Worker(db, artifact_dir=tmp_path, loader=loader, device="cpu", limits=limits)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed"
    assert job.job.error["error"] == "too_many_steps" and job.job.error["field"] == field
    assert job.job.error["limit"] == 1000 and job.job.error["steps"] > 1000
    assert loader.opened == [] and job.job.reservation_id is None and _reservations(db, dataset_id) == []


def test_a_staged_plan_counts_the_steps_of_every_stage(db: Database, tmp_path: Path) -> None:
    """NaiveGaussian: each task's stage runs ⌈epochs/q⌉ steps; the job's steps are their sum."""
    pytest.importorskip("torch")
    from tests.worker.digits_world import source_tasks, task_dataset

    budget = {"rule": "sequential", "epsilon": "100", "delta": "1e-5", "accountant": "rdp"}
    source = "builtin:split-digits?tasks=3"
    dataset_id, _ = task_dataset(db, budget, source_tasks(source), batch_size=50, source=source)
    params = {"noise_multiplier": 1.0, "sampling_probability": 0.01, "epochs": 4, "seed": 1}  # 400 a task
    job = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="naive_gaussian", params=params)
    job_id = job.id
    limits = JobLimits(max_steps=1000, max_wall_s=600, max_queued_per_tenant=10)
    loader = CountingLoader()
    worker = Worker(db, artifact_dir=tmp_path, loader=loader, device="cpu", limits=limits)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed" and job.job.error["error"] == "too_many_steps"
    assert job.job.error["steps"] == 1200 and job.job.error["field"] == "params.epochs"
    assert loader.opened == [] and _reservations(db, dataset_id) == []


def test_a_job_past_its_wall_time_is_stopped_and_failed_keeping_only_what_it_committed(
    db: Database, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    _warm_up_per_example_gradients(torch)  # torch's first autograd call imports for seconds

    dataset_id = digits_dataset(db, epsilon="1000").dataset_id
    # 100 000 steps (minutes of work); a release every 20 steps; the worker allows 2 s.
    params = {"noise_multiplier": 2.0, "steps": 100_000, "checkpoint_every": 20, "seed": 3}
    job_id = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="dp_sgd", params=params).id
    limits = JobLimits(max_steps=1_000_000, max_wall_s=2.0, max_queued_per_tenant=10)
    worker = Worker(db, artifact_dir=tmp_path, loader=CountingLoader(), device="cpu", limits=limits)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed", job
    assert job.job.error["error"] == "wall_time_exceeded" and job.job.error["limit_s"] == 2.0
    assert "LEDGER_JOB_MAX_WALL_S" in job.job.error["message"]
    released = versions_of(db, job_id)
    assert released, "the run trained and released some checkpoints before its time ran out"
    assert 0 < job.job.progress_step < 100_000
    (held,) = _reservations(db, dataset_id)
    # The steps never begun went back to the budget; what it released stays spent, and so do the
    # steps it ran after its last release (issue 24 §2): the job's record says so.
    assert held.status == "aborted" and held.committed_epsilon < held.epsilon
    ledger = spent.get_spend(db, "acme", dataset_id).to_json()
    assert ledger["epsilon_held"] == "0"
    assert (
        Decimal(ledger["epsilon_spent"]) == held.committed_epsilon == Decimal(job.job.epsilon_committed) > 0
    )
    last = certificates.get_certificate(db, "acme", released[-1].certificate_id)["certificate"]
    assert held.committed_epsilon >= Decimal(last["result"]["charge"]["epsilon"])
