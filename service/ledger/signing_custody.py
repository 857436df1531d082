"""Signing-key custody: which keys have signed for this database, and a start that refuses to
sign with a new key while an old one is missing.

Every process that signs for a database records its active key here (``signing_keys`` rows:
key id, public key, first seen) before it signs anything. A lost key file used to be replaced by
a fresh key at the next start, silently, and every certificate signed before verified
``unknown_key`` from then on (issue 24 §6). ``admit`` refuses a key ring (``SecretError``, the
start fails, as for a key-hash secret none of the stored keys was hashed with:
``tenancy.check_key_hash_secret``) while the database records a key that is neither its active
key nor one of its retired keys, unless an admin declared that key lost
(``LEDGER_SIGNING_KEYS_LOST``): then ``lost_at`` is set and ``signing_key.declared_lost`` is
appended to the global audit chain, once.
"""

from __future__ import annotations

import base64
from collections.abc import Collection
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from service.db.base import utcnow
from service.db.models import SigningKeyRecord
from service.db.session import Database
from service.ledger import audit
from service.verification.signing import KeyRing


class UnknownSigningKeys(RuntimeError):
    """The database records keys this process neither holds nor retires (``key_ids``)."""

    def __init__(self, key_ids: list[str], active: str) -> None:
        self.key_ids = key_ids
        super().__init__(
            f"this database holds certificates or audit heads signed by key(s) {', '.join(key_ids)}, "
            f"which this process neither signs with (its active key is {active}) nor lists in "
            "LEDGER_SIGNING_KEYS_RETIRED: what they signed would no longer verify. Restore the "
            "key file (LEDGER_SIGNING_KEY, or signing-key.pem in the secrets folder), or list its "
            "public key in LEDGER_SIGNING_KEYS_RETIRED; if it is lost for good, declare it so "
            f"with LEDGER_SIGNING_KEYS_LOST={','.join(key_ids)} (recorded in the audit log)."
        )


def admit(db: Database, ring: KeyRing, *, lost: Collection[str] = (), now: datetime | None = None) -> None:
    """Check ``ring`` against the keys the database recorded, then record its active key.

    ``UnknownSigningKeys`` when a recorded key is neither active nor retired in ``ring``, not
    declared lost before and not in ``lost``. Keys in ``lost`` are marked lost and audited."""
    at = now or utcnow()
    known = ring.public_keys()
    active = ring.active.public
    with db.session() as session:
        rows = session.scalars(select(SigningKeyRecord).where(SigningKeyRecord.lost_at.is_(None))).all()
        missing = sorted(r.key_id for r in rows if r.key_id not in known)
        undeclared = [k for k in missing if k not in lost]
        if undeclared:
            raise UnknownSigningKeys(undeclared, active.key_id)
        for row in rows:
            if row.key_id in missing:
                row.lost_at = at
        if missing:
            audit.append(
                session,
                [
                    audit.AuditEvent(
                        "signing_key.declared_lost",
                        {
                            "key_id": key,
                            "active_key_id": active.key_id,
                            "setting": "LEDGER_SIGNING_KEYS_LOST",
                        },
                    )
                    for key in missing
                ],
                now=at,
            )
        recorded = any(r.key_id == active.key_id for r in rows)
    if not recorded:
        _record(db, active.key_id, base64.b64encode(active.raw).decode("ascii"), at)


def _record(db: Database, key_id: str, public_key: str, at: datetime) -> None:
    """Record the active key (and its public half, where a row from before lacks it)."""
    try:
        with db.session() as session:
            row = session.get(SigningKeyRecord, key_id)
            if row is None:
                session.add(SigningKeyRecord(key_id=key_id, public_key=public_key, first_seen_at=at))
            elif row.public_key is None:
                row.public_key = public_key
    except IntegrityError:
        pass  # another process starting with the same key recorded it first


__all__ = ["UnknownSigningKeys", "admit"]
