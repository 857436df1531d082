"""The privacy audit (``dp_sgd_audit``, service.training.privacy_audit) with teeth, at CI size.

* Self-test: DP-SGD on builtin:digits calibrated to ε = 2 (δ = 1e-5), audited with 1000 Dirac
  canaries at 95% confidence: the correct run's lower bound stays below 2; the same run with the
  noise off, the clip off, or σ/10 — its plan, and so what the ledger would certify, unchanged —
  gives a lower bound above 2.
* Through the gate (real ledger, SQLite and PostgreSQL, real training): the audit job is charged
  like any job, its version carries the lower bound beside the certified upper bound, and the
  broken variants cannot be asked for by a client.
* ``ledger check`` passes an honest audited version and fails one whose lower bound exceeds its
  certificate's ε.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

from sqlalchemy.engine import URL  # noqa: E402

from accountant.privacy_audit import epsilon_lower_bound  # noqa: E402
from service.cli import main  # noqa: E402
from service.commands.export import bundle_hash  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import jobs, spent, tenancy  # noqa: E402
from service.ledger import model_registry as registry  # noqa: E402
from service.ledger.errors import InvalidInput  # noqa: E402
from service.training.algorithms import trainer_for  # noqa: E402
from service.training.data import LoadedData, load_data  # noqa: E402
from service.training.dp_sgd import DpSgdTrainer  # noqa: E402
from service.training.privacy_audit import BREAKAGES, PrivacyAuditTrainer  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.service.live_server import serve, settings_for  # noqa: E402
from tests.worker.digits_world import DIGITS, CountingLoader, digits_dataset, versions_of  # noqa: E402

CLAIM = {"target_epsilon": 2.0, "delta": 1e-5, "epochs": 10.0, "canaries": 1000, "confidence": 0.95}


@pytest.fixture(scope="module")
def digits() -> LoadedData:
    return load_data(DIGITS)


def _audit(data: LoadedData, breakage: str | None, seed: int = 11) -> dict[str, Any]:
    trainer = PrivacyAuditTrainer(device="cpu", breakage=breakage)  # type: ignore[arg-type]
    plan = trainer.plan({**CLAIM, "seed": seed}, data.n_records)
    result = trainer.train(data, plan)
    assert result.status == "completed"
    audit: dict[str, Any] = result.metrics["privacy_audit"]
    assert audit["steps"] == plan.steps == 225
    return audit


@pytest.mark.slow
def test_the_audit_has_teeth(digits: LoadedData) -> None:
    """The same run, the same claim (ε ≤ 2 by the accountant): correct → lower bound < 2;
    privacy broken three ways → lower bound > 2."""
    correct = _audit(digits, None)
    assert correct["accountant_epsilon"] <= 2.0
    assert correct["canaries"] == 1000 and correct["confidence"] == 0.95
    assert 0 <= correct["epsilon_lower"] < correct["accountant_epsilon"]
    for breakage in BREAKAGES:
        broken = _audit(digits, breakage)
        assert broken["accountant_epsilon"] == correct["accountant_epsilon"]  # what would be certified
        assert broken["epsilon_lower"] > broken["accountant_epsilon"], (breakage, broken)
        # the bound is the one its counts give (at its Bonferroni share of β)
        share = 1 - (1 - broken["confidence"]) / broken["guess_counts_tried"]
        assert broken["epsilon_lower"] == pytest.approx(
            epsilon_lower_bound(
                canaries=1000,
                guesses=broken["guesses"],
                correct=broken["correct"],
                delta=1e-5,
                confidence=share,
            )
        )


def test_the_audited_model_is_a_dp_sgd_model_of_the_data(digits: LoadedData) -> None:
    """The canaries live on coordinates of their own: the released weights have the DP-SGD
    model's shapes, and with the noise off the in-canaries never move them."""
    params = {**CLAIM, "seed": 3, "steps": 5}
    params.pop("epochs")
    audited = PrivacyAuditTrainer(device="cpu", breakage="no_noise")
    states: list[dict[str, Any]] = []
    plan = audited.plan(params, digits.n_records)
    audited.train(digits, plan, on_checkpoint=lambda step, state, event: states.append(state) or True)
    plain = DpSgdTrainer(device="cpu")
    reference = plain.initial_model(digits, plain.parse_params({"noise_multiplier": 1.0}), 3).state_dict()
    assert {k: v.shape for k, v in states[-1].items()} == {k: v.shape for k, v in reference.items()}
    assert audited.canaries is not None
    scores = audited.canaries.scores.numpy()
    assert (scores[~audited.canaries.included] == 0).all()  # out-canaries: no data, no noise


def _queue(db: Database, dataset_id: str, **params: Any) -> str:
    answer = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="dp_sgd_audit", params=params)
    return str(answer.id)


@pytest.mark.slow
def test_an_audit_job_is_charged_and_its_version_shows_both_bounds(db: Database, tmp_path: Path) -> None:
    world = digits_dataset(db, epsilon="3", delta="1e-5")
    loader = CountingLoader()
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=loader, device="cpu")
    job_id = _queue(db, world.dataset_id, **{**CLAIM, "canaries": 500, "seed": 5, "model_name": "audit"})
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert loader.opened == [DIGITS]

    # Charged as the DP-SGD run it is: the reservation is committed, the dataset's spend moved.
    dataset_spend = spent.get_spend(db, "acme", world.dataset_id).spent
    assert dataset_spend.epsilon_spent == Decimal(job.job.epsilon_committed) > 0

    (version,) = versions_of(db, job_id)
    audit = version.metrics["privacy_audit"]
    assert audit["canaries"] == 500 and audit["confidence"] == 0.95
    assert job.job.metrics["privacy_audit"] == audit  # the job's result reports it too

    answer = registry.get_version(db, "acme", "audit", version.version)
    # Against the run's own bound at the budget's δ, not the filter's budget share (issue 24 §3).
    alone = answer.dp_statement["run_alone"]
    assert answer.privacy_audit is not None
    certified = answer.privacy_audit["certified"]
    assert certified["epsilon_upper"] == float(alone["epsilon"]) and certified["delta"] == 1e-5
    assert certified["consistent"] is True and certified["epsilon_lower"] < certified["epsilon_upper"]
    assert answer.privacy_audit["epsilon_lower"] == audit["epsilon_lower"]
    # a plain DP-SGD version has no audit block; a malformed record is shown, not compared
    assert registry.privacy_audit({"test_accuracy": 0.9}, alone) is None
    malformed = {"privacy_audit": {**audit, "correct": "all"}}
    assert registry.privacy_audit(malformed, alone)["certified"] is None  # type: ignore[index]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"breakage": "no_noise"}, "params.breakage"),
        ({"noise_multiplier": 0.0}, "params.noise_multiplier"),
        ({"delta": None}, "params.delta"),
        ({"canaries": 1}, "params.canaries"),
        ({"confidence": 1.0}, "params.confidence"),
    ],
)
def test_a_client_cannot_break_the_audited_run(params: dict[str, Any], field: str) -> None:
    """Broken privacy is a constructor argument of the trainer, never a job param; the gate
    builds trainers with a device only."""
    merged = {**CLAIM, **params}
    if "noise_multiplier" in params:
        merged.pop("target_epsilon")
    merged = {k: v for k, v in merged.items() if v is not None}
    with pytest.raises(InvalidInput) as info:
        jobs.params.check_params("dp_sgd_audit", merged)
    assert info.value.field == field
    trainer = trainer_for("dp_sgd_audit", "cpu")
    assert isinstance(trainer, PrivacyAuditTrainer) and trainer.breakage is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_ledger_check_fails_a_lower_bound_above_the_certified_epsilon(
    database_url: URL, db: Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    world = digits_dataset(db, epsilon="3", delta="1e-5")
    settings = settings_for(database_url, tmp_path / "artifacts")
    worker = Worker(db, artifact_dir=settings.artifact_dir, loader=CountingLoader(), device="cpu")
    short = {k: v for k, v in CLAIM.items() if k != "epochs"}
    _queue(db, world.dataset_id, **{**short, "canaries": 500, "steps": 60, "seed": 2, "model_name": "audit"})
    viewer = tenancy.create_api_key(db, "acme", "viewer")
    assert worker.run_once() is not None
    path = tmp_path / "ledger.json"
    with serve(settings, db) as url:
        online = ["--url", url, "--key", viewer, "--dataset", world.dataset_id]
        assert main(["export", *online, "-o", str(path)]) == 0
        shown = httpx.get(f"{url}/v1/models/audit/versions/1", headers={"Authorization": f"Bearer {viewer}"})
        assert shown.status_code == 200, shown.text
        assert shown.json()["privacy_audit"]["certified"]["consistent"] is True  # over HTTP too
        alone = shown.json()["dp_statement"]["run_alone"]
        capsys.readouterr()
        code = main(["check", *online, "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert code == 0, out
    finding = next(c for c in report["checks"] if c["name"] == "privacy audit")
    assert finding["ok"] is True and finding["detail"].startswith("1 audited version(s)")

    # The same bundle with the version's audit claiming every guess right: a lower bound above
    # the certified ε — the check recomputes it from the counts and fails.
    bundle = json.loads(path.read_text())
    record = bundle["models"]["audit"][0]["metrics"]["privacy_audit"]
    record.update(guesses=500, correct=500)
    bundle["bundle_hash"] = bundle_hash(bundle)
    path.write_text(json.dumps(bundle))
    code = main(["check", "--bundle", str(path), "--allow-unverified-signer"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  privacy audit" in out and "exceeds the certified epsilon" in out
    # compared with the run's own ε at the budget's δ, as the statement shows it (issue 24 §3),
    # not with the certificate's charge (a Rényi filter's share of the budget)
    assert f"certified epsilon {alone['epsilon']} (the run alone, {alone['accountant']})" in out
