"""``service.integrations.mlflow.log_release`` against a real MLflow file store (a folder under
the test's tmp_path: no server, no network; MLflow 3 keeps it in maintenance and asks for
``MLFLOW_ALLOW_FILE_STORE=true``; its SQLite store costs 8-15 s of migrations per test here) with
a certificate a real ledger (uvicorn, SQLite) issued through the gate."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")

import mlflow
from mlflow.tracking import MlflowClient
from sqlalchemy.engine import URL

from accountant.certificates import verify
from service.client import LedgerClient
from service.db.session import Database
from service.integrations.mlflow import MlflowRunMissing, log_model_version, log_release
from service.ledger import tenancy
from tests.service.live_server import serve, settings_for

pytestmark = pytest.mark.parametrize("backend", ["sqlite"])

DPSGD = {
    "kind": "self_composed",
    "count": 100,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.05,
        "event": {"kind": "gaussian", "noise_multiplier": 1.5},
    },
}


@pytest.fixture
def certificate(database_url: URL, db: Database, tmp_path: Path) -> dict[str, Any]:
    key = tenancy.create_api_key(db, "acme", "admin")
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, key) as ledger,
    ):
        dataset = ledger.create_dataset("d", rule="sequential", epsilon="4", delta="1e-5", accountant="rdp")
        task = ledger.create_task(dataset["id"], "t")
        ledger.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r1", "r2"]}])
        with ledger.release_gate(
            dataset["id"], None, DPSGD, tasks=[task["id"]], model="mlp", version=7
        ) as gate:
            pass
    assert gate.certificate is not None
    return gate.certificate


@pytest.fixture
def tracking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MlflowClient]:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield MlflowClient(uri)
    finally:
        mlflow.set_tracking_uri(previous)


def test_a_release_is_logged_to_the_active_run(
    certificate: dict[str, Any], tracking: MlflowClient, tmp_path: Path
) -> None:
    with mlflow.start_run() as run:
        log_release(certificate)
    logged = tracking.get_run(run.info.run_id).data
    body = certificate["certificate"]
    result = body["result"]
    # The guarantee of a Rényi-filter release is the filter's budget, not its progress (issue 24 §3).
    assert result["guarantee"] == {"epsilon": "4", "delta": "0.00001"}
    assert 0 < float(result["epsilon"]) < 4
    assert logged.metrics["dp_epsilon"] == 4.0 and logged.metrics["dp_delta"] == 1e-5
    # The budget share, as a float never below the exact decimal.
    share = logged.metrics["dp_budget_share_epsilon"]
    assert share == logged.metrics["dp_charge_epsilon"] and Decimal(share) >= Decimal(
        result["charge"]["epsilon"]
    )
    assert share == pytest.approx(float(result["charge"]["epsilon"]), rel=1e-15)
    assert logged.metrics["dp_epsilon_budget"] == 4.0
    assert logged.params == {
        "dp_accountant": "rdp",
        "dp_rule": "sequential",
        "dp_certificate_id": certificate["id"],
        "dp_dataset_id": body["dataset_id"],
        "dp_release": "mlp:7",
    }
    assert logged.tags["dp_theorem"] == body["theorem"]
    statement = logged.tags["dp_statement"]
    assert "(epsilon <= 4, delta <= 0.00001)" in statement and "not a guarantee" in statement
    assert certificate["id"] in statement and "rule sequential" in statement
    assert result["epsilon"] not in statement  # no 17-digit numbers
    # the certificate itself, as the ledger answered it, re-verifies from the artifact
    folder = tracking.download_artifacts(run.info.run_id, "privacy-ledger", str(tmp_path / "download"))
    attached = json.loads((Path(folder) / f"certificate-{certificate['id']}.json").read_text())
    assert attached == certificate
    assert verify(attached["certificate"]).ok


def test_without_an_active_run_nothing_is_logged(certificate: dict[str, Any], tracking: MlflowClient) -> None:
    assert mlflow.active_run() is None
    with pytest.raises(MlflowRunMissing, match=r"mlflow\.start_run"):
        log_release(certificate)
    assert mlflow.active_run() is None
    assert tracking.search_runs([e.experiment_id for e in tracking.search_experiments()]) == []


def test_a_model_trained_outside_is_registered_and_logged_in_one_call(
    database_url: URL, db: Database, tmp_path: Path, tracking: MlflowClient
) -> None:
    key = tenancy.create_api_key(db, "acme", "admin")
    weights = b"state dict bytes" * 8
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, key) as ledger,
    ):
        dataset = ledger.create_dataset("d", rule="sequential", epsilon="4", delta="1e-5", accountant="rdp")
        task = ledger.create_task(dataset["id"], "t")
        ledger.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r1", "r2"]}])
        with mlflow.start_run() as run:
            with ledger.release_gate(
                dataset["id"], None, DPSGD, tasks=[task["id"]], model="mine", version=1
            ) as gate:
                gate.artifact_sha256 = hashlib.sha256(weights).hexdigest()
            version = log_model_version(
                ledger,
                gate.certificate,
                weights,
                architecture="MLP 64-10",
                preprocessing="x / 16",
                metrics={"accuracy": 0.9},
            )
        assert ledger.download_artifact("mine", 1).content == weights
    assert version["origin"] == "external" and version["certificate_id"] == gate.certificate["id"]
    logged = tracking.get_run(run.info.run_id).data
    assert logged.tags["dp_model"] == "mine:1"
    assert logged.tags["dp_model_sha256"] == hashlib.sha256(weights).hexdigest()
    assert logged.params["dp_certificate_id"] == gate.certificate["id"]
    assert logged.metrics["accuracy"] == 0.9 and logged.metrics["dp_epsilon"] == 4.0
    folder = Path(tracking.download_artifacts(run.info.run_id, "privacy-ledger", str(tmp_path / "dl")))
    assert (folder / "mine-v1.pt").read_bytes() == weights
    statement = json.loads((folder / "dp-statement-mine-v1.json").read_text())
    assert statement == version["dp_statement"]
    assert statement["certificate"]["id"] == gate.certificate["id"]
    assert "MLP 64-10" in (folder / "model-card-mine-v1.md").read_text()
