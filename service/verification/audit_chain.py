"""The hash-chained audit log, checked: the hash of an entry and the one walk that checks chains
of entries against their heads. The server walks its rows with it (``service.ledger.audit``,
``ledger verify``, ``GET /v1/audit/verify``) and ``ledger check`` walks an exported chain with it
(``service.commands.check``), so both find the same breaks and say them in the same words.

Entry ``n`` of a chain stores ``SHA-256`` of the canonical JSON (``accountant.canonical``) of
``{chain, chain_seq, event_type, tenant_id, dataset_id, payload, created_at, prev_hash}``, with
``created_at`` a hashed timestamp and ``prev_hash`` entry ``n − 1``'s hash (``GENESIS_HASH`` for
the first).

``check_chain`` walks entries chain by chain against heads: an edited entry fails its own hash;
a deleted, inserted or reordered entry breaks the sequence or the next entry's ``prev_hash``; a
deleted tail no longer matches the head; an entry of a chain with no head is a break.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from accountant.canonical import parse_timestamp, sha256_hex, timestamp

GENESIS_HASH: Final = "0" * 64


def entry_hash(
    *,
    chain: str,
    chain_seq: int,
    event_type: str,
    tenant_id: str | None,
    dataset_id: str | None,
    payload: Mapping[str, Any],
    created_at: datetime,
    prev_hash: str,
) -> str:
    document = {
        "chain": chain,
        "chain_seq": chain_seq,
        "event_type": event_type,
        "tenant_id": tenant_id,
        "dataset_id": dataset_id,
        "payload": payload,
        "created_at": timestamp(created_at),
        "prev_hash": prev_hash,
    }
    return sha256_hex(document)


class Entry(Protocol):
    """What the walk reads of an entry: a row of ``audit_log`` (``service.db.models.AuditEntry``)
    or an exported entry (``ChainEntry.from_json``). ``seq`` is the entry's place in the whole
    log (``None`` where unknown)."""

    @property
    def seq(self) -> int | None: ...
    @property
    def chain(self) -> str: ...
    @property
    def chain_seq(self) -> int: ...
    @property
    def event_type(self) -> str: ...
    @property
    def tenant_id(self) -> str | None: ...
    @property
    def dataset_id(self) -> str | None: ...
    @property
    def payload(self) -> Mapping[str, Any]: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def prev_hash(self) -> str: ...
    @property
    def hash(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ChainEntry:
    """An entry as the audit routes and ``ledger export`` write it (``{seq, chain, chain_seq,
    event_type, tenant_id, dataset_id, payload, prev_hash, hash, created_at}``), read back."""

    seq: int | None
    chain: str
    chain_seq: int
    event_type: str
    tenant_id: str | None
    dataset_id: str | None
    payload: Mapping[str, Any]
    created_at: datetime
    prev_hash: str
    hash: str

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ChainEntry:
        """``KeyError`` for a missing field, ``ValueError`` for a timestamp that is not one."""
        return cls(
            seq=entry.get("seq"),
            chain=entry["chain"],
            chain_seq=entry["chain_seq"],
            event_type=entry["event_type"],
            tenant_id=entry["tenant_id"],
            dataset_id=entry["dataset_id"],
            payload=entry["payload"],
            created_at=parse_timestamp(entry["created_at"]),
            prev_hash=entry["prev_hash"],
            hash=entry["hash"],
        )


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """``first_broken``: the ``seq`` of the first broken entry (``None`` when the break is a
    missing tail with no entry to point at, or the entry's ``seq`` is unknown); ``chain`` /
    ``chain_seq`` / ``reason`` locate it."""

    ok: bool
    entries: int
    first_broken: int | None = None
    chain: str | None = None
    chain_seq: int | None = None
    reason: str | None = None
    head: tuple[int, str] | None = None  # (chain_seq, hash) of the one chain a dataset walk read

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "entries": self.entries,
            "first_broken": self.first_broken,
            "chain": self.chain,
            "chain_seq": self.chain_seq,
            "reason": self.reason,
            "head": None if self.head is None else {"chain_seq": self.head[0], "hash": self.head[1]},
        }


def broken_message(verdict: Mapping[str, Any]) -> str:
    """The one sentence that says where a chain broke, from a ``ChainCheck.to_json()`` (or the
    server's ``{first_broken, chain, chain_seq, reason}``)."""
    return (
        f"audit chain broken at entry {verdict.get('first_broken')} "
        f"(chain {verdict.get('chain')!r}, position {verdict.get('chain_seq')}): {verdict.get('reason')}"
    )


@dataclass(frozen=True, slots=True)
class _Break:
    seq: int | None
    chain: str
    chain_seq: int
    reason: str


class ChainWalk:
    """Checks entries chain by chain against ``heads`` (chain → (``chain_seq``, ``hash``)), in
    ``(chain, chain_seq)`` order within each chain; the first break of a chain ends its walk.

    ``closed``: the entries are the whole chain up to its head, so an entry past the head is a
    break (an exported chain: its head is the signed one). Otherwise the heads were read before
    the entries, and an entry past its head was appended since and is skipped (the server)."""

    def __init__(self, heads: Mapping[str, tuple[int, str]], *, closed: bool = False) -> None:
        self.heads = heads
        self.closed = closed
        self.breaks: list[_Break] = []
        self.broken: set[str] = set()
        self.seen: dict[str, tuple[int, str]] = {}  # chain -> (last chain_seq, last hash)
        self.entries = 0

    def _break(self, entry: Entry, chain_seq: int, reason: str) -> None:
        self.breaks.append(_Break(entry.seq, entry.chain, chain_seq, reason))
        self.broken.add(entry.chain)

    def check(self, entry: Entry) -> None:
        chain = entry.chain
        if chain in self.broken:
            return
        head = self.heads.get(chain)
        if head is None:
            self._break(entry, entry.chain_seq, "no chain head")
            return
        if entry.chain_seq > head[0]:
            if self.closed:
                self._break(entry, entry.chain_seq, "entry after the head")
            return  # appended after the heads were read
        self.entries += 1
        last_seq, last_hash = self.seen.get(chain, (0, GENESIS_HASH))
        reason = None
        if entry.chain_seq != last_seq + 1:
            reason = "missing entry"
        elif entry.prev_hash != last_hash:
            reason = "prev_hash does not chain"
        elif entry.hash != entry_hash(
            chain=chain,
            chain_seq=entry.chain_seq,
            event_type=entry.event_type,
            tenant_id=entry.tenant_id,
            dataset_id=entry.dataset_id,
            payload=entry.payload,
            created_at=entry.created_at,
            prev_hash=entry.prev_hash,
        ):
            reason = "entry does not match its hash"
        if reason is not None:
            self._break(entry, last_seq + 1, reason)
            return
        self.seen[chain] = (entry.chain_seq, entry.hash)

    def result(self) -> ChainCheck:
        for chain, (head_seq, head_hash) in self.heads.items():
            if chain in self.broken:
                continue
            last_seq, last_hash = self.seen.get(chain, (0, GENESIS_HASH))
            if last_seq != head_seq:
                self.breaks.append(_Break(None, chain, last_seq + 1, "missing entry"))
            elif last_hash != head_hash:
                self.breaks.append(_Break(None, chain, last_seq, "last entry does not match the head"))
        if not self.breaks:
            return ChainCheck(True, self.entries)
        first = min(self.breaks, key=lambda b: (b.seq is None, b.seq or 0, b.chain))
        return ChainCheck(False, self.entries, first.seq, first.chain, first.chain_seq, first.reason)


def check_chain(
    heads: Mapping[str, tuple[int, str]], entries: Iterable[Entry], *, closed: bool = False
) -> ChainCheck:
    """Walk ``entries`` against ``heads`` (``ChainWalk``): the verdict and where it broke."""
    walk = ChainWalk(heads, closed=closed)
    for entry in entries:
        walk.check(entry)
    return walk.result()


__all__ = [
    "GENESIS_HASH",
    "ChainCheck",
    "ChainEntry",
    "ChainWalk",
    "Entry",
    "broken_message",
    "check_chain",
    "entry_hash",
]
