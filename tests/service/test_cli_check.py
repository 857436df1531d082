"""``ledger check`` and ``ledger export``: the CI gate's exit codes, its report, and the offline
bundle, against a real server (``tests.service.live_server``) on SQLite and PostgreSQL.

Exit 0: every guarantee holds; 1: one fails (stricter ε bound, a certificate or audit entry
tampered with in the database, a tampered bundle); 2: usage or connection errors.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import URL

from accountant.events import PureDpEvent, SelfComposedEvent
from service.cli import main
from service.client import LedgerClient
from service.commands.export import bundle_hash
from service.db.models import AuditEntry, Certificate
from service.db.session import Database
from service.ledger import model_registry as registry
from service.ledger import tenancy
from tests.service.live_server import free_port, serve, settings_for

# Reading the ledger runs on both backends; what only depends on the CLI or on a bundle file
# runs on SQLite (the backend fixture of tests/conftest.py, overridden).
ROOT = Path(__file__).resolve().parents[2]
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


@dataclass
class Healthy:
    """A dataset (sequential, basic, ε = 1, reading ``builtin:digits``) with three certified
    releases of model ``mlp`` (one published in the model registry) and one of ``probe``; ε spent
    0.5."""

    url: str
    viewer: str
    dataset: str
    db: Database

    def online(self, *extra: str) -> list[str]:
        return ["check", "--url", self.url, "--key", self.viewer, "--dataset", self.dataset, *extra]


@pytest.fixture
def healthy(database_url: URL, db: Database, tmp_path: Path) -> Iterator[Healthy]:
    settings = settings_for(database_url, tmp_path / "artifacts")
    admin_key = tenancy.create_api_key(db, "acme", "admin")
    viewer_key = tenancy.create_api_key(db, "acme", "viewer")
    with serve(settings, db) as url, LedgerClient(url, admin_key) as client:
        dataset = client.create_dataset(
            "d", rule="sequential", epsilon="1", delta=0, accountant="basic", data_source="builtin:digits"
        )
        task = client.create_task(dataset["id"], "t0")
        batches = [
            b["id"]
            for b in client.create_batches(
                dataset["id"], task["id"], [{"name": f"b{i}", "records": [f"r{i}"]} for i in range(3)]
            )["data"]
        ]
        certificate_ids = []
        for version, batch in enumerate(batches, start=1):
            with client.release_gate(
                dataset["id"], [batch], SelfComposedEvent(PureDpEvent(0.125), 2), model="mlp", version=version
            ) as gate:
                pass
            assert gate.certificate is not None
            certificate_ids.append(gate.certificate["id"])
        with client.release_gate(dataset["id"], batches[:1], PureDpEvent(0.25), model="probe", version=1):
            pass
        job = client.create_job(dataset["id"], "dp_sgd", {"noise_multiplier": 1.0, "steps": 1})
        client.cancel_job(job["id"])
        staged = registry.stage(
            settings.artifact_dir,
            tenant_id="acme",
            name="mlp",
            version=1,
            job_id=job["id"],
            attempt=1,
            dataset_id=dataset["id"],
            step=1,
            metrics={},
            fmt="torch",
            write=lambda h: h.write(b"w"),
        )
        registry.publish(db, settings.artifact_dir, staged, certificate_id=certificate_ids[0])
        yield Healthy(url, viewer_key, dataset["id"], db)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def checks(out: str) -> dict[str, bool]:
    report = json.loads(out)
    return {c["name"]: c["ok"] for c in report["checks"]}


# ---------------------------------------------------------------------------------------------
# Online
# ---------------------------------------------------------------------------------------------


def test_a_healthy_ledger_passes(healthy: Healthy, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(healthy.online(), capsys)
    assert code == 0, out
    assert "result: PASS" in out
    assert "4 certificate(s) re-verified offline" in out
    assert "epsilon spent 0.5 <= 1" in out

    code, out, _ = run(healthy.online("--json", "--model", "mlp", "--max-epsilon", "0.5"), capsys)
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] is True and report["mode"] == "online"
    assert checks(out) == {
        "certificates": True,
        "releases": True,
        "artifacts": True,
        "budget": True,
        "audit chain": True,
        "history": True,
        "signatures": True,
        "max epsilon": True,
        "run alone (derived)": True,
    }
    releases = next(c for c in report["checks"] if c["name"] == "releases")
    assert releases["detail"].startswith("3 release(s) of 1 model(s) and 1 registry version(s)")
    assert report["summary"]["epsilon_spent"] == "0.5"


@SQLITE_ONLY
def test_a_failed_guarantee_exits_1(healthy: Healthy, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(healthy.online("--max-epsilon", "0.4"), capsys)
    assert code == 1
    assert "FAIL  max epsilon" in out and "0.5 > 0.4" in out and "result: FAIL (1 of 9" in out

    # per model: the largest epsilon any of mlp's certificates states is 0.25 (probe came later)
    code, out, _ = run(healthy.online("--model", "mlp", "--max-epsilon", "0.25", "--json"), capsys)
    assert code == 0, out
    code, out, _ = run(healthy.online("--model", "mlp", "--max-epsilon", "0.2", "--json"), capsys)
    assert code == 1 and checks(out)["max epsilon"] is False

    code, out, _ = run(healthy.online("--model", "no-such-model"), capsys)
    assert code == 1 and "no published version of model 'no-such-model'" in out


def test_tampering_in_the_database_is_caught(healthy: Healthy, capsys: pytest.CaptureFixture[str]) -> None:
    with healthy.db.session() as session:
        row = session.scalars(
            select(Certificate)
            .where(Certificate.dataset_id == healthy.dataset)
            .order_by(Certificate.created_at)
        ).first()
        assert row is not None
        body = copy.deepcopy(row.body)
        body["result"]["epsilon"] = "0.01"
        session.execute(update(Certificate).where(Certificate.id == row.id).values(body=body))
    code, out, _ = run(healthy.online("--json"), capsys)
    assert code == 1
    result = checks(out)
    assert result == {
        "certificates": False,
        "releases": True,
        "artifacts": True,
        "budget": True,
        "audit chain": True,
        "history": True,  # the states it certifies were left alone
        "signatures": True,  # the signature is over the stored hash, which the edit left alone
        "run alone (derived)": True,  # recomputed from the certified inputs, not the result
    }

    with healthy.db.session() as session:
        entry = session.scalars(
            select(AuditEntry).where(AuditEntry.chain == healthy.dataset).order_by(AuditEntry.chain_seq)
        ).first()
        assert entry is not None
        session.execute(
            update(AuditEntry).where(AuditEntry.seq == entry.seq).values(payload={"name": "edited"})
        )
    code, out, _ = run(healthy.online(), capsys)
    assert code == 1
    assert "the server's audit verification failed" in out
    # the server's walk and the check's own, on the exported chain, find the same break
    # and say it in the same words (service.verification.audit_chain)
    broken = f"(chain {healthy.dataset!r}, position 1): entry does not match its hash"
    assert out.count(broken) == 2, out


@SQLITE_ONLY
def test_usage_and_connection_errors_exit_2(
    healthy: Healthy, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEDGER_URL", raising=False)
    monkeypatch.delenv("LEDGER_API_KEY", raising=False)
    code, _, err = run(["check", "--key", healthy.viewer, "--dataset", healthy.dataset], capsys)
    assert code == 2 and "--url" in err
    code, _, err = run(["check", "--url", healthy.url, "--key", healthy.viewer], capsys)
    assert code == 2 and "--dataset" in err
    code, out, err = run(healthy.online("--max-epsilon", "-1", "--json"), capsys)
    assert code == 2 and json.loads(out)["error"] == "usage" and "--max-epsilon" in err
    with pytest.raises(SystemExit) as usage:
        main(["check", "--no-such-flag"])
    assert usage.value.code == 2
    capsys.readouterr()

    for bad_url in ("127.0.0.1:8000", "http://[::1"):  # no scheme; not a URL
        code, _, err = run(["check", "--url", bad_url, "--key", "k", "--dataset", healthy.dataset], capsys)
        assert code == 2 and err.startswith("ledger check:")

    unreachable = f"http://127.0.0.1:{free_port()}"
    code, _, err = run(["check", "--url", unreachable, "--key", "k", "--dataset", healthy.dataset], capsys)
    assert code == 2 and "unavailable" in err
    code, _, err = run(
        [
            "check",
            "--url",
            healthy.url,
            "--key",
            "pl_wrong_key_0123456789abcdef",
            "--dataset",
            healthy.dataset,
        ],
        capsys,
    )
    assert code == 2 and "unauthorized" in err
    code, _, err = run(
        ["check", "--url", healthy.url, "--key", healthy.viewer, "--dataset", "ds_nope"], capsys
    )
    assert code == 2 and "not_found" in err

    # the key and the URL may come from the environment (keeps the key out of CI logs)
    monkeypatch.setenv("LEDGER_URL", healthy.url)
    monkeypatch.setenv("LEDGER_API_KEY", healthy.viewer)
    code, out, _ = run(["check", "--dataset", healthy.dataset], capsys)
    assert code == 0, out


# ---------------------------------------------------------------------------------------------
# Offline: export, then check the bundle
# ---------------------------------------------------------------------------------------------


def export(healthy: Healthy, path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, _, err = run(
        [
            "export",
            "--url",
            healthy.url,
            "--key",
            healthy.viewer,
            "--dataset",
            healthy.dataset,
            "-o",
            str(path),
        ],
        capsys,
    )
    assert code == 0, err
    bundle: dict[str, Any] = json.loads(path.read_text())
    return bundle


def write(path: Path, bundle: dict[str, Any], *, rehash: bool = True) -> None:
    if rehash:
        bundle["bundle_hash"] = bundle_hash(bundle)
    path.write_text(json.dumps(bundle))


def test_export_then_check_the_bundle_offline(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ledger.json"
    bundle = export(healthy, path, capsys)
    assert bundle["kind"] == "privacy-ledger/bundle" and bundle["dataset"]["id"] == healthy.dataset
    assert len(bundle["certificates"]) == 4
    assert [e["chain_seq"] for e in bundle["audit"]["entries"]] == list(
        range(1, bundle["audit"]["head"]["chain_seq"] + 1)
    )
    assert [v["version"] for v in bundle["models"]["mlp"]] == [1] and bundle["models"]["probe"] == []

    keys = tmp_path / "signing-keys.json"
    keys.write_text(json.dumps(bundle["signing_keys"]))  # as if fetched from the server itself
    code, out, _ = run(["check", "--bundle", str(path), "--json", "--trusted-keys", str(keys)], capsys)
    assert code == 0, out
    assert json.loads(out)["mode"] == "bundle" and json.loads(out)["result"] == "PASS"
    assert checks(out) == {
        "bundle": True,
        "certificates": True,
        "releases": True,
        "artifacts": True,  # offline too: the registry's hashes against the signed certificates
        "budget": True,
        "audit chain": True,
        "history": True,
        "signatures": True,
        "run alone (derived)": True,
    }
    history = next(c for c in json.loads(out)["checks"] if c["name"] == "history")
    assert history["detail"].startswith("4 settlement(s) chained per batch from the empty state over 3")
    artifacts = next(c for c in json.loads(out)["checks"] if c["name"] == "artifacts")
    assert artifacts["detail"].endswith("; 1 whose certificate states no artifact (bytes not certified)")
    code, out, _ = run(
        ["check", "--bundle", str(path), "--trusted-keys", str(keys), "--max-epsilon", "0.45"], capsys
    )
    assert code == 1 and "0.5 > 0.45" in out

    # Issue 24 §1 (changed behaviour): a bundle from a server that does not export audit
    # entries used to pass on the server's verdict alone; whoever edits a bundle writes that
    # verdict, so the chain and its signed head are now required.
    bundle["audit"].update(entries=None, head=None)
    write(path, bundle)
    code, out, _ = run(["check", "--bundle", str(path), "--trusted-keys", str(keys)], capsys)
    assert code == 1, out
    assert "FAIL  audit chain   no audit entries to recompute" in out
    assert "FAIL  history" in out and "FAIL  signatures" in out


def test_artifacts_are_compared_offline(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: a registry version whose signed certificate states ``release.artifact_sha256``
    records that hash in the bundle too; a bundle whose registry swaps a version's hash (the
    bytes a third party would download and compare) fails offline, as the bytes fail online. The
    version whose certificate states none (``mlp/1`` of ``healthy``) is counted, not failed."""
    weights = b"certified weights"
    sha256 = hashlib.sha256(weights).hexdigest()
    admin = tenancy.create_api_key(healthy.db, "acme", "admin")
    with LedgerClient(healthy.url, admin) as client:
        task = client.create_task(healthy.dataset, "t1")
        (batch,) = client.create_batches(healthy.dataset, task["id"], [{"name": "c", "records": ["c"]}])[
            "data"
        ]
        reservation = client.reserve(healthy.dataset, PureDpEvent(0.125), batches=[batch["id"]])
        answer = client.commit(reservation["id"], model="mlp", version=9, artifact_sha256=sha256)
        job = client.create_job(healthy.dataset, "dp_sgd", {"noise_multiplier": 1.0, "steps": 1})
        client.cancel_job(job["id"])
    staged = registry.stage(
        tmp_path / "artifacts",
        tenant_id="acme",
        name="mlp",
        version=9,
        job_id=job["id"],
        attempt=1,
        dataset_id=healthy.dataset,
        step=1,
        metrics={},
        fmt="torch",
        write=lambda h: h.write(weights),
    )
    registry.publish(healthy.db, tmp_path / "artifacts", staged, certificate_id=answer["certificate"]["id"])

    code, out, _ = run(healthy.online("--json"), capsys)
    assert code == 0, out
    path = tmp_path / "ledger.json"
    original = export(healthy, path, capsys)
    (version,) = [v for v in original["models"]["mlp"] if v["version"] == 9]
    assert version["artifact"]["sha256"] == sha256
    keys = tmp_path / "signing-keys.json"
    keys.write_text(json.dumps(original["signing_keys"]))
    offline = ["check", "--bundle", str(path), "--json", "--trusted-keys", str(keys)]

    code, out, _ = run(offline, capsys)
    assert code == 0, out
    artifacts = next(c for c in json.loads(out)["checks"] if c["name"] == "artifacts")
    assert artifacts["detail"] == (
        "1 version(s) record the artifact SHA-256 their signed certificate states (bytes not "
        "downloaded offline); 1 whose certificate states no artifact (bytes not certified)"
    )

    for swapped in (hashlib.sha256(b"other weights").hexdigest(), None):
        bundle = copy.deepcopy(original)
        (version,) = [v for v in bundle["models"]["mlp"] if v["version"] == 9]
        version["artifact"]["sha256"] = swapped
        write(path, bundle)
        code, out, _ = run(offline, capsys)
        assert code == 1, out
        assert {name for name, ok in checks(out).items() if not ok} == {"artifacts"}
        artifacts = next(c for c in json.loads(out)["checks"] if c["name"] == "artifacts")
        assert artifacts["problems"] == [
            f"registry version mlp/9: records SHA-256 {swapped}, its certificate {sha256}"
        ]


@SQLITE_ONLY
def test_a_bundles_run_alone_is_recomputed_and_labelled_derived_not_certified(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 §3: a bundle's DP statement shows ``run_alone``, which no certificate states;
    ``ledger check --bundle`` recomputes it from the certificate's certified charge and budget δ,
    says it is derived, not certified, and fails a statement that understates it."""
    path = tmp_path / "ledger.json"
    bundle = export(healthy, path, capsys)
    (version,) = bundle["models"]["mlp"]
    alone = version["dp_statement"]["run_alone"]
    assert (alone["epsilon"], alone["delta"], alone["accountant"]) == ("0.25", "0", "basic (exact)")
    assert alone["certified"] is False and "derived, not certified" in alone["source"]
    keys = tmp_path / "signing-keys.json"
    keys.write_text(json.dumps(bundle["signing_keys"]))
    code, out, _ = run(["check", "--bundle", str(path), "--trusted-keys", str(keys)], capsys)
    assert code == 0, out
    line = next(row for row in out.splitlines() if "run alone (derived)" in row)
    assert line.strip().startswith("PASS") and "by basic (exact)); derived, not certified" in line

    alone["epsilon"] = "0.2"  # a statement understating the run, the bundle rehashed
    write(path, bundle)
    code, out, _ = run(["check", "--bundle", str(path), "--trusted-keys", str(keys), "--json"], capsys)
    assert code == 1
    assert checks(out)["run alone (derived)"] is False and checks(out)["certificates"] is True
    finding = next(c for c in json.loads(out)["checks"] if c["name"] == "run alone (derived)")
    assert "its certificate's charge gives (epsilon 0.25, delta 0) by basic (exact)" in finding["problems"][0]


@SQLITE_ONLY
def test_a_tampered_bundle_fails(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ledger.json"
    original = export(healthy, path, capsys)

    def failing(edit: Any, *, rehash: bool = True) -> dict[str, bool]:
        bundle = copy.deepcopy(original)
        edit(bundle)
        write(path, bundle, rehash=rehash)
        # (the signer is the bundle's own here: exit 1 must come from a failed check)
        code, out, _ = run(["check", "--bundle", str(path), "--json", "--allow-unverified-signer"], capsys)
        assert code == 1, out
        return {name: ok for name, ok in checks(out).items() if not ok}

    # an edit without a recomputed bundle hash
    unhashed = failing(lambda b: b["spend"].update(epsilon_spent="0.1"), rehash=False)
    assert unhashed == {"bundle": False, "budget": False, "history": False}

    # a certificate made to state less: its hash breaks, and the chain recorded the old hash
    def cheaper(b: dict[str, Any]) -> None:
        b["certificates"][0]["certificate"]["result"]["epsilon"] = "0.01"

    assert failing(cheaper) == {"certificates": False}

    # a certificate hidden from the bundle: the chain's commit entry still names it
    assert failing(lambda b: b["certificates"].pop()) == {"audit chain": False, "history": False}

    # spend under-reported: the certificates prove more
    assert failing(lambda b: b["spend"].update(epsilon_spent="0.25")) == {"budget": False, "history": False}

    # an audit entry edited, or the chain cut short
    def edited(b: dict[str, Any]) -> None:
        b["audit"]["entries"][0]["payload"]["name"] = "other"

    assert failing(edited) == {"audit chain": False}
    assert failing(lambda b: b["audit"]["entries"].pop()) == {"audit chain": False}

    # a registry version pointing at no certificate of this dataset
    def orphan(b: dict[str, Any]) -> None:
        b["models"]["mlp"][0]["certificate_id"] = "cert_elsewhere"

    assert failing(orphan) == {"releases": False}
    # a published registry version left out of the bundle: the chain recorded publishing it
    assert failing(lambda b: b["models"]["mlp"].pop()) == {"releases": False}
    assert failing(lambda b: b.update(models={})) == {"releases": False}

    # a structurally broken bundle fails rather than crashes
    assert "budget" in failing(lambda b: b.pop("spend"))


@SQLITE_ONLY
def test_bundle_usage_errors_exit_2(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["check", "--bundle", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "cannot read bundle" in err
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}))
    code, _, err = run(["check", "--bundle", str(tmp_path / "other.json")], capsys)
    assert code == 2 and "not a privacy-ledger bundle" in err
    (tmp_path / "broken.json").write_text("{")
    code, _, err = run(["check", "--bundle", str(tmp_path / "broken.json")], capsys)
    assert code == 2 and "not JSON" in err
    path = tmp_path / "ledger.json"
    export(healthy, path, capsys)
    code, _, err = run(["check", "--bundle", str(path), "--dataset", "ds_other"], capsys)
    assert code == 2 and "ds_other" in err
    code, _, err = run(
        [
            "export",
            "--url",
            healthy.url,
            "--key",
            healthy.viewer,
            "--dataset",
            "ds_nope",
            "-o",
            str(tmp_path / "x.json"),
        ],
        capsys,
    )
    assert code == 2 and not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------
# Signatures: a consistent forgery, a tampered head, pinned and self-declared signers
# ---------------------------------------------------------------------------------------------


def _rechain(bundle: dict[str, Any]) -> None:
    """Recompute every audit entry's hash and the head (no secret needed), as a forger would."""
    from accountant.canonical import parse_timestamp
    from service.verification.audit_chain import GENESIS_HASH, entry_hash

    prev = GENESIS_HASH
    for entry in bundle["audit"]["entries"]:
        entry["prev_hash"] = prev
        entry["hash"] = prev = entry_hash(
            chain=entry["chain"],
            chain_seq=entry["chain_seq"],
            event_type=entry["event_type"],
            tenant_id=entry["tenant_id"],
            dataset_id=entry["dataset_id"],
            payload=entry["payload"],
            created_at=parse_timestamp(entry["created_at"]),
            prev_hash=entry["prev_hash"],
        )
    bundle["audit"]["head"]["hash"] = prev


def _forge_first_certificate(bundle: dict[str, Any]) -> None:
    """The first certificate re-issued for a cheaper charge (hash recomputed), the chain entry that
    recorded its hash edited and the chain recomputed: every check holds but the signatures and
    the history (a later certificate on its batch starts from the genuine state)."""
    from tests.service.api.test_signatures import forge

    stored = bundle["certificates"][0]
    genuine = stored["certificate"]
    forged = {**forge(genuine, 0.0625), "signature": genuine["signature"]}
    stored["certificate"], stored["content_hash"] = forged, forged["hash"]
    for entry in bundle["audit"]["entries"]:
        if entry["payload"].get("certificate_id") == stored["id"] and "content_hash" in entry["payload"]:
            entry["payload"]["content_hash"] = forged["hash"]
    _rechain(bundle)


@SQLITE_ONLY
def test_signatures_catch_a_consistent_forgery_and_say_who_is_trusted(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.verification import signing

    path = tmp_path / "ledger.json"
    original = export(healthy, path, capsys)
    with LedgerClient(healthy.url, healthy.viewer) as client:
        served_keys = client.signing_keys()
    assert original["signing_keys"] == served_keys
    keys_file = tmp_path / "signing-keys.json"
    keys_file.write_text(json.dumps(served_keys))
    (key,) = signing.keys_from_json(served_keys, "keys").values()
    pinned_key = f"{key.key_id}:{base64.b64encode(key.raw).decode()}"

    # intact: self-declared unless pinned, and the report says which; a self-declared signer
    # exits 1 (UNVERIFIED SIGNER) unless the caller says --allow-unverified-signer (issue 24 §1)
    code, out, _ = run(["check", "--bundle", str(path), "--json"], capsys)
    assert code == 1, out
    report = json.loads(out)
    assert report["ok"] is False and report["result"].startswith("UNVERIFIED SIGNER")
    signatures = next(c for c in report["checks"] if c["name"] == "signatures")
    assert (signatures["ok"], signatures["status"]) == (True, "UNVERIFIED SIGNER")
    detail = signatures["detail"]
    assert detail.startswith(f"4 certificate(s) and the audit head signed by key(s) {key.key_id}")
    assert "self-declared by the bundle, not pinned" in detail
    assert report["summary"]["signer_trust"] == "self-declared"
    code, out, _ = run(["check", "--bundle", str(path)], capsys)
    assert code == 1 and "  UNVERIFIED SIGNER  signatures" in out and "result: UNVERIFIED SIGNER" in out
    code, out, _ = run(["check", "--bundle", str(path), "--allow-unverified-signer"], capsys)
    assert code == 0, out
    assert "result: PASS (signer unverified, allowed by --allow-unverified-signer)" in out
    for pin in (["--trusted-keys", str(keys_file)], ["--trusted-key", pinned_key]):
        code, out, _ = run(["check", "--bundle", str(path), *pin], capsys)
        assert code == 0, out
        assert "PASS  signatures" in out and "pinned (--trusted-key" in out and "result: PASS\n" in out + "\n"

    def verdicts(bundle: dict[str, Any], *extra: str) -> tuple[int, dict[str, bool], str]:
        write(path, bundle)
        code, out, _ = run(["check", "--bundle", str(path), "--json", *extra], capsys)
        report = json.loads(out)
        problems = "\n".join(p for c in report["checks"] for p in c["problems"])
        return code, {c["name"]: c["ok"] for c in report["checks"] if not c["ok"]}, problems

    # the consistent forgery: certificate, chain and bundle hash all recomputed
    forged = copy.deepcopy(original)
    _forge_first_certificate(forged)
    code, failed, problems = verdicts(forged)
    # the history catches it too: the next certificate on its batch started from the genuine state
    assert (code, failed) == (1, {"history": False, "signatures": False})
    assert (
        "state_before of batch(es)" in problems
        and "(a state invented, or an earlier settlement altered)" in problems
    )
    first = forged["certificates"][0]["id"]
    assert f"certificate {first}: certificate.signature does not verify under key {key.key_id}" in problems
    assert "audit head (entry" in problems and "audit head.signature does not verify" in problems

    # every certificate and the head re-signed with another key, which the bundle now declares:
    # the bundle is self-consistent, which is all a self-declared key shows (UNVERIFIED SIGNER,
    # exit 1 unless explicitly allowed, issue 24 §1); the pinned key refuses it
    own = signing.SigningKey.generate()
    forged = copy.deepcopy(original)
    for stored in forged["certificates"]:
        stored["certificate"] = signing.sign_certificate(stored["certificate"], own)
    head = forged["audit"]["head"]
    forged["audit"]["head"] = signing.signed_head(
        forged["dataset"]["id"], head["chain_seq"], head["hash"], own
    )
    forged["signing_keys"] = {"keys": [own.public.to_json()]}
    code, failed, _ = verdicts(forged)
    assert (code, failed) == (1, {})
    code, failed, _ = verdicts(forged, "--allow-unverified-signer")
    assert (code, failed) == (0, {})
    code, failed, problems = verdicts(forged, "--trusted-keys", str(keys_file))
    assert (code, failed) == (1, {"signatures": False})
    assert f"certificate.signature.key_id {own.public.key_id!r} is not a trusted key" in problems

    # a tampered signed head: the chain check fails, and so does its signature
    tampered = copy.deepcopy(original)
    tampered["audit"]["head"]["chain_seq"] -= 1
    code, failed, problems = verdicts(tampered, "--trusted-key", pinned_key)
    assert (code, failed) == (1, {"audit chain": False, "signatures": False})
    assert "audit head.signature does not verify" in problems

    # a certificate stripped of its signature (as one issued before signing): not trusted
    unsigned = copy.deepcopy(original)
    del unsigned["certificates"][1]["certificate"]["signature"]
    code, failed, problems = verdicts(unsigned)
    assert (code, failed) == (1, {"signatures": False})
    assert "certificate is not signed" in problems

    # a bundle that declares no keys, none pinned
    keyless = copy.deepcopy(original)
    keyless["signing_keys"] = None
    code, failed, problems = verdicts(keyless)
    assert (code, failed) == (1, {"signatures": False}) and "--trusted-key" in problems


@SQLITE_ONLY
def test_a_bad_trusted_key_is_a_usage_error(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ledger.json"
    export(healthy, path, capsys)
    raw = base64.b64encode(bytes(32)).decode()
    for bad, message in (
        ("no-colon", "--trusted-key[0] must be KEYID:BASE64"),
        ("abcd:%%%", "--trusted-key[0] is not base64"),
        (f"0123456789abcdef:{raw}", "--trusted-key[0]: key id '0123456789abcdef' is not this key's"),
    ):
        code, _, err = run(["check", "--bundle", str(path), "--trusted-key", bad], capsys)
        assert code == 2 and message in err, err
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{"key_id": "x", "algorithm": "RSA"}]}))
    code, _, err = run(
        ["check", "--bundle", str(path), "--trusted-keys", str(tmp_path / "keys.json")], capsys
    )
    assert code == 2 and ".keys[0].algorithm must be 'Ed25519'" in err
    code, _, err = run(
        ["check", "--bundle", str(path), "--trusted-keys", str(tmp_path / "none.json")], capsys
    )
    assert code == 2 and "--trusted-keys: cannot read" in err


SERVER_PACKAGES = (
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "pydantic",
    "pydantic_settings",
    "torch",
)
_WITHOUT_SERVER = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    # A plain `pip install privacy-ledger`: the server's and the worker's packages are absent.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from service.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {packages})
assert not loaded, loaded
sys.exit(code)
"""


def _without_server(*argv: str) -> subprocess.CompletedProcess[str]:
    script = _WITHOUT_SERVER.format(packages=set(SERVER_PACKAGES))
    return subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.slow
def test_the_client_side_commands_need_no_server_packages(
    healthy: Healthy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14 §4: `ledger epsilon`, `ledger export`, `ledger check` (online and `--bundle`) and
    `ledger model-card` run
    with none of FastAPI, uvicorn, SQLAlchemy, Alembic, pydantic or torch importable; a server
    command says which extra it needs."""
    path = tmp_path / "ledger.json"
    exported = _without_server(
        "export", "--url", healthy.url, "--key", healthy.viewer, "--dataset", healthy.dataset, "-o", str(path)
    )
    assert exported.returncode == 0, exported.stderr
    checked = _without_server("check", "--bundle", str(path), "--json", "--allow-unverified-signer")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checks(checked.stdout)["signatures"] is True
    online = _without_server(
        "check", "--url", healthy.url, "--key", healthy.viewer, "--dataset", healthy.dataset
    )
    assert online.returncode == 0, online.stdout + online.stderr
    epsilon = _without_server(
        "epsilon",
        "--noise-multiplier",
        "1.1",
        "--sampling-probability",
        "0.01",
        "--steps",
        "100",
        "--delta",
        "1e-5",
    )
    assert epsilon.returncode == 0 and json.loads(epsilon.stdout)["epsilon"]["upper"] > 0, epsilon.stderr
    card = _without_server("model-card", "--url", healthy.url, "--key", healthy.viewer, "no-such-model", "1")
    assert card.returncode == 2 and "not_found" in card.stderr, card.stderr  # read, and answered, client side
    serve = _without_server("serve")
    assert serve.returncode == 2 and "pip install 'privacy-ledger[server]'" in serve.stderr


@pytest.mark.slow
def test_charged_aborts_pass_online_and_offline(
    database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 §2: an abort's certificate (``release: null``, ``outcome: "aborted"``) is a charge
    the chain records (``reservation.aborted`` with its content hash), not a release: the
    ledger checks, online and from a bundle, and the budget counts it."""
    admin_key = tenancy.create_api_key(db, "acme", "admin")
    viewer_key = tenancy.create_api_key(db, "acme", "viewer")
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, admin_key) as client,
    ):
        dataset = client.create_dataset("d", rule="sequential", epsilon="1", delta=0, accountant="basic")
        task = client.create_task(dataset["id"], "t0")
        (batch,) = [
            b["id"]
            for b in client.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r"]}])[
                "data"
            ]
        ]
        with client.release_gate(dataset["id"], [batch], PureDpEvent(0.25), model="mlp", version=1):
            pass
        with client.release_gate(
            dataset["id"], [batch], PureDpEvent(0.5), model="mlp", version=2
        ) as withheld:
            withheld.withhold()
        online = ["check", "--url", url, "--key", viewer_key, "--dataset", dataset["id"]]
        code, out, _ = run([*online, "--json"], capsys)
        assert code == 0, out
        assert all(checks(out).values()) and json.loads(out)["summary"]["epsilon_spent"] == "0.75"
        path = tmp_path / "bundle.json"
        code, out, _ = run(
            ["export", "--url", url, "--key", viewer_key, "--dataset", dataset["id"], "-o", str(path)],
            capsys,
        )
        assert code == 0, out
        keys = tmp_path / "signing-keys.json"
        keys.write_text(json.dumps(client.signing_keys()))  # fetched from the server itself
    bundle = json.loads(path.read_text())
    assert sorted(c["outcome"] for c in bundle["certificates"]) == ["aborted", "released"]
    # (the bundle's own keys leave the signer unverified, exit 1: the server's are pinned)
    code, out, _ = run(["check", "--bundle", str(path), "--json", "--trusted-keys", str(keys)], capsys)
    assert code == 0, out
    assert json.loads(out)["result"] == "PASS"
    assert all(checks(out).values())
