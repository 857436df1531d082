"""Add/remove and replace-one charges never compose on one batch (issue 13 §4; DESIGN-NOTES
note 21): over HTTP on both databases, a 409 ``mixed_neighbouring_relations`` naming both."""

from __future__ import annotations

from typing import Any

from accountant.certificates import verify as verify_certificate
from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api

GAUSSIAN = {"kind": "gaussian", "noise_multiplier": 1.0}
POISSON = {"kind": "poisson_sampled", "sampling_probability": 0.01, "event": GAUSSIAN}
WITHOUT_REPLACEMENT = {
    "kind": "sampled_without_replacement",
    "sample_size": 60,
    "population_size": 6000,
    "event": GAUSSIAN,
}
BUDGET: dict[str, Any] = {"rule": "sequential", "epsilon": "20", "delta": "1e-5", "accountant": "rdp"}


def test_mixing_relations_on_a_batch_is_409_and_charges_nothing(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(BUDGET)
    first = trainer.reserve(dataset, batches, POISSON).json()
    trainer.commit(first["id"])
    spent = admin.spend(dataset)["epsilon_spent"]

    refused = trainer.reserve(dataset, batches, WITHOUT_REPLACEMENT, status=409).json()
    assert refused["error"] == "mixed_neighbouring_relations"
    assert "add/remove" in refused["message"] and "sampled_without_replacement" in refused["message"]
    # Same relation and neutral events still compose; nothing was held by the refusal.
    trainer.reserve(dataset, batches, POISSON)
    trainer.reserve(dataset, batches, GAUSSIAN)
    assert admin.spend(dataset)["epsilon_spent"] == spent

    fresh, fresh_batches = admin.dataset(BUDGET)
    mixed = {"kind": "composed", "events": [POISSON, WITHOUT_REPLACEMENT]}
    refused = trainer.reserve(fresh, fresh_batches, mixed, status=409).json()
    assert refused["error"] == "mixed_neighbouring_relations"
    assert "poisson_sampled" in refused["message"] and "sampled_without_replacement" in refused["message"]
    assert admin.spend(fresh)["epsilon_spent"] == "0"


def test_an_l2dp_event_names_its_analysis_in_the_certificate(client: TestClient, keys: Keys) -> None:
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    dataset, batches = admin.dataset(
        {"rule": "lifelong", "epsilon": "100", "delta": "0", "accountant": "basic"}
    )
    event = {
        "kind": "l2dp_ml_functional",
        "epsilon1": 1.0,
        "epsilon2": 1.0,
        "input_dim": 10,
        "hidden_units": 4,
        "output_hidden_units": 4,
        "batch_size": 50,
        "theta1_norm_bound": 1.0,
        "analysis": "sound",
    }
    held = trainer.reserve(dataset, batches, event, noise_commitment="c").json()
    assert held["cost"]["epsilon"] == "10.7500000000000018"  # 1 + 50/6 + 50/120 + 1, rounded up
    certificate = trainer.commit(held["id"]).json()["certificate"]["certificate"]
    assert "analysis 'sound'" in certificate["analyses"][0]
    assert verify_certificate(certificate).ok
    refused = trainer.reserve(dataset, batches, {**event, "analysis": "optimistic"}, status=422).json()
    assert "analysis" in refused["message"]
