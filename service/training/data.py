"""Loading data sources: the records a source's URI names, read only when called, and the check
that a source's training record ids are exactly the ledger's batches. numpy only: no torch here.

What a URI may be, and how it is stored, is the server's contract
(``service.contract.data_sources``: ``parse_source``, ``DataSource``); where a file may live and
the checks made as it is opened are ``service.contract.data_roots`` (``TenantRoots``,
``read_file``). ``load(source, roots)`` reads the records, and the worker calls it only after the
ledger granted the reservation (the release flow, docs/ARCHITECTURE.md, reserves a run's cost
*before* the worker reads private data); ``load_data(uri, roots)`` parses and loads in one call.

Errors carry no data: a loading error names the line, the column and the rule, never a cell's
contents; ``RecordMismatchError`` gives counts and ledger batch ids, never a record id.

Privacy notes
-------------
Only the training records are private and ledgered: ``check_records`` compares the training
record ids with the ledger's batches. Test splits are held-out evaluation data (public, or
released only through accuracy numbers the operator accepts); they carry no ledger charge.
Every task of a built-in stream holds *different* records, so parallel composition over tasks
is honest: no image appears in two tasks under two record ids. A public split (``&public=P``)
holds records of no task: they are outside the ledger and carry no privacy guarantee at all.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import zipfile
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Final, TypeVar

import numpy as np
import numpy.typing as npt

from service.contract.data_roots import TenantRoots, read_file
from service.contract.data_sources import (
    SYNTHETIC_BUILTINS,
    DataSource,
    DataSourceError,
    SourceLocationError,
    parse_source,
)

if TYPE_CHECKING:
    from service.client import LedgerClient

DIGITS_TEST_SIZE: Final = 360
DIGITS_SPLIT_SEED: Final = 20_240_611
DIGITS_IMAGE_SHAPE: Final = (1, 8, 8)
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
# Loading a source
# ---------------------------------------------------------------------------------------------

PUBLIC_SPLIT_STREAM: Final = 0x7075626C  # "publ": the public draw's own seed stream


def load(source: DataSource, roots: TenantRoots | None = None) -> LoadedData:
    """Read the records. Call only after the ledger granted the run's reservation.

    A file source is read only through ``roots`` (the dataset's tenant's data roots), and
    checked again as it is opened (``service.contract.data_roots.read_file``)."""
    if source.path is not None:
        if roots is None:
            raise SourceLocationError(
                f"data source {source.uri!r}: a file is read only under the tenant's data roots, "
                "and none were given."
            )
        content = read_file(source, roots)
        if source.kind == "npz":
            return _load_npz(source.uri, content, roots.max_bytes)
        return _load_csv(source.uri, content)
    if source.kind == "stream":
        return _load_stream(source.uri, source.blocks, source.block_size, source.dim, source.seed)
    if source.kind in SYNTHETIC_BUILTINS:
        return _load_synthetic_digits(
            source.uri, source.kind, source.tasks, source.per_task, source.seed, source.public
        )
    return _load_digits(
        source.uri, source.kind, source.tasks, source.seed, source.public, source.public_classes
    )


def load_data(uri: str, roots: TenantRoots | None = None) -> LoadedData:
    """``load(parse_source(uri), roots)``: validate and read in one call."""
    return load(parse_source(uri), roots)


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


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def _build(
    uri: str,
    ids: Sequence[str],
    features: npt.NDArray[np.floating],
    labels: npt.NDArray[np.integer],
    tasks: npt.NDArray[np.integer],
    test: tuple[npt.NDArray[np.floating], npt.NDArray[np.integer]] | None,
    image_shape: tuple[int, int, int] | None,
) -> LoadedData:
    n = len(ids)
    if n == 0:
        raise DataSourceError(f"data source {uri!r} holds no training records.")
    if features.shape[0] != n or labels.shape != (n,) or tasks.shape != (n,):
        raise DataSourceError(
            f"data source {uri!r}: {n} record ids, features {features.shape}, labels {labels.shape} "
            f"and tasks {tasks.shape} do not line up."
        )
    repeated = sum(1 for c in Counter(ids).values() if c > 1)
    if repeated:  # counted, never named: a record id is private data
        raise DataSourceError(f"data source {uri!r}: {repeated} record_id value(s) occur more than once.")
    flat = np.ascontiguousarray(features.reshape(n, -1), dtype=np.float32)
    if not np.isfinite(flat).all():
        raise DataSourceError(f"data source {uri!r}: features must be finite (found NaN or inf).")
    if (labels < 0).any() or (tasks < 0).any():
        raise DataSourceError(f"data source {uri!r}: label and task must be integers >= 0.")
    test_x = np.zeros((0, flat.shape[1]), dtype=np.float32)
    test_y = np.zeros(0, dtype=np.int64)
    if test is not None:
        test_x = np.ascontiguousarray(test[0].reshape(test[0].shape[0], -1), dtype=np.float32)
        test_y = test[1].astype(np.int64)
        if test_x.shape[1] != flat.shape[1] or test_y.shape != (test_x.shape[0],):
            raise DataSourceError(
                f"data source {uri!r}: test features {test_x.shape} and labels {test_y.shape} do not "
                f"match {flat.shape[1]} training features."
            )
        if not np.isfinite(test_x).all() or (test_y < 0).any():
            raise DataSourceError(f"data source {uri!r}: test features must be finite and labels >= 0.")
    num_classes = int(max(labels.max(), test_y.max() if test_y.size else 0)) + 1
    d = flat.shape[1]
    if image_shape is None and math.isqrt(d) ** 2 == d:
        image_shape = (1, math.isqrt(d), math.isqrt(d))
    train = []
    for t in np.unique(tasks):
        mask = tasks == t
        train.append(
            TaskSplit(
                int(t),
                tuple(r for r, m in zip(ids, mask, strict=True) if m),
                flat[mask],
                labels[mask].astype(np.int64),
            )
        )
    test_splits = (
        (TaskSplit(0, tuple(f"test-{i}" for i in range(len(test_y))), test_x, test_y),) if len(test_y) else ()
    )
    return LoadedData(
        uri=uri,
        train=tuple(train),
        test=test_splits,
        num_classes=max(num_classes, 2),
        n_features=d,
        image_shape=image_shape,
    )


def _integer_array(uri: str, name: str, values: npt.NDArray[np.generic]) -> npt.NDArray[np.int64]:
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind == "f":
        floats = values.astype(np.float64)
        if np.isfinite(floats).all() and (floats == np.round(floats)).all():
            return floats.astype(np.int64)
    raise DataSourceError(f"data source {uri!r}: {name} must hold integers. Found dtype {values.dtype}.")


def _image_shape(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    if len(shape) == 3:
        return (1, shape[1], shape[2])
    if len(shape) == 4:
        return (shape[1], shape[2], shape[3])
    return None


def _npz_arrays(uri: str, content: bytes, max_bytes: int) -> dict[str, npt.NDArray[np.generic]]:
    """The arrays of an ``.npz`` held in ``content``, refusing one whose arrays would take more
    than ``max_bytes`` uncompressed (a small compressed file can inflate without bound) or whose
    ``.npy`` header claims more elements than its member holds (numpy would allocate them first).
    Errors name the member and the rule, never what the archive holds."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(content))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DataSourceError(
            f"data source {uri!r}: not a readable .npz file ({type(exc).__name__})."
        ) from None
    with archive:
        members = archive.infolist()
        total = sum(m.file_size for m in members)
        if total > max_bytes:
            raise SourceLocationError(
                f"data source {uri!r}: its arrays hold {total} bytes uncompressed, more than "
                f"LEDGER_MAX_SOURCE_BYTES = {max_bytes}."
            )
        arrays: dict[str, npt.NDArray[np.generic]] = {}
        for member in members:
            name = member.filename.removesuffix(".npy")
            try:
                with archive.open(member) as handle:
                    version = np.lib.format.read_magic(handle)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(handle)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(handle)
                    if math.prod(shape) * dtype.itemsize > member.file_size:
                        raise DataSourceError(
                            f"data source {uri!r}: array {name[:40]!r} claims more data than it holds."
                        )
                with archive.open(member) as handle:
                    arrays[name] = np.asarray(np.lib.format.read_array(handle, allow_pickle=False))
            except DataSourceError:
                raise
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError) as exc:
                # (numpy's messages can quote the header: name the type only)
                raise DataSourceError(
                    f"data source {uri!r}: array {name[:40]!r} is not a readable .npy array "
                    f"({type(exc).__name__})."
                ) from None
    return arrays


def _load_npz(uri: str, content: bytes, max_bytes: int) -> LoadedData:
    arrays = _npz_arrays(uri, content, max_bytes)

    def pick(*names: str, required: bool = True) -> npt.NDArray[np.generic] | None:
        for name in names:
            if name in arrays:
                return arrays[name]
        if required:
            raise DataSourceError(
                f"data source {uri!r}: the archive needs an array {' or '.join(map(repr, names))}."
            )
        return None

    ids_raw = pick("record_id")
    features = pick("X", "features")
    labels_raw = pick("y", "label")
    assert ids_raw is not None and features is not None and labels_raw is not None
    if features.dtype.kind not in "fiu":
        raise DataSourceError(f"data source {uri!r}: features must be numeric. Found dtype {features.dtype}.")
    ids = [x.decode() if isinstance(x, bytes) else str(x) for x in ids_raw.reshape(-1).tolist()]
    labels = _integer_array(uri, "label", labels_raw.reshape(-1))
    task_raw = pick("task", required=False)
    tasks = (
        _integer_array(uri, "task", task_raw.reshape(-1))
        if task_raw is not None
        else np.zeros(len(ids), np.int64)
    )
    test_x = pick("test_X", "test_features", required=False)
    test_y = pick("test_y", "test_label", required=False)
    if (test_x is None) != (test_y is None):
        raise DataSourceError(f"data source {uri!r}: test_X and test_y must be given together.")
    test = None
    if test_x is not None and test_y is not None:
        if test_x.dtype.kind not in "fiu":
            raise DataSourceError(f"data source {uri!r}: test_X must be numeric. Found dtype {test_x.dtype}.")
        test = (test_x.astype(np.float32), _integer_array(uri, "test_y", test_y.reshape(-1)))
    return _build(uri, ids, features.astype(np.float32), labels, tasks, test, _image_shape(features.shape))


def _column(name: str) -> str:
    """A column's header name for an error message (the header is the file's schema, not a
    record; shortened all the same)."""
    return repr(name if len(name) <= 40 else name[:40] + "…")


def _load_csv(uri: str, content: bytes) -> LoadedData:
    """The records of a CSV file's ``content``. Errors name the line, the column and the rule,
    never a cell's value (a cell may hold anything: the finding echoed ``'sk_live_…'``)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataSourceError(
            f"data source {uri!r}: not UTF-8 text (an invalid byte at offset {exc.start})."
        ) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise DataSourceError(f"data source {uri!r}: the file is empty.")
        header = [h.strip() for h in header]
        for required in ("record_id", "label"):
            if required not in header:
                raise DataSourceError(f"data source {uri!r}: the header needs a {required!r} column.")
        if len(set(header)) != len(header):
            raise DataSourceError(f"data source {uri!r}: the header names a column twice.")
        col = {name: i for i, name in enumerate(header)}
        feature_cols = [i for i, h in enumerate(header) if h not in ("record_id", "label", "task", "split")]
        if not feature_cols:
            raise DataSourceError(f"data source {uri!r}: no feature columns.")
        ids: list[str] = []
        rows: list[list[float]] = []
        labels: list[int] = []
        tasks: list[int] = []
        test_rows: list[list[float]] = []
        test_labels: list[int] = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DataSourceError(
                    f"data source {uri!r}: line {line} has {len(row)} fields; the header has {len(header)}."
                )
            feats = [_cell(uri, row, i, header, line, float, "a number") for i in feature_cols]
            label = _cell(uri, row, col["label"], header, line, int, "an integer")
            task = _cell(uri, row, col["task"], header, line, int, "an integer") if "task" in col else 0
            split = row[col["split"]].strip() if "split" in col else "train"
            if split == "test":
                test_rows.append(feats)
                test_labels.append(label)
            elif split == "train":
                ids.append(row[col["record_id"]].strip())
                rows.append(feats)
                labels.append(label)
                tasks.append(task)
            else:
                raise DataSourceError(
                    f"data source {uri!r}: line {line}: column 'split' must be 'train' or 'test'."
                )
    except csv.Error:
        raise DataSourceError(
            f"data source {uri!r}: line {reader.line_num}: not well-formed CSV (csv.Error)."
        ) from None
    d = len(feature_cols)
    test = None
    if test_rows:
        test = (np.asarray(test_rows, dtype=np.float32), np.asarray(test_labels, dtype=np.int64))
    return _build(
        uri,
        ids,
        np.asarray(rows, dtype=np.float32).reshape(len(rows), d),
        np.asarray(labels, dtype=np.int64),
        np.asarray(tasks, dtype=np.int64),
        test,
        None,
    )


_Cell = TypeVar("_Cell", int, float)


def _cell(
    uri: str, row: Sequence[str], index: int, header: Sequence[str], line: int, kind: type[_Cell], what: str
) -> _Cell:
    try:
        return kind(row[index])
    except ValueError:
        raise DataSourceError(
            f"data source {uri!r}: line {line}: column {_column(header[index])} is not {what}."
        ) from None


def digits_split() -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The fixed (train, test) indices into scikit-learn's digits: stratified, seed-independent."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    labels = load_digits().target
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    test: list[int] = []
    per_class = DIGITS_TEST_SIZE // 10
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        test.extend(rng.choice(idx, size=per_class, replace=False).tolist())
    test_idx = np.sort(np.asarray(test, dtype=np.int64))
    train_idx = np.setdiff1d(np.arange(len(labels), dtype=np.int64), test_idx)
    return train_idx, test_idx


def _load_digits(
    uri: str, kind: str, n_tasks: int, seed: int, public: int = 0, public_classes: int = 0
) -> LoadedData:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    bunch = load_digits()
    images = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    ids = np.asarray([f"digits-{i:04d}" for i in range(len(labels))])
    train_idx, test_idx = digits_split()
    public_idx = np.zeros(0, dtype=np.int64)
    private_classes = np.arange(public_classes, 10)
    if public_classes:  # classes 0 … K−1 public (all, or ``public`` of them), never a task's
        pool = train_idx[labels[train_idx] < public_classes]
        if public:
            public_rng = np.random.default_rng((seed, PUBLIC_SPLIT_STREAM))
            public_idx = np.sort(public_rng.choice(pool, size=min(public, len(pool)), replace=False))
        else:
            public_idx = pool
        train_idx = train_idx[labels[train_idx] >= public_classes]
        test_idx = test_idx[labels[test_idx] >= public_classes]
    elif public:  # its own generator, so a source without ``public`` is unchanged
        public_rng = np.random.default_rng((seed, PUBLIC_SPLIT_STREAM))
        public_idx = np.sort(public_rng.choice(train_idx, size=public, replace=False))
        train_idx = np.setdiff1d(train_idx, public_idx)
    rng = np.random.default_rng(seed)

    def split(task: int, idx: npt.NDArray[np.int64], perm: npt.NDArray[np.int64] | None) -> TaskSplit:
        feats = images[idx] if perm is None else images[idx][:, perm]
        return TaskSplit(task, tuple(ids[idx].tolist()), np.ascontiguousarray(feats), labels[idx])

    train: tuple[TaskSplit, ...]
    test: tuple[TaskSplit, ...]
    if kind == "digits":
        train = (split(0, train_idx, None),)
        test = (split(0, test_idx, None),)
    elif kind == "permuted-digits":
        chunks = np.array_split(rng.permutation(train_idx), n_tasks)
        perms = [np.arange(64, dtype=np.int64)] + [rng.permutation(64) for _ in range(n_tasks - 1)]
        train = tuple(split(t, np.sort(chunks[t]), perms[t]) for t in range(n_tasks))
        test = tuple(split(t, test_idx, perms[t]) for t in range(n_tasks))
    else:  # split-digits
        groups = np.array_split(private_classes, n_tasks)
        train = tuple(split(t, train_idx[np.isin(labels[train_idx], g)], None) for t, g in enumerate(groups))
        test = tuple(split(t, test_idx[np.isin(labels[test_idx], g)], None) for t, g in enumerate(groups))
    for t in train:
        if len(t) == 0:
            raise DataSourceError(f"data source {uri!r}: task {t.task} holds no records; use fewer tasks.")
    return LoadedData(
        uri=uri,
        train=train,
        test=test,
        num_classes=10,
        n_features=64,
        image_shape=DIGITS_IMAGE_SHAPE,
        public=(split(0, public_idx, None),) if public or public_classes else (),
        preprocessing={
            "kind": "scale",
            "divide_by": 16,
            "input": "sklearn.datasets.load_digits().data: the 64 pixel values (0-16) of an 8x8 "
            "image, row-major",
            **(
                {"permuted": "task t's pixels permuted by a seeded permutation (task 0: none)"}
                if kind == "permuted-digits"
                else {}
            ),
        },
    )


# ---------------------------------------------------------------------------------------------
# builtin:stream (continual release)
# ---------------------------------------------------------------------------------------------

STREAM_TEST_SIZE: Final = 2_000
STREAM_WEIGHT_NORM: Final = 8.0
_STREAM_SEED: Final = 0x73747265  # "stre": the stream's own seed stream


def _stream_records(
    rng: np.random.Generator, theta: npt.NDArray[np.float64], n: int
) -> tuple[FloatArray, LabelArray]:
    """n records: one row of d + 1 draws each (direction, then the label's uniform), so record i
    is the same whatever n."""
    from scipy.special import expit, ndtr

    draws = rng.standard_normal((n, theta.size + 1))
    g = draws[:, :-1]
    x = g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-300)
    u = ndtr(draws[:, -1])  # Φ(z) of a standard normal: a uniform on (0, 1)
    y = (u < expit(x @ theta)).astype(np.int64)
    x32 = x.astype(np.float32)
    # float32 rounding must not push a norm above 1: shrink those rows by a hair.
    norms = np.linalg.norm(x32.astype(np.float64), axis=1, keepdims=True)
    x32 = np.where(norms > 1.0, x32 / np.float32(1.0 + 1e-6), x32)
    return np.ascontiguousarray(x32, dtype=np.float32), y


def _load_stream(uri: str, blocks: int, block_size: int, dim: int, seed: int) -> LoadedData:
    rng = np.random.default_rng((seed, _STREAM_SEED))
    theta = rng.standard_normal(dim)
    theta *= STREAM_WEIGHT_NORM / max(float(np.linalg.norm(theta)), 1e-300)
    test_x, test_y = _stream_records(np.random.default_rng((seed, _STREAM_SEED, 1)), theta, STREAM_TEST_SIZE)
    n = blocks * block_size
    x, y = _stream_records(np.random.default_rng((seed, _STREAM_SEED, 2)), theta, n)
    ids = tuple(f"stream-{i:07d}" for i in range(n))
    test_ids = tuple(f"stream-test-{i:05d}" for i in range(STREAM_TEST_SIZE))
    return LoadedData(
        uri=uri,
        train=(TaskSplit(0, ids, x, y),),
        test=(TaskSplit(0, test_ids, test_x, test_y),),
        num_classes=2,
        n_features=dim,
    )


# ---------------------------------------------------------------------------------------------
# builtin:permuted-synthetic-digits, builtin:split-synthetic-digits (generated at any size)
# ---------------------------------------------------------------------------------------------

SYNTHETIC_TEST_PER_TASK: Final = 1_000
_SYNTHETIC_SEED: Final = 0x73796E74  # "synt": the generator's own seed stream
_TEST_DRAW: Final = 1_000_001  # task index of the test draws' streams (no task has it)
_PUBLIC_DRAW: Final = 1_000_002


def synthetic_digit_images(
    templates: FloatArray, template_labels: LabelArray, n: int, rng: np.random.Generator
) -> tuple[FloatArray, LabelArray]:
    """n independent records: a uniformly drawn template (8×8, [0, 1]) under a random affine warp
    (bilinear, zero outside), a random contrast and Gaussian pixel noise, clipped to [0, 1]."""
    pick = rng.integers(0, len(templates), n)
    angle = rng.uniform(-np.pi / 18, np.pi / 18, n)
    scale = rng.uniform(0.9, 1.1, n)
    shift = rng.uniform(-0.6, 0.6, (n, 2))
    contrast = rng.uniform(0.75, 1.25, n)
    noise = rng.normal(0.0, 0.05, (n, 64))
    # Output pixel p (row, col) reads the template at A⁻¹(p − c) + c − shift, c the image centre.
    rows, cols = np.meshgrid(np.arange(8.0) - 3.5, np.arange(8.0) - 3.5, indexing="ij")
    cos, sin = np.cos(angle)[:, None] / scale[:, None], np.sin(angle)[:, None] / scale[:, None]
    src_r = cos * rows.ravel() - sin * cols.ravel() + 3.5 - shift[:, :1]
    src_c = sin * rows.ravel() + cos * cols.ravel() + 3.5 - shift[:, 1:]
    padded = np.zeros((n, 10, 10))  # one zero pixel around: bilinear reads outside as 0
    padded[:, 1:9, 1:9] = templates[pick].reshape(n, 8, 8)
    src_r = np.clip(src_r + 1.0, 0.0, 8.999)
    src_c = np.clip(src_c + 1.0, 0.0, 8.999)
    r0, c0 = np.floor(src_r).astype(np.int64), np.floor(src_c).astype(np.int64)
    fr, fc = src_r - r0, src_c - c0
    flat = padded.reshape(n, 100)

    def at(r: npt.NDArray[np.int64], c: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        return np.take_along_axis(flat, r * 10 + c, axis=1)

    warped = (
        at(r0, c0) * (1 - fr) * (1 - fc)
        + at(r0, c0 + 1) * (1 - fr) * fc
        + at(r0 + 1, c0) * fr * (1 - fc)
        + at(r0 + 1, c0 + 1) * fr * fc
    )
    images = np.clip(warped * contrast[:, None] + noise, 0.0, 1.0).astype(np.float32)
    return np.ascontiguousarray(images), template_labels[pick].astype(np.int64)


def _load_synthetic_digits(
    uri: str, kind: str, n_tasks: int, per_task: int, seed: int, public: int
) -> LoadedData:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped,unused-ignore]

    bunch = load_digits()
    images = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = digits_split()  # held-out writers' templates for the test draws
    split = kind == "split-synthetic-digits"
    groups = np.array_split(np.arange(10), n_tasks) if split else [np.arange(10)] * n_tasks

    def draw(
        idx: npt.NDArray[np.int64], classes: npt.NDArray[np.int64], n: int, task: int
    ) -> tuple[FloatArray, LabelArray]:
        chosen = idx[np.isin(labels[idx], classes)]
        rng = np.random.default_rng((seed, _SYNTHETIC_SEED, int(split), task))
        return synthetic_digit_images(images[chosen], labels[chosen], n, rng)

    permutations = [np.arange(64, dtype=np.int64)] + [
        np.random.default_rng((seed, _SYNTHETIC_SEED, 2, t)).permutation(64) for t in range(1, n_tasks)
    ]
    train, test = [], []
    shared_test = None if split else draw(test_idx, np.arange(10), SYNTHETIC_TEST_PER_TASK, _TEST_DRAW)
    for t in range(n_tasks):
        x, y = draw(train_idx, groups[t], per_task, t)
        tx, ty = (
            shared_test
            if shared_test is not None
            else draw(test_idx, groups[t], SYNTHETIC_TEST_PER_TASK, _TEST_DRAW + 10 + t)
        )
        perm = permutations[t] if not split else permutations[0]
        ids = tuple(f"sdigits-{t:03d}-{i:06d}" for i in range(per_task))
        train.append(TaskSplit(t, ids, np.ascontiguousarray(x[:, perm]), y))
        test_ids = tuple(f"sdigits-test-{t:03d}-{i:06d}" for i in range(len(ty)))
        test.append(TaskSplit(t, test_ids, np.ascontiguousarray(tx[:, perm]), ty))
    public_splits: tuple[TaskSplit, ...] = ()
    if public:
        px, py = draw(train_idx, np.arange(10), public, _PUBLIC_DRAW)
        public_splits = (TaskSplit(0, tuple(f"sdigits-public-{i:06d}" for i in range(public)), px, py),)
    return LoadedData(
        uri=uri,
        train=tuple(train),
        test=tuple(test),
        num_classes=10,
        n_features=64,
        image_shape=DIGITS_IMAGE_SHAPE,
        public=public_splits,
    )


# ---------------------------------------------------------------------------------------------
# Registering a source's records with a ledger
# ---------------------------------------------------------------------------------------------


def register_source(
    client: LedgerClient,
    dataset_id: str | int,
    *,
    source: str | None = None,
    batch_size: int | None = None,
    roots: TenantRoots | None = None,
) -> list[dict[str, object]]:
    """Register the training records of a data source as the dataset's tasks and batches,
    through ``client`` (an admin's ``LedgerClient``): one task per task of the source
    (``task-0``, ``task-1``, ...), its records in source order cut into batches of ``batch_size``
    (default: one batch per task), named ``task-<t>/batch-<i>``. Answers ``[{id, name, batches:
    [{id, name, size}]}]``.

    ``source``: the URI (default: the dataset's ``data_source``), read *here*, by this process:
    ``builtin:`` sources need numpy and scikit-learn, a ``file://`` source the ``roots`` it lies
    under. The record ids of the built-in sources are public (``digits-0000`` ...
    ``digits-1796``, ``stream-0000000`` ...; ``service.contract.data_sources``); a job's run reserves on every
    batch and checks that the source's training records are exactly the batches' records.
    Idempotency keys are derived from the dataset, the source and the task, so running it again
    after a failure creates nothing twice. Here, not on ``LedgerClient``: it reads the data, and
    the client imports no training code."""
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1. Found {batch_size!r}.")
    uri = source if source is not None else client.get_dataset(dataset_id).get("data_source")
    if not uri:
        raise ValueError(f"dataset {dataset_id!r} has no data_source; pass source=.")
    data = load_data(str(uri), roots)
    run = hashlib.sha256(f"{dataset_id}\n{uri}".encode()).hexdigest()[:24]
    out: list[dict[str, object]] = []
    for split in data.train:
        if not len(split):
            continue
        records = list(split.record_ids)
        size = batch_size or len(records)
        name = f"task-{split.task}"
        task = client.create_task(dataset_id, name, idempotency_key=f"register:{run}:{name}")
        batches = [
            {"name": f"{name}/batch-{i // size:04d}", "records": records[i : i + size]}
            for i in range(0, len(records), size)
        ]
        created = client.create_batches(
            dataset_id, task["id"], batches, idempotency_key=f"register:{run}:{name}:batches"
        )
        out.append({"id": task["id"], "name": name, "batches": created["data"]})
    return out
