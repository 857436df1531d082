"""Tampering with the audit chain in the database, as someone with write access to it would.

What ``verify`` (``ledger verify``, ``GET /v1/audit/verify``) detects on its own:

* an edited entry (its hash no longer matches its content);
* a deleted entry in the middle (the sequence and the next ``prev_hash`` break);
* reordered entries (``chain_seq`` swapped: the ``prev_hash`` links break);
* a truncated tail (the last entry no longer matches the head stored on the dataset row — or,
  for the global chain, on the ``audit_head`` row).

What it cannot detect: an attacker who truncates the tail AND rewrites the stored head to the new
last entry leaves a chain that is internally consistent. Only a head recorded outside the
database catches that: a ``ledger export`` bundle taken earlier pins ``audit.head`` (chain_seq,
hash); the live chain must still contain that entry. The test shows both halves, and that
``ledger check --pin OLD_BUNDLE`` makes that comparison (exit 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from service.client import LedgerClient
from service.commands.export import collect
from service.db.session import Database
from service.ledger import audit, reservations, tenancy
from service.ledger.reservations import parse_event
from service.verification.bundle import evaluate
from tests.service.api.world import PURE, World, make_world, unique
from tests.service.live_server import serve, settings_for

ROOT = Path(__file__).resolve().parents[2]


def _world(db: Database) -> World:
    tenancy.create_api_key(db, "acme", "admin")  # makes the tenant
    world = make_world(db, "acme")
    # a few more entries so that there is a middle and a tail
    for _ in range(2):
        held = reservations.reserve(
            db, "acme", world.dataset, event=parse_event(PURE), batch_ids=[world.batch]
        ).to_json()
        reservations.commit(db, "acme", held["id"], release={"model": "m", "version": unique("v")})
    return world


def _entries(db: Database, chain: str) -> list[Any]:
    with db.engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT seq, chain_seq, hash, payload FROM audit_log WHERE chain = :c ORDER BY chain_seq"
                ),
                {"c": chain},
            )
        )


def _exec(db: Database, sql: str, **params: Any) -> None:
    with db.engine.begin() as conn:
        conn.execute(text(sql), params)


def test_untouched_chains_verify(db: Database) -> None:
    world = _world(db)
    assert audit.verify(db).ok
    assert audit.verify(db, dataset_id=world.dataset).ok
    assert len(_entries(db, world.dataset)) >= 6


def test_edit_is_detected(db: Database) -> None:
    world = _world(db)
    entry = _entries(db, world.dataset)[2]
    _exec(db, "UPDATE audit_log SET payload = :p WHERE seq = :s", p='{"epsilon": "0"}', s=entry.seq)
    result = audit.verify(db, dataset_id=world.dataset)
    assert not result.ok and result.first_broken == entry.seq, result
    assert not audit.verify(db).ok


def test_edit_of_a_timestamp_is_detected(db: Database) -> None:
    world = _world(db)
    entry = _entries(db, world.dataset)[1]
    _exec(db, "UPDATE audit_log SET created_at = :t WHERE seq = :s", t="2001-01-01 00:00:00", s=entry.seq)
    assert not audit.verify(db, dataset_id=world.dataset).ok


def test_delete_in_the_middle_is_detected(db: Database) -> None:
    world = _world(db)
    entry = _entries(db, world.dataset)[2]
    _exec(db, "DELETE FROM audit_log WHERE seq = :s", s=entry.seq)
    result = audit.verify(db, dataset_id=world.dataset)
    assert not result.ok, result


def test_reorder_is_detected(db: Database) -> None:
    world = _world(db)
    a, b = _entries(db, world.dataset)[2:4]
    # swap the two entries' places in the chain (through a free chain_seq: it is unique)
    _exec(db, "UPDATE audit_log SET chain_seq = -1 WHERE seq = :s", s=a.seq)
    _exec(db, "UPDATE audit_log SET chain_seq = :n WHERE seq = :s", n=a.chain_seq, s=b.seq)
    _exec(db, "UPDATE audit_log SET chain_seq = :n WHERE seq = :s", n=b.chain_seq, s=a.seq)
    result = audit.verify(db, dataset_id=world.dataset)
    assert not result.ok, result


def test_truncated_tail_is_detected_by_the_stored_head(db: Database) -> None:
    world = _world(db)
    last = _entries(db, world.dataset)[-1]
    _exec(db, "DELETE FROM audit_log WHERE seq = :s", s=last.seq)
    result = audit.verify(db, dataset_id=world.dataset)
    assert not result.ok and result.chain == world.dataset, result


def test_truncated_global_tail_is_detected_by_audit_head(db: Database) -> None:
    _world(db)
    last = _entries(db, audit.GLOBAL_CHAIN)[-1]
    _exec(db, "DELETE FROM audit_log WHERE seq = :s", s=last.seq)
    result = audit.verify(db)
    assert not result.ok and result.chain == audit.GLOBAL_CHAIN, result


def _pinned_head_holds(pinned: dict[str, Any], entries: list[dict[str, Any]]) -> bool:
    """The check an operator makes against an earlier bundle: the live chain still holds the
    pinned head entry (same chain_seq, same hash) — a chain may grow, never lose or change it."""
    by_seq = {e["chain_seq"]: e["hash"] for e in entries}
    return by_seq.get(pinned["chain_seq"]) == pinned["hash"]


@pytest.mark.slow
def test_truncation_with_a_rewritten_head_needs_an_external_head(db: Database, tmp_path) -> None:
    world = _world(db)
    settings = settings_for(db.engine.url, tmp_path / "artifacts")
    settings = settings.model_copy(update={"bootstrap_admin_key": None})
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    with serve(settings, db) as base_url:
        with LedgerClient(base_url, viewer) as client:
            pinned = collect(client, world.dataset)  # the externally recorded bundle
            assert pinned["audit"]["verify"]["ok"]
            # The attacker drops the last two entries and moves the head back to match.
            entries = _entries(db, world.dataset)
            keep = entries[-3]
            for gone in entries[-2:]:
                _exec(db, "DELETE FROM audit_log WHERE seq = :s", s=gone.seq)
            _exec(
                db,
                "UPDATE datasets SET audit_seq = :n, audit_hash = :h WHERE id = :d",
                n=keep.chain_seq,
                h=keep.hash,
                d=world.dataset,
            )
            # Blind spot: the database alone now verifies.
            assert audit.verify(db, dataset_id=world.dataset).ok
            assert audit.verify(db).ok
            later = collect(client, world.dataset)
            assert later["audit"]["verify"]["ok"]
            # The pinned head catches it.
            assert _pinned_head_holds(pinned["audit"]["head"], pinned["audit"]["entries"])
            assert not _pinned_head_holds(pinned["audit"]["head"], later["audit"]["entries"])
            # ... and so does `ledger check --pin OLD_BUNDLE`, the command for that comparison.
            old_bundle = tmp_path / "pinned.json"
            old_bundle.write_text(json.dumps(pinned))
            args = ["check", "--url", base_url, "--key", viewer, "--dataset", world.dataset, "--json"]
            # (Without the pin, `ledger check` sees only what the database shows: here the cut
            # entries anchored two certificates, so its anchoring check fails too; an attacker
            # who also deletes those certificates and rewrites the spend leaves it nothing.)
            caught = _cli([*args, "--pin", str(old_bundle)])
            assert caught.returncode == 1, caught.stdout
            pin = next(c for c in json.loads(caught.stdout)["checks"] if c["name"] == "pin")
            assert not pin["ok"], pin
            assert any("pinned audit head" in p and "is missing" in p for p in pin["problems"]), pin
            # an earlier bundle that today's ledger does extend passes the pin
            assert evaluate(pinned, mode="online", source="x", pins={"self": pinned}).ok
            # an edited pinned bundle fails the pin (its own hash)
            edited = {**pinned, "spend": {**pinned["spend"], "epsilon_spent": "0"}}
            report = evaluate(pinned, mode="online", source="x", pins={"edited": edited})
            assert not report.ok and "edited or damaged" in str(report.to_json())


def _cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
