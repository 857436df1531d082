"""The model registry: ``GET /v1/models``, ``GET /v1/models/{name}/versions``,
``.../versions/{v}``, ``.../versions/{v}/artifact``. Reads: any scope; another tenant's model
answers 404. ``PUT /v1/models/{name}/versions/{v}`` (trainer): register a version trained outside
the service under its release's certificate (``model_registry.register_external``).

Every version listed here was published after the ledger committed its release: its
``certificate`` re-verifies offline (``accountant.certificates.verify``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from service.api import PREFIX
from service.api.deps import DatabaseDep, TrainerDep, ViewerDep
from service.api.schemas import (
    ErrorBody,
    ModelsPublic,
    ModelVersionDetail,
    ModelVersionPublic,
    ModelVersionsPublic,
)
from service.ledger import model_registry as registry
from service.ledger.errors import InvalidInput
from service.ledger.jobs.params import MODEL_NAME

router = APIRouter(prefix=PREFIX, tags=["models"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    404: {"model": ErrorBody, "description": "unknown model or version, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}

Version = Annotated[int, PathParam(ge=1, le=2**31 - 1)]

# A description: no control character but tab and newline, and not blank (model_registry).
_DESCRIPTION: Final = r"^[^\x00-\x08\x0b-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x08\x0b-\x1f\x7f]*$"
Description = Annotated[str, Query(min_length=1, max_length=registry.MAX_DESCRIPTION, pattern=_DESCRIPTION)]

ARTIFACT_UPLOAD: Final = re.compile(re.escape(PREFIX) + r"/models/[^/]+/versions/[^/]+")
"""The upload route's paths: ``BodySizeLimit`` bounds them by ``LEDGER_MAX_ARTIFACT_BYTES``."""


def _artifact_dir(request: Request) -> Path:
    return Path(request.app.state.settings.artifact_dir)


@router.get(
    "/models",
    response_model=ModelsPublic,
    # json.dumps, not pydantic's JSON writer: metrics' floats keep their bytes (1e-05, not 0.00001)
    response_class=JSONResponse,
    responses={200: {"description": "the tenant's models, by name"}, **_ERRORS},
    summary="The tenant's models: versions, latest version, datasets (paged)",
)
def list_models(
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=registry.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return registry.list_models(db, principal.tenant_id, limit=limit, offset=offset).to_json()


def _metrics(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        raise InvalidInput("metrics", "must be a JSON object of metric name to number.") from None
    return registry.check_metrics(parsed)


@router.put(
    "/models/{name}/versions/{version}",
    response_model=ModelVersionPublic,
    response_class=JSONResponse,
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            "description": "the artifact's bytes (at most `LEDGER_MAX_ARTIFACT_BYTES`)",
        }
    },
    responses={
        201: {"description": "registered"},
        200: {
            "model": ModelVersionPublic,
            "description": "registered before with these bytes and certificate",
        },
        409: {
            "model": ErrorBody,
            "description": "`reason`: `not_a_release` (an abort's certificate), `release_mismatch` "
            "(the certificate's release is another name or version), `certificate_of_job` (the "
            "worker publishes it), `certificate_used`, `artifact_not_certified`, `version_exists`",
        },
        413: {"model": ErrorBody, "description": "artifact over `LEDGER_MAX_ARTIFACT_BYTES`"},
        **_ERRORS,
    },
    summary="Register a version trained outside the service, with its artifact, under its certificate",
    description="The body is the artifact; the server computes its SHA-256 and refuses (422, "
    "`field: sha256`) a `sha256` that differs. `certificate_id`: the certificate of the commit "
    "that released exactly `{name, version}` (a `release_gate` or the Opacus adapter). The "
    "version's DP statement is derived from that certificate on read; `architecture` and "
    "`preprocessing` (free text, at most 1000 characters each) and `metrics` (a JSON object of "
    "up to 32 numbers) are the client's description and are shown as such.",
)
async def register_version(
    name: Annotated[str, PathParam(pattern=f"^{MODEL_NAME.pattern}$")],
    version: Version,
    request: Request,
    response: Response,
    principal: TrainerDep,
    db: DatabaseDep,
    certificate_id: Annotated[str, Query(min_length=1, max_length=64)],
    sha256: Annotated[str, Query(pattern="^[0-9a-fA-F]{64}$")],
    architecture: Description,
    preprocessing: Description,
    artifact_format: Annotated[
        Literal["torch", "safetensors", "onnx", "bytes"], Query(alias="format")
    ] = "torch",
    metrics: Annotated[
        str | None,
        Query(max_length=8000, description="a JSON object of up to 32 metric names to finite numbers"),
    ] = None,
) -> dict[str, Any]:
    claimed = _metrics(metrics)
    await run_in_threadpool(
        lambda: registry.check_registration(
            db,
            principal.tenant_id,
            name=name,
            version=version,
            certificate_id=certificate_id,
            sha256=sha256,
            fmt=artifact_format,
            architecture=architecture,
            preprocessing=preprocessing,
        )
    )
    settings = request.app.state.settings
    upload = registry.ArtifactUpload(_artifact_dir(request), settings.max_artifact_bytes)
    try:
        async for chunk in request.stream():
            upload.write(chunk)
        answer, created = await run_in_threadpool(
            registry.register_external,
            db,
            _artifact_dir(request),
            upload,
            tenant_id=principal.tenant_id,
            name=name,
            version=version,
            certificate_id=certificate_id,
            sha256=sha256,
            fmt=artifact_format,
            architecture=architecture,
            preprocessing=preprocessing,
            metrics=claimed,
        )
    finally:
        upload.discard()
    response.status_code = 201 if created else 200
    return answer.to_json()


@router.get(
    "/models/{name}/versions",
    response_model=ModelVersionsPublic,
    response_class=JSONResponse,
    responses={200: {"description": "the versions, oldest first"}, **_ERRORS},
    summary="A model's released versions",
)
def list_versions(
    name: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=registry.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return registry.list_versions(db, principal.tenant_id, name, limit=limit, offset=offset).to_json()


@router.get(
    "/models/{name}/versions/{version}",
    response_model=ModelVersionDetail,
    response_model_exclude_unset=True,
    response_class=JSONResponse,
    responses={200: {"description": "the version with its certificate and metrics"}, **_ERRORS},
    summary="One version: certificate, metrics, job, created_at",
)
def get_version(name: str, version: Version, principal: ViewerDep, db: DatabaseDep) -> dict[str, Any]:
    return registry.get_version(db, principal.tenant_id, name, version).to_json()


@router.get(
    "/models/{name}/versions/{version}/artifact",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "the weights (safetensors, or torch.save of the state dict); "
            "`X-Artifact-SHA256` is the SHA-256 recorded when it was published",
        },
        **_ERRORS,
    },
    summary="The version's weights",
)
def get_artifact(
    name: str, version: Version, request: Request, principal: ViewerDep, db: DatabaseDep
) -> FileResponse:
    path, published = registry.artifact_file(db, principal.tenant_id, name, version, _artifact_dir(request))
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{name}-v{version}{path.suffix}",
        headers={
            "X-Artifact-SHA256": published.artifact.sha256,
            "X-Artifact-Format": published.artifact.format,
            "X-Certificate-Id": published.certificate_id,
        },
    )
