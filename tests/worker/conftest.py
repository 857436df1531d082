"""The worker tests' served ledger (``ledger``). Torch runs on one thread (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from service.db.session import Database


@pytest.fixture
def ledger(database_url: URL, db: Database, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A live ``ledger serve`` (API and an in-process worker) on the test's database, with an
    admin, a trainer and a viewer key of tenant ``acme``: ``(url, {scope: key})``."""
    from service.ledger import tenancy
    from tests.service.live_server import serve, settings_for

    keys = {scope: tenancy.create_api_key(db, "acme", scope) for scope in ("admin", "trainer", "viewer")}
    with serve(settings_for(database_url, tmp_path / "artifacts"), db, worker=True) as url:
        yield url, keys
