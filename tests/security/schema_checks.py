"""schemathesis conformance checks used by tests/security/test_schemathesis.py and
``bench/schemathesis_run.py`` (loaded there with ``SCHEMATHESIS_HOOKS=tests.security.schema_checks``).

Every built-in check runs unchanged except ``positive_data_acceptance`` ("a schema-valid request
must not be refused"), which is replaced by ``positive_data_acceptance_or_relation``: the same
check, except that a 422 whose message states one of the *documented relations between fields*
(``RELATIONS``: what JSON Schema cannot express; service/api/openapi.py lists them in the
OpenAPI document) is counted instead of failed. Any other refusal of a schema-valid request
still fails.
"""

from __future__ import annotations

import atexit
import json
import os
import re
from collections import Counter
from typing import Any, Final

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# Each is a 422 message of a rule the OpenAPI document states in words (service/api/openapi.py).
RELATIONS: Final[dict[str, re.Pattern[str]]] = {
    "sample_size <= population_size": re.compile(r"sample_size must be <= population_size"),
    "geometric series <= epsilon": re.compile(
        r"budget\.geometric\.(first|single) must (satisfy|be 0 or >= first|be in \[0, epsilon\])"
    ),
    # a dataset's declared plan (budget.plan) or a later plan segment (plan)
    "plan epsilon <= budget epsilon": re.compile(r"^(budget\.)?plan needs epsilon .* more than budget"),
    "plan segment delta <= what the budget's delta has left": re.compile(
        r"^delta must be in \(0, [0-9.eE+-]+\]: the budget's delta "
    ),
    "rdp filter has an order with allowance": re.compile(r"is too small for a Rényi filter"),
    "event the accountant supports": re.compile(r"accountant '\w+' does not support event kind"),
    "output perturbation noise scale is finite": re.compile(
        r"must give a finite noise scale l2_sensitivity/epsilon"
    ),
    "data source under the tenant's data roots": re.compile(
        r"^data_source is refused: data source .* must name a regular file under a data root"
    ),
    "pricing work within the server's limit": re.compile(r"costs too much to (price|verify)"),
    "plan_delta <= budget delta": re.compile(r"^budget\.plan_delta must be in \(0, budget\.delta = "),
    # an external model version's metrics (a JSON text in the query) and artifact (the body)
    "metrics is a JSON object of finite numbers": re.compile(r"^metrics(\.\S+)? (must|names)"),
    "artifact is not empty": re.compile(r"^artifact is empty"),
}
RELATION_REFUSALS: Counter[str] = Counter()


def documented_relation(status: int, body: bytes | str | None) -> str | None:
    """The name of the documented relation a 422 answer states, or ``None``."""
    if status != 422 or not body:
        return None
    try:
        answer: Any = json.loads(body)
    except ValueError:
        return None
    message = answer.get("message", "") if isinstance(answer, dict) else ""
    for name, pattern in RELATIONS.items():
        if isinstance(message, str) and pattern.search(message):
            return name
    return None


def _report() -> None:
    print(
        f"positive_data_acceptance_or_relation: refusals stating a documented relation: "
        f"{sum(RELATION_REFUSALS.values())} {dict(RELATION_REFUSALS)}",
        flush=True,
    )


if os.environ.get("SCHEMATHESIS_HOOKS") == __name__:  # loaded by the schemathesis CLI
    atexit.register(_report)


@schemathesis.check
def positive_data_acceptance_or_relation(ctx: Any, response: Any, case: Any) -> bool | None:
    """``positive_data_acceptance``, except a 422 stating a documented relation (counted)."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except AssertionError:
        relation = documented_relation(response.status_code, response.content)
        if relation is None:
            raise
        RELATION_REFUSALS[relation] += 1
        return None
