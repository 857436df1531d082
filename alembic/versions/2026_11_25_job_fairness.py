"""Job fairness: ``jobs.claimed_at`` (the latest claim) and the indexes the fair claim reads.

Revision ID: c4a1d2e3f503
Revises: c4a1d2e3f502
Create Date: 2026-11-25

The claim (``service.ledger.jobs.claim``) now orders claimable jobs so that tenants take turns:
first by how many jobs of the job's tenant are running, then by when that tenant last had a job
claimed (``max(claimed_at)`` over its jobs, an index-only lookup on ``(tenant_id, claimed_at)``),
then by age. ``claimed_at`` is set at every claim (``started_at`` keeps the first). Existing
rows start with ``claimed_at = started_at``: a job that ran before counts as claimed then.

``(tenant_id, model_name)`` serves the submit-time check that a model name is not another
dataset's (``create_job``: 409 ``model_name_taken``).

Static and reversible: the column type is spelled out here; the downgrade drops the indexes and
the column (the old claim order needs neither).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f503'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f502'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_tenant_id_claimed_at'), ['tenant_id', 'claimed_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_tenant_id_model_name'), ['tenant_id', 'model_name'], unique=False)
    op.execute("UPDATE jobs SET claimed_at = started_at")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_tenant_id_model_name'))
        batch_op.drop_index(batch_op.f('ix_jobs_tenant_id_claimed_at'))
        batch_op.drop_column('claimed_at')
