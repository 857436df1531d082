"""The release gate (service.worker.gate) end to end: real ledger, real databases (SQLite and
PostgreSQL), real torch training on builtin:digits (tiny models), real files.

* DP-SGD at ε = 2, δ = 1e-5 trains, releases versions at checkpoints, each certificate
  re-verifies, commits are monotone, test accuracy is recorded; a second job that needs more than
  what remains fails with the ledger's budget_exceeded details, with no data read, no version.
* Cancel mid-run aborts the rest of the reservation; a refused commit destroys the candidate;
  record ids that do not match the ledger's batches fail the job before training, and the error
  gives counts and batch ids, never a record id; AdaDp runs through the same gate.
* The job reads its dataset's own source (``builtin:digits`` here; a ``file://`` source only
  under the data roots the worker's loader is given).
"""

from __future__ import annotations

import hashlib
import threading
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from accountant.certificates import verify  # noqa: E402
from service.contract.data_roots import DataRoots  # noqa: E402
from service.db.base import utcnow  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import certificates, datasets, jobs, reservations, spent  # noqa: E402
from service.ledger import model_registry as registry  # noqa: E402
from service.ledger.errors import InvalidInput  # noqa: E402
from service.ledger.quotes import Quote  # noqa: E402
from service.ledger.reservations import parse_event  # noqa: E402
from service.training.l2dp_ml import L2dpMlTrainer  # noqa: E402
from service.training.nets import load_state  # noqa: E402
from service.worker import gate  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import (  # noqa: E402
    DIGITS,
    CountingLoader,
    digits_dataset,
    digits_train_ids,
    reservation,
    staged_files,
    versions_of,
)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    return tmp_path / "artifacts"


def _worker(db: Database, artifact_dir: Path, loader: CountingLoader, **kwargs: Any) -> Worker:
    return Worker(db, artifact_dir=artifact_dir, loader=loader, device="cpu", **kwargs)


def _queue(db: Database, dataset_id: str, algorithm: str = "dp_sgd", **params: Any) -> str:
    answer = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm=algorithm, params=params)
    return str(answer.id)


def reservations_quote(db: Database, dataset_id: str, event: dict[str, Any]) -> Quote:
    from service.ledger import quotes

    return quotes.quote(db, "acme", dataset_id, event=parse_event(event), new_batch=True).quote


def _certified_epsilons(db: Database, versions: list[Any]) -> list[Decimal]:
    out = []
    for v in versions:
        answer = certificates.get_certificate(db, "acme", v.certificate_id)
        body = answer["certificate"]
        check = verify(body)
        assert check.ok, check.reason
        assert body["release"] == {
            "model": v.name,
            "version": v.version,
            "artifact_sha256": v.artifact_sha256,
        }
        out.append(Decimal(body["result"]["charge"]["epsilon"]))
    return out


def test_dp_sgd_job_releases_certified_versions_then_a_second_job_is_refused_unread(
    db: Database, artifacts: Path
) -> None:
    world = digits_dataset(db, epsilon="3", delta="1e-5")
    loader = CountingLoader()
    worker = _worker(db, artifacts, loader)
    job_id = _queue(db, world.dataset_id, target_epsilon=2.0, delta=1e-5, checkpoint_every=100, seed=7)

    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert (job.job.progress_step, job.job.progress_total) == (225, 225)
    assert loader.opened == [DIGITS]

    # Versions 1..3 at steps 100, 200 and the end; every one certified, commits monotone.
    versions = versions_of(db, job_id)
    assert [(v.version, v.step) for v in versions] == [(1, 100), (2, 200), (3, 225)]
    epsilons = _certified_epsilons(db, versions)
    assert epsilons == sorted(epsilons) and epsilons[0] < epsilons[-1]
    assert Decimal(job.job.epsilon_committed) == epsilons[-1]
    assert job.job.plan["event"]["count"] == 225

    # The released model is useful, and its accuracy is recorded with the version.
    final = versions[-1]
    assert final.metrics["test_accuracy"] > 0.8
    assert job.job.metrics["test_accuracy"] == pytest.approx(final.metrics["test_accuracy"])

    # Its artifact is the committed model: hash as recorded, loadable, the MLP's weights.
    path = artifacts / final.artifact_path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == final.artifact_sha256
    state = load_state(path.read_bytes(), final.artifact_format)  # safetensors where installed
    assert {k: tuple(t.shape) for k, t in state.items()}["net.1.weight"] == (64, 64)
    assert staged_files(artifacts) == []

    # The whole reservation is spent, nothing is held.
    closed = reservation(db, job.job.reservation_id)
    assert closed.status == "committed" and closed.commits == 3
    before = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert before["epsilon_held"] == "0" and before["reservations_open"] == 0

    # A second job needs more than what remains: refused before its data source is opened.
    second = _queue(db, world.dataset_id, target_epsilon=2.0, delta=1e-5, seed=8)
    assert worker.run_once() == second
    refused = jobs.queue.get_job(db, "acme", second)
    assert refused.job.status == "failed"
    error = refused.job.error
    assert error["error"] == "budget_exceeded" and error["field"] == "params.target_epsilon"
    assert Decimal(error["requested"]["epsilon"]) > Decimal(error["remaining"]["epsilon"])
    assert 0 < error["largest_target_epsilon"] < 2  # what would fit, named
    assert loader.opened == [DIGITS]  # not opened again
    assert versions_of(db, second) == [] and refused.job.reservation_id is None
    after = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert after["epsilon_spent"] == before["epsilon_spent"] and after["epsilon_held"] == "0"
    assert staged_files(artifacts) == []


@pytest.mark.slow
def test_target_budget_epsilon_is_calibrated_to_what_the_dataset_charges(
    db: Database, artifacts: Path
) -> None:
    """``target_epsilon: 2`` on an rdp budget of ε = 2 was refused ("requested 2.3485": σ came
    from the RDP accountant, the budget's Rényi filter charges more). Calibrating to the budget's
    increase is the explicitly named ``target_budget_epsilon``: σ is calibrated to the dataset's
    own quote, the run fits and is charged at most 2, with a σ no larger than needed."""
    from accountant.calibration import calibrate_noise_multiplier

    world = digits_dataset(db, epsilon="2", delta="1e-5")
    worker = _worker(db, artifacts, CountingLoader())
    job_id = _queue(db, world.dataset_id, target_budget_epsilon=2.0, delta=1e-5, seed=3)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    assert Decimal("1.9") < Decimal(job.job.epsilon_committed) <= 2
    event = job.job.plan["event"]
    sigma = event["event"]["event"]["noise_multiplier"]
    q, steps = event["event"]["sampling_probability"], event["count"]
    plain = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sampling_probability=q, steps=steps)
    assert sigma > plain  # more noise than the accountant alone asks: the filter's δ split
    lighter = dict(
        event, event=dict(event["event"], event={"kind": "gaussian", "noise_multiplier": sigma - 1e-3})
    )
    quoted = reservations_quote(db, world.dataset_id, lighter)
    assert quoted.epsilon > 0 and not quoted.admitted


@pytest.mark.slow
def test_target_epsilon_is_the_runs_own_epsilon_and_one_that_cannot_fit_is_refused_unread(
    db: Database, artifacts: Path
) -> None:
    """Issue 24 §3: ``target_epsilon`` is the run's own ε at the budget's δ by the tight
    engine (since issue 25 §3 the ledger's own price of the run alone), as Opacus users mean it.
    A run of ε = 2 cannot fit an rdp budget of 2 (the
    filter charges it about 2.3): refused before anything is reserved or read, naming the largest
    target that fits; that target then runs, its own ε above dp-accounting's optimistic PLD."""
    from dp_accounting.pld import privacy_loss_distribution

    from accountant.calibration import tight_epsilon
    from accountant.events import from_json

    world = digits_dataset(db, epsilon="2", delta="1e-5")
    loader = CountingLoader()
    worker = _worker(db, artifacts, loader)
    too_big = _queue(db, world.dataset_id, target_epsilon=2.0, seed=3)  # δ: the budget's
    assert worker.run_once() == too_big
    refused = jobs.queue.get_job(db, "acme", too_big)
    assert refused.job.status == "failed" and refused.job.reservation_id is None
    error = refused.job.error
    assert error["error"] == "budget_exceeded" and error["field"] == "params.target_epsilon"
    assert "largest target_epsilon that fits" in error["message"]
    largest = error["largest_target_epsilon"]
    assert 1.5 < largest < 2
    assert loader.opened == []  # nothing read
    assert spent.get_spend(db, "acme", world.dataset_id).to_json()["epsilon_spent"] == "0"
    # The named target fits, and a little more does not (it is the largest, to about 0.1%).
    fits = _queue(db, world.dataset_id, target_epsilon=largest, seed=3)
    assert worker.run_once() == fits
    job = jobs.queue.get_job(db, "acme", fits)
    assert job.job.status == "succeeded", job.job.error
    assert loader.opened == [DIGITS]
    assert 0 < Decimal(job.job.epsilon_committed) <= 2
    event = from_json(job.job.plan["event"])
    assert largest * 0.999 <= tight_epsilon(event, 1e-5) <= largest  # its own ε, σ not too large
    sigma = job.job.plan["noise_multiplier"]
    q, steps = job.job.plan["sampling_probability"], job.job.plan["steps"]
    # The run's own ε is the ledger's engine's (issue 25 §3), a valid bound: dp-accounting's
    # optimistic PLD of the same run (a lower bound on the true ε) is below it.
    optimistic = (
        privacy_loss_distribution.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            value_discretization_interval=1e-3,
            pessimistic_estimate=False,
            use_connect_dots=False,
        )
        .self_compose(steps)
        .get_epsilon_for_delta(1e-5)
    )
    assert optimistic <= tight_epsilon(event, 1e-5)
    bigger = _queue(db, world.dataset_id, target_epsilon=round(largest * 1.01, 4), seed=3)
    assert worker.run_once() == bigger
    assert jobs.queue.get_job(db, "acme", bigger).job.error["error"] == "budget_exceeded"


@pytest.mark.slow
def test_cancel_mid_run_aborts_the_rest_and_keeps_what_was_committed(db: Database, artifacts: Path) -> None:
    world = digits_dataset(db, epsilon="10")
    worker = _worker(db, artifacts, CountingLoader(), lease_s=30, heartbeat_s=0.05)
    job_id = _queue(
        db,
        world.dataset_id,
        noise_multiplier=2.0,
        sampling_probability=0.01,
        steps=20_000,
        checkpoint_every=50,
        hidden=8,
        seed=1,
    )
    thread = threading.Thread(target=worker.run_once)
    thread.start()
    deadline = time.monotonic() + 60
    while not versions_of(db, job_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    jobs.queue.cancel_job(db, "acme", job_id)
    thread.join(timeout=60)
    assert not thread.is_alive()

    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "cancelled", job.job.error
    versions = versions_of(db, job_id)
    assert versions and job.job.progress_step < 20_000
    epsilons = _certified_epsilons(db, versions)
    assert epsilons == sorted(epsilons)
    assert [v.version for v in versions] == list(range(1, len(versions) + 1))

    held = reservation(db, job.job.reservation_id)
    assert held.status == "aborted"
    # Steps begun after the last release ran on the data: the abort charges that prefix (issue
    # 24 §2, as the ledger prices it) and returns only the steps never begun.
    aborted = [
        c
        for c in certificates.list_certificates(db, "acme", world.dataset_id)["data"]
        if c["outcome"] == "aborted"
    ]
    if aborted:
        (charged,) = aborted
        prefix = charged["certificate"]["inputs"]["partial_event"]
        assert versions[-1].step < prefix["count"] < 20_000 and prefix == {
            **held.event,
            "count": prefix["count"],
        }
        priced = reservations_quote(db, world.dataset_id, prefix).epsilon
        assert held.committed_epsilon == priced > epsilons[-1]
        assert verify(charged["certificate"]).ok and charged["release"] is None
    else:  # cancelled exactly at a release: nothing ran beyond it
        assert held.committed_epsilon == epsilons[-1]
    assert held.committed_epsilon < held.epsilon  # the steps never begun went back
    ledger = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert ledger["epsilon_held"] == "0" and ledger["reservations_open"] == 0
    assert Decimal(ledger["epsilon_spent"]) == held.committed_epsilon
    # Only committed steps are reported: the metrics are those of the last release.
    assert job.job.metrics == versions[-1].metrics
    assert staged_files(artifacts) == []


def test_a_refused_commit_destroys_the_candidate(db: Database, artifacts: Path) -> None:
    """The reservation expires while the data loads (a real TTL): the first commit is refused,
    its staged candidate deleted, nothing published. The expiry charges the whole reservation:
    a hold that outlives its TTL is charged what could have run (issue 24 §2)."""
    world = digits_dataset(db, epsilon="10")
    loader = CountingLoader(delay_s=1.0)
    worker = _worker(db, artifacts, loader, reservation_ttl_s=0.5)
    job_id = _queue(db, world.dataset_id, noise_multiplier=1.5, steps=20, checkpoint_every=10, seed=2)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed"
    assert job.job.error["error"] == "reservation_expired"
    assert versions_of(db, job_id) == [] and job.job.metrics is None
    assert staged_files(artifacts) == []
    assert not any(p.is_file() for p in artifacts.rglob("*"))  # no version file either
    ledger = spent.get_spend(db, "acme", world.dataset_id).to_json()
    held = reservation(db, job.job.reservation_id)
    assert held.status == "expired" and held.committed_epsilon == held.epsilon
    assert Decimal(ledger["epsilon_spent"]) == held.epsilon and ledger["epsilon_held"] == "0"


def test_records_that_do_not_match_the_batches_fail_before_training(db: Database, artifacts: Path) -> None:
    ids = list(digits_train_ids())
    ledgered = [*ids[:-3], "not-in-the-source"]  # the source's last 3 are in no batch
    world = digits_dataset(db, records=ledgered, epsilon="10")
    worker = _worker(db, artifacts, CountingLoader())
    job_id = _queue(db, world.dataset_id, noise_multiplier=1.5, steps=20, seed=3)
    assert worker.run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "failed"
    error = job.job.error
    assert error["error"] == "record_mismatch" and error["field"] == "data_source"
    # Counts and batch ids: the one ledgered record the source lacks is in the second batch.
    message = error["message"]
    lacking = f"1 record(s) of the ledger's batches are not in the source (1 of batch {world.batch_ids[1]})"
    assert lacking in message
    assert "3 training record(s) of the source are in none of the ledger's batches" in message
    assert "named more than once" not in message
    # ... and no record id, of the source or of the ledger, anywhere in the job's error.
    shown = str(error)
    assert [r for r in {*ids, *ledgered} if r in shown] == []
    assert job.job.progress_step == 0 and versions_of(db, job_id) == []
    assert reservation(db, job.job.reservation_id).status == "aborted"
    ledger = spent.get_spend(db, "acme", world.dataset_id).to_json()
    assert ledger["epsilon_spent"] == "0" and ledger["epsilon_held"] == "0"


def test_invalid_trainer_params_are_refused_at_submit_naming_the_field(db: Database, artifacts: Path) -> None:
    world = digits_dataset(db, epsilon="10")
    loader = CountingLoader()
    with pytest.raises(InvalidInput) as refused:
        _queue(db, world.dataset_id, noise_multiplier=1.5, steps=20, epoch=3)
    assert refused.value.field == "params.epoch"
    # Nothing was queued: no worker runs it, no source is opened, nothing is held.
    assert jobs.queue.list_jobs(db, "acme").count == 0
    assert _worker(db, artifacts, loader).run_once() is None
    assert loader.opened == []
    assert spent.get_spend(db, "acme", world.dataset_id).to_json()["reservations_open"] == 0


@pytest.mark.slow
def test_adadp_job_runs_through_the_gate(db: Database, artifacts: Path) -> None:
    world = digits_dataset(db, epsilon="3")
    job_id = _queue(
        db, world.dataset_id, algorithm="adadp", target_epsilon=2.0, delta=1e-5, checkpoint_every=150, seed=4
    )
    assert _worker(db, artifacts, CountingLoader()).run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded", job.job.error
    versions = versions_of(db, job_id)
    assert [v.step for v in versions] == [150, 225]
    epsilons = _certified_epsilons(db, versions)
    assert epsilons == sorted(epsilons)
    metrics = job.job.metrics
    assert metrics["lemma1_checked_steps"] == 225
    assert metrics["lemma1_max_ratio"] <= metrics["lemma1_limit"] * (1 + 1e-12)
    assert versions[-1].metrics["test_accuracy"] > 0.3
    assert job.job.plan["algorithm"] == "adadp"


def test_a_run_released_in_full_is_not_trained_again_after_its_worker_died(
    db: Database, artifacts: Path
) -> None:
    """The dead worker committed and published its last version, then died before finishing the
    job: the next worker finishes it ``succeeded`` without reading data or reserving again."""
    world = digits_dataset(db, records=[f"r{i}" for i in range(4)], n_batches=1, epsilon="10")
    job_id = _queue(db, world.dataset_id, noise_multiplier=5.0, steps=2, model_name="m")
    dead = jobs.leases.claim(db, "dead", 1, now=utcnow() - timedelta(minutes=1))
    assert dead is not None
    event = {"kind": "gaussian", "noise_multiplier": 5.0}
    held = reservations.reserve(
        db, "acme", world.dataset_id, event=parse_event(event), batch_ids=list(world.batch_ids)
    ).to_json()
    jobs.leases.record_reservation(db, dead.lease, held["id"])
    staged = registry.stage(
        artifacts,
        tenant_id="acme",
        name="m",
        version=1,
        job_id=job_id,
        attempt=1,
        dataset_id=world.dataset_id,
        step=2,
        metrics={"test_accuracy": 0.9, "step": 2},
        fmt="torch",
        write=lambda handle: handle.write(b"weights"),
    )
    answer = reservations.commit(db, "acme", held["id"], release={"model": "m", "version": 1}).to_json()
    registry.publish(db, artifacts, staged, certificate_id=answer["certificate"]["id"])

    loader = CountingLoader()
    assert _worker(db, artifacts, loader).run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert job.job.status == "succeeded" and job.job.attempts == 2
    assert job.job.reservation_id == held["id"] and job.job.metrics["test_accuracy"] == 0.9
    assert Decimal(job.job.epsilon_committed) > 0 and job.job.progress_step == 2
    assert loader.opened == [] and [v.version for v in versions_of(db, job_id)] == [1]


def test_an_unreadable_data_source_fails_the_job_and_frees_the_hold(
    db: Database, artifacts: Path, tmp_path: Path
) -> None:
    """The dataset's file source was there when the admin set it (under the data root), and is
    gone when the worker reads it."""
    root = tmp_path / "data"
    root.mkdir()
    roots = DataRoots({"*": [str(root)]})
    source = root / "missing.npz"
    source.write_bytes(b"")
    world = digits_dataset(db, epsilon="10", source=None)
    uri = f"file://{source}"
    datasets.set_data_source(db, "acme", world.dataset_id, data_source=uri, data_roots=roots)
    job_id = _queue(db, world.dataset_id, noise_multiplier=1.5, steps=5)
    source.unlink()
    loader = CountingLoader(roots=roots)
    assert _worker(db, artifacts, loader).run_once() == job_id
    job = jobs.queue.get_job(db, "acme", job_id)
    assert loader.opened == [uri]
    assert job.job.status == "failed" and job.job.error["error"] == "data_source"
    assert job.job.error["field"] == "data_source"
    assert "missing.npz" in job.job.error["message"] and "no such file" in job.job.error["message"]
    assert reservation(db, job.job.reservation_id).status == "aborted"
    assert spent.get_spend(db, "acme", world.dataset_id).to_json()["epsilon_held"] == "0"


def test_a_record_id_in_a_trainers_exception_never_reaches_the_failure_message(db: Database) -> None:
    """No trainer raises a record id through the gate on a consistent source, so the exception is
    raised for real by a trainer given a record its data lacks: L2DP-ML looks each record of its
    batches up by id and raises ``KeyError('<the id>')``. ``gate.failure_message`` (what the gate
    puts in the job's error and the worker's log) withholds a message this project did not write,
    and masks the source's record ids in one it did."""
    world = digits_dataset(db, epsilon="10")
    uri = datasets.data_source(db, "acme", world.dataset_id)
    assert uri == DIGITS
    data = CountingLoader()(uri, "acme")
    of_batch = gate.check_source_records(db, world.dataset_id, data)
    tasks = gate.ledger_tasks(db, world.dataset_id)
    trainer = L2dpMlTrainer(device="cpu")
    params = trainer.parse_params({"epsilon1": 4.0, "epsilon2": 2.0, "input_dim": 64, "seed": 1})
    (stage,) = trainer.stages(params, tasks)
    state = trainer.start(params, data.restrict(()), tasks)
    records = {batch_id: tuple(of_batch[batch_id]) for batch_id in stage.batch_ids}
    lost = records[world.batch_ids[1]][17]
    with pytest.raises(KeyError) as raised:
        trainer.train_stage(state, stage, data.restrict(r for r in data.record_ids if r != lost), records)
    assert lost in str(raised.value)  # the raw message names the record

    message = gate.failure_message(raised.value, data.record_ids)
    assert message.startswith("KeyError raised at service/training/l2dp_ml.py:")
    assert "withheld" in message and lost not in message

    class OwnError(ValueError):  # a message of ours that (by mistake) quotes two ids
        __module__ = "service.worker.example"

    ours = gate.failure_message(
        OwnError(f"batch lacks {lost!r} and x/{data.record_ids[3]}."), data.record_ids
    )
    assert ours.startswith("OwnError: batch lacks '<record id>' and x/<record id>.")
    assert [r for r in data.record_ids if r in ours] == []
