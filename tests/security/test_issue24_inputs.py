"""Issue 24 §5–6 (an outside red team, on main): inputs, sources and lists, each proved fixed over
real HTTP through the ASGI app on SQLite and PostgreSQL (the ``client`` / ``keys`` fixtures of
tests/service/api/conftest.py), real files and a real ``ledger check``.

1. ``l2dp_ml_functional`` without ``analysis: "sound"`` is refused as a new charge (422 naming
   ``…analysis``) wherever events are accepted; a stored "paper" charge no longer verifies
   (``valid_bound`` false) and ``ledger check`` fails naming its certificate.
   ``test_paper_l2dp_events_are_refused_where_events_are_accepted``,
   ``test_a_stored_paper_charge_is_not_a_valid_bound``.
2. A hard link into a tenant's data root: tests/security/test_data_source_escape.py (escapes and
   swaps "hard link …").
3. The worker reserves by tasks: tests/worker/test_gate.py
   ``test_a_dataset_of_more_than_10000_batches_is_reserved_by_task``.
4. ``file:`` URIs are stored in one form: tests/security/test_data_source_escape.py
   ``test_one_file_is_stored_as_one_source``; the migration of stored rows:
   tests/migrations/test_migrations.py ``test_stored_file_sources_are_canonicalised``.
5. Lists are paged or bounded. ``test_task_batches_are_paged``,
   ``test_tasks_are_paged_and_bounded``, ``test_every_list_route_is_paged_or_bounded``.
6. Hostile input answers a 4xx naming the field, never a 500, and stores nothing (lone
   surrogates, a plan segment of ε = ∞); the schema-valid bodies the parser refused, and the
   parser's schema-invalid acceptances, now agree with the OpenAPI document
   (``test_the_schema_and_the_parser_agree_on_what_the_red_team_sent``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL
from starlette.testclient import TestClient

from accountant import events as ev
from accountant.certificates import verify
from service.cli import main
from service.client import LedgerClient
from service.db.session import Database
from service.ledger import tenancy
from tests.security.test_red_team_findings import SEQUENTIAL, Api, refused
from tests.service.api.conftest import Keys
from tests.service.api.world import unique
from tests.service.live_server import serve, settings_for

LIFELONG = {"rule": "lifelong", "epsilon": "100", "delta": "0", "accountant": "basic"}
PRV_SEGMENTED = {
    "rule": "sequential",
    "epsilon": "10",
    "delta": "1e-5",
    "accountant": "prv",
    "plan": [{"kind": "gaussian", "noise_multiplier": 2.0}],
    "plan_delta": "1e-6",
}


def l2dp(analysis: str | None = "sound") -> dict[str, Any]:
    event: dict[str, Any] = {
        "kind": "l2dp_ml_functional",
        "epsilon1": 0.4,
        "epsilon2": 2.0,
        "input_dim": 4,
        "hidden_units": 3,
        "output_hidden_units": 3,
        "batch_size": 80,
        "theta1_norm_bound": 2.0,
    }
    if analysis is not None:
        event["analysis"] = analysis
    return event


# ---- 1. L2DP-ML without the sound analysis -----------------------------------------------------

UNPROVEN = [pytest.param(None, id="absent"), pytest.param("paper", id="paper")]


@pytest.mark.parametrize("analysis", UNPROVEN)
def test_paper_l2dp_events_are_refused_where_events_are_accepted(
    client: TestClient, keys: Keys, analysis: str | None
) -> None:
    """Reserve, quote, a progressive commit, a dataset's declared plan and a plan segment refuse
    an ``l2dp_ml_functional`` event whose analysis is not "sound" (at any depth), 422 naming its
    ``analysis``; nothing changes; the same requests with "sound" are accepted."""
    api = Api(client, keys.get("acme", "admin"))
    dataset, _, batch = api.dataset(LIFELONG)
    segmented = api.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": PRV_SEGMENTED}, 201).json()
    bad, nested = l2dp(analysis), {"kind": "self_composed", "count": 2, "event": l2dp(analysis)}
    before = api.state(dataset)
    refused(api.reserve(dataset, batch, bad, status=None, noise_commitment="c"), "event.analysis")
    refused(api.reserve(dataset, batch, nested, status=None, noise_commitment="c"), "event.event.analysis")
    refused(
        api.call("POST", f"/v1/datasets/{dataset}/quote", {"event": bad, "new_batch": True}), "event.analysis"
    )
    plan_budget = {**PRV_SEGMENTED, "plan": [bad]}
    answer = api.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": plan_budget})
    refused(answer, "budget.plan[0].analysis")
    segment = {"plan": [{"kind": "gaussian", "noise_multiplier": 2.0}, bad], "delta": "1e-6"}
    answer = api.call("POST", f"/v1/datasets/{segmented['id']}/plan-segments", segment)
    refused(answer, "plan[1].analysis")
    assert api.state(dataset) == before

    held = api.reserve(dataset, batch, l2dp("sound"), noise_commitment="c").json()
    partial = api.call(
        "POST",
        f"/v1/reservations/{held['id']}/commit",
        {"release": {"model": "m", "version": 1}, "event": bad},
    )
    refused(partial, "event.analysis")
    assert api.reservation(held["id"])["status"] == "reserved"
    api.call("POST", f"/v1/datasets/{dataset}/quote", {"event": l2dp("sound"), "new_batch": True}, 200)
    committed = api.call(
        "POST", f"/v1/reservations/{held['id']}/commit", {"release": {"model": "m", "version": 1}}, 200
    )
    assert verify(committed.json()["certificate"]["certificate"]).ok


def test_an_l2dp_ml_job_on_the_paper_analysis_is_refused_at_submit(client: TestClient, keys: Keys) -> None:
    """Its reservation would be refused: a 201 for a job that can only fail is refused at submit."""
    api = Api(client, keys.get("acme", "admin"))
    trainer = Api(client, keys.get("acme", "trainer"))
    dataset, _, _ = api.dataset(LIFELONG, data_source="builtin:digits")
    params = {"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64, "noise_check": False}
    body = {"dataset_id": dataset, "algorithm": "l2dp_ml", "params": {**params, "analysis": "paper"}}
    before = api.call("GET", "/v1/jobs", status=200).json()
    refused(trainer.call("POST", "/v1/jobs", body), "params.analysis")
    assert api.call("GET", "/v1/jobs", status=200).json() == before
    trainer.call("POST", "/v1/jobs", {**body, "params": params}, 201)  # the default: "sound"


@pytest.mark.parametrize("analysis", UNPROVEN)
def test_ledger_epsilon_refuses_a_paper_l2dp_event(
    capsys: pytest.CaptureFixture[str], analysis: str | None
) -> None:
    code = main(["epsilon", "--event", json.dumps(l2dp(analysis)), "--delta", "0"])
    assert code == 2
    assert "event.analysis must be 'sound'" in capsys.readouterr().err
    assert main(["epsilon", "--event", json.dumps(l2dp("sound")), "--delta", "0"]) == 0


def test_a_stored_paper_charge_is_not_a_valid_bound(
    database_url: URL,
    db: Database,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A charge priced by Thm. 2 as printed, stored before new ones were refused (made here with
    the refusal switched off, as an older server stored it): its certificate's numbers re-derive,
    but ``verify`` reports it is not a valid bound, and ``ledger check`` fails, online and on an
    exported bundle, naming the certificate. A sound charge beside it passes."""
    settings = settings_for(database_url, tmp_path / "artifacts")
    admin_key = tenancy.create_api_key(db, "acme", "admin")
    viewer_key = tenancy.create_api_key(db, "acme", "viewer")
    with serve(settings, db) as url, LedgerClient(url, admin_key) as client:
        dataset = client.create_dataset("d", rule="lifelong", epsilon="100", delta=0, accountant="basic")
        task = client.create_task(dataset["id"], "t")
        made = client.create_batches(
            dataset["id"], task["id"], [{"name": f"b{i}", "records": [f"r{i}"]} for i in range(2)]
        )
        first, second = (b["id"] for b in made["data"])
        with monkeypatch.context() as old_server:
            old_server.setattr(ev, "refuse_unproven", lambda *args, **kwargs: None)
            held = client.reserve(dataset["id"], l2dp(None), batches=[first], noise_commitment="c1")
            stored = client.commit(held["id"], model="paper", version=1)["certificate"]
        held = client.reserve(dataset["id"], l2dp("sound"), batches=[second], noise_commitment="c2")
        client.commit(held["id"], model="sound", version=1)

        result = verify(stored["certificate"])
        assert not result.ok and not result.valid_bound
        assert "L2DP-ML Thm. 2 as printed" in result.reason and "is not a valid bound" in result.reason
        online = ["check", "--url", url, "--key", viewer_key, "--dataset", dataset["id"]]
        code = main(online)
        out = capsys.readouterr().out
        assert code == 1, out
        assert "FAIL  certificates" in out
        assert f"certificate {stored['id']}: not a valid bound" in out
        assert out.count(": not a valid bound:") == 1  # the sound one passes
        bundle = tmp_path / "bundle.json"
        assert (
            main(["export", "--url", url, "--key", viewer_key, "--dataset", dataset["id"], "-o", str(bundle)])
            == 0
        )
    capsys.readouterr()
    assert main(["check", "--bundle", str(bundle)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  certificates" in out and f"certificate {stored['id']}: not a valid bound" in out


# ---- 5. lists are paged or bounded ------------------------------------------------------------


def test_task_batches_are_paged(client: TestClient, keys: Keys) -> None:
    """``GET .../tasks/{task}/batches`` answered every batch of the task (500 000: 24.8 s, 143 MB).
    It pages now: ``limit`` (default 1000, at most 10 000) after the position ``after``; ``next``
    walks every batch once, in position order; a bad ``limit`` or ``after`` is a 422 naming it."""
    api = Api(client, keys.get("acme", "admin"))
    viewer = Api(client, keys.get("acme", "viewer"))
    dataset, task, _ = api.dataset(SEQUENTIAL)
    path = f"/v1/datasets/{dataset}/tasks/{task}/batches"
    api.call(
        "POST", path, {"batches": [{"name": f"n{i}", "records": [unique("r")]} for i in range(1200)]}, 201
    )
    first = viewer.call("GET", path, status=200).json()
    assert len(first["data"]) == 1000 and first["count"] == 1201 and first["next"] == 999
    walked, after = [], None
    while True:
        query = "limit=500" if after is None else f"limit=500&after={after}"
        page = viewer.call("GET", f"{path}?{query}", status=200).json()
        assert len(page["data"]) <= 500 and page["count"] == 1201
        walked += page["data"]
        after = page["next"]
        if after is None:
            break
    assert [b["name"] for b in walked[1:]] == [f"n{i}" for i in range(1200)]  # position order
    assert len({b["id"] for b in walked}) == 1201
    assert [b["position"] for b in walked] == list(range(1201))
    last = viewer.call("GET", f"{path}?after=1200", status=200).json()
    assert last == {"data": [], "count": 1201, "next": None}
    for query, field in [
        ("limit=0", "limit"),
        ("limit=10001", "limit"),
        ("after=-1", "after"),
        ("after=x", "after"),
    ]:
        refused(viewer.call("GET", f"{path}?{query}"), field)


def test_tasks_are_paged_and_bounded(client: TestClient, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /v1/datasets/{id}/tasks`` pages (``limit`` <= 1000, ``offset``) with the total in
    ``count``; a dataset holds at most ``MAX_TASKS_PER_DATASET`` tasks (409 ``too_many_tasks``),
    so ``GET .../spend``, which lists them, stays bounded too."""
    from service.ledger import batches

    api = Api(client, keys.get("acme", "admin"))
    dataset, _, _ = api.dataset(SEQUENTIAL)
    for i in range(4):
        api.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": f"t{i}"}, 201)
    page = api.call("GET", f"/v1/datasets/{dataset}/tasks?limit=2&offset=1", status=200).json()
    assert page["count"] == 5 and [t["name"] for t in page["data"]] == ["t0", "t1"]
    refused(api.call("GET", f"/v1/datasets/{dataset}/tasks?limit=1001"), "limit")
    monkeypatch.setattr(batches, "MAX_TASKS_PER_DATASET", 5)
    before = api.state(dataset)
    answer = api.call("POST", f"/v1/datasets/{dataset}/tasks", {"name": "t5"})
    assert answer.status_code == 409 and answer.json()["reason"] == "too_many_tasks", answer.text
    assert api.state(dataset) == before


def test_every_list_route_is_paged_or_bounded(app: Any) -> None:
    """Every GET route whose answer holds a list of stored rows takes a bounded ``limit``; the
    others answer one object (or a list bounded by the configuration: the signing keys)."""
    schema = app.openapi()
    unpaged_by_design = {
        "/.well-known/privacy-ledger/signing-keys",  # the operator's configured keys
        "/v1/audit/verify",  # a verdict
    }
    for path, item in schema["paths"].items():
        get = item.get("get")
        if get is None or path in unpaged_by_design:
            continue
        answer = (
            get["responses"].get("200", {}).get("content", {}).get("application/json", {}).get("schema", {})
        )
        ref = answer.get("$ref", "")
        body = schema["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {}) if ref else answer
        lists_rows = "data" in body.get("properties", {})
        if not lists_rows:
            continue
        limits = [p for p in get.get("parameters", []) if p["name"] == "limit"]
        assert limits, f"GET {path} lists rows without a limit"
        bound = limits[0]["schema"]
        assert bound.get("maximum", math.inf) <= 10_000, (path, bound)


# ---- 6. hostile input: a 4xx naming the field, never a 500 -------------------------------------


def test_a_lone_surrogate_in_an_event_key_is_a_422_naming_it(client: TestClient, keys: Keys) -> None:
    """An event key UTF-8 cannot carry ("\\ud800" in JSON) made the 422 itself unencodable: a
    500. It is named by its repr now, on quote, reservations, plan segments and datasets."""
    api = Api(client, keys.get("acme", "admin"))
    dataset, _, batch = api.dataset(SEQUENTIAL)
    segmented = api.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": PRV_SEGMENTED}, 201).json()
    before = api.state(dataset)
    event = b'{"kind": "pure_dp", "epsilon": 0.5, "\\ud800": 1}'
    prv = (
        b'{"rule": "sequential", "epsilon": "1", "delta": "1e-5", "accountant": "prv", "plan": [%s]}' % event
    )
    for path, body, field in [
        (f"/v1/datasets/{dataset}/quote", b'{"new_batch": true, "event": %s}' % event, "event.'\\ud800'"),
        (
            f"/v1/datasets/{dataset}/reservations",
            b'{"batches": ["%s"], "event": %s}' % (batch.encode(), event),
            "event.'\\ud800'",
        ),
        (
            f"/v1/datasets/{segmented['id']}/plan-segments",
            b'{"plan": [%s], "delta": "1e-6"}' % event,
            "plan[0].'\\ud800'",
        ),
        ("/v1/datasets", b'{"name": "x", "budget": %s}' % prv, "budget.plan[0].'\\ud800'"),
    ]:
        body_json = refused(api.raw("POST", path, body), field)
        assert "is not a field of a 'pure_dp' event" in body_json["message"]
    assert api.state(dataset) == before


def test_a_lone_surrogate_record_id_is_a_422_naming_it(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "admin"))
    dataset, task, _ = api.dataset(SEQUENTIAL)
    before = api.state(dataset)
    body = b'{"batches": [{"name": "b", "records": ["ok", 7]}, {"name": "c", "records": ["x", "\\ud800"]}]}'
    answer = refused(
        api.raw("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", body), "batches[1].records[1]"
    )
    assert "lone surrogate" in answer["message"]
    assert api.state(dataset) == before
    clean = body.replace(b"\\ud800", b"y")
    assert api.raw("POST", f"/v1/datasets/{dataset}/tasks/{task}/batches", clean).status_code == 201


def test_lone_surrogates_in_names_and_ids_are_4xx(client: TestClient, keys: Keys) -> None:
    api = Api(client, keys.get("acme", "admin"))
    dataset, task, _ = api.dataset(SEQUENTIAL)
    before = api.state(dataset)
    pure = b'{"kind": "pure_dp", "epsilon": 0.1}'
    for path, body, status in [
        (f"/v1/datasets/{dataset}/tasks", b'{"name": "a\\udfff"}', 422),
        (
            f"/v1/datasets/{dataset}/tasks/{task}/batches",
            b'{"batches": [{"name": "\\ud800", "records": ["x"]}]}',
            422,
        ),
        (f"/v1/datasets/{dataset}/reservations", b'{"batches": ["\\ud800"], "event": %s}' % pure, 404),
        (f"/v1/datasets/{dataset}/quote", b'{"tasks": ["\\ud800"], "event": %s}' % pure, 404),
        (f"/v1/datasets/{dataset}/quote", b'{"new_batch": true, "event": {"kind": "\\ud800"}}', 422),
    ]:
        answer = api.raw("POST", path, body)
        assert answer.status_code == status, (path, answer.text)
    assert api.state(dataset) == before


def test_a_plan_segment_of_infinite_epsilon_is_a_422(client: TestClient, keys: Keys) -> None:
    """σ = 1e-300: the segment's PRV ε is ∞, and the 422's message computed ∞ − ∞ (a 500)."""
    api = Api(client, keys.get("acme", "admin"))
    ds = api.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": PRV_SEGMENTED}, 201).json()
    before = api.state(ds["id"])
    body = {"plan": [{"kind": "gaussian", "noise_multiplier": 1e-300}], "delta": "1e-6"}
    answer = refused(api.call("POST", f"/v1/datasets/{ds['id']}/plan-segments", body), "plan")
    assert answer["message"].startswith("plan needs epsilon Infinity"), answer
    assert api.state(ds["id"]) == before
    body["plan"] = [{"kind": "gaussian", "noise_multiplier": 2.0}]
    api.call("POST", f"/v1/datasets/{ds['id']}/plan-segments", body, 201)


# Schema-valid bodies the parser refused (the OpenAPI document and the parser disagreed), and
# what each is now: accepted (the parser was wrong) or schema-invalid (the schema was wrong).
_SPEC: list[dict[str, Any]] = []
"""The OpenAPI document, made once: every app of this code has the same (~0.5 s to make)."""


def _openapi_valid(app: Any, path: str, method: str, body: Any) -> bool:
    import jsonschema_rs

    if not _SPEC:
        _SPEC.append(app.openapi())
    spec = _SPEC[0]
    schema = spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return bool(jsonschema_rs.validator_for({**schema, "components": spec["components"]}).is_valid(body))


AGREEMENT = [
    # quote: 1e17 is the integer 10^17 in JSON (and in JSON Schema); the parser refused it
    pytest.param(
        "/v1/datasets/{dataset_id}/quote",
        "post",
        {
            "new_batch": True,
            "event": {"kind": "self_composed", "count": 1e17, "event": {"kind": "pure_dp", "epsilon": 1e-18}},
        },
        True,
        id="quote-integral-float-count",
    ),
    # quote: an event's numbers are doubles; 10^400 was schema-valid, then a 422
    pytest.param(
        "/v1/datasets/{dataset_id}/quote",
        "post",
        {"new_batch": True, "event": {"kind": "pure_dp", "epsilon": 10**400}},
        False,
        id="quote-number-beyond-double",
    ),
    # plan-segments: delta 0 was schema-valid ([0, 1)); the ledger refuses a segment at delta 0
    pytest.param(
        "/v1/datasets/{dataset_id}/plan-segments",
        "post",
        {"plan": [{"kind": "gaussian", "noise_multiplier": 2.0}], "delta": 0},
        False,
        id="plan-segment-delta-0",
    ),
    # data-source PUT: "." / ".." / empty directory components were schema-valid, then a 422
    *(
        pytest.param(
            "/v1/datasets/{dataset_id}/data-source",
            "put",
            {"data_source": uri},
            False,
            id=f"data-source-{name}",
        )
        for name, uri in [
            ("dot", "file:///a/./b.csv"),
            ("dot-dot", "file:///a/../b.csv"),
            ("empty", "file:///a//b.csv"),
        ]
    ),
    # ... and the parser took control characters the schema refuses (urlsplit drops a newline)
    pytest.param(
        "/v1/datasets/{dataset_id}/data-source",
        "put",
        {"data_source": "builtin:digits\n"},
        False,
        id="data-source-newline",
    ),
]


@pytest.mark.parametrize(("path", "method", "body", "valid"), AGREEMENT)
def test_the_schema_and_the_parser_agree_on_what_the_red_team_sent(
    app: Any, client: TestClient, keys: Keys, path: str, method: str, body: dict[str, Any], valid: bool
) -> None:
    api = Api(client, keys.get("acme", "admin"))
    dataset = api.call("POST", "/v1/datasets", {"name": unique("ds"), "budget": PRV_SEGMENTED}, 201).json()[
        "id"
    ]
    assert _openapi_valid(app, path, method, body) is valid
    answer = api.client.request(
        method.upper(), path.replace("{dataset_id}", dataset), json=body, headers=api.headers
    )
    if valid:
        assert answer.status_code in (200, 201), answer.text
    else:
        assert answer.status_code == 422, answer.text
