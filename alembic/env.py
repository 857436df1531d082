"""Alembic environment of privacy-ledger.

Run through ``service.db.migrations`` (``ledger migrate``, ``ledger serve``), which passes the URL
in ``config.attributes["url"]``; from the ``alembic`` command line the URL comes from
``-x url=...``, ``sqlalchemy.url`` or ``LEDGER_DATABASE_URL``. Each migration runs in a
transaction (SQLite included: the engine emits its own BEGIN), and on PostgreSQL under an
advisory lock, so two processes starting at once cannot migrate concurrently.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from sqlalchemy import text
from sqlalchemy.pool import NullPool

from alembic import context
from service.db.models import Base
from service.db.session import create_ledger_engine

# pg_advisory_xact_lock key: "ledger migrate"
_MIGRATION_LOCK_KEY = 0x4C4544474552

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None and config.attributes.get("url") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)  # the command line


def _url() -> object:
    url = config.attributes.get("url")
    if url is not None:
        return url
    url = context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    return url or os.environ.get("LEDGER_DATABASE_URL", "sqlite:///./ledger.db")


def run_migrations_offline() -> None:
    context.configure(
        url=str(_url()),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_ledger_engine(_url(), poolclass=NullPool)  # type: ignore[arg-type]
    try:
        with engine.connect() as connection:
            is_sqlite = connection.dialect.name == "sqlite"
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=is_sqlite,
                # SQLite's DDL is transactional once the engine emits BEGIN itself (it does).
                transactional_ddl=True,
                compare_type=True,
            )
            if is_sqlite:
                # SQLite's documented procedure for rebuilding a table that other rows reference
                # (https://www.sqlite.org/lang_altertable.html#otheralter): foreign keys off
                # *outside* the transaction (the pragma is a no-op inside one), then
                # ``foreign_key_check`` before commit. Set on the driver's connection: a
                # statement through ``connection`` would begin the transaction first.
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY}
                    )
                context.run_migrations()
                if is_sqlite:
                    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"the migration left rows without their parent: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
