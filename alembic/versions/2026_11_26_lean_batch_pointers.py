"""Lean batch rows: a charge rewrites one narrow pointer per batch, nothing else.

Revision ID: d6e1f0a2b7c3
Revises: c4a1d2e3f5a1
Create Date: 2026-11-26

Issue 15: measured per row, a charge's two set-based rewrites of ``batches.state_id`` and its
membership insert spent most of their time on what the rows carried beside the pointer, not on
the pointer (``bench/scale.py``; design note 30):

* ``batches.epsilon_spent`` / ``epsilon_held`` / ``delta_spent`` / ``naive_epsilon`` copied the
  batch's state; the views now read them from the state's row (``batch_states``), so they go;
* the index on ``batches.state_id`` was updated on every move and is not needed (moves find
  their batches by dataset, task or membership; an error names a batch by scanning its
  dataset);
* the foreign keys of ``batches.state_id``, ``reservation_batches.batch_id`` /
  ``reservation_id`` and ``batch_records.batch_id`` / ``dataset_id`` were checked per row (a
  trigger per row on PostgreSQL: 8 µs of the 10.5 µs of a membership insert, 7.3 of the 11.7 µs
  of a record's) although the transaction that writes these rows takes each key from a row it
  has just read or written under the dataset's lock, and nothing is ever deleted from a ledger;
* on PostgreSQL ``batches`` keeps half of each page free (``fillfactor = 50``): with no indexed
  column changed, a move is then a heap-only (HOT) update in place (1.1 µs a row against 13.7
  µs measured with the index, the foreign key and full pages). It applies to pages written from
  now on; ``VACUUM FULL batches`` rewrites existing ones.

Static and reversible: column types are spelled out here; the downgrade restores the columns
from each batch's state, the index, the foreign keys and the default fill factor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'd6e1f0a2b7c3'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f5a1'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Exact = sa.Numeric().with_variant(sa.Text(), "sqlite")
_COPIED = ('epsilon_spent', 'epsilon_held', 'delta_spent', 'naive_epsilon')
_batches = sa.table('batches', sa.column('state_id', sa.String(40)), *(sa.column(c, Exact) for c in _COPIED))
_states = sa.table('batch_states', sa.column('id', sa.String(40)), sa.column('state', sa.JSON()))


def upgrade() -> None:
    with op.batch_alter_table('batch_records', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_batch_records_batch_id_batches'), type_='foreignkey')
        batch_op.drop_constraint(batch_op.f('fk_batch_records_dataset_id_datasets'), type_='foreignkey')
    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_reservation_batches_batch_id_batches'), type_='foreignkey')
        batch_op.drop_constraint(batch_op.f('fk_reservation_batches_reservation_id_reservations'), type_='foreignkey')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_state_id'))
        batch_op.drop_constraint(batch_op.f('fk_batches_state_id_batch_states'), type_='foreignkey')
        for column in _COPIED:
            batch_op.drop_column(column)
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE batches SET (fillfactor = 50)')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE batches RESET (fillfactor)')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        for column in _COPIED:
            batch_op.add_column(sa.Column(column, Exact, server_default=sa.text("'0'"), nullable=False))
    connection = op.get_bind()
    for state_id, state in connection.execute(sa.select(_states.c.id, _states.c.state)):
        if isinstance(state, str):  # SQLite drivers may hand JSON back as text
            state = json.loads(state)
        connection.execute(
            _batches.update()
            .where(_batches.c.state_id == state_id)
            .values({c: state.get(c, '0') for c in _COPIED})
        )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f('fk_batches_state_id_batch_states'), 'batch_states', ['state_id'], ['id'])
        batch_op.create_index(batch_op.f('ix_batches_state_id'), ['state_id'], unique=False)
    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f('fk_reservation_batches_reservation_id_reservations'), 'reservations', ['reservation_id'], ['id'])
        batch_op.create_foreign_key(batch_op.f('fk_reservation_batches_batch_id_batches'), 'batches', ['batch_id'], ['id'])
    with op.batch_alter_table('batch_records', schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f('fk_batch_records_dataset_id_datasets'), 'datasets', ['dataset_id'], ['id'])
        batch_op.create_foreign_key(batch_op.f('fk_batch_records_batch_id_batches'), 'batches', ['batch_id'], ['id'])
