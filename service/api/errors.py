"""The one place where errors become HTTP answers: ``{"error": code, "message": ..., ...details}``.

* Domain errors (``service.ledger.errors.LedgerError``) carry their code, status and details.
* Request validation errors (pydantic) become 422 ``invalid_input`` naming the first bad field as
  a dotted path (``budget.epsilon``, ``batches[0].records``), with every error under ``errors``.
* Event and accountant argument errors that reach the router (they name their field) become 422.
* Authentication (401), authorisation (403), unknown routes (404/405) and unexpected failures
  (500, no internals leaked) use the same shape.
* A lost, refused or timed-out database connection (SQLAlchemy ``OperationalError``,
  ``InterfaceError``, pool ``TimeoutError``) becomes 503 ``unavailable`` with ``Retry-After``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from accountant.errors import InvalidArgumentError
from accountant.events import EventValidationError
from service.api.metrics import LedgerMetrics
from service.ledger.errors import LedgerError, RateLimited

logger = logging.getLogger("service.api")


class Unauthorized(Exception):
    """Missing, malformed, unknown or revoked API key (401)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Forbidden(Exception):
    """The key's scope does not allow the call (403)."""

    def __init__(self, message: str, *, scope: str, required: str) -> None:
        super().__init__(message)
        self.message = message
        self.scope = scope
        self.required = required


def field_path(loc: Sequence[int | str]) -> str:
    """``("body", "batches", 0, "records")`` → ``"batches[0].records"``; headers keep their name."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        where = parts.pop(0)
        if where == "header" and parts:
            return str(parts[0]).title()  # the header's name: "Idempotency-Key"
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _describe(error: dict[str, Any]) -> dict[str, str]:
    ctx = error.get("ctx") or {}
    loc = tuple(error.get("loc", ()))
    field = field_path(loc)
    if "field" in ctx:
        # our model validators name a field below the model (an event's innermost parameter)
        field = field_path(loc + tuple(_split(str(ctx["field"]))))
    kind = error.get("type", "")
    msg = str(error.get("msg", "invalid"))
    if kind == "json_invalid":
        return {"field": "body", "message": f"body is not valid JSON: {ctx.get('error', msg)}."}
    if loc == ("body",) and isinstance(error.get("input"), bytes | str) and kind.endswith("_type"):
        # the body was not parsed as JSON: usually a missing Content-Type header
        return {
            "field": "body",
            "message": "body must be a JSON object, sent with Content-Type: application/json.",
        }
    if kind == "missing":
        return {"field": field, "message": f"{field} is required."}
    if kind == "extra_forbidden":
        return {"field": field, "message": f"{field} is not a known field."}
    if "input" in error and kind not in _OWN_MESSAGES:
        found = error["input"]
        shown = repr(found) if isinstance(found, str) else str(found)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return {"field": field, "message": f"{field}: {msg.rstrip('.')}. Found {shown}."}
    return {"field": field, "message": f"{field} {msg}" if kind in _OWN_MESSAGES else msg}


# error types raised by service.api.schemas, whose message already reads "must be ... Found x."
_OWN_MESSAGES = frozenset(
    {
        "number_type",
        "number_finite",
        "positive_number",
        "delta_range",
        "ratio_range",
        "invalid_event",
        "reservation_target",
        "text_or_integer",
        "not_blank",
    }
)


def _split(dotted: str) -> list[str | int]:
    """``"event.events[2].scale"`` → ``["event", "events", 2, "scale"]``."""
    out: list[str | int] = []
    for segment in dotted.split("."):
        name, *indices = segment.split("[")
        if name:
            out.append(name)
        for index in indices:
            text = index.rstrip("]")
            out.append(int(text) if text.isdigit() else text)
    return out


def _allowed_methods(request: Request) -> set[str]:
    """Every method some route of the app serves on the request's path."""
    from starlette.routing import Match

    scope = dict(request.scope)
    return {
        method
        for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
        if any(
            route.matches({**scope, "method": method})[0] == Match.FULL for route in request.app.router.routes
        )
    }


def error_response(
    status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def install(app: FastAPI, metrics: LedgerMetrics) -> None:
    """Register every exception handler on ``app``."""

    def refused(code: str) -> None:
        metrics.refusals.inc(code=code)

    @app.exception_handler(LedgerError)
    async def _ledger_error(request: Request, exc: LedgerError) -> JSONResponse:
        body = exc.to_json()
        if exc.status in (409, 422, 429):
            refused(exc.code)
        headers = None
        if isinstance(exc, RateLimited):
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return error_response(exc.status, body, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_describe(dict(e)) for e in exc.errors()]
        first = errors[0] if errors else {"field": "body", "message": "invalid request."}
        refused("invalid_input")
        return error_response(
            422,
            {
                "error": "invalid_input",
                "message": first["message"],
                "field": first["field"],
                "errors": errors,
            },
        )

    @app.exception_handler(EventValidationError)
    async def _event_error(request: Request, exc: EventValidationError) -> JSONResponse:
        refused("invalid_input")
        return error_response(422, {"error": "invalid_input", "message": str(exc), "field": exc.field})

    @app.exception_handler(InvalidArgumentError)
    async def _argument_error(request: Request, exc: InvalidArgumentError) -> JSONResponse:
        refused("invalid_input")
        return error_response(422, {"error": "invalid_input", "message": str(exc), "field": exc.field})

    @app.exception_handler(Unauthorized)
    async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return error_response(
            401,
            {"error": "unauthorized", "message": exc.message},
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.exception_handler(Forbidden)
    async def _forbidden(request: Request, exc: Forbidden) -> JSONResponse:
        return error_response(
            403,
            {
                "error": "forbidden",
                "message": exc.message,
                "scope": exc.scope,
                "required_scope": exc.required,
            },
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's "There was an error parsing the body" (a body that is not UTF-8 text,
            # say): the same answer as a body that is not valid JSON.
            refused("invalid_input")
            message = "body is not valid JSON: it could not be parsed."
            return error_response(
                422,
                {
                    "error": "invalid_input",
                    "message": message,
                    "field": "body",
                    "errors": [{"field": "body", "message": message}],
                },
            )
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else code
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}."
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route matching the path only; a
            # path served by several routes (GET and POST /v1/datasets) allows all of theirs.
            allowed = _allowed_methods(request)
            if allowed:
                headers["Allow"] = ", ".join(sorted(allowed))
        return error_response(exc.status_code, {"error": code, "message": message}, headers=headers or None)

    @app.exception_handler(sa_exc.OperationalError)
    @app.exception_handler(sa_exc.InterfaceError)
    @app.exception_handler(sa_exc.TimeoutError)
    async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # A lost or refused database connection (PostgreSQL restarted, a backend terminated, the
        # pool exhausted, SQLite busy past its timeout): the transaction was rolled back or never
        # began, so the request may be retried (with its Idempotency-Key where it mutates).
        logger.warning(
            "database unavailable on %s %s: %s",
            request.method,
            request.url.path,
            type(getattr(exc, "orig", None) or exc).__name__,
        )
        refused("unavailable")
        return error_response(
            503,
            {"error": "unavailable", "message": "the database is unavailable; retry shortly."},
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            500, {"error": "internal_error", "message": "internal error; see the server log."}
        )
