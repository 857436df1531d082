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

A model trained outside the service (the Opacus adapter, ``release_gate``) has a certificate of
its release and no job: ``register_external`` publishes it under that certificate, in one
transaction (row, ``model_version.published`` audit event with ``origin: "external"``, file
moved from ``.uploads/``). The
server hashes the bytes it received (``ArtifactUpload``, size-bounded) and refuses a SHA-256 the
client stated otherwise; the certificate must be the caller tenant's, of a committed release named
exactly ``{name, version}``, not a job's (the worker publishes those), not used by another
version, and, when it names an artifact SHA-256, of these bytes. Its DP statement is derived from
the certificate on read like any version's (``get_version``): nothing the client states about its
training enters it; architecture and preprocessing are shown as the client's description.

This module does not import torch: the API reads the registry; only the gate writes weights
(through the ``write`` callback of ``stage``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import IO, Any, Final

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from accountant.errors import InvalidArgumentError
from accountant.privacy_audit import against_certificate
from service.db.base import utcnow
from service.db.models import Certificate, Job, ModelVersion, Release
from service.db.session import Database
from service.ledger import audit
from service.ledger.certificates import get_certificate
from service.ledger.datasets import can_be_id
from service.ledger.dp_statement import dp_statement, guarantee_of
from service.ledger.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from service.ledger.jobs.leases import lease_is_live
from service.ledger.jobs.params import check_model_name
from service.ledger.spending.answers import EpsilonDelta

STAGING: Final = ".staging"
UPLOADS: Final = ".uploads"  # external artifacts being received (never swept with .staging)
# An upload not written to for this long belongs to a request that died with its process.
UPLOAD_MAX_IDLE_S: Final = 86_400.0
SIDECAR: Final = ".json"
EXTENSIONS: Final = {"safetensors": ".safetensors", "torch": ".pt"}
# What an external trainer may upload: the worker's formats, ONNX, or opaque bytes.
EXTERNAL_FORMATS: Final = {**EXTENSIONS, "onnx": ".onnx", "bytes": ".bin"}
MAX_PAGE: Final = 1000
MAX_DESCRIPTION: Final = 1000  # characters of an external version's architecture / preprocessing
MAX_METRICS: Final = 32
_METRIC_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
# Control characters other than tab and newline: a description is shown on pages and cards.
_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
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
    return f"{tenant_id}/{name}/v{version}{EXTERNAL_FORMATS[fmt]}"


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


@dataclass(frozen=True, slots=True)
class Artifact:
    """A version's weights as published: their format, SHA-256 and size (``size``, ``bytes`` on
    the wire), and the route that serves them."""

    format: str
    sha256: str
    size: int
    url: str

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "sha256": self.sha256, "bytes": self.size, "url": self.url}


@dataclass(frozen=True, slots=True)
class Version:
    """A published model version as the registry answers it: what trained it (``job_id``; none for
    a release trained outside the service), the certificate of its release, its metrics and
    artifact. ``guarantee``: the (ε, δ) its certificate states, in a listing (``list_versions``)
    only. One ``to_json``, the wire form, at the edge."""

    id: str
    name: str
    version: int
    job_id: str | None
    dataset_id: str
    certificate_id: str
    step: int | None
    metrics: dict[str, Any]
    artifact: Artifact
    model_spec: dict[str, Any] | None
    created_at: datetime
    guarantee: EpsilonDelta | None = None

    @classmethod
    def of(cls, row: ModelVersion, guarantee: EpsilonDelta | None = None) -> Version:
        return cls(
            row.id,
            row.name,
            row.version,
            row.job_id,
            row.dataset_id,
            row.certificate_id,
            row.step,
            row.metrics,
            Artifact(
                row.artifact_format,
                row.artifact_sha256,
                row.artifact_bytes,
                f"/v1/models/{row.name}/versions/{row.version}/artifact",
            ),
            row.model_spec,
            row.created_at,
            guarantee,
        )

    @property
    def origin(self) -> str:
        return "job" if self.job_id is not None else "external"

    def to_json(self) -> dict[str, Any]:
        answer = {
            "id": self.id,
            "name": self.name,
            "version": self.version,
            "origin": self.origin,
            "job_id": self.job_id,
            "dataset_id": self.dataset_id,
            "certificate_id": self.certificate_id,
            "step": self.step,
            "metrics": self.metrics,
            "artifact": self.artifact.to_json(),
            "model_spec": self.model_spec,
            "created_at": self.created_at.isoformat(),
        }
        if self.guarantee is not None:
            answer["guarantee"] = self.guarantee.to_json()
        return answer


@dataclass(frozen=True, slots=True)
class VersionDetail:
    """One version as ``get_version`` answers it: the ``version``, the algorithm of the job that
    trained it (``None``: trained outside), its stored ``certificate`` and its ``dp_statement``
    (documents, as stored and as ``dp_statement`` states them) and, for an audited run, its
    ``privacy_audit`` beside the certified bound."""

    version: Version
    algorithm: str | None
    certificate: dict[str, Any]
    dp_statement: dict[str, Any]
    privacy_audit: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        answer = {
            **self.version.to_json(),
            "algorithm": self.algorithm,
            "certificate": self.certificate,
            "dp_statement": self.dp_statement,
        }
        if self.privacy_audit is not None:
            answer["privacy_audit"] = self.privacy_audit
        return answer


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """A model of the tenant's registry: how many versions (how many trained outside), the
    latest, and the datasets they were trained on."""

    name: str
    versions: int
    external_versions: int
    latest_version: int
    latest_created_at: datetime
    dataset_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": self.versions,
            "external_versions": self.external_versions,
            "latest_version": self.latest_version,
            "latest_created_at": self.latest_created_at.isoformat(),
            "dataset_ids": list(self.dataset_ids),
        }


@dataclass(frozen=True, slots=True)
class ModelsPage:
    """A page of the tenant's models, by name, and how many it has."""

    data: tuple[ModelSummary, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [m.to_json() for m in self.data], "count": self.count}


@dataclass(frozen=True, slots=True)
class VersionsPage:
    """A page of a model's versions, oldest first, and how many it has."""

    data: tuple[Version, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [v.to_json() for v in self.data], "count": self.count}


def publish(
    db: Database,
    artifact_dir: Path,
    staged: StagedArtifact,
    *,
    certificate_id: str,
    now: datetime | None = None,
) -> Version:
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
            answer = Version.of(row)
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


def _sweep_uploads(artifact_dir: Path, now_s: float) -> None:
    """Delete external uploads idle for ``UPLOAD_MAX_IDLE_S`` (a live upload's file is written
    to, hence touched, at every chunk; a registered one has moved out of ``.uploads/``)."""
    folder = artifact_dir / UPLOADS
    if not folder.is_dir():
        return
    for upload in folder.glob("upload.*.tmp"):
        try:
            if now_s - upload.stat().st_mtime > UPLOAD_MAX_IDLE_S:
                upload.unlink(missing_ok=True)
        except FileNotFoundError:
            continue


def sweep(
    db: Database, artifact_dir: Path, *, job_id: str | None = None, now: datetime | None = None
) -> dict[str, list[str]]:
    """Resolve staged candidates left by crashed workers: publish those whose own release has a
    certificate (``certificate_of_candidate``: roll forward), delete the others. Candidates of
    jobs a live worker holds are left alone, unless ``job_id`` names the job the caller holds.
    External uploads idle for a day (their request died with its process) are deleted too."""
    folder = Path(artifact_dir) / STAGING
    out: dict[str, list[str]] = {"published": [], "discarded": [], "skipped": []}
    _sweep_uploads(Path(artifact_dir), (now or utcnow()).timestamp())
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
# Versions trained outside the service
# ---------------------------------------------------------------------------------------------


class ArtifactUpload:
    """An external artifact as the server receives it: written chunk by chunk under
    ``<artifact dir>/.uploads/``, hashed as it arrives, refused past ``max_bytes``
    (``PayloadTooLarge``, the partial file deleted). ``discard()`` deletes what is left; after a
    successful ``register_external`` the file has moved and nothing is left."""

    def __init__(self, artifact_dir: Path, max_bytes: int) -> None:
        folder = Path(artifact_dir) / UPLOADS
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"upload.{secrets.token_hex(12)}.tmp"
        self.max_bytes = max_bytes
        self.bytes = 0
        self._digest = hashlib.sha256()
        self._handle: IO[bytes] | None = self.path.open("xb")

    def write(self, chunk: bytes) -> None:
        if self._handle is None:
            raise ValueError("the upload is finished")
        self.bytes += len(chunk)
        if self.bytes > self.max_bytes:
            self.discard()
            raise PayloadTooLarge("artifact", self.max_bytes)
        self._digest.update(chunk)
        self._handle.write(chunk)

    def finish(self) -> str:
        """Flush and fsync the file; its SHA-256 (hex)."""
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None
        return self._digest.hexdigest()

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self.path.unlink(missing_ok=True)


def _description(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(field, "is required: a non-empty description (free text).")
    if len(value) > MAX_DESCRIPTION:
        raise InvalidInput(field, f"must be at most {MAX_DESCRIPTION} characters. Found {len(value)}.")
    if _CONTROL.search(value) is not None:
        raise InvalidInput(field, "must not contain control characters other than tab and newline.")
    return value.strip()


def check_metrics(metrics: object, field: str = "metrics") -> dict[str, float]:
    """At most ``MAX_METRICS`` ``{name: finite number}`` (names: a letter, then up to 63 letters,
    digits, ``_ . -``): what an external trainer reports about its model, shown as its claim."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidInput(
            field, f"must be an object of metric name to number. Found {type(metrics).__name__}."
        )
    if len(metrics) > MAX_METRICS:
        raise InvalidInput(field, f"must have at most {MAX_METRICS} entries. Found {len(metrics)}.")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or _METRIC_NAME.fullmatch(key) is None:
            raise InvalidInput(
                field,
                f"names must be a letter then up to 63 letters, digits, '_', '.', '-'. Found {key!r:.80}.",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInput(f"{field}.{key}", f"must be a finite number. Found {value!r:.80}.")
        out[key] = float(value)
    return out


def _registrable(
    session: Session, tenant_id: str, name: str, version: int, certificate_id: str, sha256: str
) -> Certificate | ModelVersion:
    """The certificate under which ``sha256`` may be registered as ``name`` version ``version``,
    or the version it already registered (a retry); else the refusal (``register_external``)."""
    certificate = session.get(Certificate, certificate_id)
    if certificate is None or certificate.tenant_id != tenant_id:
        raise NotFound("certificate", certificate_id)
    existing = session.scalar(select(ModelVersion).where(ModelVersion.certificate_id == certificate_id))
    if existing is not None:
        if (existing.name, existing.version, existing.artifact_sha256) == (name, version, sha256):
            return existing  # a retry of this registration
        raise Conflict(
            f"certificate {certificate_id} is already the certificate of model "
            f"{existing.name!r} version {existing.version}; one certificate certifies one version.",
            reason="certificate_used",
            model=existing.name,
            version=existing.version,
        )
    if certificate.release_id is None:
        outcome = certificate.body.get("outcome") if isinstance(certificate.body, Mapping) else None
        raise Conflict(
            f"certificate {certificate_id} certifies a charge that released nothing "
            f"(outcome {outcome!r}); register a version under the certificate of its commit.",
            reason="not_a_release",
            outcome=outcome,
        )
    release = session.get(Release, certificate.release_id)
    if release is None or (release.model, release.version) != (name, str(version)):
        certified = None if release is None else {"model": release.model, "version": release.version}
        raise Conflict(
            f"certificate {certificate_id} certifies the release {certified}, not model "
            f"{name!r} version {version}.",
            reason="release_mismatch",
            certified_release=certified,
        )
    job_id = session.scalar(select(Job.id).where(Job.reservation_id == certificate.reservation_id))
    if job_id is not None:
        raise Conflict(
            f"certificate {certificate_id} is of job {job_id}: the service's worker "
            "publishes the versions its jobs train.",
            reason="certificate_of_job",
            job_id=job_id,
        )
    certified_bytes = certified_sha256(certificate.body)
    if certified_bytes is not None and certified_bytes != sha256:
        raise Conflict(
            f"certificate {certificate_id} certifies artifact SHA-256 {certified_bytes}, not the "
            f"artifact's {sha256}.",
            reason="artifact_not_certified",
        )
    taken = session.scalar(
        select(ModelVersion.id).where(
            ModelVersion.tenant_id == tenant_id,
            ModelVersion.name == name,
            ModelVersion.version == version,
        )
    )
    if taken is not None:
        raise Conflict(f"model {name!r} version {version} is already published.", reason="version_exists")
    return certificate


def _checked_inputs(
    name: str, version: int, sha256: object, fmt: object, architecture: object, preprocessing: object
) -> tuple[str, str, dict[str, str]]:
    """``(name, sha256 in lower case, model_spec)`` of a registration, or the field it gets wrong."""
    name = check_model_name(name, "name")
    if not 1 <= version <= 2**31 - 1:
        raise InvalidInput("version", f"must be an integer in [1, 2^31 - 1]. Found {version}.")
    stated = sha256.lower() if isinstance(sha256, str) else sha256
    if not isinstance(stated, str) or _SHA256.fullmatch(stated) is None:
        raise InvalidInput("sha256", f"must be 64 hexadecimal characters (SHA-256). Found {sha256!r:.80}.")
    if not isinstance(fmt, str) or fmt not in EXTERNAL_FORMATS:
        raise InvalidInput("format", f"must be one of {sorted(EXTERNAL_FORMATS)}. Found {fmt!r:.80}.")
    spec = {
        "kind": "external",
        "architecture": _description(architecture, "architecture"),
        "preprocessing": _description(preprocessing, "preprocessing"),
    }
    return name, stated, spec


def check_registration(
    db: Database,
    tenant_id: str,
    *,
    name: str,
    version: int,
    certificate_id: str,
    sha256: str,
    fmt: str,
    architecture: str,
    preprocessing: str,
) -> None:
    """The refusals ``register_external`` would answer before any byte is received (a wrong
    certificate need not upload a large artifact first); it checks them again when it commits."""
    name, stated, _ = _checked_inputs(name, version, sha256, fmt, architecture, preprocessing)
    if not can_be_id(certificate_id):
        raise NotFound("certificate", certificate_id)
    with db.session(readonly=True) as session:
        _registrable(session, tenant_id, name, version, certificate_id, stated)


def register_external(
    db: Database,
    artifact_dir: Path,
    upload: ArtifactUpload,
    *,
    tenant_id: str,
    name: str,
    version: int,
    certificate_id: str,
    sha256: str,
    fmt: str,
    architecture: str,
    preprocessing: str,
    metrics: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> tuple[Version, bool]:
    """Publish the uploaded artifact as ``name`` version ``version``, trained outside the service,
    under the certificate of its release (module docstring); ``(version, created)``. Registering
    the same bytes under the same certificate again answers the existing version
    (``created`` false). Every refusal changes nothing; the caller discards the upload."""
    name, stated, spec = _checked_inputs(name, version, sha256, fmt, architecture, preprocessing)
    claimed = check_metrics(metrics)
    received = upload.finish()
    if upload.bytes == 0:
        raise InvalidInput("artifact", "is empty: send the model's bytes as the request body.")
    if received != stated:
        raise InvalidInput(
            "sha256",
            f"{stated} is not the SHA-256 of the {upload.bytes} bytes received ({received}); "
            "nothing was registered.",
        )
    if not can_be_id(certificate_id):
        raise NotFound("certificate", certificate_id)
    at = now or utcnow()
    artifact_dir = Path(artifact_dir)
    target_rel = final_path(tenant_id, name, version, fmt)
    target = artifact_dir / target_rel
    moved = False
    try:
        with db.session() as session:
            checked = _registrable(session, tenant_id, name, version, certificate_id, received)
            if isinstance(checked, ModelVersion):
                return Version.of(checked), False  # a retry of this registration
            certificate = checked
            row = ModelVersion(
                id=f"mv_{secrets.token_hex(12)}",
                tenant_id=tenant_id,
                name=name,
                version=version,
                job_id=None,
                dataset_id=certificate.dataset_id,
                certificate_id=certificate_id,
                step=None,
                metrics=claimed,
                artifact_path=target_rel,
                artifact_sha256=received,
                artifact_bytes=upload.bytes,
                artifact_format=fmt,
                created_at=at,
                model_spec=spec,
            )
            session.add(row)
            session.flush()
            audit.append(
                session,
                [
                    audit.AuditEvent(
                        # the worker's event type: ``ledger check`` then requires the version in
                        # a bundle whichever trained it
                        "model_version.published",
                        {
                            "name": name,
                            "version": version,
                            "job_id": None,
                            "origin": "external",
                            "certificate_id": certificate_id,
                            "artifact_sha256": received,
                        },
                        tenant_id=tenant_id,
                        dataset_id=certificate.dataset_id,
                    )
                ],
                now=at,
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(upload.path, target)
            moved = True
            _fsync_dir(target.parent)
            answer = Version.of(row)
    except IntegrityError as exc:  # a concurrent registration of this version or certificate
        if moved:
            os.replace(target, upload.path)
        raise Conflict(
            f"model {name!r} version {version} or certificate {certificate_id} was registered "
            "concurrently; read the version.",
            reason="version_exists",
        ) from exc
    except BaseException:
        if moved:  # the row did not commit: the bytes go back to the upload, which is discarded
            os.replace(target, upload.path)
        raise
    return answer, True


def list_models(db: Database, tenant_id: str, *, limit: int = 100, offset: int = 0) -> ModelsPage:
    """The tenant's models, by name."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput("limit", f"must be in [1, {MAX_PAGE}]. Found {limit}.")
    if offset < 0:
        raise InvalidInput("offset", f"must be >= 0. Found {offset}.")
    where = ModelVersion.tenant_id == tenant_id
    with db.session(readonly=True) as session:
        count = session.scalar(select(func.count(func.distinct(ModelVersion.name))).where(where)) or 0
        names = session.execute(
            select(
                ModelVersion.name,
                func.count(),
                func.count(ModelVersion.job_id),
                func.max(ModelVersion.version),
                func.max(ModelVersion.created_at),
            )
            .where(where)
            .group_by(ModelVersion.name)
            .order_by(ModelVersion.name)
            .limit(limit)
            .offset(offset)
        ).all()
        datasets: dict[str, set[str]] = {}
        if names:
            for model, dataset_id in session.execute(
                select(ModelVersion.name, ModelVersion.dataset_id)
                .where(where, ModelVersion.name.in_([n[0] for n in names]))
                .distinct()
            ):
                datasets.setdefault(model, set()).add(dataset_id)
    data = tuple(
        ModelSummary(
            model,
            int(total),
            int(total) - int(with_job),
            int(latest),
            created,
            tuple(sorted(datasets.get(model, ()))),
        )
        for model, total, with_job, latest, created in names
    )
    return ModelsPage(data, count)


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
) -> VersionsPage:
    """The model's versions, oldest first, each with the ``guarantee`` (ε, δ)
    its certificate states (``dp_statement.guarantee_of``); an unknown model is ``NotFound``."""
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
        rows = session.execute(
            select(ModelVersion, Certificate.body)
            .join(Certificate, Certificate.id == ModelVersion.certificate_id)
            .where(*where)
            .order_by(ModelVersion.version)
            .limit(limit)
            .offset(offset)
        ).all()
        data = []
        for row, body in rows:
            epsilon, delta = guarantee_of(body)
            data.append(Version.of(row, EpsilonDelta(Decimal(epsilon), Decimal(delta))))
        return VersionsPage(tuple(data), count)


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


def get_version(db: Database, tenant_id: str, name: str, version: int) -> VersionDetail:
    """One version with its certificate (re-verifiable offline), its DP statement
    (``service.ledger.dp_statement``), metrics, job, ``model_spec`` and creation time."""
    name = _name(name)
    with db.session(readonly=True) as session:
        row = _load_version(session, tenant_id, name, version)
        published = Version.of(row)
        job = None if row.job_id is None else session.get(Job, row.job_id)
        algorithm = job.algorithm if job is not None else None
        trained_by = None if job is None else {"algorithm": job.algorithm, "plan": job.plan}
    certificate = get_certificate(db, tenant_id, row.certificate_id)
    statement = dp_statement(certificate, job=trained_by, model_spec=row.model_spec)
    audited = privacy_audit(published.metrics, statement["run_alone"])
    return VersionDetail(published, algorithm, certificate, statement, audited)


def privacy_audit(metrics: Mapping[str, Any], run_alone: Mapping[str, Any]) -> dict[str, Any] | None:
    """A ``dp_sgd_audit`` version's audited ε lower bound beside the upper bound of the same run
    (the statement's ``run_alone``: the run's own (ε, δ) at the budget's δ), recomputed at that δ
    (``accountant.privacy_audit.against_certificate``); ``None`` for a version without an audit.

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
) -> tuple[Path, Version]:
    """The version's artifact file (and the version): ``NotFound`` if it is not on disk."""
    name = _name(name)
    with db.session(readonly=True) as session:
        row = _load_version(session, tenant_id, name, version)
    root = Path(artifact_dir).resolve()
    path = (root / row.artifact_path).resolve()
    if root not in path.parents or not path.is_file():
        raise NotFound("artifact", f"{name}/{version}")
    return path, Version.of(row)


def versions_of_job(db: Database, job_id: str) -> list[int]:
    """The version numbers a job published."""
    with db.session(readonly=True) as session:
        return list(session.scalars(select(ModelVersion.version).where(ModelVersion.job_id == job_id)).all())


def last_version_of_job(db: Database, job_id: str) -> tuple[int, dict[str, Any]] | None:
    """``(step, metrics)`` of the last version a job published (``None``: none yet). A job's
    versions are published at a step (only an external registration has none)."""
    with db.session(readonly=True) as session:
        last = session.scalars(
            select(ModelVersion)
            .where(ModelVersion.job_id == job_id)
            .order_by(ModelVersion.version.desc())
            .limit(1)
        ).first()
    if last is None:
        return None
    assert last.step is not None, f"version {last.id} of job {job_id} has no step"
    return last.step, dict(last.metrics)


__all__ = [
    "EXTENSIONS",
    "EXTERNAL_FORMATS",
    "STAGING",
    "Artifact",
    "ArtifactUpload",
    "ModelSummary",
    "ModelsPage",
    "StagedArtifact",
    "Version",
    "VersionDetail",
    "VersionsPage",
    "artifact_file",
    "certificate_of_candidate",
    "certified_sha256",
    "check_metrics",
    "check_registration",
    "discard",
    "final_path",
    "get_version",
    "last_version_of_job",
    "list_models",
    "list_versions",
    "next_version",
    "publish",
    "register_external",
    "stage",
    "sweep",
    "versions_of_job",
]
