"""Jobs as the API answers them (``job_json``), read with their versions.

A page of ``list_jobs`` is at most ``MAX_PAGE`` jobs, each with at most ``MAX_LISTED_VERSIONS`` of
its versions (``versions_total`` counts them all): with params bounded, a page's client-controlled
part is at most ``MAX_PAGE × MAX_PARAMS_BYTES`` = 3.2 MiB.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime
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


def select_jobs(*where: Any) -> Any:
    size, bounded = _params_columns()
    return select(Job, bounded, size).where(*where).options(defer(Job.params), defer(Job.metric_history))


def versions_of(
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


def answer_one(session: Session, tenant_id: str, job_id: str) -> dict[str, Any]:
    found = (
        session.execute(select_jobs(Job.id == job_id, Job.tenant_id == tenant_id)).one_or_none()
        if can_be_id(job_id)
        else None
    )
    if found is None:
        raise NotFound("job", job_id)
    versions, totals = versions_of(session, [job_id])
    answer = job_json(
        found[0],
        versions[job_id],
        params=found.bounded_params,
        params_bytes=found.params_bytes,
        versions_total=totals[job_id],
    )
    # one job's answer only (a page of jobs would carry up to MAX_HISTORY_POINTS points each)
    answer["metric_history"] = _renderable(session.scalar(select(Job.metric_history).where(Job.id == job_id)))
    return answer


__all__ = [
    "MAX_LISTED_VERSIONS",
    "answer_one",
    "job_json",
    "select_jobs",
    "versions_of",
]
