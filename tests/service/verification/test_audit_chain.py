"""``check_chain``, the one walk of the hash-chained audit log (``service.verification.audit_chain``),
on exported entries: the server runs it on its rows (``tests/service/ledger/test_audit.py``) and
``ledger check`` on a bundle's chain (``tests/service/test_cli_check.py``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from accountant.canonical import timestamp
from service.verification.audit_chain import (
    GENESIS_HASH,
    ChainEntry,
    broken_message,
    check_chain,
    entry_hash,
)

CHAIN = "ds_1"


def _chain(n: int) -> list[ChainEntry]:
    entries, prev = [], GENESIS_HASH
    start = datetime(2026, 11, 27, 12, tzinfo=UTC)
    for i in range(1, n + 1):
        fields = {
            "chain": CHAIN,
            "chain_seq": i,
            "event_type": "task.created",
            "tenant_id": "t",
            "dataset_id": CHAIN,
            "payload": {"name": f"task-{i}"},
            "created_at": start + timedelta(seconds=i),
            "prev_hash": prev,
        }
        prev = entry_hash(**fields)  # type: ignore[arg-type]
        entries.append(ChainEntry(seq=10 + i, hash=prev, **fields))  # type: ignore[arg-type]
    return entries


def _head(entries: list[ChainEntry]) -> dict[str, tuple[int, str]]:
    return {CHAIN: (entries[-1].chain_seq, entries[-1].hash)}


def test_an_exported_chain_reads_back_and_verifies() -> None:
    entries = _chain(3)
    exported = [
        {**{k: getattr(e, k) for k in ChainEntry.__slots__}, "created_at": timestamp(e.created_at)}
        for e in entries
    ]
    verdict = check_chain(_head(entries), [ChainEntry.from_json(e) for e in exported], closed=True)
    assert verdict.ok and verdict.entries == 3


def test_each_break_is_found_where_it_is_and_said_in_one_sentence() -> None:
    entries = _chain(3)
    head = _head(entries)
    edited = [entries[0], replace(entries[1], payload={"name": "edited"}), entries[2]]
    verdict = check_chain(head, edited)
    assert (verdict.ok, verdict.first_broken, verdict.chain_seq) == (False, 12, 2)
    assert verdict.reason == "entry does not match its hash"
    assert broken_message(verdict.to_json()) == (
        "audit chain broken at entry 12 (chain 'ds_1', position 2): entry does not match its hash"
    )
    gap = check_chain(head, [entries[0], entries[2]])
    assert (gap.chain_seq, gap.reason) == (2, "missing entry")
    cut = check_chain(head, entries[:2])  # the tail deleted: the head names an entry not there
    assert (cut.first_broken, cut.chain_seq, cut.reason) == (None, 3, "missing entry")
    other = check_chain(head, [*entries, replace(entries[0], chain="ds_2")])
    assert (other.chain, other.reason) == ("ds_2", "no chain head")


def test_an_entry_past_the_head_breaks_a_closed_chain_only() -> None:
    entries = _chain(3)
    head = {CHAIN: (2, entries[1].hash)}  # heads read before the third entry was appended
    assert check_chain(head, entries).ok  # the server: appended since, skipped
    closed = check_chain(head, entries, closed=True)  # an export: nothing signed covers it
    assert (closed.ok, closed.chain_seq, closed.reason) == (False, 3, "entry after the head")
