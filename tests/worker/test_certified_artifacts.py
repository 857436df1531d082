"""A published model's bytes are bound to its signed certificate (issue 24 §6): the worker commits
the release with the weights' SHA-256, ``service.training.nets.load_model`` loads only bytes whose SHA-256
the signed certificate states, and ``ledger check`` (online) downloads every version and compares.

A real server (uvicorn on a loopback port, its in-process worker training for real) over the
``db`` fixture's database (SQLite and PostgreSQL); the client over real HTTP; the artifact
swapped on disk with its record rewritten to match, as a compromised server or store would.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from accountant.certificates import verify
from service.cli import main as ledger_main
from service.client import InvalidInput, LedgerError
from service.db.models import ModelVersion
from service.db.session import Database
from service.training.data import register_source
from service.training.nets import load_model
from service.verification.signing import check_certificate, keys_from_json
from tests.worker.digits_world import client_for, finished_job

DIGITS = "builtin:digits"


def _check(url: str, key: str, dataset_id: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    capsys.readouterr()
    code = ledger_main(["check", "--url", url, "--key", key, "--dataset", dataset_id, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_a_published_version_loads_only_with_the_bytes_its_signed_certificate_states(
    ledger: tuple[str, dict[str, str]],
    db: Database,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, keys = ledger
    admin, trainer, viewer = (client_for(url, keys[s]) for s in ("admin", "trainer", "viewer"))
    dataset = admin.create_dataset(
        "digits", rule="sequential", epsilon="10", delta="1e-5", data_source=DIGITS
    )
    register_source(admin, dataset["id"], batch_size=700)
    params = {"noise_multiplier": 1.1, "steps": 8, "expected_batch_size": 64, "seed": 3}
    job = finished_job(trainer, trainer.create_job(dataset["id"], "dp_sgd", params)["id"])
    assert job["status"] == "succeeded", job.get("error")
    name = job["model_name"]
    (number,) = [v["version"] for v in viewer.list_model_versions(name)["data"]]

    # The worker committed the release with the weights' SHA-256: it is in the signed certificate.
    version = viewer.get_model_version(name, number)
    certificate = version["certificate"]["certificate"]
    served = viewer.download_artifact(name, number)
    assert certificate["release"] == {"model": name, "version": number, "artifact_sha256": served.sha256}
    assert version["artifact"]["sha256"] == served.sha256 == hashlib.sha256(served.content).hexdigest()
    assert verify(certificate).ok
    assert check_certificate(certificate, keys_from_json(viewer.signing_keys(), "server")).ok
    assert load_model(viewer, name, number).model_spec == version["model_spec"]
    code, report = _check(url, keys["viewer"], dataset["id"], capsys)
    findings = {f["name"]: f for f in report["checks"]}
    assert code == 0 and findings["artifacts"]["ok"], findings["artifacts"]
    assert findings["artifacts"]["detail"].startswith("1 version(s)")

    # Other weights of the same architecture swapped in on disk, the record rewritten to match:
    # the server's header and version record agree with the bytes, the signed certificate not.
    import torch

    state = torch.load(io.BytesIO(served.content), weights_only=True)
    forged = io.BytesIO()
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, forged)
    forged_sha = hashlib.sha256(forged.getvalue()).hexdigest()
    with db.session() as session:
        row = session.scalars(select(ModelVersion).where(ModelVersion.name == name)).one()
        (tmp_path / "artifacts" / row.artifact_path).write_bytes(forged.getvalue())
        session.execute(
            update(ModelVersion).where(ModelVersion.id == row.id).values(artifact_sha256=forged_sha)
        )
    assert viewer.download_artifact(name, number).sha256 == forged_sha  # the header agrees
    with pytest.raises(LedgerError) as refused:
        load_model(viewer, name, number)
    assert refused.value.code == "artifact_not_certified"
    assert forged_sha in refused.value.message and served.sha256 in refused.value.message
    # Pinned keys that did not sign the certificate: refused too.
    with pytest.raises(LedgerError) as unpinned:
        load_model(viewer, name, number, trusted_keys={})
    assert unpinned.value.code == "artifact_not_certified" and "signature" in unpinned.value.message

    code, report = _check(url, keys["viewer"], dataset["id"], capsys)
    findings = {f["name"]: f for f in report["checks"]}
    assert code == 1 and not findings["artifacts"]["ok"]
    assert any(forged_sha in p and served.sha256 in p for p in findings["artifacts"]["problems"])


def test_an_external_trainer_binds_its_artifact_in_the_signed_certificate(
    ledger: tuple[str, dict[str, str]],
) -> None:
    url, keys = ledger
    admin, trainer = client_for(url, keys["admin"]), client_for(url, keys["trainer"])
    dataset = admin.create_dataset("d", rule="sequential", epsilon="1", delta="0", accountant="basic")
    task = admin.create_task(dataset["id"], "t")
    (batch,) = admin.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r1", "r2"]}])[
        "data"
    ]
    event = {"kind": "laplace", "scale": 10}
    weights = hashlib.sha256(b"my weights").hexdigest()

    held = trainer.reserve(dataset["id"], event, batches=[batch["id"]])
    with pytest.raises(InvalidInput) as bad:
        trainer.commit(held["id"], model="ext", version=1, artifact_sha256=weights.upper())
    assert bad.value.field == "release.artifact_sha256"
    answer = trainer.commit(held["id"], model="ext", version=1, artifact_sha256=weights)
    certificate = trainer.get_certificate(answer["certificate"]["id"])["certificate"]
    assert certificate["release"] == {"model": "ext", "version": 1, "artifact_sha256": weights}
    assert verify(certificate).ok
    assert check_certificate(certificate, keys_from_json(trainer.signing_keys(), "server")).ok

    # The release gate binds what the block sets.
    with trainer.release_gate(dataset["id"], [batch["id"]], event, model="ext", version=2) as gate:
        gate.artifact_sha256 = weights
    assert gate.certificate is not None
    stored = trainer.get_certificate(gate.certificate["id"])["certificate"]
    assert stored["release"]["artifact_sha256"] == weights
