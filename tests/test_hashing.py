"""One home for every byte that is hashed (``accountant.canonical``, issue 14 §3).

Every hash and signed message is SHA-256 / Ed25519 over ``canonical_bytes`` of its document: each
hashing function is checked against a recomputation through the module, and the source tree is
checked to hold no second encoder (``json.dumps`` with sorted keys and compact separators) and no
second copy of the hashed timestamp format.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from pathlib import Path

from accountant import events as ev
from accountant.canonical import TIMESTAMP_FORMAT, canonical_bytes, parse_timestamp, sha256_hex, timestamp
from accountant.certificates import content_hash
from accountant.rules import event_fingerprint
from service.commands.export import bundle_hash
from service.ledger.idempotency import request_hash
from service.verification.audit_chain import entry_hash
from service.verification.signing import (
    CERTIFICATE_SIGNATURE_KIND,
    HEAD_SIGNATURE_KIND,
    certificate_message,
    head_message,
)

ROOT = Path(__file__).resolve().parents[1]


def test_every_hash_is_over_the_canonical_bytes() -> None:
    event = ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1)), 10)
    assert event_fingerprint(event) == "sha256:" + sha256_hex(ev.to_json(event))
    cert = {"hash": "x", "signature": {"value": "y"}, "inputs": {"name": "Zoë"}, "version": 1}
    assert content_hash(cert) == "sha256:" + sha256_hex({"inputs": {"name": "Zoë"}, "version": 1})
    bundle = {"bundle_hash": "x", "dataset": {"name": "données"}}
    assert bundle_hash(bundle) == "sha256:" + sha256_hex({"dataset": {"name": "données"}})
    at = datetime(2026, 11, 25, 18, 0, 0, 123456, tzinfo=UTC)
    document = {
        "chain": "ds",
        "chain_seq": 3,
        "event_type": "dataset.created",
        "tenant_id": "acme",
        "dataset_id": "ds",
        "payload": {"name": "é"},
        "created_at": "2026-11-25T18:00:00.123456Z",
        "prev_hash": "0" * 64,
    }
    fields = {k: v for k, v in document.items() if k != "created_at"}
    assert entry_hash(**fields, created_at=at) == sha256_hex(document)  # type: ignore[arg-type]
    assert request_hash("reserve", {"a": [1, 2]}) == sha256_hex(
        {"operation": "reserve", "request": {"a": [1, 2]}}
    )
    assert certificate_message("sha256:ab") == canonical_bytes(
        {"kind": CERTIFICATE_SIGNATURE_KIND, "content_hash": "sha256:ab"}
    )
    assert head_message("ds", 3, "h") == canonical_bytes(
        {"kind": HEAD_SIGNATURE_KIND, "chain": "ds", "chain_seq": 3, "hash": "h"}
    )
    assert hashlib.sha256(canonical_bytes({"b": 1, "a": "é"})).hexdigest() == sha256_hex({"a": "é", "b": 1})
    assert canonical_bytes({"b": 1, "a": "é"}) == b'{"a":"\\u00e9","b":1}'


def test_timestamps_round_trip() -> None:
    at = datetime(2026, 11, 25, 18, 0, 0, 5, tzinfo=UTC)
    assert timestamp(at) == "2026-11-25T18:00:00.000005Z"
    assert parse_timestamp(timestamp(at)) == at
    assert datetime.strptime(timestamp(at), TIMESTAMP_FORMAT).replace(tzinfo=UTC) == at


def test_no_second_encoder_or_timestamp_format_in_the_tree() -> None:
    encoder = re.compile(r"json\.dumps\([^)]*sort_keys=True[^)]*separators=\(\",\", \":\"\)", re.S)
    offenders = []
    for path in [*ROOT.joinpath("accountant").rglob("*.py"), *ROOT.joinpath("service").rglob("*.py")]:
        if path.name == "canonical.py" and path.parent.name == "accountant":
            continue
        text = path.read_text(encoding="utf-8")
        if encoder.search(text) or "%Y-%m-%dT%H:%M:%S.%fZ" in text or "hashlib.sha256(json" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
