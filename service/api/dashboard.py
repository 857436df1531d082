"""Read endpoints the dashboard needs beyond the core v1 calls (any scope; another tenant's ids
answer 404). Thin: each calls one ledger view (``service.ledger.views``) or
``service.ledger.certificates.verify_stored``; the pages answer the view's ``to_json()`` through
a ``response_model`` (``service.api.schemas``) that declares each field in the view's order, so
the schema checks the answer and the bytes are the view's
(``tests/service/api/test_dashboard_api.py``).

* ``GET /v1/spend`` — every dataset's spend summary, paged (the datasets table in one call).
* ``GET /v1/datasets/{id}/batch-spend`` — per-batch spend and geometric levels, paged (heatmap).
* ``GET /v1/datasets/{id}/releases`` — the release timeline with each certificate's headline.
* ``GET /v1/datasets/{id}/epsilon-history`` — ledger ε against naive sequential ε per task.
* ``POST /v1/certificates/{id}/verify`` — re-verify a stored certificate on the server with
  ``accountant.certificates.verify`` (offline: from the certificate's own contents) and check its
  signature under the server's keys (changes nothing, so a viewer key may call it).

``mount_web(app)`` serves the dashboard itself (``service/web``): ``/`` and ``/static/*``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from service.api import PREFIX
from service.api.deps import DatabaseDep, ViewerDep
from service.api.ratelimit import RATE_LIMITED, PricingRates
from service.api.schemas import (
    BatchSpendPagePublic,
    EpsilonHistoryPublic,
    ErrorBody,
    ReleasesPublic,
    SpendSummariesPublic,
)
from service.ledger import certificates, views

router = APIRouter(prefix=PREFIX, tags=["dashboard"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked API key"},
    404: {"model": ErrorBody, "description": "unknown id, or another tenant's"},
    422: {"model": ErrorBody, "description": "invalid input; `field` names it"},
}


class SignatureVerification(BaseModel):
    """The certificate's signature under this server's keys (``service.verification.signing``)."""

    status: Literal["valid", "invalid", "unsigned", "unknown_key", "malformed"]
    key_id: str | None
    key_status: Literal["active", "retired"] | None
    reason: str


class CertificateVerification(BaseModel):
    certificate_id: str
    ok: bool
    reason: str
    signature: SignatureVerification


@router.get(
    "/spend",
    response_model=SpendSummariesPublic,
    response_model_exclude_unset=True,
    responses=_ERRORS,
    response_description="each dataset's spend, oldest dataset first",
    summary="Spend of every dataset of the tenant (from the ledger heads; paged)",
)
def list_spend(
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=views.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return views.spend_summaries(db, principal.tenant_id, limit=limit, offset=offset).to_json()


@router.get(
    "/datasets/{dataset_id}/batch-spend",
    response_model=BatchSpendPagePublic,
    response_model_exclude_unset=True,
    responses=_ERRORS,
    response_description="a page of batches with their spend and levels",
    summary="Per-batch spend in task order (heatmap; geometric levels per block)",
)
def batch_spend(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=views.MAX_BATCH_PAGE)] = 500,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return views.batch_spend(db, principal.tenant_id, dataset_id, limit=limit, offset=offset).to_json()


@router.get(
    "/datasets/{dataset_id}/releases",
    response_model=ReleasesPublic,
    response_model_exclude_unset=True,
    responses=_ERRORS,
    response_description="releases, newest first",
    summary="Release timeline: each version's certificate headline (paged, newest first)",
)
def list_releases(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=views.MAX_PAGE)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    return views.releases(db, principal.tenant_id, dataset_id, limit=limit, offset=offset).to_json()


@router.get(
    "/datasets/{dataset_id}/epsilon-history",
    response_model=EpsilonHistoryPublic,
    response_model_exclude_unset=True,
    responses=_ERRORS,
    response_description="one point per task with releases",
    summary="Ledger ε and naive sequential ε after each task (the lifelong curve)",
)
def epsilon_history(
    dataset_id: str,
    principal: ViewerDep,
    db: DatabaseDep,
    limit: Annotated[int, Query(ge=1, le=10 * views.MAX_PAGE)] = 1000,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> dict[str, Any]:
    page = views.epsilon_history(db, principal.tenant_id, dataset_id, limit=limit, offset=offset)
    return page.to_json()


@router.post(
    "/certificates/{certificate_id}/verify",
    response_model=CertificateVerification,
    responses={**_ERRORS, **RATE_LIMITED},
    summary="Re-verify a stored certificate: its inputs (accountant.certificates.verify) and its signature",
    description="`ok` only when the certificate's bound follows from its inputs *and* its "
    "`signature` verifies under one of this server's keys (active or retired; "
    "`GET /.well-known/privacy-ledger/signing-keys`); `signature.status` says which: `valid`, "
    "`invalid` (forged or edited), `unsigned` (issued before certificates were signed), "
    "`unknown_key` or `malformed`. Recomputes every price in the certificate: bounded like a reservation "
    "(`LEDGER_MAX_PRICING_WORK`: above it a 422 naming `certificate_id`, verify offline instead) "
    "and paid from the tenant's pricing time (429 `rate_limited` with `Retry-After`).",
)
def verify_certificate(
    certificate_id: str, principal: ViewerDep, db: DatabaseDep, request: Request
) -> dict[str, Any]:
    rates: PricingRates = request.app.state.pricing
    result = certificates.verify_stored(
        db, principal.tenant_id, certificate_id, policy=rates.policy(principal.tenant_id)
    )
    return {"certificate_id": certificate_id, **result}


# ---------------------------------------------------------------------------------------------
# The dashboard's files (service/web): index.html at ``/``, its assets under ``/static``.

WEB_DIR: Final = Path(__file__).resolve().parent.parent / "web"

# Every asset is local: the browser itself refuses anything from another origin, inline scripts
# and framing, so a page that works under this policy provably loads nothing from a CDN.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


SWAGGER_UI: Final = "/static/vendor/swagger-ui"
"""Swagger UI's files, vendored (``service/web/vendor/swagger-ui/README.md``): no CDN."""
DOCS_CONTENT_SECURITY_POLICY: Final = (
    # Swagger UI starts from one inline script (FastAPI's page) and styles inline; everything it
    # loads is this origin's, so the browser refuses any other (a CDN among them).
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)


def mount_web(app: FastAPI) -> None:
    """Serve the dashboard: ``GET /`` answers ``index.html``; ``/static/*`` its files; ``/docs``
    Swagger UI from the vendored files (the app is made with ``docs_url=None``)."""
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{SWAGGER_UI}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER_UI}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER_UI}/favicon-32x32.png",
        )
        page.headers["Content-Security-Policy"] = DOCS_CONTENT_SECURITY_POLICY
        return page

    @app.get("/", include_in_schema=False)
    def dashboard_index() -> FileResponse:
        return FileResponse(
            WEB_DIR / "index.html",
            media_type="text/html",
            headers={
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
            },
        )
