"""The FastAPI application: ``create_app(settings)``.

Routers under ``/v1`` (``service.api``), OpenAPI at ``/openapi.json``, docs at ``/docs``; errors
mapped to HTTP in one place (``service.api.errors``); a request-body size limit; request metrics;
``/healthz`` (database check, no auth), the signing keys at
``/.well-known/privacy-ledger/signing-keys`` (no auth; ``service.api.signing_keys``) and
``/metrics`` (Prometheus text, to the operator's
``LEDGER_METRICS_TOKEN`` or open with ``LEDGER_METRICS_PUBLIC``; never to an API key).

The lifespan opens the database (``Database(url)``, one per process) and runs the expiry sweep: a
background task that frees reservations past their TTL every
``LEDGER_EXPIRY_SWEEP_INTERVAL_S`` seconds (``service.ledger.reservations.expire_due``; every spend
transaction also checks expiry on the batches it touches, so the sweep only bounds how long an
orphaned hold lingers on a dataset nobody spends on). Migrations are not applied here:
``ledger serve`` and ``ledger migrate`` do that before the app starts.

``create_app(..., worker=True)`` (what ``ledger serve`` does unless ``--no-worker``) also runs
one training worker in a thread for the app's lifetime (``service.worker.worker``); torch is
imported only when it runs a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from decimal import Decimal

import anyio.to_thread
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy import func, select, text

from service import server_secrets
from service.api import audit as audit_routes
from service.api import audit_export as audit_export_routes
from service.api import certificates as certificate_routes
from service.api import dashboard as dashboard_routes
from service.api import datasets as dataset_routes
from service.api import jobs as job_routes
from service.api import model_registry as model_routes
from service.api import reservations as reservation_routes
from service.api import signing_keys as signing_key_routes
from service.api.deps import KeyLookups, MetricsReaderDep, PrincipalCache
from service.api.errors import install as install_error_handlers
from service.api.metrics import CONTENT_TYPE, Gauge, LedgerMetrics
from service.api.middleware import BodySizeLimit, RequestMetrics
from service.api.model_registry import ARTIFACT_UPLOAD
from service.api.openapi import install as install_openapi
from service.api.ratelimit import PricingRates
from service.db.models import Reservation
from service.db.session import Database
from service.ledger import reservations, spent
from service.settings import Settings

logger = logging.getLogger("service.app")


def create_app(
    settings: Settings | None = None, *, database: Database | None = None, worker: bool = False
) -> FastAPI:
    """The application for ``settings`` (default: from the environment).

    ``database``: use this open database instead of opening ``settings.database_url`` (the
    caller keeps ownership and disposes it). ``worker``: run the in-process training worker.
    """
    settings = settings or Settings()
    metrics = LedgerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = database is None
        db = (
            database
            if database is not None
            else Database(
                settings.database_url,
                pool_size=settings.db_pool_size,
                max_overflow=settings.db_max_overflow,
            )
        )
        app.state.database = db
        app.state.pricing = PricingRates.of(settings, db)  # shared through db on PostgreSQL
        server_secrets.configure(db, settings)  # keys are hashed with this app's secret
        # Certificates are signed with this app's key. A configured one that cannot be read stops
        # the start (SecretError), not the first commit; the default file, like the key-hash
        # secret, is made at its first use (``ledger serve`` makes both before it starts).
        if settings.signing_key is not None or settings.signing_keys_retired:
            server_secrets.bind_signing_keys(db, settings)
        # Sync routes run in anyio's thread pool; its default (40) would queue requests that
        # only wait on the database.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.http_threads
        sweeper = asyncio.create_task(_expiry_sweep(db, settings, metrics), name="expiry-sweep")
        stop_worker = threading.Event()
        worker_thread = _start_worker(db, settings, stop_worker) if worker else None
        try:
            yield
        finally:
            stop_worker.set()
            if worker_thread is not None:
                await anyio.to_thread.run_sync(worker_thread.join)
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            if owned:
                db.dispose()

    app = FastAPI(
        title="privacy-ledger",
        version="1",
        summary="Per-dataset, per-task, per-batch privacy budget ledgers with certified releases.",
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url=None,  # /docs: Swagger UI from vendored files (dashboard_routes.mount_web)
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.principals = PrincipalCache(settings.auth_cache_ttl_s)
    app.state.key_lookups = KeyLookups()
    install_error_handlers(app, metrics)
    install_openapi(app)

    # The hot routes (reserve, commit) first: a request is matched against the routes in order.
    # Each router's routes are added as they were built when its module was imported, not through
    # `include_router`: FastAPI (0.165) builds an included router's routes a second time, for each
    # app, on the first request that reaches the router (~0.1 s of that request). Nothing is set
    # at inclusion here (no prefix, tags, dependencies or overrides), so the routes and the OpenAPI
    # document are the same either way.
    for module in (
        reservation_routes,
        dataset_routes,
        certificate_routes,
        audit_routes,
        audit_export_routes,
        job_routes,
        model_routes,
        dashboard_routes,
        signing_key_routes,
    ):
        app.router.routes.extend(module.router.routes)
    dashboard_routes.mount_web(app)  # the dashboard: / and /static (service/web)

    @app.get("/healthz", tags=["operations"], summary="Liveness, with a database round trip")
    def healthz() -> JSONResponse:
        db: Database = app.state.database
        try:
            with db.session(readonly=True) as session:
                session.execute(text("SELECT 1"))
        except Exception as exc:  # the answer is the check: any failure means unhealthy
            logger.warning("health check failed: %s", exc)
            return JSONResponse(
                status_code=503,
                content={"status": "unavailable", "database": "unreachable"},
            )
        return JSONResponse({"status": "ok", "database": "ok"})

    @app.get(
        "/metrics",
        tags=["operations"],
        summary="Prometheus metrics (text format 0.0.4), for the operator's scraper",
        description="Counts across every tenant, so no API key reads them: send "
        "`Authorization: Bearer <LEDGER_METRICS_TOKEN>`, or run the server with "
        "`LEDGER_METRICS_PUBLIC=true` (a scrape on a private network). Otherwise 401.",
        response_class=PlainTextResponse,
        responses={
            401: {
                "description": "no or a wrong metrics token, or /metrics is closed (neither "
                "LEDGER_METRICS_TOKEN nor LEDGER_METRICS_PUBLIC is set)",
                # JSON, unlike the 200 (a "model" here would be filed under text/plain)
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
            }
        },
    )
    def prometheus_metrics(_: MetricsReaderDep) -> PlainTextResponse:
        _read_reservation_gauges(app.state.database, metrics)
        if settings.metrics_dataset_gauges:
            _read_budget_gauges(app.state.database, metrics)
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    # Outermost first: the size limit answers 413 before anything reads the body; the metrics
    # middleware sits inside it and times the application.
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        upload_max_bytes=settings.max_artifact_bytes,
        uploads=ARTIFACT_UPLOAD,
    )
    return app


def _start_worker(db: Database, settings: Settings, stop: threading.Event) -> threading.Thread:
    """The in-process training worker (its job's rest is aborted and the job re-queued on stop)."""
    from service.ledger.jobs.params import JobLimits
    from service.worker.worker import Worker, start_thread

    worker = Worker(
        db,
        artifact_dir=settings.artifact_dir,
        reservation_ttl_s=settings.reservation_ttl_s,
        limits=JobLimits.of(settings),
    )
    return start_thread(worker, stop)


def _read_reservation_gauges(db: Database, metrics: LedgerMetrics) -> None:
    """Open reservations and the age of the oldest, read when scraped (partial index)."""
    try:
        with db.session(readonly=True) as session:
            count, oldest = session.execute(
                select(func.count(), func.min(Reservation.created_at)).where(Reservation.status == "reserved")
            ).one()
    except Exception as exc:  # a scrape must not fail because the database is down
        logger.warning("could not read reservation gauges: %s", exc)
        return
    metrics.open_reservations.set(float(count))
    age = 0.0
    if oldest is not None:
        if oldest.tzinfo is None:
            oldest = oldest.replace(tzinfo=UTC)
        age = max(0.0, (datetime.now(UTC) - oldest).total_seconds())
    metrics.oldest_open_reservation_age.set(age)


def _read_budget_gauges(db: Database, metrics: LedgerMetrics) -> None:
    """Each dataset's budget, spent, held, remaining and naive ε, read when scraped."""
    try:
        datasets = spent.every_dataset_spend(db)
    except Exception as exc:  # a scrape must not fail because the database is down
        logger.warning("could not read budget gauges: %s", exc)
        return
    numbers: tuple[tuple[Gauge, Callable[[spent.Spent], Decimal]], ...] = (
        (metrics.budget_epsilon, lambda s: s.epsilon_budget),
        (metrics.budget_spent, lambda s: s.epsilon_spent),
        (metrics.budget_held, lambda s: s.epsilon_held),
        (metrics.budget_remaining, lambda s: s.epsilon_remaining),
        (metrics.budget_naive, lambda s: s.naive_sequential_epsilon),
    )
    for gauge, number in numbers:
        gauge.replace(
            {(s.tenant_id, s.dataset_id, s.name, s.rule, s.accountant): float(number(s)) for s in datasets}
        )


async def _expiry_sweep(db: Database, settings: Settings, metrics: LedgerMetrics) -> None:
    """Expire reservations past their TTL, forever, every ``expiry_sweep_interval_s``."""
    while True:
        try:
            expired = await anyio.to_thread.run_sync(reservations.expire_due, db)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("expiry sweep failed; retrying")
        else:
            _count_expired(expired, metrics)
        await asyncio.sleep(settings.expiry_sweep_interval_s)


def _count_expired(result: reservations.Expired, metrics: LedgerMetrics) -> None:
    if result.expired > 0:
        metrics.expired.inc(result.expired)


def create_app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory service.app:create_app_from_env`` (one per worker)."""
    return create_app(Settings())
