"""The offline checks of an exported bundle (``ledger export``): every finding ``ledger check``
reports, as pure functions of the bundle's JSON (certificates re-verified, releases and artifacts
against what their signed certificates state, the budget and spend recomputed from the history the
audit chain proves, the chain walked from genesis to its signed head, signatures under pinned or
declared keys, pins to earlier bundles, privacy audits, a release's run alone) and ``evaluate``,
which runs them into a ``Report``. ``service.commands.check`` reads the bundle (a file, or the
server through the client) and prints the report; a verifier may call ``evaluate`` directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Final

from accountant.canonical import sha256_hex
from service.verification.audit_chain import ChainEntry, broken_message, check_chain
from service.verification.history import History, anchored_certificate_id, anchors, prove

if TYPE_CHECKING:
    from service.verification.signing import PublicKey

Json = dict[str, Any]

BUNDLE_KIND: Final = "privacy-ledger/bundle"
BUNDLE_VERSION: Final = 2  # 2: hashed with accountant.canonical (ASCII), signing keys included


def bundle_hash(bundle: dict[str, Any]) -> str:
    """``sha256:`` over the canonical JSON of every field but ``bundle_hash``."""
    body = {k: v for k, v in bundle.items() if k != "bundle_hash"}
    return "sha256:" + sha256_hex(body)


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
    """The history replayed along the chain (``service.verification.history``) and the spend it adds
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
