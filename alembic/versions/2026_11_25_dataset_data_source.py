"""Datasets own their data source: ``datasets.data_source`` (nullable text, at most 2000 characters).

Revision ID: c4a1d2e3f501
Revises: 7b3e9c1d5a20
Create Date: 2026-11-25

Until this revision a job named the records it trained on in ``params.data_source``, any
``file://`` path included, so a trainer key could read any ``.csv``/``.npz`` the worker could
(issue 12 §1). From now on the source belongs to the dataset, set by an admin of its tenant, and
``file://`` sources must lie under the tenant's data roots (``LEDGER_DATA_ROOTS``).

Existing datasets: the column starts ``NULL`` (no source: a job on the dataset is refused until an
admin sets one with ``PUT /v1/datasets/{id}/data-source``), with one automatic carry-over. When
*every* job of a dataset named the same ``builtin:`` source, that source is copied to the dataset:
a built-in source is the same public, packaged data for every tenant, reads no file, and was
already validated when the job was submitted, so copying it grants nothing new. A ``file://``
source is never carried over, nor a dataset whose jobs disagree: the path may lie outside the
data roots an operator now configures, or be another tenant's file (the finding itself), so an
admin must set it again, where the API checks it against the roots.

Static and reversible: the column type is spelled out here; the carry-over reads the jobs' params
in Python (JSON functions differ between SQLite and PostgreSQL), and the downgrade drops the
column (the jobs keep their old params, so nothing the old code reads is lost).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f501'
down_revision: str | Sequence[str] | None = '7b3e9c1d5a20'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LENGTH = 2000
_datasets = sa.table('datasets', sa.column('id', sa.String(40)), sa.column('data_source', sa.String(_LENGTH)))
_jobs = sa.table('jobs', sa.column('dataset_id', sa.String(40)), sa.column('params', sa.JSON()))


def _builtin_source(params: Any) -> str | None:
    """The job's ``params.data_source`` if it is a ``builtin:`` URI that fits the column."""
    if isinstance(params, str):  # a JSON column read back as text by some drivers
        try:
            params = json.loads(params)
        except ValueError:
            return None
    source = params.get('data_source') if isinstance(params, dict) else None
    if isinstance(source, str) and source.startswith('builtin:') and len(source) <= _LENGTH:
        return source
    return None


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('data_source', sa.String(length=_LENGTH), nullable=True))

    connection = op.get_bind()
    sources: dict[str, set[str | None]] = {}
    for dataset_id, params in connection.execute(sa.select(_jobs.c.dataset_id, _jobs.c.params)):
        sources.setdefault(dataset_id, set()).add(_builtin_source(params))
    for dataset_id, named in sorted(sources.items()):
        if len(named) == 1 and None not in named:
            connection.execute(
                _datasets.update().where(_datasets.c.id == dataset_id).values(data_source=named.pop())
            )


def downgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_column('data_source')
