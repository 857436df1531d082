"""Staged runs: jobs that release one model version per *stage* (a task, a block of a stream),
each stage behind its own reservation (docs/ARCHITECTURE.md, "Release flow").

DP-SGD and AdaDp are one-reservation runs: the whole run is reserved on every batch and each
checkpoint is a progressive commit (``service.worker.gate``). The seed algorithms of the lifelong,
continual-release and pre-trained continual-learning papers read the data task by task or block by
block, and each rule charges what a stage reads differently:

* ``lifelong`` (L2DP-ML): stage τ reads task τ's batches (first perturbation: a charge that creates
  the job's ``noise_commitment`` on each batch) and the episodic memory's batches (the same
  commitment and the same event: a replay that costs 0).
* ``parallel`` (cosine classifier, PEFT ensemble, naive head): stage τ reads task τ's batches once.
* ``sequential`` (NaiveGaussian, the Full-Data baseline): every read is a charge.
* ``geometric`` (continual and sliding-window release): stage t reads the blocks of its release,
  at the level its event's ε best fits.

So a staged trainer states, **from the ledger's view alone** (tasks and batches, no data), the list
of stages: the batches each one reads and the event it spends on them. For every stage, in order,
the gate reserves ``stage.event`` on ``stage.batch_ids`` (with ``stage.noise_commitment``; named by
task when they are exactly whole tasks, so a stage may span more than 10 000 batches), and only
if the ledger grants it hands the trainer the records of exactly those batches; the trainer trains
and returns the candidate; the gate stages its artifact, commits the reservation with the release
``{model, version}`` and publishes the version. A refused reservation stops the job (``failed``
with the ledger's answer; versions already released stay released, their spend stays spent).

The data source is loaded once, after the first stage's reservation is granted, and checked
against the ledger: its records must be exactly the ledger's, and every ledger task must hold
exactly the records of one task of the source (a task of the source is a task of the ledger).
A stage's trainer call receives ``LoadedData.restrict(records of stage.batch_ids)`` and each
batch's record ids: records of batches the stage did not reserve never reach the training code.

Retries: a staged job whose worker died before releasing anything is run again from the start
(its reservations are aborted first). One that had released stages is failed ``not_resumable``:
the trainer's state between stages (models, episodic memory, sums) is not persisted, and replaying
the released stages would read their batches again. Its released versions and their spend stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from accountant.events import DpEvent

if TYPE_CHECKING:
    from service.training.data import LoadedData
    from service.training.dp_sgd import ModelState


@dataclass(frozen=True)
class LedgerBatch:
    """A batch as the ledger knows it before any data is read."""

    id: str
    task_id: str
    position: int
    size: int


@dataclass(frozen=True)
class LedgerTask:
    """A task of the dataset (``index``: its place in creation order) and its batches in
    position order."""

    id: str
    index: int
    name: str
    batches: tuple[LedgerBatch, ...]

    @property
    def batch_ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.batches)

    @property
    def size(self) -> int:
        return sum(b.size for b in self.batches)


@dataclass(frozen=True)
class Stage:
    """One release: reserve ``event`` on ``batch_ids`` (with ``noise_commitment`` when given),
    train on their records, commit, publish one version.

    ``index``: 1, 2, ... in order (the version's ``step`` in the registry); ``name``: for people
    ("task 3", "block 17, level 2"); ``info``: JSON-able facts the trainer wants back in the
    version's metrics (e.g. the task index, the geometric level it expects).
    """

    index: int
    name: str
    batch_ids: tuple[str, ...]
    event: DpEvent
    noise_commitment: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageRelease:
    """What a stage produced: the candidate's weights and its metrics (on held-out test data)."""

    model_state: ModelState
    metrics: Mapping[str, Any]


@runtime_checkable
class StagedTrainer(Protocol):
    """A trainer whose job releases one version per stage (module docstring).

    The gate calls ``parse_params`` and ``stages`` before any data is read, ``start`` once after
    the first reservation is granted and the source checked, then ``train_stage`` for each stage
    whose reservation was granted, in order. ``state`` is the trainer's own (models, episodic
    memory, sums so far); it never leaves the worker except through released versions.
    """

    def parse_params(self, params: Mapping[str, Any]) -> Any:
        """Validate the trainer's params (``InvalidParamsError`` naming the field)."""

    def stages(self, params: Any, tasks: Sequence[LedgerTask]) -> Sequence[Stage]:
        """The stages of the run, from the ledger's tasks and batches alone (no data)."""

    def start(self, params: Any, data: LoadedData, tasks: Sequence[LedgerTask]) -> Any:
        """The initial state. ``data`` holds the test splits and shapes but no training records
        (``restrict(())``): ``train_stage`` receives the ones each stage reserved."""

    def train_stage(
        self, state: Any, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        """Train stage ``stage`` on ``data``: the training records of ``stage.batch_ids`` only;
        ``records`` gives each of those batches' record ids (as the source names them)."""


def stage_steps(stage: Stage) -> int:
    """The training steps of one stage of a staged job, as its trainer states them in
    ``stage.info``: ``steps`` (DP-SGD heads, NaiveGaussian), else ``epochs`` passes over each of
    its batches (L2DP-ML), else one (a closed-form stage: class sums, private ERM)."""
    steps = stage.info.get("steps")
    if isinstance(steps, int) and steps >= 1:
        return steps
    epochs = stage.info.get("epochs")
    if isinstance(epochs, int) and epochs >= 1:
        return epochs * max(1, len(stage.batch_ids))
    return 1


__all__ = ["LedgerBatch", "LedgerTask", "Stage", "StageRelease", "StagedTrainer", "stage_steps"]
