"""A budget created without naming an accountant is ``tight`` (issue 25 §3), over real HTTP on both
databases and through ``LedgerClient``; a budget that names ``rdp`` keeps it, and the certificates
of both re-verify offline."""

from __future__ import annotations

from typing import Any

import dp_accounting
from dp_accounting.pld import PLDAccountant

from accountant.certificates import verify as verify_certificate
from service.client import LedgerClient
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api

# The Opacus run: builtin:digits at expected batch 64 (q = 1/23), 5 epochs (115 steps),
# σ = 2.03125 (Opacus's PRV calibration to ε = 1 at δ = 1e-5).
OPACUS_RUN = {
    "kind": "self_composed",
    "count": 115,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 1 / 23,
        "event": {"kind": "gaussian", "noise_multiplier": 2.03125},
    },
}


def _pld_epsilon() -> float:
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(1 / 23, dp_accounting.GaussianDpEvent(2.03125)), 115
        )
    )
    return float(accountant.get_epsilon(1e-5))


def _certificate(api: Api, reservation: str) -> dict[str, Any]:
    certificate: dict[str, Any] = api.commit(reservation).json()["certificate"]["certificate"]
    return certificate


def test_the_default_budget_admits_a_run_calibrated_to_it(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset({"rule": "sequential", "epsilon": "1", "delta": "1e-5"})
    assert admin.call("GET", f"/v1/datasets/{dataset}", status=200).json()["budget"]["accountant"] == "tight"
    held = trainer.reserve(dataset, batches, OPACUS_RUN).json()
    charged = float(held["cost"]["epsilon"])
    assert _pld_epsilon() <= charged <= 1.03 * _pld_epsilon() and charged <= 1
    certificate = _certificate(trainer, held["id"])
    assert certificate["inputs"]["budget"]["accountant"] == "tight"
    assert verify_certificate(certificate).ok
    # Asked for, the Rényi filter alone is what it was: it refuses the same run (409), and its
    # certificates re-verify as before.
    rdp, rdp_batches = admin.dataset(
        {"rule": "sequential", "epsilon": "1", "delta": "1e-5", "accountant": "rdp"}
    )
    assert trainer.reserve(rdp, rdp_batches, OPACUS_RUN, status=409).json()["error"] == "budget_exceeded"
    small = dict(OPACUS_RUN, count=40)
    held_rdp = trainer.reserve(rdp, rdp_batches, small).json()
    certificate = _certificate(trainer, held_rdp["id"])
    assert certificate["inputs"]["budget"]["accountant"] == "rdp" and verify_certificate(certificate).ok


def test_the_client_creates_tight_budgets_unless_told_otherwise(client: TestClient, keys: Keys) -> None:
    with LedgerClient(str(client.base_url), keys.get("acme", "admin"), transport=client._transport) as ledger:
        default = ledger.create_dataset("default", rule="parallel", epsilon="1", delta="1e-5")
        basic = ledger.create_dataset("basic", rule="sequential", epsilon="1", delta="0", accountant="basic")
    assert default["budget"]["accountant"] == "tight" and basic["budget"]["accountant"] == "basic"
