"""Batch records keyed by integers: ``datasets.key``, ``batches.key`` (issue 26).

Revision ID: 3b9d6e2f8a41
Revises: 7c1e5a9d3b20
Create Date: 2026-11-27

``batch_records`` held (id, dataset_id, batch_id, record_hash) with a unique index on
(dataset_id, record_hash): every record carried two 30-character text ids and a row id, and the
unique index's keys were 60 bytes. Datasets and batches now get an integer surrogate key
(``datasets.key``, unique; ``batches.key``, unique within its dataset, given from
``datasets.next_batch_key``); their text ids stay the public names. ``batch_records`` becomes
(dataset_key, record_hash, batch_key) with the primary key (dataset_key, record_hash) — on
SQLite a ``WITHOUT ROWID`` table, so the overlap check is the table itself — and an index on
(dataset_key, batch_key) to find a batch's records when it is deleted.

Existing rows are converted unchanged: datasets are numbered 1, 2, ... in creation order, each
dataset's batches 0, 1, ... in creation order, and every stored record hash is kept (no record
is re-hashed; nothing outside ``batch_records`` refers to its rows, and no certificate, audit
entry or answer names a key). A record row whose batch does not exist in its dataset (none
can: records are written and deleted with their batch) stops the upgrade before it changes
anything, rather than being dropped.

Reversible: the downgrade rebuilds the text-keyed table from the keys and drops the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3b9d6e2f8a41"
down_revision: str | Sequence[str] | None = "7c1e5a9d3b20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_NUMBER_DATASETS = """
UPDATE datasets SET key = numbered.k
FROM (SELECT id, row_number() OVER (ORDER BY created_at, id) AS k FROM datasets) AS numbered
WHERE datasets.id = numbered.id
"""
_NUMBER_BATCHES = """
UPDATE batches SET key = numbered.k
FROM (
    SELECT id, row_number() OVER (PARTITION BY dataset_id ORDER BY created_at, task_id, position) - 1 AS k
    FROM batches
) AS numbered
WHERE batches.id = numbered.id
"""
_COUNT_BATCHES = """
UPDATE datasets SET next_batch_key = (SELECT count(*) FROM batches WHERE batches.dataset_id = datasets.id)
"""
_KEYED_RECORDS = """
INSERT INTO batch_records (dataset_key, record_hash, batch_key)
SELECT d.key, r.record_hash, b.key
FROM batch_records_text AS r
JOIN datasets AS d ON d.id = r.dataset_id
JOIN batches AS b ON b.id = r.batch_id AND b.dataset_id = r.dataset_id
ORDER BY d.key, r.record_hash
"""
_TEXT_RECORDS = """
INSERT INTO batch_records (dataset_id, batch_id, record_hash)
SELECT d.id, b.id, r.record_hash
FROM batch_records_keyed AS r
JOIN datasets AS d ON d.key = r.dataset_key
JOIN batches AS b ON b.dataset_id = d.id AND b.key = r.batch_key
ORDER BY d.id, r.record_hash
"""


def _set_aside(old: str, aside: str, constraints: Sequence[str]) -> None:
    """Rename table ``old`` to ``aside``; on PostgreSQL its constraints too (their index names
    are schema-wide, and the new table takes them)."""
    op.rename_table(old, aside)
    if op.get_bind().dialect.name == "postgresql":
        for name in constraints:
            op.execute(f"ALTER TABLE {aside} RENAME CONSTRAINT {name} TO {name}_{aside.rsplit('_', 1)[1]}")


_ORPHANS = """
SELECT count(*) FROM batch_records AS r
WHERE NOT EXISTS (SELECT 1 FROM batches AS b WHERE b.id = r.batch_id AND b.dataset_id = r.dataset_id)
"""


def upgrade() -> None:
    bind = op.get_bind()
    orphans = int(bind.scalar(sa.text(_ORPHANS)) or 0)
    if orphans:
        raise RuntimeError(
            f"batch_records: {orphans} rows name a batch that does not exist in their dataset; nothing "
            f"was changed. They are: {_ORPHANS.strip().replace('count(*)', '*')}"
        )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key", sa.BigInteger(), nullable=True))
        batch_op.add_column(
            sa.Column("next_batch_key", sa.BigInteger(), server_default=sa.text("0"), nullable=False)
        )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key", sa.BigInteger(), nullable=True))
    op.execute(_NUMBER_DATASETS)
    op.execute(_NUMBER_BATCHES)
    op.execute(_COUNT_BATCHES)
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column("key", existing_type=sa.BigInteger(), nullable=False)
        batch_op.create_unique_constraint(batch_op.f("uq_datasets_key"), ["key"])
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.alter_column("key", existing_type=sa.BigInteger(), nullable=False)
    if bind.dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE datasets_key_seq OWNED BY datasets.key")
        op.execute("SELECT setval('datasets_key_seq', coalesce(max(key), 0) + 1, false) FROM datasets")

    _set_aside(
        "batch_records", "batch_records_text", ["pk_batch_records", "uq_batch_records_dataset_id_record_hash"]
    )
    op.create_table(
        "batch_records",
        sa.Column("dataset_key", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("record_hash", sa.LargeBinary(), nullable=False),
        sa.Column("batch_key", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("dataset_key", "record_hash", name=op.f("pk_batch_records")),
        sqlite_with_rowid=False,
    )
    op.execute(_KEYED_RECORDS)
    op.create_index(
        op.f("ix_batch_records_dataset_key_batch_key"), "batch_records", ["dataset_key", "batch_key"]
    )
    op.drop_table("batch_records_text")


def downgrade() -> None:
    bind = op.get_bind()
    _set_aside("batch_records", "batch_records_keyed", ["pk_batch_records"])
    op.drop_index(op.f("ix_batch_records_dataset_key_batch_key"), table_name="batch_records_keyed")
    op.create_table(
        "batch_records",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("dataset_id", sa.String(length=40), nullable=False),
        sa.Column("batch_id", sa.String(length=40), nullable=False),
        sa.Column("record_hash", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_records")),
        sa.UniqueConstraint(
            "dataset_id", "record_hash", name=op.f("uq_batch_records_dataset_id_record_hash")
        ),
    )
    # batches.key has no index of its own: one for the join, dropped with the column below
    op.create_index("ix_batches_dataset_id_key_downgrade", "batches", ["dataset_id", "key"])
    op.execute(_TEXT_RECORDS)  # every row joins: its keys were written from its batch's
    op.drop_index("ix_batches_dataset_id_key_downgrade", table_name="batches")
    op.drop_table("batch_records_keyed")
    if bind.dialect.name == "postgresql":
        op.execute("DROP SEQUENCE datasets_key_seq")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("key")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_datasets_key"), type_="unique")
        batch_op.drop_column("next_batch_key")
        batch_op.drop_column("key")
