"""Per-tenant budgets of pricing CPU time: what one tenant's requests may take of the server.

Pricing an event (its RDP curve, its PRV composition) is the one part of a request whose cost a
client chooses. ``service.ledger.pricing_limits`` bounds one request (``LEDGER_MAX_PRICING_WORK``) and
prices it outside the spend transaction, so a costly event no longer holds the database's write
lock. This module bounds a tenant's *rate*: each tenant has a bucket of pricing CPU seconds,
``LEDGER_PRICING_BURST_S`` deep, refilled at ``LEDGER_PRICING_CPU_S_PER_S`` seconds per second.

* ``admit(work)``: before pricing, the request's estimated cost (``SECONDS_PER_UNIT`` per unit of
  pricing work: the measured cost of an RDP curve per event node and order, before caching) is
  taken from the bucket; with less than that in the bucket (at most the whole bucket: one request
  at the per-request bound must stay possible) the request is refused, 429 ``rate_limited`` with
  ``Retry-After``, nothing priced and nothing locked. Taking the estimate at admission means that
  concurrent requests cannot all pass on the same tokens.
* ``spent(work, cpu_s)``: after pricing, the estimate is replaced by the CPU time the pricing
  thread really used. A repeated event is a cache hit and costs microseconds, so a trainer that
  reserves the same DP-SGD step event a thousand times a second pays for what it costs, not
  for what it could have cost.

Where the buckets live (``LEDGER_RATE_LIMITS``): ``database`` keeps each tenant's bucket in the
ledger's database (``service.ledger.meters``: one locked row per tenant, one short write
transaction only when a process's float of the tenant's seconds runs out:
``SharedPricingRates``), shared by every API process and host, so the configured rate holds for
the tenant in total; ``process`` keeps it in the process (no database work, but N processes let a
tenant use N times the rate: divide the rate by N by hand). ``auto`` (default): ``database`` on
PostgreSQL (the multi-process, multi-host deployment), ``process`` on SQLite (one host, and its
single write lock is the spends'). Tenants never share a bucket.

The key-lookup cache (``service.api.deps.PrincipalCache``, ``LEDGER_AUTH_CACHE_TTL_S``, off by
default) stays per process on purpose: it exists to save the database round trip a shared cache
would make, and what it bounds — how long a revoked key may keep working — is the TTL in every
process, whatever their number.

Certificate verification on the server (``POST /v1/certificates/{id}/verify``) is metered by the
same buckets (``service.ledger.certificates.verify_stored``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio

from service.api.schemas import ErrorBody
from service.db.session import Database
from service.ledger import meters, pricing_limits
from service.ledger.errors import RateLimited
from service.settings import Settings

SECONDS_PER_UNIT: Final = 75e-6
"""Estimated CPU seconds per unit of pricing work (an uncached RDP curve: ≈ 70 µs per event node
and order on the reference machine, docs/RELIABILITY.md)."""
RATE_LIMITED: Final[dict[int | str, dict[str, Any]]] = {
    429: {
        "model": ErrorBody,
        "description": "`rate_limited`: the tenant used its share of the server's pricing time "
        "(`LEDGER_PRICING_CPU_S_PER_S`); `Retry-After` says when to retry",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    }
}
"""The 429 answer of the routes that price, for their OpenAPI ``responses``."""
MAX_TENANTS: Final = 100_000
"""Buckets kept per process (least recently used dropped; a dropped tenant starts full again)."""


@dataclass
class _Bucket:
    tokens: float
    at: float


class PricingRates:
    """Every tenant's bucket of pricing CPU seconds in this process (module docstring)."""

    def __init__(
        self,
        *,
        rate_s: float,
        burst_s: float,
        max_work: int = pricing_limits.DEFAULT_MAX_WORK,
        threads: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (rate_s > 0 and burst_s > 0):
            raise ValueError("rate_s and burst_s must be > 0")
        self.rate_s = rate_s
        self.burst_s = burst_s
        self.max_work = max_work
        self.limiter = anyio.CapacityLimiter(threads)
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Settings, db: Database | None = None) -> PricingRates:
        """The buckets ``settings.rate_limits`` asks for: shared through ``db`` or in the process."""
        arguments: dict[str, Any] = {
            "rate_s": settings.pricing_cpu_s_per_s,
            "burst_s": settings.pricing_burst_s,
            "max_work": settings.max_pricing_work,
            "threads": settings.pricing_threads,
        }
        shared = settings.rate_limits == "database" or (
            settings.rate_limits == "auto" and settings.database_url.startswith("postgresql")
        )
        if shared and db is not None:
            return SharedPricingRates(db, **arguments)
        return cls(**arguments)

    def policy(self, tenant_id: str) -> pricing_limits.Policy:
        """The pricing policy of one request of ``tenant_id``."""
        return pricing_limits.Policy(
            max_work=self.max_work, meter=TenantMeter(self, tenant_id), limiter=self.limiter
        )

    def _bucket(self, tenant_id: str, now: float) -> _Bucket:
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            bucket = _Bucket(self.burst_s, now)
            self._buckets[tenant_id] = bucket
            while len(self._buckets) > MAX_TENANTS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(tenant_id)
            bucket.tokens = min(self.burst_s, bucket.tokens + (now - bucket.at) * self.rate_s)
            bucket.at = now
        return bucket

    def _withdraw(self, tenant_id: str, wanted: float) -> float:
        """Take ``wanted`` if the bucket holds it (0.0), else the wait until it does."""
        with self._lock:
            bucket = self._bucket(tenant_id, self._clock())
            if bucket.tokens < wanted:
                return (wanted - bucket.tokens) / self.rate_s
            bucket.tokens -= wanted
            return 0.0

    def take(self, tenant_id: str, seconds: float) -> None:
        """Take ``seconds`` (capped at the bucket's depth) from the tenant's bucket, or raise
        ``RateLimited`` with the wait until they are there."""
        wanted = min(seconds, self.burst_s)
        wait = self._withdraw(tenant_id, wanted)
        if wait > 0:
            raise RateLimited(
                f"this tenant has used its share of the server's pricing time (about "
                f"{self.rate_s:g} CPU-seconds per second, bursts of {self.burst_s:g} s; "
                f"LEDGER_PRICING_CPU_S_PER_S, LEDGER_PRICING_BURST_S): this request needs about "
                f"{wanted:.3g} s. Retry in {math.ceil(wait)} s, or send events that cost less "
                "to price (fewer event nodes, a budget with fewer orders).",
                retry_after_s=wait,
                tenant_id=tenant_id,
            )

    def give_back(self, tenant_id: str, seconds: float) -> None:
        """Return ``seconds`` (negative: take more; the bucket may go below 0, the next request
        waits for it) to the tenant's bucket."""
        with self._lock:
            bucket = self._bucket(tenant_id, self._clock())
            bucket.tokens = min(self.burst_s, bucket.tokens + seconds)

    def tokens(self, tenant_id: str) -> float:
        """Seconds in the tenant's bucket now (a full bucket for a tenant not seen yet)."""
        with self._lock:
            return self._bucket(tenant_id, self._clock()).tokens


class SharedPricingRates(PricingRates):
    """``PricingRates`` whose buckets are rows of the ledger's database (``service.ledger.meters``),
    shared by every API process on it. Called in the pricing threads (never the event loop).

    Each process keeps a small *float* per tenant: seconds it took from the shared bucket and
    has not used yet. A request is admitted from the float when it holds the estimate; else the
    process takes what is missing from the shared row, plus up to ``float_s`` more if the row
    has it (one short transaction). What pricing really used is settled on the float, and a
    float above twice ``float_s`` goes back to the row. So a run of cached (cheap) events costs
    no database work, while every second a tenant uses still came out of the one shared bucket:
    the rate holds in total, and a tenant can at most find ``float_s`` per process idle in
    floats (taken, not yet used) — which slows it, never lets it exceed the rate.
    """

    METER: Final = "pricing"
    FLOAT_FRACTION: Final = 0.05
    """A process's float: this fraction of the bucket's depth."""

    def __init__(self, db: Database, **arguments: Any) -> None:
        super().__init__(**arguments)
        self.db = db
        self.float_s = self.burst_s * self.FLOAT_FRACTION
        self._floats: dict[str, float] = {}
        self._withdrawing = threading.Lock()  # one database withdrawal at a time per process

    def _bucket_of(self, tenant_id: str) -> dict[str, Any]:
        return {"tenant_id": tenant_id, "meter": self.METER, "rate_s": self.rate_s, "burst_s": self.burst_s}

    def _from_float(self, tenant_id: str, wanted: float) -> bool:
        with self._lock:
            held = self._floats.get(tenant_id, 0.0)
            if held < wanted:
                return False
            self._floats[tenant_id] = held - wanted
            return True

    def _withdraw(self, tenant_id: str, wanted: float) -> float:
        if self._from_float(tenant_id, wanted):
            return 0.0
        with self._withdrawing:
            if self._from_float(tenant_id, wanted):  # another thread refilled it meanwhile
                return 0.0
            with self._lock:
                missing = wanted - self._floats.get(tenant_id, 0.0)
            taken, wait = meters.withdraw(
                self.db, wanted=missing, extra=self.float_s, now_s=time.time(), **self._bucket_of(tenant_id)
            )
            if wait > 0:
                return wait
            with self._lock:
                self._floats[tenant_id] = self._floats.get(tenant_id, 0.0) + taken - wanted
            return 0.0

    def give_back(self, tenant_id: str, seconds: float) -> None:
        with self._lock:
            held = self._floats.get(tenant_id, 0.0) + seconds
            surplus = held - self.float_s if held > 2 * self.float_s else 0.0
            self._floats[tenant_id] = held - surplus
            while len(self._floats) > MAX_TENANTS:  # (an evicted float is lost: the tenant pays it)
                self._floats.pop(next(iter(self._floats)))
        if surplus > 0:
            meters.deposit(self.db, seconds=surplus, now_s=time.time(), **self._bucket_of(tenant_id))

    def tokens(self, tenant_id: str) -> float:
        shared = meters.level(self.db, now_s=time.time(), **self._bucket_of(tenant_id))
        with self._lock:
            return shared + self._floats.get(tenant_id, 0.0)


@dataclass(frozen=True)
class TenantMeter:
    """``pricing_limits.Meter`` of one tenant's request: estimate at admission, CPU time after."""

    rates: PricingRates
    tenant_id: str

    def admit(self, work: int) -> None:
        self.rates.take(self.tenant_id, work * SECONDS_PER_UNIT)

    def spent(self, work: int, cpu_s: float) -> None:
        estimate = min(work * SECONDS_PER_UNIT, self.rates.burst_s)
        self.rates.give_back(self.tenant_id, estimate - cpu_s)


__all__ = [
    "MAX_TENANTS",
    "RATE_LIMITED",
    "SECONDS_PER_UNIT",
    "PricingRates",
    "SharedPricingRates",
    "TenantMeter",
]
