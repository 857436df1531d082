"""Issue 24 §1: ``ledger check --bundle`` cannot be fooled by an edited bundle.

A dataset (sequential, basic, ε budget 10) with one batch and three signed commits of ε 0.5, 4
and 0.25: 4.75 spent. The issue's forgery — the last two certificates dropped, ``audit.entries``
and ``audit.head`` nulled, ``audit.verify`` set to ok, the spend lowered to 0.5 and the bundle
hash recomputed — passed with the signing key pinned; it now fails. The recomputed spend is what
``--max-epsilon`` tests. Every field of the bundle is then removed, nulled, duplicated,
reordered and retyped in turn: each edit fails the check (exit 1) or is refused (exit 2), except the ones
listed in ``HARMLESS``, each with the reason it cannot change what the check certifies (those
pass with the genuine spend, 4.75, recomputed).

Real parts: a live server (``tests.service.live_server``) over SQLite and PostgreSQL writes the
ledger, ``ledger export`` reads it over HTTP, ``ledger check`` reads the file.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL, make_url

from accountant.events import PureDpEvent
from service.cli import main
from service.client import LedgerClient
from service.commands.export import bundle_hash
from service.db.session import Database
from service.ledger import tenancy
from service.verification import signing
from tests.service.live_server import serve, settings_for

Json = dict[str, Any]
EPSILONS = (0.5, 4, 0.25)


@dataclass
class Exported:
    bundle: Json
    keys: Json  # GET /.well-known/privacy-ledger/signing-keys, as a verifier fetched it


def _export(database_url: URL, db: Database, tmp: Path) -> Exported:
    settings = settings_for(database_url, tmp / "artifacts")
    admin = tenancy.create_api_key(db, "acme", "admin")
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    with serve(settings, db) as url, LedgerClient(url, admin) as client:
        dataset = client.create_dataset("d", rule="sequential", epsilon="10", delta=0, accountant="basic")
        task = client.create_task(dataset["id"], "t")
        (batch,) = client.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r"]}])["data"]
        for version, epsilon in enumerate(EPSILONS, start=1):
            with client.release_gate(
                dataset["id"], [batch["id"]], PureDpEvent(epsilon), model="m", version=version
            ):
                pass
        path = tmp / "genuine.json"
        code = main(["export", "--url", url, "--key", viewer, "--dataset", dataset["id"], "-o", str(path)])
        assert code == 0
        keys = client.signing_keys()
    return Exported(json.loads(path.read_text()), keys)


@pytest.fixture
def exported(database_url: URL, db: Database, tmp_path: Path) -> Exported:
    return _export(database_url, db, tmp_path)


@pytest.fixture(scope="module")
def shared(sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    """One SQLite ledger for the attack matrix (each case only edits a copy of its bundle)."""
    tmp = tmp_path_factory.mktemp("offline-bundle")
    shutil.copyfile(sqlite_template, tmp / "ledger.db")
    url = make_url(f"sqlite:///{tmp / 'ledger.db'}")
    database = Database(url)
    try:
        yield _export(url, database, tmp)
    finally:
        database.dispose()


@dataclass
class Checked:
    code: int
    report: Json

    @property
    def failed(self) -> set[str]:
        return {c["name"] for c in self.report.get("checks", []) if not c["ok"]}

    def check(self, name: str) -> Json:
        return next(c for c in self.report["checks"] if c["name"] == name)


def _check(
    bundle: Json, tmp: Path, capsys: pytest.CaptureFixture[str], *args: str, rehash: bool = True
) -> Checked:
    if rehash:
        bundle["bundle_hash"] = bundle_hash(bundle)
    path = tmp / "bundle.json"
    path.write_text(json.dumps(bundle))
    capsys.readouterr()
    code = main(["check", "--bundle", str(path), "--json", *args])
    out = capsys.readouterr().out
    return Checked(code, json.loads(out))


def _pinned(keys: Json, tmp: Path) -> list[str]:
    path = tmp / "signing-keys.json"
    path.write_text(json.dumps(keys))
    return ["--trusted-keys", str(path)]


def _issue_forgery(bundle: Json) -> None:
    """The edit of issue 24 §1 (the bundle hash is recomputed by ``_check``)."""
    del bundle["certificates"][1:]
    bundle["audit"].update(entries=None, head=None, verify={"ok": True})
    bundle["spend"]["epsilon_spent"] = "0.5"


# ---------------------------------------------------------------------------------------------
# The issue's forgery, the genuine spend, the signer
# ---------------------------------------------------------------------------------------------


def test_the_issue_forgery_fails_with_a_pinned_key(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pin = _pinned(exported.keys, tmp_path)
    genuine = _check(copy.deepcopy(exported.bundle), tmp_path, capsys, *pin, "--max-epsilon", "1")
    assert genuine.code == 1 and genuine.failed == {"max epsilon"}
    assert genuine.check("max epsilon")["detail"] == "the dataset's epsilon spent (recomputed) 4.75 > 1"

    forged = copy.deepcopy(exported.bundle)
    _issue_forgery(forged)
    result = _check(forged, tmp_path, capsys, *pin, "--max-epsilon", "1")
    assert result.code == 1
    assert result.report["result"].startswith("FAIL")
    assert {"audit chain", "history", "signatures", "max epsilon"} <= result.failed
    assert "the bundle carries no audit entries" in " ".join(result.check("audit chain")["problems"])
    assert "the audit head is missing" in " ".join(result.check("signatures")["problems"])
    assert result.check("max epsilon")["detail"].startswith("no epsilon spent proven")
    # (the old verdict of every check of this forgery was PASS, and the exit 0)

    # ... and in text: no line of the report passes the forgery's chain or spend
    path = tmp_path / "bundle.json"
    capsys.readouterr()
    assert main(["check", "--bundle", str(path), *pin, "--max-epsilon", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  audit chain" in out and "FAIL  history" in out and "FAIL  max epsilon" in out

    # The same forgery keeping the chain and its signed head: the chain anchors the two dropped
    # certificates, and the history adds up to 4.75, not the stated 0.5.
    kept = copy.deepcopy(exported.bundle)
    del kept["certificates"][1:]
    kept["spend"]["epsilon_spent"] = "0.5"
    result = _check(kept, tmp_path, capsys, *pin, "--max-epsilon", "1")
    # (budget: the spend's stated guarantee, 4.75, is not the one its stated spend, 0.5, gives)
    assert result.code == 1 and result.failed == {"audit chain", "history", "max epsilon", "budget"}
    problems = " ".join(result.check("history")["problems"])
    assert "the audit chain anchors certificate" in problems and "which is missing" in problems
    # (the history of what is left adds up to 0.5: with a gap it proves no figure to compare)
    assert result.check("max epsilon")["detail"].startswith("no epsilon spent proven")

    # ... and with the certificates kept but the spend lowered: the history adds up to 4.75
    lowered = copy.deepcopy(exported.bundle)
    lowered["spend"]["epsilon_spent"] = "0.5"
    result = _check(lowered, tmp_path, capsys, *pin, "--max-epsilon", "1")
    assert result.code == 1 and result.failed == {"budget", "history", "max epsilon"}
    problems = " ".join(result.check("history")["problems"])
    assert "the spend states epsilon_spent 0.5; the certificates' history adds up to 4.75" in problems


def test_the_genuine_bundle_recomputes_its_spend(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pin = _pinned(exported.keys, tmp_path)
    result = _check(copy.deepcopy(exported.bundle), tmp_path, capsys, *pin, "--max-epsilon", "4.75")
    assert result.code == 0, result.report
    assert result.report["result"] == "PASS" and result.failed == set()
    assert result.report["summary"]["epsilon_recomputed"] == "4.75"
    assert result.report["summary"]["epsilon_spent"] == "4.75"
    assert result.check("history")["detail"] == (
        "3 settlement(s) chained per batch from the empty state over 1 batch(es): epsilon spent "
        "4.75, delta spent 0 (max over batches)"
    )
    assert _check(copy.deepcopy(exported.bundle), tmp_path, capsys, *pin, "--max-epsilon", "4.7").code == 1


def test_the_stated_guarantee_and_outcome_are_recomputed(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spend's ``guarantee`` (what a reader takes as the dataset's DP statement) and a stored
    certificate's ``outcome`` are read against what the history and the signed body give: a
    guarantee lowered below what ran, a meaning swapped, an outcome rewritten fail."""
    pin = _pinned(exported.keys, tmp_path)
    assert exported.bundle["spend"]["guarantee"]["epsilon"] == "4.75"
    for edit, failed, problem in (
        (
            lambda b: b["spend"]["guarantee"].update(epsilon="0.5"),
            "budget",
            "the spend states the guarantee (0.5, 0)-DP; the spend the history adds up to gives (4.75, 0)",
        ),
        (
            lambda b: b["spend"].update(epsilon_spent_is="a budget share"),
            "budget",
            "not what the rule makes it",
        ),
        (
            lambda b: b["certificates"][0].update(outcome="aborted"),
            "certificates",
            "stored outcome 'aborted' != certified",
        ),
    ):
        bundle = copy.deepcopy(exported.bundle)
        edit(bundle)
        result = _check(bundle, tmp_path, capsys, *pin)
        assert result.code == 1 and result.failed == {failed}, result.report
        assert problem in " ".join(result.check(failed)["problems"])


def test_a_bundle_re_signed_with_another_key_is_an_unverified_signer(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resigned = copy.deepcopy(exported.bundle)
    _sign_as_forger(resigned)

    result = _check(copy.deepcopy(resigned), tmp_path, capsys)
    assert result.code == 1 and result.failed == set()
    assert result.report["ok"] is False and result.report["result"].startswith("UNVERIFIED SIGNER")
    assert result.check("signatures")["status"] == "UNVERIFIED SIGNER"
    allowed = _check(copy.deepcopy(resigned), tmp_path, capsys, "--allow-unverified-signer")
    assert allowed.code == 0 and allowed.report["result"].startswith("PASS (signer unverified")
    pinned = _check(copy.deepcopy(resigned), tmp_path, capsys, *_pinned(exported.keys, tmp_path))
    assert pinned.code == 1 and pinned.failed == {"signatures"}
    # the flag never passes a failed check
    forged = copy.deepcopy(resigned)
    forged["spend"]["epsilon_spent"] = "0.5"
    assert _check(forged, tmp_path, capsys, "--allow-unverified-signer").code == 1
    # and a genuine bundle without a pinned key is UNVERIFIED SIGNER too
    assert _check(copy.deepcopy(exported.bundle), tmp_path, capsys).code == 1


def test_help_documents_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--allow-unverified-signer" in out and "UNVERIFIED SIGNER" in out


# ---------------------------------------------------------------------------------------------
# An invented earlier state
# ---------------------------------------------------------------------------------------------


def _reissue(stored: Json, before: Json) -> None:
    """Re-issue a certificate as if its batch had been in ``before`` (every number recomputed
    with the accountant's own functions, so ``verify`` passes), keeping its signature field."""
    from accountant import certificates as accountant_certificates
    from accountant import events as ev
    from accountant.certificates import BatchSet, ClassRecord
    from accountant.rules import BatchState, Budget, Charge, commit, reserve

    body = stored["certificate"]
    inputs = body["inputs"]
    budget = Budget.from_json(inputs["budget"])
    charge = Charge.from_json(inputs["charge"])
    state = BatchState.from_json(before)
    admission = reserve(budget, state, charge)
    settled = commit(budget, admission.state, charge, admission.cost, None)
    (c,) = inputs["classes"]
    record = ClassRecord(
        c["class"],
        c["batches"],
        state,
        admission.cost,
        admission.state,
        None,
        settled.state,
        settled.committed,
    )
    forged = accountant_certificates.issue(
        budget=budget,
        charge=charge,
        classes=[record],
        batch_set=BatchSet(inputs["batch_set"]["count"], inputs["batch_set"]["hash"]),
        reservation_id=body["reservation_id"],
        release=body["release"],
        partial_event=None if inputs["partial_event"] is None else ev.from_json(inputs["partial_event"]),
        release_id=body["release_id"],
        dataset_id=body["dataset_id"],
        issued_at=body["issued_at"],
    )
    assert accountant_certificates.verify(forged).ok  # on its own, it verifies
    stored["certificate"] = {**forged, "signature": body.get("signature")}
    stored["content_hash"] = forged["hash"]


def test_an_invented_earlier_state_is_caught_by_the_history(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last certificate (ε 0.25) re-issued as if the batch had spent nothing before it: it
    verifies on its own, certifies 0.25 where 4.75 ran, and its anchoring entry and the chain
    are rewritten to match (no secret needed). Without a pinned key (the forger re-signs) and
    with one, the history shows the state was never there."""
    from accountant.rules import BatchState
    from tests.service.test_cli_check import _rechain

    forged = copy.deepcopy(exported.bundle)
    stored = forged["certificates"][-1]
    _reissue(stored, BatchState.empty().to_json())
    assert stored["certificate"]["result"]["epsilon"] == "0.25"
    for entry in forged["audit"]["entries"]:
        if entry["payload"].get("certificate_id") == stored["id"] and "content_hash" in entry["payload"]:
            entry["payload"]["content_hash"] = stored["content_hash"]
    _rechain(forged)
    _sign_as_forger(forged)

    result = _check(copy.deepcopy(forged), tmp_path, capsys, "--allow-unverified-signer")
    assert result.code == 1 and result.failed == {"history"}, result.report
    problems = " ".join(result.check("history")["problems"])
    assert f"certificate {stored['id']}: state_at_reserve of batch(es)" in problems
    assert f"certificate {stored['id']}: state_before of batch(es)" in problems
    assert "(a state invented, or an earlier settlement altered)" in problems
    pinned = _check(forged, tmp_path, capsys, *_pinned(exported.keys, tmp_path))
    assert pinned.code == 1 and pinned.failed == {"history", "signatures"}


# ---------------------------------------------------------------------------------------------
# Every field removed, nulled, duplicated, reordered
# ---------------------------------------------------------------------------------------------

Path_ = tuple[str | int, ...]
MUTATIONS = ("removed", "nulled", "duplicated", "reordered", "retyped")

# Fields of the bundle, by pattern ("*": every key or index there), down to each field of each
# certificate's body, audit entry, batch list and registry version; deeper inside a certificate
# its content hash and signature cover every field (tests/service/api/test_signatures.py,
# tests/accountant/test_certificates.py).
FIELDS = (
    "kind",
    "version",
    "exported_at",
    "source",
    "bundle_hash",
    "dataset",
    "dataset.*",
    "dataset.budget.*",
    "spend",
    "spend.*",
    "certificates",
    "certificates.*",
    "certificates.*.*",
    "certificates.*.certificate.*",
    "audit",
    "audit.*",
    "audit.head.*",
    "audit.entries.*",
    "audit.entries.*.*",
    "audit.verify.*",
    "models",
    "models.*",
    "signing_keys",
    "signing_keys.*",
    "signing_keys.keys.*",
    "batch_sets",
    "batch_sets.*",
    "batch_sets.*.*",
)

# The edits that pass, and why they cannot change what the check certifies (each still passes
# with the genuine 4.75 recomputed; a regex over "path:mutation").
HARMLESS: dict[str, str] = {
    r"(exported_at|source):(removed|nulled|retyped)": "informational: no check reads when or where from",
    r"spend\.ledger_version:(removed|nulled|retyped)": "informational: the server's version",
    r"dataset\.(name|created_at|updated_at|data_source|tenant_id|records|warnings|archived_at)(\.\w+)*"
    r":(removed|nulled|retyped)": (
        "informational: the certificates, the chain and the history never read them"
    ),
    r"spend\.(epsilon_remaining|delta_remaining|naive_sequential_epsilon|tasks|batches|"
    r"charges_committed|reservations_open|last_release|last_release_at|updated_at"
    r"|epsilon_held|delta_held)[^:]*:\w+": (
        "derived or informational: the ε and δ spent, the rule and the budget are checked against "
        "the history and the dataset; nothing is certified from these"
    ),
    r"certificates:reordered": "the history walks the certificates in the chain's order, not the list's",
    r"certificates\.\d+\.(created_at|tenant_id|dataset_id|reservation_id|release_id|signed)"
    r":(removed|nulled|retyped)": "the stored row's copies: the check reads the signed body",
    r"audit\.entries\.\d+\.seq:(removed|nulled|retyped)": "the database's row number: not hashed, never read",
    r"audit\.verify\.(entries|first_broken|chain|chain_seq|reason|head):\w+": (
        "the server's own verdict is reported, never trusted: the chain is recomputed and its "
        "head's signature checked"
    ),
    r"signing_keys(\.\w+)*(\.\d+)?:\w+": "the keys are pinned: the bundle's own are not used",
    r"models:(removed|nulled|retyped)|models\.m:(removed|retyped)": (
        "no registry version is published on this dataset (the releases are certificates)"
    ),
    r"batch_sets\.res_\w+:reordered": "the batch list is hashed sorted (batch_set_hash)",
}


def _paths(value: Any, pattern: str) -> list[Path_]:
    found: list[Path_] = [()]
    for part in pattern.split("."):
        expanded: list[Path_] = []
        for path in found:
            node = _get(value, path)
            if part != "*":
                if isinstance(node, dict) and part in node:
                    expanded.append((*path, part))
            elif isinstance(node, dict):
                expanded.extend((*path, k) for k in node)
            elif isinstance(node, list):
                expanded.extend((*path, i) for i in range(len(node)))
        found = expanded
    return found


def _get(value: Any, path: Path_) -> Any:
    for part in path:
        value = value[part]
    return value


def _mutate(bundle: Json, path: Path_, mutation: str) -> bool:
    """Apply ``mutation`` at ``path``; ``False`` where it does not apply (a scalar has nothing to
    reorder; a JSON object cannot hold a key twice — a duplicated key parses as one value)."""
    parent, key = _get(bundle, path[:-1]), path[-1]
    node = parent[key]
    if mutation == "removed":
        del parent[key]
    elif mutation == "nulled":
        if node is None:
            return False  # already null
        parent[key] = None
    elif mutation == "retyped":  # beyond the issue's four: a value of another JSON type
        parent[key] = [] if isinstance(node, dict) else {} if isinstance(node, list) else [node]
    elif mutation == "duplicated":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(node))  # type: ignore[arg-type]
        elif isinstance(node, list) and node:
            node.append(copy.deepcopy(node[0]))
        else:
            return False
    elif isinstance(node, list) and len(node) > 1:
        node.reverse()
    elif isinstance(node, dict) and len(node) > 1:
        parent[key] = dict(reversed(list(node.items())))
    else:
        return False
    return True


def _label(path: Path_) -> str:
    return ".".join(str(p) for p in path)


def _harmless(label: str, node: Any, mutation: str) -> str | None:
    if mutation == "reordered" and isinstance(node, dict):
        return "JSON object keys are unordered: canonical JSON sorts them, and the check reads by key"
    return next((why for pattern, why in HARMLESS.items() if re.fullmatch(pattern, label)), None)


# The sweep runs ``ledger check`` once per field path and mutation: the fast loop attacks
# every field by removing and retyping it, the whole suite by all five mutations.
FAST_MUTATIONS = ("removed", "retyped")


@pytest.mark.parametrize(
    "mutation", [m if m in FAST_MUTATIONS else pytest.param(m, marks=pytest.mark.slow) for m in MUTATIONS]
)
@pytest.mark.parametrize("pattern", FIELDS)
def test_every_field_attacked(
    shared: Exported, pattern: str, mutation: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pin = _pinned(shared.keys, tmp_path)
    wrong: list[str] = []
    tried = 0
    for path in _paths(shared.bundle, pattern):
        bundle = copy.deepcopy(shared.bundle)
        node = _get(bundle, path)
        if not _mutate(bundle, path, mutation):
            continue
        tried += 1
        label = f"{_label(path)}:{mutation}"
        result = _check(bundle, tmp_path, capsys, *pin, rehash=path != ("bundle_hash",))
        why = _harmless(label, node, mutation)
        if why is None and result.code == 0:
            wrong.append(f"{label} passed")
        elif why is not None and (
            result.code != 0 or result.report["summary"]["epsilon_recomputed"] != "4.75"
        ):
            wrong.append(f"{label} is listed harmless ({why}) but exits {result.code}: {result.failed}")
    assert not wrong, "\n".join(wrong)
    if pattern in ("certificates", "audit.entries.*", "batch_sets.*.*") or (
        mutation in ("removed", "nulled") and "*" not in pattern
    ):
        assert tried, f"{pattern}: nothing to {mutation}"


def _edits(bundle: Json) -> Iterator[tuple[str, Callable[[Json], None]]]:
    """Whole-structure edits beyond one field: certificates swapped for another's, entries moved."""

    def swap_ids(b: Json) -> None:
        first, second = b["certificates"][0], b["certificates"][1]
        first["id"], second["id"] = second["id"], first["id"]

    def move_entry(b: Json) -> None:
        entries = b["audit"]["entries"]
        entries.append(entries.pop(1))

    def duplicate_certificate_under_new_id(b: Json) -> None:
        twin = copy.deepcopy(b["certificates"][0])
        twin["id"] = "cert_twin"
        b["certificates"].append(twin)

    yield "certificate ids swapped", swap_ids
    yield "an audit entry moved to the end", move_entry
    yield "a certificate listed twice under two ids", duplicate_certificate_under_new_id
    del bundle


def test_structural_edits_fail(shared: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pin = _pinned(shared.keys, tmp_path)
    for name, edit in _edits(shared.bundle):
        bundle = copy.deepcopy(shared.bundle)
        edit(bundle)
        result = _check(bundle, tmp_path, capsys, *pin)
        assert result.code == 1, name


def test_a_settlement_without_a_release_is_anchored_like_a_commit(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The contract with aborts and expiries that charge what could have run: a certificate with
    ``release: null`` anchored by a ``reservation.aborted`` (or ``.expired``) entry that carries
    its ``certificate_id`` and ``content_hash`` is one more settlement of the history. Made here
    from the last commit (re-hashed, the chain recomputed, re-signed: the server's key is not
    ours), it passes with the same recomputed spend; anchored twice, or not at all, it fails."""
    from accountant.certificates import content_hash
    from tests.service.test_cli_check import _rechain

    def aborted(event_type: str) -> Json:
        bundle = copy.deepcopy(exported.bundle)
        stored = bundle["certificates"][-1]
        body = {k: v for k, v in stored["certificate"].items() if k != "signature"}
        body.update(release=None, release_id=None, outcome=event_type.removeprefix("reservation."))
        body["hash"] = stored["content_hash"] = content_hash(body)
        stored.update(certificate=body, release=None, outcome=body["outcome"])
        for entry in bundle["audit"]["entries"]:
            if entry["payload"].get("certificate_id") == stored["id"]:
                entry["event_type"] = event_type
                entry["payload"].update(content_hash=body["hash"], release=None)
        _rechain(bundle)
        _sign_as_forger(bundle)
        return bundle

    for event_type in ("reservation.aborted", "reservation.expired"):
        result = _check(aborted(event_type), tmp_path, capsys, "--allow-unverified-signer")
        assert result.code == 0, result.report
        assert result.report["summary"]["epsilon_recomputed"] == "4.75"
        assert result.check("releases")["detail"].startswith("2 release(s)")

    # an entry that names a certificate without its content hash (model_version.published does)
    # anchors nothing: the certificate is then unanchored
    unanchored = aborted("reservation.aborted")
    for entry in unanchored["audit"]["entries"]:
        if entry["event_type"] == "reservation.aborted":
            del entry["payload"]["content_hash"]
    _rechain(unanchored)
    result = _check(unanchored, tmp_path, capsys, "--allow-unverified-signer")
    assert result.code == 1 and {"audit chain", "history", "signatures"} <= result.failed
    assert "no audit entry anchors it" in " ".join(result.check("audit chain")["problems"])


@pytest.mark.slow
def test_an_export_taken_while_the_ledger_moves_is_consistent(
    database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A commit that lands after the export read the chain and before it read the spend: the
    export reads the chain again, so the bundle's spend is the one its chain and certificates add
    up to (it used to state the newer spend over the older chain, which the history refuses)."""
    from service.commands.export import collect

    settings = settings_for(database_url, tmp_path / "artifacts")
    admin = tenancy.create_api_key(db, "acme", "admin")
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    with serve(settings, db) as url, LedgerClient(url, admin) as client:
        dataset = client.create_dataset("d", rule="sequential", epsilon="10", delta=0, accountant="basic")
        task = client.create_task(dataset["id"], "t")
        (batch,) = client.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r"]}])["data"]
        with client.release_gate(dataset["id"], [batch["id"]], PureDpEvent(0.5), model="m", version=1):
            pass

        class Racing(LedgerClient):
            """Reads the spend only after one more commit has landed."""

            raced = False

            def spend(self, dataset_id: str) -> Json:
                if not self.raced:
                    self.raced = True
                    with client.release_gate(dataset_id, [batch["id"]], PureDpEvent(4), model="m", version=2):
                        pass
                return super().spend(dataset_id)

        with Racing(url, viewer) as racing:
            bundle = collect(racing, dataset["id"])
            assert racing.raced
        keys = client.signing_keys()
    assert bundle["spend"]["epsilon_spent"] == "4.5" and len(bundle["certificates"]) == 2
    result = _check(bundle, tmp_path, capsys, *_pinned(keys, tmp_path), rehash=False)
    assert result.code == 0, result.report
    assert result.report["summary"]["epsilon_recomputed"] == "4.5"


LIVED = [
    pytest.param({"rule": "sequential", "accountant": "basic"}, id="sequential-basic"),
    pytest.param({"rule": "sequential", "accountant": "rdp", "delta": "1e-5"}, id="sequential-rdp"),
    pytest.param({"rule": "lifelong", "accountant": "basic"}, id="lifelong-basic"),
    pytest.param({"rule": "lifelong", "accountant": "rdp", "delta": "1e-5"}, id="lifelong-rdp"),
    pytest.param(
        {"rule": "geometric", "accountant": "basic", "geometric": {"first": "2", "ratio": "0.5"}},
        id="geometric-basic",
    ),
    pytest.param({"rule": "parallel", "accountant": "basic"}, id="parallel-basic"),
]


@pytest.mark.slow
@pytest.mark.parametrize("budget", LIVED)
def test_the_history_holds_on_a_lived_ledger(
    budget: Json, database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No false alarm: reservations interleaved on shared batches, holds aborted between
    commits, progressive commits, a replay of committed noise (lifelong): the history chains on
    every rule and adds up to the spend the server states (sequential ``prv`` with declared
    segments: tests/service/api/test_plan_segments.py)."""
    from accountant.events import SelfComposedEvent

    settings = settings_for(database_url, tmp_path / "artifacts")
    admin = tenancy.create_api_key(db, "acme", "admin")
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    parallel = budget["rule"] == "parallel"
    step = PureDpEvent(0.25)
    with serve(settings, db) as url, LedgerClient(url, admin) as client:
        ds = client.create_dataset(
            "d",
            rule=budget["rule"],
            epsilon="4",
            delta=budget.get("delta", 0),
            accountant=budget["accountant"],
            geometric=budget.get("geometric"),
        )["id"]
        task = client.create_task(ds, "t")["id"]
        b = [
            x["id"]
            for x in client.create_batches(
                ds, task, [{"name": f"b{i}", "records": [f"r{i}"]} for i in range(4)]
            )["data"]
        ]
        versions = iter(range(1, 100))

        def commit(rid: str, event: Any = None) -> None:
            client.commit(rid, model="m", version=next(versions), event=event)

        first = client.reserve(ds, SelfComposedEvent(step, 4), batches=b[:2] if not parallel else b[:1])["id"]
        second = client.reserve(ds, step, batches=b[1:3] if not parallel else b[1:2])["id"]
        dropped = client.reserve(ds, step, batches=[b[2]] if parallel else [b[0]])["id"]
        client.abort(dropped)
        commit(first, SelfComposedEvent(step, 2))  # progressive: the run so far
        held = client.reserve(ds, step, batches=[b[3]] if parallel else b[:3])["id"]
        commit(second)
        commit(first)
        client.abort(held)
        if not parallel:
            commit(client.reserve(ds, step, batches=b)["id"])
        if budget["rule"] == "lifelong":
            commit(client.reserve(ds, PureDpEvent(0.5), batches=b[:2], noise_commitment="c")["id"])
            commit(client.reserve(ds, PureDpEvent(0.5), batches=b[1:3], noise_commitment="c")["id"])
        path = tmp_path / "lived.json"
        assert main(["export", "--url", url, "--key", viewer, "--dataset", ds, "-o", str(path)]) == 0
        keys = client.signing_keys()
    bundle = json.loads(path.read_text())
    result = _check(bundle, tmp_path, capsys, *_pinned(keys, tmp_path), rehash=False)
    assert result.code == 0, json.dumps(result.report, indent=1)
    assert result.report["summary"]["epsilon_recomputed"] == bundle["spend"]["epsilon_spent"]
    assert result.check("history")["detail"].startswith(f"{len(bundle['certificates'])} settlement(s)")


# ---------------------------------------------------------------------------------------------
# Real aborts and expiries: charged, certified, anchored, proven offline
# ---------------------------------------------------------------------------------------------


def _resign(bundle: Json) -> None:
    """What a forger without the server's key does after an edit: recompute the chain (entries
    renumbered from 1) and re-sign every certificate and the head with a key of their own."""
    from tests.service.test_cli_check import _rechain

    for seq, entry in enumerate(bundle["audit"]["entries"], start=1):
        entry["chain_seq"] = seq
    bundle["audit"]["head"]["chain_seq"] = len(bundle["audit"]["entries"])
    _rechain(bundle)
    _sign_as_forger(bundle)


def _sign_as_forger(bundle: Json) -> None:
    """Sign every certificate and the audit head of ``bundle`` with a fresh key of the forger's
    own, and declare that key in the bundle (what a forger without the server's key can do)."""
    own = signing.SigningKey.generate()
    for c in bundle["certificates"]:
        c["certificate"] = signing.sign_certificate(c["certificate"], own)
    head = bundle["audit"]["head"]
    bundle["audit"]["head"] = signing.signed_head(
        bundle["dataset"]["id"], head["chain_seq"], head["hash"], own
    )
    bundle["signing_keys"] = {"keys": [own.public.to_json()]}


@dataclass
class Lived:
    exported: Exported
    aborted: str  # the reservation aborted over HTTP, with later settlements on its batch
    expired: tuple[str, str]  # expired by the sweep, expired by a late commit
    progressive: str  # committed progressively, then aborted
    worker_charged: str  # the job that failed after 7 of 20 steps
    worker_refunded: str  # the job that failed before reading its data


def _lived_aborts(database_url: URL, db: Database, tmp: Path) -> Lived:
    """One dataset (sequential, RDP, the digits records in two batches) whose history holds
    every way a reservation ends: commits, an HTTP abort, an expiry by the sweep, an expiry by a
    late commit, a progressive commit then an abort, and two built-in worker jobs (real torch
    training): one failing after 7 of 20 steps (charged the prefix), one failing before reading
    its data (refunded, no certificate); commits after each on the same batches."""
    import time

    from accountant.events import SelfComposedEvent
    from service.client import LedgerError
    from service.contract.data_roots import DataRoots
    from service.ledger import datasets, jobs
    from service.ledger import reservations as ledger_reservations
    from service.worker.worker import Worker
    from tests.worker.digits_world import CountingLoader, digits_dataset

    settings = settings_for(database_url, tmp / "artifacts")
    admin = tenancy.create_api_key(db, "acme", "admin")
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    world = digits_dataset(db, epsilon="20")
    ds, (b0, b1) = world.dataset_id, world.batch_ids
    versions = iter(range(1, 100))
    step = PureDpEvent(0.25)
    with serve(settings, db) as url, LedgerClient(url, admin) as client:

        def release(batches: list[str], event: Any = step) -> None:
            with client.release_gate(ds, batches, event, model="m", version=next(versions)):
                pass

        release([b0])
        aborted = client.reserve(ds, step, batches=[b0, b1])["id"]
        client.abort(aborted)
        release([b0])

        swept = client.reserve(ds, step, batches=[b0], ttl_s=0.3)["id"]
        time.sleep(0.4)
        ledger_reservations.expire_due(db)  # the sweep (the server's own may have run first)
        assert client.get_reservation(swept)["status"] == "expired"
        late = client.reserve(ds, step, batches=[b1], ttl_s=0.3)["id"]
        time.sleep(0.4)
        with pytest.raises(LedgerError):
            client.commit(late, model="m", version=next(versions))
        assert client.get_reservation(late)["status"] == "expired"
        release([b0, b1])

        progressive = client.reserve(ds, SelfComposedEvent(step, 4), batches=[b1])["id"]
        client.commit(progressive, model="m", version=next(versions), event=SelfComposedEvent(step, 2))
        client.abort(progressive)
        release([b1])

        # The worker's own aborts (in-process only): a prefix charged, then a refund.
        blocker = tmp / "not-a-dir"
        blocker.write_text("a file where the artifact dir's parent should be")
        charged = jobs.queue.create_job(
            db,
            "acme",
            dataset_id=ds,
            algorithm="dp_sgd",
            params={"noise_multiplier": 1.5, "steps": 20, "checkpoint_every": 7, "seed": 3},
        )
        Worker(db, artifact_dir=blocker / "artifacts", loader=CountingLoader(), device="cpu").run_once()
        charged = jobs.queue.get_job(db, "acme", str(charged.id))
        assert charged.job.status == "failed", charged
        release([b0])

        root = tmp / "data"
        root.mkdir()
        roots = DataRoots({"*": [str(root)]})
        source = root / "gone.npz"
        source.write_bytes(b"")
        datasets.set_data_source(db, "acme", ds, data_source=f"file://{source}", data_roots=roots)
        refunded = jobs.queue.create_job(
            db, "acme", dataset_id=ds, algorithm="dp_sgd", params={"noise_multiplier": 1.5, "steps": 5}
        )
        source.unlink()
        Worker(
            db, artifact_dir=tmp / "artifacts", loader=CountingLoader(roots=roots), device="cpu"
        ).run_once()
        refunded = jobs.queue.get_job(db, "acme", str(refunded.id))
        assert refunded.job.status == "failed" and refunded.job.error["error"] == "data_source", refunded
        release([b0, b1])

        path = tmp / "lived-aborts.json"
        assert main(["export", "--url", url, "--key", viewer, "--dataset", ds, "-o", str(path)]) == 0
        keys = client.signing_keys()
    return Lived(
        Exported(json.loads(path.read_text()), keys),
        aborted,
        (swept, late),
        progressive,
        str(charged.job.reservation_id),
        str(refunded.job.reservation_id),
    )


def _settling(bundle: Json, reservation_id: str) -> tuple[Json, Json]:
    """The certificate that settles ``reservation_id`` without a release, and its anchoring entry."""
    (stored,) = [
        c
        for c in bundle["certificates"]
        if c["reservation_id"] == reservation_id and c["certificate"]["release"] is None
    ]
    (entry,) = [e for e in bundle["audit"]["entries"] if e["payload"].get("certificate_id") == stored["id"]]
    return stored, entry


@pytest.mark.slow
def test_real_aborts_and_expiries_are_proven_offline(
    database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 §1 and §2 together: the bundle of a ledger that aborted and expired for real
    passes ``ledger check --bundle --trusted-keys`` with the recomputed spend equal to the
    server's, each charged abort and expiry one settlement of the history; and each forgery of
    those settlements fails on a check other than the signatures (re-signed with the forger's own
    key), and on the signatures too with the server's key pinned."""
    from accountant.certificates import content_hash

    pytest.importorskip("torch")
    lived = _lived_aborts(database_url, db, tmp_path)
    bundle, pin = lived.exported.bundle, _pinned(lived.exported.keys, tmp_path)

    outcomes = {c["reservation_id"]: c["outcome"] for c in bundle["certificates"] if c["release"] is None}
    assert outcomes == {
        lived.aborted: "aborted",
        lived.expired[0]: "expired",
        lived.expired[1]: "expired",
        lived.progressive: "aborted",
        lived.worker_charged: "aborted",
    }
    charged, _ = _settling(bundle, lived.worker_charged)
    assert charged["certificate"]["inputs"]["partial_event"]["count"] == 7
    refund = [
        e
        for e in bundle["audit"]["entries"]
        if e["event_type"] == "reservation.aborted"
        and e["payload"]["reservation_id"] == lived.worker_refunded
    ]
    assert len(refund) == 1 and "certificate_id" not in refund[0]["payload"]

    result = _check(copy.deepcopy(bundle), tmp_path, capsys, *pin, rehash=False)
    assert result.code == 0, json.dumps(result.report, indent=1)
    assert result.report["summary"]["epsilon_recomputed"] == bundle["spend"]["epsilon_spent"]
    assert result.report["summary"]["delta_recomputed"] == bundle["spend"]["delta_spent"]
    assert result.check("history")["detail"].startswith(f"{len(bundle['certificates'])} settlement(s)")

    def forged(edit: Callable[[Json], None]) -> tuple[Checked, Checked]:
        edited = copy.deepcopy(bundle)
        edit(edited)
        _resign(edited)
        own = _check(copy.deepcopy(edited), tmp_path, capsys, "--allow-unverified-signer")
        pinned = _check(edited, tmp_path, capsys, *pin)
        assert pinned.code == 1 and "signatures" in pinned.failed
        return own, pinned

    for reservation_id in (lived.aborted, lived.expired[0], lived.expired[1], lived.worker_charged):

        def drop_certificate(b: Json, rid: str = reservation_id) -> None:
            stored, _ = _settling(b, rid)
            b["certificates"].remove(stored)

        def drop_entry(b: Json, rid: str = reservation_id) -> None:
            _, entry = _settling(b, rid)
            b["audit"]["entries"].remove(entry)

        def drop_both(b: Json, rid: str = reservation_id) -> None:
            stored, entry = _settling(b, rid)
            b["certificates"].remove(stored)
            b["audit"]["entries"].remove(entry)

        def into_release(b: Json, rid: str = reservation_id) -> None:
            """The settlement re-issued as a release (valid on its own, its hash recorded)."""
            stored, entry = _settling(b, rid)
            body = {k: v for k, v in stored["certificate"].items() if k != "signature"}
            body.update(outcome="released", release={"model": "m", "version": 99})
            body["hash"] = stored["content_hash"] = entry["payload"]["content_hash"] = content_hash(body)
            stored.update(certificate=body, release=body["release"], outcome="released")

        def into_refund(b: Json, rid: str = reservation_id) -> None:
            """The charge made a refund: its certificate dropped, its entry a refund's."""
            stored, entry = _settling(b, rid)
            b["certificates"].remove(stored)
            for name in ("certificate_id", "content_hash", "release", "final"):
                entry["payload"].pop(name, None)

        for name, edit in (
            ("certificate dropped", drop_certificate),
            ("anchoring entry dropped", drop_entry),
            ("certificate and entry dropped", drop_both),
            ("turned into a release", into_release),
            ("turned into a refund", into_refund),
        ):
            own, _ = forged(edit)
            label = f"{outcomes[reservation_id]} {reservation_id}: {name}"
            assert own.code == 1, label
            assert own.failed - {"signatures"}, f"{label}: only the signatures fail: {own.report}"
