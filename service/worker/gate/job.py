"""One claimed job through the gate (``run_job``): resolve the earlier attempts, plan and reserve,
load and check, train and release, and finish the job (``service.worker.gate``, steps 1 to 4).

Why its own module: this is the order of the gate — nothing is read before the reservation is
granted, nothing released before it is committed — written once, top to bottom, for the
one-reservation run (DP-SGD, AdaDp); a staged run branches off to ``staged.run_staged`` after the
same checks. The worker loop (``service.worker.worker``) calls ``run_job`` only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accountant import events as ev
from accountant.errors import AccountantError
from service.db.session import Database, is_transient_error
from service.ledger import idempotency, jobs, quotes, reservations
from service.ledger import model_registry as registry
from service.ledger.errors import LedgerError, NotFound
from service.ledger.jobs.leases import ClaimedJob, LeaseLost
from service.training.algorithms import trainer_for
from service.training.stages import StagedTrainer, stage_steps
from service.worker.gate.attempt import (
    Control,
    Outcome,
    Run,
    Stop,
    abort_quietly,
    abort_run,
    fail,
    finish,
    requeue,
    reserve_key,
    should_stop,
    stop_for,
)
from service.worker.gate.failures import failure_log, failure_message, job_error
from service.worker.gate.release import checkpoint, trace_point
from service.worker.gate.sources import Loader, default_loader, ledger_tasks, load_checked
from service.worker.gate.staged import run_staged
from service.worker.gate.targets import check_stages_fit, check_target_fits, with_budget_delta

if TYPE_CHECKING:
    from service.training.dp_sgd import TrainingPlan

logger = logging.getLogger("service.worker.gate")  # one logger for the whole gate, as before its split


def _earlier_reservations(db: Database, job: ClaimedJob) -> list[str]:
    """Reservations of this job's earlier attempts: the one recorded on the job, and any whose
    reserve call succeeded but was not recorded (found by its idempotency key)."""
    found = [job.reservation_id] if job.reservation_id else []
    if job.attempt > 1:
        current = f"job:{job.id}:a{job.attempt}:"
        for key, reservation_id in idempotency.job_reservations(db, job.tenant_id, job.id):
            if not key.startswith(current) and reservation_id not in found:
                found.append(reservation_id)
    return found


def _completed_before(run: Run) -> bool:
    """Whether the previous attempt committed its whole run (its final release closed the
    reservation; the sweep has published it): then the job is done and is not trained again."""
    job = run.job
    if job.reservation_id is None:
        return False
    try:
        previous = reservations.get_reservation(run.db, job.tenant_id, job.reservation_id)
    except NotFound:
        return False
    if previous.status != "committed":
        return False
    last = registry.last_version_of_job(run.db, job.id)
    if last is None:
        return False
    step, run.released_metrics = last
    jobs.leases.record_progress(
        run.db,
        job.lease,
        step=step,
        epsilon_committed=previous.committed.epsilon,
        delta_committed=previous.committed.delta,
    )
    return True


def run_job(
    db: Database,
    job: ClaimedJob,
    *,
    control: Control,
    artifact_dir: Path,
    reservation_ttl_s: float,
    loader: Loader = default_loader,
    device: str | None = None,
    limits: jobs.params.JobLimits = jobs.params.DEFAULT_LIMITS,
) -> Outcome:
    """Run one claimed job through the gate (``service.worker.gate``) and finish it; ``limits``: the
    steps a plan may take (checked before anything is reserved)."""
    run = Run(db, job, control, Path(artifact_dir), limits)
    try:
        return _through_the_gate(run, reservation_ttl_s, loader, device)
    except Stop as stop:
        return stop.outcome
    except LeaseLost:
        abort_run(run)
        return Outcome("lease_lost")
    except Exception as exc:
        if is_transient_error(exc):  # the next attempt is expected not to meet it
            return requeue(run, exc)
        # Unexpected (a bug, a permanent database error): free the hold and fail the job if the
        # database lets us; if it does not, the lease expires and the job is retried.
        logger.error("job %s: worker error: %s", job.id, failure_log(exc, run.record_ids))
        error = job_error("worker_error", failure_message(exc, run.record_ids))
        try:
            abort_run(run)
            return finish(run, "failed", error=error)
        except Exception:
            logger.exception("job %s: could not record the failure", job.id)
            return Outcome("lease_lost", error)


def _through_the_gate(run: Run, reservation_ttl_s: float, loader: Loader, device: str | None) -> Outcome:
    """Steps 1 to 4 for ``run`` (``service.worker.gate``); a staged trainer's run goes on in
    ``staged.run_staged`` once planned."""
    db, job = run.db, run.job
    if job.attempt > 1:
        # The previous worker is gone: settle its candidates and its holds first.
        registry.sweep(db, run.artifact_dir, job_id=job.id)
        if _completed_before(run):  # it released the whole run and died before finishing the job
            raise Stop(finish(run, "succeeded"))
        for reservation_id in _earlier_reservations(db, job):
            abort_quietly(db, job.tenant_id, reservation_id)
    if job.cancel_requested:
        raise Stop(finish(run, "cancelled"))
    if job.attempt > job.max_attempts:
        raise Stop(
            finish(
                run,
                "failed",
                error=job_error(
                    "attempts_exhausted",
                    f"the job's worker stopped before the end {job.max_attempts} time(s) "
                    "(lease expired or shut down); it is not retried again.",
                    attempts=job.max_attempts,
                ),
            )
        )
    from service.contract.job_params import InvalidParamsError

    # 1. Plan and reserve: no data is read here.
    try:
        run.trainer = trainer_for(job.algorithm, device)
        params = with_budget_delta(db, job, run.trainer.parse_params(jobs.params.trainer_params(job.params)))
        tasks = ledger_tasks(db, job.dataset_id)
        batches = [batch for task in tasks for batch in task.batches]
        if not batches:
            raise fail(
                run, job_error("no_batches", f"dataset {job.dataset_id!r} has no batches to train on.")
            )
        if isinstance(run.trainer, StagedTrainer):
            stages = list(run.trainer.stages(params, tasks))
            steps = sum(stage_steps(stage) for stage in stages)
        else:
            # σ for target_epsilon: what the dataset would charge the run on the batches it reserves
            prices = quotes.DatasetPrices(db, job.tenant_id, job.dataset_id)  # every batch: what it reserves
            run.plan = run.trainer.plan(params, sum(batch.size for batch in batches), price=prices.price)
            steps = run.plan.steps
            if getattr(params, "target_epsilon", None) is not None:
                check_target_fits(run, params, prices)
        too_many = jobs.params.steps_refusal(steps, jobs.params.trainer_params(job.params), run.limits)
        if too_many is not None:  # before the reservation: nothing is held, nothing read
            raise fail(run, too_many)
        if isinstance(run.trainer, StagedTrainer) and getattr(params, "target_epsilon", None) is not None:
            check_stages_fit(run, params, tasks, stages)  # (after the cheap refusals: it may search)
    except InvalidParamsError as exc:
        raise fail(run, job_error("invalid_input", str(exc), field=exc.field)) from None
    except AccountantError as exc:  # calibration: no σ reaches the target, ...
        raise fail(run, job_error("invalid_input", str(exc), field=getattr(exc, "field", "params"))) from None
    if isinstance(run.trainer, StagedTrainer):
        return run_staged(run, params, tasks, stages, reservation_ttl_s, loader)
    plan: TrainingPlan = run.plan
    plan_json = plan.to_json() if hasattr(plan, "to_json") else {"event": ev.to_json(plan.event)}
    jobs.leases.record_plan(db, job.lease, plan=plan_json, total_steps=plan.steps)
    try:
        # By task: every batch of the dataset's tasks (up to MAX_BATCHES_PER_RESERVATION), where a
        # list of batch ids stops at MAX_IDS_PER_REQUEST (issue 24 §5: 10 001 batches failed here).
        reserved = reservations.reserve(
            db,
            job.tenant_id,
            job.dataset_id,
            event=plan.event,
            task_ids=[task.id for task in tasks],
            idempotency_key=reserve_key(job.id, job.attempt),
            ttl_s=reservation_ttl_s,
        )
    except LedgerError as exc:
        raise fail(run, exc.to_json()) from None
    run.reservation_id = reserved.id
    if reserved.batches != len(batches):  # a batch was created since the plan
        message = (
            f"the dataset's batches changed while the job planned ({len(batches)} planned, "
            f"{reserved.batches} reserved); the reservation was aborted."
        )
        raise fail(run, job_error("batches_changed", message))
    jobs.leases.record_reservation(db, job.lease, run.reservation_id)
    if run.control.should_stop():
        raise stop_for(run)

    # 2. Load the records (only now) and check them against the ledger's batches.
    run.data, _ = load_checked(run, loader)
    if hasattr(run.trainer, "model_spec"):
        run.model_spec = run.trainer.model_spec(run.data, plan.params)

    # 3. Train; every release goes through checkpoint.
    tracing: dict[str, Any] = {}
    if getattr(run.trainer, "traces_iterates", False) and plan.params.world_size == 1:
        from service.training.dp_sgd import trace_every  # torch: only in the worker

        run.trace_every = trace_every(plan.steps)
        tracing["on_trace"] = lambda step, metrics: run.trace.append(trace_point(step, metrics))
    try:
        result = run.trainer.train(
            run.data,
            plan,
            on_checkpoint=lambda step, state, event: checkpoint(run, step, state, event),
            should_stop=lambda: should_stop(run),
            **tracing,
        )
    except (LeaseLost, Stop):
        raise
    except Exception as exc:  # a failed run: Lemma 1 violated, bad params for the data, ...
        # (run.failure: the release path failed with an unknown outcome and said why)
        failure = run.failure if run.failure is not None else exc
        if is_transient_error(failure):
            raise Stop(requeue(run, failure)) from None
        logger.error("job %s failed while training: %s", job.id, failure_log(failure, run.record_ids))
        raise fail(run, job_error("training_failed", failure_message(failure, run.record_ids))) from None

    # 4. How it ended.
    if result.status == "completed":
        run.released_metrics = dict(result.metrics)  # every step is committed: all released
        return finish(run, "succeeded")
    if result.status == "refused":
        if run.refusal is None:  # checkpoint stopped because control said so
            raise stop_for(run)
        raise fail(run, run.refusal)
    raise stop_for(run)


__all__ = ["run_job"]
