"""``GET /v1/audit/verify`` answers about the caller's tenant only (issue 12 §2).

It used to walk every chain: another tenant's viewer saw the global entry count and, after
tampering, the broken chain's dataset id. Now a key's walk covers its tenant's dataset chains;
``ledger verify`` (the operator's, reading the database) still walks everything and finds what a
tenant's key is not shown. Two tenants (``acme``, ``rival``) on real databases, real HTTP through
the ASGI app, the real CLI in a subprocess.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import text

from service.db.session import Database
from service.ledger import audit
from tests.service.api.conftest import Keys, TestClient, bearer, url_text
from tests.service.api.test_commands import ledger
from tests.service.api.world import World, make_world


def _verify(client: TestClient, key: str, **params: str) -> dict[str, Any]:
    answer = client.get("/v1/audit/verify", headers=bearer(key), params=params)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _chain_length(db: Database, *datasets: str) -> int:
    with db.engine.connect() as conn:
        return sum(
            conn.execute(text("SELECT count(*) FROM audit_log WHERE chain = :c"), {"c": d}).scalar_one()
            for d in datasets
        )


def _two_tenants(db: Database) -> tuple[list[World], World]:
    """Two acme datasets and one rival dataset, each with committed and open reservations."""
    return [make_world(db, "acme"), make_world(db, "acme")], make_world(db, "rival")


def _edit_entry(db: Database, chain: str, position: int = 2) -> int:
    """Change one entry's payload behind the ledger's back (as someone with database access)."""
    with db.engine.begin() as conn:
        seq: int = conn.execute(
            text("SELECT seq FROM audit_log WHERE chain = :c AND chain_seq = :n"), {"c": chain, "n": position}
        ).scalar_one()
        conn.execute(text("UPDATE audit_log SET payload = :p WHERE seq = :s"), {"p": '{"x": 1}', "s": seq})
    return seq


def test_a_tenants_count_covers_its_own_dataset_chains_only(
    client: TestClient, db: Database, keys: Keys
) -> None:
    acme, rival = _two_tenants(db)
    whole = audit.verify(db)  # the operator's walk: every chain, the global one included
    assert whole.ok
    mine = _verify(client, keys.get("acme", "viewer"))
    theirs = _verify(client, keys.get("rival", "viewer"))
    assert mine == {**whole.to_json(), "entries": _chain_length(db, *(w.dataset for w in acme))}
    assert theirs["ok"] and theirs["entries"] == _chain_length(db, rival.dataset)
    # neither count includes the other tenant's chains nor the global chain (tenant/key events)
    assert mine["entries"] + theirs["entries"] < whole.entries
    assert _chain_length(db, audit.GLOBAL_CHAIN) > 0
    # one dataset of one's own narrows it further; another tenant's is 404, as an unknown id
    assert _verify(client, keys.get("acme", "viewer"), dataset_id=acme[0].dataset)["entries"] == (
        _chain_length(db, acme[0].dataset)
    )
    foreign = client.get(
        "/v1/audit/verify", headers=bearer(keys.get("acme", "admin")), params={"dataset_id": rival.dataset}
    )
    assert foreign.status_code == 404 and rival.dataset in foreign.json()["message"]


@pytest.mark.slow
def test_another_tenants_broken_chain_is_not_shown_but_ledger_verify_finds_it(
    client: TestClient, db: Database, database_url: Any, keys: Keys
) -> None:
    acme, rival = _two_tenants(db)
    seq = _edit_entry(db, rival.dataset)
    for scope in ("viewer", "trainer", "admin"):
        answer = client.get("/v1/audit/verify", headers=bearer(keys.get("acme", scope)))
        assert answer.status_code == 200
        assert answer.json()["ok"] is True, answer.text
        assert answer.json()["entries"] == _chain_length(db, *(w.dataset for w in acme))
        assert rival.dataset not in answer.text
    # the tenant it belongs to is told (positive control: the walk does look)
    theirs = _verify(client, keys.get("rival", "viewer"))
    assert not theirs["ok"] and theirs["chain"] == rival.dataset and theirs["first_broken"] == seq
    # and the operator's command, reading the database, finds it
    found = ledger("verify", "--database-url", url_text(database_url))
    assert found.returncode == 1, found.stdout + found.stderr
    result = json.loads(found.stdout)
    assert result["ok"] is False and result["chain"] == rival.dataset and result["first_broken"] == seq


def test_a_broken_global_chain_is_the_operators_to_see(client: TestClient, db: Database, keys: Keys) -> None:
    _two_tenants(db)
    # rival's key-creation event, on the global chain (shared by every tenant)
    with db.engine.connect() as conn:
        position = conn.execute(
            text(
                "SELECT min(chain_seq) FROM audit_log WHERE chain = 'global' AND tenant_id = 'rival' "
                "AND event_type = 'api_key.created'"
            )
        ).scalar_one()
    _edit_entry(db, audit.GLOBAL_CHAIN, position)
    for tenant in ("acme", "rival"):
        body = _verify(client, keys.get(tenant, "viewer"))
        assert body["ok"] is True and body["chain"] is None, body
    whole = audit.verify(db)
    assert not whole.ok and whole.chain == audit.GLOBAL_CHAIN


def test_a_tenants_own_break_is_reported_to_it(client: TestClient, db: Database, keys: Keys) -> None:
    acme, _rival = _two_tenants(db)
    seq = _edit_entry(db, acme[1].dataset, position=3)
    body = _verify(client, keys.get("acme", "viewer"))
    assert (body["ok"], body["first_broken"], body["chain"]) == (False, seq, acme[1].dataset), body
    assert body["reason"] == "entry does not match its hash"
    # a cut tail (the stored head no longer matches) too
    with db.engine.begin() as conn:
        conn.execute(
            text(
                "DELETE FROM audit_log WHERE chain = :c AND chain_seq = (SELECT max(chain_seq) "
                "FROM audit_log WHERE chain = :c)"
            ),
            {"c": acme[0].dataset},
        )
    narrowed = _verify(client, keys.get("acme", "viewer"), dataset_id=acme[0].dataset)
    assert not narrowed["ok"] and narrowed["chain"] == acme[0].dataset
    assert narrowed["reason"] == "missing entry"
    assert _verify(client, keys.get("rival", "viewer"))["ok"]
