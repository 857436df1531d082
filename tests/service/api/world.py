"""Objects to call routes on, made through the ledger's own operations (no HTTP, no mocks)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from service.db.session import Database
from service.ledger import batches, datasets, reservations
from service.ledger.reservations import parse_event

_serial = itertools.count(1)

PURE = {"kind": "pure_dp", "epsilon": 0.1}


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_serial)}"


@dataclass(frozen=True)
class World:
    """A tenant's dataset (sequential, basic, ε=10) with one task and one batch, an open
    reservation on the batch and a committed one with its certificate."""

    tenant: str
    dataset: str
    task: str
    batch: str
    reservation: str
    certificate: str

    def ids(self) -> dict[str, str]:
        return {
            "dataset": self.dataset,
            "task": self.task,
            "batch": self.batch,
            "reservation": self.reservation,
            "certificate": self.certificate,
        }


def sequential_budget(epsilon: str = "10") -> dict[str, Any]:
    return {"rule": "sequential", "epsilon": epsilon, "delta": "0", "accountant": "basic"}


def make_world(db: Database, tenant: str) -> World:
    dataset = datasets.create_dataset(db, tenant, name=unique("ds"), budget=sequential_budget())
    task = batches.create_task(db, tenant, dataset.id, name=unique("task"))
    created = batches.create_batches(
        db,
        tenant,
        dataset.id,
        task.id,
        batches=[{"name": unique("batch"), "records": [unique("r"), unique("r")]}],
    )
    batch = created.data[0].id
    done = reservations.reserve(db, tenant, dataset.id, event=parse_event(PURE), batch_ids=[batch]).to_json()
    commit = reservations.commit(
        db, tenant, done["id"], release={"model": "m", "version": unique("v")}
    ).to_json()
    held = reservations.reserve(db, tenant, dataset.id, event=parse_event(PURE), batch_ids=[batch]).to_json()
    return World(
        tenant=tenant,
        dataset=dataset.id,
        task=task.id,
        batch=batch,
        reservation=held["id"],
        certificate=commit["certificate"]["id"],
    )
