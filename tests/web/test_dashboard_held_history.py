"""Issue 28's remaining dashboard items in headless Chromium at 1400×900, against a real
``ledger serve`` on SQLite, in one browser session: the δ ≥ 1/N warning on a dataset's page, the
"archived" badge (datasets table and the dataset's page), ε spent *and held* at each release
with the budget line and what is held now, and a worker-trained job's per-step curves (its
released iterates) next to its model's privacy–utility view. Values are checked against the
API's own answers.

Screenshots go to ``test-artifacts/dashboard/`` (``40-*`` and on).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import LedgerClient
from service.db.session import Database
from service.ledger import tenancy
from service.training.data import register_source
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
BUDGET = {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"}


@dataclass
class World:
    server: Server
    viewer_key: str
    loose_delta: str  # δ = 0.1 for 10 records: δ ≥ 1/N
    archived: str
    held: str  # releases made while other reservations were open; one still open
    job: str
    model: str

    def get(self, path: str) -> Any:
        answer = httpx.get(self.server.base_url + path, headers=bearer(self.viewer_key), timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()


def _pure(epsilon: float) -> dict[str, Any]:
    return {"kind": "pure_dp", "epsilon": epsilon}


def _seed(server: Server, url: str, artifacts: Path) -> World:
    from service.worker.worker import Worker

    api = Api(server.base_url, server.admin_key)
    loose = api.dataset(
        "loose-delta", {"rule": "sequential", "epsilon": "2", "delta": "0.1", "accountant": "rdp"}
    )
    api.task(loose, "t", [f"b{i}" for i in range(10)])
    archived = api.dataset("retired-survey", BUDGET)
    api.post(f"/v1/datasets/{archived}/archive", status=200)

    held = api.dataset("held-while-released", BUDGET)
    _, batches = api.task(held, "t", ["b0", "b1"])
    target = {"batches": batches}
    first_hold = api.post(f"/v1/datasets/{held}/reservations", {**target, "event": _pure(0.5)})
    api.release(held, target, 0.25, "survey-model", 1)  # held then: 0.5
    api.post(
        f"/v1/reservations/{first_hold['id']}/commit",
        {"release": {"model": "survey-model", "version": 2}},
        200,
    )
    api.post(f"/v1/datasets/{held}/reservations", {**target, "event": _pure(0.75)})  # still open
    api.release(held, target, 0.25, "survey-model", 3)  # held then: 0.75, and now

    with LedgerClient(server.base_url, server.admin_key, timeout=30) as admin:
        digits = admin.create_dataset(
            "digits-curves",
            rule="sequential",
            epsilon="8",
            delta="1e-5",  # the default accountant (tight), with checkpoint commits
            data_source="builtin:digits",
        )
        register_source(admin, digits["id"], batch_size=500)
        params = {
            "model_name": "digits-curves-mlp",
            "noise_multiplier": 1.0,
            "steps": 60,
            "checkpoint_every": 30,
            "expected_batch_size": 64,
            "hidden": 16,
            "seed": 4,
        }
        job = admin.create_job(digits["id"], "dp_sgd", params)["id"]
    db = Database(url, pool_size=1, max_overflow=0)
    try:
        assert Worker(db, artifact_dir=artifacts).run_once() == job
        viewer = tenancy.create_api_key(db, "default", "viewer")
    finally:
        db.dispose()
    api.client.close()
    return World(server, viewer, loose, archived, held, job, "digits-curves-mlp")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    _require_browser()
    folder = tmp_path_factory.mktemp("held")
    url = f"sqlite:///{folder / 'ledger.db'}"
    artifacts = folder / "artifacts"
    server = start_server(url, env={"LEDGER_ARTIFACT_DIR": str(artifacts)})
    try:
        yield _seed(server, url, artifacts)
    finally:
        stop_server(server.process)


@pytest.fixture(scope="module")
def driver(world: World) -> Iterator[Any]:
    with signed_in(world.server.base_url, world.viewer_key, WIDTH) as browser:
        yield browser


def _shot(driver: Any, name: str) -> None:
    shot(driver, name, WIDTH)


def test_delta_warning_and_archived_badges(driver: Any, world: World) -> None:
    from selenium.webdriver.common.by import By

    warnings = world.get(f"/v1/datasets/{world.loose_delta}")["warnings"]
    assert warnings and warnings[0]["code"] == "delta_not_below_one_over_n", warnings
    go(driver, f"#/datasets/{world.loose_delta}")
    shown = wait_for("the δ warning", lambda: all_of(driver, "#dataset-warnings p"))
    assert [p.get_attribute("data-code") for p in shown] == [w["code"] for w in warnings]
    assert warnings[0]["message"] in shown[0].text
    _shot(driver, "40-dataset-delta-warning")

    go(driver, "#/datasets")
    row = wait_for(
        "the archived row", lambda: all_of(driver, f"#datasets-table tr[data-dataset-id='{world.archived}']")
    )[0]
    assert "archived" in (row.get_attribute("class") or "")
    assert row.find_element(By.CSS_SELECTOR, "td.name .archived-badge").text.lower() == "archived"
    others = all_of(driver, "#datasets-table tbody tr:not(.archived) .archived-badge")
    assert others == []  # only the archived dataset is badged
    assert world.get(f"/v1/datasets/{world.archived}")["archived_at"] is not None
    _shot(driver, "41-datasets-archived-badge")

    go(driver, f"#/datasets/{world.archived}")
    badge = wait_for("the page's badge", lambda: all_of(driver, "#dataset-name .archived-badge"))[0]
    assert badge.text.lower() == "archived" and "unarchive" in badge.get_attribute("title")
    _shot(driver, "42-dataset-archived")


def test_epsilon_spent_and_held_at_each_release(driver: Any, world: World) -> None:
    releases = world.get(f"/v1/datasets/{world.held}/releases")["data"][::-1]  # oldest first
    assert [r["held_at_release"]["epsilon"] for r in releases] == ["0.5", "0", "0.75"]
    go(driver, f"#/datasets/{world.held}")
    bars = wait_for("the held bars", lambda: all_of(driver, "#epsilon-over-time rect.held-at-release"))
    assert sorted((b.get_attribute("data-version"), b.get_attribute("data-held")) for b in bars) == [
        ("1", "0.5"),
        ("3", "0.75"),
    ]
    # each bar stands on that release's spent point and is as tall as what was held then
    for bar in bars:
        (point,) = all_of(
            driver,
            f"#epsilon-over-time circle.pt-release[data-version='{bar.get_attribute('data-version')}']",
        )
        bottom = float(bar.get_attribute("y")) + float(bar.get_attribute("height"))
        assert abs(bottom - float(point.get_attribute("cy"))) < 0.6
    assert all_of(driver, "#epsilon-over-time rect.held-now")
    assert world.get(f"/v1/datasets/{world.held}/spend")["epsilon_held"] == "0.75"
    assert all_of(driver, "#epsilon-over-time line.budget-line")
    assert "held then 0.75" in text_of(driver, "#epsilon-over-time-caption")
    _shot(driver, "43-dataset-epsilon-spent-and-held")


def test_job_curves_of_released_iterates_and_the_privacy_utility_view(driver: Any, world: World) -> None:
    from selenium.webdriver.common.by import By

    job = world.get(f"/v1/jobs/{world.job}")
    assert job["status"] == "succeeded", job["error"]
    points = job["metric_history"]["points"]
    go(driver, f"#/jobs/{world.job}")
    curves = wait_for("the per-step curves", lambda: all_of(driver, "#history-curves svg.history-curve"))
    assert {c.get_attribute("data-metric") for c in curves} == {"test_loss", "test_accuracy"}
    for curve in curves:
        assert curve.get_attribute("data-points") == str(len(points))
        dots = curve.find_elements(By.CSS_SELECTOR, "circle.pt-checkpoint")
        assert [d.get_attribute("data-step") for d in dots] == ["30", "60"]
    assert f"{len(points)} points, every {job['metric_history']['every']} steps" in text_of(
        driver, "#history-note"
    )
    _shot(driver, "44-job-metrics-per-step")

    go(driver, f"#/models/{world.model}")
    dots = wait_for("the privacy-utility points", lambda: all_of(driver, "#privacy-utility .pu-point"))
    versions = world.get(f"/v1/models/{world.model}/versions")["data"]
    assert sorted((d.get_attribute("data-version"), d.get_attribute("data-epsilon")) for d in dots) == sorted(
        (str(v["version"]), v["guarantee"]["epsilon"]) for v in versions
    )
    _shot(driver, "45-model-privacy-utility-of-a-job")
    assert browser_errors(driver) == []
