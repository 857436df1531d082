"""One home for every byte that is hashed or signed.

Event fingerprints, certificate content hashes, audit-chain entry hashes, idempotency request
hashes, export-bundle hashes and the messages signed for certificates and audit heads are all
SHA-256 (or Ed25519) over the **canonical JSON** of a document: keys sorted, no spaces, ASCII only
(``\\uXXXX`` escapes), NaN and infinities refused. Timestamps inside hashed documents are UTC with
microseconds, ``2026-11-25T18:00:00.000000Z``. A verifier recomputes these bytes, so two encoders
that differ in one flag would break verification silently; every hash goes through here
(``tests/test_hashing.py`` checks that nothing else calls ``json.dumps(..., sort_keys=True)``
or formats a hashed timestamp).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

TIMESTAMP_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"
"""Hashed timestamps: ``datetime.strptime(text, TIMESTAMP_FORMAT).replace(tzinfo=UTC)`` gives the
instant back."""


def canonical_json(value: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """The canonical JSON text of ``value`` (``default`` converts what JSON has no type for)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, default=default
    )


def canonical_bytes(value: Any, *, default: Callable[[Any], Any] | None = None) -> bytes:
    """The canonical JSON of ``value`` as bytes (ASCII)."""
    return canonical_json(value, default=default).encode("ascii")


def sha256_hex(value: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """SHA-256 (hex) of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_bytes(value, default=default)).hexdigest()


def timestamp(value: datetime) -> str:
    """``value`` as a hashed timestamp (UTC, microseconds, ``Z``)."""
    return value.astimezone(UTC).strftime(TIMESTAMP_FORMAT)


def parse_timestamp(text: str) -> datetime:
    """The instant a hashed timestamp names (``ValueError`` if it is not one)."""
    return datetime.strptime(text, TIMESTAMP_FORMAT).replace(tzinfo=UTC)


__all__ = [
    "TIMESTAMP_FORMAT",
    "canonical_bytes",
    "canonical_json",
    "parse_timestamp",
    "sha256_hex",
    "timestamp",
]
