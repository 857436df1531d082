"""Run the Alembic migrations programmatically: the only way the schema is created or changed.

The migration scripts live in the repository's top-level ``alembic/`` folder (no
``__init__.py``: it must never shadow the ``alembic`` library). It is found relative to the
``service`` package's parent, which is the repository root both in a source checkout and in an
editable install (``pip install -e .``).
"""

from __future__ import annotations

import threading
from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

import service
from alembic import command
from service.db.session import create_ledger_engine


def script_location() -> Path:
    """The ``alembic/`` folder next to the ``service`` package."""
    location = Path(service.__file__).resolve().parent.parent / "alembic"
    if not (location / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic scripts not found at {location}; install privacy-ledger from a source "
            "checkout (pip install -e .)"
        )
    return location


def alembic_config(url: str | URL) -> Config:
    """An Alembic ``Config`` for ``url``; ``alembic/env.py`` reads the URL from its attributes."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d_%%(slug)s")
    config.attributes["url"] = make_url(url)
    return config


# Alembic's ``context`` is one object per process: commands in several threads would share it.
_ALEMBIC = threading.Lock()


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest).

    Safe to run from several processes at once: PostgreSQL migrations take an advisory lock and
    SQLite ones run inside ``BEGIN IMMEDIATE``; the later ones find the schema up to date.
    """
    with _ALEMBIC:
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"``: no tables at all)."""
    with _ALEMBIC:
        command.downgrade(alembic_config(url), revision)


def current_revision(url: str | URL) -> str | None:
    """The revision the database is at (``None``: never migrated)."""
    engine = create_ledger_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite:///unused.db")).get_current_head()
    assert head is not None
    return head


def is_up_to_date(url: str | URL) -> bool:
    return current_revision(url) == head_revision()


def sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite URL (``None``: another backend, or in memory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(str(parsed.database)).expanduser()


def make_home(url: str | URL) -> None:
    """Create the folder of a SQLite database (the ledger's home, 0700) before it is migrated."""
    path = sqlite_file(url)
    if path is not None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)


def missing_ledger(url: str | URL) -> str | None:
    """Why ``url`` holds no ledger this version can use, in one line (``None``: it does). A
    missing SQLite file is never created here (the engine would make an empty one)."""
    shown = make_url(url).render_as_string(hide_password=True)
    path = sqlite_file(url)
    if path is not None and not path.is_file():
        return (
            f"no ledger at {path} (no such file): run 'ledger serve' or 'ledger migrate' to create "
            "one, or point at yours with --home DIR / LEDGER_HOME or LEDGER_DATABASE_URL."
        )
    try:
        current = current_revision(url)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        return f"cannot open the database at {shown}: {reason}"
    if current is None:
        return f"the database at {shown} holds no ledger (never migrated): run 'ledger migrate' first."
    head = head_revision()
    if current != head:
        return (
            f"the ledger at {shown} is at schema revision {current}; this version needs {head}: "
            "run 'ledger migrate' first."
        )
    return None


__all__ = [
    "alembic_config",
    "current_revision",
    "downgrade",
    "head_revision",
    "is_up_to_date",
    "make_home",
    "missing_ledger",
    "script_location",
    "sqlite_file",
    "upgrade",
]
