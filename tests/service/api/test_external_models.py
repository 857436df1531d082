"""A model trained outside the service, registered against its release's certificate
(``PUT /v1/models/{name}/versions/{v}``; issue 28 §1), over real HTTP (uvicorn on TCP, the
``LedgerClient``) on both backends: the happy path end to end (registry, DP statement from the
certificate, artifact, models index, model card, audit chain), and every way to lie to it —
another tenant's certificate, an abort's, another release's, a used one, bytes the certificate
does not name, a wrong hash, an oversized or chunked-oversized upload, a taken name, a viewer key,
bad descriptions and metrics. Each refusal changes nothing (no row, no file)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import URL

from service.cli import main as cli_main
from service.client import Conflict, Forbidden, LedgerClient, NotFound
from service.db.session import Database
from service.ledger import model_registry as registry
from service.ledger import tenancy
from service.ledger.dp_statement import guarantee_of
from tests.service.live_server import serve, settings_for

LIMIT = 4096  # LEDGER_MAX_ARTIFACT_BYTES of the test server
DPSGD = {
    "kind": "self_composed",
    "count": 50,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.1,
        "event": {"kind": "gaussian", "noise_multiplier": 2.0},
    },
}
WEIGHTS = b"\x80\x02weights of ext v1" * 10
OTHER = b"other bytes" * 10
SPEC = {"architecture": "MLP 64-32-10, ReLU", "preprocessing": "pixels / 16, flattened"}


def _sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@pytest.fixture
def world(database_url: URL, db: Database, tmp_path: Path) -> Iterator[dict[str, Any]]:
    keys = {
        "admin": tenancy.create_api_key(db, "acme", "admin"),
        "viewer": tenancy.create_api_key(db, "acme", "viewer"),
        "rival": tenancy.create_api_key(db, "rival", "admin"),
    }
    artifacts = tmp_path / "artifacts"
    settings = settings_for(database_url, artifacts).model_copy(update={"max_artifact_bytes": LIMIT})
    with serve(settings, db) as url, LedgerClient(url, keys["admin"], retries=0) as ledger:
        dataset = ledger.create_dataset("d", rule="sequential", epsilon="8", delta="1e-5", accountant="rdp")
        task = ledger.create_task(dataset["id"], "t")
        ledger.create_batches(
            dataset["id"], task["id"], [{"name": "b", "records": [f"r{i}" for i in range(40)]}]
        )
        certificates = {}
        # v1 names its bytes in the signed certificate; v2 does not
        with ledger.release_gate(
            dataset["id"], None, DPSGD, tasks=[task["id"]], model="ext", version=1
        ) as gate:
            gate.artifact_sha256 = _sha(WEIGHTS)
        certificates[1] = gate.certificate["id"]
        with ledger.release_gate(
            dataset["id"], None, DPSGD, tasks=[task["id"]], model="ext", version=2
        ) as gate:
            pass
        certificates[2] = gate.certificate["id"]
        held = ledger.reserve(dataset["id"], DPSGD, tasks=[task["id"]])
        ledger.abort(held["id"])
        (aborted,) = [c for c in ledger.iter_certificates(dataset["id"]) if c["outcome"] == "aborted"]
        certificates["aborted"] = aborted["id"]
        yield {
            "url": url,
            "keys": keys,
            "ledger": ledger,
            "dataset": dataset,
            "task": task,
            "certificates": certificates,
            "artifacts": artifacts,
        }


def _put(world: dict[str, Any], name: str, version: int, content: Any, **params: Any) -> httpx.Response:
    """The upload as curl would send it (the client always states the right SHA-256)."""
    return httpx.put(
        f"{world['url']}/v1/models/{name}/versions/{version}",
        params={"format": "torch", **SPEC, **params},
        content=content,
        headers={"Authorization": f"Bearer {world['keys']['admin']}"},
        timeout=10,
    )


def _nothing_kept(world: dict[str, Any]) -> None:
    with pytest.raises(NotFound):
        world["ledger"].list_model_versions("ext")
    assert world["ledger"].list_models()["count"] == 0
    files = [p for p in world["artifacts"].rglob("*") if p.is_file()]
    assert files == [], files


@pytest.mark.parametrize("backend", ["sqlite"])  # refused before the transaction: one backend
def test_every_lie_is_refused_and_changes_nothing(world: dict[str, Any]) -> None:
    ledger: LedgerClient = world["ledger"]
    cert = world["certificates"]
    register = ledger.register_model_version

    # the bytes are not those the stated SHA-256 names (v2's certificate names no bytes)
    answer = _put(world, "ext", 2, WEIGHTS, certificate_id=cert[2], sha256=_sha(OTHER))
    assert answer.status_code == 422 and answer.json()["field"] == "sha256", answer.text
    # over the limit: declared, and streamed without a length (chunked)
    big = b"x" * (LIMIT + 1)
    answer = _put(world, "ext", 2, big, certificate_id=cert[2], sha256=_sha(big))
    assert answer.status_code == 413 and answer.json()["field"] == "artifact", answer.text
    answer = _put(world, "ext", 2, iter([big[:3000], big[3000:]]), certificate_id=cert[2], sha256=_sha(big))
    assert answer.status_code == 413 and answer.json()["field"] == "artifact", answer.text
    # the bytes are not those the certificate names
    with pytest.raises(Conflict) as refused:
        register("ext", 1, OTHER, certificate_id=cert[1], **SPEC)
    assert refused.value.details["reason"] == "artifact_not_certified"
    # another release's certificate: another version, another name
    for name, version in (("ext", 2), ("ext-copy", 1)):
        with pytest.raises(Conflict) as refused:
            register(name, version, WEIGHTS, certificate_id=cert[1], **SPEC)
        assert refused.value.details["reason"] == "release_mismatch"
        assert refused.value.details["certified_release"] == {"model": "ext", "version": "1"}
    # an abort's certificate released nothing
    with pytest.raises(Conflict) as refused:
        register("ext", 3, WEIGHTS, certificate_id=cert["aborted"], **SPEC)
    assert refused.value.details["reason"] == "not_a_release"
    # another tenant's certificate does not exist for this key (nor an unknown one)
    with LedgerClient(world["url"], world["keys"]["rival"], retries=0) as rival:
        with pytest.raises(NotFound):
            rival.register_model_version("ext", 1, WEIGHTS, certificate_id=cert[1], **SPEC)
    with pytest.raises(NotFound):
        register("ext", 1, WEIGHTS, certificate_id="cert_" + "0" * 24, **SPEC)
    # a viewer key reads, never registers
    with LedgerClient(world["url"], world["keys"]["viewer"], retries=0) as viewer:
        with pytest.raises(Forbidden):
            viewer.register_model_version("ext", 1, WEIGHTS, certificate_id=cert[1], **SPEC)
    # descriptions and metrics: required, bounded, no control characters, numbers only
    bad: list[tuple[dict[str, Any], str]] = [
        ({"architecture": "  "}, "architecture"),
        ({"preprocessing": "a\x00b"}, "preprocessing"),
        ({"architecture": "x" * 1001}, "architecture"),
        ({"format": "pickle"}, "format"),
        ({"metrics": '{"accuracy": Infinity}'}, "metrics.accuracy"),
        ({"metrics": '{"1st": 0.5}'}, "metrics"),
        ({"metrics": "[0.5]"}, "metrics"),
    ]
    for change, field in bad:
        answer = _put(world, "ext", 1, WEIGHTS, certificate_id=cert[1], sha256=_sha(WEIGHTS), **change)
        assert answer.status_code == 422 and answer.json()["field"] == field, (change, answer.text)
    _nothing_kept(world)


def test_an_external_version_is_registered_from_its_certificate(world: dict[str, Any], capsys: Any) -> None:
    ledger: LedgerClient = world["ledger"]
    cert = world["certificates"]
    version = ledger.register_model_version(
        "ext", 1, WEIGHTS, certificate_id=cert[1], metrics={"accuracy": 0.91, "loss": 0.3}, **SPEC
    )
    assert version["origin"] == "external" and version["job_id"] is None
    assert version["artifact"]["sha256"] == _sha(WEIGHTS) and version["artifact"]["bytes"] == len(WEIGHTS)
    # a retry answers the same version; the certificate is then used, for any other bytes
    again = ledger.register_model_version("ext", 1, WEIGHTS, certificate_id=cert[1], **SPEC)
    assert again["id"] == version["id"]
    with pytest.raises(Conflict) as refused:
        ledger.register_model_version("ext", 1, OTHER, certificate_id=cert[1], **SPEC)
    assert refused.value.details["reason"] == "certificate_used"
    # no certified SHA-256 in v2's certificate: any bytes, recorded and served as uploaded
    ledger.register_model_version("ext", 2, OTHER, certificate_id=cert[2], format="bytes", **SPEC)
    # the name is taken for every version that has a certificate
    with pytest.raises(Conflict) as refused:
        with ledger.release_gate(
            world["dataset"]["id"], None, DPSGD, tasks=[world["task"]["id"]], model="ext", version=2
        ):
            pass
    assert refused.value.details["reason"] == "release_exists"

    # the DP statement is the certificate's, not the client's
    read = ledger.get_model_version("ext", 1)
    certificate = ledger.get_certificate(cert[1])
    statement = read["dp_statement"]
    assert (statement["guarantee"]["epsilon"], statement["guarantee"]["delta"]) == guarantee_of(
        certificate["certificate"]
    )
    assert statement["certificate"]["id"] == cert[1]
    assert statement["mechanism"]["noise_multiplier"] == 2.0 and statement["mechanism"]["steps"] == 50
    assert statement["mechanism"]["algorithm"] is None
    assert statement["public_data"].startswith("not known to the ledger")
    assert read["model_spec"] == {"kind": "external", **SPEC}
    assert read["metrics"] == {"accuracy": 0.91, "loss": 0.3}
    assert ledger.download_artifact("ext", 1).content == WEIGHTS
    assert ledger.download_artifact("ext", 2).content == OTHER
    listed = ledger.list_model_versions("ext")["data"]
    assert [v["version"] for v in listed] == [1, 2]
    assert listed[0]["guarantee"]["epsilon"] == statement["guarantee"]["epsilon"]
    models = ledger.list_models()
    assert models["count"] == 1
    (model,) = models["data"]
    assert (model["name"], model["versions"], model["external_versions"], model["latest_version"]) == (
        "ext",
        2,
        2,
        2,
    )
    assert model["dataset_ids"] == [world["dataset"]["id"]]
    with LedgerClient(world["url"], world["keys"]["rival"], retries=0) as rival:
        assert rival.list_models()["count"] == 0
        with pytest.raises(NotFound):
            rival.get_model_version("ext", 1)
    # the audit chain records each publication with the certified artifact, and verifies
    entries = list(ledger.iter_audit_entries(world["dataset"]["id"]))
    published = [e["payload"] for e in entries if e["event_type"] == "model_version.published"]
    assert [(p["version"], p["origin"], p["artifact_sha256"]) for p in published] == [
        (1, "external", _sha(WEIGHTS)),
        (2, "external", _sha(OTHER)),
    ]
    assert ledger.verify_audit(world["dataset"]["id"])["ok"] is True

    # the CI gate checks the external versions too (served bytes, statement, audit entries)
    viewer = world["keys"]["viewer"]
    dataset_id = world["dataset"]["id"]
    code = cli_main(
        ["check", "--url", world["url"], "--key", viewer, "--dataset", dataset_id, "--model", "ext"]
    )
    report = capsys.readouterr().out
    assert code == 0, report
    assert "2 registry version(s)" in report and "1 version(s) serve the bytes their signed" in report

    # the model card of an external version
    code = cli_main(["model-card", "--url", world["url"], "--key", world["keys"]["viewer"], "ext", "1"])
    card = capsys.readouterr().out
    assert code == 0, card
    assert f'certificate_id: "{cert[1]}"' in card
    assert "MLP 64-32-10, ReLU" in card and "pixels / 16, flattened" in card
    assert "not known to the ledger" in card


@pytest.mark.parametrize("backend", ["sqlite"])
def test_an_upload_left_by_a_dead_request_is_swept(db: Database, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    stale = registry.ArtifactUpload(artifacts, max_bytes=LIMIT)
    stale.write(b"half an upload")
    live = registry.ArtifactUpload(artifacts, max_bytes=LIMIT)
    live.write(b"still arriving")
    day_ago = time.time() - registry.UPLOAD_MAX_IDLE_S - 60
    os.utime(stale.path, (day_ago, day_ago))
    registry.sweep(db, artifacts)
    assert not stale.path.exists() and live.path.exists()
    live.discard()
