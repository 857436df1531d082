"""Staged runs (``service.training.stages``): one reservation, commit and version per stage.

Why its own module: a staged trainer (the lifelong, continual and pre-trained algorithms) reads
its data stage by stage, so the gate reserves each stage's event on exactly its batches — named
by task when they are whole tasks (``_stage_selector``), by id otherwise — trains on exactly
their records, and releases before the next stage reserves. The job's plan records the stages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, Final

from accountant import events as ev
from accountant.exact import ZERO, exact_add
from service.ledger import jobs, reservations
from service.ledger import model_registry as registry
from service.ledger.errors import LedgerError
from service.training.stages import LedgerTask, Stage
from service.worker.gate.attempt import Outcome, Run, Stop, fail, finish, reserve_key, stop_for
from service.worker.gate.failures import failure_log, failure_message, job_error
from service.worker.gate.release import release
from service.worker.gate.sources import SOURCE_FIELD, Loader, check_source_tasks, load_checked

logger = logging.getLogger("service.worker.gate")  # one logger for the whole gate, as before its split

_PLAN_EVENTS: Final = 20  # how many distinct events a staged job's recorded plan lists


def _staged_plan_json(stages: Sequence[Stage]) -> dict[str, Any]:
    events: list[Any] = []
    for stage in stages:
        event = ev.to_json(stage.event)
        if event not in events and len(events) < _PLAN_EVENTS:
            events.append(event)
    return {"kind": "staged", "stages": len(stages), "events": events}


def run_staged(
    run: Run,
    params: Any,
    tasks: Sequence[LedgerTask],
    stages: Sequence[Stage],
    reservation_ttl_s: float,
    loader: Loader,
) -> Outcome:
    """Each stage: reserve its event on its batches, train on exactly their records, release."""
    db, job = run.db, run.job
    if job.attempt > 1 and registry.versions_of_job(db, job.id):
        # A stage's state (models, episodic memory, sums) is not persisted, and its reads were
        # charged: an interrupted staged run is not replayed. What was released stays released.
        raise Stop(
            finish(
                run,
                "failed",
                error=job_error(
                    "not_resumable",
                    "the job's worker stopped after releasing some stages; a staged run is not "
                    "resumed. Its released versions and their spend stay.",
                ),
            )
        )
    if not stages:
        raise fail(run, job_error("invalid_input", "the run has no stages for this dataset.", field="params"))
    jobs.leases.record_plan(db, job.lease, plan=_staged_plan_json(stages), total_steps=len(stages))
    from service.training.data import RecordIndex

    data: RecordIndex | None = None
    of_batch: dict[str, list[str]] = {}
    state: Any = None
    charged: dict[str, Decimal] = {}  # per batch: the sum of this job's committed charges
    delta_charged: dict[str, Decimal] = {}
    task_of = {batch.id: task for task in tasks for batch in task.batches}  # (_stage_selector)
    for stage in stages:
        run.control.set_step(stage.index - 1)
        if run.control.should_stop():
            raise stop_for(run)
        batch_ids, task_ids = _stage_selector(stage, task_of)
        try:
            reserved = reservations.reserve(
                db,
                job.tenant_id,
                job.dataset_id,
                event=stage.event,
                batch_ids=batch_ids,
                task_ids=task_ids,
                noise_commitment=stage.noise_commitment,
                idempotency_key=reserve_key(job.id, job.attempt, stage.index),
                ttl_s=reservation_ttl_s,
            )
        except LedgerError as exc:
            raise fail(run, {**exc.to_json(), "stage": stage.index, "stage_name": stage.name}) from None
        run.reservation_id = reserved.id  # (a retry finds it by its idempotency key)
        if reserved.batches != len(stage.batch_ids):  # a task gained a batch since the plan
            message = (
                f"the batches of stage {stage.index} changed while the job planned "
                f"({len(stage.batch_ids)} planned, {reserved.batches} reserved); "
                "its reservation was aborted."
            )
            raise fail(run, job_error("batches_changed", message, stage=stage.index))
        run.stage_training = False
        if data is None:  # the first granted reservation: only now is the source read
            loaded, of_batch = load_checked(run, loader)
            try:
                check_source_tasks(loaded, tasks, of_batch)
            except ValueError as exc:
                raise fail(run, job_error("record_mismatch", str(exc), field=SOURCE_FIELD)) from None
            data = RecordIndex(loaded)
            state = run.trainer.start(params, data.restrict(()), tasks)
        records = {batch_id: tuple(of_batch.get(batch_id, ())) for batch_id in stage.batch_ids}
        run.stage_training = True  # from here the stage's records are read: charged whole
        try:
            candidate = run.trainer.train_stage(
                state, stage, data.restrict(r for ids in records.values() for r in ids), records
            )
        except Exception as exc:
            logger.error(
                "job %s failed in stage %s: %s", job.id, stage.index, failure_log(exc, run.record_ids)
            )
            error = job_error("training_failed", failure_message(exc, run.record_ids), stage=stage.index)
            raise fail(run, error) from None
        run.control.set_step(stage.index)
        if run.control.should_stop() or not run.control.lease_valid():
            raise stop_for(run)
        metrics = {**candidate.metrics, **stage.info, "step": stage.index, "stage": stage.name}
        answer = release(run, stage.index, candidate.model_state, metrics, event=None)
        if answer is None:
            raise fail(run, run.refusal or job_error("refused", "the ledger refused the release."))
        run.reservation_id = None  # committed in full: closed
        reservation = answer.reservation
        cost_of = {c.index: c for c in reservation.classes}
        for b, index in reservations.all_batches(db, job.tenant_id, reservation.id):
            charged[b] = exact_add(charged.get(b, ZERO), cost_of[index].epsilon)
            delta_charged[b] = exact_add(delta_charged.get(b, ZERO), cost_of[index].delta)
        jobs.leases.record_progress(
            db,
            job.lease,
            step=stage.index,
            epsilon_committed=max(charged.values()),
            delta_committed=max(delta_charged.values()),
            metrics=metrics,
        )
    return finish(run, "succeeded")


def _stage_selector(
    stage: Stage, task_of: Mapping[str, LedgerTask]
) -> tuple[list[str] | None, list[str] | None]:
    """How a stage's reservation names its batches, ``(batch_ids, task_ids)``: by task (up to
    ``MAX_BATCHES_PER_RESERVATION`` batches) when they are exactly every batch of some tasks, as
    the planned tasks held them; else by id (at most ``MAX_IDS_PER_REQUEST``: a
    stage that reads part of a task, e.g. an episodic memory's batch). Issue 24: a stage of one
    task of 10 001 batches failed by id. The reservation's batch count is checked against the
    stage's afterwards (a batch added to a task since the plan is not read unreserved).
    ``task_of``: each planned batch's task."""
    named = set(stage.batch_ids)
    whole = {task_of[b].id: task_of[b] for b in stage.batch_ids if b in task_of}
    exact = (
        len(named) == len(stage.batch_ids)
        and named <= task_of.keys()
        and sum(len(task.batches) for task in whole.values()) == len(named)
    )
    if exact:
        return None, list(whole)
    return list(stage.batch_ids), None


__all__ = ["run_staged"]
