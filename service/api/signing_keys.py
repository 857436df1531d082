"""Public documents, no API key needed: ``GET /.well-known/privacy-ledger/signing-keys`` (the
public keys that verify this server's signatures: a verifier must be able to fetch them before it
holds any credential) and ``GET /schemas/event.json`` (the JSON Schema of every event kind, also in
``docs/event.schema.json``).

Answer: ``{"keys": [{key_id, algorithm: "Ed25519", public_key, status}]}`` — ``public_key`` the
base64 of the raw 32-byte key, ``status`` ``active`` (signs what is issued now; listed first) or
``retired`` (signed before a rotation; still verifies). A verifier that pins these keys (``ledger
check --trusted-keys FILE``) trusts the server, not whatever keys a bundle declares.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from service import server_secrets
from service.api.openapi import EVENT_SCHEMA_PATH, event_json_schema
from service.api.schemas import SigningKeysPublic
from service.verification.signing import WELL_KNOWN_PATH

router = APIRouter(tags=["signatures"])


@router.get(
    WELL_KNOWN_PATH,
    response_model=SigningKeysPublic,
    summary="The public keys that verify this server's certificate and audit-head signatures",
    description="No API key needed. `key_id` is 16 hex characters of the SHA-256 of the raw key; "
    "the `active` key signs what is issued now, `retired` keys signed before a rotation.",
)
def signing_keys(request: Request) -> dict[str, Any]:
    return server_secrets.signing_keys(request.app.state.database).to_json()


@router.get(
    EVENT_SCHEMA_PATH,
    tags=["schemas"],
    summary="The JSON Schema of a mechanism event (every kind)",
    description="No API key needed. Draft 2020-12; nested events refer to the root. The service "
    "checks more than the schema can say (relations between fields; 422 naming the field).",
)
def event_schema() -> dict[str, Any]:
    return event_json_schema()
