"""Jobs and model versions: the training worker's queue and the model registry.

Revision ID: 7b3e9c1d5a20
Revises: d14182b65c38
Create Date: 2026-11-21

Static and reversible: the column types are spelled out here, not imported from the models.
A ``model_versions`` row references the certificate of its committed release (unique), so the
schema itself says a version exists only together with a committed certificate.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# Exact decimals: NUMERIC (arbitrary precision) on PostgreSQL, canonical text on SQLite.
Exact = sa.Numeric().with_variant(sa.Text(), "sqlite")
Timestamp = sa.DateTime(timezone=True)

revision: str = '7b3e9c1d5a20'
down_revision: str | Sequence[str] | None = 'd14182b65c38'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('algorithm', sa.String(length=32), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('model_name', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=True),
    sa.Column('progress_step', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('progress_total', sa.Integer(), nullable=True),
    sa.Column('epsilon_committed', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('delta_committed', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=True),
    sa.Column('error', sa.JSON(), nullable=True),
    sa.Column('reservation_id', sa.String(length=40), nullable=True),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', Timestamp, nullable=True),
    sa.Column('heartbeat_at', Timestamp, nullable=True),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('cancel_requested_at', Timestamp, nullable=True),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.Column('updated_at', Timestamp, nullable=False),
    sa.Column('started_at', Timestamp, nullable=True),
    sa.Column('finished_at', Timestamp, nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_jobs_status')),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_jobs_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['reservation_id'], ['reservations.id'], name=op.f('fk_jobs_reservation_id_reservations')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_jobs_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_status_created_at'), ['status', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_tenant_id_created_at'), ['tenant_id', 'created_at'], unique=False)

    op.create_table('model_versions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('certificate_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('artifact_path', sa.String(length=1000), nullable=False),
    sa.Column('artifact_sha256', sa.String(length=64), nullable=False),
    sa.Column('artifact_bytes', sa.BigInteger(), nullable=False),
    sa.Column('artifact_format', sa.String(length=32), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['certificate_id'], ['certificates.id'], name=op.f('fk_model_versions_certificate_id_certificates')),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_model_versions_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_model_versions_job_id_jobs')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_model_versions_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_model_versions')),
    sa.UniqueConstraint('certificate_id', name=op.f('uq_model_versions_certificate_id')),
    sa.UniqueConstraint('tenant_id', 'name', 'version', name=op.f('uq_model_versions_tenant_id_name_version'))
    )
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_model_versions_job_id'), ['job_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_model_versions_job_id'))

    op.drop_table('model_versions')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_tenant_id_created_at'))
        batch_op.drop_index(batch_op.f('ix_jobs_status_created_at'))

    op.drop_table('jobs')
