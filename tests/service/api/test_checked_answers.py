"""The reservation routes off the spend path (get, its batches, extend) answer through their
``response_model`` — a real check of the answer against its schema — and their bytes are the
bytes the spend routes' fast path (``json_answer``, no model) gives for the same reservation, on
both databases."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from service.db.session import Database
from service.ledger import reservations
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import SEQUENTIAL, Api, pure


def test_checked_routes_answer_the_fast_paths_bytes(client: TestClient, keys: Keys, db: Database) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(SEQUENTIAL, batches=3)
    held = trainer.reserve(dataset, batches, pure(0.25), ttl_s=600)
    rid = held.json()["id"]
    got = trainer.call("GET", f"/v1/reservations/{rid}", status=200)
    assert got.content == held.content  # unchanged since the reserve: the same bytes
    # A heartbeat that changes nothing answers the same reservation, checked, byte for byte.
    again = trainer.call("POST", f"/v1/reservations/{rid}/extend", {"ttl_s": 1}, status=200)
    assert again.content == held.content
    page = trainer.call("GET", f"/v1/reservations/{rid}/batches?limit=2", status=200)
    direct = reservations.list_batches(db, "acme", rid, limit=2).to_json()
    assert page.content == JSONResponse(content=direct).body
    assert [b["id"] for b in page.json()["data"]] == sorted(batches)[:2] and page.json()["next"] is not None
    # After a commit: closed_at set, committed costs; still the fast path's bytes.
    trainer.commit(rid)
    closed = trainer.call("GET", f"/v1/reservations/{rid}", status=200)
    assert closed.json()["status"] == "committed" and closed.json()["closed_at"] is not None
    expected = reservations.get_reservation(db, "acme", rid).to_json()
    assert closed.content == JSONResponse(content=expected).body
