"""Signing-key custody: ``signing_keys``, every key that has signed for this database.

Revision ID: e2b7c4d9a1f0
Revises: d6e1f0a2b7c3
Create Date: 2026-11-27

Issue 24 §6: a lost signing-key file was replaced by a new key at the next start, silently, and
every certificate signed before then verified ``unknown_key``. Each process now records the key
it signs with (``service.ledger.signing_custody``) and refuses to start while a recorded key is
neither its active nor one of its retired keys, unless an admin declared that key lost
(``LEDGER_SIGNING_KEYS_LOST``; ``lost_at`` is set and audited once).

The upgrade records the keys that signed the certificates stored so far (their ``key_id`` only:
a certificate carries no public key). Static and reversible: the downgrade drops the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa

from alembic import op

revision: str = "e2b7c4d9a1f0"
down_revision: str | Sequence[str] | None = "d6e1f0a2b7c3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "signing_keys",
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lost_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_signing_keys")),
    )
    connection = op.get_bind()
    certificates = sa.table("certificates", sa.column("body", sa.JSON()))
    seen: set[str] = set()
    for (body,) in connection.execute(sa.select(certificates.c.body)).yield_per(1000):
        signature = body.get("signature") if isinstance(body, dict) else None
        key_id = signature.get("key_id") if isinstance(signature, dict) else None
        if isinstance(key_id, str) and 0 < len(key_id) <= 16:
            seen.add(key_id)
    # Stored naive on SQLite, aware on PostgreSQL, as service.db.base.UtcDateTime writes them.
    now = datetime.now(UTC)
    if connection.dialect.name == "sqlite":
        now = now.replace(tzinfo=None)
    if seen:
        op.bulk_insert(table, [{"key_id": k, "public_key": None, "first_seen_at": now} for k in sorted(seen)])


def downgrade() -> None:
    op.drop_table("signing_keys")
