"""Initial schema: tenants and keys, datasets (ledger heads), tasks, batches and their records,
reservations, releases, certificates, idempotency keys, the hash-chained audit log.

Revision ID: d14182b65c38
Revises:
Create Date: 2026-11-21

Static and reversible: the column types are spelled out here, not imported from the models, so
this file keeps meaning the same schema whatever the models become.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# Exact decimals: NUMERIC (arbitrary precision) on PostgreSQL, canonical text on SQLite.
Exact = sa.Numeric().with_variant(sa.Text(), "sqlite")
Timestamp = sa.DateTime(timezone=True)
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
# Every audit chain starts from this hash (its head's value before the first entry).
GENESIS_HASH = "0" * 64

revision: str = 'd14182b65c38'
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('audit_head',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_head'))
    )
    op.execute(
        sa.text("INSERT INTO audit_head (id, seq, hash) VALUES (1, 0, :genesis)").bindparams(
            genesis=GENESIS_HASH
        )
    )
    op.create_table('audit_log',
    sa.Column('seq', BigId, autoincrement=True, nullable=False),
    sa.Column('chain', sa.String(length=64), nullable=False),
    sa.Column('chain_seq', sa.BigInteger(), nullable=False),
    sa.Column('event_type', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=True),
    sa.Column('dataset_id', sa.String(length=40), nullable=True),
    sa.Column('payload', sa.JSON(), nullable=False),
    sa.Column('prev_hash', sa.String(length=64), nullable=False),
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_audit_log')),
    sa.UniqueConstraint('chain', 'chain_seq', name=op.f('uq_audit_log_chain_chain_seq'))
    )
    op.create_table('tenants',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.Column('revoked_at', Timestamp, nullable=True),
    sa.CheckConstraint("scope IN ('admin', 'trainer', 'viewer')", name=op.f('ck_api_keys_scope')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('datasets',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('rule', sa.String(length=16), nullable=False),
    sa.Column('accountant', sa.String(length=16), nullable=False),
    sa.Column('budget', sa.JSON(), nullable=False),
    sa.Column('epsilon_budget', Exact, nullable=False),
    sa.Column('delta_budget', Exact, nullable=False),
    sa.Column('record_salt', sa.LargeBinary(), nullable=False),
    sa.Column('ledger_version', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('epsilon_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('delta_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('naive_epsilon', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('epsilon_held', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('reservations_open', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('charges_committed', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('audit_seq', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('audit_hash', sa.String(length=64), server_default=sa.text("'" + GENESIS_HASH + "'"), nullable=False),
    sa.Column('last_release', sa.JSON(), nullable=True),
    sa.Column('last_release_at', Timestamp, nullable=True),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.Column('updated_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_datasets_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_datasets'))
    )
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_datasets_tenant_id_created_at'), ['tenant_id', 'created_at'], unique=False)

    op.create_table('idempotency_keys',
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('operation', sa.String(length=64), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('response', sa.JSON(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_idempotency_keys_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_idempotency_keys')),
    sa.UniqueConstraint('tenant_id', 'key', name=op.f('uq_idempotency_keys_tenant_id_key'))
    )
    op.create_table('reservations',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('event', sa.JSON(), nullable=False),
    sa.Column('noise_commitment', sa.String(length=256), nullable=True),
    sa.Column('epsilon', Exact, nullable=False),
    sa.Column('delta', Exact, nullable=False),
    sa.Column('committed_epsilon', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('committed_delta', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('commits', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('expires_at', Timestamp, nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.Column('closed_at', Timestamp, nullable=True),
    sa.CheckConstraint("status IN ('reserved', 'committed', 'aborted', 'expired')", name=op.f('ck_reservations_status')),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_reservations_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_reservations_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_reservations'))
    )
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.create_index('ix_reservations_open_dataset_id_expires_at', ['dataset_id', 'expires_at'], unique=False, postgresql_where=sa.text("status = 'reserved'"), sqlite_where=sa.text("status = 'reserved'"))
        batch_op.create_index('ix_reservations_open_expires_at', ['expires_at'], unique=False, postgresql_where=sa.text("status = 'reserved'"), sqlite_where=sa.text("status = 'reserved'"))

    op.create_table('tasks',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('epsilon_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('delta_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('naive_epsilon', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_tasks_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tasks'))
    )
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_tasks_dataset_id_created_at'), ['dataset_id', 'created_at'], unique=False)

    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('epsilon_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('epsilon_held', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('delta_spent', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('naive_epsilon', Exact, server_default=sa.text("'0'"), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_batches_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_batches_task_id_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches')),
    sa.UniqueConstraint('task_id', 'position', name=op.f('uq_batches_task_id_position'))
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batches_dataset_id'), ['dataset_id'], unique=False)

    op.create_table('releases',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('reservation_id', sa.String(length=40), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('version', sa.String(length=100), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_releases_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['reservation_id'], ['reservations.id'], name=op.f('fk_releases_reservation_id_reservations')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_releases_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_releases')),
    sa.UniqueConstraint('tenant_id', 'model', 'version', name=op.f('uq_releases_tenant_id_model_version'))
    )
    op.create_table('batch_records',
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('batch_id', sa.String(length=40), nullable=False),
    sa.Column('record_hash', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_batch_records_batch_id_batches')),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_batch_records_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batch_records')),
    sa.UniqueConstraint('dataset_id', 'record_hash', name=op.f('uq_batch_records_dataset_id_record_hash'))
    )
    op.create_table('certificates',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('reservation_id', sa.String(length=40), nullable=False),
    sa.Column('release_id', sa.String(length=40), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.Column('content_hash', sa.String(length=128), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_certificates_dataset_id_datasets')),
    sa.ForeignKeyConstraint(['release_id'], ['releases.id'], name=op.f('fk_certificates_release_id_releases')),
    sa.ForeignKeyConstraint(['reservation_id'], ['reservations.id'], name=op.f('fk_certificates_reservation_id_reservations')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_certificates_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_certificates')),
    sa.UniqueConstraint('release_id', name=op.f('uq_certificates_release_id'))
    )
    with op.batch_alter_table('certificates', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_certificates_dataset_id_created_at'), ['dataset_id', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_certificates_reservation_id'), ['reservation_id'], unique=False)

    op.create_table('reservation_batches',
    sa.Column('reservation_id', sa.String(length=40), nullable=False),
    sa.Column('batch_id', sa.String(length=40), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('state_at_reserve', sa.JSON(), nullable=False),
    sa.Column('cost', sa.JSON(), nullable=False),
    sa.Column('committed', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_reservation_batches_batch_id_batches')),
    sa.ForeignKeyConstraint(['reservation_id'], ['reservations.id'], name=op.f('fk_reservation_batches_reservation_id_reservations')),
    sa.PrimaryKeyConstraint('reservation_id', 'batch_id', name=op.f('pk_reservation_batches'))
    )


def downgrade() -> None:
    op.drop_table('reservation_batches')
    with op.batch_alter_table('certificates', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_certificates_reservation_id'))
        batch_op.drop_index(batch_op.f('ix_certificates_dataset_id_created_at'))

    op.drop_table('certificates')
    op.drop_table('batch_records')
    op.drop_table('releases')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_dataset_id'))

    op.drop_table('batches')
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_tasks_dataset_id_created_at'))

    op.drop_table('tasks')
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.drop_index('ix_reservations_open_expires_at', postgresql_where=sa.text("status = 'reserved'"), sqlite_where=sa.text("status = 'reserved'"))
        batch_op.drop_index('ix_reservations_open_dataset_id_expires_at', postgresql_where=sa.text("status = 'reserved'"), sqlite_where=sa.text("status = 'reserved'"))

    op.drop_table('reservations')
    op.drop_table('idempotency_keys')
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_datasets_tenant_id_created_at'))

    op.drop_table('datasets')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_tenant_id'))

    op.drop_table('api_keys')
    op.drop_table('tenants')
    op.drop_table('audit_log')
    op.drop_table('audit_head')
