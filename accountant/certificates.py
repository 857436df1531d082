"""Certificates: frozen, JSON, content-hashed records that justify one charge: a commit (one
release), or the settlement of a reservation aborted or expired without a release.

Theorem relied on: the certificate restates the theorem of the budget's rule
(``accountant.rules.theorem``: basic composition / the Rényi filter of Feldman & Zrnic 2021,
Thm. 3.1 / PRV for a declared plan, parallel composition (McSherry 2009, Thm. 4), L2DP-ML
Thm. 2, continual release Thm. 1, 4, 7). ``verify`` re-derives every number of the certificate
with the same pure functions the ledger used (``accountant.rules.reserve`` / ``commit``), so a
certificate verifies iff the ledger's decision follows from its inputs under that theorem.

What a certificate holds (``issue``):

* ``rule``, ``accountant``, ``theorem`` (version 3: ``rules.stated_theorem``, written from the
  budget's parameters; versions 1–2: the fixed ``rules.theorem``); ``analyses`` when the charge
  holds an L2DP-ML event: which analysis of Thm. 2 it is priced with ("paper" or "sound",
  DESIGN-NOTES note 21); the caller's ids (``dataset_id``, ``reservation_id``,
  ``release_id``, ``release`` = ``{model, version}``, ``issued_at``);
* ``outcome``: ``"released"`` (a commit: ``release`` names what was released), ``"aborted"`` or
  ``"expired"`` (the reservation closed without a release: ``release`` and ``release_id`` are
  ``null``, and the charge is what could have run — docs/ARCHITECTURE.md, "Threat model").
  Certificates issued before outcomes existed lack it: they are releases;
* ``inputs``: the budget (with its δ, order grid, geometric schedule or plan), the charge (event
  and noise commitment), the ``partial_event`` of a progressive commit, and for every batch the
  reservation touched: the state the reservation was admitted against (``state_at_reserve``),
  the reserved cost, the state just before this commit, the cost committed before, the state
  after and the cumulative committed cost;
* ``result``: over the touched batches, the largest ε, δ and naive ε after the commit (the spend
  in the rule's units: for a Rényi filter its progress), the largest cumulative cost of this
  reservation (``charge``), and for geometric budgets the levels used and the infinite-horizon
  bound first/(1 − ratio); since version 3 ``guarantee``, the release's (ε, δ)-DP guarantee, valid
  under adaptive stopping (``accountant.statements.release_guarantee``), and ``budget_share``
  (``charge`` named for what it is: budget consumed, not a guarantee);
* ``libraries``: versions of numpy, scipy, prv-accountant and privacy-ledger;
* ``hash``: ``sha256:`` over the canonical JSON (sorted keys, no spaces) of everything else but
  ``signature``: the service adds a ``signature`` of the hash after issuing
  (``service.verification.signing``), and the hash must not depend on it.

``verify(cert)`` also fails (``valid_bound=False``, its numbers re-derived) on a charge priced by
L2DP-ML Thm. 2 as printed (``analysis`` "paper" or absent, stored before new charges were
refused it): not a valid bound (DESIGN-NOTES note 21), so never reported as verified.

``verify(cert)`` fails on any edited field: an edit without a new hash breaks the hash; an edit
with a recomputed hash breaks a recomputation (the reserved cost from ``state_at_reserve``, the
commit from ``state_before``, the state after, the result, the theorem, the plan's PRV ε, the
budget check). Inputs that nothing derives from (ids, release, library versions, or a budget
edited consistently with every state) are protected by the hash alone; the service anchors the
hash in its hash-chained audit log, which is what binds a certificate to its ledger.

``issue`` does no accounting (no PRV, no RDP): it is cheap enough to run inside the commit
transaction, with the ``Admission``/``Settlement`` values the ledger just computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any, Final

from accountant import events as ev
from accountant.canonical import sha256_hex
from accountant.errors import AccountantError, InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, exact_add, to_text
from accountant.mechanisms import l2dp_ml_analysis_text
from accountant.rules import (
    BatchState,
    Budget,
    Charge,
    Cost,
    PriceMemo,
    Settlement,
    active_pricing,
    commit,
    delta_of_what_ran,
    pricing,
    pricing_version,
    reserve,
    stated_theorem,
    theorem,
    within_budget,
)
from accountant.rules.memo import PRICING_VERSIONS
from accountant.statements import release_guarantee

CERTIFICATE_VERSION: Final = 3
"""3: ``theorem`` is ``rules.stated_theorem`` (written from the budget's own parameters) and
``result`` states the release's ``guarantee`` and its ``budget_share`` (``accountant.statements``);
2: the batches are grouped into classes (``ClassRecord``) and committed to by a ``BatchSet``;
1: one ``BatchRecord`` per batch. Versions 1 and 2 still verify, against ``rules.theorem``."""
CERTIFICATE_VERSIONS: Final = (1, 2, 3)
CERTIFICATE_KIND: Final = "privacy-ledger/certificate"
OUTCOMES: Final = ("released", "aborted", "expired")
"""What a certificate's charge ended in: a release, or a reservation aborted or expired without one."""
_LIBRARIES: Final = ("numpy", "scipy", "prv-accountant", "privacy-ledger")
_UNHASHED: Final = frozenset({"hash", "signature"})


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch's part in a commit, as the ledger computed it.

    ``state_at_reserve``: the state passed to ``reserve`` for this reservation, ``reserved``: its
    ``Admission.cost``; ``state_before``: the state passed to this ``commit``,
    ``committed_before``: the previous ``Settlement.committed`` (``None`` on the first commit);
    ``state_after`` / ``committed``: this commit's ``Settlement``.
    """

    batch_id: str
    state_at_reserve: BatchState
    reserved: Cost
    state_before: BatchState
    committed_before: Cost | None
    state_after: BatchState
    committed: Cost

    def to_json(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, **_transition_json(self)}

    @classmethod
    def from_json(cls, obj: object, path: str) -> BatchRecord:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, "must be an object.")
        batch_id = obj.get("batch_id")
        if not isinstance(batch_id, str) or not batch_id:
            raise InvalidArgumentError(f"{path}.batch_id", "must be a non-empty string.")
        before = obj.get("committed_before")
        return cls(
            batch_id=batch_id,
            state_at_reserve=BatchState.from_json(obj.get("state_at_reserve"), f"{path}.state_at_reserve"),
            reserved=Cost.from_json(obj.get("reserved"), f"{path}.reserved"),
            state_before=BatchState.from_json(obj.get("state_before"), f"{path}.state_before"),
            committed_before=None if before is None else Cost.from_json(before, f"{path}.committed_before"),
            state_after=BatchState.from_json(obj.get("state_after"), f"{path}.state_after"),
            committed=Cost.from_json(obj.get("committed"), f"{path}.committed"),
        )


@dataclass(frozen=True, slots=True)
class ClassRecord:
    """The batches of a commit that share one transition: the reservation class they belong to
    (``reservation_class``: they were in one state when reserved), how many they are, and the
    fields of a ``BatchRecord``. Every batch of a class replays the same pure functions on the same
    inputs, so checking the class checks each of its batches."""

    reservation_class: int
    batches: int
    state_at_reserve: BatchState
    reserved: Cost
    state_before: BatchState
    committed_before: Cost | None
    state_after: BatchState
    committed: Cost

    def to_json(self) -> dict[str, Any]:
        return {"class": self.reservation_class, "batches": self.batches, **_transition_json(self)}

    @classmethod
    def from_json(cls, obj: object, path: str) -> ClassRecord:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, "must be an object.")
        index, count = obj.get("class"), obj.get("batches")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidArgumentError(f"{path}.class", "must be an integer >= 0.")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(f"{path}.batches", "must be an integer >= 1.")
        record = BatchRecord.from_json({**obj, "batch_id": "-"}, path)
        return cls(
            reservation_class=index,
            batches=count,
            state_at_reserve=record.state_at_reserve,
            reserved=record.reserved,
            state_before=record.state_before,
            committed_before=record.committed_before,
            state_after=record.state_after,
            committed=record.committed,
        )


def _transition_json(record: BatchRecord | ClassRecord) -> dict[str, Any]:
    """The fields a batch record and a class record share: its states and costs."""
    before = record.committed_before
    return {
        "state_at_reserve": record.state_at_reserve.to_json(),
        "reserved": record.reserved.to_json(),
        "state_before": record.state_before.to_json(),
        "committed_before": None if before is None else before.to_json(),
        "state_after": record.state_after.to_json(),
        "committed": record.committed.to_json(),
    }


@dataclass(frozen=True, slots=True)
class BatchSet:
    """Which batches a reservation reads: how many, and ``hash`` = ``batch_set_hash`` of the
    (batch id, reservation class) pairs. The pairs themselves are served page by page and
    exported in bundles; ``check_batch_set`` checks them against a certificate."""

    count: int
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "hash": self.hash}


def batch_set_hash(members: Iterable[tuple[str, int]]) -> str:
    """``sha256:`` + SHA-256 over the lines ``"<batch id> <class>\\n"`` (UTF-8) in ascending
    order of batch id (code points). Streaming, so a verifier never holds a JSON list of 10⁶ ids."""
    digest = hashlib.sha256()
    for batch_id, index in sorted(members):
        digest.update(f"{batch_id} {index}\n".encode())
    return "sha256:" + digest.hexdigest()


def check_batch_set(certificate: Mapping[str, Any], members: Sequence[tuple[str, int]]) -> Verification:
    """Whether ``members`` (batch id, class) are the batches a version-2 certificate commits to:
    the hash matches, no batch repeats, and each class has as many batches as the certificate's
    classes say."""
    inputs = certificate.get("inputs")
    if not isinstance(inputs, Mapping) or not isinstance(inputs.get("batch_set"), Mapping):
        return Verification(False, "the certificate commits to no batch set (version 1 lists its batches)")
    stated = inputs["batch_set"]
    if len({b for b, _ in members}) != len(members):
        return Verification(False, "the batch list repeats a batch")
    if len(members) != stated.get("count") or batch_set_hash(members) != stated.get("hash"):
        return Verification(False, "the batch list does not match the certificate's batch_set")
    counts: dict[int, int] = {}
    for _, index in members:
        counts[index] = counts.get(index, 0) + 1
    for c in inputs.get("classes", []):
        counts[c["class"]] = counts.get(c["class"], 0) - c["batches"]
    if any(counts.values()):
        return Verification(False, "the batch list's classes do not match the certificate's counts")
    return Verification(True, f"{len(members)} batch(es) match the certificate's batch_set")


@dataclass(frozen=True, slots=True)
class Verification:
    """``verify``'s answer: ``ok``, and ``reason`` (what failed, or what was checked).

    ``valid_bound`` is ``False`` for a certificate whose numbers all re-derive but whose charge is
    priced by an analysis that is not a valid bound (``unproven_analyses``): it is then not
    ``ok`` either, since what it certifies may be less than the privacy loss of what ran."""

    ok: bool
    reason: str
    valid_bound: bool = True


@cache
def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a certificate's numbers depend on."""
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def content_hash(certificate: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON of every field but ``hash`` and ``signature`` (the
    signature is over the hash; this module neither makes nor checks it)."""
    body = {k: v for k, v in certificate.items() if k not in _UNHASHED}
    return "sha256:" + sha256_hex(body)


def _result(
    budget: Budget, records: Sequence[BatchRecord] | Sequence[ClassRecord], version: int = CERTIFICATE_VERSION
) -> dict[str, Any]:
    """The certificate's ``result``. ``epsilon`` / ``delta``: the largest spend of the touched
    batches after the commit, in the rule's units (for a Rényi filter its progress, not a
    guarantee); ``charge``: this reservation's largest committed cost. Version 3 adds
    ``guarantee`` (the (ε, δ)-DP guarantee of the release, ``accountant.statements``) and
    ``budget_share`` (``charge`` under a name that says what it is: budget consumed, not DP)."""
    after = [r.state_after for r in records]
    result: dict[str, Any] = {
        "epsilon": to_text(max((s.epsilon_spent for s in after), default=ZERO)),
        "delta": to_text(max((s.delta_spent for s in after), default=ZERO)),
        "naive_epsilon": to_text(max((s.naive_epsilon for s in after), default=ZERO)),
        "charge": {
            "epsilon": to_text(max((r.committed.epsilon for r in records), default=ZERO)),
            "delta": to_text(max((r.committed.delta for r in records), default=ZERO)),
        },
        "budget": {"epsilon": to_text(budget.epsilon), "delta": to_text(budget.delta)},
        "within_budget": True,
    }
    if version >= 3:
        eps, dlt = release_guarantee(budget, records)
        result["guarantee"] = {"epsilon": to_text(eps), "delta": to_text(dlt)}
        result["budget_share"] = dict(result["charge"])
    if budget.geometric is not None:
        result["infinite_horizon_bound"] = to_text(budget.geometric.infinite_horizon_bound())
        result["levels"] = (
            [r.committed.level for r in records]
            if all(isinstance(r, ClassRecord) for r in records)
            else {r.batch_id: r.committed.level for r in records if isinstance(r, BatchRecord)}
        )
    return result


def charged_analyses(event: DpEvent) -> list[str]:
    """The analyses the charge's paper-specific events are priced with, in words, without
    repeats (``accountant.mechanisms.l2dp_ml_analysis_text``); ``[]`` when there is none."""
    out: list[str] = []
    for node in ev.walk(event):
        if isinstance(node, ev.FunctionalMechanismL2DPEvent):
            text = l2dp_ml_analysis_text(node)
            if text not in out:
                out.append(text)
    return out


def unproven_analyses(*events: DpEvent | None) -> list[str]:
    """The analyses of the events' L2DP-ML nodes that are not valid bounds (Thm. 2 as printed:
    ``"paper"``, or no ``analysis``; docs/DESIGN-NOTES.md note 21), in words, without repeats."""
    out: list[str] = []
    for event in events:
        for node in () if event is None else ev.walk(event):
            if isinstance(node, ev.FunctionalMechanismL2DPEvent) and node.charged_analysis != "sound":
                text = l2dp_ml_analysis_text(node)
                if text not in out:
                    out.append(text)
    return out


def issue(
    *,
    budget: Budget,
    charge: Charge,
    classes: Sequence[ClassRecord],
    batch_set: BatchSet,
    reservation_id: str,
    release: Mapping[str, Any] | None,
    partial_event: DpEvent | None = None,
    previous_event: DpEvent | None = None,
    release_id: str | None = None,
    dataset_id: str | None = None,
    issued_at: str | None = None,
    outcome: str = "released",
) -> dict[str, Any]:
    """Build the certificate of one commit (a JSON object with its content hash).

    Pure and cheap (no accounting): call it inside the commit transaction with the records the
    ledger just computed. ``release`` must be JSON (e.g. ``{"model": ..., "version": ...}``);
    ``issued_at`` is passed by the caller so the certificate is deterministic. ``previous_event``
    is the run so far the reservation's previous commit settled (a progressive commit must extend
    it); it is written as ``inputs.previous_partial_event`` only when there is one.
    ``outcome``: ``"released"`` with a ``release``; ``"aborted"`` or ``"expired"`` with
    ``release=None`` (the charge of a reservation closed without a release, ``OUTCOMES``).
    """
    if not classes:
        raise InvalidArgumentError("classes", "must name at least one class of batches.")
    if sum(c.batches for c in classes) != batch_set.count:
        raise InvalidArgumentError("classes", f"must cover the batch set's {batch_set.count} batches.")
    if outcome not in OUTCOMES:
        raise InvalidArgumentError("outcome", f"must be one of {', '.join(OUTCOMES)}. Found {outcome!r}.")
    if outcome == "released" and not isinstance(release, Mapping):
        raise InvalidArgumentError("release", f"must be an object. Found {release!r}.")
    if outcome != "released" and release is not None:
        raise InvalidArgumentError("release", f"must be null when {outcome}. Found {release!r}.")
    body: dict[str, Any] = {
        "version": CERTIFICATE_VERSION,
        "kind": CERTIFICATE_KIND,
        "rule": budget.rule,
        "accountant": budget.accountant,
        "theorem": stated_theorem(budget),
        "dataset_id": dataset_id,
        "reservation_id": reservation_id,
        "release_id": release_id,
        "release": None if release is None else dict(release),
        "outcome": outcome,
        "issued_at": issued_at,
        "inputs": {
            "budget": budget.to_json(),
            "charge": charge.to_json(),
            "partial_event": None if partial_event is None else ev.to_json(partial_event),
            "classes": [c.to_json() for c in classes],
            "batch_set": batch_set.to_json(),
            **({} if previous_event is None else {"previous_partial_event": ev.to_json(previous_event)}),
        },
        "result": _result(budget, classes),
        "libraries": dict(library_versions()),
        "pricing": active_pricing(),
    }
    analyses = charged_analyses(charge.event)
    if analyses:
        body["analyses"] = analyses
    try:
        body["hash"] = content_hash(body)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError("release", f"must be JSON-serialisable: {exc}") from None
    return body


def verify(certificate: Mapping[str, Any]) -> Verification:
    """Recompute everything from the certificate alone; ``ok`` only if every check passes.

    Prices are recomputed under the certificate's ``pricing`` version (``rules.PRICING_VERSION``;
    absent: 1, the certificates issued before versions were recorded), so a certificate keeps
    verifying after an upgrade that prices charges tighter."""
    try:
        return _verify(certificate)
    except (AccountantError, EventValidationError, ValueError, TypeError, KeyError) as exc:
        return Verification(False, f"invalid certificate: {exc}")


def _verify(cert: Mapping[str, Any]) -> Verification:
    if not isinstance(cert, Mapping):
        return Verification(False, "a certificate must be a JSON object")
    stored = cert.get("hash")
    if not isinstance(stored, str):
        return Verification(False, "missing content hash")
    actual = content_hash(cert)
    if actual != stored:
        return Verification(False, f"content hash mismatch: stored {stored}, computed {actual}")
    if cert.get("version") not in CERTIFICATE_VERSIONS or cert.get("kind") != CERTIFICATE_KIND:
        return Verification(False, f"unknown certificate version {cert.get('version')!r}")
    version = cert.get("pricing", 1)
    if isinstance(version, bool) or version not in PRICING_VERSIONS:
        return Verification(False, f"unknown pricing version {version!r}")
    with pricing_version(version):
        return _verify_content(cert)


def _verify_content(cert: Mapping[str, Any]) -> Verification:
    inputs = cert["inputs"]
    budget = Budget.from_json(inputs["budget"], trust_plan_epsilon=False)
    if budget.to_json() != inputs["budget"]:
        return Verification(False, "inputs.budget is not in canonical form")
    charge = Charge.from_json(inputs["charge"])
    partial_obj = inputs.get("partial_event")
    partial = None if partial_obj is None else ev.from_json(partial_obj, "inputs.partial_event")
    previous_obj = inputs.get("previous_partial_event")
    previous = None if previous_obj is None else ev.from_json(previous_obj, "inputs.previous_partial_event")
    problem = _outcome_problem(cert)
    if problem:
        return Verification(False, problem)
    cited = stated_theorem(budget) if cert["version"] >= 3 else theorem(budget)
    expected = {"rule": budget.rule, "accountant": budget.accountant, "theorem": cited}
    for name, value in expected.items():
        if cert.get(name) != value:
            return Verification(False, f"{name} does not match the budget: {cert.get(name)!r}")
    # Certificates issued before ``analyses`` existed lack it; one that has it must say what the
    # charge's events are priced with.
    if "analyses" in cert and cert["analyses"] != charged_analyses(charge.event):
        return Verification(False, f"analyses does not match the charge: {cert['analyses']!r}")
    records: list[BatchRecord] | list[ClassRecord]
    if cert["version"] == 1:
        batch_objs = inputs["batches"]
        if not isinstance(batch_objs, list) or not batch_objs:
            return Verification(False, "inputs.batches must list at least one batch")
        records = [BatchRecord.from_json(b, f"inputs.batches[{i}]") for i, b in enumerate(batch_objs)]
        if len({r.batch_id for r in records}) != len(records):
            return Verification(False, "inputs.batches repeats a batch")
        labels = [f"batch {r.batch_id!r}" for r in records]
        count = len(records)
    else:
        class_objs = inputs["classes"]
        if not isinstance(class_objs, list) or not class_objs:
            return Verification(False, "inputs.classes must list at least one class")
        records = [ClassRecord.from_json(c, f"inputs.classes[{i}]") for i, c in enumerate(class_objs)]
        labels = [f"class {r.reservation_class} ({r.batches} batch(es))" for r in records]
        count = sum(r.batches for r in records)
        stated = inputs["batch_set"]
        if not isinstance(stated, Mapping) or stated.get("count") != count:
            return Verification(False, "inputs.batch_set.count does not match the classes' batches")
        for r in records:  # a reservation class was reserved once, from one state
            first = next(x for x in records if x.reservation_class == r.reservation_class)
            if (r.state_at_reserve, r.reserved, r.committed_before) != (
                first.state_at_reserve,
                first.reserved,
                first.committed_before,
            ):
                return Verification(False, f"class {r.reservation_class} is not one reservation class")
    # Every batch replays the same charge: its prices are computed once (``PriceMemo``).
    with pricing(PriceMemo(budget)):
        for record, label in zip(list[BatchRecord | ClassRecord](records), labels, strict=True):
            problem = _check_batch(budget, charge, partial, previous, record)
            if problem:
                return Verification(False, f"{label}: {problem}")
    if cert.get("result") != _result(budget, records, cert["version"]):
        return Verification(False, "result does not match the recomputed bound")
    libraries = cert.get("libraries")
    if not isinstance(libraries, Mapping) or not all(isinstance(v, str) for v in libraries.values()):
        return Verification(False, "libraries must map names to versions")
    checked = (
        f"hash, {count} batch(es) recomputed under rule {budget.rule!r} / accountant "
        f"{budget.accountant!r}; epsilon {cert['result']['epsilon']} within budget "
        f"{to_text(budget.epsilon)}"
    )
    unproven = unproven_analyses(charge.event, partial, previous)
    if unproven:  # the arithmetic holds, the theorem it rests on does not (note 21)
        return Verification(
            False,
            f"{checked}, but the charge is priced by {'; '.join(unproven)}, which is not a valid "
            "bound (docs/DESIGN-NOTES.md note 21): the certified epsilon may be less than what ran",
            valid_bound=False,
        )
    return Verification(True, checked)


def _outcome_problem(cert: Mapping[str, Any]) -> str:
    """Why the certificate's ``outcome`` and ``release`` disagree (``""``: they agree). Certificates
    issued before outcomes existed lack the field and are releases; they are checked as before."""
    if "outcome" not in cert:
        return ""
    outcome = cert["outcome"]
    if outcome not in OUTCOMES:
        return f"unknown outcome {outcome!r}"
    released = outcome == "released"
    if released != isinstance(cert.get("release"), Mapping):
        return f"outcome {outcome!r} does not match release {cert.get('release')!r}"
    if not released and cert.get("release_id") is not None:
        return f"an {outcome} reservation releases nothing, but release_id is {cert.get('release_id')!r}"
    return ""


def _check_batch(
    budget: Budget,
    charge: Charge,
    partial: DpEvent | None,
    previous: DpEvent | None,
    record: BatchRecord | ClassRecord,
) -> str:
    # A certificate states the δ of what ran. The replay alone accepted certificates the ledger
    # issued before issue 24 §6 (a plan entry of PRV ε 0 charged (0, 0)); this check, made first,
    # refuses them with the reason, whatever rule version issued them.
    ran = delta_of_what_ran(budget, record.state_after)
    if exact_add(record.state_after.delta_spent, record.state_after.delta_held) < ran:
        return (
            f"state_after charges delta {to_text(record.state_after.delta_spent)} below the "
            f"{to_text(ran)} of the plan segments the batch ran"
        )
    admission = reserve(budget, record.state_at_reserve, charge)
    if admission.cost != record.reserved:
        return "the reserved cost does not follow from state_at_reserve"
    settlement = commit(
        budget, record.state_before, charge, record.reserved, record.committed_before, partial, previous
    )
    if settlement != Settlement(record.state_after, record.committed):
        return "the commit does not follow from state_before (state_after or committed differs)"
    if not within_budget(budget, record.state_after):
        return "state_after exceeds the budget"
    return ""


__all__ = [
    "CERTIFICATE_KIND",
    "CERTIFICATE_VERSION",
    "CERTIFICATE_VERSIONS",
    "OUTCOMES",
    "BatchRecord",
    "BatchSet",
    "ClassRecord",
    "Verification",
    "batch_set_hash",
    "charged_analyses",
    "check_batch_set",
    "content_hash",
    "issue",
    "library_versions",
    "unproven_analyses",
    "verify",
]
