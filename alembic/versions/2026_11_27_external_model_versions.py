"""A model version trained outside the service: ``model_versions.job_id`` and ``step`` may be
``NULL``.

Revision ID: a7c2e5d8b3f1
Revises: f3b8a1c42d90
Create Date: 2026-11-27

Issue 28 §1: a client that trains with its own code (the Opacus adapter, ``release_gate``) gets a
certificate of its release; it now registers the version it released — the artifact, whose
SHA-256 the server computes, with its architecture and preprocessing — tied to that
certificate (``service.ledger.model_registry.register_external``). Such a version has no job of
the ledger's worker and no step of it. Existing rows all name their job and step and keep them.

Static and reversible. The downgrade refuses while any version names no job: the code before
this revision reads every version's job.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a7c2e5d8b3f1"
down_revision: str | Sequence[str] | None = "f3b8a1c42d90"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_versions = sa.table(
    "model_versions",
    sa.column("name", sa.String(200)),
    sa.column("version", sa.Integer()),
    sa.column("job_id", sa.String(40)),
)


def upgrade() -> None:
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.alter_column("job_id", existing_type=sa.String(length=40), nullable=True)
        batch_op.alter_column("step", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    external = (
        op.get_bind()
        .execute(
            sa.select(_versions.c.name, _versions.c.version)
            .where(_versions.c.job_id.is_(None))
            .order_by(_versions.c.name, _versions.c.version)
            .limit(5)
        )
        .all()
    )
    if external:
        names = [f"{name} v{version}" for name, version in external]
        raise RuntimeError(
            f"cannot downgrade below revision a7c2e5d8b3f1: model versions {names} were trained "
            "outside the service and name no job, which the code before it cannot read."
        )
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.alter_column("step", existing_type=sa.Integer(), nullable=False)
        batch_op.alter_column("job_id", existing_type=sa.String(length=40), nullable=False)
