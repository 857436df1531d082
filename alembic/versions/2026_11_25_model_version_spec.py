"""A model version records what it is: ``model_versions.model_spec``.

Revision ID: c4a1d2e3f5a1
Revises: e7a2c5d91b30
Create Date: 2026-11-25

The architecture the weights belong to (network kind, widths, inputs, classes) and the
preprocessing that turns the source's raw records into its inputs, written by the worker when
it publishes the version (``service.ledger.model_registry``), so that ``LedgerClient.load_model``
rebuilds the module without guessing. JSON, ``NULL`` for versions published before, and for
trainers whose models are not rebuilt from a spec (the staged ones).

Static and reversible: the column type is spelled out here; the downgrade drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f5a1'
down_revision: str | Sequence[str] | None = 'e7a2c5d91b30'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model_spec', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('model_versions', schema=None) as batch_op:
        batch_op.drop_column('model_spec')
