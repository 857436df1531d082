"""Answers on the hot path, serialised once.

The ledger's operations return JSON-ready dicts exactly as the API answers them, or typed
answers whose ``to_json`` is that (``service.ledger.spending.answers``). On the hot routes
(reserve, commit, abort, and the spend a dashboard polls) the router returns them as a
``JSONResponse`` directly instead of through ``response_model``: FastAPI would otherwise validate
the dict against the schema before serialising it (measured: validating a reservation's answer
against ``ReservationPublic`` costs about 11 µs, a commit's against ``CommitPublic`` about 23 µs —
a few per cent of a spend's server CPU; a spend's answer grows with the dataset's tasks). So does
``POST /v1/jobs``, whose idempotent replay is the answer as stored. The schema is
still declared in ``responses=`` (``documented``) for the OpenAPI document, and
``tests/service/api/test_documented_answers.py`` holds every answer of those routes to it, field
by field, and fails a JSON route that neither has a ``response_model`` nor documents a model.

The other routes answer through ``response_model`` (with ``response_model_exclude_unset``, so that
an optional field the ledger leaves out stays out): the schema is then a real check, and the
bytes are the fast path's (``tests/service/api/test_checked_answers.py``). Where an answer
carries client floats (params, metrics, audit payloads) the route sets
``response_class=JSONResponse``: pydantic's own JSON writer would print ``1e-05`` as ``0.00001``.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


def json_answer(body: dict[str, Any], status_code: int = 200) -> JSONResponse:
    return JSONResponse(content=body, status_code=status_code)


def documented(model: type[BaseModel], description: str) -> dict[str, Any]:
    """``responses=`` entry for a route answering ``model`` through ``json_answer``."""
    return {"model": model, "description": description}
