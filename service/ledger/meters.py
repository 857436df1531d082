"""Token buckets shared by every API process on one database (issue 30 §2).

A tenant's bucket of a metered resource (``meter``: ``"pricing"``, seconds of pricing CPU) is one
row of ``meter_buckets``: the seconds left and when that was written. Each operation is one short
write transaction that locks the row (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite's write
lock), refills it at ``rate_s`` per second since it was written (up to ``burst_s``), then takes or
gives back. So the configured rate holds for the tenant in total, whatever the number of API
processes or hosts: two concurrent requests on two hosts cannot both spend the same tokens.

Time is the API host's wall clock (``time.time()``): hosts kept within milliseconds by NTP
refill within that of each other; a clock behind the row's time refills nothing (never a
negative refill), so a skewed host can slow a tenant down, not speed it up.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.dialects import postgresql, sqlite

from service.db.models import MeterBucket
from service.db.session import Database

_BUCKETS = MeterBucket.__table__


def _locked(
    connection: Connection, tenant_id: str, meter: str, *, rate_s: float, burst_s: float, now_s: float
) -> float:
    """The bucket's tokens refilled to ``now_s``, its row locked (created full if new)."""
    where = (_BUCKETS.c.tenant_id == tenant_id, _BUCKETS.c.meter == meter)
    query = select(_BUCKETS.c.tokens, _BUCKETS.c.at_s).where(*where).with_for_update()
    row = connection.execute(query).first()
    if row is None:
        dialect: Any = postgresql if connection.dialect.name == "postgresql" else sqlite
        new = dialect.insert(_BUCKETS).values(tenant_id=tenant_id, meter=meter, tokens=burst_s, at_s=now_s)
        connection.execute(new.on_conflict_do_nothing())
        row = connection.execute(query).one()
    return float(min(burst_s, row.tokens + max(0.0, now_s - row.at_s) * rate_s))


def _write(connection: Connection, tenant_id: str, meter: str, tokens: float, now_s: float) -> None:
    connection.execute(
        update(MeterBucket)
        .where(_BUCKETS.c.tenant_id == tenant_id, _BUCKETS.c.meter == meter)
        .values(tokens=tokens, at_s=now_s)
    )


def withdraw(
    db: Database,
    tenant_id: str,
    meter: str,
    wanted: float,
    *,
    rate_s: float,
    burst_s: float,
    now_s: float,
    extra: float = 0.0,
) -> tuple[float, float]:
    """Take ``wanted`` seconds from the bucket if it holds them, and up to ``extra`` more that it
    also holds: ``(taken, 0.0)``; else take nothing: ``(0.0, seconds until it holds wanted)``."""
    with db.transaction() as connection:
        tokens = _locked(connection, tenant_id, meter, rate_s=rate_s, burst_s=burst_s, now_s=now_s)
        if tokens < wanted:
            _write(connection, tenant_id, meter, tokens, now_s)
            return 0.0, (wanted - tokens) / rate_s
        taken = wanted + max(0.0, min(extra, tokens - wanted))
        _write(connection, tenant_id, meter, tokens - taken, now_s)
        return taken, 0.0


def deposit(
    db: Database, tenant_id: str, meter: str, seconds: float, *, rate_s: float, burst_s: float, now_s: float
) -> None:
    """Give ``seconds`` back (negative: take more; the bucket may go below 0)."""
    with db.transaction() as connection:
        tokens = _locked(connection, tenant_id, meter, rate_s=rate_s, burst_s=burst_s, now_s=now_s)
        _write(connection, tenant_id, meter, min(burst_s, tokens + seconds), now_s)


def level(db: Database, tenant_id: str, meter: str, *, rate_s: float, burst_s: float, now_s: float) -> float:
    """Seconds in the bucket now (a full bucket for a tenant not seen yet)."""
    with db.transaction() as connection:
        return _locked(connection, tenant_id, meter, rate_s=rate_s, burst_s=burst_s, now_s=now_s)


__all__ = ["deposit", "level", "withdraw"]
