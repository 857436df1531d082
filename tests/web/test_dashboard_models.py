"""Issue 28's dashboard pages in headless Chromium at 1400×900, against a real ``ledger serve``
on SQLite, in one browser session: the models index and a model's privacy–utility view (an
externally trained model registered over HTTP, and a worker's checkpoints with their metric
curves), an external version's page, the audit log, the jobs table (names, the ε a running job
holds, metric names on one line), ε over releases on a dataset, the certificate's budget in words
with its internals folded, the datasets table's δ, records and id, and a lifelong chart whose
end labels never overlap when the guarantee meets the budget. Values are checked against the
API's own answers.

Screenshots go to ``test-artifacts/dashboard/`` (``30-*`` and on).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import LedgerClient
from service.db.session import Database
from service.ledger import datasets, jobs, reservations, tenancy
from service.ledger import model_registry as registry
from service.ledger.reservations import parse_event
from tests.service.api.conftest import Server, bearer, start_server, stop_server
from tests.web.pages import go, shot, signed_in
from tests.web.test_dashboard import (
    Api,
    _require_browser,
    all_of,
    browser_errors,
    text_of,
    wait_for,
)

pytestmark = pytest.mark.slow

WIDTH = 1400
DPSGD = {
    "kind": "self_composed",
    "count": 100,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.05,
        "event": {"kind": "gaussian", "noise_multiplier": 1.0},
    },
}
LONG_METRIC = "held_out_macro_averaged_f1_score"


@dataclass
class World:
    server: Server
    viewer_key: str
    external: str  # dataset of the externally trained model
    trained: str  # dataset of the worker's job with checkpoints
    lifelong: str  # a lifelong dataset whose guarantee reaches its budget
    running_job: str
    done_job: str
    reserved_epsilon: str
    external_certificate: str

    def get(self, path: str) -> Any:
        answer = httpx.get(self.server.base_url + path, headers=bearer(self.viewer_key), timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()


def _checkpoints(db: Database, artifacts: Path, dataset: str, batch: str) -> str:
    """A finished job with two published checkpoints (steps 10 and 20), as the worker publishes
    them: staged, released through the ledger, published."""
    job = str(
        jobs.queue.create_job(
            db,
            "default",
            dataset_id=dataset,
            algorithm="dp_sgd",
            params={"noise_multiplier": 1.0, "steps": 20},
        ).id
    )
    claimed = jobs.leases.claim(db, "browser-test-worker", lease_s=60)
    assert claimed is not None and claimed.lease.job_id == job
    model = f"dp_sgd-{job}"
    for version, (step, accuracy) in enumerate(((10, 0.61), (20, 0.74)), start=1):
        staged = registry.stage(
            artifacts,
            tenant_id="default",
            name=model,
            version=version,
            job_id=job,
            attempt=1,
            dataset_id=dataset,
            step=step,
            metrics={
                "accuracy": accuracy,
                "loss": 1.5 - accuracy,
                LONG_METRIC: accuracy - 0.05,
                "step": step,
            },
            fmt="torch",
            write=lambda handle: handle.write(b"weights"),
        )
        held = reservations.reserve(
            db,
            "default",
            dataset,
            event=parse_event({"kind": "pure_dp", "epsilon": 0.2 * version}),
            batch_ids=[batch],
        ).to_json()
        answer = reservations.commit(
            db, "default", held["id"], release={"model": model, "version": version}
        ).to_json()
        registry.publish(db, artifacts, staged, certificate_id=answer["certificate"]["id"])
    jobs.leases.finish(db, claimed.lease, "succeeded", metrics={"accuracy": 0.74, LONG_METRIC: 0.69})
    return job


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    _require_browser()
    folder = tmp_path_factory.mktemp("models")
    url = f"sqlite:///{folder / 'ledger.db'}"
    artifacts = folder / "artifacts"
    server = start_server(url, env={"LEDGER_ARTIFACT_DIR": str(artifacts)})
    db = Database(url, pool_size=1, max_overflow=0)
    try:
        api = Api(server.base_url, server.admin_key)
        external = api.dataset(
            "external-trainer", {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
        )
        _, batches = api.task(external, "train", [f"part-{i}" for i in range(4)])
        with LedgerClient(server.base_url, server.admin_key) as ledger:
            certificate = ""
            for version, accuracy in ((1, 0.82), (2, 0.88)):
                weights = f"weights of v{version}".encode() * 16
                with ledger.release_gate(
                    external, batches, DPSGD, model="opacus-mlp", version=version
                ) as gate:
                    gate.artifact_sha256 = hashlib.sha256(weights).hexdigest()
                certificate = gate.certificate["id"]
                ledger.register_model_version(
                    "opacus-mlp",
                    version,
                    weights,
                    certificate_id=certificate,
                    architecture="MLP 64-32-10 (ReLU), Opacus GradSampleModule",
                    preprocessing="pixels / 16, flattened to 64 floats",
                    metrics={"accuracy": accuracy, LONG_METRIC: accuracy - 0.04},
                )
            # a charge still held: the over-releases chart shows it on top
            api.post(f"/v1/datasets/{external}/reservations", {"batches": batches[:1], "event": DPSGD})

        trained = api.dataset(
            "worker-trained", {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"}
        )
        _, (batch,) = api.task(trained, "all", ["everything"])
        datasets.set_data_source(db, "default", trained, data_source="builtin:digits")
        done = _checkpoints(db, artifacts, trained, batch)
        # a running job holding its reservation, nothing committed yet
        running = str(
            jobs.queue.create_job(
                db,
                "default",
                dataset_id=trained,
                algorithm="dp_sgd",
                params={"noise_multiplier": 1.0, "steps": 50},
            ).id
        )
        claimed = jobs.leases.claim(db, "browser-test-worker", lease_s=600)
        assert claimed is not None and claimed.lease.job_id == running
        jobs.leases.record_plan(db, claimed.lease, plan={"steps": 50}, total_steps=50)
        held = reservations.reserve(
            db, "default", trained, event=parse_event({"kind": "pure_dp", "epsilon": 0.75}), batch_ids=[batch]
        ).to_json()
        jobs.leases.record_reservation(db, claimed.lease, held["id"])
        jobs.leases.record_progress(db, claimed.lease, step=12, metrics={LONG_METRIC: 0.5, "loss": 1.1})

        lifelong = api.dataset(
            "lifelong-full", {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"}
        )
        _, (memory,) = api.task(lifelong, "task-1", ["memory"])
        api.release(lifelong, {"batches": [memory]}, 1.0, "l2dp", 1, commitment="m")
        for k in (2, 3):
            _, (fresh,) = api.task(lifelong, f"task-{k}", [f"task-{k}"])
            api.release(lifelong, {"batches": [fresh, memory]}, 1.0, "l2dp", k, commitment="m")
        api.client.close()
        viewer = tenancy.create_api_key(db, "default", "viewer")
    except BaseException:
        db.dispose()
        stop_server(server.process)
        raise
    db.dispose()
    try:
        yield World(server, viewer, external, trained, lifelong, running, done, "0.75", certificate)
    finally:
        stop_server(server.process)


@pytest.fixture(scope="module")
def driver(world: World) -> Iterator[Any]:
    with signed_in(world.server.base_url, world.viewer_key, WIDTH) as browser:
        yield browser


def _shot(driver: Any, name: str) -> None:
    shot(driver, name, WIDTH)


def test_models_index_privacy_utility_and_an_external_version(driver: Any, world: World) -> None:
    from selenium.webdriver.common.by import By

    models = world.get("/v1/models")
    go(driver, "#/models")
    rows = wait_for("the models table", lambda: all_of(driver, "#models-table tbody tr"))
    shown = {r.get_attribute("data-model"): r for r in rows}
    assert set(shown) == {m["name"] for m in models["data"]} and "opacus-mlp" in shown
    opacus = shown["opacus-mlp"]
    assert opacus.find_element(By.CSS_SELECTOR, "td.versions").text == "2"
    assert opacus.find_element(By.CSS_SELECTOR, "td.external").text == "2"
    assert "external-trainer" in opacus.text  # the dataset by name
    assert text_of(driver, "nav a.active") == "Models"
    _shot(driver, "30-models-index")

    go(driver, "#/models/opacus-mlp")
    points = wait_for("the privacy-utility points", lambda: all_of(driver, "#privacy-utility .pu-point"))
    versions = world.get("/v1/models/opacus-mlp/versions")["data"]
    assert sorted(
        (p.get_attribute("data-version"), p.get_attribute("data-epsilon"), p.get_attribute("data-metric"))
        for p in points
    ) == sorted(
        (str(v["version"]), v["guarantee"]["epsilon"], str(v["metrics"]["accuracy"])) for v in versions
    )
    # the metric can be switched; the version table names the origin
    driver.find_element(By.CSS_SELECTOR, f"#utility-metric option[value='{LONG_METRIC}']").click()
    wait_for("the other metric", lambda: all_of(driver, f"#privacy-utility[aria-label^='{LONG_METRIC}']"))
    origins = [
        r.find_elements(By.CSS_SELECTOR, "td")[1].text
        for r in all_of(driver, "#model-versions-table tbody tr")
    ]
    assert origins == ["external", "external"]
    _shot(driver, "31-model-privacy-utility")

    go(driver, "#/models/opacus-mlp/2")
    wait_for(
        "the external version",
        lambda: text_of(driver, "#model-origin").startswith("trained outside the service"),
    )
    assert text_of(driver, "#model-architecture") == "MLP 64-32-10 (ReLU), Opacus GradSampleModule"
    statement = world.get("/v1/models/opacus-mlp/versions/2")["dp_statement"]
    assert (
        driver.find_element(By.ID, "statement-epsilon").get_attribute("data-full")
        == statement["guarantee"]["epsilon"]
    )
    assert "trained outside the service" in text_of(driver, "p.crumbs")
    _shot(driver, "32-model-version-external")
    assert browser_errors(driver) == []


def test_audit_log_page(driver: Any, world: World) -> None:
    go(driver, f"#/audit/{world.external}")
    rows = wait_for("the audit entries", lambda: all_of(driver, "#audit-table tbody tr"))
    chain = world.get(f"/v1/datasets/{world.external}/audit?limit=200")
    assert [r.get_attribute("data-event") for r in rows] == [e["event_type"] for e in chain["data"]]
    assert "model_version.published" in [r.get_attribute("data-event") for r in rows]
    wait_for("the verification", lambda: text_of(driver, "#audit-verify").startswith("chain verified"))
    assert text_of(driver, "#audit-head").startswith(
        f"Head: entry {chain['head']['chain_seq']} · {chain['head']['hash']}"
    )
    assert text_of(driver, "nav a.active") == "Audit log"
    _shot(driver, "33-audit-log")


def test_jobs_show_names_the_reserved_epsilon_and_unbroken_metric_names(driver: Any, world: World) -> None:
    from selenium.webdriver.common.by import By

    go(driver, "#/jobs")
    row = wait_for(
        "the running job", lambda: all_of(driver, f"#jobs-table tr[data-job-id='{world.running_job}']")
    )[0]
    names = row.find_element(By.CSS_SELECTOR, "td.names")
    assert names.find_element(By.CSS_SELECTOR, ".dataset-name").text == "worker-trained"
    assert names.find_element(By.CSS_SELECTOR, ".model-name").text == f"dp_sgd-{world.running_job}"
    epsilon = wait_for(
        "the reserved ε", lambda: row.find_elements(By.CSS_SELECTOR, "td.epsilon .reserved-epsilon")
    )[0]
    assert epsilon.text == world.reserved_epsilon
    # a metric name breaks, if at all, after an underscore: no word of it spans two lines
    metric = row.find_element(By.CSS_SELECTOR, f".metric-name[data-name='{LONG_METRIC}']")
    assert metric.text.replace("\n", "") == LONG_METRIC
    lines_per_word = driver.execute_script(
        "return Array.from(arguments[0].childNodes).filter(n => n.nodeType === 3).map(n => {"
        " const r = document.createRange(); r.selectNodeContents(n);"
        " return new Set(Array.from(r.getClientRects()).map(b => Math.round(b.top))).size; });",
        metric,
    )
    assert lines_per_word and set(lines_per_word) == {1}, lines_per_word
    _shot(driver, "34-jobs-names-reserved")

    go(driver, f"#/jobs/{world.running_job}")
    assert wait_for("the reserved stat", lambda: text_of(driver, "#job-reserved")) == world.reserved_epsilon
    go(driver, f"#/jobs/{world.done_job}")
    curves = wait_for("the metric curves", lambda: all_of(driver, "#metric-curves svg.metric-curve"))
    assert {c.get_attribute("data-metric") for c in curves} >= {"accuracy", "loss"}
    assert len(curves[0].find_elements(By.CSS_SELECTOR, "circle.pt-metric")) == 2
    _shot(driver, "35-job-metric-curves")


def test_dataset_pages_epsilon_over_releases_budget_in_words_and_labels(driver: Any, world: World) -> None:
    from selenium.webdriver.common.by import By

    go(driver, "#/datasets")
    row = wait_for(
        "the row", lambda: all_of(driver, f"#datasets-table tr[data-dataset-id='{world.external}']")
    )[0]
    spend = world.get("/v1/spend")
    (summary,) = [d for d in spend["data"] if d["id"] == world.external]
    assert (
        row.find_element(By.CSS_SELECTOR, "td.delta-budget").get_attribute("data-full")
        == summary["delta_budget"]
    )
    assert row.find_element(By.CSS_SELECTOR, "td.records").text == str(summary["records"]) == "4"
    assert row.find_element(By.CSS_SELECTOR, "td.dataset-id").text == world.external
    _shot(driver, "36-datasets-delta-records-id")

    go(driver, f"#/datasets/{world.external}")
    points = wait_for("the releases", lambda: all_of(driver, "#epsilon-over-time circle.pt-release"))
    releases = world.get(f"/v1/datasets/{world.external}/releases")["data"][::-1]
    assert [p.get_attribute("data-epsilon") for p in points] == [r["epsilon"] for r in releases]
    assert all_of(driver, "#epsilon-over-time rect.held-band")  # the open reservation
    assert Decimal(world.get(f"/v1/datasets/{world.external}/spend")["epsilon_held"]) > 0
    _shot(driver, "37-dataset-epsilon-over-releases")

    go(driver, f"#/certificates/{world.external_certificate}")
    words = wait_for("the budget in words", lambda: text_of(driver, "#cert-budget-words"))
    assert words.startswith("sequential composition under a Rényi privacy filter") and "Budget ε 8," in words
    details = driver.find_element(By.ID, "cert-budget-details")
    assert details.get_attribute("open") is None  # folded away
    assert not driver.find_element(By.ID, "cert-budget").is_displayed()
    _shot(driver, "38-certificate-budget-in-words")

    go(driver, f"#/datasets/{world.lifelong}")
    labels = wait_for("the end labels", lambda: all_of(driver, "#lifelong-curve text.series-label"))
    boxes = sorted(
        (
            driver.execute_script("const b = arguments[0].getBBox(); return [b.y, b.y + b.height];", label)
            for label in labels
        ),
        key=lambda b: b[0],
    )
    assert all(upper[1] <= lower[0] + 0.5 for upper, lower in itertools.pairwise(boxes)), boxes
    _shot(driver, "39-lifelong-labels-apart")
    assert browser_errors(driver) == []
