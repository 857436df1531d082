"""Worker tests run torch on one intra-op thread.

The models are tiny, so extra threads buy nothing, and on a shared machine with few cores
OpenMP's spinning threads make small ops ten times slower (an AdaDp run went from ~1 s to ~14 s).
The previous setting is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from service.db.session import Database


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def ledger(database_url: URL, db: Database, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A live ``ledger serve`` (API and an in-process worker) on the test's database, with an
    admin, a trainer and a viewer key of tenant ``acme``: ``(url, {scope: key})``."""
    from service.ledger import tenancy
    from tests.service.live_server import serve, settings_for

    keys = {scope: tenancy.create_api_key(db, "acme", scope) for scope in ("admin", "trainer", "viewer")}
    with serve(settings_for(database_url, tmp_path / "artifacts"), db, worker=True) as url:
        yield url, keys
