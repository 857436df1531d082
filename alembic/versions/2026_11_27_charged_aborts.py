"""An abort or an expiry is a charge with a certificate and no release: ``certificates.release_id``
may be ``NULL``.

Revision ID: f3b8a1c42d90
Revises: e2b7c9d4f1a6
Create Date: 2026-11-27

Issue 24 §2: a reservation whose data could have been read is charged for what could have run.
An abort (or an expiry) of an open reservation settles it as a final charge of the whole reserved
event and stores a certificate whose body says ``release: null`` and ``outcome: "aborted"`` (or
``"expired"``); nothing is released, so the certificate row names no release. Existing rows all
name one and keep it.

Static and reversible. The downgrade refuses while any certificate names no release: the code
before this revision lists certificates through their release, so it would drop those charges
from every certificate listing and bundle (the spend itself stays on the batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "f3b8a1c42d90"
down_revision: str | Sequence[str] | None = "e2b7c9d4f1a6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_certificates = sa.table(
    "certificates", sa.column("id", sa.String(40)), sa.column("release_id", sa.String(40))
)


def upgrade() -> None:
    with op.batch_alter_table("certificates", schema=None) as batch_op:
        batch_op.alter_column("release_id", existing_type=sa.String(length=40), nullable=True)


def downgrade() -> None:
    unreleased = (
        op.get_bind()
        .execute(
            sa.select(_certificates.c.id)
            .where(_certificates.c.release_id.is_(None))
            .order_by(_certificates.c.id)
            .limit(5)
        )
        .scalars()
        .all()
    )
    if unreleased:
        raise RuntimeError(
            f"cannot downgrade below revision f3b8a1c42d90: certificates {unreleased} charge aborted "
            "or expired reservations and name no release, which the code before it cannot list."
        )
    with op.batch_alter_table("certificates", schema=None) as batch_op:
        batch_op.alter_column("release_id", existing_type=sa.String(length=40), nullable=False)
