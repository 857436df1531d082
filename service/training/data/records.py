"""The records a loaded source holds, and the ledger check: ``TaskSplit`` (one task's ids,
features and labels), ``LoadedData`` (a source's train, test and public splits), ``RecordIndex``
(a task's rows by record id) and ``check_records`` (``RecordMismatchError`` unless the training
record ids are exactly the ledger's batches). Errors carry counts and batch ids, never a record id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from service.contract.data_sources import DataSourceError

_SAMPLE: Final = 5  # how many batch ids an error message names

FloatArray = npt.NDArray[np.float32]
LabelArray = npt.NDArray[np.int64]


IDENTITY: Final[Mapping[str, object]] = {
    "kind": "identity",
    "input": "the source's feature values as stored, flattened in row-major order",
}


class RecordMismatchError(DataSourceError):
    """The source's training record ids are not exactly the ledger's batches.

    ``missing``: how many records of the ledger's batches the source lacks, and
    ``missing_batches`` how many per ledger batch id (when known); ``unexpected``: how many of the
    source's training records are in no batch; ``duplicated``: how many record ids are named twice
    (in two batches, or twice in the source). Counts and batch ids only: a record id is private
    data, and an error that echoed them let a trainer learn another tenant's ids five at a time
    (issue 12 §1).
    """

    def __init__(
        self,
        uri: str,
        *,
        missing: int,
        unexpected: int,
        duplicated: int,
        missing_batches: Mapping[str, int] | None = None,
    ) -> None:
        parts = []
        batches = sorted((missing_batches or {}).items())
        if missing:
            shown = ", ".join(f"{n} of batch {b}" for b, n in batches[:_SAMPLE])
            more = f", … ({len(batches) - _SAMPLE} more batches)" if len(batches) > _SAMPLE else ""
            where = f" ({shown}{more})" if batches else ""
            parts.append(f"{missing} record(s) of the ledger's batches are not in the source{where}")
        if unexpected:
            parts.append(f"{unexpected} training record(s) of the source are in none of the ledger's batches")
        if duplicated:
            parts.append(f"{duplicated} record id(s) are named more than once")
        super().__init__(
            f"record ids of data source {uri!r} do not match the ledger's batches: "
            + "; ".join(parts)
            + ". Training was not started."
        )
        self.uri = uri
        self.missing = missing
        self.missing_batches = dict(batches)
        self.unexpected = unexpected
        self.duplicated = duplicated


@dataclass(frozen=True, slots=True, eq=False)
class TaskSplit:
    """The records of one task: ids, flat float32 features (n, d) and int64 labels (n,)."""

    task: int
    record_ids: tuple[str, ...]
    features: FloatArray
    labels: LabelArray

    def __post_init__(self) -> None:
        n = len(self.record_ids)
        if self.features.ndim != 2 or self.features.shape[0] != n or self.labels.shape != (n,):
            raise DataSourceError(
                f"task {self.task}: {n} record ids, features of shape {self.features.shape} and "
                f"labels of shape {self.labels.shape} do not line up."
            )

    def __len__(self) -> int:
        return len(self.record_ids)


@dataclass(frozen=True, slots=True, eq=False)
class LoadedData:
    """Training records per task (private, ledgered) and a held-out test split per task.

    ``num_classes`` is 10 for the built-ins; for files it is 1 + the largest label, which the
    private labels determine — a job that must not reveal it fixes ``params.num_classes``.
    """

    uri: str
    train: tuple[TaskSplit, ...]
    test: tuple[TaskSplit, ...]
    num_classes: int
    n_features: int
    image_shape: tuple[int, int, int] | None = None
    public: tuple[TaskSplit, ...] = ()
    """Records declared public (``&public=P``): in no task, never ledgered, kept by ``restrict``."""
    preprocessing: Mapping[str, object] = field(default_factory=lambda: dict(IDENTITY))
    """How the source's raw records became ``features`` (recorded with every model version, so
    that a loaded model is fed what it was trained on): ``{"kind": "identity"}`` (features as
    stored, flattened) or ``{"kind": "scale", "divide_by": d, ...}`` (raw values / d)."""

    @property
    def n_records(self) -> int:
        """How many training records (the ``n_records`` a training plan is made for)."""
        return sum(len(t) for t in self.train)

    @property
    def record_ids(self) -> tuple[str, ...]:
        return tuple(r for t in self.train for r in t.record_ids)

    def train_arrays(self) -> tuple[FloatArray, LabelArray]:
        """All tasks' training features and labels, concatenated in task order."""
        return _concat(self.train, self.n_features)

    def test_arrays(self) -> tuple[FloatArray, LabelArray]:
        """All tasks' test features and labels, concatenated in task order (may be empty)."""
        return _concat(self.test, self.n_features)

    def restrict(self, record_ids: Iterable[str]) -> LoadedData:
        """The same data with only the training records in ``record_ids`` (e.g. reserved batches),
        in source order. Raises ``RecordMismatchError`` for an id the source does not hold. Test
        splits are kept. (Restricting one source many times: ``RecordIndex``.)"""
        return RecordIndex(self).restrict(record_ids)


class RecordIndex:
    """Where each training record of ``data`` sits, found once, so that ``restrict`` takes time
    in the number of records asked for, not in the size of the source (a staged run restricts
    the source once per stage)."""

    def __init__(self, data: LoadedData) -> None:
        self.data = data
        self._where = {r: (i, row) for i, t in enumerate(data.train) for row, r in enumerate(t.record_ids)}

    def restrict(self, record_ids: Iterable[str]) -> LoadedData:
        """``data.restrict(record_ids)``."""
        rows: dict[int, list[int]] = {}
        missing: list[str] = []
        for record_id in set(record_ids):
            where = self._where.get(record_id)
            if where is None:
                missing.append(record_id)
            else:
                rows.setdefault(where[0], []).append(where[1])
        if missing:
            # ids asked for that the source lacks: the caller's (the ledger's), counted, not named
            raise RecordMismatchError(self.data.uri, missing=len(missing), unexpected=0, duplicated=0)
        tasks = []
        for i in sorted(rows):
            t = self.data.train[i]
            keep = np.sort(np.asarray(rows[i], dtype=np.int64))
            ids = tuple(t.record_ids[k] for k in keep)
            tasks.append(TaskSplit(t.task, ids, t.features[keep], t.labels[keep]))
        return replace(self.data, train=tuple(tasks))


def _concat(splits: Sequence[TaskSplit], n_features: int) -> tuple[FloatArray, LabelArray]:
    if not splits:
        return np.zeros((0, n_features), dtype=np.float32), np.zeros(0, dtype=np.int64)
    features = np.concatenate([s.features for s in splits]).astype(np.float32, copy=False)
    labels = np.concatenate([s.labels for s in splits]).astype(np.int64, copy=False)
    return features, labels


# ---------------------------------------------------------------------------------------------
# The ledger check
# ---------------------------------------------------------------------------------------------


def check_records(data: LoadedData, batches: Mapping[str, Collection[str]]) -> None:
    """Raise ``RecordMismatchError`` unless the training record ids are exactly the batches'.

    ``batches`` maps a ledger batch id to its record ids. Every record must be in exactly one
    batch and in the source once; the worker calls this before training, so a mismatch fails the
    job with nothing trained and nothing released.
    """
    in_batches: Counter[str] = Counter()
    for records in batches.values():
        in_batches.update(records)
    in_source = Counter(data.record_ids)
    duplicated = {r for r, c in in_batches.items() if c > 1} | {r for r, c in in_source.items() if c > 1}
    missing_batches = Counter(
        {batch_id: sum(1 for r in records if r not in in_source) for batch_id, records in batches.items()}
    )
    missing = len(in_batches.keys() - in_source.keys())
    unexpected = len(in_source.keys() - in_batches.keys())
    if missing or unexpected or duplicated:
        raise RecordMismatchError(
            data.uri,
            missing=missing,
            unexpected=unexpected,
            duplicated=len(duplicated),
            missing_batches={b: n for b, n in missing_batches.items() if n},
        )
