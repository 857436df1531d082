"""Training jobs: the one module that does all database work for them.

A job is created ``queued`` (``create_job``), *claimed* by one worker with a lease (``claim``),
kept by heartbeats (``heartbeat``), and ended by the worker that holds the lease (``finish``):
``succeeded``, ``failed`` or ``cancelled``. A worker that shuts down hands its job back
(``release``: ``queued`` again).

Claim — one statement (procrastinate's shape), fair between tenants:

* PostgreSQL: ``UPDATE jobs SET status = 'running', lease_owner = …, attempts = attempts + 1,
  claimed_at = now … WHERE id = (SELECT id FROM jobs AS candidate WHERE status = 'queued' OR
  (status = 'running' AND lease_expires_at < now) ORDER BY <running jobs of the candidate's
  tenant>, <the tenant's last claim> NULLS FIRST, created_at, id LIMIT 1 FOR UPDATE OF candidate
  SKIP LOCKED) RETURNING …``. Concurrent claimers skip the row another one has locked, and the
  row's lock is held until the claim commits, so one job is never handed to two workers.
* SQLite: the same statement inside ``BEGIN IMMEDIATE`` (``Database.session``): the write lock
  is taken before the row is chosen, so claims are serialised.

  Tenants take turns: a tenant with fewer jobs running goes first, then the one whose last job
  was claimed longest ago (never: first), then the oldest job. So one tenant's queue of long jobs
  cannot keep another tenant's job waiting behind it: with tenant A's five jobs queued before
  tenant B's one, the second claim is B's. (Two claims racing on PostgreSQL both read the state
  before either commits, so they may both pick the same tenant; the next claim evens it out.)

Limits (``JobLimits``, from ``LEDGER_JOB_MAX_STEPS``, ``LEDGER_JOB_MAX_WALL_S``,
``LEDGER_MAX_QUEUED_JOBS_PER_TENANT``): a tenant may have at most ``max_queued_per_tenant`` jobs
queued (409 ``too_many_queued_jobs`` at submit); the steps a job implies are checked against
``max_steps`` from its plan, before anything is reserved (``service.worker.gate``; an explicit
``params.steps`` above it is refused at submit already); a worker stops an attempt that runs
longer than ``max_wall_s``, aborts the rest of its reservation and fails it
(``service.worker.worker.JobControl``).

Leases. A lease is ``(lease_owner, attempts)``: every later write by the worker (``heartbeat``,
``record_reservation``, ``record_progress``, ``finish``) is conditional on both and on the job
still being ``running``; when another worker has re-claimed the job (after this lease expired),
the write matches no row and raises ``LeaseLost``, and the worker stops. A ``running`` job whose
lease expired is claimable again with ``attempts + 1``; the worker that claims an attempt past
``max_attempts`` fails the job instead of running it (``service.worker.gate``).

Cancel. A queued job is cancelled at once. A running one gets ``cancel_requested_at``; the
worker holding it sees that on its next heartbeat, stops, aborts the rest of the reservation
and finishes the job ``cancelled``. If that worker is gone, the next claim (after the lease
expires) does the same.

Job params: a typed document, validated at submit, stored only once valid (``create_job``).

* The document is JSON as the standard defines it: no NaN or Infinity (``1e999`` parses to
  Infinity), no lone surrogate and no NUL in a string, at most ``MAX_PARAMS_DEPTH`` levels deep and
  ``MAX_PARAMS_BYTES`` bytes as canonical JSON (422 naming the field). A row stored by an older
  version may hold any of these: answers render such rows defensively (``_renderable``; params
  above the bound are omitted and their size given) so one bad row cannot make ``GET /v1/jobs``
  answer 500 for its whole tenant.
* ``model_name`` (optional) is the job's: the registry name its versions are published under
  (default ``<algorithm>-<job id>``, unique per job). A name another dataset released versions under, or a
  queued or running job of another dataset will publish under, is refused (409
  ``model_name_taken``): versions are numbered per name after every release the ledger recorded
  (``registry.next_version``), so the job's versions would interleave with another dataset's model.
* The rest are the trainer's, checked against the algorithm's declaration
  (``service.contract.job_params``, torch-free: the same reader the trainer uses when the job runs).
* ``data_source`` is refused: the source belongs to the dataset, set by an admin
  (``service.ledger.datasets``), and a job on a dataset without one (or without batches) is
  refused at submit.

A page of ``list_jobs`` is at most ``MAX_PAGE`` jobs, each with at most ``MAX_LISTED_VERSIONS`` of
its versions (``versions_total`` counts them all): with params bounded, a page's client-controlled
part is at most ``MAX_PAGE × MAX_PARAMS_BYTES`` = 3.2 MiB.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Text, and_, case, cast, func, or_, select, type_coerce, update
from sqlalchemy.orm import Session, aliased, defer

from accountant.exact import to_text
from accountant.rules import BatchState
from service.contract import job_params
from service.contract.job_params import ALGORITHMS
from service.db.base import utcnow
from service.db.models import Batch, BatchStateRow, Dataset, Job, ModelVersion, Release, Tenant
from service.db.session import Database
from service.ledger import audit, idempotency
from service.ledger.datasets import can_be_id, load_dataset, refuse_archived
from service.ledger.errors import ChargeRefused, Conflict, InvalidInput, NotFound
from service.settings import Settings

JOB_KEYS: Final = ("model_name",)
"""Keys of ``params`` read by the job itself; the others are the trainer's."""
LEGACY_KEYS: Final = ("data_source",)
"""Keys that rows queued by older versions may hold: refused at submit, never passed to a trainer."""
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
ACTIVE: Final = ("queued", "running")
DEFAULT_MAX_ATTEMPTS: Final = 3
MAX_PAGE: Final = 100
MAX_LISTED_VERSIONS: Final = 50
MAX_PARAMS_KEYS: Final = 200
MAX_PARAMS_BYTES: Final = 32 * 1024
"""Bytes of the params document as canonical JSON (what is stored). The largest valid documents
(an L2DP-ML ``task_order`` for 1 000 tasks and the other keys) are under 6 KB."""
MAX_PARAMS_DEPTH: Final = 8
"""Nesting levels of the params document (the object itself is level 1; no trainer takes more
than a list of numbers, level 2)."""
MAX_KEY_LENGTH: Final = 100
MODEL_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
SET_SOURCE: Final = (
    "an admin sets it (POST /v1/datasets with data_source, or PUT /v1/datasets/{id}/data-source)"
)


class LeaseLost(Exception):
    """The job is no longer this worker's: re-claimed by another worker, or already finished."""

    def __init__(self, job_id: str, worker_id: str) -> None:
        super().__init__(f"worker {worker_id!r} no longer holds the lease of job {job_id!r}.")
        self.job_id = job_id
        self.worker_id = worker_id


class ModelNameTaken(Conflict):
    """The job's model name belongs to another dataset (its versions would interleave)."""

    code = "model_name_taken"


class TooManyQueuedJobs(Conflict):
    """The tenant already has ``LEDGER_MAX_QUEUED_JOBS_PER_TENANT`` jobs queued."""

    code = "too_many_queued_jobs"


@dataclass(frozen=True)
class JobLimits:
    """What one tenant's jobs may take of the shared workers (``service.settings``)."""

    max_steps: int
    max_wall_s: float
    max_queued_per_tenant: int

    @classmethod
    def of(cls, settings: Settings) -> JobLimits:
        return cls(settings.job_max_steps, settings.job_max_wall_s, settings.max_queued_jobs_per_tenant)

    @classmethod
    def from_environment(cls) -> JobLimits:
        """The limits ``LEDGER_*`` sets for this process (a worker started without explicit ones)."""
        return cls.of(Settings())


DEFAULT_LIMITS: Final = JobLimits.of(Settings.model_construct())
"""The settings' defaults (no environment read)."""


@dataclass(frozen=True)
class Lease:
    """A claim: the job's id and the (owner, attempt) every later write is conditional on."""

    job_id: str
    worker_id: str
    attempt: int
    expires_at: datetime


@dataclass(frozen=True)
class ClaimedJob:
    """What a worker needs to run a claimed job."""

    lease: Lease
    tenant_id: str
    dataset_id: str
    algorithm: str
    params: dict[str, Any]
    model_name: str
    max_attempts: int
    reservation_id: str | None
    cancel_requested: bool

    @property
    def id(self) -> str:
        return self.lease.job_id

    @property
    def attempt(self) -> int:
        return self.lease.attempt


@dataclass(frozen=True)
class Heartbeat:
    """The answer to a heartbeat: the lease's new expiry and whether a cancel was requested."""

    expires_at: datetime
    cancel_requested: bool


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def check_algorithm(algorithm: object) -> str:
    if algorithm in ALGORITHMS:
        assert isinstance(algorithm, str)
        return algorithm
    raise InvalidInput("algorithm", f"must be one of {list(ALGORITHMS)}. Found {_shown(algorithm)}.")


def check_model_name(name: object, field: str = "params.model_name") -> str:
    if not isinstance(name, str) or MODEL_NAME.fullmatch(name) is None:
        raise InvalidInput(
            field,
            "must be 1-200 characters of letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit. Found {_shown(name)}.",
        )
    return name


def default_model_name(algorithm: str, job_id: str) -> str:
    """``<algorithm>-<job id>``: unique per job, so a job without ``model_name`` never numbers
    its versions among another job's (two jobs on one dataset used to share a name)."""
    return f"{algorithm}-{job_id}"


def _shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message may quote it: ASCII (a lone surrogate would make the answer
    itself unencodable), and short (a message must not echo a megabyte back)."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _key_field(prefix: str, key: str) -> str:
    """``prefix.key`` as a field name an answer can carry (printable ASCII escapes, bounded)."""
    printable = key if key.isascii() and key.isprintable() else ascii(key)[1:-1]
    if len(printable) > MAX_KEY_LENGTH:
        printable = printable[:MAX_KEY_LENGTH] + "..."
    return f"{prefix}.{printable}"


def _check_text(text: str, field: str) -> None:
    if "\x00" in text:
        raise InvalidInput(field, "must not contain NUL (U+0000): no database stores it in a JSON string.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidInput(
            field,
            f"must be Unicode text: it holds a lone surrogate U+{code:04X} at index {exc.start}, "
            "which no UTF-8 answer can carry.",
        ) from None


def _check_json(value: object, field: str, depth: int) -> None:
    """Raise ``InvalidInput`` naming the first value of ``value`` that standard JSON cannot carry."""
    if depth > MAX_PARAMS_DEPTH:
        raise InvalidInput(field, f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does.")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(
                field,
                "must be a finite number: JSON has no NaN or Infinity (and a number beyond the "
                f"double range, such as 1e999, reads as Infinity). Found {value}.",
            )
    elif isinstance(value, str):
        _check_text(value, field)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(field, f"keys must be strings. Found {_shown(key)}.")
            name = _key_field(field, key)
            if len(key) > MAX_KEY_LENGTH:
                raise InvalidInput(name, f"is a key of {len(key)} characters; at most {MAX_KEY_LENGTH}.")
            _check_text(key, name)
            _check_json(item, name, depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{field}[{index}]", depth + 1)
    elif value is not None and not isinstance(value, bool | int):
        raise InvalidInput(
            field, f"must be JSON (object, array, string, number, boolean or null). Found {_shown(value)}."
        )


def check_document(params: object) -> dict[str, Any]:
    """The params document's shape and size: an object of at most ``MAX_PARAMS_KEYS`` keys and
    ``MAX_PARAMS_BYTES`` bytes as JSON. Measured in C before anything walks it (walking a
    multi-megabyte document in Python would be the attack). Its values are checked by
    ``check_params``."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise InvalidInput("params", f"must be an object. Found {type(params).__name__}.")
    if len(params) > MAX_PARAMS_KEYS:
        raise InvalidInput("params", f"must have at most {MAX_PARAMS_KEYS} keys. Found {len(params)}.")
    try:
        size = len(json.dumps(params, ensure_ascii=True, separators=(",", ":"), allow_nan=True))
    except RecursionError:
        raise InvalidInput(
            "params", f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does."
        ) from None
    except (TypeError, ValueError) as exc:
        raise InvalidInput("params", f"must be a JSON object ({exc}).") from None
    if size > MAX_PARAMS_BYTES:
        raise InvalidInput("params", f"must be at most {MAX_PARAMS_BYTES} bytes as JSON. Found {size} bytes.")
    # The RecursionError above is not a bound: Python 3.12's C encoder recurses far deeper than
    # 3.11's (a 5 000-level document encodes there; seen on the GPU machine). The size is bounded
    # now, so a walk that stops ``_WALK_BOUND`` levels down is cheap; ``check_params`` names the
    # exact path of anything between ``MAX_PARAMS_DEPTH`` and it.
    if _nests_deeper(params, _WALK_BOUND):
        raise InvalidInput("params", f"nests deeper than {MAX_PARAMS_DEPTH} levels; no trainer param does.")
    return dict(params)


_WALK_BOUND: Final = 4 * MAX_PARAMS_DEPTH
"""Levels ``check_document`` walks at most: a document deeper is refused before any other walk."""


def _nests_deeper(document: object, limit: int) -> bool:
    """Whether ``document`` holds a container more than ``limit`` levels deep (it is level 1)."""
    level: list[object] = [document]
    for _ in range(limit):
        children: list[object] = []
        for value in level:
            if isinstance(value, Mapping):
                children.extend(v for v in value.values() if isinstance(v, Mapping | list))
            elif isinstance(value, list):
                children.extend(v for v in value if isinstance(v, Mapping | list))
        if not children:
            return False
        level = children
    return True


def check_params(algorithm: str, document: Mapping[str, Any], limits: JobLimits = DEFAULT_LIMITS) -> Any:
    """The params ``check_document`` let through, validated (422 naming ``params.<key>``): as
    standard JSON (no NaN/Infinity, lone surrogate or NUL; ``MAX_PARAMS_DEPTH`` levels), the job's
    own keys, then the trainer's as the trainer will read them. Returns what the trainer's reader
    made of them (its dataclass)."""
    _check_json(document, "params", 1)
    if "data_source" in document:
        raise InvalidInput(
            "params.data_source",
            f"is not a job param: the data source belongs to the dataset; {SET_SOURCE}. A job "
            "trains on its dataset's source and cannot name one.",
        )
    if document.get("model_name") is not None:
        check_model_name(document["model_name"])
    try:
        parsed = job_params.validate(algorithm, trainer_params(document))
    except job_params.InvalidParamsError as exc:
        raise InvalidInput(exc.field, exc.message) from None
    steps = getattr(parsed, "steps", None)
    if isinstance(steps, int) and steps > limits.max_steps:
        raise InvalidInput(
            "params.steps", f"must be <= {limits.max_steps} (LEDGER_JOB_MAX_STEPS). Found {steps}."
        )
    return parsed


def trainer_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's part of a job's params (without ``JOB_KEYS`` and ``LEGACY_KEYS``)."""
    return {k: v for k, v in params.items() if k not in JOB_KEYS and k not in LEGACY_KEYS}


def steps_refusal(steps: int, params: Mapping[str, Any], limits: JobLimits) -> dict[str, Any] | None:
    """The job's error when ``steps`` (what its plan implies) exceed ``limits.max_steps``; the
    worker checks it before reserving, so a refused job reads nothing and holds nothing."""
    if steps <= limits.max_steps:
        return None
    field = "params.steps" if "steps" in params else "params.epochs"
    return {
        "error": "too_many_steps",
        "message": (
            f"the job's plan takes {steps} training steps, more than the {limits.max_steps} a job may "
            f"take (LEDGER_JOB_MAX_STEPS); give fewer {field[len('params.') :]}."
        ),
        "field": field,
        "steps": steps,
        "limit": limits.max_steps,
    }


# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _renderable(value: Any, depth: int = 0) -> Any:
    """``value`` as a strict JSON answer can carry it. Rows stored before submit-time validation
    (or metrics a worker wrote) may hold NaN/Infinity or lone surrogates, which would make the whole
    answer fail to encode (a 500 for every page holding the row): they are shown as text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        return value
    if depth >= MAX_PARAMS_DEPTH and isinstance(value, Mapping | list):
        return f"<nested deeper than {MAX_PARAMS_DEPTH} levels: not shown>"
    if isinstance(value, Mapping):
        return {_renderable(str(k)): _renderable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_renderable(v, depth + 1) for v in value]
    return value


def job_json(
    row: Job,
    versions: list[dict[str, Any]] | None = None,
    *,
    params: Any = None,
    params_bytes: int | None = None,
    versions_total: int | None = None,
) -> dict[str, Any]:
    """The job's answer. ``params``/``params_bytes``: the row's params as ``_bounded_params``
    loaded them (default: ``row.params``, bounded here)."""
    if params_bytes is None:
        params, params_bytes = _bounded(row.params)
    listed = versions if versions is not None else []
    answer = {
        "id": row.id,
        "dataset_id": row.dataset_id,
        "algorithm": row.algorithm,
        "params": _renderable(params),
        "model_name": row.model_name,
        "status": row.status,
        "progress": {"step": row.progress_step, "total": row.progress_total},
        "epsilon_committed": to_text(row.epsilon_committed),
        "delta_committed": to_text(row.delta_committed),
        "metrics": _renderable(row.metrics),
        "error": _renderable(row.error),
        "reservation_id": row.reservation_id,
        "attempts": row.attempts,
        "max_attempts": row.max_attempts,
        "cancel_requested": row.cancel_requested_at is not None,
        "plan": _renderable(row.plan),
        "versions": listed,
        "versions_total": versions_total if versions_total is not None else len(listed),
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
    }
    if params is None and params_bytes > MAX_PARAMS_BYTES:
        answer["params_omitted"] = {"bytes": params_bytes, "limit": MAX_PARAMS_BYTES}
    return answer


def _bounded(params: Any) -> tuple[Any, int]:
    """``(params, size)``, ``params`` ``None`` when its canonical JSON exceeds the bound."""
    try:
        size = len(json.dumps(params, ensure_ascii=True, separators=(",", ":"), allow_nan=True))
    except (TypeError, ValueError, RecursionError):
        return None, MAX_PARAMS_BYTES + 1
    return (params if size <= MAX_PARAMS_BYTES else None), size


def _params_columns() -> tuple[Any, Any]:
    """The stored params' size (the stored text is canonical, ASCII-only JSON: characters are
    bytes) and the params themselves only when within ``MAX_PARAMS_BYTES``: a row an older version
    stored with megabytes of params is never read whole into an answer."""
    size = func.length(cast(Job.params, Text))
    bounded = type_coerce(case((size <= MAX_PARAMS_BYTES, Job.params)), Job.params.type)
    return size.label("params_bytes"), bounded.label("bounded_params")


def _select_jobs(*where: Any) -> Any:
    size, bounded = _params_columns()
    return select(Job, bounded, size).where(*where).options(defer(Job.params))


def _versions_of(
    session: Session, job_ids: list[str], *, most: int | None = None
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Each job's versions (the newest ``most`` when given, oldest first) and how many it has."""
    out: dict[str, list[dict[str, Any]]] = {j: [] for j in job_ids}
    totals: dict[str, int] = dict.fromkeys(job_ids, 0)
    if not job_ids:
        return out, totals
    for job_id, count in session.execute(
        select(ModelVersion.job_id, func.count())
        .where(ModelVersion.job_id.in_(job_ids))
        .group_by(ModelVersion.job_id)
    ).all():
        totals[job_id] = count
    ranked = select(
        ModelVersion.job_id,
        ModelVersion.name,
        ModelVersion.version,
        ModelVersion.step,
        func.row_number()
        .over(partition_by=ModelVersion.job_id, order_by=ModelVersion.version.desc())
        .label("rank"),
    ).where(ModelVersion.job_id.in_(job_ids))
    query = ranked.subquery()
    stmt = select(query.c.job_id, query.c.name, query.c.version, query.c.step)
    if most is not None:
        stmt = stmt.where(query.c.rank <= most)
    for r in session.execute(stmt.order_by(query.c.version)).all():
        out[r.job_id].append({"name": r.name, "version": r.version, "step": r.step})
    return out, totals


def _answer_one(session: Session, tenant_id: str, job_id: str) -> dict[str, Any]:
    found = (
        session.execute(_select_jobs(Job.id == job_id, Job.tenant_id == tenant_id)).one_or_none()
        if can_be_id(job_id)
        else None
    )
    if found is None:
        raise NotFound("job", job_id)
    versions, totals = _versions_of(session, [job_id])
    return job_json(
        found[0],
        versions[job_id],
        params=found.bounded_params,
        params_bytes=found.params_bytes,
        versions_total=totals[job_id],
    )


def _load_job(session: Session, tenant_id: str, job_id: str) -> Job:
    row = (
        session.execute(
            select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id).options(defer(Job.params))
        ).scalar_one_or_none()
        if can_be_id(job_id)
        else None
    )
    if row is None:
        raise NotFound("job", job_id)
    return row


def _check_dataset_can_train(session: Session, dataset: Dataset) -> None:
    """A job on ``dataset`` could run: it has a data source and batches (422 ``dataset_id``)."""
    if dataset.data_source is None:
        raise InvalidInput(
            "dataset_id",
            f"dataset {dataset.id!r} has no data source: {SET_SOURCE}, then queue the job.",
        )
    if session.scalar(select(Batch.id).where(Batch.dataset_id == dataset.id).limit(1)) is None:
        raise InvalidInput(
            "dataset_id",
            f"dataset {dataset.id!r} has no batches to train on: register its tasks' batches "
            "(POST /v1/datasets/{id}/tasks/{task_id}/batches), then queue the job.",
        )


def _check_batch_size(session: Session, dataset: Dataset, parsed: Any) -> None:
    """422 naming the param when the trainer's params refuse the dataset's largest batch
    (``check_batch_size``: a run whose noise would leave the model at chance, e.g. L2DP-ML)."""
    check = getattr(parsed, "check_batch_size", None)
    if check is None:
        return
    largest = session.scalar(select(func.max(Batch.size)).where(Batch.dataset_id == dataset.id))
    try:
        check(int(largest or 0))
    except job_params.InvalidParamsError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def _check_delta_is_the_budgets(dataset: Dataset, algorithm: str, document: Mapping[str, Any]) -> None:
    """422 ``params.delta`` when a job names a δ other than its budget's (issue 28 §5): the ledger
    certifies every charge at the budget's δ, so a σ calibrated at another δ would be reported at
    one and certified at the other. Absent, the worker uses the budget's. Not for
    ``dp_sgd_audit``, whose ``delta`` is the δ its one-run audit states its bounds at (its charge
    is certified at the budget's δ all the same)."""
    if algorithm == "dp_sgd_audit":
        return
    delta = document.get("delta")
    if delta is None or isinstance(delta, bool) or not isinstance(delta, int | float):
        return  # absent, or the params check names what is wrong with it
    budget_delta = Decimal(str(dataset.budget["delta"]))
    if Decimal(repr(float(delta))) != budget_delta:
        raise InvalidInput(
            "params.delta",
            f"must be the dataset's budget delta, {to_text(budget_delta)}, at which the ledger "
            f"certifies every charge (or be left out to use it). Found {delta!r}.",
        )


MAX_NAMED_BATCHES: Final = 10


def _check_parallel_batches_unread(session: Session, dataset: Dataset) -> None:
    """409 ``batch_already_read`` when a job would read a batch of a ``parallel`` budget that a
    reservation read already (issue 28 §8): every job reads every task's batches, and the rule
    lets each batch be read once, so the worker would refuse the run. Decided on the distinct
    batch states (a handful), naming up to ``MAX_NAMED_BATCHES`` of the batches."""
    if dataset.budget.get("rule") != "parallel":
        return
    state_ids = session.scalars(select(Batch.state_id).where(Batch.dataset_id == dataset.id).distinct()).all()
    if not state_ids:
        return
    rows = session.execute(
        select(BatchStateRow.id, BatchStateRow.state).where(BatchStateRow.id.in_(state_ids))
    )
    read = [sid for sid, state in rows if BatchState.from_json(state).reads > 0]
    if not read:
        return
    where = (Batch.dataset_id == dataset.id, Batch.state_id.in_(read))
    count = session.scalar(select(func.count()).select_from(Batch).where(*where)) or 0
    named = list(session.scalars(select(Batch.id).where(*where).order_by(Batch.id).limit(MAX_NAMED_BATCHES)))
    refusal = ChargeRefused(
        "batch_already_read",
        f"dataset {dataset.id!r} has a parallel budget and {count} of its batches were read "
        f"already ({', '.join(named)}{', ...' if count > len(named) else ''}); a job reads every "
        "batch of the dataset and the parallel rule (assumption S2) lets each be read once. "
        "Register the new data as new batches of a new dataset (or tasks of one not yet read).",
        batch_id=named[0],
    )
    refusal.details.update(field="dataset_id", batches=named, batches_read=count)
    raise refusal


def _check_model_name_free(session: Session, tenant_id: str, dataset_id: str, model_name: str) -> None:
    """409 ``model_name_taken`` when another dataset released versions of ``model_name`` or has a
    queued or running job that will (module docstring)."""
    released = session.execute(
        select(Release.dataset_id, Release.version)
        .where(Release.tenant_id == tenant_id, Release.model == model_name, Release.dataset_id != dataset_id)
        .limit(1)
    ).first()
    if released is not None:
        raise ModelNameTaken(
            f"model {model_name!r} version {released.version!r} was released from dataset "
            f"{released.dataset_id!r}; this job's versions of {model_name!r} (from dataset "
            f"{dataset_id!r}) would be numbered among them. Choose another params.model_name.",
            reason="model_name_taken",
            model=model_name,
            version=released.version,
            dataset_id=released.dataset_id,
        )
    pending = session.execute(
        select(Job.id, Job.dataset_id)
        .where(
            Job.tenant_id == tenant_id,
            Job.model_name == model_name,
            Job.dataset_id != dataset_id,
            Job.status.in_(ACTIVE),
        )
        .limit(1)
    ).first()
    if pending is not None:
        raise ModelNameTaken(
            f"job {pending.id!r} of dataset {pending.dataset_id!r} will publish versions of model "
            f"{model_name!r}; this job's versions (from dataset {dataset_id!r}) would be numbered "
            "among them. Choose another params.model_name.",
            reason="model_name_taken",
            model=model_name,
            job_id=pending.id,
            dataset_id=pending.dataset_id,
        )


def _check_queue(session: Session, tenant_id: str, limits: JobLimits) -> None:
    queued = session.scalar(
        select(func.count()).select_from(Job).where(Job.tenant_id == tenant_id, Job.status == "queued")
    )
    if (queued or 0) >= limits.max_queued_per_tenant:
        raise TooManyQueuedJobs(
            f"the tenant has {queued} jobs queued, the most it may (LEDGER_MAX_QUEUED_JOBS_PER_TENANT = "
            f"{limits.max_queued_per_tenant}); queue more once some have started, or cancel some.",
            reason="too_many_queued_jobs",
            queued=queued,
            limit=limits.max_queued_per_tenant,
        )


# ---------------------------------------------------------------------------------------------
# API operations
# ---------------------------------------------------------------------------------------------


def create_job(
    db: Database,
    tenant_id: str,
    *,
    dataset_id: str,
    algorithm: str,
    params: Mapping[str, Any] | None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    limits: JobLimits = DEFAULT_LIMITS,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Queue a job (201). Refused, nothing is stored: ``InvalidInput`` (422) names a bad field —
    the document, a trainer param, a dataset without a source or batches, a ``params.delta``
    other than the budget's; ``NotFound`` an unknown dataset (checked before the params);
    ``ChargeRefused`` (``batch_already_read``) a parallel dataset whose batches were read;
    ``Conflict`` a model name another dataset's (``model_name_taken``) or a full queue
    (``too_many_queued_jobs``)."""
    if not isinstance(dataset_id, str) or not dataset_id or len(dataset_id) > 64:
        raise InvalidInput("dataset_id", f"must be a dataset id. Found {_shown(dataset_id)}.")
    _check_text(dataset_id, "dataset_id")
    algorithm = check_algorithm(algorithm)
    document = check_document(params)
    job_id = f"job_{secrets.token_hex(12)}"
    model_name = document.get("model_name") or default_model_name(algorithm, job_id)

    def body(session: Session, at: datetime) -> idempotency.Outcome:
        # One job creation per tenant at a time (SQLite: BEGIN IMMEDIATE already), so the queue
        # count and the model-name check hold until the row is in. FOR NO KEY UPDATE: spends'
        # inserts referencing the tenant (FOR KEY SHARE) do not wait for it.
        session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))
        dataset = load_dataset(session, tenant_id, dataset_id)
        # Unknown dataset first (404), then the params (422): an id that names nothing says
        # nothing about its params.
        parsed = check_params(algorithm, document, limits)
        refuse_archived(dataset_id, dataset.archived_at)
        _check_dataset_can_train(session, dataset)
        _check_batch_size(session, dataset, parsed)
        _check_delta_is_the_budgets(dataset, algorithm, document)
        _check_parallel_batches_unread(session, dataset)
        _check_model_name_free(session, tenant_id, dataset_id, model_name)
        _check_queue(session, tenant_id, limits)
        row = Job(
            id=job_id,
            tenant_id=tenant_id,
            dataset_id=dataset_id,
            algorithm=algorithm,
            params=document,
            model_name=model_name,
            status="queued",
            progress_step=0,
            epsilon_committed=Decimal(0),
            delta_committed=Decimal(0),
            attempts=0,
            max_attempts=max_attempts,
            created_at=at,
            updated_at=at,
        )
        session.add(row)
        session.flush()
        event = audit.AuditEvent(
            "job.created",
            {"job_id": row.id, "algorithm": algorithm, "model_name": model_name},
            tenant_id=tenant_id,
            dataset_id=dataset_id,
        )
        return idempotency.Outcome(job_json(row), [event])

    return idempotency.execute(
        db,
        tenant_id=tenant_id,
        operation="create_job",
        request={"dataset_id": dataset_id, "algorithm": algorithm, "params": document},
        idempotency_key=idempotency_key,
        body=body,
        status_code=201,
        now=now,
    )


def get_job(db: Database, tenant_id: str, job_id: str) -> dict[str, Any]:
    """The job (another tenant's answers ``NotFound``), with all its versions."""
    with db.session(readonly=True) as session:
        return _answer_one(session, tenant_id, job_id)


def list_jobs(
    db: Database, tenant_id: str, *, dataset_id: str | None = None, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    """The tenant's jobs, newest first: ``{data, count}`` (page bounds: module docstring)."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    with db.session(readonly=True) as session:
        where = [Job.tenant_id == tenant_id]
        if dataset_id is not None:
            where.append(Job.dataset_id == dataset_id)
        found = session.execute(
            _select_jobs(*where).order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
        ).all()
        count = session.scalar(select(func.count()).select_from(Job).where(*where))
        versions, totals = _versions_of(session, [r[0].id for r in found], most=MAX_LISTED_VERSIONS)
        data = [
            job_json(
                r[0],
                versions[r[0].id],
                params=r.bounded_params,
                params_bytes=r.params_bytes,
                versions_total=totals[r[0].id],
            )
            for r in found
        ]
        return {"data": data, "count": count or 0}


def cancel_job(db: Database, tenant_id: str, job_id: str, *, now: datetime | None = None) -> dict[str, Any]:
    """Cancel: a queued job now; a running one when its worker next heartbeats (``cancel_requested``).

    Cancelling a cancelled job answers it unchanged; a succeeded or failed one is a ``Conflict``
    (``job_finished``).
    """
    at = now or utcnow()
    with db.session() as session:
        row = _load_job(session, tenant_id, job_id)
        if row.status in ("succeeded", "failed"):
            raise Conflict(
                f"job {job_id!r} is {row.status}; it cannot be cancelled.",
                reason="job_finished",
                status=row.status,
            )
        if row.status == "cancelled" or row.cancel_requested_at is not None:
            return _answer_one(session, tenant_id, job_id)
        if row.status == "queued":
            row.status = "cancelled"
            row.finished_at = at
            row.lease_owner = row.lease_expires_at = None
        row.cancel_requested_at = at
        row.updated_at = at
        session.flush()
        audit.append(
            session,
            [
                audit.AuditEvent(
                    "job.cancel_requested",
                    {"job_id": row.id, "status": row.status},
                    tenant_id=tenant_id,
                    dataset_id=row.dataset_id,
                )
            ],
            now=at,
        )
        return _answer_one(session, tenant_id, job_id)


# ---------------------------------------------------------------------------------------------
# Worker operations
# ---------------------------------------------------------------------------------------------

_CLAIMED_COLUMNS: Final = (
    Job.id,
    Job.tenant_id,
    Job.dataset_id,
    Job.algorithm,
    Job.params,
    Job.model_name,
    Job.attempts,
    Job.max_attempts,
    Job.reservation_id,
    Job.cancel_requested_at,
    Job.lease_expires_at,
)


def _claim_statement(worker_id: str, at: datetime, expires: datetime) -> Any:
    """The fair claim (module docstring): one ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP
    LOCKED) RETURNING``, tenants ordered by their running jobs, then by their last claim."""
    candidate = aliased(Job, name="candidate")
    running = aliased(Job, name="running")
    claimed = aliased(Job, name="claimed")
    tenant_running = (
        select(func.count())
        .select_from(running)
        .where(
            running.tenant_id == candidate.tenant_id,
            running.status == "running",
            running.lease_expires_at >= at,
        )
        .scalar_subquery()
    )
    tenant_last_claim = (
        select(func.max(claimed.claimed_at)).where(claimed.tenant_id == candidate.tenant_id).scalar_subquery()
    )
    claimable = (
        select(candidate.id)
        .where(
            or_(
                candidate.status == "queued",
                and_(candidate.status == "running", candidate.lease_expires_at < at),
            )
        )
        .order_by(tenant_running, tenant_last_claim.asc().nulls_first(), candidate.created_at, candidate.id)
        .limit(1)
        # SQLite: FOR UPDATE is omitted; BEGIN IMMEDIATE serialises claims instead.
        .with_for_update(skip_locked=True, of=candidate)
        .scalar_subquery()
    )
    return (
        update(Job)
        .where(Job.id == claimable)
        .values(
            status="running",
            lease_owner=worker_id,
            lease_expires_at=expires,
            heartbeat_at=at,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, at),
            claimed_at=at,
            updated_at=at,
        )
        .returning(*_CLAIMED_COLUMNS)
    )


def claim(db: Database, worker_id: str, lease_s: float, *, now: datetime | None = None) -> ClaimedJob | None:
    """Claim the next job for ``worker_id`` for ``lease_s`` seconds, tenants taking turns (see the
    module docstring); ``None`` when there is none. One statement, one transaction."""
    at = now or utcnow()
    stmt = _claim_statement(worker_id, at, at + timedelta(seconds=lease_s))
    with db.session() as session:
        row = session.execute(stmt).one_or_none()
    if row is None:
        return None
    return ClaimedJob(
        lease=Lease(row.id, worker_id, row.attempts, row.lease_expires_at),
        tenant_id=row.tenant_id,
        dataset_id=row.dataset_id,
        algorithm=row.algorithm,
        params=dict(row.params),
        model_name=row.model_name,
        max_attempts=row.max_attempts,
        reservation_id=row.reservation_id,
        cancel_requested=row.cancel_requested_at is not None,
    )


def _held(lease: Lease) -> Any:
    return and_(
        Job.id == lease.job_id,
        Job.lease_owner == lease.worker_id,
        Job.attempts == lease.attempt,
        Job.status == "running",
    )


def heartbeat(
    db: Database,
    lease: Lease,
    lease_s: float,
    *,
    progress_step: int | None = None,
    now: datetime | None = None,
) -> Heartbeat:
    """Extend the lease by ``lease_s`` from now (and record the progress); ``LeaseLost`` if the
    job is no longer this lease's."""
    at = now or utcnow()
    expires = at + timedelta(seconds=lease_s)
    values: dict[str, Any] = {"lease_expires_at": expires, "heartbeat_at": at, "updated_at": at}
    if progress_step is not None:
        values["progress_step"] = progress_step
    with db.session() as session:
        row = session.execute(
            update(Job).where(_held(lease)).values(**values).returning(Job.cancel_requested_at)
        ).one_or_none()
    if row is None:
        raise LeaseLost(lease.job_id, lease.worker_id)
    return Heartbeat(expires, row.cancel_requested_at is not None)


def _update_held(db: Database, lease: Lease, values: dict[str, Any], now: datetime | None) -> None:
    values = {**values, "updated_at": now or utcnow()}
    with db.session() as session:
        done = session.execute(update(Job).where(_held(lease)).values(**values).returning(Job.id)).first()
    if done is None:
        raise LeaseLost(lease.job_id, lease.worker_id)


def record_plan(
    db: Database, lease: Lease, *, plan: dict[str, Any], total_steps: int, now: datetime | None = None
) -> None:
    """The attempt's training plan (computed before any data is read) and its step count."""
    _update_held(
        db,
        lease,
        {
            "plan": plan,
            "progress_total": total_steps,
            "progress_step": 0,
            "epsilon_committed": Decimal(0),
            "delta_committed": Decimal(0),
        },
        now,
    )


def record_reservation(
    db: Database, lease: Lease, reservation_id: str, *, now: datetime | None = None
) -> None:
    """The ledger reservation of this attempt (so a later attempt can abort what it holds)."""
    _update_held(db, lease, {"reservation_id": reservation_id}, now)


def record_progress(
    db: Database,
    lease: Lease,
    *,
    step: int,
    epsilon_committed: Decimal | None = None,
    delta_committed: Decimal | None = None,
    metrics: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    values: dict[str, Any] = {"progress_step": step}
    if epsilon_committed is not None:
        values["epsilon_committed"] = epsilon_committed
    if delta_committed is not None:
        values["delta_committed"] = delta_committed
    if metrics is not None:
        values["metrics"] = dict(metrics)
    _update_held(db, lease, values, now)


def finish(
    db: Database,
    lease: Lease,
    status: str,
    *,
    metrics: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    """End the job (``succeeded``, ``failed`` or ``cancelled``) and drop the lease."""
    if status not in TERMINAL:
        raise ValueError(f"status must be one of {sorted(TERMINAL)}. Found {status!r}.")
    at = now or utcnow()
    values: dict[str, Any] = {
        "status": status,
        "finished_at": at,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": at,
    }
    if metrics is not None:
        values["metrics"] = dict(metrics)
    if error is not None:
        values["error"] = dict(error)
    with db.session() as session:
        row = session.execute(
            update(Job).where(_held(lease)).values(**values).returning(Job.tenant_id, Job.dataset_id)
        ).one_or_none()
        if row is None:
            raise LeaseLost(lease.job_id, lease.worker_id)
        audit.append(
            session,
            [
                audit.AuditEvent(
                    "job.finished",
                    {"job_id": lease.job_id, "status": status, "attempt": lease.attempt},
                    tenant_id=row.tenant_id,
                    dataset_id=row.dataset_id,
                )
            ],
            now=at,
        )


def ended_under(db: Database, lease: Lease) -> bool:
    """Whether the job left ``running`` under this lease (finished or handed back by its own
    worker, no later claim): a heartbeat that races the end of its job is not a lost lease."""
    with db.session(readonly=True) as session:
        row = session.execute(select(Job.status, Job.attempts).where(Job.id == lease.job_id)).one_or_none()
    return row is not None and row.status != "running" and row.attempts == lease.attempt


def release(db: Database, lease: Lease, *, now: datetime | None = None) -> None:
    """Hand the job back (the worker is shutting down): ``queued`` again, lease dropped.

    The attempt counts: a job that keeps being handed back ends ``failed`` after
    ``max_attempts`` like one whose worker crashed.
    """
    _update_held(db, lease, {"status": "queued", "lease_owner": None, "lease_expires_at": None}, now)


def lease_is_live(session: Session, job_id: str, at: datetime) -> bool:
    """Whether some worker holds an unexpired lease on the job (for the staging sweep)."""
    row = session.execute(select(Job.status, Job.lease_expires_at).where(Job.id == job_id)).one_or_none()
    if row is None:
        return False
    return bool(row.status == "running" and row.lease_expires_at is not None and row.lease_expires_at >= at)


__all__ = [
    "ALGORITHMS",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_ATTEMPTS",
    "JOB_KEYS",
    "LEGACY_KEYS",
    "MAX_LISTED_VERSIONS",
    "MAX_PAGE",
    "MAX_PARAMS_BYTES",
    "MAX_PARAMS_DEPTH",
    "ClaimedJob",
    "Heartbeat",
    "JobLimits",
    "Lease",
    "LeaseLost",
    "ModelNameTaken",
    "TooManyQueuedJobs",
    "cancel_job",
    "check_algorithm",
    "check_document",
    "check_model_name",
    "check_params",
    "claim",
    "create_job",
    "default_model_name",
    "ended_under",
    "finish",
    "get_job",
    "heartbeat",
    "job_json",
    "lease_is_live",
    "list_jobs",
    "record_plan",
    "record_progress",
    "record_reservation",
    "release",
    "steps_refusal",
    "trainer_params",
]
