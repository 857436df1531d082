"""Mechanism events: JSON round trip, stable kinds, validation that names field and value."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accountant import events as ev

GAUSSIAN = {"kind": "gaussian", "noise_multiplier": 1.1}


def _dp_sgd(count: int = 14060) -> dict[str, Any]:
    return {
        "kind": "self_composed",
        "count": count,
        "event": {"kind": "poisson_sampled", "sampling_probability": 0.004, "event": GAUSSIAN},
    }


EXAMPLES: list[dict[str, Any]] = [
    {"kind": "no_op"},
    {"kind": "non_private"},
    GAUSSIAN,
    {"kind": "laplace", "scale": 2.0},
    {"kind": "pure_dp", "epsilon": 0.5},
    {"kind": "approx_dp", "epsilon": 1.0, "delta": 1e-6},
    _dp_sgd(),
    {"kind": "sampled_without_replacement", "sample_size": 600, "population_size": 60000, "event": GAUSSIAN},
    {"kind": "composed", "events": [GAUSSIAN, {"kind": "pure_dp", "epsilon": 0.1}]},
    {
        "kind": "l2dp_ml_functional",
        "epsilon1": 0.5,
        "epsilon2": 0.5,
        "input_dim": 64,
        "hidden_units": 32,
        "output_hidden_units": 10,
        "batch_size": 1000,
        "theta1_norm_bound": 1.0,
    },
    {"kind": "output_perturbation", "l2_sensitivity": 0.02, "epsilon": 1.0},
    {
        "kind": "functional_mechanism",
        "noise_multiplier": 4.5,
        "feature_dim": 64,
        "num_classes": 10,
        "feature_bound": 1.0,
    },
    {"kind": "adaptive_gaussian", "noise_multiplier": 1.0},
    {
        "kind": "adaptive_gaussian",
        "noise_multiplier": 1.0,
        "sensitivities": [0.5, 0.5],
        "noise_stddevs": [1.0, 1.0],
    },
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: o["kind"])
def test_json_round_trip_is_identity(obj: dict[str, Any]) -> None:
    event = ev.from_json(obj)
    assert ev.to_json(event) == obj
    assert ev.from_json(json.loads(json.dumps(ev.to_json(event)))) == event


def test_every_kind_has_an_example_and_a_parser() -> None:
    kinds = {e.kind for o in EXAMPLES for e in ev.walk(ev.from_json(o))}
    assert kinds == set(ev.EVENT_TYPES)


def test_kinds_are_stable_strings() -> None:
    # The compatibility contract: these strings are stored in ledger rows and never change.
    assert ev.GaussianEvent.kind == "gaussian"
    assert ev.PoissonSampledEvent.kind == "poisson_sampled"
    assert ev.SampledWithoutReplacementEvent.kind == "sampled_without_replacement"
    assert ev.FunctionalMechanismL2DPEvent.kind == "l2dp_ml_functional"
    assert ev.OutputPerturbationEvent.kind == "output_perturbation"
    assert ev.AdaptiveGaussianEvent.kind == "adaptive_gaussian"


@pytest.mark.parametrize(
    ("obj", "field", "fragment"),
    [
        (
            {"kind": "gaussian", "noise_multiplier": math.nan},
            "event.noise_multiplier",
            "must be finite and > 0. Found nan.",
        ),
        ({"kind": "gaussian", "noise_multiplier": math.inf}, "event.noise_multiplier", "inf"),
        ({"kind": "gaussian", "noise_multiplier": -1}, "event.noise_multiplier", "-1"),
        ({"kind": "gaussian"}, "event.noise_multiplier", "is required"),
        ({"kind": "gaussian", "noise_multiplier": "1"}, "event.noise_multiplier", "number"),
        ({"kind": "gaussian", "noise_multiplier": True}, "event.noise_multiplier", "number"),
        ({"kind": "pure_dp", "epsilon": -0.1}, "event.epsilon", "-0.1"),
        ({"kind": "approx_dp", "epsilon": 1, "delta": 1}, "event.delta", "[0, 1)"),
        (
            {"kind": "poisson_sampled", "sampling_probability": 0, "event": GAUSSIAN},
            "event.sampling_probability",
            "(0, 1]",
        ),
        (
            {"kind": "poisson_sampled", "sampling_probability": 1.5, "event": GAUSSIAN},
            "event.sampling_probability",
            "1.5",
        ),
        (
            {
                "kind": "poisson_sampled",
                "sampling_probability": 0.1,
                "event": {"kind": "gaussian", "noise_multiplier": 0},
            },
            "event.event.noise_multiplier",
            "Found 0",
        ),
        (
            {"kind": "composed", "events": [GAUSSIAN, {"kind": "laplace", "scale": -2}]},
            "event.events[1].scale",
            "-2",
        ),
        (
            {
                "kind": "self_composed",
                "count": 3,
                "event": {
                    "kind": "poisson_sampled",
                    "sampling_probability": 0.1,
                    "event": {"kind": "gaussian", "noise_multiplier": math.inf},
                },
            },
            "event.event.event.noise_multiplier",
            "inf",
        ),
        (
            {
                "kind": "poisson_sampled",
                "sampling_probability": 0.1,
                "event": {"kind": "gaussian", "noise_multiplier": "x"},
            },
            "event.event.noise_multiplier",
            "number",
        ),
        (
            {
                "kind": "composed",
                "events": [{"kind": "self_composed", "count": 2, "event": {"kind": "laplace"}}],
            },
            "event.events[0].event.scale",
            "required",
        ),
        ({"kind": "self_composed", "count": 10**18 + 1, "event": GAUSSIAN}, "event.count", "10^18"),
        ({"kind": "self_composed", "count": 1.5, "event": GAUSSIAN}, "event.count", "integer"),
        (
            {
                "kind": "sampled_without_replacement",
                "sample_size": 7,
                "population_size": 6,
                "event": GAUSSIAN,
            },
            "event.sample_size",
            "population_size",
        ),
        ({"kind": "teleport"}, "event.kind", "'teleport'"),
        (
            {
                "kind": "adaptive_gaussian",
                "noise_multiplier": 1.0,
                "sensitivities": [1.0, 1.0],
                "noise_stddevs": [1.0, 1.0],
            },
            "event.noise_stddevs",
            "Lemma 1",
        ),
        (
            {"kind": "adaptive_gaussian", "noise_multiplier": 1.0, "sensitivities": [1.0]},
            "event.noise_stddevs",
            "together",
        ),
    ],
)
def test_invalid_events_name_the_field_and_value(obj: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(ev.EventValidationError) as info:
        ev.from_json(obj)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_nesting_depth_is_bounded() -> None:
    obj: dict[str, Any] = GAUSSIAN
    for _ in range(ev.MAX_NESTING_DEPTH + 5):
        obj = {"kind": "self_composed", "count": 2, "event": obj}
    with pytest.raises(ev.EventValidationError, match="nests deeper"):
        ev.from_json(obj)


def test_events_are_immutable_and_validated_when_built() -> None:
    event = ev.GaussianEvent(1.0)
    with pytest.raises(AttributeError):
        event.noise_multiplier = 2.0  # type: ignore[misc]
    with pytest.raises(ev.EventValidationError, match=r"event.noise_multiplier"):
        ev.GaussianEvent(float("nan"))


def test_output_perturbation_noise_scale_is_sensitivity_over_epsilon() -> None:
    event = ev.OutputPerturbationEvent(l2_sensitivity=0.5, epsilon=2.0)
    assert event.noise_scale == 0.25


@given(
    sigma=st.floats(min_value=1e-6, max_value=1e6),
    q=st.floats(min_value=1e-12, max_value=1.0),
    count=st.integers(min_value=0, max_value=10**18),
)
def test_round_trip_property(sigma: float, q: float, count: int) -> None:
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), count)
    assert ev.from_json(json.loads(json.dumps(ev.to_json(event)))) == event


def test_walk_lists_every_nested_event() -> None:
    event = ev.from_json(_dp_sgd())
    assert [e.kind for e in ev.walk(event)] == ["self_composed", "poisson_sampled", "gaussian"]


def _nodes(obj: dict[str, Any], path: str = "event") -> list[tuple[dict[str, Any], str]]:
    """Every event object inside ``obj`` with its path (``event.events[1].event``)."""
    out = [(obj, path)]
    if isinstance(obj.get("event"), dict):
        out += _nodes(obj["event"], f"{path}.event")
    for i, child in enumerate(obj.get("events", [])):
        out += _nodes(child, f"{path}.events[{i}]")
    return out


@given(
    example=st.sampled_from(
        [
            *EXAMPLES,
            {
                "kind": "composed",
                "events": [_dp_sgd(3), {"kind": "self_composed", "count": 2, "event": GAUSSIAN}],
            },
        ]
    ),
    pick=st.integers(min_value=0),
    name=st.sampled_from(["count", "steps", "epoch", "noise_multiplier", "events", "event", "x"]),
)
def test_an_unknown_field_at_any_depth_is_refused_naming_its_path(
    example: dict[str, Any], pick: int, name: str
) -> None:
    """A field the ledger ignored could change what ran (``count`` one level too high inside
    ``poisson_sampled``: a thousand steps charged as one): any key that is not a field of its
    node's kind is refused with the node's path and the key."""
    obj = json.loads(json.dumps(example))
    nodes = _nodes(obj)
    node, path = nodes[pick % len(nodes)]
    fields = {f for f in ev.EVENT_TYPES[node["kind"]].__dataclass_fields__}
    if name in fields:
        return  # a field of this kind: not unknown here
    node[name] = 1000
    with pytest.raises(ev.EventValidationError) as refused:
        ev.from_json(obj)
    assert refused.value.field == f"{path}.{name}"
    assert "refused, not ignored" in str(refused.value)


def test_the_reviews_two_events_are_refused() -> None:
    misplaced = {"kind": "poisson_sampled", "sampling_probability": 0.01, "count": 1000, "event": GAUSSIAN}
    with pytest.raises(ev.EventValidationError) as refused:
        ev.from_json(misplaced)
    assert refused.value.field == "event.count"
    with pytest.raises(ev.EventValidationError) as refused:
        ev.from_json({"kind": "gaussian", "noise_multiplier": 60, "steps": 1000})
    assert refused.value.field == "event.steps"
