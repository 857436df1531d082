"""Meter buckets shared by the API processes: ``meter_buckets``.

Revision ID: a7c4e2d9b150
Revises: a7d3e5f19b20
Create Date: 2026-11-27

Issue 30 §2: the pricing-time buckets (``service.api.ratelimit``) were kept in each API process,
so N processes let a tenant use N times the configured rate. One row per (tenant, meter) holds the
bucket for every process on the database (``service.ledger.meters``). A new table only: existing
ledgers and certificates are untouched; the downgrade drops it (the buckets refill from full).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "a7c4e2d9b150"
down_revision: str | Sequence[str] | None = "a7d3e5f19b20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "meter_buckets",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("meter", sa.String(length=32), nullable=False),
        sa.Column("tokens", sa.Double(), nullable=False),
        sa.Column("at_s", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "meter", name=op.f("pk_meter_buckets")),
    )


def downgrade() -> None:
    op.drop_table("meter_buckets")
