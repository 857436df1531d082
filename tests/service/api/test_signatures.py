"""Signed certificates and audit heads (``service.verification.signing``), over HTTP on both backends.

The forgery the signature exists for: a certificate whose event, states and result are edited
consistently (recomputed with the accountant's own pure functions, as anyone can) and whose
content hash is recomputed. ``accountant.certificates.verify`` accepts it; the server's verify
refuses it, because its signature is not over its hash. Rotation: a key moved to
``LEDGER_SIGNING_KEYS_RETIRED`` still verifies what it signed; a key dropped entirely does not.
"""

from __future__ import annotations

import base64
import copy
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update
from sqlalchemy.engine import URL

from accountant import certificates as accountant_certificates
from accountant import events as ev
from accountant.certificates import BatchSet, ClassRecord
from accountant.rules import BatchState, Budget, Charge, commit, reserve
from service import server_secrets
from service.app import create_app
from service.db.models import AuditEntry, Certificate
from service.db.session import Database
from service.ledger import tenancy
from service.ledger.certificates import verify_stored
from service.settings import Settings
from service.verification import signing
from tests.service.api.conftest import ROOT, Keys, TestClient, bearer, free_port, url_text
from tests.service.api.world import make_world

WELL_KNOWN = "/.well-known/privacy-ledger/signing-keys"


def forge(certificate: dict[str, Any], epsilon: float) -> dict[str, Any]:
    """``certificate`` re-issued for a cheaper pure-DP charge: every state, cost and result
    recomputed with the accountant's own functions, and the content hash with it. No signature."""
    inputs = certificate["inputs"]
    budget = Budget.from_json(inputs["budget"])
    charge = Charge(ev.from_json({"kind": "pure_dp", "epsilon": epsilon}, "event"), None)
    records = []
    for c in inputs["classes"]:
        at_reserve = BatchState.from_json(c["state_at_reserve"])
        before = BatchState.from_json(c["state_before"])
        reserved = reserve(budget, at_reserve, charge).cost
        settled = commit(budget, before, charge, reserved, None, None, None)
        records.append(
            ClassRecord(
                c["class"], c["batches"], at_reserve, reserved, before, None, settled.state, settled.committed
            )
        )
    return accountant_certificates.issue(
        budget=budget,
        charge=charge,
        classes=records,
        batch_set=BatchSet(inputs["batch_set"]["count"], inputs["batch_set"]["hash"]),
        reservation_id=certificate["reservation_id"],
        release=certificate["release"],
        release_id=certificate["release_id"],
        dataset_id=certificate["dataset_id"],
        issued_at=certificate["issued_at"],
    )


def store(db: Database, certificate_id: str, body: dict[str, Any]) -> None:
    """What someone with write access to the database does: replace the stored certificate."""
    with db.session() as session:
        session.execute(
            update(Certificate)
            .where(Certificate.id == certificate_id)
            .values(body=body, content_hash=body["hash"])
        )


def stored(client: TestClient, certificate_id: str, key: str) -> dict[str, Any]:
    answer = client.get(f"/v1/certificates/{certificate_id}", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()["certificate"]
    return body


def verify(client: TestClient, certificate_id: str, key: str) -> dict[str, Any]:
    answer = client.post(f"/v1/certificates/{certificate_id}/verify", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def write_key(path: Path) -> signing.SigningKey:
    key = signing.SigningKey.generate()
    path.write_bytes(key.pem())
    path.chmod(0o600)
    return key


def raw_b64(key: signing.SigningKey) -> str:
    return base64.b64encode(key.public.raw).decode()


@contextmanager
def running(settings: Settings, db: Database) -> Iterator[TestClient]:
    """The app on ``db`` under ``settings``: a start (and, on leaving, a stop) of the server."""
    app: FastAPI = create_app(settings, database=db)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_a_valid_certificate_is_signed_and_verifies(client: TestClient, db: Database, keys: Keys) -> None:
    viewer = keys.get("acme", "viewer")
    world = make_world(db, "acme")
    body = stored(client, world.certificate, viewer)
    active = server_secrets.signing_keys(db).active.public

    assert body["signature"]["algorithm"] == "Ed25519"
    assert body["signature"]["key_id"] == active.key_id
    # the content hash does not cover the signature: adding it changed nothing
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    assert accountant_certificates.content_hash(body) == body["hash"]
    assert accountant_certificates.content_hash(unsigned) == body["hash"]
    assert accountant_certificates.verify(body).ok

    result = verify(client, world.certificate, viewer)
    assert result["ok"] is True, result
    assert result["signature"] == {
        "status": "valid",
        "key_id": active.key_id,
        "key_status": "active",
        "reason": f"signed by key {active.key_id} (active)",
    }


def test_a_consistent_forgery_with_a_recomputed_hash_fails_on_its_signature(
    client: TestClient, db: Database, keys: Keys
) -> None:
    viewer = keys.get("acme", "viewer")
    world = make_world(db, "acme")
    genuine = stored(client, world.certificate, viewer)

    forged = forge(genuine, 0.01)
    assert forged["hash"] != genuine["hash"]
    assert forged["inputs"]["charge"] != genuine["inputs"]["charge"]
    assert accountant_certificates.verify(forged).ok  # the hash and every recomputation hold

    # with the genuine certificate's signature copied over: not over this hash
    store(db, world.certificate, {**forged, "signature": genuine["signature"]})
    result = verify(client, world.certificate, viewer)
    assert result["ok"] is False
    assert result["signature"]["status"] == "invalid"
    assert "its inputs re-verify, but certificate.signature does not verify" in result["reason"]

    # with no signature at all: unsigned, not ok
    store(db, world.certificate, forged)
    result = verify(client, world.certificate, viewer)
    assert (result["ok"], result["signature"]["status"]) == (False, "unsigned")
    assert "not signed" in result["reason"]

    # signed by the forger's own key: a key this server does not know
    own = signing.SigningKey.generate()
    store(db, world.certificate, signing.sign_certificate(forged, own))
    result = verify(client, world.certificate, viewer)
    assert (result["ok"], result["signature"]["status"]) == (False, "unknown_key")
    assert (
        f"certificate.signature.key_id {own.public.key_id!r} is none of this server's keys"
        in result["reason"]
    )

    # a signature that is not one
    broken = copy.deepcopy(genuine)
    broken["signature"]["value"] = "not base64!"
    store(db, world.certificate, broken)
    result = verify(client, world.certificate, viewer)
    assert (result["ok"], result["signature"]["status"]) == (False, "malformed")
    assert "certificate.signature.value is not base64" in result["reason"]


def test_the_well_known_route_lists_the_keys_without_an_api_key(client: TestClient, db: Database) -> None:
    answer = client.get(WELL_KNOWN)
    assert answer.status_code == 200, answer.text
    active = server_secrets.signing_keys(db).active.public
    assert answer.json() == {"keys": [active.to_json()]}
    assert signing.keys_from_json(answer.json(), "keys") == {active.key_id: active}
    assert active.key_id == signing.key_id(active.raw) and len(active.key_id) == 16


def test_audit_heads_are_signed_and_a_tampered_head_fails(
    client: TestClient, db: Database, keys: Keys
) -> None:
    viewer = keys.get("acme", "viewer")
    world = make_world(db, "acme")
    server_keys = signing.keys_from_json(client.get(WELL_KNOWN).json(), "keys")

    page = client.get(f"/v1/datasets/{world.dataset}/audit", headers=bearer(viewer)).json()
    head = page["head"]
    assert head["chain_seq"] == len(page["data"]) and head["hash"] == page["data"][-1]["hash"]
    assert signing.check_head(world.dataset, head, server_keys).ok

    walked = client.get("/v1/audit/verify", params={"dataset_id": world.dataset}, headers=bearer(viewer))
    assert walked.status_code == 200 and walked.json()["ok"] is True
    assert walked.json()["head"] == head  # Ed25519 is deterministic: the same statement, the same bytes
    assert client.get("/v1/audit/verify", headers=bearer(viewer)).json()["head"] is None

    for tampered in (
        {**head, "chain_seq": head["chain_seq"] - 1},
        {**head, "hash": "0" * 64},
    ):
        assert signing.check_head(world.dataset, tampered, server_keys).status == "invalid"
    # a head signed for one dataset's chain says nothing about another's
    other = make_world(db, "acme")
    assert signing.check_head(other.dataset, head, server_keys).status == "invalid"


@pytest.mark.slow
def test_rotation_keeps_retired_keys_verifying_and_a_dropped_key_unknown(
    settings: Settings, db: Database, keys: Keys, tmp_path: Path
) -> None:
    viewer = keys.get("acme", "viewer")
    first = write_key(tmp_path / "key-1.pem")
    second = write_key(tmp_path / "key-2.pem")

    with running(settings.model_copy(update={"signing_key": tmp_path / "key-1.pem"}), db) as client:
        old = make_world(db, "acme").certificate
        assert stored(client, old, viewer)["signature"]["key_id"] == first.public.key_id

    # restart with key 2 current and key 1 retired (by its public key, as the route listed it)
    rotated = settings.model_copy(
        update={"signing_key": tmp_path / "key-2.pem", "signing_keys_retired": [raw_b64(first)]}
    )
    with running(rotated, db) as client:
        new = make_world(db, "acme").certificate
        assert stored(client, new, viewer)["signature"]["key_id"] == second.public.key_id
        listed = client.get(WELL_KNOWN).json()["keys"]
        assert [(k["key_id"], k["status"]) for k in listed] == [
            (second.public.key_id, "active"),
            (first.public.key_id, "retired"),
        ]
        result = verify(client, old, viewer)
        assert result["ok"] is True, result
        assert result["signature"]["key_status"] == "retired"
        assert verify(client, new, viewer)["signature"]["key_status"] == "active"

    # the retired key given as its PEM file works the same
    by_file = rotated.model_copy(update={"signing_keys_retired": [str(tmp_path / "key-1.pem")]})
    with running(by_file, db) as client:
        assert verify(client, old, viewer)["ok"] is True

    # key 1 dropped entirely: the start is refused (issue 24 §6), naming the key and the way out
    dropped = settings.model_copy(update={"signing_key": tmp_path / "key-2.pem"})
    with pytest.raises(server_secrets.SecretError, match=f"signed by key\\(s\\) {first.public.key_id}"):
        with running(dropped, db):
            pass
    # declared lost by an admin: the start goes on, audited once; what it signed no longer
    # verifies, and the answer says why
    declared = dropped.model_copy(update={"signing_keys_lost": [first.public.key_id]})
    with running(declared, db) as client:
        result = verify(client, old, viewer)
        assert (result["ok"], result["signature"]["status"]) == (False, "unknown_key")
        assert result["signature"]["key_id"] == first.public.key_id
        assert f"key_id {first.public.key_id!r} is none of this server's keys" in result["reason"]
        assert verify(client, new, viewer)["ok"] is True
    assert declared_lost(db) == [first.public.key_id]
    with running(dropped, db) as client:  # declared once: later starts need no declaration
        assert verify(client, new, viewer)["ok"] is True
    assert declared_lost(db) == [first.public.key_id]


def declared_lost(db: Database) -> list[str]:
    """The key ids the global audit chain says were declared lost, in order."""
    with db.session(readonly=True) as session:
        return [
            e.payload["key_id"]
            for e in session.scalars(
                select(AuditEntry)
                .where(AuditEntry.chain == "global", AuditEntry.event_type == "signing_key.declared_lost")
                .order_by(AuditEntry.seq)
            )
        ]


def signer_of(db: Database, certificate_id: str) -> str:
    with db.session(readonly=True) as session:
        body = session.scalars(select(Certificate.body).where(Certificate.id == certificate_id)).one()
    return str(body["signature"]["key_id"])


def test_a_lost_default_key_file_is_not_replaced_silently(
    settings: Settings, db: Database, tmp_path: Path
) -> None:
    """Issue 24 §6: ``signing-key.pem`` in the secrets folder is deleted; the next start made a
    new one and served on, and every earlier certificate verified ``unknown_key``."""
    here = settings.model_copy(update={"secrets_dir": tmp_path / "secrets"})
    with running(here, db):
        tenancy.create_api_key(db, "acme", "viewer")  # the tenant
        old = make_world(db, "acme").certificate
    lost_id = signer_of(db, old)
    assert verify_stored(db, "acme", old)["ok"] is True
    (tmp_path / "secrets" / server_secrets.SIGNING_KEY_FILE).unlink()
    for _ in range(2):  # the key made at the refused start does not make the next one pass
        with pytest.raises(server_secrets.SecretError, match=f"LEDGER_SIGNING_KEYS_LOST={lost_id}"):
            server_secrets.bind(db, here)  # what ``ledger serve`` does before it serves
    with running(here, db):  # an app made elsewhere signs nothing with the new key either
        with pytest.raises(server_secrets.SecretError, match=lost_id):
            server_secrets.signing_keys(db)
    assert declared_lost(db) == []
    with running(here.model_copy(update={"signing_keys_lost": [lost_id]}), db):
        assert verify_stored(db, "acme", old)["signature"]["status"] == "unknown_key"
        assert signer_of(db, make_world(db, "acme").certificate) != lost_id
    assert declared_lost(db) == [lost_id]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_ledger_serve_refuses_to_start_when_a_signing_key_is_missing(
    settings: Settings, database_url: URL, db: Database, tmp_path: Path
) -> None:
    folder = tmp_path / "secrets"
    with running(settings.model_copy(update={"secrets_dir": folder}), db):
        tenancy.create_api_key(db, "acme", "viewer")  # the tenant, its key hashed as serve will
        lost_id = signer_of(db, make_world(db, "acme").certificate)
    (folder / server_secrets.SIGNING_KEY_FILE).unlink()
    env = {**os.environ, "LEDGER_SECRETS_DIR": str(folder)}
    for name in ("LEDGER_SIGNING_KEY", "LEDGER_SIGNING_KEYS_RETIRED", "LEDGER_BOOTSTRAP_ADMIN_KEY"):
        env.pop(name, None)
    port = free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--no-worker"]
    command += ["--database-url", url_text(database_url)]
    served = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert served.returncode == 2, served.stderr
    assert f"ledger serve: this database holds certificates or audit heads signed by key(s) {lost_id}" in (
        served.stderr
    )
    worker = [sys.executable, "-m", "service.cli", "worker", "--once", "--artifact-dir", str(tmp_path / "a")]
    worker += ["--database-url", url_text(database_url)]
    refused = subprocess.run(worker, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert f"ledger worker: this database holds certificates or audit heads signed by key(s) {lost_id}" in (
        refused.stderr
    )
    assert declared_lost(db) == []

    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**env, "LEDGER_SIGNING_KEYS_LOST": lost_id},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}{WELL_KNOWN}", timeout=1.0)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            assert answer.status_code == 200 and lost_id not in answer.text
            break
        else:
            raise AssertionError(f"ledger serve did not start: exit {process.poll()}")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert declared_lost(db) == [lost_id]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_an_unreadable_configured_key_stops_the_start(
    settings: Settings, db: Database, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key\n")
    with pytest.raises(server_secrets.SecretError, match=r"LEDGER_SIGNING_KEY \(.*bad.pem\) is not"):
        with running(settings.model_copy(update={"signing_key": bad}), db):
            pass
    with pytest.raises(server_secrets.SecretError, match="LEDGER_SIGNING_KEY: cannot read"):
        with running(settings.model_copy(update={"signing_key": tmp_path / "missing.pem"}), db):
            pass
    assert not (tmp_path / "missing.pem").exists()  # a configured key is never made up
    for retired, message in (
        (
            [raw_b64(signing.SigningKey.generate()), "nope"],
            r"LEDGER_SIGNING_KEYS_RETIRED\[1\] .*cannot read 'nope'",
        ),
        ([" "], r"LEDGER_SIGNING_KEYS_RETIRED\[0\] must not be blank"),
        ([str(bad)], r"LEDGER_SIGNING_KEYS_RETIRED\[0\] \(.*bad.pem\) is not a PEM public or private key"),
    ):
        with pytest.raises(server_secrets.SecretError, match=message):
            server_secrets.load_signing_keys(
                settings.model_copy(update={"secrets_dir": tmp_path, "signing_keys_retired": retired}),
                settings.database_url,
            )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_ledger_serve_refuses_to_start_with_an_unreadable_key(database_url: URL, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
    env = {**os.environ, "LEDGER_SIGNING_KEY": str(bad)}
    env.pop("LEDGER_BOOTSTRAP_ADMIN_KEY", None)
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(free_port()), "--no-worker"]
    served = subprocess.run(
        [*command, "--database-url", url_text(database_url)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert served.returncode == 2, served.stderr
    assert f"ledger serve: LEDGER_SIGNING_KEY ({bad}) is not an unencrypted PEM private key" in served.stderr


@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_default_key_is_made_once_beside_the_key_hash_secret(settings: Settings, tmp_path: Path) -> None:
    folder = tmp_path / "secrets"
    here = settings.model_copy(update={"secrets_dir": folder})
    ring = server_secrets.load_signing_keys(here, settings.database_url)
    path = folder / server_secrets.SIGNING_KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert server_secrets.load_signing_keys(here, settings.database_url).active.public == ring.active.public
    assert ring.retired == ()


def test_settings_take_retired_keys_as_a_list_or_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_SIGNING_KEYS_RETIRED", "a.pem, b.pem")
    assert Settings().signing_keys_retired == ["a.pem", "b.pem"]
    monkeypatch.setenv("LEDGER_SIGNING_KEYS_RETIRED", '["c.pem"]')
    assert Settings().signing_keys_retired == ["c.pem"]
