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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

import mlflow

from accountant.exact import shown
from accountant.rules import Budget, stated_theorem
from service.ledger.dp_statement import guarantee_of

ARTIFACT_DIR: Final = "privacy-ledger"


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
