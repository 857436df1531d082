"""A task can hold the state of all its batches: ``tasks.state_id``; a reservation can read whole
tasks: ``reservation_tasks`` (issue 26).

Revision ID: 7c1e5a9d3b20
Revises: e8f4a2c61d37
Create Date: 2026-11-27

A charge on whole tasks whose batches are all in one state rewrote one pointer and wrote one
membership row per batch. A *compact* task now names the state of every one of its batches
(``tasks.state_id``; their own ``batches.state_id`` is ``NULL``), and a reservation over whole
compact tasks records one ``reservation_tasks`` row per task (its class, its last batch position,
how many batches) instead of one ``reservation_batches`` row per batch. Existing ledgers are
unchanged: every task starts not compact (``NULL``), every batch keeps its pointer, every
reservation its rows, so every certificate, answer and audit chain verifies as before.

Reversible: the downgrade writes the task's state into the pointers of its batches and the
membership of every ``reservation_tasks`` row as ``reservation_batches`` rows (the same batches,
the same class), then drops the column and the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "7c1e5a9d3b20"
down_revision: str | Sequence[str] | None = "e8f4a2c61d37"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_tasks = sa.table("tasks", sa.column("id", sa.String(40)), sa.column("state_id", sa.String(40)))
_batches = sa.table(
    "batches",
    sa.column("id", sa.String(40)),
    sa.column("task_id", sa.String(40)),
    sa.column("position", sa.Integer()),
    sa.column("state_id", sa.String(40)),
)
_members = sa.table(
    "reservation_tasks",
    sa.column("reservation_id", sa.String(40)),
    sa.column("task_id", sa.String(40)),
    sa.column("class_index", sa.Integer()),
    sa.column("last_position", sa.Integer()),
)
_rows = sa.table(
    "reservation_batches",
    sa.column("reservation_id", sa.String(40)),
    sa.column("batch_id", sa.String(40)),
    sa.column("position", sa.Integer()),
    sa.column("class_index", sa.Integer()),
)


def upgrade() -> None:
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_id", sa.String(length=40), nullable=True))
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.alter_column("state_id", existing_type=sa.String(length=40), nullable=True)
    op.create_table(
        "reservation_tasks",
        sa.Column("reservation_id", sa.String(length=40), nullable=False),
        sa.Column("task_id", sa.String(length=40), nullable=False),
        sa.Column("class_index", sa.Integer(), nullable=False),
        sa.Column("last_position", sa.Integer(), nullable=False),
        sa.Column("batches", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("reservation_id", "task_id", name=op.f("pk_reservation_tasks")),
    )


def downgrade() -> None:
    bind = op.get_bind()
    # Every batch of a compact task gets the task's state as its own pointer.
    task_state = sa.select(_tasks.c.state_id).where(_tasks.c.id == _batches.c.task_id).scalar_subquery()
    bind.execute(sa.update(_batches).where(_batches.c.state_id.is_(None)).values(state_id=task_state))
    # Every reservation of whole tasks gets one membership row per batch it read.
    rows = (
        sa.select(_members.c.reservation_id, _batches.c.id, _batches.c.position, _members.c.class_index)
        .join(_batches, _batches.c.task_id == _members.c.task_id)
        .where(_batches.c.position <= _members.c.last_position)
    )
    bind.execute(
        sa.insert(_rows).from_select(["reservation_id", "batch_id", "position", "class_index"], rows)
    )
    op.drop_table("reservation_tasks")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.alter_column("state_id", existing_type=sa.String(length=40), nullable=False)
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_column("state_id")
