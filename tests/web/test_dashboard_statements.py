"""Issue 24 §3–4 on the dashboard, in headless Chromium against a real ``ledger serve`` on
SQLite: every number says what it is. The datasets table shows each dataset's (ε, δ) guarantee
beside what its budget used, labelled a budget share where it is a Rényi filter's progress; the
lifelong chart draws the guarantee as its primary series and the filter's progress as a budget
share; a "Remaining" that is a tiny positive is shown at the budget's precision, rounded down: 0
(issue 28), its exact value on hover.

Screenshots go to ``test-artifacts/dashboard/`` (``20-*`` and on).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest

from service.db.session import Database
from service.ledger import tenancy
from tests.service.api.conftest import Server, bearer, start_server, stop_server
from tests.service.api.test_plan_segments import dpsgd
from tests.web.pages import go, sign_in
from tests.web.test_dashboard import (
    Api,
    _require_browser,
    all_of,
    browser_errors,
    headless_chromium,
    screenshot,
    text_of,
    wait_for,
)

pytestmark = pytest.mark.slow

NEARLY_ALL = "0.99999999997002"  # leaves 2.998e-11 of a budget of 1
FILTER_BUDGET = {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
LIFELONG_FILTER = {"rule": "lifelong", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"}
NEARLY_SPENT = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
LIFELONG_TASKS = 3


@dataclass
class World:
    server: Server
    viewer_key: str
    filtered: str
    lifelong: str
    nearly_spent: str

    def get(self, path: str) -> Any:
        answer = httpx.get(self.server.base_url + path, headers=bearer(self.viewer_key), timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()


def _release(api: Api, dataset: str, body: dict[str, Any], model: str, version: int) -> None:
    reservation = api.post(f"/v1/datasets/{dataset}/reservations", body)
    api.post(
        f"/v1/reservations/{reservation['id']}/commit",
        {"release": {"model": model, "version": version}},
        status=200,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    _require_browser()
    folder = tmp_path_factory.mktemp("statements")
    url = f"sqlite:///{folder / 'ledger.db'}"
    server = start_server(url)
    try:
        api = Api(server.base_url, server.admin_key)
        filtered = api.dataset("filtered", FILTER_BUDGET)
        _, batches = api.task(filtered, "train", ["b-1", "b-2"])
        _release(api, filtered, {"batches": batches, "event": dpsgd(0.01, 1.1, 200)}, "filtered", 1)

        lifelong = api.dataset("lifelong-filter", LIFELONG_FILTER)
        _, (memory,) = api.task(lifelong, "task-1", ["memory"])
        for k in range(1, LIFELONG_TASKS + 1):
            read = [memory]
            if k > 1:
                _, (batch,) = api.task(lifelong, f"task-{k}", [f"batch-{k}"])
                read = [batch, memory]
            event = {"kind": "gaussian", "noise_multiplier": 4.0}
            _release(api, lifelong, {"batches": read, "event": event, "noise_commitment": "memory"}, "ll", k)

        nearly = api.dataset(
            "nearly-spent", {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
        )
        _, (one,) = api.task(nearly, "only", ["only"])
        _release(
            api,
            nearly,
            {"batches": [one], "event": {"kind": "pure_dp", "epsilon": float(NEARLY_ALL)}},
            "n",
            1,
        )
        api.client.close()

        db = Database(url, pool_size=1, max_overflow=0)
        try:
            viewer = tenancy.create_api_key(db, "default", "viewer")
        finally:
            db.dispose()
        yield World(server, viewer, filtered, lifelong, nearly)
    finally:
        stop_server(server.process)


@pytest.fixture(scope="module")
def driver(world: World) -> Iterator[Any]:
    with headless_chromium() as chromium:
        yield chromium


def _sign_in(driver: Any, world: World) -> None:
    sign_in(driver, world.server.base_url, world.viewer_key)


def test_the_datasets_table_shows_the_guarantee_beside_the_budget_used(driver: Any, world: World) -> None:
    _sign_in(driver, world)
    rows = wait_for(
        "three datasets",
        lambda: (
            len(all_of(driver, "#datasets-table tbody tr")) == 3
            and all_of(driver, "#datasets-table tbody tr")
        ),
    )
    shown = {row.get_attribute("data-dataset-id"): row for row in rows}
    header = [th.text for th in all_of(driver, "#datasets-table thead th")]
    assert "Guarantee (ε, δ)" in header and "Budget used ε" in header and "Spent ε" not in header
    for dataset_id, row in shown.items():
        spend = world.get(f"/v1/datasets/{dataset_id}/spend")
        guarantee = row.find_element("css selector", "td.guarantee")
        assert guarantee.get_attribute("data-full") == spend["guarantee"]["epsilon"]
        assert guarantee.get_attribute("data-delta") == spend["guarantee"]["delta"]
        spent = row.find_element("css selector", "td.spent")
        assert spent.get_attribute("data-full") == spend["epsilon_spent"]
        assert spent.get_attribute("data-is") == spend["epsilon_spent_is"]
    # A Rényi filter: the guarantee is its budget; what it used is labelled a budget share.
    filtered = shown[world.filtered]
    spend = world.get(f"/v1/datasets/{world.filtered}/spend")
    assert 0 < Decimal(spend["epsilon_spent"]) < 8
    assert filtered.find_element("css selector", "td.guarantee .guarantee-epsilon").text == "8"
    assert filtered.find_element("css selector", "td.guarantee .guarantee-delta").text == "δ 1e-5"
    assert "budget share, not a DP guarantee" in filtered.find_element("css selector", "td.spent").text
    # Basic composition: the spend is the guarantee, nothing labelled a share.
    nearly = shown[world.nearly_spent]
    assert nearly.find_elements("css selector", "td.spent .share-note") == []
    assert nearly.find_element("css selector", "td.guarantee .guarantee-epsilon").text == "1"  # up
    # A tiny positive remaining is shown at the budget's precision, rounded down: 0 (issue 28;
    # the exact value stays on hover and copy).
    remaining = nearly.find_element("css selector", "td.remaining")
    assert world.get(f"/v1/datasets/{world.nearly_spent}/spend")["epsilon_remaining"] == "0.00000000002998"
    assert (remaining.text, remaining.get_attribute("data-full")) == ("0", "0.00000000002998")
    assert "not a DP guarantee" in text_of(driver, "#datasets-note")
    screenshot(driver, "20-datasets-guarantee-and-budget-share")
    go(driver, f"#/datasets/{world.nearly_spent}")
    stat = wait_for("the remaining stat", lambda: all_of(driver, "#stat-remaining"))[0]
    assert (stat.text, stat.get_attribute("data-full")) == ("0", "0.00000000002998")
    screenshot(driver, "21-dataset-tiny-remaining")
    assert browser_errors(driver) == []


def test_the_lifelong_chart_draws_the_guarantee_and_labels_the_filter_progress_a_share(
    driver: Any, world: World
) -> None:
    _sign_in(driver, world)
    go(driver, f"#/datasets/{world.lifelong}")
    guarantee = wait_for(
        "the guarantee series", lambda: all_of(driver, "#lifelong-curve circle.pt-guarantee")
    )
    history = world.get(f"/v1/datasets/{world.lifelong}/epsilon-history")
    spend = world.get(f"/v1/datasets/{world.lifelong}/spend")
    assert "not a DP guarantee" in history["epsilon_is"]
    assert len(guarantee) == len(history["data"]) == LIFELONG_TASKS
    assert [p.get_attribute("data-epsilon") for p in guarantee] == [
        "8"
    ] * LIFELONG_TASKS  # the filter's budget
    assert [p.get_attribute("data-delta") for p in guarantee] == ["0.00001"] * LIFELONG_TASKS
    assert (
        history["guarantee"]
        == {"epsilon": "8", "delta": "0.00001"}
        == {k: spend["guarantee"][k] for k in ("epsilon", "delta")}
    )
    share = all_of(driver, "#lifelong-curve circle.pt-share")
    assert [p.get_attribute("data-epsilon") for p in share] == [p["epsilon"] for p in history["data"]]
    assert all(0 < Decimal(p["epsilon"]) < 8 for p in history["data"])
    caption = text_of(driver, "#curve-caption")
    assert caption.startswith(f"After task {LIFELONG_TASKS} (task-{LIFELONG_TASKS}): guarantee ε 8, δ 1e-5")
    assert "(filter progress, not a DP guarantee)" in caption
    assert text_of(driver, "#lifelong-curve text.guarantee-text") == "guarantee 8"
    assert text_of(driver, "#lifelong-curve text.share-text").endswith("(share)")
    legend = text_of(driver, "#section-lifelong .legend")
    assert "a budget share, not a DP guarantee" in legend
    assert "budget used (filter progress, not a guarantee)" in text_of(driver, "#section-budget")
    screenshot(driver, "22-lifelong-guarantee-and-filter-progress")
    assert browser_errors(driver) == []
