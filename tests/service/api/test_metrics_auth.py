"""``GET /metrics`` is the operator's, not a tenant's (issue 12 §2).

Its series count every tenant's reservations, refusals and routes, so no API key reads it, not
even an admin's: the scraper sends ``LEDGER_METRICS_TOKEN`` as its bearer token, or the operator
opens it with ``LEDGER_METRICS_PUBLIC=true``. With neither, it is closed. Real app, real HTTP
through the ASGI interface, and a real ``ledger serve``.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from service.app import create_app
from service.db.session import Database
from service.settings import Settings
from tests.service.api.conftest import (
    METRICS_TOKEN,
    Keys,
    Server,
    TestClient,
    bearer,
)


def _client(settings: Settings, db: Database, **changes: object) -> TestClient:
    app: FastAPI = create_app(settings.model_copy(update=changes), database=db)
    return TestClient(app, raise_server_exceptions=False)


def _refused(answer: httpx.Response) -> str:
    assert answer.status_code == 401, answer.text
    assert answer.headers["www-authenticate"] == "Bearer"
    body = answer.json()
    assert body["error"] == "unauthorized" and "ledger_" not in answer.text
    message: str = body["message"]
    return message


def test_no_api_key_reads_metrics_only_the_token(client: TestClient, keys: Keys) -> None:
    for tenant in ("acme", "rival"):
        for scope in ("admin", "trainer", "viewer"):
            _refused(client.get("/metrics", headers=bearer(keys.get(tenant, scope))))
    assert "LEDGER_METRICS_TOKEN" in _refused(client.get("/metrics"))
    for wrong in (METRICS_TOKEN[:-1], METRICS_TOKEN + "x", METRICS_TOKEN.upper(), keys.revoked):
        _refused(client.get("/metrics", headers=bearer(wrong)))
    _refused(client.get("/metrics", headers={"Authorization": f"Basic {METRICS_TOKEN}"}))
    answer = client.get("/metrics", headers=bearer(METRICS_TOKEN))
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE ledger_commits_total counter" in answer.text
    # the refused scrapes were counted as requests like any other (status 401), and that is all
    assert 'route="/metrics",status="401"' in answer.text


def test_metrics_are_closed_without_a_token_and_open_with_the_switch(
    settings: Settings, db: Database, keys: Keys
) -> None:
    with _client(settings, db, metrics_token=None) as closed:
        message = _refused(closed.get("/metrics"))
        assert "closed" in message and "LEDGER_METRICS_PUBLIC" in message
        _refused(closed.get("/metrics", headers=bearer(keys.get("acme", "admin"))))
        _refused(closed.get("/metrics", headers=bearer(METRICS_TOKEN)))
    with _client(settings, db, metrics_token=None, metrics_public=True) as public:
        answer = public.get("/metrics")
        assert answer.status_code == 200 and "ledger_commits_total" in answer.text


def test_metrics_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="LEDGER_METRICS_TOKEN must be at least 24"):
        Settings(metrics_token="short-token")
    assert Settings(metrics_token="  ").metrics_token is None  # blank: unset, not a usable token
    assert Settings().metrics_public is False


def test_openapi_documents_who_reads_metrics(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/metrics"]["get"]
    assert "LEDGER_METRICS_TOKEN" in operation["description"]
    assert "LEDGER_METRICS_PUBLIC" in operation["description"]
    assert set(operation["responses"]) == {"200", "401"}
    assert operation["responses"]["401"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }


@pytest.mark.slow
def test_ledger_serve_keeps_metrics_from_the_admin_key(ledger_server: Server) -> None:
    url = f"{ledger_server.base_url}/metrics"
    _refused(httpx.get(url, headers=bearer(ledger_server.admin_key)))
    answer = httpx.get(url, headers=bearer(METRICS_TOKEN))  # start_server sets LEDGER_METRICS_TOKEN
    assert answer.status_code == 200 and "ledger_http_requests_total" in answer.text
