"""The model registry: ``GET /v1/models/{name}/versions``, ``.../versions/{v}``,
``.../versions/{v}/artifact``. Reads: any scope; another tenant's model answers 404.

Every version listed here was published after the ledger committed its release: its
``certificate`` re-verifies offline (``accountant.certificates.verify``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.responses import documented, json_answer
from service.api.schemas import ErrorBody
from service.ledger import model_registry as registry

router = APIRouter(prefix=PREFIX, tags=["models"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    404: {"model": ErrorBody, "description": "unknown model or version, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}

Version = Annotated[int, PathParam(ge=1, le=2**31 - 1)]


class ModelVersionPublic(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int
    job_id: str
    certificate_id: str
    metrics: dict[str, Any]
    artifact: dict[str, Any]
    model_spec: dict[str, Any] | None = Field(
        default=None,
        description="architecture and preprocessing (`LedgerClient.load_model` rebuilds the module "
        "from it); null for versions published before it was recorded and staged trainers'",
    )
    dp_statement: dict[str, Any] | None = Field(
        default=None,
        description="one version only: its DP statement (Ponomareva et al. 2023, Section 5.3), "
        "derived from its certificate and its job's plan (`service.ledger.dp_statement`)",
    )
    created_at: str


class ModelVersionsPublic(BaseModel):
    model_config = ConfigDict(extra="allow")

    data: list[ModelVersionPublic]
    count: int


def _artifact_dir(request: Request) -> Path:
    return Path(request.app.state.settings.artifact_dir)


@router.get(
    "/models/{name}/versions",
    response_model=None,
    responses={200: documented(ModelVersionsPublic, "the versions, oldest first"), **_ERRORS},
    summary="A model's released versions",
)
def list_versions(
    name: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=registry.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> JSONResponse:
    return json_answer(registry.list_versions(db, principal.tenant_id, name, limit=limit, offset=offset))


@router.get(
    "/models/{name}/versions/{version}",
    response_model=None,
    responses={
        200: documented(ModelVersionPublic, "the version with its certificate and metrics"),
        **_ERRORS,
    },
    summary="One version: certificate, metrics, job, created_at",
)
def get_version(name: str, version: Version, principal: ViewerDep, db: DatabaseDep) -> JSONResponse:
    return json_answer(registry.get_version(db, principal.tenant_id, name, version))


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
    path, answer = registry.artifact_file(db, principal.tenant_id, name, version, _artifact_dir(request))
    artifact = answer["artifact"]
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{name}-v{version}{path.suffix}",
        headers={
            "X-Artifact-SHA256": artifact["sha256"],
            "X-Artifact-Format": artifact["format"],
            "X-Certificate-Id": answer["certificate_id"],
        },
    )
