"""API keys hashed with a keyed hash (HMAC-SHA256 under a server secret); shorter display prefixes.

Revision ID: c4a1d2e3f502
Revises: c4a1d2e3f501
Create Date: 2026-11-25

``api_keys`` gains ``hash_scheme`` (``sha256`` for every existing row: the plain SHA-256 of the
key; ``hmac-sha256`` for keys hashed under the server's key-hash secret) and ``secret_id`` (the
public id of that secret, ``service.server_secrets.secret_id``). A migration cannot rehash a
key, having only its hash: an existing key is rehashed with HMAC by the service at its first
successful use (``service.ledger.tenancy.authenticate_many``).

Display prefixes are cut to what a human needs to tell keys apart: ``pl_`` and 4 characters
of a generated key; nothing of a chosen key (one not starting with ``pl_``), whose first
characters could be half of a human-made secret.

Static and reversible: the column types are spelled out here. The downgrade drops both columns;
the prefixes stay short (what was cut is gone), and a key already rehashed with HMAC no longer
authenticates under the old code, which computes plain SHA-256: it fails closed, and an admin
issues a new key.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f502'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f501'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('hash_scheme', sa.String(length=16), server_default=sa.text("'sha256'"), nullable=False)
        )
        batch_op.add_column(sa.Column('secret_id', sa.String(length=16), nullable=True))
        batch_op.create_check_constraint(
            op.f('ck_api_keys_hash_scheme'), "hash_scheme IN ('sha256', 'hmac-sha256')"
        )
    op.execute(
        "UPDATE api_keys SET prefix = CASE WHEN substr(prefix, 1, 3) = 'pl_' "
        "THEN substr(prefix, 1, 7) ELSE '' END"
    )


def downgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_api_keys_hash_scheme'), type_='check')
        batch_op.drop_column('secret_id')
        batch_op.drop_column('hash_scheme')
