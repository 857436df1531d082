"""One attempt at a job, and how it ends (``service.worker.gate``, step 4).

Why its own module: every way out of a run — finished, failed, cancelled, stopped at the wall
time, handed back at shutdown, requeued after a transient database error, a lost lease — aborts
what the reservation still holds, saying what ran (``what_ran``: nothing before the first step,
the prefix of the steps begun, else the whole event), then records the job's end. Writing that
once keeps the charge of a stopped run the same on every path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from service.db.session import Database
from service.ledger import jobs, reservations
from service.ledger.errors import Conflict, LedgerError
from service.ledger.jobs.leases import ClaimedJob, LeaseLost
from service.worker.gate.failures import job_error

logger = logging.getLogger("service.worker.gate")  # one logger for the whole gate, as before its split


class Control(Protocol):
    """What the worker tells the gate while a job runs."""

    def should_stop(self) -> bool:
        """True once the job must stop: cancel requested, lease lost, or worker shutting down."""

    @property
    def reason(self) -> str | None:
        """``"cancelled"``, ``"lease_lost"``, ``"wall_time"`` (the attempt ran past
        ``LEDGER_JOB_MAX_WALL_S``) or ``"shutdown"`` once ``should_stop`` is true."""

    def lease_valid(self) -> bool:
        """Whether the lease is certainly still held now (checked before every commit)."""

    def set_step(self, step: int) -> None:
        """Steps done so far (the heartbeat records it)."""


@dataclass
class Outcome:
    """How the gate left the job: ``status`` as stored, or ``lease_lost`` / ``released`` /
    ``requeued`` (a transient database error ended the attempt: the job is queued again)."""

    status: str
    error: dict[str, Any] | None = None
    versions: list[int] = field(default_factory=list)


class Stop(Exception):
    """Leave the job: already finished, or not ours any more."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.status)
        self.outcome = outcome


@dataclass
class Run:
    """What the gate knows of the attempt it runs: what it planned and reserved, what it
    released, and how far training got (``steps_started``: what an abort charges)."""

    db: Database
    job: ClaimedJob
    control: Control
    artifact_dir: Path
    limits: jobs.params.JobLimits = jobs.params.DEFAULT_LIMITS
    trainer: Any = None
    plan: Any = None
    data: Any = None
    reservation_id: str | None = None
    refusal: dict[str, Any] | None = None
    failure: BaseException | None = None
    released: list[int] = field(default_factory=list)
    released_metrics: dict[str, Any] | None = None
    model_spec: dict[str, Any] | None = None  # what the released weights are (load_model)
    calls: int = 0
    record_ids: frozenset[str] = frozenset()  # the loaded source's, masked in failures
    steps_started: int = 0  # DP-SGD steps begun on the current reservation (``should_stop``)
    stage_training: bool = False  # a staged run's current stage has begun training
    # the iterate's metrics between checkpoints (on_trace), kept until a commit covers them
    trace: list[dict[str, Any]] = field(default_factory=list)
    trace_every: int | None = None


def reserve_key(job_id: str, attempt: int, stage: int | None = None) -> str:
    if stage is None:
        return f"job:{job_id}:a{attempt}:reserve"
    return f"job:{job_id}:a{attempt}:s{stage}:reserve"


def abort_quietly(
    db: Database, tenant_id: str, reservation_id: str | None, ran: reservations.Ran | None = None
) -> reservations.Reservation | None:
    """Abort what the reservation still holds; a closed one (committed in full) is left alone.
    ``ran``: what this worker ran of it (``_what_ran``); ``None`` when it cannot know (an earlier
    attempt's reservation): the whole reserved event is charged. The aborted reservation, or
    ``None`` when there was none to abort."""
    if reservation_id is None:
        return None
    try:
        return reservations.abort(db, tenant_id, reservation_id, ran=ran)
    except Conflict:
        return None  # fully committed: nothing is held
    except LedgerError as exc:
        logger.warning("could not abort reservation %s: %s", reservation_id, exc.message)
        return None


def _what_ran(run: Run) -> reservations.Ran | None:
    """What ran of ``run.reservation_id``, for its abort (``service.worker.gate``, step 4): ``Ran(None)``
    before any mechanism ran, the prefix of the steps begun, or ``None`` (charge the whole event)
    when this worker cannot tell (a staged stage that began training, a trainer without steps)."""
    if run.stage_training:
        return None
    if run.steps_started == 0:
        return reservations.Ran(None)
    from service.training.dp_sgd import DpSgdTrainer, TrainingPlan

    # ``DpSgdTrainer.train`` asks ``should_stop`` before each step and nowhere else, so the steps
    # begun are counted exactly; another trainer's are not.
    if not isinstance(run.trainer, DpSgdTrainer) or not isinstance(run.plan, TrainingPlan):
        return None
    return reservations.Ran(run.plan.event_after(min(run.steps_started, run.plan.steps)))


def abort_run(run: Run) -> None:
    """Abort the run's reservation, saying what ran of it; a one-reservation job then records
    what it was charged in all (the steps begun after its last release included)."""
    aborted = abort_quietly(run.db, run.job.tenant_id, run.reservation_id, _what_ran(run))
    if aborted is None or run.plan is None or run.steps_started == 0:
        return
    try:
        jobs.leases.record_progress(
            run.db,
            run.job.lease,
            step=run.steps_started,
            epsilon_committed=aborted.committed.epsilon,
            delta_committed=aborted.committed.delta,
        )
    except (LeaseLost, LedgerError):
        pass  # not ours any more: the ledger has the charge, the job row keeps its last release


def should_stop(run: Run) -> bool:
    """Asked before each step: a ``False`` begins one (``run.steps_started``)."""
    run.calls += 1
    run.control.set_step(run.calls - 1)
    stop = run.control.should_stop()
    if not stop:
        run.steps_started += 1
    return stop


def requeue(run: Run, exc: BaseException) -> Outcome:
    """A transient database error (``service.db.session.is_transient_error``: a terminated
    connection, a serialization failure, a deadlock) ended this attempt, not the job: abort the
    reservation as any stopped attempt does (what ran is charged, the rest returned), and hand
    the job back to the queue for its next attempt (``jobs.leases.release``; attempts still count, up
    to ``max_attempts``). A release whose commit's outcome is unknown stays staged: the next
    attempt's sweep publishes it if the commit landed. If the database refuses this too, the
    lease expires and the job is retried."""
    cause = type(getattr(exc, "orig", None) or exc).__name__
    logger.warning(
        "job %s: transient database error (%s) in attempt %d; requeued", run.job.id, cause, run.job.attempt
    )
    error = job_error(
        "transient_database_error", f"attempt {run.job.attempt} met a transient database error ({cause})."
    )
    try:
        abort_run(run)  # charges the steps this attempt began, as any stopped attempt
        jobs.leases.release(run.db, run.job.lease)
    except Exception:
        logger.exception("job %s: could not requeue it; its lease will expire", run.job.id)
        return Outcome("lease_lost", error, list(run.released))
    return Outcome("requeued", error, list(run.released))


def finish(run: Run, status: str, *, error: dict[str, Any] | None = None) -> Outcome:
    metrics = run.released_metrics
    jobs.leases.finish(run.db, run.job.lease, status, metrics=metrics, error=error)
    return Outcome(status, error, list(run.released))


def fail(run: Run, error: dict[str, Any]) -> Stop:
    abort_run(run)
    return Stop(finish(run, "failed", error=error))


def stop_for(run: Run) -> Stop:
    """Leave the job because ``control`` said so: abort the rest, then cancel / hand back."""
    abort_run(run)
    reason = run.control.reason
    if reason == "cancelled":
        return Stop(finish(run, "cancelled"))
    if reason == "wall_time":  # what was committed stays spent and released; the rest was aborted
        limit = run.limits.max_wall_s
        error = job_error(
            "wall_time_exceeded",
            f"the job ran longer than the {limit:g} s a job may run on a worker (LEDGER_JOB_MAX_WALL_S); "
            "it was stopped and the rest of its reservation returned.",
            limit_s=limit,
        )
        return Stop(finish(run, "failed", error=error))
    if reason == "shutdown":
        jobs.leases.release(run.db, run.job.lease)
        return Stop(Outcome("released", None, list(run.released)))
    return Stop(Outcome("lease_lost", None, list(run.released)))


__all__ = [
    "Control",
    "Outcome",
    "Run",
    "Stop",
    "abort_quietly",
    "abort_run",
    "fail",
    "finish",
    "requeue",
    "reserve_key",
    "should_stop",
    "stop_for",
]
