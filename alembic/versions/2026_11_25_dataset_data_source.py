"""Datasets own their data source (placeholder, filled in by the data-source change).

Revision ID: c4a1d2e3f501
Revises: 7b3e9c1d5a20
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa  # noqa: F401
from alembic import op  # noqa: F401

revision: str = 'c4a1d2e3f501'
down_revision: str | Sequence[str] | None = '7b3e9c1d5a20'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
