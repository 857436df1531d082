"""A release's certificate in the active MLflow run.

::

    import mlflow
    from service.integrations.mlflow import log_release

    with mlflow.start_run():
        with ledger.release_gate(dataset_id, None, event, tasks=tasks, model="mlp", version=3) as gate:
            train()
        log_release(gate.certificate)            # or run.certificate of the Opacus gate

What is logged, all read from the certificate the ledger signed (never recomputed here):

* metrics ``dp_epsilon``, ``dp_delta`` — the release's guarantee (``result.guarantee``, or for
  a certificate before version 3 the same figure derived from it: ``dp_statement.guarantee_of``),
  valid for every release from the batches it read, adaptive stopping included;
  ``dp_budget_share_epsilon``, ``dp_budget_share_delta`` — the budget this release consumed, which
  is not a DP guarantee (``dp_charge_*``: the same numbers under their version-1 name);
  ``dp_epsilon_budget``, ``dp_delta_budget``. Floats are the exact decimals rounded up (a
  ``float`` that reads lower than the certified number would not be a bound);
* params ``dp_accountant``, ``dp_rule``, ``dp_certificate_id``, ``dp_dataset_id``,
  ``dp_release`` (``model:version``);
* tags ``dp_theorem`` (the theorem that justified the charge, written from the budget's
  parameters: ``rules.stated_theorem``) and ``dp_statement`` (one sentence built from those
  fields, its numbers in 4 significant digits rounded toward the safe side);
* the artifact ``privacy-ledger/certificate-<id>.json``: the certificate as the ledger answered
  it (``{id, certificate, signature, ...}``), which ``ledger check`` re-verifies offline.

Only logs to a run that is already active (``MlflowRunMissing`` otherwise): MLflow would start
an unnamed run, and the certificate would sit apart from the training it certifies.

A model you trained yourself, in one call (``log_model_version``)::

    with mlflow.start_run():
        with ledger.release_gate(dataset_id, None, event, tasks=tasks, model="mlp", version=3) as gate:
            weights = train()
            gate.artifact_sha256 = hashlib.sha256(weights).hexdigest()   # the certificate names them
        log_model_version(ledger, gate.certificate, weights, architecture="...", preprocessing="...")

It registers the version with the ledger (``LedgerClient.register_model_version``: the server
hashes the bytes and checks them against the certificate), then logs everything
``log_release`` logs, plus the artifacts ``privacy-ledger/<model>-v<N><ext>`` (the bytes),
``privacy-ledger/dp-statement-<model>-v<N>.json`` (the DP statement the ledger derived from the
certificate) and ``privacy-ledger/model-card-<model>-v<N>.md`` (``ledger model-card``), and the
tags ``dp_model`` (``model:N``), ``dp_model_sha256``, ``dp_model_origin``.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import mlflow

from accountant.exact import shown
from accountant.rules import Budget, stated_theorem
from service.ledger.dp_statement import guarantee_of

if TYPE_CHECKING:
    from service.client import LedgerClient

ARTIFACT_DIR: Final = "privacy-ledger"
_EXTENSIONS: Final = {"torch": ".pt", "safetensors": ".safetensors", "onnx": ".onnx", "bytes": ".bin"}


class MlflowRunMissing(RuntimeError):
    """``log_release`` was called with no active MLflow run."""


def dp_statement(certificate: Mapping[str, Any]) -> str:
    """One sentence from the certificate's fields: what a reader of the run needs first."""
    body = certificate["certificate"]
    result = body["result"]
    release = body["release"]
    eps, dlt = guarantee_of(body)
    share = result["charge"]
    return (
        f"Model {release.get('model')} version {release.get('version')} is released with "
        f"(epsilon <= {shown(eps)}, delta <= {shown(dlt)})-differential privacy on dataset "
        f"{body['dataset_id']}, for every release from the batches it read under rule {body['rule']} "
        f"(budget ({shown(result['budget']['epsilon'])}, {shown(result['budget']['delta'])}); this "
        f"release consumed epsilon {shown(share['epsilon'])} of it, a budget share, not a guarantee); "
        f"accountant {body['accountant']}; privacy-ledger certificate {certificate['id']}."
    )


def upper_float(text: str) -> float:
    """The smallest float at least the exact decimal ``text`` (a bound stays a bound)."""
    value = float(text)
    return math.nextafter(value, math.inf) if Decimal(value) < Decimal(text) else value


def log_release(certificate: Mapping[str, Any]) -> None:
    """Log the committed release's ``certificate`` (``ReleaseGate.certificate``) to the active
    MLflow run (module docstring)."""
    if mlflow.active_run() is None:
        raise MlflowRunMissing(
            "log_release needs an active MLflow run (mlflow.start_run()); nothing was logged."
        )
    body = certificate["certificate"]
    result = body["result"]
    release = body["release"]
    eps, dlt = guarantee_of(body)
    mlflow.log_metrics(
        {
            "dp_epsilon": upper_float(eps),
            "dp_delta": upper_float(dlt),
            "dp_budget_share_epsilon": upper_float(result["charge"]["epsilon"]),
            "dp_budget_share_delta": upper_float(result["charge"]["delta"]),
            "dp_charge_epsilon": upper_float(result["charge"]["epsilon"]),
            "dp_charge_delta": upper_float(result["charge"]["delta"]),
            "dp_epsilon_budget": float(result["budget"]["epsilon"]),
            "dp_delta_budget": float(result["budget"]["delta"]),
        }
    )
    mlflow.log_params(
        {
            "dp_accountant": body["accountant"],
            "dp_rule": body["rule"],
            "dp_certificate_id": certificate["id"],
            "dp_dataset_id": body["dataset_id"],
            "dp_release": f"{release.get('model')}:{release.get('version')}",
        }
    )
    theorem = stated_theorem(Budget.from_json(body["inputs"]["budget"]))
    mlflow.set_tags({"dp_theorem": theorem, "dp_statement": dp_statement(certificate)})
    mlflow.log_dict(dict(certificate), f"{ARTIFACT_DIR}/certificate-{certificate['id']}.json")


def log_model_version(
    ledger: LedgerClient,
    certificate: Mapping[str, Any],
    artifact: bytes,
    *,
    architecture: str,
    preprocessing: str,
    format: str = "torch",
    metrics: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Register ``artifact`` as the version the committed release's ``certificate`` released,
    and log it with its DP statement to the active MLflow run (module docstring); the version as
    the ledger answers it (``GET /v1/models/{name}/versions/{v}``, with ``dp_statement``).

    Checks the run first: without one nothing is registered or logged (``MlflowRunMissing``).
    ``metrics`` are registered with the version (shown as yours) and logged as MLflow metrics."""
    if mlflow.active_run() is None:
        raise MlflowRunMissing(
            "log_model_version needs an active MLflow run (mlflow.start_run()); nothing was registered."
        )
    release = certificate["certificate"]["release"]
    if not isinstance(release, Mapping):
        raise ValueError(
            f"certificate {certificate['id']} released nothing (an abort's): nothing to register."
        )
    name, version = str(release["model"]), int(str(release["version"]))
    ledger.register_model_version(
        name,
        version,
        artifact,
        certificate_id=str(certificate["id"]),
        architecture=architecture,
        preprocessing=preprocessing,
        format=format,
        metrics=metrics,
    )
    registered = ledger.get_model_version(name, version)
    log_release(certificate)
    if metrics:
        mlflow.log_metrics(dict(metrics))
    from service.commands.model_card import render

    stem = f"{name}-v{version}"
    with tempfile.TemporaryDirectory(prefix="privacy-ledger-") as folder:
        path = Path(folder) / f"{stem}{_EXTENSIONS.get(format, '.bin')}"
        path.write_bytes(artifact)
        mlflow.log_artifact(str(path), ARTIFACT_DIR)
    mlflow.log_text(
        json.dumps(registered["dp_statement"], indent=2, sort_keys=True),
        f"{ARTIFACT_DIR}/dp-statement-{stem}.json",
    )
    mlflow.log_text(render(registered), f"{ARTIFACT_DIR}/model-card-{stem}.md")
    mlflow.set_tags(
        {
            "dp_model": f"{name}:{version}",
            "dp_model_sha256": registered["artifact"]["sha256"],
            "dp_model_origin": registered["origin"],
        }
    )
    return dict(registered)
