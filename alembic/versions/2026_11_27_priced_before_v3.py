"""Which datasets may hold charges priced before pricing version 3: ``datasets.priced_before_v3``
(issue 26: the spend read at 10⁶ batches).

Revision ID: 5d2a8c4e1f63
Revises: 3b9d6e2f8a41
Create Date: 2026-11-27

Charges priced before pricing version 3 (``accountant.rules.memo.PRICING_VERSION``) could store
a prefix of what ran (an open plan segment on a ``sequential`` ``prv`` budget, a ``parallel``
progressive commit on a non-``basic`` accountant), so the spend read derived those datasets'
guarantees from their batches or committed reservations as well as from the aggregates — a read
per batch for every dataset of those rules. Since version 3 the stored spend is the whole run's,
so only a dataset that existed before may need it. This marks every existing dataset (``true``,
whatever it holds: a dataset is not inspected, the mark only costs a read) and every dataset
created from now on ``false``; the spend read skips the derivation for the latter.

Reversible: the downgrade drops the column (the read derives for every dataset, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5d2a8c4e1f63"
down_revision: str | Sequence[str] | None = "3b9d6e2f8a41"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.add_column(sa.Column("priced_before_v3", sa.Boolean(), server_default=sa.false(), nullable=False))
    op.execute(sa.text("UPDATE datasets SET priced_before_v3 = true"))


def downgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.drop_column("priced_before_v3")
