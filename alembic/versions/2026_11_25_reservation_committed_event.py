"""Progressive commits must extend each other: ``reservations.committed_event``.

Revision ID: c4a1d2e3f504
Revises: c4a1d2e3f503
Create Date: 2026-11-25

A progressive commit reports the reserved run cut short, and each one must extend the previous
(``accountant.rules.commit``: ``commit_not_prefix`` / ``commit_does_not_extend``). The run so far
that a reservation's last commit reported is kept on the reservation (JSON, ``NULL`` before its
first progressive commit). Existing open reservations start with ``NULL``: their next commit is
checked against the reserved event only (their earlier commits' events are in their
certificates).

Static and reversible: the column type is spelled out here; the downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f504'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f503'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('committed_event', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.drop_column('committed_event')
