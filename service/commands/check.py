"""``ledger check``: the CI gate on a dataset's privacy guarantees.

::

    ledger check --url http://ledger:8000 --key "$LEDGER_API_KEY" --dataset ds_… \\
                 [--model NAME] [--max-epsilon 2.0] [--json]
    ledger check --bundle ledger.json [--model NAME] [--max-epsilon 2.0] [--json]
    ledger check ... --pin ledger-2026-11-01.json   # today's ledger must extend that export
    ledger check --bundle ledger.json --trusted-keys signing-keys.json   # pin the signer
    ledger check --bundle ledger.json --allow-unverified-signer          # exit 0 on the bundle's own keys

Online, it reads the dataset's ledger over HTTP API v1 into the same bundle ``ledger export``
writes (``service.commands.export.collect``); with ``--bundle`` it reads an exported one and
touches no server. Either way every verdict is *recomputed* here, not taken from the server:

``certificates``
    every certificate of the dataset re-verifies offline (``accountant.certificates.verify``:
    hash, budget, every batch's reserve and commit recomputed, state within the budget), certifies
    this dataset under the dataset's own budget, and matches the hash, release and outcome it is
    stored with.
``releases``
    every published version has a committed certificate: each release a certificate names is
    unique, and each model-registry version trained on the dataset (``--model``: of that model)
    points at a certificate of this dataset that certifies exactly that ``{model, version}``;
    every ``model_version.published`` entry of the chain is in the bundle's registry (none left
    out). A certificate with ``release: null`` (a settled abort or expiry) releases nothing.
    ``--model`` naming a model with no release at all fails (a misspelt gate must not pass).
``artifacts``
    every registry version records the SHA-256 its signed certificate states for the release
    (``release.artifact_sha256``; the registry's ``artifact.sha256``) and, online, its bytes,
    downloaded, have it too; offline the bytes are not at hand, so a bundle whose registry swaps a
    version's hash fails, and a downloaded artifact is compared with the certified hash by whoever
    holds it. Versions whose certificate states none (published before releases did) are
    counted, not failed.
``budget``
    spend ≤ budget under the dataset's rule: the ε and δ spent — the largest of what the server
    reports, what the certificates state and what the history adds up to — are within the budget;
    the spend is of this dataset, rule, accountant and budget, and its stated ``guarantee`` and
    ``epsilon_spent_is`` are the ones the recomputed spend gives (``accountant.statements``); a
    server reporting less than its certificates prove fails too.
``audit chain``
    the chain and its head are present (a bundle without them fails: whoever edits a bundle also
    writes the server's verdict in it); the server's verdict (``GET /v1/audit/verify``) is ``ok``;
    the chain's entries are recomputed hash by hash from the genesis hash to the head by the
    walk the server runs (``service.verification.audit_chain.check_chain``); certificates and
    anchoring entries are one to one
    (``service.commands.history.anchors``: an entry whose payload carries a ``certificate_id`` and
    a ``content_hash`` anchors that certificate — ``reservation.committed``, and an abort or
    expiry that settles a charge; each certificate anchored once, with its hash, and listed once;
    the entry records the settlement the certificate states: its kind, ``reservation.committed``
    for a release and ``reservation.aborted`` / ``.expired`` for that ``outcome``, and its release).
``history``
    the history proven along the chain (``service.commands.history``): per batch, from the empty
    state, each certificate's ``state_at_reserve`` is the state the batch was in at its
    reservation's ``reservation.reserved`` entry and its ``state_before`` the state the previous
    settlement left (plan segment closes replayed), compared on what only settlements move; the
    ε and δ spent recomputed from it (maximum over batches) equal the spend the bundle states.
    This is what catches a certificate built on an invented earlier state, which
    ``accountant.certificates.verify`` alone accepts.
``max epsilon`` (``--max-epsilon E``)
    a stricter bound: the dataset's ε spent *as the history recomputes it* (never a stated
    figure; a history that does not hold proves none, and the check fails) is ≤ E; with
    ``--model``: the largest ε any of the model's certificates states.
``privacy audit`` (only where a version carries one, ``dp_sgd_audit``)
    every audited version's ε lower bound (one-run auditing, ``accountant.privacy_audit``), recomputed
    here at its certificate's δ from the audit's counts, is at most the ε its certificate states
    for the run; a lower bound above the upper bound means the code or the accounting is wrong.
``run alone (derived)`` (only where a version's DP statement shows ``run_alone``)
    every statement's ``run_alone`` — the run alone, not the release's guarantee — is recomputed
    from its certificate's certified inputs (the reserved charge's event, the budget's δ;
    ``accountant.statements.certificate_run_alone``): the same accountant and δ, an ε no smaller.
    It is a derived figure, not a certified one: the certificate does not state it, and the
    check's line says so.
``signatures``
    every certificate's ``signature`` (over its content hash) and the audit head's (over the
    dataset, ``chain_seq`` and ``hash``) verify under a trusted Ed25519 key
    (``service.verification.signing``). This is what catches a forgery that edits a certificate's event,
    budget and states consistently, recomputes its hash, rewrites the chain to match and
    recomputes the bundle hash: every other check passes on it. Trusted keys are the *pinned*
    ones (``--trusted-key KEYID:BASE64``, repeatable, or ``--trusted-keys FILE``, the JSON of
    ``GET /.well-known/privacy-ledger/signing-keys`` fetched from the server itself); without
    them, the keys the server declares (online: the server the check itself connected to) or the
    bundle declares. The bundle's own keys only show it is self-consistent — anyone can re-sign
    a forgery and declare their key — so offline without a pinned key the check reads
    ``UNVERIFIED SIGNER`` and exits 1 unless ``--allow-unverified-signer`` is passed. The audit
    head must be present and signed. An unsigned certificate (issued before the ledger signed)
    fails: nothing shows the server issued it.
``bundle`` (``--bundle`` only)
    the bundle's own hash matches (damage or an edit without recomputing it).
``pin`` (``--pin OLD_BUNDLE``, repeatable)
    the ledger still *extends* a bundle exported earlier and kept outside the database (the
    externally recorded head of docs/RELIABILITY.md): the old bundle is intact (its own hash),
    names the same dataset, its audit head (``chain_seq``, ``hash``) is an entry of today's chain
    with the same hash, every certificate it holds is still present with the same content hash,
    and the ε and δ spent have not decreased. This is what catches a database whose chain tail
    was cut *and* whose stored head was rewritten to match: ``ledger verify`` and the ``audit
    chain`` check pass on such a database, the pin does not.

Each check reads ``PASS``, ``FAIL`` or (``signatures`` of a bundle with no pinned key)
``UNVERIFIED SIGNER``; the last line is ``result: PASS``, ``result: FAIL (n of m checks failed)``,
``result: UNVERIFIED SIGNER (…)`` or ``result: PASS (signer unverified, allowed by
--allow-unverified-signer)``. Exit 0 when every check holds under a pinned (or, online, the
server's) signer, or with ``--allow-unverified-signer``; 1 when a guarantee fails or the signer is
unverified (a summary on stdout, or a JSON report with ``--json``: ``ok``, ``result``, each
check's ``status``); 2 on usage errors, an unreadable bundle, an unreachable server, a refused key
or an unknown dataset.

What an offline check cannot prove: that a bundle is the *latest* — an older genuine bundle
passes as of when it was exported (pin its successor to it with ``--pin``, or compare its
``audit.head`` with the live server's); and the parts of a batch's state that other reservations
move between certificates (held amounts, reads, levels, plan position), which only
``accountant.certificates.verify`` checks within each certificate.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.commands.export import (
    BUNDLE_KIND,
    BUNDLE_VERSION,
    add_connection_arguments,
    bundle_hash,
    connection_error,
)
from service.commands.history import History, anchored_certificate_id, anchors, prove
from service.verification.audit_chain import ChainEntry, broken_message, check_chain

if TYPE_CHECKING:
    from service.client import LedgerClient
    from service.verification.signing import PublicKey

Json = dict[str, Any]


class UsageError(Exception):
    """Exit 2: the check could not run (bad arguments, unreadable bundle, no server)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check",
        help="CI gate: exit 1 when a dataset's privacy guarantees do not hold",
        description="Verify a dataset's certificates, releases, budget, audit chain and history, "
        "online (--url/--key/--dataset) or on an exported bundle (--bundle). Each check prints "
        "PASS, FAIL or UNVERIFIED SIGNER (a bundle checked without --trusted-key(s): signed only "
        "by keys it declares itself). Exit 0: all hold (a bundle: under a pinned key, or with "
        "--allow-unverified-signer); 1: a guarantee fails or the signer is unverified; 2: usage "
        "or connection error.",
    )
    add_connection_arguments(parser)
    parser.add_argument("--dataset", help="the dataset's id or name (required online)")
    parser.add_argument("--bundle", help="check an exported bundle offline (ledger export)")
    parser.add_argument("--model", help="check the published versions of this model")
    parser.add_argument(
        "--max-epsilon",
        help="fail when the dataset's epsilon spent, as recomputed from the certificates' history "
        "(or the largest epsilon certified for --model), exceeds this stricter bound",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="OLD_BUNDLE",
        help="a bundle exported earlier (ledger export) that today's ledger must extend: its "
        "audit head still in the chain, its certificates still present, spend not decreased "
        "(repeatable)",
    )
    parser.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="KEYID:BASE64",
        help="pin a signing key the certificates and the audit head must be signed by (a key of "
        "GET /.well-known/privacy-ledger/signing-keys; repeatable). Without a pinned key, the keys "
        "the bundle or server declares are used; a bundle's own keys make it UNVERIFIED SIGNER "
        "(exit 1 unless --allow-unverified-signer)",
    )
    parser.add_argument(
        "--trusted-keys",
        metavar="FILE",
        help="pin every key of this JSON file, as GET /.well-known/privacy-ledger/signing-keys answers it",
    )
    parser.add_argument(
        "--allow-unverified-signer",
        action="store_true",
        help="with --bundle and no pinned key: exit 0 although the signer is only the one the "
        "bundle declares (the report still says UNVERIFIED SIGNER); without this flag such a "
        "bundle exits 1",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run)


# ---------------------------------------------------------------------------------------------
# Findings
# ---------------------------------------------------------------------------------------------


@dataclass
class Finding:
    """One check's verdict. ``unverified``: it holds, but only under keys the bundle declares
    itself (the ``signatures`` check of a bundle with no pinned key): ``UNVERIFIED SIGNER``."""

    name: str
    ok: bool
    detail: str
    problems: list[str] = field(default_factory=list)
    unverified: bool = False

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAIL"
        return "UNVERIFIED SIGNER" if self.unverified else "PASS"

    def to_json(self) -> Json:
        return {
            "name": self.name,
            "ok": self.ok,
            "status": self.status,
            "detail": self.detail,
            "problems": self.problems,
        }


@dataclass
class Report:
    dataset_id: str
    source: str
    mode: str  # online | bundle
    findings: list[Finding]
    summary: Json
    allow_unverified_signer: bool = False

    @property
    def unverified(self) -> bool:
        """Whether a check holds only under a self-declared signer."""
        return any(f.unverified for f in self.findings)

    @property
    def ok(self) -> bool:
        """Exit 0: every check holds, under a pinned signer or with the explicit flag."""
        return all(f.ok for f in self.findings) and (self.allow_unverified_signer or not self.unverified)

    def to_json(self) -> Json:
        return {
            "ok": self.ok,
            "result": self.verdict,
            "dataset_id": self.dataset_id,
            "mode": self.mode,
            "source": self.source,
            "checked_at": datetime.now(UTC).isoformat(),
            "checks": [f.to_json() for f in self.findings],
            "summary": self.summary,
        }

    def text(self) -> str:
        s = self.summary
        lines = [
            f"ledger check: dataset {self.dataset_id} ({s.get('rule')}/{s.get('accountant')}, "
            f"epsilon budget {s.get('epsilon_budget')}, delta budget {s.get('delta_budget')}) "
            f"from {self.source}"
        ]
        for f in self.findings:
            lines.append(f"  {f.status}  {f.name:<13} {f.detail}")
            problems = [p for p in f.problems if p != f.detail]
            shown = problems[:10]
            lines.extend(f"          - {p}" for p in shown)
            if len(problems) > len(shown):
                lines.append(f"          ... and {len(problems) - len(shown)} more")
        lines.append(f"result: {self.verdict}")
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """``FAIL (…)``, ``UNVERIFIED SIGNER (…)`` or ``PASS``: the report's last line."""
        failed = sum(not f.ok for f in self.findings)
        if failed:
            return f"FAIL ({failed} of {len(self.findings)} checks failed)"
        if self.unverified and not self.allow_unverified_signer:
            return (
                "UNVERIFIED SIGNER (every check holds under keys the bundle declares itself; pin "
                "the server's keys with --trusted-keys, or pass --allow-unverified-signer)"
            )
        if self.unverified:
            return "PASS (signer unverified, allowed by --allow-unverified-signer)"
        return "PASS"


def _number(value: object, what: str) -> Decimal:
    try:
        number = Decimal(str(value))
    except (InvalidOperation, ValueError) as exc:
        raise ValueError(f"{what} is not a number: {value!r}") from exc
    if not number.is_finite():
        raise ValueError(f"{what} is not finite: {value!r}")
    return number


def _guarded(name: str, check: Callable[[], Finding]) -> Finding:
    """A check that cannot read what it needs fails (the bundle does not prove the guarantee)."""
    try:
        return check()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return Finding(name, False, "malformed ledger data", [f"{type(exc).__name__}: {exc}"])


# ---------------------------------------------------------------------------------------------
# The checks (pure functions of a bundle)
# ---------------------------------------------------------------------------------------------


def _certificates(bundle: Json) -> Finding:
    from accountant.certificates import check_batch_set, verify
    from accountant.rules.budget import grown_from

    dataset = bundle["dataset"]
    problems: list[str] = []
    certificates = bundle["certificates"]
    batch_sets = bundle.get("batch_sets") or {}
    for stored in certificates:
        cid = stored.get("id")
        body = stored["certificate"]
        result = verify(body)
        if not result.valid_bound:  # re-derives, but priced by a theorem we cannot prove: FAIL
            problems.append(f"certificate {cid}: not a valid bound: {result.reason}")
        elif not result.ok:
            problems.append(f"certificate {cid}: does not re-verify: {result.reason}")
            continue
        if "batch_set" in body["inputs"]:  # version 2: the batches are listed beside it
            members = batch_sets.get(body.get("reservation_id"))
            if members is None:
                problems.append(f"certificate {cid}: the bundle lacks the batches of its reservation")
            else:
                listed = check_batch_set(body, [(str(b), int(k)) for b, k in members])
                if not listed.ok:
                    problems.append(f"certificate {cid}: {listed.reason}")
        if stored.get("content_hash") != body.get("hash"):
            problems.append(
                f"certificate {cid}: stored hash {stored.get('content_hash')} != {body.get('hash')}"
            )
        if body.get("dataset_id") != dataset["id"]:
            problems.append(f"certificate {cid}: certifies dataset {body.get('dataset_id')!r}")
        # Issued under the budget as it stood then: the dataset's, or it before later plan segments.
        if not grown_from(body["inputs"]["budget"], dataset["budget"]):
            problems.append(f"certificate {cid}: certified under a budget that is not the dataset's")
        if stored.get("release") != body.get("release"):
            problems.append(f"certificate {cid}: stored release {stored.get('release')} != certified")
        if stored.get("outcome") != body.get("outcome", "released"):  # none: issued before outcomes
            problems.append(f"certificate {cid}: stored outcome {stored.get('outcome')!r} != certified")
    detail = (
        f"{len(certificates)} certificate(s) re-verified offline"
        if certificates
        else "no certificate yet (nothing released)"
    )
    return Finding("certificates", not problems, detail, problems)


def _release_key(release: object) -> tuple[str, str]:
    if not isinstance(release, Mapping):
        raise TypeError(f"a release must be an object. Found {release!r}.")
    return str(release["model"]), str(release["version"])


def _released(certificate: Json) -> tuple[str, str] | None:
    """The ``{model, version}`` a certificate releases; ``None`` for one that settles a charge
    with no release (an abort or expiry charged what could have run: ``release: null``)."""
    release = certificate["certificate"]["release"]
    return None if release is None else _release_key(release)


def _published(bundle: Json, registry: Mapping[str, list[Json]]) -> list[str]:
    """Every ``model_version.published`` entry of the chain is in the bundle's registry, with
    the certificate it was published with: a version cannot be left out of the bundle."""
    entries = (bundle.get("audit") or {}).get("entries")
    if not isinstance(entries, list):
        return []  # the audit chain check fails the bundle
    listed = {
        (name, str(v.get("version")), v.get("certificate_id"))
        for name, versions in registry.items()
        for v in versions or []
    }
    problems = []
    for entry in entries:
        if entry.get("event_type") != "model_version.published":
            continue
        payload = entry["payload"]
        key = (str(payload.get("name")), str(payload.get("version")), payload.get("certificate_id"))
        if key not in listed:
            problems.append(
                f"the audit chain records publishing {key[0]}/{key[1]} (entry {entry.get('chain_seq')}), "
                "which the bundle's registry lacks"
            )
    return problems


def _releases(bundle: Json, model: str | None) -> Finding:
    by_id = {c["id"]: c for c in bundle["certificates"]}
    problems: list[str] = []
    released: dict[tuple[str, str], str] = {}
    for c in bundle["certificates"]:
        key = _released(c)
        if key is None:
            continue
        if key in released:
            problems.append(f"release {key[0]}/{key[1]} certified twice ({released[key]}, {c['id']})")
        released[key] = c["id"]
    registry: Mapping[str, list[Json]] = bundle.get("models") or {}
    problems.extend(_published(bundle, registry))
    names = sorted(registry) if model is None else [model]
    checked = 0
    for name in names:
        for version in registry.get(name, []):
            checked += 1
            label = f"{name}/{version.get('version')}"
            cid = version.get("certificate_id")
            certificate = by_id.get(cid)
            if certificate is None:
                problems.append(
                    f"registry version {label}: no committed certificate ({cid!r}) in this dataset"
                )
                continue
            certified = _released(certificate) or ("(no release)", "-")
            if certified != (name, str(version.get("version"))):
                problems.append(
                    f"registry version {label}: certificate {cid} certifies {certified[0]}/{certified[1]}"
                )
    scope = [k for k in released if model is None or k[0] == model]
    if model is not None and not scope and checked == 0:
        problems.append(f"no published version of model {model!r} on this dataset")
    models = sorted({k[0] for k in scope})
    detail = (
        f"{len(scope)} release(s) of {len(models)} model(s) and {checked} registry version(s), "
        "each with a committed certificate"
    )
    return Finding("releases", not problems, detail, problems)


def _artifacts(bundle: Json, served: Mapping[tuple[str, str], str] | None, model: str | None) -> Finding:
    """Every registry version records the SHA-256 its signed certificate states for the release
    (``release.artifact_sha256``), and online (``served``: the SHA-256 of each version's bytes as
    the server serves them, or why they could not be read) its bytes have it too. Offline the
    record is all there is: an edited bundle that swaps a version's hash fails, and the bytes
    are for whoever downloads them to compare. A certificate that states none (issued before
    releases named their artifact, or an external trainer's that did not set
    ``gate.artifact_sha256``) binds no bytes: counted, not failed."""
    by_id = {c["id"]: c for c in bundle["certificates"]}
    registry: Mapping[str, list[Json]] = bundle.get("models") or {}
    problems: list[str] = []
    bound = unbound = 0
    for name in sorted(registry) if model is None else [model]:
        for version in registry.get(name, []):
            label = f"{name}/{version.get('version')}"
            certificate = by_id.get(version.get("certificate_id"))
            if certificate is None:
                continue  # the releases finding reports it
            certified = (certificate["certificate"].get("release") or {}).get("artifact_sha256")
            if certified is None:
                unbound += 1
                continue
            bound += 1
            recorded = (version.get("artifact") or {}).get("sha256")
            if recorded != certified:
                problems.append(
                    f"registry version {label}: records SHA-256 {recorded}, its certificate {certified}"
                )
            if served is None:
                continue
            actual = served.get((name, str(version.get("version"))), "not downloaded")
            if actual != certified:
                problems.append(
                    f"registry version {label}: serves bytes of SHA-256 {actual}, "
                    f"its certificate states {certified}"
                )
    detail = (
        f"{bound} version(s) serve the bytes their signed certificate states"
        if served is not None
        else f"{bound} version(s) record the artifact SHA-256 their signed certificate states "
        "(bytes not downloaded offline)"
    )
    if unbound:
        detail += f"; {unbound} whose certificate states no artifact (bytes not certified)"
    return Finding("artifacts", not problems, detail, problems)


def _served_artifacts(client: LedgerClient, bundle: Json) -> dict[tuple[str, str], str]:
    """The SHA-256 of every registry version's bytes as the server serves them now."""
    from service.client import LedgerError

    served: dict[tuple[str, str], str] = {}
    for name, versions in (bundle.get("models") or {}).items():
        for version in versions:
            key = (name, str(version["version"]))
            try:
                served[key] = client.download_artifact(name, int(version["version"])).sha256
            except LedgerError as exc:
                served[key] = f"unreadable ({exc})"
    return served


def _spent(bundle: Json) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    """(ε reported, δ reported, ε certified, δ certified)."""
    spend = bundle["spend"]
    certified_eps = max(
        (_number(c["certificate"]["result"]["epsilon"], "result.epsilon") for c in bundle["certificates"]),
        default=Decimal(0),
    )
    certified_delta = max(
        (_number(c["certificate"]["result"]["delta"], "result.delta") for c in bundle["certificates"]),
        default=Decimal(0),
    )
    return (
        _number(spend["epsilon_spent"], "spend.epsilon_spent"),
        _number(spend["delta_spent"], "spend.delta_spent"),
        certified_eps,
        certified_delta,
    )


def _segments(budget: Json) -> list[str]:
    """A budget's declared plan segments, recomputed offline: each one's PRV ε at its δ share, and
    Σεᵢ ≤ ε, Σδᵢ ≤ δ (``Budget.from_json`` without trusting the stored numbers)."""
    from accountant.errors import AccountantError
    from accountant.rules import Budget

    try:
        recomputed = Budget.from_json(budget, trust_plan_epsilon=False)
    except AccountantError as exc:
        return [f"the budget's plan segments do not hold: {exc}"]
    if recomputed.to_json() != budget:
        return ["the budget's plan segments do not match their PRV recomputation"]
    return []


def _stated_guarantee(bundle: Json, history: History) -> list[str]:
    """The spend's ``guarantee`` (ε, δ) and ``epsilon_spent_is`` are the ones the spend the
    history adds up to gives (``accountant.statements``): a bundle cannot state a smaller
    guarantee of what was released than what ran. Where the history does not hold (its own
    finding fails) the stated spend stands in, so the guarantee is still read and compared."""
    from accountant.rules import Budget
    from accountant.statements import spend_guarantee, spend_meaning

    spend = bundle["spend"]
    budget = Budget.from_json(bundle["dataset"]["budget"])
    epsilon, delta = history.epsilon_spent, history.delta_spent
    if epsilon is None or delta is None or history.problems:
        epsilon = _number(spend["epsilon_spent"], "spend.epsilon_spent")
        delta = _number(spend["delta_spent"], "spend.delta_spent")
    expected = spend_guarantee(budget, epsilon, delta)
    stated = spend["guarantee"]
    found = (
        _number(stated["epsilon"], "spend.guarantee.epsilon"),
        _number(stated["delta"], "spend.guarantee.delta"),
    )
    problems = []
    if found != expected:
        problems.append(
            f"the spend states the guarantee ({found[0]}, {found[1]})-DP; the spend the history "
            f"adds up to gives ({expected[0]}, {expected[1]})"
        )
    if spend["epsilon_spent_is"] != spend_meaning(budget):
        problems.append(
            f"the spend says its epsilon is {spend['epsilon_spent_is']!r}, not what the rule makes it"
        )
    return problems


def _budget(bundle: Json, history: History) -> Finding:
    budget = bundle["dataset"]["budget"]
    spend = bundle["spend"]
    epsilon = _number(budget["epsilon"], "budget.epsilon")
    delta = _number(budget["delta"], "budget.delta")
    eps_reported, delta_reported, eps_certified, delta_certified = _spent(bundle)
    # The largest figure anything shows: stated, certified, or recomputed from the history.
    eps_spent = max(eps_reported, eps_certified, history.epsilon_spent or Decimal(0))
    delta_spent = max(delta_reported, delta_certified, history.delta_spent or Decimal(0))
    problems: list[str] = []
    if spend.get("rule") != budget["rule"]:
        problems.append(
            f"the spend is reported under rule {spend.get('rule')!r}, the budget's is {budget['rule']!r}"
        )
    if spend.get("accountant") != budget["accountant"]:
        problems.append(
            f"the spend is reported under accountant {spend.get('accountant')!r}, the budget's is "
            f"{budget['accountant']!r}"
        )
    if spend.get("dataset_id") != bundle["dataset"]["id"]:
        problems.append(f"the spend is of dataset {spend.get('dataset_id')!r}")
    if _number(spend["epsilon_budget"], "spend.epsilon_budget") != epsilon:
        problems.append(
            f"the spend reports an epsilon budget of {spend['epsilon_budget']}, the dataset's is {epsilon}"
        )
    if _number(spend["delta_budget"], "spend.delta_budget") != delta:
        problems.append(
            f"the spend reports a delta budget of {spend['delta_budget']}, the dataset's is {delta}"
        )
    if budget.get("segments"):
        problems.extend(_segments(budget))
    problems.extend(_stated_guarantee(bundle, history))
    if eps_spent > epsilon:
        problems.append(f"epsilon spent {eps_spent} exceeds the budget {epsilon}")
    if delta_spent > delta:
        problems.append(f"delta spent {delta_spent} exceeds the budget {delta}")
    if eps_reported < eps_certified:
        problems.append(
            f"the server reports epsilon spent {eps_reported}, "
            f"below the {eps_certified} its certificates prove"
        )
    if delta_reported < delta_certified:
        problems.append(
            f"the server reports delta spent {delta_reported}, "
            f"below the {delta_certified} its certificates prove"
        )
    detail = (
        f"epsilon spent {eps_spent} <= {epsilon}, delta spent {delta_spent} <= {delta} "
        f"(rule {budget['rule']}, max over batches)"
        if not problems
        else f"epsilon spent {eps_spent} of {epsilon}, delta spent {delta_spent} of {delta}"
    )
    return Finding("budget", not problems, detail, problems)


def _recompute_chain(dataset_id: str, head: Mapping[str, Any], entries: list[Json]) -> list[str]:
    """The chain walked from the genesis hash to its signed head by the walk the server runs
    (``service.verification.audit_chain.check_chain``): every entry must be of this dataset's
    chain and at or before the head."""
    verdict = check_chain(
        {dataset_id: (head["chain_seq"], head["hash"])},
        [ChainEntry.from_json(entry) for entry in entries],
        closed=True,
    )
    return [] if verdict.ok else [broken_message(verdict.to_json())]


def _declared_segments(budget: Json, entries: list[Json]) -> list[str]:
    """The budget's plan segments are the ones the chain recorded declaring (``plan.segment_declared``),
    in order: a segment left out of the exported budget, or one the chain never saw, is found."""
    recorded = [
        {k: e["payload"].get(k) for k in ("plan", "delta", "epsilon")}
        for e in sorted(entries, key=lambda e: e["chain_seq"])
        if e.get("event_type") == "plan.segment_declared"
    ]
    listed = list(budget.get("segments") or [])
    if recorded == listed:
        return []
    return [
        f"the budget lists {len(listed)} plan segment(s), the audit chain records declaring "
        f"{len(recorded)}, and they differ"
    ]


def _audit(bundle: Json) -> Finding:
    audit = bundle["audit"]
    verdict = audit["verify"]
    problems: list[str] = []
    if verdict.get("ok") is not True:
        problems.append(f"the server's audit verification failed: {broken_message(verdict)}")
    entries, head = audit.get("entries"), audit.get("head")
    if not isinstance(entries, list) or not isinstance(head, Mapping):
        # The server's verdict alone proves nothing offline: whoever edits the bundle writes it.
        missing = "entries" if not isinstance(entries, list) else "head"
        problems.append(
            f"the bundle carries no audit {missing}: the chain from genesis to a signed head is "
            "required to prove the history"
        )
        return Finding("audit chain", False, f"no audit {missing} to recompute", problems)
    problems.extend(_recompute_chain(bundle["dataset"]["id"], head, entries))
    problems.extend(anchors(bundle["certificates"], entries))
    problems.extend(_declared_segments(bundle["dataset"]["budget"], entries))
    anchoring = sum(anchored_certificate_id(e) is not None for e in entries)
    detail = (
        f"{len(entries)} entries recomputed from genesis to the head, {anchoring} anchoring the "
        "certificates one to one; server verdict " + ("ok" if verdict.get("ok") else "broken")
    )
    return Finding("audit chain", not problems, detail, problems)


@dataclass(frozen=True)
class Trust:
    """The keys signatures are checked against: ``pinned`` by the verifier (``--trusted-key``,
    ``--trusted-keys``), or ``None``: the ones the bundle declares."""

    pinned: Mapping[str, PublicKey] | None = None
    source: str = ""


def _signatures(bundle: Json, trust: Trust, declared_by: str) -> Finding:
    from service.verification import signing

    if trust.pinned is not None:
        keys: Mapping[str, PublicKey] = trust.pinned
        trusted = f"pinned ({trust.source})"
    else:
        document = bundle.get("signing_keys")
        if document is None:
            return Finding(
                "signatures",
                False,
                f"the {declared_by} declares no signing keys and none is pinned",
                ["no key to check signatures with: pass --trusted-key or --trusted-keys"],
            )
        try:
            keys = signing.keys_from_json(document, "signing_keys")
        except signing.SigningKeyError as exc:
            return Finding("signatures", False, "the declared signing keys are malformed", [str(exc)])
        trusted = (
            f"self-declared by the {declared_by}, not pinned: pass --trusted-key or --trusted-keys "
            "to trust a signer"
        )
    problems: list[str] = []
    checks = []
    for stored in bundle["certificates"]:
        check = signing.check_certificate(stored["certificate"], keys)
        checks.append(check)
        if not check.ok:
            problems.append(f"certificate {stored.get('id')}: {check.reason}")
    head = bundle["audit"].get("head")
    if isinstance(head, Mapping):
        check = signing.check_head(bundle["dataset"]["id"], head, keys)
        checks.append(check)
        if not check.ok:
            problems.append(f"audit head (entry {head.get('chain_seq')}): {check.reason}")
    else:
        problems.append("the audit head is missing: nothing signed vouches for the chain")
    signers = ", ".join(signing.key_ids(c for c in checks if c.ok)) or "none"
    what = f"{len(bundle['certificates'])} certificate(s) and the audit head"
    if problems:
        detail = f"{len(problems)} of the signatures of {what} do not verify; signer {trusted}"
    else:
        detail = f"{what} signed by key(s) {signers}, {trusted}"
    # A bundle's own keys show only that it is self-consistent: anyone can re-sign a forgery.
    unverified = trust.pinned is None and declared_by == "bundle"
    return Finding("signatures", not problems, detail, problems, unverified=unverified)


def _max_epsilon(bundle: Json, bound: Decimal, model: str | None, history: History) -> Finding:
    if model is None:
        if history.epsilon_spent is None or history.problems:
            # A history with a gap (a certificate missing, a state invented) proves no figure.
            detail = "no epsilon spent proven by the history to compare (see the history check)"
            return Finding("max epsilon", False, detail, [detail])
        value, what = history.epsilon_spent, "the dataset's epsilon spent (recomputed)"
    else:
        value = max(
            (
                _number(c["certificate"]["result"]["epsilon"], "result.epsilon")
                for c in bundle["certificates"]
                if (_released(c) or ("", ""))[0] == model
            ),
            default=Decimal(0),
        )
        what = f"the largest epsilon certified for model {model!r}"
    ok = value <= bound
    detail = f"{what} {value} {'<=' if ok else '>'} {bound}"
    return Finding("max epsilon", ok, detail, [] if ok else [detail])


def _audited_versions(bundle: Json, model: str | None) -> list[tuple[str, Json]]:
    registry: Mapping[str, list[Json]] = bundle.get("models") or {}
    names = sorted(registry) if model is None else [model]
    return [
        (name, version)
        for name in names
        for version in registry.get(name, [])
        if isinstance((version.get("metrics") or {}).get("privacy_audit"), Mapping)
    ]


def _has_privacy_audits(bundle: Json, model: str | None) -> bool:
    try:
        return bool(_audited_versions(bundle, model))
    except (AttributeError, TypeError):
        return True  # malformed: the guarded check reports it


def _privacy_audits(bundle: Json, model: str | None) -> Finding:
    """Every audited version's ε lower bound, recomputed from the audit's counts, is at most the
    run's own ε at the budget's δ, recomputed from its certificate's signed inputs
    (``accountant.statements.certificate_run_alone``, as the version's statement compares it;
    ``against_certificate``). Not the certificate's charge: under a Rényi filter that is a share
    of the budget, no (ε, δ) bound on the run (issue 24 §3)."""
    from accountant.privacy_audit import against_certificate
    from accountant.statements import certificate_run_alone

    by_id = {c["id"]: c for c in bundle["certificates"]}
    problems: list[str] = []
    audited = _audited_versions(bundle, model)
    for name, version in audited:
        label = f"{name}/{version.get('version')}"
        certificate = by_id.get(version.get("certificate_id"))
        if certificate is None:
            problems.append(f"audited version {label}: no certificate to compare with")
            continue
        alone = certificate_run_alone(certificate["certificate"])
        upper = _number(alone["epsilon"], "run_alone.epsilon")
        delta = _number(alone["delta"], "run_alone.delta")
        compared = against_certificate(
            version["metrics"]["privacy_audit"], epsilon_upper=float(upper), delta_upper=float(delta)
        )
        if not compared["consistent"]:
            problems.append(
                f"audited version {label}: epsilon lower bound {compared['epsilon_lower']:.4f} "
                f"(confidence {compared['confidence']}, delta {delta}) exceeds the certified "
                f"epsilon {upper} (the run alone, {alone['accountant']}): the training code or its "
                "accounting is wrong"
            )
    detail = (
        f"{len(audited)} audited version(s), each lower bound <= its certified epsilon"
        if not problems
        else f"{len(problems)} of {len(audited)} audited version(s) contradict their certificate"
    )
    return Finding("privacy audit", not problems, detail, problems)


def _stated_run_alone(bundle: Json, model: str | None) -> list[tuple[str, Json]]:
    """The registry versions whose DP statement states a ``run_alone`` figure."""
    registry: Mapping[str, list[Json]] = bundle.get("models") or {}
    names = sorted(registry) if model is None else [model]
    return [
        (f"{name}/{version.get('version')}", version)
        for name in names
        for version in registry.get(name, [])
        if isinstance((version.get("dp_statement") or {}).get("run_alone"), Mapping)
    ]


def _has_run_alone(bundle: Json, model: str | None) -> bool:
    try:
        return bool(_stated_run_alone(bundle, model))
    except (AttributeError, TypeError):
        return True  # malformed: the guarded check reports it


def _run_alone(bundle: Json, model: str | None) -> Finding:
    """Every ``run_alone`` a version's statement shows, recomputed from its certificate's certified
    inputs (``accountant.statements.certificate_run_alone``): the same accountant, the same δ,
    and an ε no smaller. It is derived, not certified (docs/ACCOUNTING.md): the finding says so."""
    from accountant.statements import certificate_run_alone

    by_id = {c["id"]: c for c in bundle["certificates"]}
    problems: list[str] = []
    stated = _stated_run_alone(bundle, model)
    accountants: set[str] = set()
    for label, version in stated:
        shown_alone = version["dp_statement"]["run_alone"]
        certificate = by_id.get(version.get("certificate_id"))
        if certificate is None:  # the releases check fails it: no certificate certifies it
            continue
        again = certificate_run_alone(certificate["certificate"])
        accountants.add(again["accountant"])
        if shown_alone.get("accountant") != again["accountant"]:
            problems.append(
                f"version {label}: run_alone names accountant {shown_alone.get('accountant')!r}, "
                f"recomputed by {again['accountant']!r}"
            )
        epsilon = _number(shown_alone.get("epsilon"), "run_alone.epsilon")
        delta = _number(shown_alone.get("delta"), "run_alone.delta")
        if epsilon < Decimal(again["epsilon"]) or delta != Decimal(again["delta"]):
            problems.append(
                f"version {label}: run_alone states (epsilon {epsilon}, delta {delta}), its certificate's "
                f"charge gives (epsilon {again['epsilon']}, delta {again['delta']}) by {again['accountant']}"
            )
    by = ", ".join(sorted(accountants)) or "none"
    detail = (
        f"{len(stated)} version(s): each statement's run_alone recomputed from its certificate's charge "
        f"and budget delta (by {by}); derived, not certified"
        if not problems
        else f"{len(problems)} problem(s) in the run_alone of {len(stated)} version(s)"
    )
    return Finding("run alone (derived)", not problems, detail, problems)


def _bundle_integrity(bundle: Json) -> Finding:
    stored = bundle.get("bundle_hash")
    actual = bundle_hash(bundle)
    if stored != actual:
        return Finding(
            "bundle", False, "edited or damaged after export", [f"bundle_hash {stored} != {actual}"]
        )
    return Finding("bundle", True, f"hash {actual[:19]}... matches")


def _pin(bundle: Json, old: Json, source: str) -> Finding:
    """Today's ``bundle`` extends ``old``, a bundle exported earlier (module docstring)."""
    problems: list[str] = []
    if old.get("bundle_hash") != bundle_hash(old):
        problems.append(f"the pinned bundle {source} was edited or damaged after export")
    if (old.get("dataset") or {}).get("id") != bundle["dataset"]["id"]:
        problems.append(f"the pinned bundle {source} is of dataset {(old.get('dataset') or {}).get('id')}")
        return Finding("pin", False, f"{source}: another dataset", problems)
    head = old["audit"]["head"]
    entries = bundle["audit"].get("entries")
    if entries is None:
        problems.append("this server does not export audit entries: the pinned head cannot be found")
    else:
        seq = head["chain_seq"]
        match = [e for e in entries if e["chain_seq"] == seq]
        if seq > len(entries) or not match:
            problems.append(
                f"the pinned audit head (entry {seq}) is missing: today's chain ends at entry "
                f"{len(entries)} (its tail was cut)"
            )
        elif match[0]["hash"] != head["hash"]:
            problems.append(
                f"audit entry {seq} has hash {str(match[0]['hash'])[:16]}..., the pinned bundle "
                f"recorded {str(head['hash'])[:16]}... (the chain was rewritten)"
            )
    today = {c["id"]: c.get("content_hash") for c in bundle["certificates"]}
    for c in old["certificates"]:
        if c["id"] not in today:
            problems.append(f"certificate {c['id']} of the pinned bundle is missing")
        elif today[c["id"]] != c.get("content_hash"):
            problems.append(f"certificate {c['id']} has another content hash than when pinned")
    for name in ("epsilon_spent", "delta_spent"):
        before = _number(old["spend"][name], f"pinned spend.{name}")
        now = _number(bundle["spend"][name], f"spend.{name}")
        if now < before:
            problems.append(f"{name} decreased from {before} (pinned) to {now}")
    detail = (
        f"{source}: audit head entry {head['chain_seq']} still in the chain, its "
        f"{len(old['certificates'])} certificate(s) present, spend not decreased"
        if not problems
        else f"{source}: today's ledger does not extend the pinned bundle"
    )
    return Finding("pin", not problems, detail, problems)


def _history(bundle: Json, history: History) -> Finding:
    """The history replayed along the chain (``service.commands.history``) and the spend it adds
    up to, which the stated spend must equal."""
    problems = list(history.problems)
    spend = bundle["spend"]
    for name, recomputed in (("epsilon_spent", history.epsilon_spent), ("delta_spent", history.delta_spent)):
        stated = _number(spend[name], f"spend.{name}")
        if recomputed is not None and stated != recomputed:
            problems.append(
                f"the spend states {name} {stated}; the certificates' history adds up to {recomputed}"
            )
    if history.epsilon_spent is None:
        return Finding("history", False, "no history to replay", problems)
    detail = (
        f"{history.settlements} settlement(s) chained per batch from the empty state over "
        f"{history.batches} batch(es): epsilon spent {history.epsilon_spent}, delta spent "
        f"{history.delta_spent} (max over batches)"
    )
    return Finding("history", not problems, detail, problems)


def _proven(bundle: Json) -> History:
    try:
        return prove(bundle)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return History([f"malformed ledger data: {type(exc).__name__}: {exc}"])


def evaluate(
    bundle: Json,
    *,
    mode: str,
    source: str,
    model: str | None = None,
    max_epsilon: Decimal | None = None,
    pins: Mapping[str, Json] | None = None,
    trust: Trust | None = None,
    served: Mapping[tuple[str, str], str] | None = None,
    allow_unverified_signer: bool = False,
) -> Report:
    """Every check on ``bundle``: a ``Report`` (``ok`` iff every finding holds, and, for a
    bundle, its signer is pinned or ``allow_unverified_signer``). ``pins``: bundles exported
    earlier (by their file name) that ``bundle`` must extend; ``trust``: the keys its signatures
    must verify under (default: the ones it declares); ``served`` (online): the SHA-256 of each
    registry version's bytes as downloaded (the ``artifacts`` finding)."""
    trust = trust or Trust()
    history = _proven(bundle)
    declared_by = "bundle" if mode == "bundle" else "server"
    findings: list[Finding] = []
    if mode == "bundle":
        findings.append(_bundle_integrity(bundle))
    for pin_source, old in (pins or {}).items():
        findings.append(_guarded("pin", functools.partial(_pin, bundle, old, pin_source)))
    findings.append(_guarded("certificates", lambda: _certificates(bundle)))
    findings.append(_guarded("releases", lambda: _releases(bundle, model)))
    findings.append(_guarded("artifacts", lambda: _artifacts(bundle, served, model)))
    findings.append(_guarded("budget", lambda: _budget(bundle, history)))
    findings.append(_guarded("audit chain", lambda: _audit(bundle)))
    findings.append(_guarded("history", lambda: _history(bundle, history)))
    findings.append(_guarded("signatures", lambda: _signatures(bundle, trust, declared_by)))
    if max_epsilon is not None:
        findings.append(_guarded("max epsilon", lambda: _max_epsilon(bundle, max_epsilon, model, history)))
    if _has_privacy_audits(bundle, model):  # only where a version was audited (dp_sgd_audit)
        findings.append(_guarded("privacy audit", lambda: _privacy_audits(bundle, model)))
    if _has_run_alone(bundle, model):  # only where a statement shows one
        findings.append(_guarded("run alone (derived)", lambda: _run_alone(bundle, model)))
    dataset = bundle.get("dataset") or {}
    budget = dataset.get("budget") or {}
    spend = bundle.get("spend") or {}
    summary = {
        "rule": budget.get("rule"),
        "accountant": budget.get("accountant"),
        "epsilon_budget": budget.get("epsilon"),
        "delta_budget": budget.get("delta"),
        "epsilon_spent": spend.get("epsilon_spent"),
        "delta_spent": spend.get("delta_spent"),
        "epsilon_recomputed": None if history.epsilon_spent is None else str(history.epsilon_spent),
        "delta_recomputed": None if history.delta_spent is None else str(history.delta_spent),
        "naive_sequential_epsilon": spend.get("naive_sequential_epsilon"),
        "certificates": len(bundle.get("certificates") or []),
        "audit_entries": None
        if (bundle.get("audit") or {}).get("entries") is None
        else len(bundle["audit"]["entries"]),
        "model": model,
        "max_epsilon": None if max_epsilon is None else str(max_epsilon),
        "signer_trust": "pinned" if trust.pinned is not None else "self-declared",
    }
    return Report(str(dataset.get("id")), source, mode, findings, summary, allow_unverified_signer)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _bound(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value <= 0:
        raise UsageError(f"--max-epsilon must be a finite number > 0. Found {text!r}.")
    return value


def load_bundle(path: str) -> Json:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read bundle {path}: {exc}") from exc
    try:
        bundle = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"bundle {path} is not JSON: {exc}") from exc
    if not isinstance(bundle, dict) or bundle.get("kind") != BUNDLE_KIND:
        raise UsageError(f"{path} is not a privacy-ledger bundle (see `ledger export`).")
    if bundle.get("version") != BUNDLE_VERSION:
        raise UsageError(
            f"bundle {path} has version {bundle.get('version')!r}; this ledger reads {BUNDLE_VERSION}."
        )
    return bundle


def _trust(args: argparse.Namespace) -> Trust:
    """The keys ``--trusted-key`` and ``--trusted-keys`` pin (none given: ``Trust()``)."""
    from service.verification import signing

    pinned: dict[str, PublicKey] = {}
    sources = []
    try:
        for i, text in enumerate(getattr(args, "trusted_key", None) or []):
            key = signing.trusted_key(text, f"--trusted-key[{i}]")
            pinned[key.key_id] = key
        if getattr(args, "trusted_keys", None):
            path = args.trusted_keys
            try:
                document = json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise UsageError(f"--trusted-keys: cannot read {path} as JSON: {exc}") from exc
            pinned.update(signing.keys_from_json(document, f"--trusted-keys {path}"))
            sources.append(f"--trusted-keys {path}")
    except signing.SigningKeyError as exc:
        raise UsageError(str(exc)) from exc
    if getattr(args, "trusted_key", None):
        sources.insert(0, "--trusted-key")
    if not sources:
        return Trust()
    if not pinned:
        raise UsageError(f"{' and '.join(sources)} pin no key.")
    return Trust(pinned, " and ".join(sources))


def _report(args: argparse.Namespace) -> Report:
    max_epsilon = _bound(args.max_epsilon)
    trust = _trust(args)
    pins = {path: load_bundle(path) for path in getattr(args, "pin", None) or []}
    if args.bundle is not None:
        bundle = load_bundle(args.bundle)
        dataset_id = (bundle.get("dataset") or {}).get("id")
        if args.dataset is not None and args.dataset != dataset_id:
            raise UsageError(f"--dataset {args.dataset} but the bundle holds dataset {dataset_id}.")
        return evaluate(
            bundle,
            mode="bundle",
            source=args.bundle,
            model=args.model,
            max_epsilon=max_epsilon,
            pins=pins,
            trust=trust,
            allow_unverified_signer=args.allow_unverified_signer,
        )

    from service.client import LedgerClient, LedgerError
    from service.commands.export import collect

    problem = connection_error("check", args)
    if problem is None and not args.dataset:
        problem = "ledger check: --dataset is required (or --bundle FILE)."
    if problem is not None:
        raise UsageError(problem)
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            dataset_id = str(client.find_dataset(args.dataset)["id"])  # an id or a name
            bundle = collect(client, dataset_id, model=args.model)
            served = _served_artifacts(client, bundle)
    except LedgerError as exc:
        raise UsageError(f"ledger check: {exc}") from exc
    return evaluate(
        bundle,
        mode="online",
        source=args.url,
        model=args.model,
        max_epsilon=max_epsilon,
        pins=pins,
        trust=trust,
        served=served,
        allow_unverified_signer=args.allow_unverified_signer,
    )


def run(args: argparse.Namespace) -> int:
    try:
        report = _report(args)
    except UsageError as exc:
        message = str(exc)
        if args.json:
            print(json.dumps({"ok": False, "error": "usage", "message": message}))
        print(message, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.text())
    return 0 if report.ok else 1
