"""Fixtures of the ledger tests: two tenants on a fresh database, and a dataset factory."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.db.session import Database
from service.ledger import batches, datasets


@pytest.fixture
def ledger(template_tenants: None, db: Database) -> Database:
    """``db`` with tenants ``t1`` and ``t2`` (copied with them in it: ``tests/conftest.py``)."""
    return db


@dataclass
class Layout:
    """A dataset made by ``make_dataset``: its id, task ids, and batch ids per task."""

    id: str
    tasks: list[str] = field(default_factory=list)
    batches: list[list[str]] = field(default_factory=list)

    @property
    def all_batches(self) -> list[str]:
        return [b for task in self.batches for b in task]


MakeDataset = Callable[..., Layout]


@pytest.fixture
def make_dataset(ledger: Database) -> MakeDataset:
    """``make_dataset(budget, tasks=[batches per task], tenant="t1")``: each batch gets its own
    records (``<task>-<batch>-<i>``)."""

    def make(budget: dict[str, Any], tasks: Sequence[int] = (1,), tenant: str = "t1") -> Layout:
        ds = datasets.create_dataset(ledger, tenant, name=f"dataset-{secrets.token_hex(4)}", budget=budget).id
        layout = Layout(ds)
        for t, count in enumerate(tasks):
            task = batches.create_task(ledger, tenant, ds, name=f"task-{t}").id
            created = batches.create_batches(
                ledger,
                tenant,
                ds,
                task,
                batches=[
                    {"name": f"batch-{t}-{b}", "records": [f"{t}-{b}-{i}" for i in range(3)]}
                    for b in range(count)
                ],
            )
            layout.tasks.append(task)
            layout.batches.append([row.id for row in created.data])
        return layout

    return make
