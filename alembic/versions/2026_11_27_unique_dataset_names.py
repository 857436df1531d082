"""A dataset's name is unique within its tenant: existing duplicates are renamed, deterministically.

Revision ID: a7d3e5f19b20
Revises: a7c2e5d8b3f1
Create Date: 2026-11-27

Issue 28 §6: two datasets of one tenant could share a name and looked identical on the dashboard,
and a name could not stand for an id. Every tenant's duplicate names are resolved before the
constraint ``uq_datasets_tenant_id_name`` is added: in each group of datasets sharing a name, the
oldest (by ``created_at``, then ``id``) keeps it and each later one becomes ``"<name> (2)"``,
``"<name> (3)"``, ... in that order, skipping a suffix another dataset of the tenant already
uses. Only ``datasets.name`` changes: ids, budgets, batches, certificates and the audit chains
(whose ``dataset.created`` entries keep the name given then) stay exactly as they were, so every
ledger, certificate and chain verifies as before.

Reversible: the downgrade drops the constraint and leaves the new names (which are valid names).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a7d3e5f19b20"
down_revision: str | Sequence[str] | None = "a7c2e5d8b3f1"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME_LENGTH = 200  # service.db.models.NAME

_datasets = sa.table(
    "datasets",
    sa.column("id", sa.String(40)),
    sa.column("tenant_id", sa.String(40)),
    sa.column("name", sa.String(NAME_LENGTH)),
    sa.column("created_at", sa.DateTime()),
)


def _renamed(name: str, k: int) -> str:
    suffix = f" ({k})"
    return name[: NAME_LENGTH - len(suffix)] + suffix


def upgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(_datasets.c.id, _datasets.c.tenant_id, _datasets.c.name).order_by(
            _datasets.c.tenant_id, _datasets.c.created_at, _datasets.c.id
        )
    ).all()
    taken: dict[str, set[str]] = {}
    for row in rows:
        taken.setdefault(row.tenant_id, set()).add(row.name)
    seen: dict[str, set[str]] = {}
    for row in rows:
        kept = seen.setdefault(row.tenant_id, set())
        if row.name not in kept:
            kept.add(row.name)
            continue
        names = taken[row.tenant_id]
        k = 2
        while _renamed(row.name, k) in names:
            k += 1
        new = _renamed(row.name, k)
        names.add(new)
        kept.add(new)
        bind.execute(sa.update(_datasets).where(_datasets.c.id == row.id).values(name=new))
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.create_unique_constraint("uq_datasets_tenant_id_name", ["tenant_id", "name"])


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_constraint("uq_datasets_tenant_id_name", type_="unique")
