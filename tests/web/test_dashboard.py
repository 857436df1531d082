"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium, against a real ``ledger serve`` subprocess on SQLite.

The data is seeded over HTTP with the bootstrap admin key: a sequential dataset with three tasks
(230 batches, so the heatmap has two pages), releases and an open reservation; a lifelong
dataset whose first task's episodic memory is replayed at every later task; a geometric dataset
whose blocks use different levels; and a training job. The browser signs in with a *viewer* key
and the tests assert the values shown against the API's own answers. The job's progress is
advanced by the worker's own job operations (``service.ledger.jobs``: claim, plan, progress,
finish) on the same database while the page stays open, so the page must update by itself.

Screenshots of every page go to ``test-artifacts/dashboard/``. Without Chromium (or Selenium)
the tests skip — unless ``CI`` is set, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from service.db.session import Database
from service.ledger import jobs, tenancy
from service.training.data import register_source
from tests.service.api.conftest import ROOT, Server, bearer, start_server, stop_server

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
DOWNLOADS = Path(tempfile.mkdtemp(prefix="ledger-downloads-"))
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)
WAIT_S = 10.0

T = TypeVar("T")


def _require_browser() -> None:
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        message = "browser tests need " + ", ".join(missing) + " (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI is set, so this is a failure")
        pytest.skip(message)


# ---------------------------------------------------------------------------------------------
# The seeded ledger


@dataclass
class Seeded:
    server: Server
    database_url: str
    viewer_key: str
    sequential: str
    lifelong: str
    geometric: str
    job: str
    lifelong_tasks: int
    long_decimals: str  # a lifelong dataset whose charges have 18 significant digits
    digits: str  # an RDP dataset a real DP-SGD job trained on
    trained_job: str  # that job: succeeded, one published version of TRAINED_MODEL
    failed_job: str  # a job the ledger refused (budget_exceeded)

    def get(self, path: str) -> Any:
        answer = httpx.get(self.server.base_url + path, headers=bearer(self.viewer_key), timeout=10)
        assert answer.status_code == 200, answer.text
        return answer.json()


class Api:
    def __init__(self, base_url: str, key: str) -> None:
        self.client = httpx.Client(base_url=base_url, headers=bearer(key), timeout=30)
        self.serial = 0

    def post(self, path: str, body: dict[str, Any] | None = None, status: int = 201) -> Any:
        answer = self.client.post(path, json=body)
        assert answer.status_code == status, f"{path}: {answer.status_code} {answer.text}"
        return answer.json()

    def dataset(self, name: str, budget: dict[str, Any], source: str | None = None) -> str:
        body: dict[str, Any] = {"name": name, "budget": budget}
        if source is not None:  # the records its jobs train on
            body["data_source"] = source
        return str(self.post("/v1/datasets", body)["id"])

    def task(self, dataset: str, name: str, batches: list[str]) -> tuple[str, list[str]]:
        task = self.post(f"/v1/datasets/{dataset}/tasks", {"name": name})["id"]
        created = self.post(
            f"/v1/datasets/{dataset}/tasks/{task}/batches",
            {"batches": [{"name": b, "records": [f"{dataset}:{name}:{b}"]} for b in batches]},
        )
        return task, [b["id"] for b in created["data"]]

    def release(
        self,
        dataset: str,
        target: dict[str, Any],
        epsilon: float,
        model: str,
        version: int,
        commitment: str | None = None,
        commit: bool = True,
    ) -> Any:
        body: dict[str, Any] = {**target, "event": {"kind": "pure_dp", "epsilon": epsilon}}
        if commitment is not None:
            body["noise_commitment"] = commitment
        reservation = self.post(f"/v1/datasets/{dataset}/reservations", body)
        if not commit:
            return reservation
        return self.post(
            f"/v1/reservations/{reservation['id']}/commit",
            {"release": {"model": model, "version": version}},
            status=200,
        )


TRAINED_MODEL = "digits-mlp"
TRAINED_PARAMS = {
    "model_name": TRAINED_MODEL,
    "noise_multiplier": 1.0,
    "steps": 40,
    "expected_batch_size": 64,
    "max_grad_norm": 1.2,
    "seed": 1,
}
LONG_EPSILON = 0.12345678901234568  # a JSON number: the ledger keeps its 17 significant digits


def _seed_trained(server: Server, database_url: str, artifact_dir: Path) -> tuple[str, str, str]:
    """An RDP dataset registered from ``builtin:digits`` (the client's helper), a DP-SGD job the
    worker trains for real (run here, on the server's database and artifact folder), and a job
    the ledger refuses at reserve (its run costs more than the budget)."""
    from service.client import LedgerClient
    from service.worker.worker import Worker

    with LedgerClient(server.base_url, server.admin_key, timeout=30) as admin:
        digits = admin.create_dataset(
            "digits-dp", rule="sequential", epsilon="8", delta="1e-5", data_source="builtin:digits"
        )
        register_source(admin, digits["id"], batch_size=500)
        trained = admin.create_job(digits["id"], "dp_sgd", TRAINED_PARAMS)["id"]
        failed = admin.create_job(
            digits["id"],
            "dp_sgd",
            {"model_name": "too-costly", "noise_multiplier": 0.3, "steps": 3000, "expected_batch_size": 64},
        )["id"]
    db = Database(database_url, pool_size=1, max_overflow=0)
    try:
        worker = Worker(db, artifact_dir=artifact_dir)
        assert worker.run_once() == trained and worker.run_once() == failed
    finally:
        db.dispose()
    return digits["id"], trained, failed


def _seed(server: Server, database_url: str, artifact_dir: Path) -> Seeded:
    api = Api(server.base_url, server.admin_key)

    sequential = api.dataset(
        "clinical-notes",
        {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"},
        source="builtin:digits",  # the job below trains on the dataset's own source
    )
    intake, intake_batches = api.task(sequential, "intake", [f"week-{i:03d}" for i in range(120)])
    triage, _ = api.task(sequential, "triage", [f"week-{i:03d}" for i in range(80)])
    followup, _ = api.task(sequential, "follow-up", [f"week-{i:03d}" for i in range(30)])
    api.release(sequential, {"tasks": [intake]}, 0.5, "notes-classifier", 1)
    api.release(sequential, {"tasks": [triage]}, 0.25, "notes-classifier", 2)
    api.release(sequential, {"batches": intake_batches[:40]}, 0.3, "notes-classifier", 3)
    api.release(sequential, {"tasks": [followup]}, 0.2, "notes-classifier", 4, commit=False)  # held

    lifelong = api.dataset(
        "sensor-stream", {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"}
    )
    tasks = 6
    _, (memory,) = api.task(lifelong, "task-1", ["task-1/memory"])
    api.release(lifelong, {"batches": [memory]}, 0.4, "l2dp-ml", 1, commitment="l2dp-perturbation")
    for k in range(2, tasks + 1):
        # Task k perturbs its own batch once and replays task 1's perturbed episodic memory.
        _, (batch,) = api.task(lifelong, f"task-{k}", [f"task-{k}/batch"])
        api.release(lifelong, {"batches": [batch, memory]}, 0.4, "l2dp-ml", k, commitment="l2dp-perturbation")

    geometric = api.dataset(
        "sliding-window",
        {
            "rule": "geometric",
            "epsilon": "1",
            "delta": "0",
            "accountant": "basic",
            "geometric": {"first": "0.5", "ratio": "0.5"},
        },
    )
    _, blocks = api.task(geometric, "window", ["block-1", "block-2", "block-3", "block-4"])
    version = 0
    for block, charges in zip(blocks, ([0.5, 0.25, 0.1], [0.2], [0.06], []), strict=True):
        for epsilon in charges:
            version += 1
            api.release(geometric, {"batches": [block]}, epsilon, "window-model", version)

    long_decimals = api.dataset(
        "long-decimals", {"rule": "lifelong", "epsilon": "1", "delta": "0", "accountant": "basic"}
    )
    _, (long_memory,) = api.task(long_decimals, "first", ["first/memory"])
    for k, name in enumerate(("first", "second-task-with-a-long-name", "third")):
        batches = [long_memory]
        if k:
            _, (batch,) = api.task(long_decimals, name, [f"{name}/batch"])
            batches = [batch, long_memory]
        body = {
            "batches": batches,
            "event": {"kind": "pure_dp", "epsilon": LONG_EPSILON},
            "noise_commitment": "memory",
        }
        reservation = api.post(f"/v1/datasets/{long_decimals}/reservations", body)
        api.post(
            f"/v1/reservations/{reservation['id']}/commit",
            {"release": {"model": "long", "version": k + 1}},
            status=200,
        )

    digits, trained_job, failed_job = _seed_trained(server, database_url, artifact_dir)

    job = api.post(
        "/v1/jobs",
        {
            "dataset_id": sequential,
            "algorithm": "dp_sgd",
            "params": {
                "model_name": "notes-dp-sgd",
                # a fixed σ: the budget's δ is 0, and a job's delta must be its budget's (§5)
                "noise_multiplier": 1.0,
                "epochs": 2,
            },
        },
    )["id"]

    db = Database(database_url, pool_size=1, max_overflow=0)
    try:
        viewer = tenancy.create_api_key(db, "default", "viewer")
    finally:
        db.dispose()
    api.client.close()
    return Seeded(
        server,
        database_url,
        viewer,
        sequential,
        lifelong,
        geometric,
        job,
        tasks,
        long_decimals,
        digits,
        trained_job,
        failed_job,
    )


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    _require_browser()
    folder = tmp_path_factory.mktemp("dashboard")
    url = f"sqlite:///{folder / 'ledger.db'}"
    artifact_dir = folder / "artifacts"
    server = start_server(url, env={"LEDGER_ARTIFACT_DIR": str(artifact_dir)})
    try:
        yield _seed(server, url, artifact_dir)
    finally:
        stop_server(server.process)


@contextmanager
def headless_chromium(downloads: Path | None = None) -> Iterator[Any]:
    """Debian's Chromium under ChromeDriver, headless, in a fresh profile, keeping the browser
    log (``browser_errors``); ``downloads``: where files the page saves land. Quit and its profile
    removed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="ledger-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if downloads is not None:
        downloads.mkdir(parents=True, exist_ok=True)
        options.add_experimental_option(
            "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
        )
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    if downloads is not None:
        driver.execute_cdp_cmd(
            "Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
        )
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(seeded: Seeded) -> Iterator[Any]:
    with headless_chromium(DOWNLOADS) as driver:
        yield driver


# ---------------------------------------------------------------------------------------------
# Helpers


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = WAIT_S) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except Exception as exc:  # the element may not exist yet, or be replaced mid-read
            last_error = exc
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error!r})")


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def all_of(driver: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, css))


def go(driver: Any, seeded: Seeded, hash_route: str) -> None:
    driver.execute_script("window.location.hash = arguments[0];", hash_route)


def screenshot(driver: Any, name: str, width: int = 1280) -> Path:
    """A full-page screenshot (the window is stretched to the page's height first)."""
    height = int(driver.execute_script("return Math.ceil(document.documentElement.scrollHeight);"))
    driver.set_window_size(width, max(900, min(height + 20, 6000)))
    driver.execute_script("window.scrollTo(0, 0);")
    time.sleep(0.15)  # let layout settle at the new size
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 900)
    return path


def sign_in(driver: Any, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By

    if driver.execute_script("return window.sessionStorage.getItem('privacy-ledger.api-key');"):
        return
    driver.get(seeded.server.base_url + "/#/signin")
    field = wait_for("the key field", lambda: driver.find_element(By.ID, "api-key"))
    field.send_keys(seeded.viewer_key)
    driver.find_element(By.ID, "signin-submit").click()
    wait_for("the datasets table", lambda: all_of(driver, "#datasets-table tbody tr"))


def browser_errors(driver: Any) -> list[str]:
    """Console errors other than the HTTP errors a test provokes on purpose."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "Failed to load resource" not in entry["message"]
    ]


# ---------------------------------------------------------------------------------------------
# Pages


def test_sign_in_refuses_a_bad_key_and_keeps_a_good_one_in_session_storage_only(
    browser: Any, seeded: Seeded
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(seeded.server.base_url + "/")
    wait_for("the sign-in page", lambda: browser.current_url.endswith("#/signin"))
    field = browser.find_element(By.ID, "api-key")
    assert field.get_attribute("type") == "password"
    field.send_keys("pl_not_a_key")
    browser.find_element(By.ID, "signin-submit").click()
    message = wait_for(
        "the refusal",
        lambda: "401" in text_of(browser, "#signin-message") and text_of(browser, "#signin-message"),
    )
    assert "unknown or revoked" in message
    assert browser.execute_script("return window.sessionStorage.length;") == 0
    screenshot(browser, "01-sign-in-refused")

    field = browser.find_element(By.ID, "api-key")
    field.clear()
    sign_in(browser, seeded)
    assert browser.current_url.endswith("#/datasets")
    stored = browser.execute_script("return window.sessionStorage.getItem('privacy-ledger.api-key');")
    assert stored == seeded.viewer_key
    assert browser.execute_script("return window.localStorage.length;") == 0
    assert browser.execute_script("return document.cookie;") == ""


def test_datasets_table_shows_the_apis_spend(browser: Any, seeded: Seeded) -> None:
    sign_in(browser, seeded)
    go(browser, seeded, "#/datasets")
    rows = wait_for(
        "five datasets",
        lambda: (
            len(all_of(browser, "#datasets-table tbody tr")) == 5
            and all_of(browser, "#datasets-table tbody tr")
        ),
    )
    shown = {row.get_attribute("data-dataset-id"): row for row in rows}
    assert set(shown) == {
        seeded.sequential,
        seeded.lifelong,
        seeded.geometric,
        seeded.long_decimals,
        seeded.digits,
    }
    for dataset_id, row in shown.items():
        spend = seeded.get(f"/v1/datasets/{dataset_id}/spend")
        cells = {
            name: row.find_element("css selector", f"td.{name}").get_attribute("data-full")
            for name in ("budget", "spent", "remaining", "held")
        }
        cells["rule"] = row.find_element("css selector", "td.rule").text
        cells["last-release"] = row.find_element("css selector", "td.last-release").text
        assert cells["budget"] == spend["epsilon_budget"]
        assert cells["spent"] == spend["epsilon_spent"]
        assert cells["remaining"] == spend["epsilon_remaining"]
        assert cells["held"] == spend["epsilon_held"]
        assert cells["rule"].startswith(spend["rule"])
        release = spend["last_release"]
        assert cells["last-release"].startswith(f"{release['model']} v{release['version']}")
    sequential = shown[seeded.sequential]
    assert (
        sequential.find_element("css selector", "td.spent").text,
        sequential.find_element("css selector", "td.remaining").text,
    ) == ("0.8", "2.2")
    # Every resource the page loaded came from this server (no CDN, no outside font).
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert resources and all(url.startswith(seeded.server.base_url) for url in resources), resources
    screenshot(browser, "02-datasets")
    assert browser_errors(browser) == []


def test_sequential_dataset_gauge_task_bars_paged_heatmap_and_timeline(browser: Any, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, seeded)
    go(browser, seeded, f"#/datasets/{seeded.sequential}")
    label = wait_for("the gauge", lambda: text_of(browser, "#gauge-label"))
    spend = seeded.get(f"/v1/datasets/{seeded.sequential}/spend")
    assert label == (
        f"spent {spend['epsilon_spent']} · held {spend['epsilon_held']} · "
        f"remaining {spend['epsilon_remaining']} of ε {spend['epsilon_budget']}"
    )
    assert label == "spent 0.8 · held 0.2 · remaining 2.2 of ε 3"

    bars = all_of(browser, "#task-bars rect.bar")
    assert len(bars) == len(spend["tasks"]) == 3
    assert [b.get_attribute("data-epsilon") for b in bars] == [t["epsilon_spent"] for t in spend["tasks"]]
    assert [b.get_attribute("data-epsilon") for b in bars] == ["0.8", "0.25", "0"]

    first_page = seeded.get(f"/v1/datasets/{seeded.sequential}/batch-spend?limit=200&offset=0")
    cells = all_of(browser, "#heatmap rect.cell")
    assert len(cells) == 200
    assert text_of(browser, "#heatmap-range") == "1–200 of 230"
    assert [c.get_attribute("data-epsilon") for c in cells] == [
        b["epsilon_spent"] for b in first_page["data"]
    ]
    assert len(all_of(browser, "#heatmap rect.cell-held")) == 0  # the held task's batches are on page 2

    timeline = all_of(browser, "#timeline li.release")
    releases = seeded.get(f"/v1/datasets/{seeded.sequential}/releases")
    assert [li.get_attribute("data-certificate-id") for li in timeline] == [
        r["certificate_id"] for r in releases["data"]
    ]
    assert len(timeline) == 3
    assert timeline[0].find_element(By.CSS_SELECTOR, ".release-name").text == "notes-classifier v3"
    screenshot(browser, "03-dataset-sequential")

    browser.find_element(By.ID, "heatmap-next").click()
    wait_for("the second heatmap page", lambda: text_of(browser, "#heatmap-range") == "201–230 of 230")
    cells = all_of(browser, "#heatmap rect.cell")
    assert len(cells) == 30
    assert len(all_of(browser, "#heatmap rect.cell-held")) == 30  # follow-up: the open reservation
    screenshot(browser, "04-dataset-sequential-heatmap-page-2")


def test_certificate_shows_rule_theorem_inputs_and_verifies_on_the_server(
    browser: Any, seeded: Seeded
) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, seeded)
    go(browser, seeded, f"#/datasets/{seeded.sequential}")
    first = wait_for("a release", lambda: all_of(browser, "#timeline li.release a.release-name"))[0]
    certificate_id = first.find_element(By.XPATH, "./ancestor::li").get_attribute("data-certificate-id")
    first.click()
    wait_for("the certificate page", lambda: text_of(browser, "#cert-rule") == "sequential")
    stored = seeded.get(f"/v1/certificates/{certificate_id}")
    body = stored["certificate"]
    assert text_of(browser, "#cert-theorem") == body["theorem"] and body["theorem"]
    assert text_of(browser, "#cert-accountant") == "basic"
    assert text_of(browser, "#cert-hash") == stored["content_hash"]
    assert (
        browser.find_element(By.CSS_SELECTOR, "#cert-epsilon [data-full]").get_attribute("data-full")
        == (body["result"]["epsilon"])
    )
    assert (
        json.loads(browser.find_element(By.ID, "cert-event").get_attribute("textContent"))
        == (body["inputs"]["charge"])
    )
    # 40 batches in one state: one class, one row
    assert len(all_of(browser, "#cert-batches tbody tr")) == len(body["inputs"]["classes"]) == 1
    assert body["inputs"]["batch_set"]["count"] == 40
    assert "40 batches" in text_of(browser, "#cert-batches tbody tr")
    assert text_of(browser, "#verify-result") == "not verified yet"
    key_id = body["signature"]["key_id"]
    assert text_of(browser, "#cert-signer") == f"{key_id} (Ed25519)"
    assert text_of(browser, "#signature-result") == f"signed by key {key_id} — not checked yet"

    browser.find_element(By.ID, "verify-button").click()
    result = wait_for(
        "the verification",
        lambda: text_of(browser, "#verify-result").startswith("valid") and text_of(browser, "#verify-result"),
    )
    assert "ok" in browser.find_element(By.ID, "verify-result").get_attribute("class")
    assert result.startswith("valid — ")
    assert text_of(browser, "#signature-result") == f"signed by key {key_id} (active) — valid"
    assert "ok" in browser.find_element(By.ID, "signature-result").get_attribute("class")
    screenshot(browser, "05-certificate-verified")


def test_lifelong_dataset_curve_of_ledger_epsilon_against_naive_sequential(
    browser: Any, seeded: Seeded
) -> None:
    sign_in(browser, seeded)
    go(browser, seeded, f"#/datasets/{seeded.lifelong}")
    ledger = wait_for("the lifelong curve", lambda: all_of(browser, "#lifelong-curve circle.pt-ledger"))
    naive = all_of(browser, "#lifelong-curve circle.pt-naive")
    history = seeded.get(f"/v1/datasets/{seeded.lifelong}/epsilon-history")
    spend = seeded.get(f"/v1/datasets/{seeded.lifelong}/spend")
    assert len(ledger) == len(naive) == len(history["data"]) == seeded.lifelong_tasks
    assert [p.get_attribute("data-epsilon") for p in ledger] == [p["epsilon"] for p in history["data"]]
    assert [p.get_attribute("data-epsilon") for p in naive] == [
        p["naive_sequential_epsilon"] for p in history["data"]
    ]
    # The last points: the ledger's ε stays at one perturbation, the naive sum grows per task.
    assert [p.get_attribute("data-epsilon") for p in ledger[-2:]] == ["0.4", "0.4"]
    assert [p.get_attribute("data-epsilon") for p in naive[-2:]] == ["2", "2.4"]
    assert (ledger[-1].get_attribute("data-epsilon"), naive[-1].get_attribute("data-epsilon")) == (
        spend["epsilon_spent"],
        spend["naive_sequential_epsilon"],
    )
    # ... and the naive curve is drawn above the ledger's at the last task.
    assert float(naive[-1].get_attribute("cy")) < float(ledger[-1].get_attribute("cy"))
    caption = text_of(browser, "#curve-caption")
    assert caption.startswith(
        "After task 6 (task-6): guarantee ε 0.4, δ 0 · naive sequential ε 2.4 (6× the guarantee)"
    )
    points = all_of(browser, "#lifelong-curve circle.pt-guarantee")
    guarantee = [p.get_attribute("data-epsilon") for p in points]
    assert guarantee == [p["guarantee"]["epsilon"] for p in history["data"]]
    assert guarantee[-1] == spend["guarantee"]["epsilon"] == "0.4"
    assert len(all_of(browser, "#task-bars rect.bar")) == seeded.lifelong_tasks
    assert all_of(browser, "#task-bars line.naive-mark")  # task 1's memory batch: naive > ledger
    screenshot(browser, "06-dataset-lifelong")


def test_geometric_dataset_levels_per_block(browser: Any, seeded: Seeded) -> None:
    sign_in(browser, seeded)
    go(browser, seeded, f"#/datasets/{seeded.geometric}")
    blocks = wait_for("the level grid", lambda: all_of(browser, "#levels g.block"))
    page = seeded.get(f"/v1/datasets/{seeded.geometric}/batch-spend")
    assert [b.get_attribute("data-levels") for b in blocks] == [
        ",".join(map(str, b["levels"])) for b in page["data"]
    ]
    assert [b.get_attribute("data-levels") for b in blocks] == ["0,1,2", "1", "3", ""]
    used = [len(b.find_elements("css selector", "rect.level.used")) for b in blocks]
    assert used == [3, 1, 1, 0]
    spend = seeded.get(f"/v1/datasets/{seeded.geometric}/spend")
    assert text_of(browser, "#gauge-label") == (
        f"spent {spend['epsilon_spent']} · held 0 · remaining {spend['epsilon_remaining']} of ε 1"
    )
    assert spend["epsilon_spent"] == "0.875"  # block 1: 0.5 + 0.25 + 0.125, its levels' allowances
    assert len(all_of(browser, "#timeline li.release")) == 5
    screenshot(browser, "07-dataset-geometric")


def test_jobs_show_live_progress_without_reloading(browser: Any, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, seeded)
    go(browser, seeded, "#/jobs")
    row = wait_for("the job row", lambda: all_of(browser, f"#jobs-table tr[data-job-id='{seeded.job}']"))[0]
    assert row.find_element(By.CSS_SELECTOR, "td.status").text == "queued"
    screenshot(browser, "08-jobs")

    go(browser, seeded, f"#/jobs/{seeded.job}")
    wait_for("the job page", lambda: text_of(browser, "#job-status") == "queued")
    assert text_of(browser, "#job-progress-text") == "0 / ? steps"
    browser.execute_script("window.__not_reloaded = true;")

    # A worker claims the job and reports progress, through the worker's own job operations.
    db = Database(seeded.database_url, pool_size=1, max_overflow=0)
    try:
        claimed = jobs.leases.claim(db, "browser-test-worker", lease_s=60)
        assert claimed is not None and claimed.lease.job_id == seeded.job
        lease = claimed.lease
        jobs.leases.record_plan(db, lease, plan={"steps": 100}, total_steps=100)
        jobs.leases.record_progress(
            db, lease, step=40, epsilon_committed=Decimal("0.35"), metrics={"accuracy": 0.8125, "loss": 0.52}
        )
        wait_for("step 40", lambda: text_of(browser, "#job-progress-text") == "40 / 100 steps (40%)")
        assert text_of(browser, "#job-status") == "running"
        assert text_of(browser, "#job-epsilon") == "0.35"
        metric_rows = {
            r.get_attribute("data-metric"): r.find_element(By.CSS_SELECTOR, "td").text
            for r in all_of(browser, "#job-metrics tr")
        }
        assert metric_rows == {"accuracy": "0.8125", "loss": "0.52"}
        screenshot(browser, "09-job-live-progress")

        jobs.leases.record_progress(
            db, lease, step=100, epsilon_committed=Decimal("0.9"), metrics={"accuracy": 0.9, "loss": 0.31}
        )
        jobs.leases.finish(db, lease, "succeeded", metrics={"accuracy": 0.9, "loss": 0.31})
    finally:
        db.dispose()
    wait_for("the finished job", lambda: text_of(browser, "#job-status") == "succeeded")
    assert text_of(browser, "#job-progress-text") == "100 / 100 steps (100%)"
    assert text_of(browser, "#job-epsilon") == "0.9"
    assert browser.execute_script("return window.__not_reloaded === true;")  # same page all along
    assert browser_errors(browser) == []


# ---------------------------------------------------------------------------------------------
# Issue 16: the rough edges a trial found, each with its screenshot


def _boxes(driver: Any, css: str) -> list[dict[str, float]]:
    """Each SVG element's box in its SVG's user units, with the viewBox width as ``limit``."""
    return list(
        driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => {"
            "  const b = e.getBBox(); const svg = e.ownerSVGElement;"
            "  return {x: b.x, y: b.y, right: b.x + b.width, bottom: b.y + b.height,"
            "          limit: svg.viewBox.baseVal.width, height: svg.viewBox.baseVal.height}; });",
            css,
        )
    )


def test_spend_per_task_value_labels_fit_and_naive_marks_stay_on_the_axis(
    browser: Any, seeded: Seeded
) -> None:
    sign_in(browser, seeded)
    go(browser, seeded, f"#/datasets/{seeded.long_decimals}")
    labels = wait_for("the task bars", lambda: all_of(browser, "#task-bars text.bar-value"))
    spend = seeded.get(f"/v1/datasets/{seeded.long_decimals}/spend")
    assert [t.get_attribute("data-full") for t in labels] == [t["epsilon_spent"] for t in spend["tasks"]]
    # 17 significant digits: three reads of the memory batch, each charged alone
    assert spend["tasks"][0]["naive_sequential_epsilon"] == str(3 * Decimal(repr(LONG_EPSILON)))
    # 4 significant digits, spends rounded up: never shown below what the ledger holds.
    assert labels[0].text == "0.1235 (naive 0.3704)"
    boxes = _boxes(browser, "#task-bars text.bar-value")
    assert boxes and all(0 <= b["x"] and b["right"] <= b["limit"] for b in boxes), boxes
    # Every naive mark lies on the axis, whose end is its last tick.
    axis_end = float(browser.find_element("css selector", "#task-bars line.axis").get_attribute("x2"))
    marks = [float(m.get_attribute("x1")) for m in all_of(browser, "#task-bars line.naive-mark")]
    assert marks and all(x <= axis_end + 1e-9 for x in marks), (marks, axis_end)
    ticks = [t.text for t in all_of(browser, "#task-bars text.tick")]
    assert float(ticks[-1]) >= max(float(t["naive_sequential_epsilon"]) for t in spend["tasks"])
    screenshot(browser, "12-task-bars-labels-fit")

    # The lifelong chart's end labels stay inside the chart.
    go(browser, seeded, f"#/datasets/{seeded.lifelong}")
    wait_for("the lifelong curve", lambda: all_of(browser, "#lifelong-curve text.series-label"))
    for dataset in (seeded.lifelong, seeded.long_decimals):
        go(browser, seeded, f"#/datasets/{dataset}")
        wait_for("the end labels", lambda: len(all_of(browser, "#lifelong-curve text.series-label")) == 3)
        boxes = _boxes(browser, "#lifelong-curve text.series-label")
        assert all(
            0 <= b["x"] and b["right"] <= b["limit"] and 0 <= b["y"] and b["bottom"] <= b["height"]
            for b in boxes
        ), boxes
    assert text_of(browser, "#lifelong-curve text.naive-text") == "naive 0.3704"
    screenshot(browser, "13-lifelong-end-labels")


COPY_SCRIPT = """
const node = arguments[0];
const range = document.createRange();
range.selectNodeContents(node);
const selection = window.getSelection();
selection.removeAllRanges();
selection.addRange(range);
const event = new ClipboardEvent("copy", {clipboardData: new DataTransfer(), bubbles: true});
node.dispatchEvent(event);
return event.clipboardData.getData("text/plain");
"""
"""Select ``arguments[0]``'s contents and copy them as a user would (the page's copy handler runs)."""


def test_numbers_show_four_significant_digits_and_the_exact_value_on_hover_and_copy(
    browser: Any, seeded: Seeded
) -> None:
    sign_in(browser, seeded)
    go(browser, seeded, "#/datasets")
    row = wait_for(
        "the long-decimals row",
        lambda: all_of(browser, f"#datasets-table tr[data-dataset-id='{seeded.long_decimals}']"),
    )[0]
    spend = seeded.get(f"/v1/datasets/{seeded.long_decimals}/spend")
    spent = row.find_element("css selector", "td.spent")
    remaining = row.find_element("css selector", "td.remaining")
    assert spend["epsilon_spent"] == repr(LONG_EPSILON)
    assert (spent.text, spent.get_attribute("title")) == ("0.1235", repr(LONG_EPSILON))  # up
    assert (remaining.text, remaining.get_attribute("title")) == (
        "0.8765",
        spend["epsilon_remaining"],
    )  # down
    copied = browser.execute_script(COPY_SCRIPT, spent)
    assert copied == repr(LONG_EPSILON)
    copied_row = browser.execute_script(COPY_SCRIPT, row)
    assert repr(LONG_EPSILON) in copied_row and spend["epsilon_remaining"] in copied_row
    screenshot(browser, "14-four-significant-digits")
    go(browser, seeded, f"#/datasets/{seeded.long_decimals}")
    stat = wait_for("the stats", lambda: all_of(browser, "#stat-naive"))[0]
    assert (stat.text, stat.get_attribute("title")) == ("0.3704", spend["naive_sequential_epsilon"])


def test_jobs_table_fits_1400_px_and_a_failed_job_says_why(browser: Any, seeded: Seeded) -> None:
    sign_in(browser, seeded)
    browser.set_window_size(1400, 900)
    try:
        go(browser, seeded, "#/jobs")
        row = wait_for(
            "the failed job", lambda: all_of(browser, f"#jobs-table tr[data-job-id='{seeded.failed_job}']")
        )[0]
        job = seeded.get(f"/v1/jobs/{seeded.failed_job}")
        assert job["status"] == "failed" and job["error"]["error"] == "budget_exceeded"
        reason = row.find_element("css selector", ".failure-reason")
        assert reason.text.startswith("budget_exceeded: requested epsilon=")
        assert reason.get_attribute("title") == f"budget_exceeded: {job['error']['message']}"
        width = browser.execute_script("return window.innerWidth;")
        table_right = browser.execute_script(
            "return document.getElementById('jobs-table').getBoundingClientRect().right;"
        )
        page_width = browser.execute_script("return document.documentElement.scrollWidth;")
        assert table_right <= width and page_width <= width, (table_right, page_width, width)
        overflowing = browser.execute_script(
            "return Array.from(document.querySelectorAll('#jobs-table td'))"
            ".filter(td => td.scrollWidth > td.clientWidth + 1).length;"
        )
        assert overflowing == 0
        screenshot(browser, "15-jobs-1400px-failure-reason", width=1400)
    finally:
        browser.set_window_size(1280, 900)


def test_job_page_shows_plan_params_and_downloads_the_checked_artifact(browser: Any, seeded: Seeded) -> None:
    import hashlib

    from selenium.webdriver.common.by import By

    sign_in(browser, seeded)
    go(browser, seeded, f"#/jobs/{seeded.trained_job}")
    wait_for("the plan", lambda: all_of(browser, "#plan-sigma"))
    job = seeded.get(f"/v1/jobs/{seeded.trained_job}")
    plan = job["plan"]
    assert text_of(browser, "#plan-sigma") == "1" and plan["noise_multiplier"] == 1.0
    q = browser.find_element(By.CSS_SELECTOR, "#plan-q [data-full]")
    assert float(q.get_attribute("data-full")) == plan["sampling_probability"]
    assert text_of(browser, "#plan-steps") == "40" == str(plan["steps"])
    assert text_of(browser, "#plan-clipping") == "1.2"
    assert json.loads(browser.find_element(By.ID, "job-params").get_attribute("textContent")) == job["params"]
    assert json.loads(browser.find_element(By.ID, "plan-event").get_attribute("textContent")) == plan["event"]

    version = seeded.get(f"/v1/models/{TRAINED_MODEL}/versions/1")
    button = wait_for("the download button", lambda: all_of(browser, "#versions-table button.download"))[0]
    assert button.get_attribute("data-sha256") == version["artifact"]["sha256"]
    screenshot(browser, "16-job-plan-params-versions")
    button.click()
    wait_for(
        "the check", lambda: "saved (SHA-256 checked)" in text_of(browser, "#versions-table .download-status")
    )
    saved = wait_for(
        "the downloaded file",
        lambda: [
            p
            for p in DOWNLOADS.iterdir()
            if p.name.startswith(f"{TRAINED_MODEL}-v1") and not p.name.endswith(".crdownload")
        ],
    )
    assert hashlib.sha256(saved[0].read_bytes()).hexdigest() == version["artifact"]["sha256"]
    assert browser_errors(browser) == []


def test_model_version_page_shows_its_dp_statement(browser: Any, seeded: Seeded) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, seeded)
    go(browser, seeded, f"#/jobs/{seeded.trained_job}")
    wait_for("the version link", lambda: all_of(browser, "#versions-table a.version-link"))[0].click()
    wait_for("the statement", lambda: all_of(browser, "#statement-epsilon"))
    statement = seeded.get(f"/v1/models/{TRAINED_MODEL}/versions/1")["dp_statement"]
    epsilon = browser.find_element(By.ID, "statement-epsilon")
    assert epsilon.get_attribute("data-full") == statement["guarantee"]["epsilon"]
    assert float(epsilon.text) >= float(statement["guarantee"]["epsilon"])  # rounded up
    assert text_of(browser, "#statement-accountant") == "tight"  # the client's default
    assert text_of(browser, "#statement-steps") == "40"
    assert text_of(browser, "#statement-sigma") == "1"
    assert text_of(browser, "#statement-clipping") == "1.2"
    assert text_of(browser, "#statement-unit") == statement["privacy_unit"]["description"]
    assert (
        browser.find_element(By.ID, "statement-remaining").get_attribute("data-full")
        == (statement["budget"]["epsilon_remaining"])
    )
    assert '"divide_by":16' in text_of(browser, "#model-preprocessing")
    # The run alone names its accountant and says it is derived, not certified (issue 24 §3).
    alone = text_of(browser, "#statement-run-alone")
    assert f"by {statement['run_alone']['accountant']}" in alone
    assert "derived from the certificate's charge and budget δ, not certified" in alone
    screenshot(browser, "17-model-version-dp-statement")
    assert browser_errors(browser) == []


def test_api_docs_load_swagger_ui_from_this_server(browser: Any, seeded: Seeded) -> None:
    browser.get(seeded.server.base_url + "/docs")
    try:
        wait_for("Swagger UI", lambda: "privacy-ledger" in text_of(browser, ".swagger-ui .info .title"))
        wait_for("the operations", lambda: len(all_of(browser, ".swagger-ui .opblock")) > 10)
        resources = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name);"
        )
        assert any(url.endswith("/static/vendor/swagger-ui/swagger-ui-bundle.js") for url in resources), (
            resources
        )
        assert all(url.startswith(seeded.server.base_url) for url in resources), resources
        screenshot(browser, "18-api-docs-local-assets")
        assert browser_errors(browser) == []
    finally:
        browser.get(seeded.server.base_url + "/#/jobs")  # back to the dashboard for the next test


# The last test: it stops the server.


def test_an_audited_release_shows_its_lower_bound_beside_the_certified_epsilon(
    browser: Any, seeded: Seeded, tmp_path: Path
) -> None:
    """A ``dp_sgd_audit`` version — its audit from a real audited DP-SGD run on digits — on its
    certificate's page: the lower bound, recomputed at the certificate's δ, beside its ε."""
    pytest.importorskip("torch")
    from service.ledger import model_registry as registry
    from service.training.data import load_data
    from service.training.privacy_audit import PrivacyAuditTrainer

    trainer = PrivacyAuditTrainer(device="cpu")
    data = load_data("builtin:digits")
    params = {"noise_multiplier": 1.0, "delta": 1e-5, "steps": 30, "canaries": 200, "seed": 1}
    audit = trainer.train(data, trainer.plan(params, data.n_records)).metrics["privacy_audit"]

    api = Api(seeded.server.base_url, seeded.server.admin_key)
    budget = {"rule": "sequential", "epsilon": "3", "delta": "0", "accountant": "basic"}
    dataset = api.dataset("audited", budget, source="builtin:digits")
    _, batches = api.task(dataset, "all", ["b0"])
    certificate_id = api.release(dataset, {"batches": batches}, 0.5, "audited-model", 1)["certificate"]["id"]
    job = api.post("/v1/jobs", {"dataset_id": dataset, "algorithm": "dp_sgd_audit", "params": params})["id"]
    api.post(f"/v1/jobs/{job}/cancel", status=200)  # (no worker runs here: the version is published below)
    api.client.close()
    db = Database(seeded.database_url, pool_size=1, max_overflow=0)
    try:
        staged = registry.stage(
            tmp_path,
            tenant_id="default",
            name="audited-model",
            version=1,
            job_id=job,
            attempt=1,
            dataset_id=dataset,
            step=30,
            metrics={"privacy_audit": audit},
            fmt="torch",
            write=lambda h: h.write(b"w"),
        )
        registry.publish(db, tmp_path, staged, certificate_id=certificate_id)
    finally:
        db.dispose()
    certified = seeded.get("/v1/models/audited-model/versions/1")["privacy_audit"]["certified"]
    assert certified["epsilon_upper"] == 0.5 and certified["delta"] == 0.0 and certified["consistent"] is True

    sign_in(browser, seeded)
    go(browser, seeded, f"#/certificates/{certificate_id}")
    shown = wait_for("the audited bound", lambda: text_of(browser, "#cert-audit"))
    lower = float(f"{certified['epsilon_lower']:.4g}")  # the page's toPrecision(4)
    assert shown.startswith(f"ε ≥ {lower:g} at confidence 0.95")
    assert "certified ε ≤ 0.5" in shown and "CONTRADICTED" not in shown
    assert text_of(browser, "#cert-audit-counts") == (
        f"200 canaries, {audit['correct']} of {audit['guesses']} guesses right"
    )
    screenshot(browser, "19-certificate-audited")
    assert browser_errors(browser) == []


def test_a_refused_key_returns_to_sign_in_and_network_errors_are_shown(browser: Any, seeded: Seeded) -> None:
    sign_in(browser, seeded)
    # A key the server no longer accepts: the next call answers 401 and the page signs out.
    browser.execute_script(
        "window.sessionStorage.setItem('privacy-ledger.api-key', 'pl_revoked_or_unknown');"
    )
    go(browser, seeded, "#/datasets")
    wait_for("the sign-in page", lambda: browser.current_url.endswith("#/signin"))
    message = wait_for("the 401 message", lambda: text_of(browser, "#signin-message"))
    assert "401" in message and "unknown or revoked API key" in message
    assert browser.execute_script("return window.sessionStorage.length;") == 0
    screenshot(browser, "10-signed-out-after-401")

    sign_in(browser, seeded)
    go(browser, seeded, "#/jobs")
    wait_for("the jobs table", lambda: all_of(browser, "#jobs-table"))
    stop_server(seeded.server.process)  # the ledger goes away while the page polls
    banner = wait_for(
        "the network error",
        lambda: "Network error" in text_of(browser, "#banner") and text_of(browser, "#banner"),
    )
    assert seeded.server.base_url in banner
    screenshot(browser, "11-network-error")
