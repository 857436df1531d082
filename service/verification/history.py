"""The history of a bundle, proven offline: which certificate settled what, on which batch, from
which state, and the spend that history adds up to (``ledger check``'s ``history`` check).

``accountant.certificates.verify`` recomputes a charge from the states written *inside* the
certificate, so a certificate built on an invented earlier state verifies on its own; only the
history can show the state was never there. This module replays that history from the audit
chain (which ``ledger check`` recomputes hash by hash and whose head the server signs):

* **anchoring** (``anchors``): an audit entry whose payload carries a ``certificate_id`` *and* a
  ``content_hash`` anchors that certificate — ``reservation.committed`` today, and
  ``reservation.aborted`` / ``reservation.expired`` where an abort or expiry settles a final
  charge. Every certificate of the bundle is anchored by exactly one entry with its content
  hash, and every anchored certificate is in the bundle once. (``model_version.published``
  carries a ``certificate_id`` without a ``content_hash``: it names a certificate, it does not
  anchor one.) The entry records the settlement its certificate states: ``reservation.committed``
  a release, ``reservation.aborted`` / ``.expired`` the charge of that ``outcome`` (``release:
  null``), with the certificate's ``release``; a refund is an abort entry with no certificate.
* **chaining**, per batch, walking the chain in order from the empty state
  (``BatchState.empty()``): a certificate's ``state_before`` on each of its batches is the state
  the batch's previous settlement left, and its ``state_at_reserve`` the state the batch was in
  at the reservation's ``reservation.reserved`` entry. The part of a state compared is the part
  only settlements move (``settled``): ε, δ and naive ε spent, the Rényi sums spent, the closed
  plan segments and the committed noise commitments. What is held, the reads and the slots
  (levels, plan position) move with every reservation and abort of *other* reservations, which
  certify nothing, so they are left to ``verify`` within each certificate. A
  ``plan.segment_declared`` entry closes the open segment on every batch (``rules.close_segment``,
  replayed under the budget as it stood before that declaration).
* **spend**: the dataset's ε and δ spent, recomputed as the maximum over batches of the replayed
  states (parallel composition, McSherry 2009 Thm. 4; ``rules.dataset_epsilon``).

A batch is named by the batch list of its certificate's reservation (``bundle.batch_sets``, the
pairs the certificate's ``batch_set`` hash commits to) or, for a version-1 certificate, by the
certificate itself. Batches that share a state share one ``BatchState`` object, and the compared
part of a state is computed once per object, so the replay is linear in the batch lists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from accountant.rules import BatchState

Json = dict[str, Any]
_SHOWN: Final = 3  # batches named per mismatch; the rest are counted
_ANCHORED_BY: Final = {
    "released": "reservation.committed",
    "aborted": "reservation.aborted",
    "expired": "reservation.expired",
}


def anchored_certificate_id(entry: Mapping[str, Any]) -> str | None:
    """The certificate an audit entry anchors: its payload's ``certificate_id`` when the payload
    also records the certificate's ``content_hash`` (``None`` otherwise)."""
    payload = entry.get("payload")
    if not isinstance(payload, Mapping) or "content_hash" not in payload:
        return None
    value = payload.get("certificate_id")
    return None if value is None else str(value)


def _settled_as(cid: str, body: Mapping[str, Any], entry: Mapping[str, Any]) -> list[str]:
    """The anchoring entry records the settlement the certificate states: a release is anchored
    by ``reservation.committed``, an abort's or expiry's charge by ``reservation.aborted`` /
    ``.expired``, and the entry's ``release`` is the certificate's. Without this, a charged abort
    re-issued as a release (valid on its own, its new hash written into the entry) would pass:
    the chain recorded that nothing was released."""
    outcome = body.get("outcome", "released")  # certificates from before outcomes are releases
    expected = _ANCHORED_BY.get(str(outcome))
    problems = []
    if entry.get("event_type") != expected:
        problems.append(
            f"certificate {cid}: its outcome is {outcome!r}, but the audit chain records it as "
            f"{entry.get('event_type')} (entry {entry.get('chain_seq')})"
        )
    recorded = entry["payload"].get("release")
    if recorded != body.get("release"):
        problems.append(
            f"certificate {cid}: certifies release {body.get('release')!r}, the audit chain recorded "
            f"{recorded!r} (entry {entry.get('chain_seq')})"
        )
    return problems


def anchors(certificates: list[Json], entries: list[Json]) -> list[str]:
    """Certificates ↔ anchoring entries: a bijection, with equal content hashes."""
    problems: list[str] = []
    anchored: dict[str, list[Json]] = {}
    for entry in entries:
        cid = anchored_certificate_id(entry)
        if cid is not None:
            anchored.setdefault(cid, []).append(entry)
    present: dict[str, int] = {}
    for c in certificates:
        cid = str(c["id"])
        present[cid] = present.get(cid, 0) + 1
        found = anchored.get(cid, [])
        if not found:
            problems.append(f"certificate {cid}: no audit entry anchors it")
            continue
        recorded = found[0]["payload"].get("content_hash")
        if recorded != c["certificate"].get("hash") or recorded != c.get("content_hash"):
            problems.append(f"certificate {cid}: its hash differs from the one the audit chain recorded")
        problems.extend(_settled_as(cid, c["certificate"], found[0]))
    for cid, count in sorted(present.items()):
        if count > 1:
            problems.append(f"certificate {cid} is listed {count} times")
    for cid, found in sorted(anchored.items()):
        if len(found) > 1:
            seqs = ", ".join(str(e.get("chain_seq")) for e in found)
            problems.append(f"certificate {cid} is anchored by {len(found)} audit entries ({seqs})")
        if cid not in present:
            problems.append(
                f"the audit chain anchors certificate {cid} (entry {found[0].get('chain_seq')}, "
                f"{found[0].get('event_type')}), which is missing"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------------


def settled(state: BatchState) -> tuple[object, ...]:
    """The part of a batch's state that only settlements (and plan segment closes) move."""
    return (
        state.epsilon_spent,
        state.delta_spent,
        state.naive_epsilon,
        state.rdp_spent,
        state.plan_closed,
        tuple(c for c in state.noise_commitments if c.committed),
    )


@dataclass
class _Record:
    """One class record of a certificate, parsed."""

    index: int
    batches: int
    at_reserve: BatchState
    before: BatchState
    after: BatchState


@dataclass
class _Group:
    """The records of one class that leave one state: where they take it, how many batches they
    count, how many the history put there."""

    after: BatchState
    count: int = 0
    matched: int = 0


@dataclass
class _Settlement:
    """A certificate, parsed for the replay: its records by class and the batches of each."""

    cid: str
    reservation_id: str
    records: list[_Record]
    members: list[tuple[str, int]]


@dataclass
class History:
    """``problems`` (none: the history holds) and the spend it adds up to."""

    problems: list[str] = field(default_factory=list)
    epsilon_spent: Decimal | None = None
    delta_spent: Decimal | None = None
    batches: int = 0
    settlements: int = 0


class _Mismatches:
    """Batches whose replayed state differs from the one a certificate states, counted per
    (certificate, what), a few named."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, str], list[str]] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, cid: str, what: str, batch_id: str) -> None:
        key = (cid, what)
        self.counts[key] = self.counts.get(key, 0) + 1
        named = self.found.setdefault(key, [])
        if len(named) < _SHOWN:
            named.append(batch_id)

    def problems(self) -> list[str]:
        out = []
        for (cid, what), named in self.found.items():
            count = self.counts[(cid, what)]
            more = f" and {count - len(named)} more" if count > len(named) else ""
            out.append(
                f"certificate {cid}: {what} of batch(es) {', '.join(named)}{more} is not the state "
                "the chain's history left them in (a state invented, or an earlier settlement altered)"
            )
        return out


def _parse(stored: Json, batch_sets: Mapping[str, Any]) -> _Settlement:
    from accountant.certificates import BatchRecord, ClassRecord

    body = stored["certificate"]
    cid = str(stored["id"])
    inputs = body["inputs"]
    if body.get("version") == 1:
        records = [BatchRecord.from_json(b, f"inputs.batches[{i}]") for i, b in enumerate(inputs["batches"])]
        return _Settlement(
            cid,
            str(body["reservation_id"]),
            [_Record(i, 1, r.state_at_reserve, r.state_before, r.state_after) for i, r in enumerate(records)],
            [(r.batch_id, i) for i, r in enumerate(records)],
        )
    classes = [ClassRecord.from_json(c, f"inputs.classes[{i}]") for i, c in enumerate(inputs["classes"])]
    listed = batch_sets.get(str(body["reservation_id"]))
    if not isinstance(listed, list):
        raise ValueError(f"the bundle lacks the batch list of reservation {body['reservation_id']}")
    members = []
    for pair in listed:
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or isinstance(pair[1], bool)
            or not isinstance(pair[1], int)
        ):
            raise ValueError(f"batch_sets[{body['reservation_id']!r}] holds {pair!r}, not [batch id, class]")
        members.append((pair[0], pair[1]))
    return _Settlement(
        cid,
        str(body["reservation_id"]),
        [
            _Record(c.reservation_class, c.batches, c.state_at_reserve, c.state_before, c.state_after)
            for c in classes
        ],
        members,
    )


class _Replay:
    """Per-batch states, replayed along the chain (module docstring)."""

    def __init__(self, budget: Json) -> None:
        from accountant.rules import BatchState

        self.budget = budget
        self.empty = BatchState.empty()
        self.states: dict[str, BatchState] = {}
        self.keys: dict[int, tuple[BatchState, tuple[object, ...]]] = {}  # id(state) -> its key
        self.mismatches = _Mismatches()
        self.problems: list[str] = []
        self.declared = 0

    def key(self, state: BatchState) -> tuple[object, ...]:
        cached = self.keys.get(id(state))
        if cached is None or cached[0] is not state:
            cached = (state, settled(state))
            self.keys[id(state)] = cached
        return cached[1]

    def reserved(self, settlement: _Settlement) -> None:
        """At the reservation's ``reservation.reserved`` entry: each batch is in the state its
        class's ``state_at_reserve`` says."""
        expected = {r.index: self.key(r.at_reserve) for r in settlement.records}
        for batch_id, index in settlement.members:
            if self.key(self.states.get(batch_id, self.empty)) != expected.get(index):
                self.mismatches.add(settlement.cid, "state_at_reserve", batch_id)

    def settle(self, settlement: _Settlement) -> None:
        """At the certificate's anchoring entry: each batch moves from its class's
        ``state_before`` to its ``state_after``, with as many batches per record as it counts."""
        groups: dict[tuple[int, tuple[object, ...]], _Group] = {}
        for r in settlement.records:
            group = groups.setdefault((r.index, self.key(r.before)), _Group(r.after))
            if self.key(group.after) != self.key(r.after):
                self.problems.append(
                    f"certificate {settlement.cid}: class {r.index} settles one state two ways"
                )
            group.count += r.batches
        for batch_id, index in settlement.members:
            found = groups.get((index, self.key(self.states.get(batch_id, self.empty))))
            if found is None:
                self.mismatches.add(settlement.cid, "state_before", batch_id)
                continue
            found.matched += 1
            self.states[batch_id] = found.after
        for (index, _), group in groups.items():
            if group.matched != group.count:
                self.problems.append(
                    f"certificate {settlement.cid}: a record of class {index} settles {group.count} "
                    f"batch(es); the history puts {group.matched} in its state_before"
                )

    def close_segment(self) -> None:
        """A ``plan.segment_declared`` entry: every batch's open segment closes under the budget
        as it stood before the declaration (its first ``declared`` segments)."""
        from accountant.errors import AccountantError
        from accountant.rules import Budget, close_segment

        segments = list(self.budget.get("segments") or [])
        if self.declared >= len(segments):
            self.problems.append(
                f"the chain declares plan segment {self.declared + 1}; the budget lists {len(segments)}"
            )
            self.declared += 1
            return
        before = {k: v for k, v in self.budget.items() if k != "segments"}
        if self.declared:
            before["segments"] = segments[: self.declared]
        self.declared += 1
        try:
            budget = Budget.from_json(before)
            closed: dict[int, tuple[BatchState, BatchState]] = {}
            for batch_id, state in self.states.items():
                done = closed.get(id(state))
                if done is None or done[0] is not state:
                    done = (state, close_segment(budget, replace(state, plan_open=False)))
                    closed[id(state)] = done
                self.states[batch_id] = done[1]
        except AccountantError as exc:
            self.problems.append(f"plan segment {self.declared} cannot be replayed: {exc}")


def prove(bundle: Json) -> History:
    """Replay the bundle's history along its audit chain (module docstring)."""
    from accountant.errors import AccountantError

    history = History()
    entries = (bundle.get("audit") or {}).get("entries")
    if not isinstance(entries, list):
        history.problems.append("the bundle carries no audit entries: its history cannot be proven")
        return history
    certificates: list[Json] = bundle["certificates"]
    history.problems.extend(anchors(certificates, entries))
    batch_sets = bundle.get("batch_sets") or {}
    parsed: dict[str, _Settlement] = {}
    by_reservation: dict[str, list[_Settlement]] = {}
    for stored in certificates:
        try:
            settlement = _parse(stored, batch_sets)
        except (AccountantError, KeyError, TypeError, ValueError) as exc:
            history.problems.append(f"certificate {stored.get('id')}: cannot be replayed: {exc}")
            continue
        if settlement.cid not in parsed:
            parsed[settlement.cid] = settlement
            by_reservation.setdefault(settlement.reservation_id, []).append(settlement)
    replay = _Replay(bundle["dataset"]["budget"])
    reserved: set[str] = set()
    for entry in entries:
        event_type = entry.get("event_type")
        payload = entry.get("payload") if isinstance(entry.get("payload"), Mapping) else {}
        if event_type == "reservation.reserved":
            rid = str(payload.get("reservation_id"))
            reserved.add(rid)
            for settlement in by_reservation.get(rid, ()):
                replay.reserved(settlement)
        elif event_type == "plan.segment_declared":
            replay.close_segment()
        cid = anchored_certificate_id(entry)
        settled_here = parsed.pop(cid, None) if cid is not None else None
        if settled_here is not None:
            if settled_here.reservation_id not in reserved:
                history.problems.append(
                    f"certificate {cid}: settles reservation {settled_here.reservation_id}, which "
                    "the chain does not reserve before it"
                )
            replay.settle(settled_here)
            history.settlements += 1
    history.problems.extend(replay.problems)
    history.problems.extend(replay.mismatches.problems())
    states = list(replay.states.values())
    history.batches = len(states)
    history.epsilon_spent = max((s.epsilon_spent for s in states), default=Decimal(0))
    history.delta_spent = max((s.delta_spent for s in states), default=Decimal(0))
    return history


__all__ = ["History", "anchored_certificate_id", "anchors", "prove", "settled"]
