"""What a user gets from a released model version (issue 16): its DP statement (served, exported,
rendered as a model card), a module ``load_model`` rebuilds from the recorded architecture and
preprocessing, and the mistakes caught before training (a taken release named at reserve, the
client's dataset defaults, per-job model names, the source-registration helper).

A real server (uvicorn on a loopback port, its in-process worker training for real) over the
``db`` fixture's database; the client over real HTTP; the ε checked against dp-accounting.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import yaml
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism
from sqlalchemy import update

from accountant.events import GaussianEvent, PoissonSampledEvent, PureDpEvent, SelfComposedEvent
from accountant.exact import shown
from service.cli import main as ledger_main
from service.client import Conflict, InvalidInput, LedgerError
from service.commands.export import collect
from service.db.models import ModelVersion
from service.db.session import Database
from service.ledger.dp_statement import dp_statement
from service.training.data import digits_split, load_data, register_source
from service.training.nets import load_model
from tests.worker.digits_world import client_for, finished_job

SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])
DIGITS = "builtin:digits"


def _dp_accounting_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    return float(accountant.get_epsilon(delta))


@pytest.mark.slow
@SQLITE_ONLY
def test_a_trained_version_loads_predicts_as_reported_and_states_what_was_certified(
    ledger: tuple[str, dict[str, str]], db: Database, tmp_path: Path
) -> None:
    url, keys = ledger
    admin, trainer, viewer = (client_for(url, keys[s]) for s in ("admin", "trainer", "viewer"))
    # The client's defaults fit DP-SGD: the tight accountant (issue 25 §3; delta has no default).
    dataset = admin.create_dataset(
        "digits", rule="sequential", epsilon="10", delta="1e-5", data_source=DIGITS
    )
    assert dataset["budget"]["accountant"] == "tight"

    # The helper registers the source's training records: one task, batches of 700 in order.
    tasks = register_source(admin, dataset["id"], batch_size=700)
    train_ids = load_data(DIGITS).record_ids
    assert [t["name"] for t in tasks] == ["task-0"]
    assert [b["size"] for b in tasks[0]["batches"]] == [700, 700, len(train_ids) - 1400]
    assert [b["name"] for b in tasks[0]["batches"]] == [
        "task-0/batch-0000",
        "task-0/batch-0001",
        "task-0/batch-0002",
    ]
    again = register_source(admin, dataset["id"], batch_size=700)  # idempotent: nothing twice
    assert again == tasks and admin.list_tasks(dataset["id"])["count"] == 1

    params = {
        "noise_multiplier": 1.1,
        "steps": 120,
        "expected_batch_size": 128,
        "max_grad_norm": 1.5,
        "learning_rate": 2.0,
        "seed": 7,
    }
    job = finished_job(trainer, trainer.create_job(dataset["id"], "dp_sgd", params)["id"])
    assert job["status"] == "succeeded", job.get("error")
    name = job["model_name"]
    assert name == f"dp_sgd-{job['id']}"  # unique per job
    (version_number,) = [v["version"] for v in viewer.list_model_versions(name)["data"]]
    version = viewer.get_model_version(name, version_number)

    # The architecture and preprocessing are recorded, and load_model rebuilds the module.
    spec = version["model_spec"]
    assert spec["model"] == "mlp" and spec["n_features"] == 64 and spec["num_classes"] == 10
    assert spec["preprocessing"]["kind"] == "scale" and spec["preprocessing"]["divide_by"] == 16
    module = load_model(viewer, name, version_number)
    assert not module.training and module.model_spec == spec

    # Predict on the raw built-in digits with the recorded preprocessing: the job's accuracy.
    import torch
    from sklearn.datasets import load_digits

    raw = load_digits()
    _, test_idx = digits_split()
    x = np.asarray(raw.data[test_idx], dtype=np.float32) / spec["preprocessing"]["divide_by"]
    with torch.no_grad():
        predicted = module(torch.from_numpy(x)).argmax(1).numpy()
    accuracy = float(torch.tensor(predicted == raw.target[test_idx]).float().mean().item())
    assert accuracy == version["metrics"]["test_accuracy"]
    assert accuracy > 0.5  # trained, not chance: the comparison above means something

    # The DP statement restates the certificate and the job's plan.
    statement = version["dp_statement"]
    certificate = version["certificate"]["certificate"]
    plan = trainer.get_job(job["id"])["plan"]
    # Three figures, each valid for what it names (issue 24 §3): the release's guarantee is the
    # budget of the union of filters (its progress is no guarantee), the run alone its own PRV bound at the
    # budget's δ, the budget share the reservation's committed cost, labelled as not a guarantee.
    assert statement["guarantee"]["epsilon"] == certificate["result"]["guarantee"]["epsilon"] == "10"
    assert statement["guarantee"]["delta"] == certificate["result"]["guarantee"]["delta"] == "0.00001"
    assert "stopping" in statement["guarantee"]["scope"] and "Feldman" in statement["guarantee"]["covers"]
    assert Decimal(certificate["result"]["epsilon"]) < 10  # the filter's progress
    assert statement["budget_share"]["epsilon"] == certificate["result"]["charge"]["epsilon"]
    assert "NOT a DP guarantee" in statement["budget_share"]["scope"]
    alone = statement["run_alone"]
    assert alone["accountant"] == "prv (upper bound)" and alone["delta"] == "0.00001"
    assert statement["release"]["epsilon"] == alone["epsilon"]  # version 1's field, now true
    assert statement["privacy_unit"]["relation"] == ["add_remove"]
    assert (
        statement["accounting"]["accountant"] == "tight" and statement["accounting"]["rule"] == "sequential"
    )
    assert statement["accounting"]["theorem"] == certificate["theorem"]
    mechanism = statement["mechanism"]
    assert mechanism["sampler"]["kind"] == "poisson"
    assert (
        mechanism["sampler"]["sampling_probability"] == plan["sampling_probability"] == 128 / len(train_ids)
    )
    assert mechanism["steps"] == 120 and mechanism["noise_multiplier"] == 1.1
    assert mechanism["clipping_norm"] == 1.5 and mechanism["algorithm"] == "dp_sgd"
    assert statement["public_data"].startswith("none")
    assert Decimal(statement["budget"]["epsilon_remaining"]) == Decimal("10") - Decimal(
        certificate["result"]["epsilon"]
    )
    assert statement["budget"]["delta_remaining"] is None  # RDP converts at the budget's δ: not spent
    assert statement["certificate"]["id"] == version["certificate_id"]
    # The run alone: never below prv-accountant's lower bound, tighter than dp-accounting's RDP.
    oracle = _dp_accounting_epsilon(plan["sampling_probability"], 1.1, 120, 1e-5)
    library = PRVAccountant(
        PoissonSubsampledGaussianMechanism(plan["sampling_probability"], 1.1),
        max_self_compositions=120,
        eps_error=0.01,
        delta_error=1e-9,
    )
    lower, _, _ = library.compute_epsilon(1e-5, 120)
    assert lower <= float(alone["epsilon"]) < oracle <= float(statement["guarantee"]["epsilon"])

    # The model card: Hugging Face front matter that parses to the statement, and the markdown.
    card_path = tmp_path / "README.md"
    code = ledger_main(
        ["model-card", "--url", url, "--key", keys["viewer"], name, str(version_number), "-o", str(card_path)]
    )
    assert code == 0
    card = card_path.read_text(encoding="utf-8")
    _, front, markdown = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    dp = meta["differential_privacy"]
    assert meta["library_name"] == "pytorch" and "differential-privacy" in meta["tags"]
    assert (
        dp["epsilon"] == statement["guarantee"]["epsilon"] and dp["delta"] == statement["guarantee"]["delta"]
    )
    assert dp["noise_multiplier"] == 1.1 and dp["steps"] == 120 and dp["clipping_norm"] == 1.5
    assert dp["sampler"] == "poisson" and dp["accountant"] == "tight"
    assert dp["certificate_hash"] == certificate["hash"]
    assert "## Differential privacy" in markdown and "| Privacy unit |" in markdown
    assert statement["accounting"]["theorem"] in markdown
    assert (
        dp["run_alone_epsilon"] == alone["epsilon"]
        and dp["budget_share_epsilon"] == (statement["budget_share"]["epsilon"])
    )
    rows = {line.split(" | ")[0][2:]: line for line in markdown.splitlines() if line.startswith("| ")}
    assert "(ε ≤ 10, δ ≤ 0.00001)-DP" in rows["Guarantee of this model"]
    assert f"(ε ≤ {shown(alone['epsilon'])}, δ ≤ 0.00001)-DP by prv" in rows["This run alone"]
    assert "derived from the certificate's charge and budget δ, not certified" in rows["This run alone"]
    assert dp["run_alone_certified"] is False and dp["run_alone_accountant"] == "prv (upper bound)"
    assert "NOT a DP guarantee" in rows["Budget share"] and "This release" not in rows
    # 4 significant digits, rounded up, everywhere a person reads a number (the hash aside).
    long_numbers = [
        number
        for name, row in rows.items()
        if name != "Certificate"
        for number in re.findall(r"\d+\.\d+(?:e-?\d+)?", row)
        if len(Decimal(number).normalize().as_tuple().digits) > 4
    ]
    assert long_numbers == []

    # Exported bundles carry the statement with each version.
    bundle = collect(viewer, dataset["id"], model=name)
    exported = bundle["models"][name]
    assert exported and all(v["dp_statement"] == statement for v in exported)

    # A version that records no architecture (published before it was recorded) is not guessed.
    with db.session() as session:
        session.execute(update(ModelVersion).where(ModelVersion.name == name).values(model_spec=None))
    with pytest.raises(LedgerError) as refused:
        load_model(viewer, name, version_number)
    assert refused.value.code == "model_not_loadable" and name in refused.value.message


def test_a_taken_release_is_refused_at_reserve_naming_model_and_version(
    ledger: tuple[str, dict[str, str]],
) -> None:
    url, keys = ledger
    admin, trainer = client_for(url, keys["admin"]), client_for(url, keys["trainer"])
    dataset = admin.create_dataset("d", rule="sequential", epsilon="1", delta="0", accountant="basic")
    task = admin.create_task(dataset["id"], "t")
    (batch,) = admin.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["r1"]}])["data"]
    with trainer.release_gate(
        dataset["id"], [batch["id"]], PureDpEvent(0.25), model="clf", version=1
    ) as gate:
        pass

    # A release the ledger did not train: its statement says what the ledger cannot know.
    assert gate.certificate is not None
    statement = dp_statement(gate.certificate, job=None, model_spec=None)
    assert statement["guarantee"]["epsilon"] == "0.25" and statement["accounting"]["accountant"] == "basic"
    assert statement["run_alone"] == {
        **statement["run_alone"],
        "epsilon": "0.25",
        "accountant": "basic (exact)",
        "certified": False,  # not in the certificate: recomputed from its charge (ledger check)
    }
    assert "inputs.charge.event and inputs.budget.delta" in statement["run_alone"]["source"]
    assert statement["mechanism"]["sampler"] is None and statement["mechanism"]["event_kinds"] == ["pure_dp"]
    assert statement["mechanism"]["clipping_norm"] is None
    assert "not known to the ledger" in statement["mechanism"]["clipping_norm_source"]
    assert statement["public_data"].startswith("not known to the ledger")
    assert statement["privacy_unit"]["relation"] == []  # pure DP states none: the batch's
    assert (
        statement["budget"]["epsilon_remaining"] == "0.75" and statement["budget"]["delta_remaining"] == "0"
    )
    trained = []
    with (
        pytest.raises(Conflict) as taken,
        trainer.release_gate(dataset["id"], [batch["id"]], PureDpEvent(0.25), model="clf", version=1),
    ):
        trained.append(True)  # never reached: refused before the block
    assert not trained
    assert taken.value.status == 409 and taken.value.details["reason"] == "release_exists"
    assert taken.value.details["model"] == "clf" and taken.value.details["version"] == "1"
    assert "'clf'" in taken.value.message and "'1'" in taken.value.message
    spend = admin.spend(dataset["id"])
    assert spend["epsilon_spent"] == "0.25" and spend["epsilon_held"] == "0"  # nothing held

    # Without naming it at reserve, the commit refuses it, naming both too.
    held = trainer.reserve(dataset["id"], PureDpEvent(0.25), batches=[batch["id"]])
    with pytest.raises(Conflict) as at_commit:
        trainer.commit(held["id"], model="clf", version=1)
    assert at_commit.value.details["reason"] == "release_exists" and "'clf'" in at_commit.value.message
    trainer.abort(held["id"])

    # A malformed release at reserve is a 422 naming the field; nothing is held.
    with pytest.raises(InvalidInput) as bad:
        trainer.reserve(
            dataset["id"], PureDpEvent(0.25), batches=[batch["id"]], release={"model": "", "version": 2}
        )
    assert bad.value.field == "release.model"
    assert admin.spend(dataset["id"])["epsilon_held"] == "0"


def test_client_dataset_defaults_fit_dp_sgd(ledger: tuple[str, dict[str, str]]) -> None:
    url, keys = ledger
    admin = client_for(url, keys["admin"])
    with pytest.raises(TypeError, match="delta"):
        admin.create_dataset("d", rule="sequential", epsilon="1")  # type: ignore[call-arg]
    dataset = admin.create_dataset("d", rule="sequential", epsilon="3", delta="1e-5")
    task = admin.create_task(dataset["id"], "t")
    admin.create_batches(dataset["id"], task["id"], [{"name": "b", "records": [f"r{i}" for i in range(10)]}])
    dp_sgd = SelfComposedEvent(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 1000)
    quote = admin.quote(dataset["id"], dp_sgd, tasks=[task["id"]])
    assert quote["admitted"] is True, quote["refused"]
