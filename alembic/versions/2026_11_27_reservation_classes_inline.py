"""A reservation's classes are kept in its own row: ``reservations.classes`` (issue 26).

Revision ID: e8f4a2c61d37
Revises: 5d2f8b7e9a14
Create Date: 2026-11-27

Each reservation held its classes (the batches it read in one state: that state, the reserved
and committed cost, how many batches) as rows of ``reservation_classes``, so a reserve wrote one
more statement and a commit updated one more. They are now a JSON list in the reservation's row,
``[{index, state_at_reserve, cost, committed, batches}, ...]`` in index order, written and read
with the reservation. The values are moved unchanged (the same JSON documents, the same order),
so every certificate, answer and audit chain verifies as before; ``reservation_classes`` is
dropped.

Reversible: the downgrade recreates ``reservation_classes`` from the lists and drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "e8f4a2c61d37"
down_revision: str | Sequence[str] | None = "5d2f8b7e9a14"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CHUNK = 5_000
_FIELDS = ("index", "state_at_reserve", "cost", "committed", "batches")

_classes = sa.table(
    "reservation_classes",
    sa.column("reservation_id", sa.String(40)),
    sa.column("index", sa.Integer()),
    sa.column("state_at_reserve", sa.JSON()),
    sa.column("cost", sa.JSON()),
    sa.column("committed", sa.JSON()),
    sa.column("batches", sa.Integer()),
)
_reservations = sa.table(
    "reservations",
    sa.column("id", sa.String(40)),
    sa.column("classes", sa.JSON()),
)
_SET_CLASSES = (
    sa.update(_reservations)
    .where(_reservations.c.id == sa.bindparam("reservation_id"))
    .values(classes=sa.bindparam("listed"))
)


def upgrade() -> None:
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("classes", sa.JSON(), server_default=sa.text("'[]'"), nullable=False))
    bind = op.get_bind()
    rows = bind.execute(sa.select(_classes).order_by(_classes.c.reservation_id, _classes.c.index)).all()
    updates: list[dict[str, Any]] = []
    current: str | None = None
    for row in rows:
        if row.reservation_id != current:
            current = row.reservation_id
            updates.append({"reservation_id": current, "listed": []})
        updates[-1]["listed"].append({name: getattr(row, name) for name in _FIELDS})
    for start in range(0, len(updates), _CHUNK):
        bind.execute(_SET_CLASSES, updates[start : start + _CHUNK])
    op.drop_table("reservation_classes")


def downgrade() -> None:
    op.create_table(
        "reservation_classes",
        sa.Column("reservation_id", sa.String(length=40), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("state_at_reserve", sa.JSON(), nullable=False),
        sa.Column("cost", sa.JSON(), nullable=False),
        sa.Column("committed", sa.JSON(), nullable=True),
        sa.Column("batches", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["reservation_id"],
            ["reservations.id"],
            name=op.f("fk_reservation_classes_reservation_id_reservations"),
        ),
        sa.PrimaryKeyConstraint("reservation_id", "index", name=op.f("pk_reservation_classes")),
    )
    bind = op.get_bind()
    listed = bind.execute(sa.select(_reservations.c.id, _reservations.c.classes)).all()
    rows = [
        {"reservation_id": rid, **{name: c[name] for name in _FIELDS}}
        for rid, classes in listed
        for c in classes
    ]
    for start in range(0, len(rows), _CHUNK):
        bind.execute(sa.insert(_classes), rows[start : start + _CHUNK])
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_column("classes")
