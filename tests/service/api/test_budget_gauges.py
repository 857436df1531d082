"""Per-dataset budget gauges on ``/metrics`` (issue 16): spent, held, remaining, naive and the
budget of every tenant's datasets, labelled by tenant, read with the operator's token over real
HTTP (uvicorn on real TCP, SQLite and PostgreSQL) and parsed by prometheus_client's own parser;
no API key reads them, and ``LEDGER_METRICS_DATASET_GAUGES=false`` drops them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy.engine import URL

from service.client import LedgerClient
from service.db.session import Database
from service.ledger import tenancy
from service.settings import Settings
from tests.service.live_server import serve, settings_for

TOKEN = "budget-gauges-metrics-token-0123456789"
GAUGES = {
    "ledger_dataset_epsilon_budget": "epsilon_budget",
    "ledger_dataset_epsilon_spent": "epsilon_spent",
    "ledger_dataset_epsilon_held": "epsilon_held",
    "ledger_dataset_epsilon_remaining": "epsilon_remaining",
    "ledger_dataset_naive_sequential_epsilon": "naive_sequential_epsilon",
}


def _settings(database_url: URL, tmp_path: Path, **changes: object) -> Settings:
    return settings_for(database_url, tmp_path / "artifacts").model_copy(
        update={"metrics_token": SecretStr(TOKEN), **changes}
    )


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    answer = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


@pytest.fixture
def keys(db: Database) -> dict[str, str]:
    return {tenant: tenancy.create_api_key(db, tenant, "admin") for tenant in ("acme", "rival")}


@pytest.fixture
def url(database_url: URL, db: Database, tmp_path: Path) -> Iterator[str]:
    with serve(_settings(database_url, tmp_path), db) as base_url:
        yield base_url


def test_every_tenant_s_datasets_with_the_api_s_numbers(url: str, keys: dict[str, str]) -> None:
    with LedgerClient(url, keys["acme"]) as acme, LedgerClient(url, keys["rival"]) as rival:
        # a name a label must escape: quotes and a backslash (names refuse control characters)
        spent = acme.create_dataset('a "b"\\c', rule="sequential", epsilon="2", delta="0", accountant="basic")
        task = acme.create_task(spent["id"], "t")
        batch = acme.create_batches(spent["id"], task["id"], [{"name": "b", "records": ["r"]}])["data"][0]
        with acme.release_gate(
            spent["id"], [batch["id"]], {"kind": "pure_dp", "epsilon": 0.5}, model="m", version=1
        ):
            pass
        acme.reserve(spent["id"], {"kind": "pure_dp", "epsilon": 0.25}, batches=[batch["id"]])  # held
        other = rival.create_dataset("other", rule="parallel", epsilon="1", delta="0", accountant="basic")
        scraped = _scrape(url)
        for client, dataset, tenant in ((acme, spent, "acme"), (rival, other, "rival")):
            spend = client.spend(dataset["id"])
            labels = {
                "tenant": tenant,
                "dataset": dataset["id"],
                "name": dataset["name"],
                "rule": dataset["budget"]["rule"],
                "accountant": dataset["budget"]["accountant"],
            }
            for gauge, field in GAUGES.items():
                assert scraped[gauge][tuple(sorted(labels.items()))] == float(spend[field]), gauge
    acme_series = [dict(k) for k in scraped["ledger_dataset_epsilon_spent"] if dict(k)["tenant"] == "acme"]
    assert [s["name"] for s in acme_series] == ['a "b"\\c']
    assert scraped["ledger_dataset_epsilon_spent"][tuple(sorted(acme_series[0].items()))] == 0.5
    assert scraped["ledger_dataset_epsilon_held"][tuple(sorted(acme_series[0].items()))] == 0.25
    assert scraped["ledger_dataset_epsilon_remaining"][tuple(sorted(acme_series[0].items()))] == 1.5
    # a tenant's key does not read them (nor any series)
    assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {keys['acme']}"}).status_code == 401


@pytest.mark.parametrize("backend", ["sqlite"])
def test_the_switch_drops_them(database_url: URL, db: Database, tmp_path: Path, keys: dict[str, str]) -> None:
    with serve(_settings(database_url, tmp_path, metrics_dataset_gauges=False), db) as base_url:
        with LedgerClient(base_url, keys["acme"]) as acme:
            acme.create_dataset("d", rule="sequential", epsilon="1", delta="0", accountant="basic")
        scraped = _scrape(base_url)
    assert "ledger_commits_total" in scraped
    assert not [name for name in scraped if name.startswith("ledger_dataset_")]
