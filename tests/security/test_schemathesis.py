"""schemathesis against the app's own ``/openapi.json`` (every operation, through the ASGI
interface, over a migrated SQLite database with a real admin key), positive and negative data,
with **every** conformance check: no 5xx, every status, content type, header and body as
documented, schema-invalid requests refused, schema-valid ones accepted (except a 422 stating one
of the relations between fields that the OpenAPI document gives in words:
``tests/security/schema_checks.py``), ``Allow`` on 405, auth not ignored. CI size:
``MAX_EXAMPLES`` per operation (≈ 40 operations), and schemathesis' coverage phase (every
boundary case the schema defines) on every operation but three (``COVERAGE_ONCE``, below).

Larger run against a live server, with the same checks::

    python bench/schemathesis_run.py --max-examples 60
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

import tests.security.schema_checks  # noqa: E402, F401  (registers the relation check)
from service.app import create_app  # noqa: E402
from service.db.migrations import upgrade  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import tenancy  # noqa: E402
from service.settings import Settings  # noqa: E402

pytestmark = pytest.mark.slow

# 10, not 15: the event schema now holds dp-accounting's JSON forms too, and generating events
# for every operation that takes one made this test ~5 min of CI; the larger run is the bench.
# (Fewer does not help: 7 examples took 158 s here against 142 s for 10; the time does not
# follow the number of examples.)
MAX_EXAMPLES = 10

# Built at import (schemathesis parametrises from a schema object): a migrated SQLite file.
_FOLDER = Path(tempfile.mkdtemp(prefix="ledger-schemathesis-"))
atexit.register(shutil.rmtree, _FOLDER, ignore_errors=True)
_URL = f"sqlite:///{_FOLDER / 'ledger.db'}"
upgrade(_URL)
_DB = Database(_URL)
atexit.register(_DB.dispose)
_KEY = tenancy.create_api_key(_DB, "acme", "admin")
# The same bearer opens /metrics (its operator token), so its 200 answer is checked too.
_APP = create_app(
    Settings(
        database_url=_URL,
        artifact_dir=_FOLDER / "artifacts",
        max_body_bytes=256 * 1024,
        metrics_token=_KEY,
    ),
    database=_DB,
)
CONFIG = Path(__file__).with_name("schemathesis.toml")

# The privacy-event schema (every event kind and dp-accounting's JSON forms) is one component
# that five operations take. Its coverage phase is thousands of boundary cases per operation
# (7 261 for the quote), generated while pytest collects — in every xdist process — and then
# sent: ~6 min of this 2-core CI machine for the same event boundaries five times over. They
# run here through the two operations that define and spend a budget (creating a dataset with a
# declared plan, reserving); the quote, the commit and plan segments get the examples and
# fuzzing phases on every field. bench/schemathesis_run.py keeps the coverage phase everywhere.
COVERAGE_ONCE = r"/(quote|commit|plan-segments)$"
_CONFIG = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
_CONFIG["operations"] = [{"include-path-regex": COVERAGE_ONCE, "phases": {"coverage": {"enabled": False}}}]
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", _APP, config=schemathesis.config.SchemathesisConfig.from_dict(_CONFIG)
)


# Every registered check but the built-in positive_data_acceptance, which schema_checks replaces.
CHECK_FUNCTIONS = [c for c in CHECKS.get_all() if getattr(c, "__name__", "") != "positive_data_acceptance"]


def _takes_an_event(document: dict[str, Any], node: Any, seen: set[str]) -> bool:
    """Whether the privacy-event component is reachable from ``node`` through ``$ref``s."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            seen.add(ref)
            if ref == "#/components/schemas/Event":
                return True
            if _takes_an_event(document, document["components"]["schemas"][ref.rsplit("/", 1)[1]], seen):
                return True
        return any(_takes_an_event(document, value, seen) for value in node.values())
    if isinstance(node, list):
        return any(_takes_an_event(document, value, seen) for value in node)
    return False


def test_the_event_schema_is_covered_through_a_budget_and_a_spend() -> None:
    # COVERAGE_ONCE leaves out exactly three operations, each taking the event schema, and the
    # two that keep the coverage phase take it too (a renamed route would silently drop it).
    document = schema.raw_schema
    ops = {f"{o.method.upper()} {o.path}": o for o in (r.ok() for r in schema.get_all_operations())}
    phases = {label: schema.config.phases_for(operation=o) for label, o in ops.items()}
    skipped = {label for label, p in phases.items() if not p.coverage.enabled}
    assert skipped == {
        "POST /v1/datasets/{dataset_id}/quote",
        "POST /v1/reservations/{reservation_id}/commit",
        "POST /v1/datasets/{dataset_id}/plan-segments",
    }, skipped
    for label in [*skipped, "POST /v1/datasets", "POST /v1/datasets/{dataset_id}/reservations"]:
        assert _takes_an_event(document, ops[label].definition.raw.get("requestBody"), set()), label
    assert phases["POST /v1/datasets"].coverage.enabled


def test_every_conformance_check_runs() -> None:
    names = {getattr(c, "__name__", "") for c in CHECK_FUNCTIONS}
    assert {
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "positive_data_acceptance_or_relation",
        "ignored_auth",
    } <= names, names


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_responses_conform_to_the_schema(case: Any) -> None:
    # Raises on any failed check; relation refusals are counted (RELATION_REFUSALS) and reported
    # by bench/schemathesis_run.py.
    case.call_and_validate(headers={"Authorization": f"Bearer {_KEY}"}, checks=CHECK_FUNCTIONS)
