"""The task plan and the accuracy matrix of a lifelong run, shared by the lifelong trainers
(L2DP-ML, its functional-mechanism form, the A-GEM and fine-tuning baselines).

Why its own module: which ledger tasks run, in which order, with which batch joining the
episodic memory (``make_plan``), and the accuracy matrix a_{τ,t} the released models are scored
by (``LifelongRecord``) are the same for every lifelong trainer; kept in ``l2dp_ml`` they made the
functional mechanism import L2DP-ML while L2DP-ML delegated to it (an import cycle, issue 29 §4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.contract.job_params import InvalidParamsError
from service.training.agem import average_accuracy, average_forgetting, choose_memory_batches
from service.training.data import LoadedData, TaskSplit
from service.training.stages import LedgerTask


@dataclass(frozen=True, slots=True)
class Plan:
    """Which ledger tasks run, in which order, for how many epochs, and which batch of each joins
    the episodic memory: fixed from params and the ledger's view alone."""

    order: tuple[LedgerTask, ...]
    epochs: tuple[int, ...]
    memory: tuple[str, ...]  # memory[i]: the batch of order[i] that joins after it

    def memory_before(self, position: int) -> tuple[str, ...]:
        return self.memory[:position]


def make_plan(
    tasks: Sequence[LedgerTask],
    *,
    task_order: tuple[int, ...] | None,
    epochs: int | tuple[int, ...],
    seed: int,
) -> Plan:
    """The run's plan (``InvalidParamsError`` naming ``task_order`` or ``epochs``)."""
    if task_order is None:
        order = list(tasks)
    else:
        if sorted(task_order) != list(range(len(tasks))):
            raise InvalidParamsError(
                "params.task_order",
                f"must be a permutation of the dataset's {len(tasks)} task indices 0..{len(tasks) - 1}. "
                f"Found {list(task_order)}.",
            )
        order = [tasks[i] for i in task_order]
    if isinstance(epochs, tuple):
        if len(epochs) != len(order):
            raise InvalidParamsError(
                "params.epochs",
                f"must give one epoch count per task ({len(order)} tasks). Found {list(epochs)}.",
            )
        per_task = epochs
    else:
        per_task = tuple(epochs for _ in order)
    memory = choose_memory_batches(seed, [t.batch_ids for t in order])
    return Plan(tuple(order), per_task, tuple(memory))


# ---------------------------------------------------------------------------------------------
# Lifelong bookkeeping: test splits of the tasks seen so far and the metrics
# ---------------------------------------------------------------------------------------------


@dataclass
class LifelongRecord:
    """The accuracy matrix a_{τ,t} of the released models (held-out test splits only)."""

    tests: dict[int, TaskSplit]
    seen: list[int] = field(default_factory=list)  # source task index of each learnt task
    accuracies: list[dict[int, float]] = field(default_factory=list)

    @classmethod
    def of(cls, data: LoadedData) -> LifelongRecord:
        return cls({split.task: split for split in data.test})

    def task_classes(self, task: int) -> np.ndarray:
        """The classes of ``task`` (those of its test split; all of the data's when it has none):
        what a multi-head, task-aware model chooses among."""
        split = self.tests.get(task)
        if split is None or len(split) == 0:
            return np.arange(max((int(s.labels.max()) for s in self.tests.values() if len(s)), default=0) + 1)
        return np.unique(split.labels)

    def evaluate_heads(self, scores: Callable[[np.ndarray], np.ndarray]) -> dict[str, Any]:
        """``evaluate`` of a single network read as a multi-head one: on each task the argmax of
        ``scores`` (logits, one column per class) among that task's classes only."""

        def predict(task: int, x: np.ndarray) -> np.ndarray:
            classes = self.task_classes(task)
            return np.asarray(classes[scores(x)[:, classes].argmax(axis=1)])

        return self.evaluate_tasks(predict)

    def learnt(self, data: LoadedData, current: Sequence[str]) -> int:
        """Note the task whose records ``current`` are (its source task index)."""
        wanted = set(current)
        found = {s.task for s in data.train if wanted.intersection(s.record_ids)}
        if len(found) != 1:
            raise RuntimeError(f"a task's batches must come from one source task. Found {sorted(found)}.")
        task = found.pop()
        self.seen.append(task)
        return task

    def evaluate(self, predict: Callable[[np.ndarray], np.ndarray]) -> dict[str, Any]:
        """a_{τ,t} for every learnt t (1-based), and the paper's metrics after task τ."""
        return self.evaluate_tasks(lambda task, x: predict(x))

    def evaluate_tasks(self, predict: Callable[[int, np.ndarray], np.ndarray]) -> dict[str, Any]:
        """``evaluate`` for a model that predicts knowing the task (``predict(source task, x)``:
        a multi-head model)."""
        row: dict[int, float] = {}
        for position, task in enumerate(self.seen, start=1):
            split = self.tests.get(task, self.tests.get(0))
            if split is None or len(split) == 0:
                row[position] = float("nan")
                continue
            row[position] = float(np.mean(predict(task, split.features) == split.labels))
        self.accuracies.append(row)
        tau = len(self.seen)
        metrics: dict[str, Any] = {
            "task_position": tau,
            "source_task": self.seen[-1],
            "test_accuracy": row[tau],
            "average_accuracy": average_accuracy(self.accuracies, tau),
            "accuracies": [row[t] for t in range(1, tau + 1)],
        }
        forgetting = average_forgetting(self.accuracies, tau)
        if forgetting is not None:
            metrics["average_forgetting"] = forgetting
        return metrics


__all__ = ["LifelongRecord", "Plan", "make_plan"]
