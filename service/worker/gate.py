"""The release gate: no data is read before the ledger holds the run's cost, and no model
version is published before the ledger committed it (docs/ARCHITECTURE.md, "Release flow").

For one claimed job (``run_job``):

1. **Plan and reserve, before any data is read.** The trainer's ``plan(params, n_records)``
   gives the event of the whole run (DP-SGD: ``SelfComposed(PoissonSampled(q, Gaussian(σ)), T)``)
   from the params and the record count of the dataset's batches, which the ledger knows. The
   gate reserves that event on every batch of the dataset, named by its tasks (up to 2 000 000
   batches; a list of batch ids stops at 10 000) (``service.ledger.reservations.reserve``,
   idempotency key ``job:<id>:a<attempt>:reserve``); a batch created while the job planned
   (the reservation holds more batches than planned) aborts it and fails the job. A refusal
   fails the job with the ledger's answer (``budget_exceeded`` with ``remaining`` and
   ``requested``, or the rule's code) and the data source is never opened.
2. **Load and check.** The *dataset's* data source (``datasets.data_source``, set by an admin of
   its tenant; a job's params never name one, and a ``params.data_source`` left by old clients is
   ignored) is read from the dataset row, then loaded through the tenant's data roots, which the
   loader checks again as it opens the file (``service.training.data``, "Data roots"). Its training
   record ids must be exactly the records of the ledger's batches — compared as the ledger stores
   them, HMAC-SHA256 with the dataset's salt. A mismatch aborts the reservation and fails the job
   before any training. No error, log line or metric carries a cell of the source or a record
   id: loading errors name lines, columns and rules; a mismatch gives counts and batch ids; a
   training failure's message has the source's record ids masked, and its log has no locals.
3. **Train and release.** At every checkpoint (``checkpoint_every`` steps, and the last step) the
   candidate is *staged* (weights written and fsynced under ``.staging``, their SHA-256 taken),
   then the release ``{model, version, artifact_sha256}`` is **committed** (so the signed
   certificate names those bytes) with the event of the steps so far (a progressive
   commit; the last one, for the whole run, closes the reservation), and only then *published*
   (``service.ledger.model_registry``). A refused commit destroys the candidate and stops the run.
4. **Stop.** Cancel, a lost lease, a worker shutdown, a refused commit or a failure abort the
   rest of the reservation, saying what ran (``reservations.abort(ran=...)``, in-process only:
   docs/ARCHITECTURE.md, "Threat model"). The worker holds the data and every output, so it
   knows: nothing is charged for a job that stopped before its first DP-SGD step (the source
   loaded and checked against the ledger's record hashes, no mechanism run, nothing shown); a
   job stopped after k steps is charged the k-step prefix ``plan.event_after(k)`` (a step counts
   from the moment it starts: a failure inside it may depend on its sample), with a certificate
   of ``outcome: "aborted"``, and only the steps never started are returned. A staged stage
   whose training began is charged whole (its trainer reports no prefix).
   A transient database error (a terminated connection, a serialization failure, a deadlock:
   ``service.db.session.is_transient_error``) ends the attempt, not the job: what ran is charged
   as above and the job goes back to the queue for its next attempt, as after a shutdown.

Only released numbers leave the run: a version's metrics are those of the committed model, on
the held-out test split; the metrics of a run that stopped early are those of its last release
(evaluating the unreleased model would publish a statistic of steps whose cost was returned).
The same holds for the job's per-step curve (``jobs.metric_history``): the trainer evaluates the
iterate on the test split every ``trace_every(steps)`` steps (``on_trace``), the gate keeps those
points in memory and stores them only once a commit covers their step (``_checkpoint``); the
points of steps no commit covered go with the run. The unnoised training loss is never kept.

A retried job (its previous worker lost the lease) first resolves the previous attempts: staged
candidates are published if their release was committed, deleted otherwise
(``registry.sweep``), and their reservations are aborted — charged in full: the worker that ran
them is gone, and nothing says how far it got. The retry then plans and reserves anew and trains
from the start; what the earlier attempts were charged stays spent.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Protocol

from accountant import events as ev
from accountant.errors import AccountantError
from accountant.exact import ZERO, exact_add
from accountant.rules import Charge
from service.db.session import Database, is_transient_error
from service.ledger import datasets, idempotency, jobs, quotes, reservations
from service.ledger import model_registry as registry
from service.ledger.batches import record_batches, record_hash, task_layout
from service.ledger.errors import Conflict, LedgerError, NotFound
from service.ledger.jobs.leases import ClaimedJob, LeaseLost
from service.training.algorithms import trainer_for
from service.training.stages import LedgerBatch, LedgerTask, Stage, StagedTrainer, stage_steps

if TYPE_CHECKING:
    from service.contract.data_roots import DataRoots
    from service.training.data import LoadedData
    from service.training.dp_sgd import ModelState, TrainingPlan

logger = logging.getLogger("service.worker.gate")

Loader = Callable[[str, str], "LoadedData"]
"""``loader(uri, tenant_id)``: the records of the dataset's source, read within the tenant's
data roots (``SourceLoader``)."""
SOURCE_FIELD: Final = "data_source"  # the dataset's (errors of a job's source name it)
_VERSION_RETRIES: Final = 20
_SAMPLE: Final = 5
_PLAN_EVENTS: Final = 20  # how many distinct events a staged job's recorded plan lists


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


class _Stop(Exception):
    """Leave the job: already finished, or not ours any more."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.status)
        self.outcome = outcome


@dataclass(frozen=True)
class SourceLoader:
    """The worker's loader: ``load_data(uri, roots.for_tenant(tenant_id))``."""

    roots: DataRoots

    def __call__(self, uri: str, tenant_id: str) -> LoadedData:
        from service.training.data import load_data

        return load_data(uri, self.roots.for_tenant(tenant_id))


def default_loader(uri: str, tenant_id: str) -> LoadedData:
    """``SourceLoader`` over the data roots of the environment's settings (``ledger worker``,
    ``ledger serve``); an app built with explicit settings passes its own ``SourceLoader``."""
    from service.contract.data_roots import DataRoots
    from service.settings import Settings

    return SourceLoader(DataRoots.of(Settings()))(uri, tenant_id)


# Packages whose exception messages this project writes: they name fields, rules and counts,
# never what a source holds (``DataSourceError``'s contract, ``InvalidParamsError``, the
# accountant's errors). Any other exception's text (a builtin ``KeyError('r17')``, numpy's or
# torch's messages quoting a value) is withheld.
_OWN_PACKAGES: Final = ("service.", "accountant.")


def without_records(text: str, record_ids: Collection[str]) -> str:
    """``text`` with every occurrence of a record id of the source replaced by ``<record id>``,
    longest ids first, also in their escaped (``repr``) form. Belt and braces for the messages
    ``failure_message`` keeps: they are ours and should never hold an id."""
    ids = {r for r in record_ids if r}
    if not ids:
        return text
    ids |= {repr(r)[1:-1] for r in ids}
    lengths = sorted({len(r) for r in ids}, reverse=True)
    out: list[str] = []
    i = 0
    while i < len(text):
        n = next((n for n in lengths if text[i : i + n] in ids), 0)
        out.append("<record id>" if n else text[i])
        i += n or 1
    return "".join(out)


def _raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, as the innermost frame of this project's code (file:line in
    function): a place in our source, never a value."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/service/" in f.filename or "/accountant/" in f.filename] or frames
    if not ours:
        return "an unknown place"
    frame = ours[-1]
    where = frame.filename
    for marker in ("/service/", "/accountant/"):
        if marker in where:
            where = where[where.rindex(marker) + 1 :]
    return f"{where}:{frame.lineno} in {frame.name}"


def failure_message(exc: BaseException, record_ids: Collection[str]) -> str:
    """What a job's error and the worker's log may say of a failure: the exception's type, and
    its message only when this project wrote it (``_OWN_PACKAGES``), with the source's record ids
    masked; otherwise where it was raised and that its text was withheld."""
    name = type(exc).__name__
    if type(exc).__module__.startswith(_OWN_PACKAGES):
        return f"{name}: {without_records(str(exc), record_ids)}"
    return f"{name} raised at {_raised_at(exc)} (its message is withheld: it may quote the data)"


def _failure_log(exc: BaseException, record_ids: Collection[str]) -> str:
    """``failure_message`` and the stack's frames (file, line, function and source line: never
    locals, never the message of a chained exception)."""
    frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    return f"{failure_message(exc, record_ids)}\n{frames}"


def _error(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": code, "message": message, **details}


def _serializer(model_state: ModelState) -> tuple[str, Callable[[IO[bytes]], None]]:
    """safetensors when installed, else ``torch.save`` of the state dict."""
    try:
        from safetensors.torch import save as save_safetensors  # type: ignore[import-not-found]
    except ImportError:
        import torch

        def write_torch(handle: IO[bytes]) -> None:
            torch.save(model_state, handle)

        return "torch", write_torch

    def write_safetensors(handle: IO[bytes]) -> None:
        handle.write(save_safetensors({k: v.contiguous() for k, v in model_state.items()}))

    return "safetensors", write_safetensors


# ---------------------------------------------------------------------------------------------
# Ledger reads
# ---------------------------------------------------------------------------------------------


def check_source_records(db: Database, dataset_id: str, data: LoadedData) -> dict[str, list[str]]:
    """The source's training record ids of each ledger batch (``{batch id: [record id, ...]}``).

    Raises ``RecordMismatchError`` unless the source's training record ids are exactly the records
    of the dataset's batches (compared as stored: HMAC-SHA256 with the dataset's salt)."""
    from service.training.data import RecordMismatchError

    salt, in_ledger = record_batches(db, dataset_id)
    seen: dict[bytes, str] = {}
    unexpected = 0
    duplicated = 0
    of_batch: dict[str, list[str]] = {}
    for record_id in data.record_ids:
        digest = record_hash(salt, str(record_id))
        if digest in seen:
            duplicated += 1
            continue
        seen[digest] = record_id
        if digest not in in_ledger:
            unexpected += 1
        else:
            of_batch.setdefault(in_ledger[digest], []).append(record_id)
    # Counts and batch ids only: naming the ids let a trainer learn them from the error.
    lacking = Counter(batch for digest, batch in in_ledger.items() if digest not in seen)
    if lacking or unexpected or duplicated:
        raise RecordMismatchError(
            data.uri,
            missing=sum(lacking.values()),
            unexpected=unexpected,
            duplicated=duplicated,
            missing_batches=lacking,
        )
    return of_batch


def check_source_tasks(
    data: LoadedData, tasks: Sequence[LedgerTask], of_batch: Mapping[str, list[str]]
) -> None:
    """Raise ``DataSourceError`` unless every ledger task holds exactly the records of one task
    of the source, each source task matched once (a staged run reads task by task)."""
    from service.contract.data_sources import DataSourceError

    source_task = {r: split.task for split in data.train for r in split.record_ids}
    sizes = {split.task: len(split) for split in data.train if len(split)}
    matched: dict[int, str] = {}
    for task in tasks:
        records = [r for batch_id in task.batch_ids for r in of_batch.get(batch_id, ())]
        found = {source_task[r] for r in records}
        if len(found) != 1 or sizes[min(found)] != len(records) or min(found) in matched:
            raise DataSourceError(
                f"{data.uri}: the records of the ledger's task {task.name!r} are not exactly one "
                f"task of the source (they come from source task(s) {sorted(found)[:_SAMPLE]})."
            )
        matched[min(found)] = task.id
    if len(matched) != len(sizes):
        raise DataSourceError(
            f"{data.uri}: source tasks {sorted(set(sizes) - set(matched))[:_SAMPLE]} have no ledger task."
        )


def ledger_tasks(db: Database, dataset_id: str) -> list[LedgerTask]:
    """The dataset's tasks in creation order, each with its batches in position order; a task
    without batches is left out."""
    return [
        LedgerTask(
            t.id, i, t.name, tuple(LedgerBatch(b, t.id, position, size) for b, position, size in t.batches)
        )
        for i, t in enumerate(t for t in task_layout(db, dataset_id) if t.batches)
    ]


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


def _completed_before(run: _Run) -> bool:
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


def _reserve_key(job_id: str, attempt: int, stage: int | None = None) -> str:
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


# ---------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------


@dataclass
class _Run:
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
    steps_started: int = 0  # DP-SGD steps begun on the current reservation (``_should_stop``)
    stage_training: bool = False  # a staged run's current stage has begun training
    # the iterate's metrics between checkpoints (on_trace), kept until a commit covers them
    trace: list[dict[str, Any]] = field(default_factory=list)
    trace_every: int | None = None


def _what_ran(run: _Run) -> reservations.Ran | None:
    """What ran of ``run.reservation_id``, for its abort (module docstring, step 4): ``Ran(None)``
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


def _abort_run(run: _Run) -> None:
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
    """Run one claimed job through the gate (module docstring) and finish it; ``limits``: the
    steps a plan may take (checked before anything is reserved)."""
    run = _Run(db, job, control, Path(artifact_dir), limits)
    try:
        return _run(run, reservation_ttl_s, loader, device)
    except _Stop as stop:
        return stop.outcome
    except LeaseLost:
        _abort_run(run)
        return Outcome("lease_lost")
    except Exception as exc:
        if is_transient_error(exc):  # the next attempt is expected not to meet it
            return _requeue(run, exc)
        # Unexpected (a bug, a permanent database error): free the hold and fail the job if the
        # database lets us; if it does not, the lease expires and the job is retried.
        logger.error("job %s: worker error: %s", job.id, _failure_log(exc, run.record_ids))
        error = _error("worker_error", failure_message(exc, run.record_ids))
        try:
            _abort_run(run)
            return _finish(run, "failed", error=error)
        except Exception:
            logger.exception("job %s: could not record the failure", job.id)
            return Outcome("lease_lost", error)


def _requeue(run: _Run, exc: BaseException) -> Outcome:
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
    error = _error(
        "transient_database_error", f"attempt {run.job.attempt} met a transient database error ({cause})."
    )
    try:
        _abort_run(run)  # charges the steps this attempt began, as any stopped attempt
        jobs.leases.release(run.db, run.job.lease)
    except Exception:
        logger.exception("job %s: could not requeue it; its lease will expire", run.job.id)
        return Outcome("lease_lost", error, list(run.released))
    return Outcome("requeued", error, list(run.released))


def _finish(run: _Run, status: str, *, error: dict[str, Any] | None = None) -> Outcome:
    metrics = run.released_metrics
    jobs.leases.finish(run.db, run.job.lease, status, metrics=metrics, error=error)
    return Outcome(status, error, list(run.released))


def _fail(run: _Run, error: dict[str, Any]) -> _Stop:
    _abort_run(run)
    return _Stop(_finish(run, "failed", error=error))


def _stop_for(run: _Run) -> _Stop:
    """Leave the job because ``control`` said so: abort the rest, then cancel / hand back."""
    _abort_run(run)
    reason = run.control.reason
    if reason == "cancelled":
        return _Stop(_finish(run, "cancelled"))
    if reason == "wall_time":  # what was committed stays spent and released; the rest was aborted
        limit = run.limits.max_wall_s
        error = _error(
            "wall_time_exceeded",
            f"the job ran longer than the {limit:g} s a job may run on a worker (LEDGER_JOB_MAX_WALL_S); "
            "it was stopped and the rest of its reservation returned.",
            limit_s=limit,
        )
        return _Stop(_finish(run, "failed", error=error))
    if reason == "shutdown":
        jobs.leases.release(run.db, run.job.lease)
        return _Stop(Outcome("released", None, list(run.released)))
    return _Stop(Outcome("lease_lost", None, list(run.released)))


def _run(run: _Run, reservation_ttl_s: float, loader: Loader, device: str | None) -> Outcome:
    db, job = run.db, run.job
    if job.attempt > 1:
        # The previous worker is gone: settle its candidates and its holds first.
        registry.sweep(db, run.artifact_dir, job_id=job.id)
        if _completed_before(run):  # it released the whole run and died before finishing the job
            raise _Stop(_finish(run, "succeeded"))
        for reservation_id in _earlier_reservations(db, job):
            abort_quietly(db, job.tenant_id, reservation_id)
    if job.cancel_requested:
        raise _Stop(_finish(run, "cancelled"))
    if job.attempt > job.max_attempts:
        raise _Stop(
            _finish(
                run,
                "failed",
                error=_error(
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
        params = _with_budget_delta(db, job, run.trainer.parse_params(jobs.params.trainer_params(job.params)))
        tasks = ledger_tasks(db, job.dataset_id)
        batches = [batch for task in tasks for batch in task.batches]
        if not batches:
            raise _fail(run, _error("no_batches", f"dataset {job.dataset_id!r} has no batches to train on."))
        if isinstance(run.trainer, StagedTrainer):
            stages = list(run.trainer.stages(params, tasks))
            steps = sum(stage_steps(stage) for stage in stages)
        else:
            # σ for target_epsilon: what the dataset would charge the run on the batches it reserves
            prices = quotes.DatasetPrices(db, job.tenant_id, job.dataset_id)  # every batch: what it reserves
            run.plan = run.trainer.plan(params, sum(batch.size for batch in batches), price=prices.price)
            steps = run.plan.steps
            if getattr(params, "target_epsilon", None) is not None:
                _check_target_fits(run, params, prices)
        too_many = jobs.params.steps_refusal(steps, jobs.params.trainer_params(job.params), run.limits)
        if too_many is not None:  # before the reservation: nothing is held, nothing read
            raise _fail(run, too_many)
        if isinstance(run.trainer, StagedTrainer) and getattr(params, "target_epsilon", None) is not None:
            _check_stages_fit(run, params, tasks, stages)  # (after the cheap refusals: it may search)
    except InvalidParamsError as exc:
        raise _fail(run, _error("invalid_input", str(exc), field=exc.field)) from None
    except AccountantError as exc:  # calibration: no σ reaches the target, ...
        raise _fail(run, _error("invalid_input", str(exc), field=getattr(exc, "field", "params"))) from None
    if isinstance(run.trainer, StagedTrainer):
        return _run_staged(run, params, tasks, stages, reservation_ttl_s, loader)
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
            idempotency_key=_reserve_key(job.id, job.attempt),
            ttl_s=reservation_ttl_s,
        )
    except LedgerError as exc:
        raise _fail(run, exc.to_json()) from None
    run.reservation_id = reserved.id
    if reserved.batches != len(batches):  # a batch was created since the plan
        message = (
            f"the dataset's batches changed while the job planned ({len(batches)} planned, "
            f"{reserved.batches} reserved); the reservation was aborted."
        )
        raise _fail(run, _error("batches_changed", message))
    jobs.leases.record_reservation(db, job.lease, run.reservation_id)
    if run.control.should_stop():
        raise _stop_for(run)

    # 2. Load the records (only now) and check them against the ledger's batches.
    run.data, _ = _load_checked(run, loader)
    if hasattr(run.trainer, "model_spec"):
        run.model_spec = run.trainer.model_spec(run.data, plan.params)

    # 3. Train; every release goes through _checkpoint.
    tracing: dict[str, Any] = {}
    if getattr(run.trainer, "traces_iterates", False) and plan.params.world_size == 1:
        from service.training.dp_sgd import trace_every  # torch: only in the worker

        run.trace_every = trace_every(plan.steps)
        tracing["on_trace"] = lambda step, metrics: run.trace.append(_point(step, metrics))
    try:
        result = run.trainer.train(
            run.data,
            plan,
            on_checkpoint=lambda step, state, event: _checkpoint(run, step, state, event),
            should_stop=lambda: _should_stop(run),
            **tracing,
        )
    except (LeaseLost, _Stop):
        raise
    except Exception as exc:  # a failed run: Lemma 1 violated, bad params for the data, ...
        # (run.failure: the release path failed with an unknown outcome and said why)
        failure = run.failure if run.failure is not None else exc
        if is_transient_error(failure):
            raise _Stop(_requeue(run, failure)) from None
        logger.error("job %s failed while training: %s", job.id, _failure_log(failure, run.record_ids))
        raise _fail(run, _error("training_failed", failure_message(failure, run.record_ids))) from None

    # 4. How it ended.
    if result.status == "completed":
        run.released_metrics = dict(result.metrics)  # every step is committed: all released
        return _finish(run, "succeeded")
    if result.status == "refused":
        if run.refusal is None:  # _checkpoint stopped because control said so
            raise _stop_for(run)
        raise _fail(run, run.refusal)
    raise _stop_for(run)


def _with_budget_delta(db: Database, job: ClaimedJob, params: Any) -> Any:
    """Params with a target ε and no ``delta`` (DP-SGD, AdaDp, the pre-trained trainers,
    NaiveGaussian): the budget's δ (the target is the run's own ε at it)."""
    from service.contract.job_params import (
        DpSgdParams,
        InvalidParamsError,
        NaiveGaussianParams,
        PretrainedParams,
    )

    targeted = isinstance(params, DpSgdParams | PretrainedParams | NaiveGaussianParams)
    if not targeted or params.delta is not None or params.noise_multiplier is not None:
        return params
    from service.ledger.spending.store import dataset_budget

    delta = dataset_budget(db, job.dataset_id)[1].delta
    if not 0 < delta < 1:
        raise InvalidParamsError(
            "params.delta",
            f"is required: the budget's delta is {delta}, and a target epsilon needs one in (0, 1).",
        )
    return replace(params, delta=float(delta))


def _check_target_fits(run: _Run, params: Any, prices: quotes.DatasetPrices) -> None:
    """A run calibrated to ``target_epsilon`` (its own ε) that the budget cannot admit is refused
    here, before anything is reserved or read, naming the largest ``target_epsilon`` that fits
    (``accountant.calibration.largest_fitting_epsilon`` on the dataset's quote)."""
    from accountant.calibration import largest_fitting_epsilon
    from service.training.dp_sgd import dp_sgd_event

    plan = run.plan
    quoted = prices.quote(plan.event)
    refused = quoted.refused
    if refused is None or refused.refusal is None:
        return

    def make(sigma: float) -> ev.DpEvent:
        q, steps = plan.sampling_probability, plan.steps
        return dp_sgd_event(sampling_probability=q, noise_multiplier=sigma, steps=steps)

    largest = largest_fitting_epsilon(
        make, admits=prices.admits, delta=params.delta, start=plan.noise_multiplier
    )
    fits = (
        f"the largest target_epsilon that fits is {largest}"
        if largest is not None
        else "no target_epsilon fits (no noise multiplier is admitted)"
    )
    raise _fail(
        run,
        {
            **refused.refusal.to_json(),
            "message": (
                f"the run calibrated to target_epsilon={params.target_epsilon} (its own epsilon at "
                f"delta={params.delta}, sigma={plan.noise_multiplier}) does not fit this dataset's "
                f"budget: {fits}. Nothing was reserved or read. ({refused.refusal.message})"
            ),
            "field": "params.target_epsilon",
            "largest_target_epsilon": largest,
        },
    )


def _check_stages_fit(run: _Run, params: Any, tasks: Sequence[LedgerTask], stages: Sequence[Stage]) -> None:
    """A staged run calibrated to ``target_epsilon`` (each stage's run's own ε; NaiveGaussian:
    the whole run's) whose stages the budget cannot admit in turn is refused here, before
    anything is reserved or read (``quotes.StagedPrices``: a later stage meets what the earlier
    ones leave). When the budget is what refuses it, the refusal names the largest
    ``target_epsilon`` under which every stage fits (``largest_fitting_target``: the stages
    re-planned by the trainer at each target tried); a rule's refusal (a ``parallel`` batch read
    twice) names none, as no target changes it."""
    from accountant.calibration import largest_fitting_target
    from service.ledger.errors import BudgetExceeded

    # the stages' batches do not depend on the target (only their σ does): classes formed once
    batch_sets = [stage.batch_ids for stage in stages]
    prices = quotes.StagedPrices(run.db, run.job.tenant_id, run.job.dataset_id, batch_sets)

    def charges(planned: Sequence[Stage]) -> list[Charge]:
        if [s.batch_ids for s in planned] != batch_sets:
            raise AssertionError("re-planned stages read other batches")
        return [Charge(s.event, s.noise_commitment) for s in planned]

    refused = prices.refusal(charges(stages))
    if refused is None:
        return
    stage = stages[refused.index]
    details: dict[str, Any] = {
        **refused.refusal.to_json(),
        "stage": stage.index,
        "stage_name": stage.name,
        "field": "params.target_epsilon",
    }
    if isinstance(refused.refusal, BudgetExceeded):

        def admits(target: float) -> bool:
            try:
                planned = run.trainer.stages(replace(params, target_epsilon=target), tasks)
            except AccountantError:  # no σ reaches this target
                return False
            return prices.refusal(charges(planned)) is None

        largest = largest_fitting_target(admits, below=params.target_epsilon)
        details["largest_target_epsilon"] = largest
        fits = (
            f"the largest target_epsilon under which every stage fits is {largest}"
            if largest is not None
            else "no target_epsilon fits (no noise multiplier is admitted)"
        )
    else:
        fits = "no target_epsilon changes that"
    details["message"] = (
        f"the run calibrated to target_epsilon={params.target_epsilon} (its own epsilon at "
        f"delta={params.delta}) would be refused at stage {stage.index} ({stage.name}): {fits}. "
        f"Nothing was reserved or read. ({refused.refusal.message})"
    )
    raise _fail(run, details)


def _load_checked(run: _Run, loader: Loader) -> tuple[LoadedData, dict[str, list[str]]]:
    """Load the dataset's data source (call only once a reservation is granted) and check it
    against the ledger's batches; a bad source fails the job. Returns the data and each batch's
    records. The job's own params are not consulted: the source belongs to the dataset."""
    from service.contract.data_sources import DataSourceError

    uri = datasets.data_source(run.db, run.job.tenant_id, run.job.dataset_id)
    if uri is None:
        message = (
            f"dataset {run.job.dataset_id!r} has no data source: an admin sets it with "
            "PUT /v1/datasets/{id}/data-source."
        )
        raise _fail(run, _error("data_source", message, field=SOURCE_FIELD))
    try:
        data = loader(uri, run.job.tenant_id)
        run.record_ids = frozenset(data.record_ids)
        return data, check_source_records(run.db, run.job.dataset_id, data)
    except DataSourceError as exc:  # its messages carry no cell and no record id
        code = "record_mismatch" if type(exc).__name__ == "RecordMismatchError" else "data_source"
        raise _fail(run, _error(code, str(exc), field=SOURCE_FIELD)) from None
    except (OSError, ImportError, ValueError) as exc:  # unreadable file, loader dependency missing
        # the type only: a library's message may quote what it read
        logger.error("job %s: could not load its data source: %s", run.job.id, _failure_log(exc, ()))
        message = f"could not load the data source ({type(exc).__name__})."
        raise _fail(run, _error("data_source", message, field=SOURCE_FIELD)) from None


def _should_stop(run: _Run) -> bool:
    """Asked before each step: a ``False`` begins one (``run.steps_started``)."""
    run.calls += 1
    run.control.set_step(run.calls - 1)
    stop = run.control.should_stop()
    if not stop:
        run.steps_started += 1
    return stop


def _checkpoint(run: _Run, step: int, model_state: ModelState, event: Any) -> bool:
    """Release the model after ``step`` steps: stage, commit, publish. ``False`` stops training."""
    run.control.set_step(step)
    if run.control.should_stop() or not run.control.lease_valid():
        return False
    final = step == run.plan.steps
    metrics: dict[str, Any] = dict(run.trainer.evaluate(run.data, model_state, run.plan.params))
    metrics["step"] = step
    answer = _release(run, step, model_state, metrics, event=None if final else event)
    if answer is None:
        return False
    committed = answer.reservation.committed
    jobs.leases.record_progress(
        run.db,
        run.job.lease,
        step=step,
        epsilon_committed=committed.epsilon,
        delta_committed=committed.delta,
        metrics=metrics,
    )
    if run.trace_every is not None:
        # The commit just made covers steps 1..step, so the iterates traced before it are
        # released (post-processing of the committed noisy steps): only now may they be stored.
        covered = [p for p in run.trace if p["step"] <= step]
        run.trace = [p for p in run.trace if p["step"] > step]
        jobs.leases.record_history(
            run.db, run.job.lease, [*covered, _point(step, metrics, checkpoint=True)], every=run.trace_every
        )
    return True


def _point(step: int, metrics: Mapping[str, Any], *, checkpoint: bool = False) -> dict[str, Any]:
    """One point of a job's ``metric_history``: the iterate's numeric metrics after ``step``."""
    point: dict[str, Any] = {"step": step, "checkpoint": checkpoint}
    point.update(
        (k, float(v))
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    )
    return point


def _release(
    run: _Run, step: int, model_state: ModelState, metrics: dict[str, Any], *, event: ev.DpEvent | None
) -> reservations.Commit | None:
    """Stage the candidate, commit ``run.reservation_id`` with its release (``event``: the
    run so far for a progressive commit, ``None`` for the whole reservation), then publish it.
    Returns the commit's answer, or ``None`` when the ledger refused (``run.refusal`` says why;
    the candidate is destroyed)."""
    db, job = run.db, run.job
    fmt, write = _serializer(model_state)
    answer: reservations.Commit | None = None
    staged: registry.StagedArtifact | None = None
    for _ in range(_VERSION_RETRIES):
        version = registry.next_version(db, job.tenant_id, job.model_name)
        staged = registry.stage(
            run.artifact_dir,
            tenant_id=job.tenant_id,
            name=job.model_name,
            version=version,
            job_id=job.id,
            attempt=job.attempt,
            dataset_id=job.dataset_id,
            step=step,
            metrics=metrics,
            fmt=fmt,
            write=write,
            model_spec=run.model_spec,
        )
        try:
            answer = reservations.commit(
                db,
                job.tenant_id,
                run.reservation_id or "",
                # The weights' SHA-256, known before the commit: the signed certificate binds it.
                release={"model": job.model_name, "version": version, "artifact_sha256": staged.sha256},
                event=event,
                idempotency_key=f"job:{job.id}:a{job.attempt}:commit:{step}:v{version}",
            )
        except Conflict as exc:
            registry.discard(run.artifact_dir, staged)
            if exc.reason == "release_exists":  # another job took the number
                continue
            run.refusal = exc.to_json()
            return None
        except LedgerError as exc:  # refused: the candidate is destroyed, never published
            registry.discard(run.artifact_dir, staged)
            run.refusal = exc.to_json()
            return None
        except BaseException as exc:
            # Unknown outcome (the database went away mid-commit): leave the candidate staged;
            # the sweep publishes it if the commit landed and deletes it otherwise.
            run.failure = exc
            raise
        break
    if answer is None or staged is None:
        run.refusal = _error("version_conflict", f"no free version number for {job.model_name!r}.")
        return None
    registry.publish(db, run.artifact_dir, staged, certificate_id=answer.certificate.id)
    run.released.append(staged.version)
    run.released_metrics = metrics
    return answer


# ---------------------------------------------------------------------------------------------
# Staged runs (service.training.stages): one reservation, commit and version per stage
# ---------------------------------------------------------------------------------------------


def _staged_plan_json(stages: Sequence[Stage]) -> dict[str, Any]:
    events: list[Any] = []
    for stage in stages:
        event = ev.to_json(stage.event)
        if event not in events and len(events) < _PLAN_EVENTS:
            events.append(event)
    return {"kind": "staged", "stages": len(stages), "events": events}


def _run_staged(
    run: _Run,
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
        raise _Stop(
            _finish(
                run,
                "failed",
                error=_error(
                    "not_resumable",
                    "the job's worker stopped after releasing some stages; a staged run is not "
                    "resumed. Its released versions and their spend stay.",
                ),
            )
        )
    if not stages:
        raise _fail(run, _error("invalid_input", "the run has no stages for this dataset.", field="params"))
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
            raise _stop_for(run)
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
                idempotency_key=_reserve_key(job.id, job.attempt, stage.index),
                ttl_s=reservation_ttl_s,
            )
        except LedgerError as exc:
            raise _fail(run, {**exc.to_json(), "stage": stage.index, "stage_name": stage.name}) from None
        run.reservation_id = reserved.id  # (a retry finds it by its idempotency key)
        if reserved.batches != len(stage.batch_ids):  # a task gained a batch since the plan
            message = (
                f"the batches of stage {stage.index} changed while the job planned "
                f"({len(stage.batch_ids)} planned, {reserved.batches} reserved); "
                "its reservation was aborted."
            )
            raise _fail(run, _error("batches_changed", message, stage=stage.index))
        run.stage_training = False
        if data is None:  # the first granted reservation: only now is the source read
            loaded, of_batch = _load_checked(run, loader)
            try:
                check_source_tasks(loaded, tasks, of_batch)
            except ValueError as exc:
                raise _fail(run, _error("record_mismatch", str(exc), field=SOURCE_FIELD)) from None
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
                "job %s failed in stage %s: %s", job.id, stage.index, _failure_log(exc, run.record_ids)
            )
            error = _error("training_failed", failure_message(exc, run.record_ids), stage=stage.index)
            raise _fail(run, error) from None
        run.control.set_step(stage.index)
        if run.control.should_stop() or not run.control.lease_valid():
            raise _stop_for(run)
        metrics = {**candidate.metrics, **stage.info, "step": stage.index, "stage": stage.name}
        answer = _release(run, stage.index, candidate.model_state, metrics, event=None)
        if answer is None:
            raise _fail(run, run.refusal or _error("refused", "the ledger refused the release."))
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
    return _finish(run, "succeeded")


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


__all__ = [
    "Control",
    "Outcome",
    "SourceLoader",
    "abort_quietly",
    "check_source_records",
    "default_loader",
    "ledger_tasks",
    "run_job",
    "trainer_for",
]
