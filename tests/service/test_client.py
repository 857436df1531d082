"""``service.client``: every method against the real app over real HTTP, on SQLite and PostgreSQL.

The server is ``create_app`` under uvicorn on a loopback port (``tests.service.live_server``).
The one fault injected is a lost response: a transport wrapper passes the request to the real
server, lets it handle and answer it, then drops the answer — the only way to produce "the
server charged, the client never heard" — so the client's retry with the same Idempotency-Key
can be shown to charge once. Another wrapper only records the bodies the client sends, to show
what an optional argument puts on the wire. The server reads ``file://`` sources under one data
root of tenant ``acme`` (``LEDGER_DATA_ROOTS``); ``/metrics`` opens to the operator's token only.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import secrets
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy.engine import URL

from accountant.certificates import verify
from accountant.events import PureDpEvent, SelfComposedEvent
from service.client import (
    AsyncLedgerClient,
    BatchOverlap,
    BudgetExceeded,
    Conflict,
    Forbidden,
    InvalidInput,
    LedgerClient,
    LedgerUnavailable,
    NotFound,
    ReservationExpiring,
    Unauthorized,
)
from service.db.session import Database
from service.ledger import model_registry as registry
from service.ledger import tenancy
from service.settings import Settings
from service.verification import signing
from tests.service.live_server import free_port, serve, settings_for

# Client behaviour that does not depend on the database runs on SQLite only (the backend fixture
# of tests/conftest.py, overridden); the calls themselves run on both backends.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])
METRICS_TOKEN = "client-test-metrics-token-0123456789"


@dataclass
class Ledger:
    url: str
    keys: dict[str, str]
    settings: Settings
    db: Database
    data_root: Path

    def client(self, scope: str = "admin", **kwargs: object) -> LedgerClient:
        return LedgerClient(self.url, self.keys[scope], timeout=10.0, backoff_s=0.01, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def ledger(database_url: URL, db: Database, tmp_path: Path) -> Iterator[Ledger]:
    data_root = tmp_path / "data"
    data_root.mkdir()
    settings = settings_for(database_url, tmp_path / "artifacts").model_copy(
        update={"data_roots": {"acme": [str(data_root)]}, "metrics_token": SecretStr(METRICS_TOKEN)}
    )
    keys = {scope: tenancy.create_api_key(db, "acme", scope) for scope in ("admin", "trainer", "viewer")}
    keys["rival"] = tenancy.create_api_key(db, "rival", "admin")
    with serve(settings, db) as url:
        yield Ledger(url, keys, settings, db, data_root)


def make_dataset(
    client: LedgerClient, *, epsilon: str = "1", records: int = 4, rule: str = "sequential"
) -> tuple[str, str, list[str]]:
    """A dataset with one task and ``records`` one-record batches: (dataset, task, batch ids)."""
    dataset = client.create_dataset(
        f"digits-{secrets.token_hex(4)}", rule=rule, epsilon=epsilon, delta=0, accountant="basic"
    )
    task = client.create_task(dataset["id"], "task-0")
    created = client.create_batches(
        dataset["id"],
        task["id"],
        [{"name": f"b{i}", "records": [f"{dataset['id']}-r{i}"]} for i in range(records)],
    )
    return dataset["id"], task["id"], [b["id"] for b in created["data"]]


# ---------------------------------------------------------------------------------------------
# Every call
# ---------------------------------------------------------------------------------------------


def test_every_v1_call(ledger: Ledger) -> None:
    admin, trainer, viewer = ledger.client("admin"), ledger.client("trainer"), ledger.client("viewer")
    assert admin.healthz() == {"status": "ok", "database": "ok"}

    dataset = admin.create_dataset(
        "digits",
        rule="sequential",
        epsilon=Decimal("1.0"),
        delta="0",
        accountant="basic",
        data_source="builtin:digits",
    )
    assert dataset["budget"]["rule"] == "sequential"
    assert dataset["data_source"] == "builtin:digits"
    assert viewer.get_dataset(dataset["id"])["id"] == dataset["id"]
    assert dataset["id"] in {d["id"] for d in viewer.list_datasets()["data"]}
    task = admin.create_task(dataset["id"], "task-0")
    assert viewer.list_tasks(dataset["id"])["data"][0]["id"] == task["id"]
    batches = admin.create_batches(
        dataset["id"], task["id"], [{"name": "b0", "records": ["r0", "r1"]}, {"name": "b1", "records": [7]}]
    )["data"]
    assert [b["size"] for b in batches] == [2, 1]
    assert {b["id"] for b in viewer.list_batches(dataset["id"], task["id"])["data"]} == {
        b["id"] for b in batches
    }

    # reserve (an accountant.events object), read it, commit progressively, abort the rest
    planned = SelfComposedEvent(PureDpEvent(0.1), 4)
    held = trainer.reserve(dataset["id"], planned, batches=[batches[0]["id"]])
    assert held["status"] == "reserved" and held["cost"]["epsilon"] == "0.4"
    assert viewer.get_reservation(held["id"])["id"] == held["id"]
    committed = trainer.commit(
        held["id"],
        model="mlp",
        version=1,
        event={"kind": "self_composed", "count": 2, "event": {"kind": "pure_dp", "epsilon": 0.1}},
    )
    certificate = committed["certificate"]
    assert certificate["release"] == {"model": "mlp", "version": 1}
    assert verify(certificate["certificate"]).ok
    aborted = trainer.abort(held["id"])  # charges all 4 reserved steps (issue 24 §2)
    assert aborted["committed"]["epsilon"] == "0.4"
    spend = viewer.spend(dataset["id"])
    assert spend["epsilon_spent"] == "0.4" and spend["epsilon_held"] == "0"

    # certificates: list, page, get (the release's, then the abort's: release null)
    assert viewer.list_certificates(dataset["id"])["count"] == 2
    listed = list(viewer.iter_certificates(dataset["id"], page_size=1))
    assert [c["id"] for c in listed][:1] == [certificate["id"]]
    assert [(c["outcome"], c["release"]) for c in listed] == [
        ("released", {"model": "mlp", "version": 1}),
        ("aborted", None),
    ]
    fetched = viewer.get_certificate(certificate["id"])
    assert fetched["content_hash"] == certificate["certificate"]["hash"]
    assert verify(fetched["certificate"]).ok

    # the dashboard's reads
    assert dataset["id"] in {d["id"] for d in viewer.list_spend()["data"]}
    assert {b["id"] for b in viewer.batch_spend(dataset["id"])["data"]} == {b["id"] for b in batches}
    timeline = viewer.list_releases(dataset["id"])["data"]
    assert [(r["certificate_id"], r["model"]) for r in timeline] == [(certificate["id"], "mlp")]
    assert viewer.epsilon_history(dataset["id"])["count"] == 1
    assert viewer.verify_certificate_on_server(certificate["id"])["ok"] is True

    # audit: the server's verdict, and the chain itself, page by page
    assert viewer.verify_audit(dataset["id"])["ok"] is True
    assert viewer.verify_audit()["ok"] is True
    entries = list(viewer.iter_audit_entries(dataset["id"], page_size=2))
    assert [e["chain_seq"] for e in entries] == list(range(1, len(entries) + 1))
    head = viewer.audit_entries(dataset["id"], limit=1)["head"]
    assert (head["chain_seq"], head["hash"]) == (len(entries), entries[-1]["hash"])
    # the head and the certificate are signed by the key the well-known route lists
    keys = signing.keys_from_json(viewer.signing_keys(), "signing_keys")
    assert [k.status for k in keys.values()] == ["active"]
    assert signing.check_head(dataset["id"], head, keys).ok
    assert signing.check_certificate(certificate["certificate"], keys).ok
    assert "reservation.committed" in {e["event_type"] for e in entries}

    # the data source: replaced by an admin (the dataset answers), then set back
    replaced = admin.set_data_source(dataset["id"], "builtin:split-digits?tasks=2")
    assert (replaced["id"], replaced["data_source"]) == (dataset["id"], "builtin:split-digits?tasks=2")
    assert admin.set_data_source(dataset["id"], "builtin:digits")["data_source"] == "builtin:digits"
    assert viewer.get_dataset(dataset["id"])["data_source"] == "builtin:digits"

    # jobs: queue (on the dataset's own source), read, list, cancel (no worker runs in this app)
    job = trainer.create_job(dataset["id"], "dp_sgd", {"noise_multiplier": 1.0, "epochs": 1})
    assert job["status"] == "queued"
    assert viewer.get_job(job["id"])["id"] == job["id"]
    assert job["id"] in {j["id"] for j in viewer.list_jobs(dataset_id=dataset["id"])["data"]}
    assert trainer.cancel_job(job["id"])["status"] == "cancelled"

    # model registry: a version published by the registry after its release was committed
    with pytest.raises(NotFound):
        viewer.list_model_versions("mlp")
    weights = b"weights of mlp v1"
    staged = registry.stage(
        ledger.settings.artifact_dir,
        tenant_id="acme",
        name="mlp",
        version=1,
        job_id=job["id"],
        attempt=1,
        dataset_id=dataset["id"],
        step=2,
        metrics={"accuracy": 0.5},
        fmt="torch",
        write=lambda handle: handle.write(weights),
    )
    registry.publish(ledger.db, ledger.settings.artifact_dir, staged, certificate_id=certificate["id"])
    versions = viewer.list_model_versions("mlp")["data"]
    assert [(v["version"], v["certificate_id"]) for v in versions] == [(1, certificate["id"])]
    assert [v["version"] for v in viewer.iter_model_versions("mlp")] == [1]
    version = viewer.get_model_version("mlp", 1)
    assert version["certificate"]["id"] == certificate["id"]
    artifact = viewer.download_artifact("mlp", 1)
    assert artifact.content == weights
    assert artifact.sha256 == hashlib.sha256(weights).hexdigest()
    assert artifact.certificate_id == certificate["id"] and artifact.format == "torch"
    with pytest.raises(NotFound):
        viewer.download_artifact("mlp", 2)

    # /metrics: the operator's token reads it; no API key does
    with LedgerClient(ledger.url, METRICS_TOKEN, timeout=10.0) as scraper:
        assert "ledger_" in scraper.metrics_text()
    with pytest.raises(Unauthorized):
        admin.metrics_text()
    for client in (admin, trainer, viewer):
        client.close()


# ---------------------------------------------------------------------------------------------
# A dataset's data source
# ---------------------------------------------------------------------------------------------


@dataclass
class RecordBodies(httpx.BaseTransport):
    """Forwards every request to the real server, keeping the (method, path, JSON body) sent."""

    inner: httpx.HTTPTransport = field(default_factory=httpx.HTTPTransport)
    sent: list[tuple[str, str, Any]] = field(default_factory=list)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, request.url.path, body))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_an_admin_gives_a_dataset_its_data_source_at_creation_or_later(ledger: Ledger) -> None:
    wire = RecordBodies()
    admin, viewer = ledger.client("admin", transport=wire), ledger.client("viewer")

    # at creation: sent only when given
    dataset_id, _, _ = make_dataset(admin)
    method, path, body = wire.sent[0]
    assert (method, path) == ("POST", "/v1/datasets") and "data_source" not in body
    assert viewer.get_dataset(dataset_id)["data_source"] is None
    with_source = admin.create_dataset(
        "read", rule="sequential", epsilon="1", delta=0, accountant="basic", data_source="builtin:digits"
    )
    assert wire.sent[-1][2]["data_source"] == "builtin:digits"
    assert with_source["data_source"] == "builtin:digits"
    assert viewer.get_dataset(with_source["id"])["data_source"] == "builtin:digits"

    # a job on a dataset without a source is refused at submit, naming the dataset
    trainer = ledger.client("trainer")
    with pytest.raises(InvalidInput) as no_source:
        trainer.create_job(dataset_id, "dp_sgd", {"noise_multiplier": 1.0, "steps": 1})
    assert no_source.value.field == "dataset_id"

    # later: set (PUT; the dataset answers, and a job on it is now queued), the same again (no
    # change), a file under the tenant's data root, then removed (null)
    answer = admin.set_data_source(dataset_id, "builtin:digits")
    assert wire.sent[-1] == (
        "PUT",
        f"/v1/datasets/{dataset_id}/data-source",
        {"data_source": "builtin:digits"},
    )
    assert (answer["id"], answer["data_source"]) == (dataset_id, "builtin:digits")
    assert (
        trainer.create_job(dataset_id, "dp_sgd", {"noise_multiplier": 1.0, "steps": 1})["status"] == "queued"
    )
    assert admin.set_data_source(dataset_id, "builtin:digits")["data_source"] == "builtin:digits"
    records = ledger.data_root / "records.csv"
    records.write_text("id,label,x0\nr0,0,0.5\n")
    assert admin.set_data_source(dataset_id, f"file://{records}")["data_source"] == f"file://{records}"
    removed = admin.set_data_source(dataset_id, None)
    assert wire.sent[-1][2] == {"data_source": None}
    assert removed["data_source"] is None and viewer.get_dataset(dataset_id)["data_source"] is None

    # each change is audited with the source it replaced; setting the same source appended nothing
    changes = [
        entry["payload"]
        for entry in viewer.iter_audit_entries(dataset_id)
        if entry["event_type"] == "dataset.data_source_set"
    ]
    assert changes == [
        {"data_source": "builtin:digits", "previous": None},
        {"data_source": f"file://{records}", "previous": "builtin:digits"},
        {"data_source": None, "previous": f"file://{records}"},
    ]

    # refusals, typed: not an admin, another tenant's dataset, a file outside the data roots
    with pytest.raises(Forbidden) as forbidden:
        trainer.set_data_source(dataset_id, "builtin:digits")
    assert (forbidden.value.scope, forbidden.value.required_scope) == ("trainer", "admin")
    with pytest.raises(NotFound) as elsewhere:
        ledger.client("rival").set_data_source(dataset_id, "builtin:digits")
    assert elsewhere.value.resource == "dataset"
    outside = ledger.data_root.parent / "outside.csv"
    outside.write_text("id,label,x0\nr0,0,0.5\n")
    with pytest.raises(InvalidInput) as refused:
        admin.set_data_source(dataset_id, f"file://{outside}")
    assert refused.value.field == "data_source"
    with pytest.raises(InvalidInput) as refused_at_creation:
        admin.create_dataset(
            "d", rule="sequential", epsilon="1", delta=0, accountant="basic", data_source=f"file://{outside}"
        )
    assert refused_at_creation.value.field == "data_source"
    assert viewer.get_dataset(dataset_id)["data_source"] is None
    assert "d" not in {d["name"] for d in viewer.list_datasets()["data"]}


# ---------------------------------------------------------------------------------------------
# Typed errors
# ---------------------------------------------------------------------------------------------


@SQLITE_ONLY
def test_errors_are_typed(ledger: Ledger) -> None:
    admin, viewer = ledger.client("admin"), ledger.client("viewer")
    dataset_id, task_id, batches = make_dataset(admin, epsilon="0.5")

    with pytest.raises(Unauthorized) as unauthorized:
        LedgerClient(ledger.url, "pl_not_a_key_at_all_0123456789").list_datasets()
    assert unauthorized.value.status == 401 and unauthorized.value.code == "unauthorized"

    with pytest.raises(Forbidden) as forbidden:
        viewer.create_task(dataset_id, "nope")
    assert (forbidden.value.scope, forbidden.value.required_scope) == ("viewer", "admin")

    with pytest.raises(NotFound) as missing:
        viewer.get_dataset("ds_does_not_exist")
    assert missing.value.resource == "dataset" and missing.value.status == 404
    with pytest.raises(NotFound):  # another tenant's dataset looks exactly the same
        ledger.client("rival").spend(dataset_id)

    with pytest.raises(InvalidInput) as invalid:
        admin.create_dataset("bad", rule="sequential", epsilon=float("nan"), delta=0, accountant="basic")
    assert invalid.value.field == "budget.epsilon"
    assert "nan" in invalid.value.message
    with pytest.raises(InvalidInput) as bad_event:
        admin.reserve(dataset_id, {"kind": "gaussian", "noise_multiplier": -1}, batches=batches[:1])
    assert bad_event.value.field == "event.noise_multiplier"

    with pytest.raises(BatchOverlap) as overlap:
        admin.create_batches(dataset_id, task_id, [{"name": "again", "records": [f"{dataset_id}-r0"]}])
    assert overlap.value.record_id == f"{dataset_id}-r0" and overlap.value.status == 409

    admin.reserve(dataset_id, PureDpEvent(0.375), batches=batches[:1])
    with pytest.raises(BudgetExceeded) as refused:
        admin.reserve(dataset_id, PureDpEvent(0.25), batches=batches[:1])
    assert refused.value.remaining == {"epsilon": "0.125", "delta": "0"}
    assert refused.value.requested == {"epsilon": "0.25", "delta": "0"}
    assert isinstance(refused.value, Conflict)

    held = admin.reserve(dataset_id, PureDpEvent(0.1), batches=batches[1:2])
    admin.commit(held["id"], model="m", version="1")
    with pytest.raises(Conflict) as closed:
        admin.commit(held["id"], model="m", version="2")
    assert closed.value.status == 409 and not isinstance(closed.value, BudgetExceeded)


def test_connection_errors_are_retried_then_raised() -> None:
    port = free_port()  # nothing listens there
    client = LedgerClient(f"http://127.0.0.1:{port}", "pl_key", retries=2, backoff_s=0.01, timeout=2.0)
    with pytest.raises(LedgerUnavailable) as failure:
        client.spend("ds_1")
    assert failure.value.details["attempts"] == 3 and failure.value.status is None


# ---------------------------------------------------------------------------------------------
# Idempotency across a lost response
# ---------------------------------------------------------------------------------------------


@dataclass
class LoseResponses(httpx.BaseTransport):
    """Forwards every request to the real server. For the first request of each Idempotency-Key
    that ``match``es, it reads the server's whole answer, then raises as if the connection
    dropped before the answer arrived."""

    match: Callable[[httpx.Request], bool]
    inner: httpx.HTTPTransport = field(default_factory=httpx.HTTPTransport)
    seen: list[tuple[str, str, str | None, int]] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()  # the server has handled the request and answered in full
        key = request.headers.get("Idempotency-Key")
        self.seen.append((request.method, request.url.path, key, response.status_code))
        if key is not None and key not in self.lost and self.match(request):
            self.lost.add(key)
            response.close()
            raise httpx.ReadError("connection reset before the answer arrived", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def test_a_lost_response_is_retried_with_the_same_key_and_charged_once(ledger: Ledger) -> None:
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    lose = LoseResponses(lambda r: r.method == "POST")
    trainer = ledger.client("trainer", transport=lose)

    held = trainer.reserve(dataset_id, PureDpEvent(0.25), batches=batches[:1])
    committed = trainer.commit(held["id"], model="m", version=1)

    posts = [s for s in lose.seen if s[0] == "POST"]
    reserve_calls = [s for s in posts if s[1].endswith("/reservations")]
    commit_calls = [s for s in posts if s[1].endswith("/commit")]
    # each call was answered twice by the server (201/200 both times), under one key
    assert [s[3] for s in reserve_calls] == [201, 201] and len({s[2] for s in reserve_calls}) == 1
    assert [s[3] for s in commit_calls] == [200, 200] and len({s[2] for s in commit_calls}) == 1
    assert reserve_calls[0][2] != commit_calls[0][2]

    spend = admin.spend(dataset_id)
    assert spend["epsilon_spent"] == "0.25"  # one charge, not two
    assert spend["epsilon_held"] == "0" and spend["reservations_open"] == 0
    assert spend["charges_committed"] == 1
    certificates = admin.list_certificates(dataset_id)
    assert certificates["count"] == 1
    assert certificates["data"][0]["id"] == committed["certificate"]["id"]


# ---------------------------------------------------------------------------------------------
# The release gate
# ---------------------------------------------------------------------------------------------


def test_release_gate_commits_on_success_and_aborts_on_exception(ledger: Ledger) -> None:
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    trainer = ledger.client("trainer")

    with trainer.release_gate(dataset_id, batches[:2], PureDpEvent(0.25), model="mlp", version=1) as gate:
        assert gate.status == "reserved" and gate.cost["epsilon"] == "0.25"
        assert gate.certificate is None
        assert admin.spend(dataset_id)["epsilon_held"] == "0.25"
    assert gate.status == "committed"
    assert gate.certificate is not None and verify(gate.certificate["certificate"]).ok
    assert gate.certificate["release"] == {"model": "mlp", "version": 1}
    assert admin.spend(dataset_id)["epsilon_spent"] == "0.25"

    class TrainingFailed(RuntimeError):
        pass

    with pytest.raises(TrainingFailed):
        with trainer.release_gate(
            dataset_id, batches[:1], PureDpEvent(0.5), model="mlp", version=2
        ) as failed:
            raise TrainingFailed("diverged")
    assert failed.status == "aborted" and failed.certificate is None
    assert trainer.get_reservation(failed.reservation_id)["status"] == "aborted"
    spend = admin.spend(dataset_id)  # the failed run is charged what it reserved (issue 24 §2)
    assert (spend["epsilon_spent"], spend["epsilon_held"], spend["last_release"]["version"]) == (
        "0.75",
        "0",
        1,
    )
    assert [c["outcome"] for c in admin.list_certificates(dataset_id)["data"]] == ["released", "aborted"]

    with trainer.release_gate(dataset_id, batches[1:2], PureDpEvent(0.5), model="mlp", version=3) as withheld:
        withheld.withhold()
    assert withheld.status == "withheld" and withheld.certificate is None
    assert trainer.get_reservation(withheld.reservation_id)["committed"]["epsilon"] == "0.5"
    assert admin.spend(dataset_id)["epsilon_held"] == "0"

    # a run stopped early releases what it ran; the abort of the rest charges the rest
    planned = SelfComposedEvent(PureDpEvent(0.125), 4)
    with trainer.release_gate(dataset_id, batches[2:3], planned, model="mlp", version=4) as partial:
        partial.commit_event = SelfComposedEvent(PureDpEvent(0.125), 1)
    assert partial.status == "committed" and partial.certificate is not None
    assert partial.certificate["certificate"]["result"]["charge"]["epsilon"] == "0.125"
    assert trainer.get_reservation(partial.reservation_id)["committed"]["epsilon"] == "0.5"
    assert admin.spend(dataset_id)["epsilon_held"] == "0"

    # refused on enter: the body never runs, nothing is held
    ran = []
    with pytest.raises(BudgetExceeded):
        with trainer.release_gate(dataset_id, batches[:1], PureDpEvent(0.9), model="mlp", version=5):
            ran.append(True)
    assert ran == [] and admin.spend(dataset_id)["reservations_open"] == 0


@SQLITE_ONLY
def test_release_gate_aborts_when_the_commit_is_refused(ledger: Ledger) -> None:
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    trainer = ledger.client("trainer")
    with pytest.raises(Conflict) as refused:
        # reserved while (m, 1) is free (the reserve checks it) ...
        with trainer.release_gate(dataset_id, batches[1:2], PureDpEvent(0.25), model="m", version=1) as gate:
            # ... and released by another run before this one commits
            with trainer.release_gate(dataset_id, batches[:1], PureDpEvent(0.25), model="m", version=1):
                pass
    assert refused.value.details["reason"] == "release_exists"
    assert gate.status == "aborted"
    assert admin.spend(dataset_id)["epsilon_held"] == "0"


# ---------------------------------------------------------------------------------------------
# The async twin
# ---------------------------------------------------------------------------------------------


@SQLITE_ONLY
def test_async_client_and_gate(ledger: Ledger) -> None:
    dataset_id, _, batches = make_dataset(ledger.client("admin"), epsilon="1")

    async def pure() -> tuple[dict[str, object], list[str]]:
        async with AsyncLedgerClient(ledger.url, ledger.keys["trainer"], backoff_s=0.01) as client:
            async with client.release_gate(
                dataset_id, batches[:1], PureDpEvent(0.5), model="async", version="v1"
            ) as gate:
                pass
            assert gate.certificate is not None and verify(gate.certificate["certificate"]).ok
            with pytest.raises(BudgetExceeded):
                await client.reserve(dataset_id, PureDpEvent(0.75), batches=batches[:1])
            ids = [c["id"] async for c in client.iter_certificates(dataset_id)]
            return await client.spend(dataset_id), ids

    async def sources() -> tuple[dict[str, Any], dict[str, Any]]:
        async with AsyncLedgerClient(ledger.url, ledger.keys["admin"], backoff_s=0.01) as admin:
            created = await admin.create_dataset(
                "async",
                rule="sequential",
                epsilon="1",
                delta=0,
                accountant="basic",
                data_source="builtin:digits",
            )
            return created, await admin.set_data_source(created["id"], None)

    spend, ids = asyncio.run(pure())
    assert spend["epsilon_spent"] == "0.5" and len(ids) == 1
    created, removed = asyncio.run(sources())
    assert created["data_source"] == "builtin:digits"
    assert (removed["id"], removed["data_source"]) == (created["id"], None)


@SQLITE_ONLY
def test_events_may_be_objects_or_json_and_decimals_stay_exact(ledger: Ledger) -> None:
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    for i in range(4):
        event = PureDpEvent(0.25) if i % 2 else {"kind": "pure_dp", "epsilon": 0.25}
        held = admin.reserve(dataset_id, event, batches=batches[:1])
        admin.commit(held["id"], model="m", version=i)
    assert admin.spend(dataset_id)["epsilon_spent"] == "1"  # four quarters fill 1 exactly
    with pytest.raises(TypeError):
        admin.reserve(dataset_id, io.BytesIO(), batches=batches[:1])  # type: ignore[arg-type]


@SQLITE_ONLY
def test_release_gate_resumes_a_crashed_attempt_by_its_key(ledger: Ledger) -> None:
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    trainer = ledger.client("trainer")
    event = PureDpEvent(0.25)

    # attempt 1 reserves, then its process dies inside the block: no commit, no abort
    crashed = trainer.release_gate(
        dataset_id, batches[:1], event, model="m", version=1, idempotency_key="run-7"
    )
    held = crashed.__enter__()
    # attempt 2, same run id: the same hold, not a second one; it commits
    with trainer.release_gate(
        dataset_id, batches[:1], event, model="m", version=1, idempotency_key="run-7"
    ) as gate:
        assert gate.reservation_id == held.reservation_id
    assert gate.status == "committed"
    spend = admin.spend(dataset_id)
    assert (spend["epsilon_spent"], spend["epsilon_held"], spend["charges_committed"]) == ("0.25", "0", 1)

    # a later attempt with the key of a closed hold is refused before its block runs
    ran = []
    with pytest.raises(Conflict) as closed:
        with trainer.release_gate(
            dataset_id, batches[:1], event, model="m", version=2, idempotency_key="run-7"
        ):
            ran.append(True)
    assert ran == [] and closed.value.code == "reservation_closed"


@pytest.mark.slow
@SQLITE_ONLY
def test_release_gate_warns_before_expiry_and_keeps_its_hold_alive(ledger: Ledger) -> None:
    """Issue 28 §2: a hold used to expire after its ttl with no warning and no way to renew it.
    The gate warns shortly before its expiry; ``keep_alive`` renews it while the block runs (each
    renewal audited), so a block longer than the ttl still commits."""
    admin = ledger.client("admin")
    dataset_id, _, batches = make_dataset(admin, epsilon="1")
    trainer = ledger.client("trainer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(Conflict) as late:
            with trainer.release_gate(
                dataset_id, batches[:1], PureDpEvent(0.1), model="m", version=1, ttl_s=1.0
            ):
                time.sleep(1.3)  # past the hold: warned at 0.9 s, expired at 1 s
    assert late.value.code == "reservation_expired"
    (warning,) = [w for w in caught if issubclass(w.category, ReservationExpiring)]
    assert "charges everything reserved" in str(warning.message)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trainer.release_gate(
            dataset_id, batches[1:2], PureDpEvent(0.1), model="m", version=2, ttl_s=2.0, keep_alive=True
        ) as gate:
            # more than twice the ttl: renewed (from 1 s left, checked every 0.5 s) long before
            # the warning's 0.2 s, even when an extension takes a loaded machine half a second
            time.sleep(4.4)
    assert gate.status == "committed" and gate.certificate is not None
    assert not [w for w in caught if issubclass(w.category, ReservationExpiring)]
    renewals = [e for e in admin.iter_audit_entries(dataset_id) if e["event_type"] == "reservation.extended"]
    assert len(renewals) >= 2 and {e["payload"]["reservation_id"] for e in renewals} == {gate.reservation_id}


@pytest.mark.parametrize(
    ("key", "code"),
    [("", "no_api_key"), ("   ", "no_api_key"), (None, "no_api_key"), ("pl_key\n", "invalid_api_key")],
)
def test_a_missing_or_mangled_key_is_said_plainly_before_any_call(key: object, code: str) -> None:
    """Issue 28 §8: an empty key used to surface as "unavailable ... Illegal header value" at
    the first call. Both clients refuse it when made, naming the field; nothing is sent (the URL
    points at a closed port)."""
    url = f"http://127.0.0.1:{free_port()}"
    for client in (LedgerClient, AsyncLedgerClient):
        with pytest.raises(Unauthorized) as info:
            client(url, key)  # type: ignore[arg-type]
        assert info.value.code == code and info.value.details == {"field": "api_key"}
        assert "no API key" in info.value.message or "line break" in info.value.message


def test_dataset_names_are_unique_per_tenant_and_stand_for_the_dataset(ledger: Ledger) -> None:
    """Issue 28 §6: two datasets could share a name, and a name where an id was expected was a
    bare 404. A name is one dataset's per tenant (409 ``dataset_name_taken`` naming it), and the
    client finds a dataset by id or by name; a miss names what was looked up."""
    admin, rival = ledger.client("admin"), ledger.client("rival")
    first = admin.create_dataset("mnist-train", rule="sequential", epsilon="1", delta=0, accountant="basic")
    with pytest.raises(Conflict) as taken:
        admin.create_dataset("mnist-train", rule="parallel", epsilon="2", delta=0, accountant="basic")
    assert (
        taken.value.details["reason"],
        taken.value.details["dataset_id"],
        taken.value.details["field"],
    ) == (
        "dataset_name_taken",
        first["id"],
        "name",
    )
    assert admin.list_datasets()["count"] == 1
    theirs = rival.create_dataset("mnist-train", rule="sequential", epsilon="1", delta=0, accountant="basic")
    assert theirs["id"] != first["id"]

    viewer = ledger.client("viewer")
    assert viewer.find_dataset("mnist-train")["id"] == first["id"]
    assert viewer.find_dataset(first["id"])["name"] == "mnist-train"
    assert rival.find_dataset("mnist-train")["id"] == theirs["id"]
    assert viewer.list_datasets(name="mnist-train")["data"][0]["id"] == first["id"]
    assert viewer.list_datasets(name="nope") == {"data": [], "count": 0}
    for missing in ("mnist-test", theirs["id"]):  # another tenant's id is not found either
        with pytest.raises(NotFound) as info:
            viewer.find_dataset(missing)
        assert info.value.details["looked_up"] == missing and repr(missing) in info.value.message

    async def found() -> str:
        async with AsyncLedgerClient(ledger.url, ledger.keys["viewer"]) as client:
            return str((await client.find_dataset("mnist-train"))["id"])

    assert asyncio.run(found()) == first["id"]
