"""A release's certificate in the active MLflow run.

::

    import mlflow
    from service.integrations.mlflow import log_release

    with mlflow.start_run():
        with ledger.release_gate(dataset_id, None, event, tasks=tasks, model="mlp", version=3) as gate:
            train()
        log_release(gate.certificate)            # or run.certificate of the Opacus gate

What is logged, all read from the certificate the ledger signed (never recomputed here):

* metrics ``dp_epsilon``, ``dp_delta`` — the dataset's (ε, δ) after this release, what the
  certificate certifies (``result``); ``dp_charge_epsilon``, ``dp_charge_delta`` — this
  release's own charge; ``dp_epsilon_budget``, ``dp_delta_budget``;
* params ``dp_accountant``, ``dp_rule``, ``dp_certificate_id``, ``dp_dataset_id``,
  ``dp_release`` (``model:version``);
* tags ``dp_theorem`` (the theorem that justified the charge) and ``dp_statement`` (one sentence
  built from those fields);
* the artifact ``privacy-ledger/certificate-<id>.json``: the certificate as the ledger answered
  it (``{id, certificate, signature, ...}``), which ``ledger check`` re-verifies offline.

Only logs to a run that is already active (``MlflowRunMissing`` otherwise): MLflow would start
an unnamed run, and the certificate would sit apart from the training it certifies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import mlflow

ARTIFACT_DIR: Final = "privacy-ledger"


class MlflowRunMissing(RuntimeError):
    """``log_release`` was called with no active MLflow run."""


def dp_statement(certificate: Mapping[str, Any]) -> str:
    """One sentence from the certificate's fields: what a reader of the run needs first."""
    body = certificate["certificate"]
    result = body["result"]
    release = body["release"]
    return (
        f"Model {release.get('model')} version {release.get('version')} is released with "
        f"({result['epsilon']}, {result['delta']})-differential privacy on dataset "
        f"{body['dataset_id']} (budget ({result['budget']['epsilon']}, {result['budget']['delta']})), "
        f"rule {body['rule']}, accountant {body['accountant']}, {body['theorem']}; "
        f"privacy-ledger certificate {certificate['id']}."
    )


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
    mlflow.log_metrics(
        {
            "dp_epsilon": float(result["epsilon"]),
            "dp_delta": float(result["delta"]),
            "dp_charge_epsilon": float(result["charge"]["epsilon"]),
            "dp_charge_delta": float(result["charge"]["delta"]),
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
    mlflow.set_tags({"dp_theorem": body["theorem"], "dp_statement": dp_statement(certificate)})
    mlflow.log_dict(dict(certificate), f"{ARTIFACT_DIR}/certificate-{certificate['id']}.json")
