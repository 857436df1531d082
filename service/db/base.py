"""Declarative base and the column types the ledger needs on both SQLite and PostgreSQL.

* ``ExactDecimal`` — budgets and spends as exact decimals (docs/ARCHITECTURE.md, "Numerical safety"):
  ``NUMERIC`` without precision on PostgreSQL (arbitrary precision, ``Infinity`` allowed since
  PostgreSQL 14), canonical decimal text (``accountant.exact.to_text``) on SQLite, whose own
  NUMERIC affinity would turn the value into a binary float. Python sees ``Decimal`` either way.
* ``UtcDateTime`` — timezone-aware UTC datetimes on both databases (SQLite keeps no zone; its
  text form ``YYYY-MM-DD HH:MM:SS.ffffff`` sorts correctly, so range queries work).
* ``Document`` — a JSON document. Plain ``JSON`` (not ``JSONB``) on PostgreSQL so a stored
  certificate keeps its exact text; the ledger never queries inside documents.

Constraint names come from ``NAMING_CONVENTION`` so that migrations and error translation
(``service.db.session``) can refer to them by name.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import JSON, BigInteger, DateTime, Dialect, Integer, MetaData, Numeric, Text
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator, TypeEngine

from accountant.exact import to_text

NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class ExactDecimal(TypeDecorator[Decimal]):
    """An exact ``Decimal``: ``NUMERIC`` on PostgreSQL, canonical text elsewhere."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(Numeric(asdecimal=True))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if not isinstance(value, Decimal):
            raise TypeError(f"ExactDecimal takes a Decimal, not {type(value).__name__}: {value!r}")
        if value.is_nan():
            raise ValueError("ExactDecimal refuses NaN")
        if dialect.name == "postgresql":
            return value
        return to_text(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Decimal | None:
        if value is None:
            return None
        if isinstance(value, Decimal):
            return value
        if isinstance(value, float):  # never stored by us; refuse to guess
            raise TypeError(f"ExactDecimal column returned a float: {value!r}")
        return Decimal(str(value))


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out; naive datetimes are refused on the way in."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"UtcDateTime needs an aware datetime. Found {value!r}.")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# JSON documents: the generic type (TEXT on SQLite, json on PostgreSQL).
Document = JSON

# 64-bit integer keys; SQLite's rowid alias must be spelled INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 - SQLAlchemy's declarative protocol
        Decimal: ExactDecimal(),
        datetime: UtcDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }
