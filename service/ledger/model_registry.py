"""The model registry: published model versions, their certificates, metrics and artifacts.

A version is published only after the ledger committed its release, and never half-way:

1. ``stage`` writes the candidate's weights under ``<artifact dir>/.staging/`` (temporary file,
   fsync, rename) with a *sidecar* JSON that says what it is (tenant, model, version, job,
   step, metrics, SHA-256). Nothing refers to it yet.
2. The gate commits the release ``{model, version}`` to the ledger, which stores its certificate.
   Refused: ``discard`` deletes the staged files — the candidate is destroyed.
3. ``publish``, in one database transaction: insert the ``model_versions`` row (it references the
   certificate), append ``model_version.published`` (with the artifact's SHA-256) to the
   dataset's audit chain, move the file to its final place (``<tenant>/<model>/v<N>.<ext>``),
   commit; then delete the sidecar.

So a row exists only with a committed certificate (the row is inserted after the commit and
references it) and only with its file in place (the file is moved before the row commits). A
crash between 2 and 3 leaves a sidecar whose release has a certificate but no row: ``sweep``
(run by every worker at start-up and when it takes over a job) finishes the publication from the
sidecar — *rolls forward* — so no certificate is left pointing at a release that never appears.
A sidecar without a certificate is a candidate that was never committed: ``sweep`` deletes it,
unless a live worker still holds the job's lease (it may be about to commit).

Versions are immutable integers per (tenant, model name), numbered after every release the
ledger recorded for that name (``next_version``), so a number that has a certificate is never
given to another model.

This module does not import torch: the API reads the registry; only the gate writes weights
(through the ``write`` callback of ``stage``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Final

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from accountant.auditing import against_certificate
from accountant.errors import InvalidArgumentError
from service.db.base import utcnow
from service.db.models import Certificate, Job, ModelVersion, Release
from service.db.session import Database
from service.ledger import audit
from service.ledger.certificates import get_certificate
from service.ledger.dp_statement import dp_statement
from service.ledger.errors import Conflict, InvalidInput, NotFound
from service.ledger.jobs import check_model_name, lease_is_live

STAGING: Final = ".staging"
SIDECAR: Final = ".json"
EXTENSIONS: Final = {"safetensors": ".safetensors", "torch": ".pt"}
MAX_PAGE: Final = 1000
_CHUNK: Final = 1 << 20


@dataclass(frozen=True)
class StagedArtifact:
    """A candidate version's weights, written and fsynced, not yet published."""

    tenant_id: str
    name: str
    version: int
    job_id: str
    attempt: int
    dataset_id: str
    step: int
    metrics: dict[str, Any]
    format: str
    sha256: str
    bytes: int
    staging_name: str  # file name under <artifact dir>/.staging/
    final_path: str  # relative to the artifact dir
    model_spec: dict[str, Any] | None = None  # architecture and preprocessing (load_model)

    def staging_path(self, artifact_dir: Path) -> Path:
        return Path(artifact_dir) / STAGING / self.staging_name

    def sidecar_path(self, artifact_dir: Path) -> Path:
        return Path(artifact_dir) / STAGING / (self.staging_name + SIDECAR)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> StagedArtifact:
        # ``model_spec`` is optional: sidecars written before it was recorded lack it.
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj or k != "model_spec"})


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temporary file in its folder: write, fsync, rename, fsync dir."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def final_path(tenant_id: str, name: str, version: int, fmt: str) -> str:
    return f"{tenant_id}/{name}/v{version}{EXTENSIONS[fmt]}"


def stage(
    artifact_dir: Path,
    *,
    tenant_id: str,
    name: str,
    version: int,
    job_id: str,
    attempt: int,
    dataset_id: str,
    step: int,
    metrics: Mapping[str, Any],
    fmt: str,
    write: Callable[[IO[bytes]], None],
    model_spec: Mapping[str, Any] | None = None,
) -> StagedArtifact:
    """Write a candidate's weights (``write`` serialises them to a binary file) and its sidecar;
    ``model_spec``: what the weights are (architecture, preprocessing), published with them."""
    if fmt not in EXTENSIONS:
        raise ValueError(f"artifact format must be one of {sorted(EXTENSIONS)}. Found {fmt!r}.")
    folder = Path(artifact_dir) / STAGING
    folder.mkdir(parents=True, exist_ok=True)
    staging_name = f"{job_id}.a{attempt}.v{version}{EXTENSIONS[fmt]}"
    path = folder / staging_name
    _write_atomically(path, write)
    staged = StagedArtifact(
        tenant_id=tenant_id,
        name=name,
        version=version,
        job_id=job_id,
        attempt=attempt,
        dataset_id=dataset_id,
        step=step,
        metrics=dict(metrics),
        format=fmt,
        sha256=_sha256(path),
        bytes=path.stat().st_size,
        staging_name=staging_name,
        final_path=final_path(tenant_id, name, version, fmt),
        model_spec=None if model_spec is None else dict(model_spec),
    )
    document = json.dumps(staged.to_json(), sort_keys=True).encode()

    def write_sidecar(handle: IO[bytes]) -> None:
        handle.write(document)

    _write_atomically(staged.sidecar_path(artifact_dir), write_sidecar)
    return staged


def discard(artifact_dir: Path, staged: StagedArtifact) -> None:
    """Destroy a candidate that will never be published (its commit was refused)."""
    staged.staging_path(artifact_dir).unlink(missing_ok=True)
    staged.sidecar_path(artifact_dir).unlink(missing_ok=True)
    _fsync_dir(Path(artifact_dir) / STAGING)


# ---------------------------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------------------------


def next_version(db: Database, tenant_id: str, name: str) -> int:
    """1 + the largest integer version the ledger released or the registry published for ``name``."""
    with db.session(readonly=True) as session:
        released = session.scalars(
            select(Release.version).where(Release.tenant_id == tenant_id, Release.model == name)
        ).all()
        published = session.scalar(
            select(func.max(ModelVersion.version)).where(
                ModelVersion.tenant_id == tenant_id, ModelVersion.name == name
            )
        )
    numbers = [int(v) for v in released if v.isdigit()]
    return max([0, published or 0, *numbers]) + 1


def certificate_of_candidate(session: Session, staged: StagedArtifact) -> str | None:
    """The id of the certificate of ``staged``'s own release, or ``None``.

    A certificate of the release ``{name, version}`` is the candidate's only if it names the
    candidate's bytes (its ``release.artifact_sha256``); one issued before releases named their
    artifact, only if its reservation is the candidate's job's. A certificate of the same model
    and version that another job or an external trainer committed is not: publishing the
    candidate under it would publish weights nobody committed (issue 24 §6)."""
    row = session.execute(
        select(Certificate.id, Certificate.body, Certificate.reservation_id)
        .join(Release, Release.id == Certificate.release_id)
        .where(
            Release.tenant_id == staged.tenant_id,
            Release.model == staged.name,
            Release.version == str(staged.version),
        )
    ).one_or_none()
    if row is None:
        return None
    certified = certified_sha256(row.body)
    if certified is not None:
        return str(row.id) if certified == staged.sha256 else None
    job_reservation = session.scalar(select(Job.reservation_id).where(Job.id == staged.job_id))
    return str(row.id) if job_reservation is not None and row.reservation_id == job_reservation else None


def certified_sha256(certificate: Mapping[str, Any]) -> str | None:
    """The artifact SHA-256 a certificate's release states (``None``: it names no artifact)."""
    release = certificate.get("release")
    digest = release.get("artifact_sha256") if isinstance(release, Mapping) else None
    return digest if isinstance(digest, str) else None


def version_json(row: ModelVersion) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name,
        "version": row.version,
        "job_id": row.job_id,
        "dataset_id": row.dataset_id,
        "certificate_id": row.certificate_id,
        "step": row.step,
        "metrics": row.metrics,
        "artifact": {
            "format": row.artifact_format,
            "sha256": row.artifact_sha256,
            "bytes": row.artifact_bytes,
            "url": f"/v1/models/{row.name}/versions/{row.version}/artifact",
        },
        "model_spec": row.model_spec,
        "created_at": row.created_at.isoformat(),
    }


def publish(
    db: Database,
    artifact_dir: Path,
    staged: StagedArtifact,
    *,
    certificate_id: str,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Publish a staged candidate whose release the ledger committed (see the module docstring).

    ``Conflict`` ``artifact_not_certified`` when the certificate names other bytes than the
    candidate's: the registry never serves weights under a certificate of other weights."""
    artifact_dir = Path(artifact_dir)
    source = staged.staging_path(artifact_dir)
    target = artifact_dir / staged.final_path
    target.parent.mkdir(parents=True, exist_ok=True)
    at = now or utcnow()
    moved = False
    try:
        with db.session() as session:
            certificate = session.scalar(select(Certificate.body).where(Certificate.id == certificate_id))
            certified = None if certificate is None else certified_sha256(certificate)
            if certified is not None and certified != staged.sha256:
                raise Conflict(
                    f"certificate {certificate_id} certifies artifact SHA-256 {certified}, not the "
                    f"staged candidate's {staged.sha256}.",
                    reason="artifact_not_certified",
                )
            row = ModelVersion(
                id=f"mv_{secrets.token_hex(12)}",
                tenant_id=staged.tenant_id,
                name=staged.name,
                version=staged.version,
                job_id=staged.job_id,
                dataset_id=staged.dataset_id,
                certificate_id=certificate_id,
                step=staged.step,
                metrics=staged.metrics,
                artifact_path=staged.final_path,
                artifact_sha256=staged.sha256,
                artifact_bytes=staged.bytes,
                artifact_format=staged.format,
                created_at=at,
                model_spec=staged.model_spec,
            )
            session.add(row)
            session.flush()
            audit.append(
                session,
                [
                    audit.AuditEvent(
                        "model_version.published",
                        {
                            "name": staged.name,
                            "version": staged.version,
                            "job_id": staged.job_id,
                            "certificate_id": certificate_id,
                            "artifact_sha256": staged.sha256,
                        },
                        tenant_id=staged.tenant_id,
                        dataset_id=staged.dataset_id,
                    )
                ],
                now=at,
            )
            if source.exists():
                os.replace(source, target)
                moved = True
            elif not target.exists():
                raise FileNotFoundError(f"staged artifact {source} is missing")
            _fsync_dir(target.parent)
            answer = version_json(row)
    except IntegrityError as exc:
        if moved:
            os.replace(target, source)
        raise Conflict(
            f"model {staged.name!r} version {staged.version} is already published.",
            reason="version_exists",
        ) from exc
    except BaseException:
        if moved:  # the row did not commit: the file goes back to staging for the sweep
            os.replace(target, source)
        raise
    staged.sidecar_path(artifact_dir).unlink(missing_ok=True)
    return answer


def sweep(
    db: Database, artifact_dir: Path, *, job_id: str | None = None, now: datetime | None = None
) -> dict[str, list[str]]:
    """Resolve staged candidates left by crashed workers: publish those whose own release has a
    certificate (``certificate_of_candidate``: roll forward), delete the others. Candidates of
    jobs a live worker holds are left alone, unless ``job_id`` names the job the caller holds."""
    folder = Path(artifact_dir) / STAGING
    out: dict[str, list[str]] = {"published": [], "discarded": [], "skipped": []}
    if not folder.is_dir():
        return out
    at = now or utcnow()
    for sidecar in sorted(folder.glob("*" + SIDECAR)):
        if job_id is not None and not sidecar.name.startswith(job_id + "."):
            continue
        try:
            staged = StagedArtifact.from_json(json.loads(sidecar.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: a sidecar is written atomically, so this is not ours
        with db.session(readonly=True) as session:
            if job_id is None and lease_is_live(session, staged.job_id, at):
                out["skipped"].append(staged.staging_name)
                continue
            published = session.scalar(
                select(ModelVersion.id).where(
                    ModelVersion.tenant_id == staged.tenant_id,
                    ModelVersion.name == staged.name,
                    ModelVersion.version == staged.version,
                    ModelVersion.job_id == staged.job_id,
                )
            )
            certificate_id = certificate_of_candidate(session, staged)
        if published is not None:  # published; only the sidecar was left
            sidecar.unlink(missing_ok=True)
        elif certificate_id is not None:
            publish(db, artifact_dir, staged, certificate_id=certificate_id, now=at)
            out["published"].append(staged.staging_name)
        else:
            discard(artifact_dir, staged)
            out["discarded"].append(staged.staging_name)
    # Temporary files of writes that never finished (their job is not live any more).
    for tmp in folder.glob("*.tmp"):
        owner = tmp.name.split(".", 1)[0]
        if job_id is not None and owner != job_id:
            continue
        with db.session(readonly=True) as session:
            live = job_id is None and lease_is_live(session, owner, at)
        if not live:
            tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# Reads (the API)
# ---------------------------------------------------------------------------------------------


def _name(name: str) -> str:
    try:
        return check_model_name(name, "name")
    except InvalidInput:
        raise NotFound("model", name) from None


def list_versions(
    db: Database, tenant_id: str, name: str, *, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    """The model's versions, oldest first: ``{data, count}``; an unknown model is ``NotFound``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    name = _name(name)
    where = (ModelVersion.tenant_id == tenant_id, ModelVersion.name == name)
    with db.session(readonly=True) as session:
        count = session.scalar(select(func.count()).select_from(ModelVersion).where(*where)) or 0
        if count == 0:
            raise NotFound("model", name)
        rows = session.scalars(
            select(ModelVersion).where(*where).order_by(ModelVersion.version).limit(limit).offset(offset)
        ).all()
        return {"data": [version_json(r) for r in rows], "count": count}


def _load_version(session: Session, tenant_id: str, name: str, version: int) -> ModelVersion:
    row = session.scalar(
        select(ModelVersion).where(
            ModelVersion.tenant_id == tenant_id,
            ModelVersion.name == name,
            ModelVersion.version == version,
        )
    )
    if row is None:
        raise NotFound("model version", f"{name}/{version}")
    return row


def get_version(db: Database, tenant_id: str, name: str, version: int) -> dict[str, Any]:
    """One version with its certificate (re-verifiable offline), its DP statement
    (``service.ledger.dp_statement``), metrics, job, ``model_spec`` and creation time."""
    name = _name(name)
    with db.session(readonly=True) as session:
        row = _load_version(session, tenant_id, name, version)
        answer = version_json(row)
        job = session.get(Job, row.job_id)
        answer["algorithm"] = job.algorithm if job is not None else None
        trained_by = None if job is None else {"algorithm": job.algorithm, "plan": job.plan}
    answer["certificate"] = get_certificate(db, tenant_id, row.certificate_id)
    answer["dp_statement"] = dp_statement(answer["certificate"], job=trained_by, model_spec=row.model_spec)
    audited = privacy_audit(answer["metrics"], answer["dp_statement"]["run_alone"])
    if audited is not None:
        answer["privacy_audit"] = audited
    return answer


def privacy_audit(metrics: Mapping[str, Any], run_alone: Mapping[str, Any]) -> dict[str, Any] | None:
    """A ``dp_sgd_audit`` version's audited ε lower bound beside the upper bound of the same run
    (the statement's ``run_alone``: the run's own (ε, δ) at the budget's δ), recomputed at that δ
    (``accountant.auditing.against_certificate``); ``None`` for a version without an audit.

    Not the certificate's charge: under a Rényi filter or a plan segment that is a budget share
    (the growth of the filter's progress, δ = 0 after the first release), no bound on the run."""
    record = metrics.get("privacy_audit")
    if not isinstance(record, Mapping):
        return None
    try:
        certified: dict[str, Any] | None = against_certificate(
            record, epsilon_upper=float(run_alone["epsilon"]), delta_upper=float(run_alone["delta"])
        )
    except InvalidArgumentError:  # a stored record the worker did not write: shown, not compared
        certified = None  # (``ledger check`` fails it as malformed)
    return {**record, "certified": certified}


def artifact_file(
    db: Database, tenant_id: str, name: str, version: int, artifact_dir: Path
) -> tuple[Path, dict[str, Any]]:
    """The version's artifact file (and the version): ``NotFound`` if it is not on disk."""
    name = _name(name)
    with db.session(readonly=True) as session:
        row = _load_version(session, tenant_id, name, version)
    root = Path(artifact_dir).resolve()
    path = (root / row.artifact_path).resolve()
    if root not in path.parents or not path.is_file():
        raise NotFound("artifact", f"{name}/{version}")
    return path, version_json(row)


__all__ = [
    "EXTENSIONS",
    "STAGING",
    "StagedArtifact",
    "artifact_file",
    "certificate_of_candidate",
    "certified_sha256",
    "discard",
    "final_path",
    "get_version",
    "list_versions",
    "next_version",
    "publish",
    "stage",
    "sweep",
    "version_json",
]
