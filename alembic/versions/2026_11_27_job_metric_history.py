"""A job keeps a bounded history of its released iterates' metrics: ``jobs.metric_history``
(issue 28, dashboard: per-step curves).

Revision ID: 5d2f8b7e9a14
Revises: c4e1a9d27b83
Create Date: 2026-11-27

``{"every": N, "points": [{"step", "test_loss", "test_accuracy", "checkpoint"}, ...]}`` (at most
``service.ledger.jobs.MAX_HISTORY_POINTS`` points), written by the worker only after the ledger
committed the steps a point describes (``service.worker.gate``). A new nullable column, ``NULL``
for every existing job (they recorded none; their versions keep their metrics).

Reversible: the downgrade drops the column (the curves are lost; nothing the ledger certified is).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5d2f8b7e9a14"
down_revision: str | Sequence[str] | None = "c4e1a9d27b83"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("metric_history", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("metric_history")
