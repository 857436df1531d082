"""The OpenAPI document says exactly what the service answers and accepts.

Every response a route can give is documented with its body schema, and every limit the service
enforces is in the request schemas, so that a client (or schemathesis with all its conformance
checks) can rely on the document:

* **Answers every route may give** (added to each ``/v1`` operation by ``install``): 401 (no or a
  bad key), 403 (scope), 404 (unknown id or another tenant's), 409 on mutations (a conflict with the
  ledger's state: an ``Idempotency-Key`` reused with another request, a closed reservation, ...),
  413 (body over ``LEDGER_MAX_BODY_BYTES``, on routes with a body), 422 (invalid input, ``field``
  names it) and 503 (the database is unavailable; ``Retry-After``), each an ``ErrorBody``.
  ``/healthz`` documents its 503; ``/metrics`` answers Prometheus text, not JSON.
* **Request limits**: the JSON schemas of numbers a user writes (``NUMBER_SCHEMAS``: a JSON
  number, or a decimal string matching ``DECIMAL_PATTERN``, with the field's range), of ids, and
  of events (``EVENT_SCHEMA``: the ``kind`` enum and each kind's fields with their ranges, as
  ``accountant.events`` validates them) are declared next to the validators that enforce them
  (``service.api.schemas``).

What JSON Schema cannot say is written in the schema's description and left to the 422 that
names the field: relations between fields (a geometric series' ``single + copies·first/(1 −
ratio) ≤ epsilon``, ``sample_size ≤ population_size``, an output perturbation's noise scale
``l2_sensitivity/epsilon`` finite and > 0, AdaDp's Lemma 1 over its vectors, whose vectors the
schema therefore leaves out), the pricing work of an event under the dataset's budget (event
nodes × orders, at most ``LEDGER_MAX_PRICING_WORK``), a ``prv`` plan costing more than the budget, an ``rdp``
epsilon too small for its order grid at its delta, an event the accountant does not support, and
a job's ``data_source`` grammar beyond its common shape, and whether a dataset's ``file://``
data source lies under the tenant's data roots as a regular file within the size limit (the
operator's configuration and the host's state). Where the service took more than the
schema can state, the service was narrowed to the schema (decimal strings, integer versions within
±10¹⁸, δ ≥ 1e-300 for ``rdp``/``prv``, printable-ASCII ``noise_commitment`` and
``Idempotency-Key``), so that a schema-valid request is accepted and a schema-invalid one refused.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any, Final

from fastapi import FastAPI

from accountant.events import MAX_COMPOSED_EVENTS, MAX_COUNT, MAX_VECTOR_LENGTH

# A decimal written as a string: optional sign, digits with an optional point, an optional
# exponent of at most 4 digits (|exponent| ≤ 9999 keeps every sum and comparison of the exact
# decimal arithmetic inside Decimal's default context).
DECIMAL_PATTERN: Final = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,4})?$"
DECIMAL_RE: Final = re.compile(DECIMAL_PATTERN)
# ... and > 0: some non-zero digit before the exponent.
_POSITIVE_PATTERN: Final = r"^\+?(0*[1-9][0-9]*(\.[0-9]*)?|0*\.[0-9]*[1-9][0-9]*)([eE][+-]?[0-9]{1,4})?$"
# ... and in (0, 1): zero integer part (a string such as "5e-1" is accepted by the service but
# not documented; the schema is never wider than what the service takes).
_UNIT_OPEN_PATTERN: Final = r"^\+?0*\.[0-9]*[1-9][0-9]*$"
# ... and in [0, 1).
_UNIT_HALF_OPEN_PATTERN: Final = r"^\+?(0+(\.[0-9]*)?|0*\.[0-9]+)$"


def _number_or_string(number: dict[str, Any], pattern: str, description: str) -> dict[str, Any]:
    return {
        "anyOf": [{"type": "number", **number}, {"type": "string", "pattern": pattern}],
        "description": description,
    }


NUMBER_SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "positive": _number_or_string(
        {"exclusiveMinimum": 0},
        _POSITIVE_PATTERN,
        "A finite number > 0, as a JSON number or a decimal string (taken as written).",
    ),
    "unit_open": _number_or_string(
        {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        _UNIT_OPEN_PATTERN,
        "A number in (0, 1), as a JSON number or a decimal string (taken as written).",
    ),
    "delta": _number_or_string(
        {"minimum": 0, "exclusiveMaximum": 1},
        _UNIT_HALF_OPEN_PATTERN,
        "A number in [0, 1), as a JSON number or a decimal string (taken as written).",
    ),
    # a plan segment's share of delta: > 0 (the ledger refuses 0: a segment priced at delta 0)
    "positive_delta": _number_or_string(
        {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        _UNIT_OPEN_PATTERN,
        "A number in (0, 1), as a JSON number or a decimal string (taken as written).",
    ),
}


# Names, models and versions: no C0 control character or DEL anywhere (PostgreSQL refuses NUL;
# the others would forge lines in logs and exports: service.ledger.datasets.check_text), and one
# character at least that str.isspace() does not call whitespace (spelled out for every regex
# engine).
_NO_CONTROL: Final = "[^\x00-\x1f\x7f]*"
TEXT_PATTERN: Final = (
    "^"
    + _NO_CONTROL
    + "[^\x00-\x20\x7f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
    + _NO_CONTROL
    + "$"
)
# Versions: at most 100 characters; an integer version is within ±10^18 (a bound every JSON
# Schema tool reads exactly: 10^18 is a float64 too).
VERSION_INTEGER_LIMIT: Final = 10**18
VERSION_SCHEMA: Final[dict[str, Any]] = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": 100, "pattern": TEXT_PATTERN},
        {"type": "integer", "minimum": -VERSION_INTEGER_LIMIT, "maximum": VERSION_INTEGER_LIMIT},
    ],
    "description": "a version: 1-100 characters, not all whitespace, no control character, or an integer",
}
# rdp and prv budgets split δ over an order grid (up to 1000 orders) in float64: a δ below this
# would underflow to 0 there.
MIN_RDP_DELTA: Final = 1e-300
# A dataset's data source (service.contract.data_sources): the built-ins' common shapes, or an absolute
# file:/// path of a .npz/.csv. Whether a file lies under the tenant's data roots, exists and is a
# regular file within LEDGER_MAX_SOURCE_BYTES is the operator's configuration and the host's
# state, which no schema can state: such a refusal is a 422 naming `data_source`.
DATA_SOURCE_PATTERN: Final = (
    r"^(builtin:digits"
    r"|builtin:split-digits\?tasks=([1-9]|10)(&seed=[0-9]{1,9})?"
    r"|builtin:permuted-digits\?tasks=[1-9][0-9]{0,2}(&seed=[0-9]{1,9})?"
    r"|builtin:(permuted|split)-synthetic-digits\?tasks=([1-9]|10)&per_task=[1-9][0-9]{0,4}(&seed=[0-9]{1,9})?"
    r"|builtin:stream(\?blocks=[1-9][0-9]{0,2}&block_size=[1-9][0-9]{0,2})?"
    # directories: no empty, "." or ".." component (service.contract.data_sources refuses them)
    r"|file:///(?:(?:[^?#%\[\]/.\x00-\x1f\x7f][^?#%\[\]/\x00-\x1f\x7f]*"
    r"|\.[^?#%\[\]/.\x00-\x1f\x7f][^?#%\[\]/\x00-\x1f\x7f]*|\.\.[^?#%\[\]/\x00-\x1f\x7f]+)/)*"
    r"[^?#%\[\]/.\x00-\x1f\x7f][^?#%\[\]/\x00-\x1f\x7f]*\.(npz|csv))$"
)
DATA_SOURCE_SCHEMA: Final[dict[str, Any]] = {
    "anyOf": [{"type": "string", "maxLength": 2000, "pattern": DATA_SOURCE_PATTERN}, {"type": "null"}],
    "description": "the URI the worker reads the dataset's records from: `builtin:digits`, "
    "`builtin:split-digits?tasks=5`, ... or `file:///absolute/path.npz|.csv` under a data root the "
    "operator configured for the tenant (`LEDGER_DATA_ROOTS`); `null`: none (no job can run)",
}


def text_or_integer_schema(max_length: int, what: str) -> dict[str, Any]:
    """An id a client may send as a string of 1-``max_length`` characters or an integer."""
    return {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": max_length},
            {"type": "integer"},
        ],
        "description": f"{what}: a string of 1-{max_length} characters or an integer",
    }


# ---- events (accountant.events: the parser's kinds, fields and ranges) ---------------------------

# An event's numbers are floats: a JSON integer beyond the largest double (10^400) is refused.
_FLOAT_MAX: Final = sys.float_info.max
_POSITIVE: Final = {"type": "number", "exclusiveMinimum": 0, "maximum": _FLOAT_MAX}
_NON_NEGATIVE: Final = {"type": "number", "minimum": 0, "maximum": _FLOAT_MAX}
_PROBABILITY: Final = {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
_DELTA: Final = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
_REF: Final = {"$ref": "#/components/schemas/Event"}


def _count(minimum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": MAX_COUNT}


def _kind(
    kind: str, fields: dict[str, Any] | None = None, *, optional: dict[str, Any] | None = None
) -> dict[str, Any]:
    fields = fields or {}
    return {
        "type": "object",
        "title": kind,
        "properties": {"kind": {"type": "string", "enum": [kind]}, **fields, **(optional or {})},
        "required": ["kind", *fields],
        # accountant.events refuses any other key, at any depth (a field it ignored could
        # change what ran: a `count` one level too high)
        "additionalProperties": False,
    }


def _dp_accounting(class_name: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """dp_accounting's form of a shared event (``accountant.dp_accounting_form``)."""
    fields = fields or {}
    return {
        "type": "object",
        "title": class_name,
        "properties": {
            "class_name": {"type": "string", "enum": [class_name]},
            "module_name": {"type": "string", "enum": ["dp_accounting.dp_event"]},
            **fields,
        },
        "required": ["class_name", *fields],
        "additionalProperties": False,
    }


_NULL_ONLY: Final = {
    "type": "null",
    "description": f"or a list of at most {MAX_VECTOR_LENGTH} numbers > 0 (both lists of equal "
    "length, given together, with sum of s_i^2/sigma_i^2 <= 1/noise_multiplier^2)",
}

EVENT_SCHEMA: Final[dict[str, Any]] = {
    "title": "Event",
    "description": "A mechanism event: a stable `kind` and its parameters (docs/event.schema.json), or "
    "dp_accounting's form of a shared event (its `DpEvent.to_named_tuple()` as JSON: `class_name`, "
    "optional `module_name`, the fields). Nesting "
    "depth at most 32. Relations between fields are checked by the service (422): "
    "`sample_size <= population_size`; for `adaptive_gaussian` with vectors, equal lengths and "
    "AdaDp's Lemma 1 (sum of s_i^2/sigma_i^2 <= 1/noise_multiplier^2); for `output_perturbation`, "
    "a finite noise scale `l2_sensitivity/epsilon` > 0. Unknown fields are refused at any depth "
    "(422 naming their path). Pricing the event under the dataset's budget may cost at most "
    "`LEDGER_MAX_PRICING_WORK` units (event nodes x the budget's orders; 422 naming `event`).",
    "oneOf": [
        _kind("no_op"),
        _kind("non_private"),
        _kind("gaussian", {"noise_multiplier": _POSITIVE}),
        _kind("laplace", {"scale": _POSITIVE}),
        _kind("pure_dp", {"epsilon": _NON_NEGATIVE}),
        _kind("approx_dp", {"epsilon": _NON_NEGATIVE, "delta": _DELTA}),
        _kind("poisson_sampled", {"sampling_probability": _PROBABILITY, "event": _REF}),
        _kind(
            "sampled_without_replacement",
            {"sample_size": _count(1), "population_size": _count(1), "event": _REF},
        ),
        _kind("self_composed", {"event": _REF, "count": _count(0)}),
        _kind("composed", {"events": {"type": "array", "items": _REF, "maxItems": MAX_COMPOSED_EVENTS}}),
        _kind(
            "l2dp_ml_functional",
            {
                "epsilon1": _POSITIVE,
                "epsilon2": _POSITIVE,
                "input_dim": _count(1),
                "hidden_units": _count(1),
                "output_hidden_units": _count(1),
                "batch_size": _count(1),
                "theta1_norm_bound": _POSITIVE,
                "analysis": {
                    "type": "string",
                    "enum": ["sound"],
                    "description": "which analysis of L2DP-ML Thm. 2 is charged (DESIGN-NOTES "
                    "note 21): 'sound' = independent input noise per record, input term "
                    "d*eps1/gamma_x. Required for a new charge: 'paper' (one shared input-noise "
                    "vector, Thm. 2 as printed) and an absent field (which means 'paper' in events "
                    "stored before) are refused, 422 naming `analysis`: not a valid bound.",
                },
            },
        ),
        _kind("output_perturbation", {"l2_sensitivity": _POSITIVE, "epsilon": _POSITIVE}),
        _kind(
            "functional_mechanism",
            {
                "noise_multiplier": _POSITIVE,
                "feature_dim": _count(1),
                "num_classes": _count(2),
                "feature_bound": _POSITIVE,
            },
        ),
        # The optional per-coordinate vectors (equal lengths, given together, Lemma 1) are
        # described, not generated: JSON Schema cannot state Lemma 1.
        _kind(
            "adaptive_gaussian",
            {"noise_multiplier": _POSITIVE},
            optional={"sensitivities": _NULL_ONLY, "noise_stddevs": _NULL_ONLY},
        ),
        # dp_accounting's DpEvent.to_named_tuple() as JSON, for the classes the ledger shares
        _dp_accounting("NoOpDpEvent"),
        _dp_accounting("NonPrivateDpEvent"),
        _dp_accounting("GaussianDpEvent", {"noise_multiplier": _POSITIVE}),
        _dp_accounting("LaplaceDpEvent", {"noise_multiplier": _POSITIVE}),
        _dp_accounting("PoissonSampledDpEvent", {"sampling_probability": _PROBABILITY, "event": _REF}),
        _dp_accounting(
            "SampledWithoutReplacementDpEvent",
            {"source_dataset_size": _count(1), "sample_size": _count(1), "event": _REF},
        ),
        _dp_accounting("SelfComposedDpEvent", {"event": _REF, "count": _count(0)}),
        _dp_accounting(
            "ComposedDpEvent", {"events": {"type": "array", "items": _REF, "maxItems": MAX_COMPOSED_EVENTS}}
        ),
    ],
}


EVENT_SCHEMA_PATH: Final = "/schemas/event.json"


def event_json_schema() -> dict[str, Any]:
    """``EVENT_SCHEMA`` as a standalone JSON Schema (draft 2020-12; nested events refer to the
    root), served at ``EVENT_SCHEMA_PATH`` and kept in ``docs/event.schema.json``."""

    def rooted(node: Any) -> Any:
        if node == _REF:
            return {"$ref": "#"}
        if isinstance(node, dict):
            return {k: rooted(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rooted(v) for v in node]
        return node

    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://privacy-ledger.invalid/schemas/event.json",
        **rooted(EVENT_SCHEMA),
    }


# ---- answers ------------------------------------------------------------------------------------

_ERROR_REF: Final = {"$ref": "#/components/schemas/ErrorBody"}
_COMMON: Final[dict[str, str]] = {
    "401": "missing, unknown or revoked API key",
    "403": "the key's scope does not allow this call",
    "404": "unknown id, or another tenant's",
    "422": "invalid input; `field` names it",
    "503": "the database is unavailable (the request changed nothing; retry after `Retry-After` "
    "seconds, with the same `Idempotency-Key` where it mutates)",
}
_MUTATION: Final[dict[str, str]] = {
    "409": "conflicts with the ledger's state (an `Idempotency-Key` reused with another request, "
    "an object in a state that does not allow the call, charges of two neighbouring relations "
    "on one batch (`mixed_neighbouring_relations`), ...)",
}
_BODY: Final[dict[str, str]] = {
    "413": "the body is larger than the server's LEDGER_MAX_BODY_BYTES",
}


def _error_answer(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _document(schema: dict[str, Any]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Event"] = EVENT_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            answers = operation.setdefault("responses", {})
            if path == "/healthz":
                answers.setdefault(
                    "503",
                    {
                        "description": "the database check failed",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "status": {"type": "string"},
                                        "database": {"type": "string"},
                                    },
                                }
                            }
                        },
                    },
                )
                continue
            if not path.startswith("/v1/"):
                continue
            extra = dict(_COMMON)
            if method in ("post", "put", "patch", "delete"):
                extra.update(_MUTATION)
            if "requestBody" in operation:
                extra.update(_BODY)
            for status, description in extra.items():
                answers.setdefault(status, _error_answer(description))
    return schema


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once, then cached)."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = [
    "DECIMAL_PATTERN",
    "DECIMAL_RE",
    "EVENT_SCHEMA",
    "NUMBER_SCHEMAS",
    "install",
    "text_or_integer_schema",
]


# ---- budgets: which fields go with which rule and accountant (accountant.rules.Budget.create) ---

_POSITIVE_DELTA: Final = _number_or_string(
    {"minimum": MIN_RDP_DELTA, "exclusiveMaximum": 1},
    r"^\+?0*\.0{0,299}[1-9][0-9]*$",
    "A number in [1e-300, 1), as a JSON number or a decimal string (taken as written): rdp and "
    "prv split delta over their order grid in floating point.",
)
_NULL: Final = {"type": "null"}


def _when(
    condition: dict[str, Any],
    then: dict[str, Any],
    otherwise: dict[str, Any] | None = None,
    *,
    required: list[str],
) -> dict[str, Any]:
    rule: dict[str, Any] = {"if": {"properties": condition, "required": required}, "then": then}
    if otherwise is not None:
        rule["else"] = otherwise
    return rule


def budget_schema_extra(schema: dict[str, Any]) -> None:
    """Complete ``BudgetCreate``'s schema with the rules that tie its fields together."""
    from accountant.rdp import MAX_ORDER
    from accountant.rdp_filter import MAX_ORDERS
    from accountant.rules import ACCOUNTANTS, MAX_PLAN_EVENTS, SUPPORTED

    properties = schema.setdefault("properties", {})
    properties["orders"] = {
        "anyOf": [
            {
                "type": "array",
                "items": {"type": "number", "exclusiveMinimum": 1, "maximum": MAX_ORDER},
                "minItems": 1,
                "maxItems": MAX_ORDERS,
                "uniqueItems": True,
            },
            _NULL,
        ],
        "description": (
            "RDP orders of the Rényi filter (`rdp` only), distinct, each in (1, 2^20]; fixed at creation."
        ),
    }
    relations: list[dict[str, Any]] = []
    for rule, accountants in SUPPORTED.items():
        if set(accountants) != set(ACCOUNTANTS):
            relations.append(
                _when(
                    {"rule": {"const": rule}},
                    {"properties": {"accountant": {"enum": list(accountants)}}},
                    required=["rule"],
                )
            )
    relations += [
        # rdp and prv bound (ε, δ)-DP with δ > 0 (the default δ is 0)
        _when(
            {"accountant": {"enum": ["rdp", "prv"]}},
            {"required": ["delta"], "properties": {"delta": _POSITIVE_DELTA}},
            required=["accountant"],
        ),
        _when(
            {"accountant": {"const": "rdp"}}, {}, {"properties": {"orders": _NULL}}, required=["accountant"]
        ),
        _when({"rule": {"const": "geometric"}}, {}, {"properties": {"geometric": _NULL}}, required=["rule"]),
        _when(
            {"rule": {"const": "sequential"}, "accountant": {"const": "prv"}},
            {
                "required": ["plan"],
                "properties": {"plan": {"type": "array", "minItems": 1, "maxItems": MAX_PLAN_EVENTS}},
            },
            {"properties": {"plan": _NULL, "plan_delta": _NULL}},
            required=["rule", "accountant"],
        ),
    ]
    schema["allOf"] = relations
    schema["description"] = (
        "A privacy budget. Checked by the service beyond this schema (422 naming the field): "
        "a geometric series must satisfy single + copies*first/(1 - ratio) <= epsilon with "
        "single in [0, epsilon] and single 0 or >= first, a prv "
        "plan must fit the budget (its PRV epsilon <= epsilon) and its plan_delta the budget's "
        "delta, and an rdp budget's epsilon "
        "must leave a positive allowance at some order of its grid at its delta, and every "
        "plan event must be one the accountant supports (sampling amplifies Gaussian noise "
        "only)."
    )


def _target_ids(schema: dict[str, Any]) -> None:
    """``batches`` / ``tasks``: distinct id strings, at most ``MAX_IDS_PER_REQUEST``."""
    from service.ledger.spending.requests import MAX_IDS_PER_REQUEST

    properties = schema.setdefault("properties", {})
    for name in ("batches", "tasks"):
        variants = properties.get(name, {}).get("anyOf", [])
        for variant in variants:
            if variant.get("type") == "array":
                # documented as strings (the contract's ids); an integer is also taken, as its
                # decimal string, so [1, "1"] would be a repeat JSON Schema cannot see
                variant["items"] = {"type": "string", "minLength": 1, "maxLength": 64}
                variant["uniqueItems"] = True
                variant["maxItems"] = MAX_IDS_PER_REQUEST


def reservation_schema_extra(schema: dict[str, Any]) -> None:
    """``ReservationCreate``: ``batches`` xor ``tasks`` (``_target_ids``)."""
    _target_ids(schema)
    schema["anyOf"] = [
        {"required": ["batches"], "properties": {"batches": {"type": "array"}, "tasks": _NULL}},
        {"required": ["tasks"], "properties": {"tasks": {"type": "array"}, "batches": _NULL}},
    ]


def quote_schema_extra(schema: dict[str, Any]) -> None:
    """``QuoteCreate``: exactly one of ``batches``, ``tasks`` and ``new_batch: true``."""
    _target_ids(schema)
    others = {"batches": _NULL, "tasks": _NULL, "new_batch": _NULL}
    schema["oneOf"] = [
        {"required": [name], "properties": {**others, name: shape}}
        for name, shape in (
            ("batches", {"type": "array"}),
            ("tasks", {"type": "array"}),
            ("new_batch", {"const": True}),
        )
    ]
