"""Batch state classes: distinct batch states stored once, reservations held per state class.

Revision ID: c4a1d2e3f505
Revises: c4a1d2e3f504
Create Date: 2026-11-25

Issue 15: a charge over N batches cost N rule calls, N JSON states read and written, and a
certificate with N entries. Batches that have had the same charges are in the same state, so:

* ``batch_states`` holds each distinct state of a dataset once, content-addressed
  (``id = "bs_" + sha256(dataset id, 0x00, canonical state JSON)[:37]``); ``batches.state``
  becomes ``batches.state_id``;
* ``reservation_classes`` holds, per reservation, each distinct (state at reserve, reserved cost,
  committed cost) once with its batch count; ``reservation_batches`` keeps one narrow row per
  batch (``class_index``) instead of three JSON documents;
* ``reservations.batches`` / ``reservations.batch_set`` count the batches and commit to which
  (SHA-256 over the lines ``"<batch id> <class index>\\n"`` in ascending batch id order).

Existing rows are regrouped in Python (the same canonical JSON as ``accountant.canonical``), so
every existing ledger keeps its states, holds and commits exactly; the downgrade expands them
back. Static and reversible: column types are spelled out here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = 'c4a1d2e3f505'
down_revision: str | Sequence[str] | None = 'c4a1d2e3f504'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime(timezone=True)
_batches = sa.table(
    'batches',
    sa.column('id', sa.String(40)),
    sa.column('dataset_id', sa.String(40)),
    sa.column('state', sa.JSON()),
    sa.column('state_id', sa.String(40)),
)
_states = sa.table(
    'batch_states',
    sa.column('id', sa.String(40)),
    sa.column('dataset_id', sa.String(40)),
    sa.column('state', sa.JSON()),
    sa.column('created_at', Timestamp),
)
_reservations = sa.table(
    'reservations',
    sa.column('id', sa.String(40)),
    sa.column('batches', sa.Integer()),
    sa.column('batch_set', sa.String(80)),
)
_reservation_batches = sa.table(
    'reservation_batches',
    sa.column('reservation_id', sa.String(40)),
    sa.column('batch_id', sa.String(40)),
    sa.column('position', sa.Integer()),
    sa.column('state_at_reserve', sa.JSON()),
    sa.column('cost', sa.JSON()),
    sa.column('committed', sa.JSON()),
    sa.column('class_index', sa.Integer()),
)
_classes = sa.table(
    'reservation_classes',
    sa.column('reservation_id', sa.String(40)),
    sa.column('index', sa.Integer()),
    sa.column('state_at_reserve', sa.JSON()),
    sa.column('cost', sa.JSON()),
    sa.column('committed', sa.JSON()),
    sa.column('batches', sa.Integer()),
)


def _document(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(',', ':'), ensure_ascii=True, allow_nan=False)


def _state_id(dataset_id: str, state: Any) -> str:
    digest = hashlib.sha256(dataset_id.encode() + b'\0' + _canonical(state).encode('ascii')).hexdigest()
    return 'bs_' + digest[:37]


def _batch_set(members: list[tuple[str, int]]) -> str:
    h = hashlib.sha256()
    for batch_id, index in sorted(members):
        h.update(f'{batch_id} {index}\n'.encode())
    return 'sha256:' + h.hexdigest()


def upgrade() -> None:
    op.create_table('batch_states',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('dataset_id', sa.String(length=40), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('created_at', Timestamp, nullable=False),
    sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], name=op.f('fk_batch_states_dataset_id_datasets')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batch_states'))
    )
    with op.batch_alter_table('batch_states', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batch_states_dataset_id'), ['dataset_id'], unique=False)
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_id', sa.String(length=40), nullable=True))
    op.create_table('reservation_classes',
    sa.Column('reservation_id', sa.String(length=40), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('state_at_reserve', sa.JSON(), nullable=False),
    sa.Column('cost', sa.JSON(), nullable=False),
    sa.Column('committed', sa.JSON(), nullable=True),
    sa.Column('batches', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['reservation_id'], ['reservations.id'], name=op.f('fk_reservation_classes_reservation_id_reservations')),
    sa.PrimaryKeyConstraint('reservation_id', 'index', name=op.f('pk_reservation_classes'))
    )
    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('class_index', sa.Integer(), nullable=True))
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batches', sa.Integer(), server_default=sa.text('0'), nullable=False))
        batch_op.add_column(sa.Column('batch_set', sa.String(length=80), server_default=sa.text("''"), nullable=False))

    connection = op.get_bind()
    now = datetime.now(UTC)
    seen: set[str] = set()
    moves: list[dict[str, Any]] = []
    rows = connection.execute(sa.select(_batches.c.id, _batches.c.dataset_id, _batches.c.state)).all()
    for batch_id, dataset_id, stored in rows:
        state = _document(stored)
        state_id = _state_id(dataset_id, state)
        if state_id not in seen:
            seen.add(state_id)
            connection.execute(
                _states.insert().values(id=state_id, dataset_id=dataset_id, state=state, created_at=now)
            )
        moves.append({'b_id': batch_id, 'b_state_id': state_id})
    if moves:
        connection.execute(
            _batches.update().where(_batches.c.id == sa.bindparam('b_id')).values(state_id=sa.bindparam('b_state_id')),
            moves,
        )

    held = connection.execute(
        sa.select(
            _reservation_batches.c.reservation_id,
            _reservation_batches.c.batch_id,
            _reservation_batches.c.state_at_reserve,
            _reservation_batches.c.cost,
            _reservation_batches.c.committed,
        ).order_by(_reservation_batches.c.reservation_id, _reservation_batches.c.position)
    ).all()
    by_reservation: dict[str, list[tuple[str, Any, Any, Any]]] = {}
    for reservation_id, batch_id, at_reserve, cost, committed in held:
        by_reservation.setdefault(reservation_id, []).append(
            (batch_id, _document(at_reserve), _document(cost), _document(committed))
        )
    for reservation_id, members in by_reservation.items():
        members.sort(key=lambda m: m[0])  # classes numbered by first batch id, as the ledger does
        index_of: dict[str, int] = {}
        counts: list[int] = []
        marks: list[dict[str, Any]] = []
        for batch_id, at_reserve, cost, committed in members:
            key = _canonical([at_reserve, cost, committed])
            if key not in index_of:
                index_of[key] = len(counts)
                counts.append(0)
                connection.execute(
                    _classes.insert().values(
                        reservation_id=reservation_id,
                        index=index_of[key],
                        state_at_reserve=at_reserve,
                        cost=cost,
                        committed=committed,
                        batches=0,
                    )
                )
            counts[index_of[key]] += 1
            marks.append({'r_id': reservation_id, 'b_id': batch_id, 'r_index': index_of[key]})
        for index, count in enumerate(counts):
            connection.execute(
                _classes.update()
                .where(_classes.c.reservation_id == reservation_id, _classes.c.index == index)
                .values(batches=count)
            )
        connection.execute(
            _reservation_batches.update()
            .where(
                _reservation_batches.c.reservation_id == sa.bindparam('r_id'),
                _reservation_batches.c.batch_id == sa.bindparam('b_id'),
            )
            .values(class_index=sa.bindparam('r_index')),
            marks,
        )
        connection.execute(
            _reservations.update()
            .where(_reservations.c.id == reservation_id)
            .values(
                batches=len(members),
                batch_set=_batch_set([(m['b_id'], m['r_index']) for m in marks]),
            )
        )

    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.alter_column('class_index', existing_type=sa.Integer(), nullable=False)
        batch_op.drop_column('state_at_reserve')
        batch_op.drop_column('cost')
        batch_op.drop_column('committed')
        batch_op.create_index(batch_op.f('ix_reservation_batches_reservation_id_class_index'), ['reservation_id', 'class_index'], unique=False)
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.alter_column('state_id', existing_type=sa.String(length=40), nullable=False)
        batch_op.create_foreign_key(batch_op.f('fk_batches_state_id_batch_states'), 'batch_states', ['state_id'], ['id'])
        batch_op.create_index(batch_op.f('ix_batches_state_id'), ['state_id'], unique=False)
        batch_op.drop_column('state')


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state', sa.JSON(), nullable=True))
    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_at_reserve', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('cost', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('committed', sa.JSON(), nullable=True))

    connection = op.get_bind()
    states = {
        state_id: _document(state)
        for state_id, state in connection.execute(sa.select(_states.c.id, _states.c.state))
    }
    rows = connection.execute(sa.select(_batches.c.id, _batches.c.state_id)).all()
    if rows:
        connection.execute(
            _batches.update().where(_batches.c.id == sa.bindparam('b_id')).values(state=sa.bindparam('b_state')),
            [{'b_id': batch_id, 'b_state': states[state_id]} for batch_id, state_id in rows],
        )
    classes = {
        (reservation_id, index): (_document(at_reserve), _document(cost), _document(committed))
        for reservation_id, index, at_reserve, cost, committed in connection.execute(
            sa.select(_classes.c.reservation_id, _classes.c.index, _classes.c.state_at_reserve, _classes.c.cost, _classes.c.committed)
        )
    }
    held = connection.execute(
        sa.select(_reservation_batches.c.reservation_id, _reservation_batches.c.batch_id, _reservation_batches.c.class_index)
    ).all()
    if held:
        connection.execute(
            _reservation_batches.update()
            .where(
                _reservation_batches.c.reservation_id == sa.bindparam('r_id'),
                _reservation_batches.c.batch_id == sa.bindparam('b_id'),
            )
            .values(state_at_reserve=sa.bindparam('r_at'), cost=sa.bindparam('r_cost'), committed=sa.bindparam('r_committed')),
            [
                {'r_id': r, 'b_id': b, 'r_at': at, 'r_cost': cost, 'r_committed': committed}
                for r, b, index in held
                for at, cost, committed in (classes[(r, index)],)
            ],
        )

    op.drop_table('reservation_classes')
    with op.batch_alter_table('reservations', schema=None) as batch_op:
        batch_op.drop_column('batch_set')
        batch_op.drop_column('batches')
    with op.batch_alter_table('reservation_batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_reservation_batches_reservation_id_class_index'))
        batch_op.alter_column('state_at_reserve', existing_type=sa.JSON(), nullable=False)
        batch_op.alter_column('cost', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column('class_index')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.alter_column('state', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_index(batch_op.f('ix_batches_state_id'))
        batch_op.drop_constraint(batch_op.f('fk_batches_state_id_batch_states'), type_='foreignkey')
        batch_op.drop_column('state_id')
    with op.batch_alter_table('batch_states', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batch_states_dataset_id'))
    op.drop_table('batch_states')
