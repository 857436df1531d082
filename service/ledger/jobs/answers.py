"""Jobs as the ledger answers them, typed (issue 29 §1), read with their versions: a
``JobAnswer`` (``Decimal`` committed amounts, datetimes, ``JobVersion``s; its params, metrics,
error and plan stay the documents they are, shown as a strict JSON answer can carry them), a
``JobDetail`` (one job with its metric history: ``get_job``, ``cancel_job``) and a ``JobsPage``,
each with one ``to_json``, its wire form, called at the edge. A replay of ``create_job`` is
``JobAnswer.from_json`` of the stored answer, whose wire form stays that stored JSON.

A page of ``list_jobs`` is at most ``MAX_PAGE`` jobs, each with at most ``MAX_LISTED_VERSIONS`` of
its versions (``versions_total`` counts them all): with params bounded, a page's client-controlled
part is at most ``MAX_PAGE × MAX_PARAMS_BYTES`` = 3.2 MiB.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Text, case, cast, func, select, type_coerce
from sqlalchemy.orm import Session, defer

from accountant.exact import to_text
from service.db.models import Job, ModelVersion
from service.ledger.datasets import can_be_id
from service.ledger.errors import NotFound
from service.ledger.jobs.params import MAX_PARAMS_BYTES, MAX_PARAMS_DEPTH

MAX_LISTED_VERSIONS: Final = 50


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


@dataclass(frozen=True, slots=True)
class JobVersion:
    """A model version a job published: its model ``name``, ``version`` and training ``step``."""

    name: str
    version: int
    step: int | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "step": self.step}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> JobVersion:
        return cls(obj["name"], obj["version"], obj.get("step"))


@dataclass(frozen=True, slots=True)
class JobAnswer:
    """A job as the ledger answers it. ``params`` is ``None`` with ``params_omitted`` (its size in
    bytes) when the stored params exceed ``MAX_PARAMS_BYTES``; ``versions`` lists at most what was
    asked for, ``versions_total`` counts them all."""

    id: str
    dataset_id: str
    algorithm: str
    params: Any
    model_name: str
    status: str
    progress_step: int
    progress_total: int | None
    epsilon_committed: Decimal
    delta_committed: Decimal
    metrics: Any
    error: Any
    reservation_id: str | None
    attempts: int
    max_attempts: int
    cancel_requested: bool
    plan: Any
    versions: tuple[JobVersion, ...]
    versions_total: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    params_omitted: int | None = None
    _wire: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls,
        row: Job,
        versions: list[JobVersion] | None = None,
        *,
        params: Any = None,
        params_bytes: int | None = None,
        versions_total: int | None = None,
    ) -> JobAnswer:
        """The job's answer. ``params``/``params_bytes``: the row's params as ``select_jobs``
        loaded them (default: ``row.params``, bounded here)."""
        if params_bytes is None:
            params, params_bytes = _bounded(row.params)
        listed = tuple(versions) if versions is not None else ()
        return cls(
            row.id,
            row.dataset_id,
            row.algorithm,
            _renderable(params),
            row.model_name,
            row.status,
            row.progress_step,
            row.progress_total,
            row.epsilon_committed,
            row.delta_committed,
            _renderable(row.metrics),
            _renderable(row.error),
            row.reservation_id,
            row.attempts,
            row.max_attempts,
            row.cancel_requested_at is not None,
            _renderable(row.plan),
            listed,
            versions_total if versions_total is not None else len(listed),
            row.created_at,
            row.updated_at,
            row.started_at,
            row.finished_at,
            params_bytes if params is None and params_bytes > MAX_PARAMS_BYTES else None,
        )

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> JobAnswer:
        """The job of an answer this ledger gave (a stored idempotent answer); its wire form is
        that answer as stored."""
        omitted = obj.get("params_omitted")
        return cls(
            obj["id"],
            obj["dataset_id"],
            obj["algorithm"],
            obj.get("params"),
            obj["model_name"],
            obj["status"],
            obj["progress"]["step"],
            obj["progress"]["total"],
            Decimal(obj["epsilon_committed"]),
            Decimal(obj["delta_committed"]),
            obj.get("metrics"),
            obj.get("error"),
            obj.get("reservation_id"),
            obj["attempts"],
            obj["max_attempts"],
            obj["cancel_requested"],
            obj.get("plan"),
            tuple(JobVersion.from_json(v) for v in obj.get("versions", ())),
            obj.get("versions_total", 0),
            datetime.fromisoformat(obj["created_at"]),
            datetime.fromisoformat(obj["updated_at"]),
            _datetime(obj.get("started_at")),
            _datetime(obj.get("finished_at")),
            None if omitted is None else omitted["bytes"],
            dict(obj),
        )

    def to_json(self) -> dict[str, Any]:
        if self._wire is not None:
            return self._wire
        answer = {
            "id": self.id,
            "dataset_id": self.dataset_id,
            "algorithm": self.algorithm,
            "params": self.params,
            "model_name": self.model_name,
            "status": self.status,
            "progress": {"step": self.progress_step, "total": self.progress_total},
            "epsilon_committed": to_text(self.epsilon_committed),
            "delta_committed": to_text(self.delta_committed),
            "metrics": self.metrics,
            "error": self.error,
            "reservation_id": self.reservation_id,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "cancel_requested": self.cancel_requested,
            "plan": self.plan,
            "versions": [v.to_json() for v in self.versions],
            "versions_total": self.versions_total,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }
        if self.params_omitted is not None:
            answer["params_omitted"] = {"bytes": self.params_omitted, "limit": MAX_PARAMS_BYTES}
        return answer


@dataclass(frozen=True, slots=True)
class JobDetail:
    """One job as ``get_job`` and ``cancel_job`` answer it: the ``job`` with all its versions and
    its ``metric_history`` (a document; only here: a page of jobs would carry up to
    ``MAX_HISTORY_POINTS`` points each)."""

    job: JobAnswer
    metric_history: Any

    def to_json(self) -> dict[str, Any]:
        return {**self.job.to_json(), "metric_history": self.metric_history}


@dataclass(frozen=True, slots=True)
class JobsPage:
    """A page of the tenant's jobs (``list_jobs``) and how many match in all."""

    data: tuple[JobAnswer, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [j.to_json() for j in self.data], "count": self.count}


def _datetime(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


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


def select_jobs(*where: Any) -> Any:
    size, bounded = _params_columns()
    return select(Job, bounded, size).where(*where).options(defer(Job.params), defer(Job.metric_history))


def versions_of(
    session: Session, job_ids: list[str], *, most: int | None = None
) -> tuple[dict[str, list[JobVersion]], dict[str, int]]:
    """Each job's versions (the newest ``most`` when given, oldest first) and how many it has."""
    out: dict[str, list[JobVersion]] = {j: [] for j in job_ids}
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
        out[r.job_id].append(JobVersion(r.name, r.version, r.step))
    return out, totals


def answer_one(session: Session, tenant_id: str, job_id: str) -> JobDetail:
    found = (
        session.execute(select_jobs(Job.id == job_id, Job.tenant_id == tenant_id)).one_or_none()
        if can_be_id(job_id)
        else None
    )
    if found is None:
        raise NotFound("job", job_id)
    versions, totals = versions_of(session, [job_id])
    job = JobAnswer.of(
        found[0],
        versions[job_id],
        params=found.bounded_params,
        params_bytes=found.params_bytes,
        versions_total=totals[job_id],
    )
    history = session.scalar(select(Job.metric_history).where(Job.id == job_id))
    return JobDetail(job, _renderable(history))


__all__ = [
    "MAX_LISTED_VERSIONS",
    "JobAnswer",
    "JobDetail",
    "JobVersion",
    "JobsPage",
    "answer_one",
    "select_jobs",
    "versions_of",
]
