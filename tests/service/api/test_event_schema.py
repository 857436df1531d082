"""The event schema is published (issue 14 §6): served at ``/schemas/event.json`` without a key,
identical to ``docs/event.schema.json``, covering every event kind the accountant parses, and
agreeing with the parser on valid and invalid events."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest

from accountant import events as ev
from accountant.dp_accounting_form import SHARED
from tests.service.api.conftest import TestClient

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "event.schema.json"

DPSGD = {
    "kind": "self_composed",
    "count": 1000,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.01,
        "event": {"kind": "gaussian", "noise_multiplier": 1.1},
    },
}

DP_ACCOUNTING_DPSGD = {
    "module_name": "dp_accounting.dp_event",
    "class_name": "SelfComposedDpEvent",
    "count": 1000,
    "event": {
        "class_name": "PoissonSampledDpEvent",
        "sampling_probability": 0.01,
        "event": {"class_name": "GaussianDpEvent", "noise_multiplier": 1.1},
    },
}
L2DP = {
    "kind": "l2dp_ml_functional",
    "epsilon1": 0.4,
    "epsilon2": 2.0,
    "input_dim": 4,
    "hidden_units": 3,
    "output_hidden_units": 3,
    "batch_size": 80,
    "theta1_norm_bound": 2.0,
    "analysis": "sound",
}


def test_served_without_a_key_and_equal_to_the_docs(client: TestClient) -> None:
    answer = client.get("/schemas/event.json")
    assert answer.status_code == 200
    assert answer.json() == json.loads(DOCS.read_text(encoding="utf-8"))


def test_every_kind_the_accountant_parses_is_in_the_schema() -> None:
    schema = json.loads(DOCS.read_text(encoding="utf-8"))
    kinds = {v["properties"]["kind"]["enum"][0] for v in schema["oneOf"] if "kind" in v["properties"]}
    assert kinds == set(ev.EVENT_TYPES)
    # and dp_accounting's form of every class the ledger shares (accountant.dp_accounting_form)
    classes = {
        v["properties"]["class_name"]["enum"][0] for v in schema["oneOf"] if "class_name" in v["properties"]
    }
    assert classes == set(SHARED)


@pytest.mark.parametrize(
    ("event", "valid"),
    [
        (DPSGD, True),
        ({"kind": "pure_dp", "epsilon": 0.5}, True),
        ({"kind": "composed", "events": [DPSGD, {"kind": "laplace", "scale": 2}]}, True),
        # the audit's under-charge: a count one level too high, a field the kind does not have
        ({**DPSGD, "event": {**DPSGD["event"], "count": 1000}}, False),
        ({"kind": "gaussian", "noise_multiplier": 60, "steps": 1000}, False),
        ({"kind": "gaussian"}, False),
        ({"kind": "unknown"}, False),
        (DP_ACCOUNTING_DPSGD, True),
        ({**DP_ACCOUNTING_DPSGD, "steps": 1000}, False),
        ({**DP_ACCOUNTING_DPSGD, "module_name": "os"}, False),
        ({"class_name": "ZCDpEvent", "epsilon": 1.0}, False),
        ({"class_name": "GaussianDpEvent", "kind": "gaussian", "noise_multiplier": 1.0}, False),
        # issue 24 §6: an integral float is an integer in JSON (the parser refused 1e17) ...
        ({"kind": "self_composed", "count": 1e17, "event": {"kind": "pure_dp", "epsilon": 1}}, True),
        ({"kind": "self_composed", "count": 1e19, "event": {"kind": "pure_dp", "epsilon": 1}}, False),
        # ... and an event's numbers are doubles: 10^400 is refused by both
        ({"kind": "pure_dp", "epsilon": 10**400}, False),
        # issue 24 §5: a new L2DP-ML charge must name the sound analysis (note 21)
        (L2DP, True),
        ({**L2DP, "analysis": "paper"}, False),
        ({k: v for k, v in L2DP.items() if k != "analysis"}, False),
    ],
)
def test_the_schema_and_the_parser_agree(event: dict[str, object], valid: bool) -> None:
    validator = jsonschema_rs.validator_for(json.loads(DOCS.read_text(encoding="utf-8")))
    assert validator.is_valid(event) is valid
    try:
        ev.from_json(event, new=True)  # the schema documents what a client may send now
    except ev.EventValidationError:
        parsed = False
    else:
        parsed = True
    assert parsed is valid
