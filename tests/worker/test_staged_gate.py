"""Staged runs through the gate (service.training.stages): one reservation, commit and version per
task, on a real ledger (SQLite and PostgreSQL) over builtin:split-digits.

The trainer here is a small but genuine DP mechanism, not a stub: a nearest-centroid classifier
whose per-class sums of unit-normalised features are released with Gaussian noise (L2
sensitivity 1 under add/remove, noise multiplier ``NOISE``). What the tests check is the gate's
contract for staged runs:

* the source is opened only after the first reservation is granted, and each stage's trainer
  call sees exactly the records of the batches it reserved;
* a refused stage fails the job with the ledger's answer and the stage named; versions released
  before stay, nothing stays held;
* ledger tasks that are not the source's tasks fail the job before any training, and the error
  names no record id;
* a retried job that had released stages is failed ``not_resumable``; one that released nothing
  runs again from the start.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accountant import events as ev  # noqa: E402
from accountant.certificates import verify  # noqa: E402
from service.contract import job_params  # noqa: E402
from service.contract.job_params import JobParams  # noqa: E402
from service.db.base import utcnow  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import (  # noqa: E402
    certificates,
    jobs,
    spent,
)
from service.ledger.jobs.answers import JobDetail  # noqa: E402
from service.training import algorithms  # noqa: E402
from service.training.data import LoadedData  # noqa: E402
from service.training.stages import LedgerTask, Stage, StageRelease  # noqa: E402
from service.worker import gate  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import CountingLoader, source_tasks, task_dataset, versions_of  # noqa: E402

SOURCE = "builtin:split-digits?tasks=3"
NOISE = 4.0
ALGORITHM = "noisy_class_means"


def read_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's params declaration: it takes none (an unknown key is refused at submit)."""
    JobParams(params).finish()
    return {}


@dataclass
class NoisyClassMeans:
    """Stage τ releases the nearest-centroid classifier of the class sums over tasks 1..τ, each
    task's sums noised once (Gaussian, ``NOISE``) when its stage reads it."""

    device: str | None = None
    seen: list[tuple[int, frozenset[str]]] = field(default_factory=list)
    started_with: list[int] = field(default_factory=list)

    def parse_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return read_params(params)

    def stages(self, params: Mapping[str, Any], tasks: Sequence[LedgerTask]) -> list[Stage]:
        event = ev.GaussianEvent(noise_multiplier=NOISE)
        return [
            Stage(i + 1, f"task {task.name}", task.batch_ids, event, info={"task": task.index})
            for i, task in enumerate(tasks)
        ]

    def start(self, params: Mapping[str, Any], data: LoadedData, tasks: Sequence[LedgerTask]) -> Any:
        self.started_with.append(data.n_records)
        return {"sums": np.zeros((data.num_classes, data.n_features)), "test": data.test_arrays()}

    def train_stage(
        self, state: Any, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        self.seen.append((stage.index, frozenset(data.record_ids)))
        assert set(records) == set(stage.batch_ids)
        x, y = data.train_arrays()
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        sums = np.zeros_like(state["sums"])
        np.add.at(sums, y, x)
        rng = np.random.default_rng(stage.index)
        state["sums"] += sums + rng.normal(0.0, NOISE, size=sums.shape)
        centroids = state["sums"] / np.maximum(np.linalg.norm(state["sums"], axis=1, keepdims=True), 1e-12)
        test_x, test_y = state["test"]
        accuracy = float(np.mean(np.argmax(test_x @ centroids.T, axis=1) == test_y))
        return StageRelease({"centroids": torch.tensor(centroids)}, {"test_accuracy": accuracy})


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> Iterator[NoisyClassMeans]:
    """Register the trainer under ``ALGORITHM`` (the registry's own lookup builds it), with its
    params declaration (``create_job`` checks a job's params against it)."""
    instance = NoisyClassMeans()
    monkeypatch.setitem(algorithms.TRAINERS, ALGORITHM, f"{__name__}:_current")
    monkeypatch.setitem(job_params.PARAMS, ALGORITHM, read_params)
    monkeypatch.setattr(jobs.params, "ALGORITHMS", (*jobs.params.ALGORITHMS, ALGORITHM))
    monkeypatch.setitem(globals(), "_current", lambda device: instance)
    yield instance


def _dataset(
    db: Database, budget: Mapping[str, Any], *, mix_tasks: bool = False
) -> tuple[str, list[set[str]]]:
    """The source's tasks as ledger tasks (two batches each), on a dataset reading ``SOURCE``;
    ``mix_tasks`` swaps one record between the first two tasks, so that ledger tasks are not the
    source's."""
    per_task = source_tasks(SOURCE)
    if mix_tasks:
        per_task[0][0], per_task[1][0] = per_task[1][0], per_task[0][0]
    dataset_id, _ = task_dataset(db, budget, per_task, name="split-digits", source=SOURCE)
    return dataset_id, [set(ids) for ids in per_task]


def _budget(rule: str, epsilon: str) -> dict[str, Any]:
    return {"rule": rule, "epsilon": epsilon, "delta": "1e-5", "accountant": "rdp"}


def _run(db: Database, tmp_path: Path, dataset_id: str, loader: CountingLoader) -> JobDetail:
    job = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm=ALGORITHM, params={})
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=loader, device="cpu")
    assert worker.run_once() == job.id
    return jobs.queue.get_job(db, "acme", job.id)


@pytest.mark.slow
def test_parallel_stages_release_one_version_per_task_reading_only_their_batches(
    db: Database, tmp_path: Path, trainer: NoisyClassMeans
) -> None:
    dataset_id, per_task = _dataset(db, _budget("parallel", "2"))
    loader = CountingLoader()
    job = _run(db, tmp_path, dataset_id, loader)
    assert job.job.status == "succeeded", job.job.error
    assert loader.opened == [SOURCE]
    assert trainer.started_with == [0]  # start() sees no training record
    assert [(i, records) for i, records in trainer.seen] == [
        (1, per_task[0]),
        (2, per_task[1]),
        (3, per_task[2]),
    ]

    versions = versions_of(db, job.job.id)
    assert [(v.version, v.step, v.metrics["task"]) for v in versions] == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    charged = []
    for v in versions:
        body = certificates.get_certificate(db, "acme", v.certificate_id)["certificate"]
        assert verify(body).ok
        charged.append(Decimal(body["result"]["charge"]["epsilon"]))
    assert len(set(charged)) == 1 and charged[0] > 0  # the same mechanism on each task
    assert versions[-1].metrics["test_accuracy"] > 0.5

    # Parallel: the dataset's ε is one task's, not the sum; the job reports the same.
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert Decimal(answer["epsilon_spent"]) == charged[0]
    assert answer["epsilon_held"] == "0" and answer["reservations_open"] == 0
    assert Decimal(job.job.epsilon_committed) == charged[0]
    assert (job.job.progress_step, job.job.progress_total) == (3, 3)
    assert job.job.plan["kind"] == "staged" and job.job.plan["stages"] == 3


def test_a_refused_first_stage_reads_nothing(db: Database, tmp_path: Path, trainer: NoisyClassMeans) -> None:
    dataset_id, _ = _dataset(db, _budget("parallel", "0.01"))
    loader = CountingLoader()
    job = _run(db, tmp_path, dataset_id, loader)
    assert job.job.status == "failed"
    assert job.job.error["error"] == "budget_exceeded" and job.job.error["stage"] == 1
    assert loader.opened == [] and trainer.seen == []
    assert versions_of(db, job.job.id) == []


def test_a_refused_later_stage_keeps_what_was_released(
    db: Database, tmp_path: Path, trainer: NoisyClassMeans
) -> None:
    # Sequential with a budget that holds one read of a batch, not two: stages 1 and 2 read new
    # batches, stage 3 reads task t0's batches again and is refused.
    dataset_id, per_task = _dataset(db, _budget("sequential", "1.5"))
    original = trainer.stages

    def rereading(params: Mapping[str, Any], tasks: Sequence[LedgerTask]) -> list[Stage]:
        plan = original(params, tasks)
        return [*plan[:2], Stage(3, "task t0 again", tasks[0].batch_ids, plan[0].event)]

    trainer.stages = rereading  # type: ignore[method-assign]
    loader = CountingLoader()
    job = _run(db, tmp_path, dataset_id, loader)
    assert job.job.status == "failed", job
    assert job.job.error["error"] == "budget_exceeded" and job.job.error["stage"] == 3
    assert [v.step for v in versions_of(db, job.job.id)] == [1, 2]
    assert [i for i, _ in trainer.seen] == [1, 2]
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert answer["epsilon_held"] == "0" and answer["reservations_open"] == 0
    assert per_task  # the source's tasks were registered


def test_ledger_tasks_that_are_not_the_source_tasks_fail_before_training(
    db: Database, tmp_path: Path, trainer: NoisyClassMeans
) -> None:
    dataset_id, per_task = _dataset(db, _budget("parallel", "2"), mix_tasks=True)
    job = _run(db, tmp_path, dataset_id, CountingLoader())
    assert job.job.status == "failed"
    assert job.job.error["error"] == "record_mismatch" and job.job.error["field"] == "data_source"
    assert "task 't0' are not exactly one task of the source" in job.job.error["message"]
    shown = str(job.job.error)
    assert [r for ids in per_task for r in ids if r in shown] == []  # no record id in the error
    assert trainer.seen == [] and versions_of(db, job.job.id) == []
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert answer["epsilon_held"] == "0" and answer["epsilon_spent"] == "0"


@dataclass
class StopAfter:
    """A ``Control`` that says the lease was lost once stage ``stages + 1`` is trained (before
    its release): ``stages`` versions are released."""

    stages: int
    step: int = 0

    def should_stop(self) -> bool:
        return self.step > self.stages

    @property
    def reason(self) -> str | None:
        return "lease_lost" if self.should_stop() else None

    def lease_valid(self) -> bool:
        return not self.should_stop()

    def set_step(self, step: int) -> None:
        self.step = step


@pytest.mark.slow
@pytest.mark.parametrize(
    ("released_before", "second_error"), [(1, "not_resumable"), (0, "batch_already_read")]
)
def test_a_retry_resumes_no_job_whose_stage_read_the_data(
    db: Database, tmp_path: Path, trainer: NoisyClassMeans, released_before: int, second_error: str
) -> None:
    """The first attempt trains stage ``released_before + 1`` and loses its lease before
    releasing it. That stage read its batches: its abort charges it whole (issue 24 §2: the
    built-in worker refunds only what provably never ran), so on this ``parallel`` budget the
    retry cannot read them again; a job that released stages is not resumed either."""
    dataset_id, _ = _dataset(db, _budget("parallel", "2"))
    created = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm=ALGORITHM, params={})
    artifacts = tmp_path / "artifacts"
    claimed = jobs.leases.claim(db, "w1", 30.0)
    assert claimed is not None
    first = gate.run_job(
        db,
        claimed,
        control=StopAfter(released_before),
        artifact_dir=artifacts,
        reservation_ttl_s=60.0,
        loader=CountingLoader(),
    )
    assert first.status == "lease_lost" and len(first.versions) == released_before
    # the stage that trained and was not released is charged: nothing held, something spent
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert answer["epsilon_held"] == "0" and Decimal(answer["epsilon_spent"]) > 0
    aborted = [
        c for c in certificates.list_certificates(db, "acme", dataset_id)["data"] if c["outcome"] == "aborted"
    ]
    assert len(aborted) == 1 and aborted[0]["release"] is None

    retry = jobs.leases.claim(db, "w2", 30.0, now=utcnow() + timedelta(seconds=60))
    assert retry is not None and retry.attempt == 2
    second = gate.run_job(
        db,
        retry,
        control=StopAfter(10**6),
        artifact_dir=artifacts,
        reservation_ttl_s=60.0,
        loader=CountingLoader(),
    )
    job = jobs.queue.get_job(db, "acme", created.id)
    assert second.status == job.job.status == "failed", job
    assert job.job.error["error"] == second_error
    assert len(versions_of(db, created.id)) == released_before


def test_a_batch_added_to_a_stages_task_after_the_plan_fails_the_stage_unread(
    db: Database, tmp_path: Path, trainer: NoisyClassMeans, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage over whole tasks is reserved by task (issue 24), which would also take a batch
    added to the task after the plan: the reservation's count is checked, the job fails
    ``batches_changed`` before the source is opened, and nothing is charged or held."""
    from service.ledger import batches

    dataset_id, _ = _dataset(db, _budget("parallel", "2"))
    planned = trainer.stages

    def stages_then_a_new_batch(params: Mapping[str, Any], tasks: Sequence[LedgerTask]) -> list[Stage]:
        out = planned(params, tasks)
        batches.create_batches(
            db, "acme", dataset_id, tasks[0].id, batches=[{"name": "late", "records": ["late-record"]}]
        )
        return out

    monkeypatch.setattr(trainer, "stages", stages_then_a_new_batch)
    loader = CountingLoader()
    job = _run(db, tmp_path, dataset_id, loader)
    assert job.job.status == "failed"
    assert job.job.error["error"] == "batches_changed" and job.job.error["stage"] == 1
    assert loader.opened == [] and trainer.seen == []
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert answer["epsilon_held"] == "0" and answer["epsilon_spent"] == "0"
