"""Sequential ``prv`` budgets take further declared plans: ``datasets.plan_segments``.

Revision ID: e7a2c5d91b30
Revises: c4a1d2e3f505
Create Date: 2026-11-25

A dataset's budget JSON lists the plan segments declared after creation (``budget.segments``,
``accountant.rules.Budget.with_segment``); ``plan_segments`` counts them on the ledger head, which
every spend locks and reads, so a process whose cached budget lists fewer segments reads the
budget again (``service.ledger.spending.store.Work.open``). Existing datasets start at 0: their
budgets list no segments.

Static and reversible. The downgrade drops the column, and refuses while any dataset has declared
a segment: code from before this revision reads such a budget as its first plan alone, and a batch
whose first plan was closed (its ``plan_position`` back at 0) could run that plan again.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'e7a2c5d91b30'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f505'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_datasets = sa.table('datasets', sa.column('id', sa.String(40)), sa.column('plan_segments', sa.Integer()))


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('plan_segments', sa.Integer(), server_default=sa.text('0'), nullable=False))


def downgrade() -> None:
    segmented = op.get_bind().execute(
        sa.select(_datasets.c.id).where(_datasets.c.plan_segments > 0).order_by(_datasets.c.id).limit(5)
    ).scalars().all()
    if segmented:
        raise RuntimeError(
            f"cannot downgrade below revision e7a2c5d91b30: datasets {segmented} have declared plan "
            "segments, which the code before it would read as their first plan alone."
        )
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_column('plan_segments')
