"""Datasets can be archived: ``datasets.archived_at`` (issue 28 §7).

Revision ID: c4e1a9d27b83
Revises: a7c4e2d9b150
Create Date: 2026-11-27

An archived dataset refuses new work (reservations, jobs, quotes, plan segments, tasks and
batches) and is hidden from the default dataset list; its ledger, certificates and audit chain
stay exactly as they were. A new nullable column, ``NULL`` for every existing dataset (none is
archived): every ledger, certificate and chain verifies as before.

Reversible: the downgrade drops the column (archived datasets become active again; their
``dataset.archived`` audit entries stay and still verify).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c4e1a9d27b83"
down_revision: str | Sequence[str] | None = "a7c4e2d9b150"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("archived_at")
